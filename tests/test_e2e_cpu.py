# SPDX-License-Identifier: Apache-2.0
"""ddtree inside vLLM 0.32 on CPU: lossless greedy generation, non-vacuous trees.

Tiny models are written at test time
(vllm_ddtree.tiny_models). The engine runs in-process (see conftest.py).
Three drafter regimes:

* random drafter: almost nothing is accepted; output must still be identical;
* oracle pair: the target repeats its last token and the drafter predicts it,
  every draft is accepted (mean acceptance length L + 1);
* scripted siblings: a random target, and draft logits that put the target's true
  continuation at rank 1 (never rank 0) at every depth. A chain verifier accepts
  nothing; the tree accepts full depth through sibling nodes, so the accepted
  K/V must be moved (a wrong commit changes the random target's output).
"""

import random

import pytest

from vllm_ddtree import tiny_models
from vllm_ddtree.ops import cpu_ext
from vllm_ddtree.vllm_adapter import plugin_cpu_attention
from vllm_ddtree.vllm_adapter import runner as runner_module
from vllm_ddtree.vllm_adapter.draft_trees import record_of
from vllm_ddtree.vllm_adapter.drafter_weights import int8_supported

vllm = pytest.importorskip("vllm")

BLOCK_SIZE = 5  # drafter block: L = 4 drafted positions
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_patched):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for kind in ("random", "oracle"):
        target = tiny_models.make_target(root / f"{kind}_target", kind=kind, seed=1)
        drafter = tiny_models.make_dflash_drafter(
            root / f"{kind}_drafter", target, kind=kind, block_size=BLOCK_SIZE, seed=2
        )
        out[kind] = (str(target), str(drafter))
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def generate(
    target,
    prompt_ids,
    speculative_config=None,
    max_model_len=512,
    dtype="float32",
    logit_bias=None,
    **kw,
):
    llm = vllm.LLM(
        model=target,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_model_len,
        disable_log_stats=False,
        speculative_config=speculative_config,
        seed=0,
        **kw,
    )
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=logit_bias
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
    )
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    runner = None
    if speculative_config is not None:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
    stats = {
        "drafts": metrics.get("vllm:spec_decode_num_drafts", 0),
        "draft_tokens": metrics.get("vllm:spec_decode_num_draft_tokens", 0),
        "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens", 0),
        "branch_paths": int(runner.ddtree.num_branch_paths)
        if runner is not None
        else 0,
        "chain_fallbacks": runner.ddtree.num_chain_fallbacks
        if runner is not None
        else 0,
        "attention_trees": runner.ddtree.num_attention_trees
        if runner is not None
        else 0,
        # The drafter's query rows per request (its buffers) and its block.
        "drafter_rows": runner.drafter.max_query_tokens // runner.drafter.max_batch_size
        if runner is not None
        else 0,
        "draft_len": runner.drafter.draft_len if runner is not None else 0,
        # Layers on vLLM's int8 GEMM (ddtree_drafter_quantization): the
        # drafter's, the target's.
        "int8_layers": int8_layers(runner) if runner is not None else (0, 0, 0),
    }
    del llm
    return tokens, stats


