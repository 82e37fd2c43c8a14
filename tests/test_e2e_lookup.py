# SPDX-License-Identifier: Apache-2.0
"""Lookup drafts in ddtree's trees, end to end in vLLM 0.32 on CPU.

* A target whose right continuation only the lookup proposes (the oracle target
  repeats its last token; the drafter is random): with lookup on, the lookup
  chain is accepted in full step after step; with ``ddtree_lookup="off"``
  almost nothing is; greedy output identical to no speculation either way.
  Both sources: vLLM's n-gram matcher, and SuffixDecoding where
  arctic-inference is installed.
* T = 1: trees holding lookup nodes *and* the drafter's (a prompt whose
  continuations are the target's two likely successors, an oracle drafter of
  the same law), the joint law of the first tokens against non-speculative
  vLLM (two-sample TV bound, fixed seeds).
* ``ddtree_lookup`` values and start-up resolution.
"""

from __future__ import annotations

import gc
import random

import pytest

from _law_utils import joint_tv, tv_bound
from vllm_ddtree import tiny_models
from vllm_ddtree.vllm_adapter import config as ddtree_config
from vllm_ddtree.vllm_adapter import lookup as lookup_sources

vllm = pytest.importorskip("vllm")

BLOCK_SIZE = 5  # L = 4 drafted positions
BUDGET = 8
MAX_TOKENS = 40
SOURCES = ["ngram"] + (["suffix"] if lookup_sources.suffix_decoding_available() else [])


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_patched):
    root = tmp_path_factory.mktemp("lookup_models")
    repeat = tiny_models.make_target(root / "repeat_target", kind="oracle", seed=1)
    random_drafter = tiny_models.make_dflash_drafter(
        root / "random_drafter", repeat, kind="random", block_size=BLOCK_SIZE, seed=2
    )
    two_way, head, emb = tiny_models.make_two_way_target(root / "two_way_target")
    two_way_drafter = tiny_models.make_dflash_drafter(
        root / "two_way_drafter", two_way, kind="oracle", block_size=BLOCK_SIZE, seed=2
    )
    return {
        "repeat": (str(repeat), str(random_drafter)),
        "two_way": (str(two_way), str(two_way_drafter)),
        "head": head,
        "emb": emb,
    }


def make_llm(target, spec=None, **kw):
    kw.setdefault("max_model_len", 512)
    return vllm.LLM(model=target, dtype="float32", enforce_eager=True, seed=0,
                    disable_log_stats=False, speculative_config=spec, **kw)  # fmt: skip


def spec_counts(llm) -> dict:
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {
        "drafts": metrics.get("vllm:spec_decode_num_drafts", 0) or 0,
        "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens", 0) or 0,
    }


def lookup_of(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.ddtree.lookup


def repeat_prompts() -> list[list[int]]:
    """Random heads ending in a run of one token (the target continues it), and
    one whose run only starts in the output."""
    rng = random.Random(5)
    prompts = []
    for n in (3, 6, 12):
        last = rng.randrange(1, 250)
        prompts.append([rng.randrange(250) for _ in range(7)] + [last] * n)
    prompts.append([rng.randrange(250) for _ in range(9)])
    return prompts


@pytest.fixture(scope="module")
def repeat_reference(models):
    target, _ = models["repeat"]
    llm = make_llm(target)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in repeat_prompts()], params,
                        use_tqdm=False)  # fmt: skip
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "lookup, budget", [(s, "fixed") for s in SOURCES + ["off"]] + [(SOURCES[-1], "auto")]
)
def test_a_continuation_only_the_lookup_proposes_is_accepted(
    models, repeat_reference, lookup, budget
):
    """Fixed budgets: the lookup chain accepted in full, not with lookup off.
    The auto budget (lookup-only trees while the drafter is skipped, where
    they pay: on these tiny models a tree's fixed cost exceeds a plain step):
    greedy identity."""
    target, drafter = models["repeat"]
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET,
            "ddtree_budget": budget, "ddtree_lookup": lookup}  # fmt: skip
    llm = make_llm(target, spec)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in repeat_prompts()], params,
                        use_tqdm=False)  # fmt: skip
    counts = spec_counts(llm)
    source = lookup_of(llm)
    stats = None if source is None else (source.stats(), type(source.source).__name__)
    del llm
    gc.collect()
    assert [list(o.outputs[0].token_ids) for o in outs] == repeat_reference
    tau = 1 + counts["accepted"] / max(counts["drafts"], 1)
    print(f"lookup={lookup} budget={budget}: tau {tau:.2f} {counts} {stats}")
    if budget == "auto":
        assert source is not None and source.num_proposed > 0, stats
        return
    if lookup == "off":
        assert source is None
        assert tau < 1.5, counts  # the random drafter's chain: almost nothing
        return
    assert type(source.source).__name__ == {
        "ngram": "NgramLookup", "suffix": "SuffixLookup"
    }[lookup]
    # Most verify steps accept the whole lookup chain (B nodes).
    assert tau > 0.6 * (BUDGET + 1), (counts, stats)
    assert source.accepted_by_source["lookup"] > 0.9 * counts["accepted"], stats


