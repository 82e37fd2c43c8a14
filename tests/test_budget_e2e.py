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
import torch

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
        controller = runner.ddtree.budget
        if controller is not None:
            stats["skipped"] = controller.num_skipped_steps
            stats["histogram"] = controller.chosen_histogram.tolist()
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def auto(drafter):
    # The drafter's trees alone: these tests read which drafter nodes the
    # budget keeps (lookup drafts under the auto budget: test_e2e_lookup.py).
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET,
            "ddtree_budget": "auto", "ddtree_lookup": "off"}


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
        # 0 nodes only on context-only steps (6 requests each at most).
        histogram = stats["histogram"]
        assert histogram[BLOCK_SIZE - 1] == sum(histogram[1:]) > 0, stats
        assert histogram[0] <= 6 * stats["skipped"], stats
        assert stats["accepted_tokens"] > 0.8 * stats["draft_tokens"], stats


def test_forced_drafter_skips_stay_exact(pairs, plain, monkeypatch):
    """Context-only drafter passes, then drafting again, on the partly-accepting
    pair: output unchanged, and drafts after the skips are still accepted."""
    calls = {"n": 0}

    def draft_next(self, num_reqs, **kwargs):
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


def test_shallow_trees_draft_a_shorter_block(pairs, plain, monkeypatch):
    """A pass at draft depth d < L lays out the bonus and d mask queries per
    request (the drafter's forward and LM head shrink with the trees), its
    trees are at most d deep, and the output stays exact (the noisy oracle
    pair: most drafts accepted, some rejected)."""
    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

    calls, passes = {"n": 0}, []
    draft_next = budget_control.BudgetController.draft_next

    def alternating_depth(self, num_reqs, **kwargs):
        drafting = draft_next(self, num_reqs, **kwargs)
        calls["n"] += 1
        self.draft_depth = 1 + calls["n"] % (BLOCK_SIZE - 1)  # 1 .. L - 1, then L
        return drafting

    propose = DDTreeProposer.propose

    def recording_propose(self, num_speculative_tokens, **kwargs):
        out = propose(self, num_speculative_tokens, **kwargs)
        # DFlash keeps the K it was asked for: its block is 1 + K queries.
        passes.append((self.draft_depth, self.num_speculative_tokens,
                       int(self.last_tree.depths.max())))
        return out

    monkeypatch.setattr(budget_control.BudgetController, "draft_next", alternating_depth)
    monkeypatch.setattr(DDTreeProposer, "propose", recording_propose)
    target, drafter = pairs["noisy"]
    out, stats = generate(target, auto(drafter))
    assert out == plain["noisy"]
    assert {d for d, _, _ in passes} >= {1, 2, BLOCK_SIZE - 1}, passes
    assert all(k == d and deepest <= d for d, k, deepest in passes), passes
    assert stats["accepted_tokens"] > 0, stats