def int8_layers(runner) -> tuple[int, int, int]:
    """Layers on vLLM's int8 GEMM: the drafter's, the target's; and the
    drafter's own linear layers and LM head (not shared with the target)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    def swapped(model):
        return sum(hasattr(m, "ddtree_int8_kernel") for m in model.modules())

    target = {id(m) for m in runner.model.modules()}
    own = sum(
        isinstance(m, (LinearBase, ParallelLMHead)) and id(m) not in target
        for m in runner.drafter.model.modules()
    )
    return swapped(runner.drafter.model), swapped(runner.model), own


def ddtree(drafter, budget):
    # "fixed": these tests count tree mechanics (B nodes every step); the auto
    # budget, the default, has its own tests (test_budget_e2e.py). The
    # drafter's trees alone: lookup drafts (test_e2e_lookup.py) change which
    # nodes a tree holds and how deep it goes.
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget,
            "ddtree_budget": "fixed", "ddtree_lookup": "off"}


@pytest.fixture(scope="module")
def reference(models):
    """Plain greedy outputs (no speculation) of both targets."""
    p = prompts(8)
    return p, {kind: generate(models[kind][0], p)[0] for kind in models}


@pytest.mark.parametrize(
    "budget,batch,quantization",
    [(1, 8, "auto"), (4, 1, "none"), (16, 8, "auto"), (64, 8, "auto")],
)
def test_random_drafter_is_lossless(models, reference, budget, batch, quantization):
    p, ref = reference
    spec = ddtree(models["random"][1], budget)
    spec["ddtree_drafter_quantization"] = quantization
    out, stats = generate(models["random"][0], p[:batch], spec)
    assert out == ref["random"][:batch]
    assert stats["drafts"] > 0
    # "auto": the drafter's own linear layers (and LM head, where it has one)
    # in int8 where vLLM's CPU int8 GEMM runs, never the target's.
    drafter, target, own = stats["int8_layers"]
    int8 = quantization == "auto" and int8_supported()[0]
    assert own > 0 and target == 0, stats
    assert drafter == (own if int8 else 0), stats


def test_oracle_pair_accepts_everything(models, reference):
    p, ref = reference
    # The drafter in int8 where it runs ("auto"): its drafts are still right.
    out, stats = generate(models["oracle"][0], p, ddtree(models["oracle"][1], 16))
    print("oracle pair:", stats)
    assert out == ref["oracle"]
    mean_acceptance = 1 + stats["accepted"] / stats["drafts"]
    assert mean_acceptance >= 0.9 * BLOCK_SIZE, stats


def test_large_budget_needs_room_for_the_block_only(models, reference):
    """A budget B needs B + draft_len + 2 free positions under max_model_len, not
    the 2B + 2 vLLM reserves for a DFlash chain of B drafts (which blanks every
    draft of the batch: the oracle pair would then accept nothing)."""
    p, ref = reference
    budget = 64
    longest = max(len(x) for x in p) + MAX_TOKENS
    max_model_len = longest + budget + (BLOCK_SIZE - 1) + 8
    # vLLM's chain rule would refuse drafts long before the end of generation.
    assert longest + 2 * budget + 2 > max_model_len + MAX_TOKENS
    out, stats = generate(
        models["oracle"][0],
        p,
        ddtree(models["oracle"][1], budget),
        max_model_len=max_model_len,
    )
    assert out == ref["oracle"]
    # Oracle drafts are right along the whole block: L of every L + 1 tokens.
    emitted = len(p) * MAX_TOKENS
    assert stats["accepted"] >= 0.6 * emitted, stats
    # The drafter's buffers and warm-up hold its block (L + 1 rows per request),
    # not the B + 1 rows of the target's verify step.
    assert stats["draft_len"] < budget, stats
    assert stats["drafter_rows"] == stats["draft_len"] + 1, stats


@pytest.mark.parametrize("max_children,budget", [(None, 30), (1, 30), (2, 40)])
def test_siblings_are_accepted_and_committed(
    models, reference, scripted_drafter, truth_at_rank_1, max_children, budget
):
    """True continuation at rank 1 of every depth: only a tree can accept it.

    ``ddtree_max_children=1`` verifies the argmax chain: it must accept nothing.
    With 2 children per node a tree has 2 + 4 + 8 + 16 = 30 real nodes, fewer than
    B = 40: only the real nodes are verified, as the stored tree (a padded draft
    would fall back to a chain and accept nothing).
    """
    p, ref = reference
    target, drafter = models["random"]
    scripted_drafter(truth_at_rank_1(
        {tuple(q): q + r for q, r in zip(p, ref["random"], strict=True)}
    ))
    # B = 30 holds the whole binary tree of depth 4 (2 + 4 + 8 + 16 nodes).
    spec = ddtree(drafter, budget)
    if max_children is not None:
        spec["ddtree_max_children"] = max_children
    compiled_before = plugin_cpu_attention.compiled_calls()
    out, stats = generate(target, p, spec)
    assert out == ref["random"]
    print("scripted siblings:", max_children, stats)
    mean_acceptance = 1 + stats["accepted"] / stats["drafts"]
    assert stats["chain_fallbacks"] == 0, stats
    real_nodes = {None: 30, 1: BLOCK_SIZE - 1, 2: 30}[max_children]
    # Every draft is a whole tree of real nodes (a few are cut by max_tokens).
    assert stats["draft_tokens"] <= real_nodes * stats["drafts"], stats
    assert stats["draft_tokens"] >= 0.9 * real_nodes * stats["drafts"], stats
    if max_children == 1:
        assert stats["branch_paths"] == 0 and stats["accepted"] == 0, stats
        # Chains attend as the stock causal kernel computes them.
        assert stats["attention_trees"] == 0, stats
    else:
        assert stats["branch_paths"] > 0, stats
        assert stats["attention_trees"] >= stats["drafts"], stats
        assert mean_acceptance >= 0.8 * BLOCK_SIZE, stats
        # Plugin only: the trees were attended by the compiled op
        # (csrc/cpu/tree_attention.cpp) where the extension has it, and the
        # random target's output, which depends on every attended key, is
        # still the plain greedy one.
        if cpu_ext.tree_attention_available():
            assert plugin_cpu_attention.compiled_calls() > compiled_before


@pytest.mark.parametrize(
    "extra,match",
    [
        # (plugin message | vLLM's own, with ddtree in-tree)
        ({"ddtree_bogus": 1}, "unknown ddtree key|ddtree_bogus"),
        ({"num_speculative_tokens": 0}, "must be an integer >= 1|num_speculative_tokens"),
        ({"ddtree_verify": "leviathan"}, "ddtree_verify"),
        ({"ddtree_threshold_acc": 0.0}, "ddtree_threshold_acc"),
        ({"ddtree_max_children": 0}, "ddtree_max_children"),
        ({"ddtree_drafter_quantization": "fp4"}, "ddtree_drafter_quantization"),
        ({"model": None}, 'needs "model"|without speculative model'),
    ],
)
def test_bad_config_fails_at_startup(models, extra, match):
    spec = ddtree(models["random"][1], 8)
    spec.update(extra)
    if spec.get("model") is None:
        spec.pop("model")
    with pytest.raises(ValueError, match=match):
        vllm.LLM(
            model=models["random"][0],
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            speculative_config=spec,
        )


def test_abort_mid_generation_frees_everything(models, reference):
    """An aborted request leaves no KV blocks and no tree state behind."""
    p, ref = reference
    target, drafter = models["oracle"]
    llm = vllm.LLM(
        model=target,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        speculative_config=ddtree(drafter, 16),
        seed=0,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    long = vllm.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("abort-me", {"prompt_token_ids": p[0]}, long)
    for _ in range(4):
        engine.step()
    # The scheduler keeps the request's tree on its Request; the worker keeps
    # none across steps.
    (aborted,) = [r for i, r in core.scheduler.requests.items() if "abort-me" in i]
    assert record_of(aborted) is not None
    assert len(runner.ddtree.proposed) == 0
    engine.abort_request(["abort-me"])
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    outs = llm.generate(
        [{"prompt_token_ids": q} for q in p[1:3]], params, use_tqdm=False
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == ref["oracle"][1:3]
    assert not any("abort-me" in i for i in core.scheduler.requests)
    assert len(runner.ddtree.proposed) == 0
    assert core.scheduler.kv_cache_manager.usage == 0.0
    del llm


def test_trees_survive_a_skipped_step(models, monkeypatch):
    """A token budget below the batch's verify rows leaves decoding requests
    unscheduled for a step; each keeps its tree and verifies it when scheduled
    again: no scheduled draft falls back to a chain (the stash counts them)."""
    target, drafter = models["oracle"]
    p = [[7 + i, 11 + i, 13 + i] for i in range(8)]  # prefill fits one step
    ref, _ = generate(target, p)
    skipped, alive = [], set()
    orig_drop = runner_module.DDTreeVerifier.drop_requests

    def drop_and_count(self, scheduler_output):
        alive.difference_update(scheduler_output.finished_req_ids)
        scheduled = set(scheduler_output.num_scheduled_tokens)
        skipped.append(len(alive - scheduled))
        alive.update(scheduled)
        return orig_drop(self, scheduler_output)

    monkeypatch.setattr(runner_module.DDTreeVerifier, "drop_requests", drop_and_count)
    # 8 requests x (root + 8 nodes) = 72 verify rows per step, 20 fit.
    out, stats = generate(
        target,
        p,
        ddtree(drafter, 8),
        max_num_batched_tokens=20,
        max_num_seqs=8,
    )
    print("skipped per step:", skipped, stats)
    assert out == ref
    assert sum(skipped) >= 8, f"requests left out of a step: {skipped}"
    assert stats["chain_fallbacks"] == 0, stats
    assert 1 + stats["accepted"] / stats["drafts"] >= 0.8 * BLOCK_SIZE, stats


# Small biases on every other token: in bf16 they would round away or tie
# logits (bf16 spacing at |logit| ~ 4 is 0.03), so the argmax moves unless the
# edit runs in float32 as vLLM's sampler does.
BF16_BIAS = {t: 0.02 + 0.001 * (t % 7) for t in range(0, 320, 2)}


@pytest.mark.parametrize("kind,max_children", [("random", 1), ("oracle", None)])
@pytest.mark.parametrize("bias", [None, BF16_BIAS], ids=["plain", "logit_bias"])
def test_bf16_greedy_is_lossless(models, kind, max_children, bias):
    """bf16 target + drafter: ddtree greedy == no-spec greedy, with and without
    a logit_bias (vLLM edits float32 logits; a bf16 edit rounds and flips ties).

    Rows whose ancestors are exactly the rows before them (a chain, a tree's
    spine) keep the stock attention kernel's output, bit for bit; the random
    target runs as a chain (``ddtree_max_children=1``) because recomputed sibling
    rows are not bit-identical to the stock kernel in bf16 (its near-tied bf16
    logits then flip: a known limit, see docs/plugin.md)."""
    target, drafter = models[kind]
    p = prompts(8, seed=5)
    spec = ddtree(drafter, 16)
    if max_children is not None:
        spec["ddtree_max_children"] = max_children
    ref, _ = generate(target, p, dtype="bfloat16", logit_bias=bias)
    out, stats = generate(target, p, spec, dtype="bfloat16", logit_bias=bias)
    assert out == ref
    assert stats["drafts"] > 0
