# SPDX-License-Identifier: Apache-2.0
"""ddtree under real serving conditions on CPU: Llama targets, other draft block
sizes, prefix-cache hits, chunked prefill with truncated trees, preemption, and
requests that finish inside an accepted path (stop tokens, stop strings,
max_tokens). Greedy output must equal non-speculative greedy output exactly."""

import random

import pytest

from vllm_ddtree import tiny_models

vllm = pytest.importorskip("vllm")


def make_pair(root, kind, arch="qwen3", block_size=5, **target_kw):
    target = tiny_models.make_target(root / f"{arch}_{kind}_target", arch=arch, kind=kind,
                                     seed=3, **target_kw)
    drafter = tiny_models.make_dflash_drafter(
        root / f"{arch}_{kind}_drafter_b{block_size}", target, kind=kind,
        block_size=block_size, seed=4,
    )
    return str(target), str(drafter)


def run(target, prompts, params, spec=None, **kw):
    """(outputs, metrics) of one engine; outputs are (token_ids, text) per prompt."""
    llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True,
                   max_model_len=kw.pop("max_model_len", 1024), disable_log_stats=False,
                   speculative_config=spec, seed=0, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    del llm
    return result, metrics


def ddtree(drafter, budget):
    # "fixed": every step verifies a full tree (the auto default may skip drafts).
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget,
            "ddtree_budget": "fixed"}


def random_prompts(n, lo=2, hi=40, seed=0, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(250) for _ in range(rng.randrange(lo, hi))]
            for _ in range(n)]


GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory, vllm_patched):
    return tmp_path_factory.mktemp("batching")


@pytest.mark.parametrize("arch,block_size", [("llama", 4), ("llama", 9), ("qwen3", 9)])
def test_targets_and_block_sizes(root, arch, block_size):
    """Llama and Qwen3 targets, drafters with K = 3 and K = 8 drafted positions."""
    for kind in ("random", "oracle"):
        target, drafter = make_pair(root, kind, arch, block_size)
        prompts = random_prompts(4, seed=block_size)
        params = vllm.SamplingParams(**GREEDY)
        ref, _ = run(target, prompts, params)
        out, m = run(target, prompts, params, ddtree(drafter, 16))
        assert out == ref
        if kind == "oracle":
            tau = 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"]
            assert tau >= 0.9 * block_size, (tau, m)


def test_prefix_cache_hits_and_chunked_prefill(root):
    """Shared 300-token prefixes (cache hits on the second pass) and a token budget
    of 64 that chunks prefills and truncates trees (8 requests x (1 + 16) > 64)."""
    target, drafter = make_pair(root, "random")
    prompts = random_prompts(8, lo=5, hi=30, seed=7, prefix=random_prompts(1, 300, 301)[0])
    params = vllm.SamplingParams(**GREEDY)
    ref, _ = run(target, prompts, params)
    llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024,
                   disable_log_stats=False, speculative_config=ddtree(drafter, 16),
                   max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=True,
                   seed=0)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs] == ref
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    del llm
    assert metrics.get("vllm:prefix_cache_hits", 0) > 0, metrics
    assert metrics["vllm:spec_decode_num_drafts"] > 0


def test_preemption(root):
    """A KV cache too small for the batch forces preemption and recomputation."""
    target, drafter = make_pair(root, "oracle", block_size=5, oracle_noise=8.0)
    prompts = random_prompts(8, lo=100, hi=160, seed=11)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kw = dict(num_gpu_blocks_override=10, block_size=32, max_model_len=256)
    ref, _ = run(target, prompts, params, **kw)
    out, m = run(target, prompts, params, ddtree(drafter, 16), **kw)
    assert out == ref
    assert m.get("vllm:num_preemptions", 0) > 0, m
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


def test_finish_inside_an_accepted_path(root):
    """Stop tokens, stop strings and max_tokens end generation exactly where
    non-speculative decoding ends it, even when a path accepts past that point."""
    target, drafter = make_pair(root, "oracle", block_size=9, oracle_noise=8.0)
    prompts = random_prompts(6, seed=5)
    base = vllm.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref, _ = run(target, prompts, base)
    # A token and a 2-character text from the middle of each reference output.
    stop_tok = ref[0][0][17]
    stop_str = ref[1][1][20:22]
    cases = [
        vllm.SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        vllm.SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_tok]),
        vllm.SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_str]),
    ]
    for params in cases:
        want, _ = run(target, prompts, params)
        got, m = run(target, prompts, params, ddtree(drafter, 24))
        assert got == want, params
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0
        if params.max_tokens == 7:
            assert all(len(tokens) == 7 for tokens, _ in got)


BLOCK = 32


def test_second_turn_reuses_blocks_written_by_commits(root, monkeypatch):
    """Turn 2's prompt = turn 1's prompt + answer: the prefix cache serves the
    KV blocks ddtree wrote while decoding, including K/V that commits moved from a
    sibling's slot across a block boundary. Equal to no speculation. (32-token
    blocks: the smallest vLLM's CPU attention takes.)"""
    from vllm_ddtree.vllm_adapter import runner as runner_module

    target, drafter = make_pair(root, "oracle", block_size=5, oracle_noise=12.0)
    first = random_prompts(6, lo=20, hi=40, seed=21)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kw = dict(block_size=BLOCK, enable_prefix_caching=True, max_model_len=512)
    ref1, _ = run(target, first, params, **kw)
    second = [p + out + [7, 8] for p, (out, _) in zip(first, ref1)]
    ref2, _ = run(target, second, params, **kw)

    crossings = []
    orig_sample = runner_module.DDTreeVerifier.sample

    def sample_and_record(self, logits, spec_decode_metadata):
        out = orig_sample(self, logits, spec_decode_metadata)
        plan = self._plan
        if plan is not None:
            moved = plan.moved()
            linear = self._linear_positions
            src = linear[plan.src_rows[moved]] // BLOCK
            dst = linear[plan.dst_rows[moved]] // BLOCK
            crossings.append(int((src != dst).sum()))
        return out

    monkeypatch.setattr(runner_module.DDTreeVerifier, "sample", sample_and_record)
    llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True,
                   disable_log_stats=False, speculative_config=ddtree(drafter, 16),
                   seed=0, **kw)
    got1 = llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
    hits = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    got2 = llm.generate([{"prompt_token_ids": p} for p in second], params, use_tqdm=False)
    after = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    del llm
    assert [list(o.outputs[0].token_ids) for o in got1] == [t for t, _ in ref1]
    assert [list(o.outputs[0].token_ids) for o in got2] == [t for t, _ in ref2]
    # Turn 2 hit the cache for (about) every full block of turn 1's sequences.
    reused = after["vllm:prefix_cache_hits"] - hits["vllm:prefix_cache_hits"]
    full_blocks = sum((len(p) - 2) // BLOCK * BLOCK for p in second)
    assert reused >= full_blocks - BLOCK * len(second), (reused, full_blocks)
    assert sum(crossings) > 0, "no committed K/V moved across a block boundary"