def test_skipped_drafter_steps_keep_its_context_complete(pairs, monkeypatch):
    """A drafter step skipped (context K/V written, at once or deferred and
    batched, no forward) leaves every later draft what it is without skips: the
    draft logits at the same committed length of the same request are equal
    (to float rounding: batched projections round differently), on the random
    pair, whose drafter attends over its context K/V (a hole in it changes the
    logits by far more)."""
    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer
    from vllm_ddtree.vllm_adapter.runner import DDTreeVerifier

    target, drafter = pairs["random"]
    propose = DDTreeProposer.propose
    sample = DDTreeProposer._sample_draft_tokens
    before_propose = DDTreeVerifier.before_propose
    batch = {}

    def recording_before_propose(self, *args, **kwargs):
        batch["req_ids"] = list(self.runner.input_batch.req_ids)
        return before_propose(self, *args, **kwargs)

    def run(skip):
        logits = {}
        calls = {"n": 0}

        def draft_next(self, num_reqs, **kwargs):
            calls["n"] += 1
            if skip(calls["n"]):
                self.num_skipped_steps += 1
                return False
            return True

        def recording_propose(self, num_speculative_tokens, **kwargs):
            cad = kwargs["common_attn_metadata"]
            num_reqs = kwargs["next_token_ids"].shape[0]
            lens = cad.seq_lens[:num_reqs]
            rejected = kwargs.get("num_rejected_tokens_gpu")
            if rejected is not None:
                lens = lens - rejected[:num_reqs]
            # vLLM request ids: "<counter>-<random suffix>".
            batch["keys"] = [(r.split("-")[0], n) for r, n in
                             zip(batch["req_ids"], lens.tolist())]
            return propose(self, num_speculative_tokens, **kwargs)

        def recording_sample(self, hidden_states, sampling_metadata):
            out = sample(self, hidden_states, sampling_metadata)
            rows = self._draft_logits.view(len(batch["keys"]), self.draft_depth, -1)
            for key, row in zip(batch["keys"], rows):
                logits[key] = row.clone()
            return out

        with monkeypatch.context() as m:
            m.setattr(budget_control.BudgetController, "draft_next", draft_next)
            m.setattr(DDTreeProposer, "propose", recording_propose)
            m.setattr(DDTreeProposer, "_sample_draft_tokens", recording_sample)
            m.setattr(DDTreeVerifier, "before_propose", recording_before_propose)
            out, stats = generate(target, auto(drafter))
        return out, stats, logits

    out_all, _, all_logits = run(lambda n: False)
    # Skips of one step and of runs of steps, then drafting again.
    out_skip, stats, skip_logits = run(lambda n: n % 3 == 0 or 10 <= n <= 14)
    assert out_skip == out_all
    assert stats["skipped"] >= 10, stats
    common = sorted(set(all_logits) & set(skip_logits))
    assert len(common) >= 20, (len(common), len(skip_logits))
    for key in common:
        torch.testing.assert_close(skip_logits[key], all_logits[key], rtol=0, atol=1e-3)


def test_drafter_cost_samples_leave_out_context_flushes(pairs, monkeypatch):
    """The first drafting pass after context-only steps also writes their queued
    context K/V; that write is not a cost of drafting, so the full-pass samples
    the budget learns from leave it out. Each flush is slowed by 0.2 s here (far
    more than a tiny pass), so a sample that counted one would show it."""
    import time

    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

    delay = 0.2
    flushes = {"slowed": 0}
    samples = []
    calls = {"n": 0}
    flush = DDTreeProposer.flush_context
    record = budget_control.BudgetController.record_drafter

    def slow_flush(self):
        store = self.model.precompute_and_store_context_kv

        def slowed(*args, **kwargs):
            flushes["slowed"] += 1
            time.sleep(delay)
            return store(*args, **kwargs)

        self.model.precompute_and_store_context_kv = slowed
        try:
            flush(self)
        finally:
            del self.model.precompute_and_store_context_kv

    def recording(self, full, num_reqs, seconds, depth=None):
        samples.append((full, seconds))
        return record(self, full, num_reqs, seconds, depth)

    def draft_next(self, num_reqs, **kwargs):
        calls["n"] += 1
        if calls["n"] % 4 in (1, 2):  # runs of two context-only steps
            self.num_skipped_steps += 1
            return False
        return True

    monkeypatch.setattr(DDTreeProposer, "flush_context", slow_flush)
    monkeypatch.setattr(budget_control.BudgetController, "record_drafter", recording)
    monkeypatch.setattr(budget_control.BudgetController, "draft_next", draft_next)
    target, drafter = pairs["noisy"]
    generate(target, auto(drafter))
    # Every flush precedes a full pass; a few first passes are slow anyway
    # (first calls of each shape), so the check is on how many reach the delay.
    full = [s for f, s in samples if f]
    slow = [s for s in full if s >= delay]
    assert flushes["slowed"] >= 6 and len(full) >= 12, (flushes, len(full))
    assert len(slow) <= flushes["slowed"] // 3, (flushes, samples)


def test_budget_key_is_validated():
    from vllm_ddtree.vllm_adapter.plugin_hooks import pop_ddtree_config

    spec = {"method": "ddtree", "model": "x", "num_speculative_tokens": 4,
            "ddtree_budget": "dynamic"}
    with pytest.raises(ValueError, match="ddtree_budget"):
        pop_ddtree_config(spec)
    spec = {"method": "ddtree", "model": "x", "num_speculative_tokens": 4,
            "ddtree_budget": "auto"}
    assert pop_ddtree_config(spec).budget_mode == "auto"
