# SPDX-License-Identifier: Apache-2.0
"""The offline replay of vLLM's drafting steps (issue 47's evaluation that predicts vLLM).

A noisy oracle pair (the target mostly repeats its last token, the drafter drafts
repeats: partial acceptance) runs through vLLM's ``"dflash"`` chain; the offline
replay at the anchors vLLM drafted from must reproduce vLLM's accepted count at
every step (fp32 both sides). Fails if the anchors drift (a step's bonus position
misplaced), if the offline block sees the wrong context, or if vLLM's counts are
misread.
"""

import pytest

from vllm_ddtree import tiny_models

vllm = pytest.importorskip("vllm")


def test_replay_reproduces_vllm_step_by_step(tmp_path, vllm_patched):
    from vllm_ddtree.drafter import replay

    target, drafter = tiny_models.make_pair(tmp_path, "oracle", drafter_block_size=6,
                                            target_oracle_noise=8.0, seed=3)
    prompts = [[5, 17, 99, 3, 250, 42, 7, 7, 128], [64, 33, 12, 12, 90, 31]]
    report = replay.replay(target, drafter, prompts, max_new_tokens=40)
    accepted = [a for run in report["runs"] for a in run["accepted"]]
    # Partial acceptance: full blocks, empty ones and some in between.
    assert min(accepted) == 0 and max(accepted) == 5 and len(set(accepted)) >= 3, accepted
    assert report["steps"] >= 8
    assert report["steps_equal"] == report["steps"], report["runs"]
    assert report["relative_gap"] == 0.0
