# SPDX-License-Identifier: Apache-2.0
"""``ddtree_budget="auto"`` inside vLLM 0.32 on CPU (tiny models, in-process).

* greedy output is token-identical to no speculation: when the controller trims
  trees (a mostly-repeating target whose drafts are often right), when it stops
  drafting (a random drafter: nothing is ever accepted), and across forced
  drafter skips and resumptions;
* a perfect drafter keeps exactly its full-depth chain per request (the tree's
  other nodes have draft probability ~0).

Which budgets the controller picks depends on this machine's timings; the
policy itself is tested on synthetic costs in test_budget.py.
"""

import gc
import random

import pytest

from vllm_ddtree import tiny_models
from vllm_ddtree.vllm_adapter import budget_control

vllm = pytest.importorskip("vllm")

BLOCK_SIZE = 5  # L = 4
BUDGET = 8
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, vllm_patched):
    root = tmp_path_factory.mktemp("budget")
    out = {}
    for name, kw in (("random", dict(kind="random")),
                     ("oracle", dict(kind="oracle")),
                     ("noisy", dict(kind="oracle", target_oracle_noise=8.0))):
        out[name] = tiny_models.make_pair(root, seed=1, drafter_block_size=BLOCK_SIZE,
                                          name=name, **kw)
    return out


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(2, 24))] for _ in range(n)]


def generate(target, spec=None):
    llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512,
                   seed=0, disable_log_stats=False, speculative_config=spec)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    stats = {k: metrics.get(f"vllm:spec_decode_num_{k}", 0) or 0
             for k in ("drafts", "draft_tokens", "accepted_tokens")}
    controller = None
    if spec is not None:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        controller = runner._ddtree_budget
        if controller is not None:
            stats["skipped"] = controller.num_skipped_steps
            stats["histogram"] = controller.chosen_histogram.tolist()
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def auto(drafter):
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET,
            "ddtree_budget": "auto"}


@pytest.fixture(scope="module")
def plain(pairs):
    return {name: generate(target)[0] for name, (target, _) in pairs.items()}


@pytest.mark.parametrize("name", ["random", "oracle", "noisy"])
def test_auto_greedy_equals_plain(pairs, plain, name):
    target, drafter = pairs[name]
    out, stats = generate(target, auto(drafter))
    print(name, stats)
    assert out == plain[name]
    # A context-only drafter pass was timed (what skipping would save).
    assert stats["skipped"] >= 1, stats
    if name == "oracle":
        # Only the depth-L chain has draft probability (the other nodes' is
        # ~1e-30): after the start-up profile that chain is what is kept, and
        # all of it is accepted.
        histogram = stats["histogram"]
        assert histogram[BLOCK_SIZE - 1] == sum(histogram) > 0, stats
        assert stats["accepted_tokens"] > 0.8 * stats["draft_tokens"], stats


def test_forced_drafter_skips_stay_exact(pairs, plain, monkeypatch):
    """Context-only drafter passes, then drafting again, on the partly-accepting
    pair: output unchanged, and drafts after the skips are still accepted."""
    calls = {"n": 0}

    def draft_next(self):
        calls["n"] += 1
        if 3 <= calls["n"] <= 8 or calls["n"] % 5 == 0:
            self.num_skipped_steps += 1
            return False
        return True

    monkeypatch.setattr(budget_control.BudgetController, "draft_next", draft_next)
    target, drafter = pairs["noisy"]
    out, stats = generate(target, auto(drafter))
    print("forced skips", stats)
    assert out == plain["noisy"]
    assert stats["skipped"] >= 6, stats
    assert stats["accepted_tokens"] > 0, stats


def test_budget_key_is_validated():
    from vllm_ddtree.vllm_adapter.config import pop_ddtree_config

    spec = {"method": "ddtree", "model": "x", "num_speculative_tokens": 4,
            "ddtree_budget": "dynamic"}
    with pytest.raises(ValueError, match="ddtree_budget"):
        pop_ddtree_config(spec)
    spec = {"method": "ddtree", "model": "x", "num_speculative_tokens": 4,
            "ddtree_budget": "auto"}
    assert pop_ddtree_config(spec).budget_mode == "auto"