# --------------------------------------------------------------------------- #
# T = 1
# --------------------------------------------------------------------------- #

N_LAW = 4000
# top_k = 2: after x the target's two likeliest successors, which the lookup
# proposes too; the joint law of 3 tokens has at most 8 cells.
LAW_PARAMS = dict(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)


def law_prompt(models) -> list[int]:
    """``x x y x x y x``: after ``x`` the prompt continued with ``x`` and with
    ``y``, the target's two likeliest successors of ``x``."""
    import torch

    emb, head = models["emb"], models["head"]
    x = 67
    probs = torch.softmax(head.double() @ emb[x].double(), dim=-1)
    first, second = probs.topk(2).indices.tolist()
    y = second if first == x else first
    return [12, x, x, y, x, x, y, x]


def test_law_with_lookup_nodes_matches_non_speculative(models):
    """The joint law of the first 3 tokens (T = 1, top_k = 2: at most 8 cells),
    N_LAW ddtree requests (trees of lookup and drafter nodes, unseeded: the
    rejection rule) vs N_LAW plain vLLM requests, bound :func:`tv_bound` at
    delta 1e-6 (about 0.09)."""
    target, drafter = models["two_way"]
    prompt = law_prompt(models)
    params = vllm.SamplingParams(**LAW_PARAMS)
    llm = make_llm(target)
    ref = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": prompt}] * N_LAW, params, use_tqdm=False)]  # fmt: skip
    del llm
    gc.collect()
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET,
            "ddtree_budget": "fixed", "ddtree_lookup": "ngram"}  # fmt: skip
    llm = make_llm(target, spec)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": prompt}] * N_LAW, params, use_tqdm=False)]  # fmt: skip
    counts = spec_counts(llm)
    source = lookup_of(llm)
    by_source = dict(source.accepted_by_source)
    del llm
    gc.collect()
    # Trees held lookup nodes, and the target accepted some of them.
    assert source.num_proposed > N_LAW and source.num_accepted > 0.05 * N_LAW, (
        source.stats()
    )
    assert by_source["lookup"] + by_source["both"] > 0, by_source
    assert counts["accepted"] > 0.1 * N_LAW, counts
    tv, cells = joint_tv(outs, ref, slice(0, 3))
    bound = tv_bound(8, N_LAW, N_LAW)
    print(f"lookup law: cells {cells}, TV {tv:.4f}, bound {bound:.4f}, "
          f"{source.stats()}")  # fmt: skip
    assert cells <= 8
    assert tv <= bound, (tv, bound)


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


def test_lookup_values_are_checked_and_resolved(monkeypatch):
    with pytest.raises(ValueError, match="ddtree_lookup"):
        ddtree_config.DDTreeConfig(budget=4, lookup="sufix")
    assert ddtree_config.resolve_lookup("off") == "off"
    assert ddtree_config.resolve_lookup("ngram") == "ngram"
    monkeypatch.setattr(lookup_sources, "suffix_decoding_available", lambda: False)
    assert ddtree_config.resolve_lookup("auto") == "ngram"
    with pytest.raises(ValueError, match="ddtree_lookup='suffix' needs arctic-inference"):
        ddtree_config.resolve_lookup("suffix")
    monkeypatch.setattr(lookup_sources, "suffix_decoding_available", lambda: True)
    assert ddtree_config.resolve_lookup("auto") == "suffix"
