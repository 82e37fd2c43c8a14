# SPDX-License-Identifier: Apache-2.0
"""Structured outputs with ddtree (xgrammar), end to end on CPU.

Oracle: vLLM's own constrained decoding without speculation. Tiny byte-level
models written at test time; the random target puts its greedy choice anywhere
in the grammar's allowed set, so any wrong bitmask row shows up as a different
token (or as a request ending in error when an off-grammar token is committed).

* random drafter, json_schema / regex / choice / json_object / a tool-call
  schema, batch 1 and a batch mixing constrained and unconstrained requests:
  token-identical greedy output, every finished output parses / matches, and
  every node of every grammar-built tree is one the grammar accepts after the
  committed output (checked at scheduling, with vLLM's own ``validate_tokens``);
* forced runs: a drafter that proposes only tokens the grammar rejects still
  gets the grammar's forced tokens verified, and accepted in one step;
* scripted siblings: the true (constrained) continuation at rank 1 of every
  depth, a wrong token at rank 0: only a tree with per-path grammar rows
  accepts full depth and stays identical;
* requests refused per request: a grammar backend the tree walk is not
  validated with.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from _law_utils import tv_bound
from vllm_ddtree import tiny_models

vllm = pytest.importorskip("vllm")
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402

BLOCK_SIZE = 5  # L = 4 drafted positions
MAX_TOKENS = 48

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}
# A tool call: nested objects, enums, an array (what agent traffic sends).
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "units": {"enum": ["C", "F"]},
                "days": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}, "maxItems": 3},
            },
            "required": ["city", "units", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{3}-[0-9]{2,4}(,[a-f]{2})?"
CHOICES = ["alpha", "beta", "gamma delta"]

CONSTRAINTS = {
    "json_schema": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "json_object": StructuredOutputsParams(json_object=True),
    "tool_call": StructuredOutputsParams(json=TOOL_CALL),
}


def check_output(kind: str, text: str, finished: bool) -> None:
    """A finished constrained output is what the constraint describes."""
    if not finished:
        return
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"id", "ok", "tag"} and value["tag"] in SCHEMA[
            "properties"
        ]["tag"]["enum"], text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "tool_call":
        value = json.loads(text)
        assert value["name"] in ("get_weather", "get_time"), text
        assert set(value["arguments"]) == {"city", "units", "days"}, text


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_patched):
    root = tmp_path_factory.mktemp("so_models")
    target = tiny_models.make_target(root / "target", kind="random", seed=3)
    drafter = tiny_models.make_dflash_drafter(
        root / "drafter", target, kind="random", block_size=BLOCK_SIZE, seed=4
    )
    return str(target), str(drafter)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def ddtree(drafter, budget=16, **extra):
    return {
        "method": "ddtree",
        "model": drafter,
        "num_speculative_tokens": budget,
        "ddtree_budget": "fixed",
        **extra,
    }


def make_llm(target, speculative_config=None, **kw):
    """The in-process engine every test here builds (float32, eager, seeded)."""
    kw.setdefault("max_model_len", 512)
    return vllm.LLM(model=target, dtype="float32", enforce_eager=True,
                    disable_log_stats=False, speculative_config=speculative_config,
                    seed=0, **kw)


def generate(target, requests, speculative_config=None):
    """requests: [(prompt ids, constraint kind or None)]; returns
    [(token ids, text, finished, finish_reason)] and the engine's spec stats."""
    llm = make_llm(target, speculative_config)
    params = [
        vllm.SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            structured_outputs=CONSTRAINTS[kind] if kind else None,
        )
        for _, kind in requests
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False
    )
    # The text from the token ids: the tiny tokenizer's token i < 256 is byte i
    # (vLLM's incremental detokenizer would glue on the random prompt's partial
    # UTF-8 tail).
    results = [
        (
            list(o.outputs[0].token_ids),
            bytes(t for t in o.outputs[0].token_ids if t < 256).decode(
                "utf-8", errors="replace"
            ),
            o.outputs[0].finish_reason == "stop",
            o.outputs[0].finish_reason,
        )
        for o in outs
    ]
    stats = spec_counters(llm)
    if speculative_config is not None:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        stats["branch_paths"] = int(runner.ddtree.num_branch_paths)
        stats["chain_fallbacks"] = runner.ddtree.num_chain_fallbacks
    del llm
    return results, stats


def spec_counters(llm) -> dict[str, float]:
    """The engine's running spec-decode counters."""
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {
        "drafts": metrics.get("vllm:spec_decode_num_drafts", 0),
        "draft_tokens": metrics.get("vllm:spec_decode_num_draft_tokens", 0),
        "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens", 0),
    }


def only_token(token: int):
    """A drafter script whose every position proposes ``token`` alone."""

    def script(proposer, runner, req_ids, committed, logits):
        draft = torch.zeros_like(logits)
        draft[:, token] = 8.0
        return draft

    return script


@pytest.fixture(scope="module")
def batch():
    """Every constraint kind twice plus unconstrained requests, mixed."""
    kinds = [*CONSTRAINTS, *CONSTRAINTS, None, None]
    return list(zip(prompts(len(kinds)), kinds, strict=True))


@pytest.fixture(scope="module")
def reference(models, batch):
    return generate(models[0], batch)[0]


def test_reference_follows_the_constraints(batch, reference):
    """The oracle itself: constrained output parses (finished ones)."""
    finished = 0
    for (_, kind), (_, text, done, reason) in zip(batch, reference, strict=True):
        assert reason in ("stop", "length"), reason
        if kind:
            check_output(kind, text, done)
            finished += done
    assert finished >= 4  # the short grammars finish within MAX_TOKENS


@pytest.fixture
def checked_trees(monkeypatch):
    """Counts the grammar-built trees' scheduled nodes, each checked, as it is
    scheduled, against the request's grammar with vLLM's ``validate_tokens``
    (a path the grammar rejects is cut short there): {"trees", "nodes",
    "unreachable"}."""
    from vllm_ddtree.vllm_adapter import draft_trees

    counts = {"trees": 0, "nodes": 0, "unreachable": 0}
    scheduled = draft_trees.scheduled_draft_trees

    def checking(requests, num_scheduled_tokens, scheduled_tokens):
        trees = scheduled(requests, num_scheduled_tokens, scheduled_tokens)
        for req_id, tree in trees.items():
            if not tree.grammar_shaped or len(tree.parents) == 1:
                continue
            grammar = requests[req_id].structured_output_request.grammar
            tokens = scheduled_tokens[req_id]
            counts["trees"] += 1
            for node in range(1, len(tree.parents)):
                path, v = [], node
                while v > 0:
                    path.append(tokens[v - 1])
                    v = tree.parents[v]
                counts["nodes"] += 1
                if len(grammar.validate_tokens(path[::-1])) != len(path):
                    counts["unreachable"] += 1
        return trees

    monkeypatch.setattr(draft_trees, "scheduled_draft_trees", checking)
    return counts


@pytest.mark.parametrize("size", [1, "all"])
def test_random_drafter_is_lossless(models, batch, reference, size, checked_trees):
    """Batch 1 (each constraint alone) and the whole mixed batch."""
    groups = [[i] for i in range(len(CONSTRAINTS))] if size == 1 else [range(len(batch))]
    drafts = 0
    for group in groups:
        out, stats = generate(models[0], [batch[i] for i in group], ddtree(models[1]))
        for i, got in zip(group, out, strict=True):
            kind = batch[i][1]
            assert got[3] == reference[i][3], (kind, got, reference[i])
            assert got[0] == reference[i][0], (kind, got[1], reference[i][1])
            if kind:
                check_output(kind, got[1], got[2])
        # Grammar-built trees only hold allowed nodes: a random drafter whose
        # top candidates the grammar rules out drafts nothing for a request.
        drafts += stats["drafts"]
    assert drafts > 0
    assert checked_trees["trees"] > 0 and checked_trees["nodes"] > 0, checked_trees
    assert checked_trees["unreachable"] == 0, checked_trees


def test_siblings_are_accepted_under_the_grammar(
    models, batch, reference, scripted_drafter, truth_at_rank_1
):
    """True continuation at rank 1 of every depth, a wrong token at rank 0.

    The rank-0 nodes and the rank-1 path are siblings: each row must be the
    grammar state after its own path. A chain-semantics bitmask would mask the
    true path's rows with its sibling's state (different tokens, or a request
    failed for an off-grammar commit); here the tree accepts full depth.
    """
    target, drafter = models
    scripted_drafter(truth_at_rank_1(
        {tuple(p): p + ref[0] for (p, _), ref in zip(batch, reference, strict=True)}
    ))
    out, stats = generate(target, batch, ddtree(drafter, 30))
    print("structured scripted siblings:", stats)
    for (_, kind), got, ref in zip(batch, out, reference, strict=True):
        assert got[3] == ref[3] and got[0] == ref[0], (kind, got[1], ref[1])
    assert stats["chain_fallbacks"] == 0, stats
    assert stats["branch_paths"] > 0, stats
    assert 1 + stats["accepted"] / stats["drafts"] >= 0.7 * BLOCK_SIZE, stats


def test_forced_runs_are_accepted_in_full(models, scripted_drafter, monkeypatch):
    """A drafter that proposes only a token the grammar never allows ('z'):
    after a choice's first character the grammar forces the rest (and the end
    of the output), so the grammar-built tree is that run, past the drafter's
    L = 4 positions, and the target accepts all of it in one verify step."""
    target, drafter = models
    stars = ["alpha centauri", "beta pictoris", "gamma delta"]  # runs > L
    requests = [(p, "stars") for p in prompts(3, seed=5)]
    monkeypatch.setitem(CONSTRAINTS, "stars", StructuredOutputsParams(choice=stars))
    reference, _ = generate(target, requests)
    scripted_drafter(only_token(ord("z")))
    for request, ref in zip(requests, reference, strict=True):
        out, stats = generate(target, [request], ddtree(drafter, 16))
        assert out[0][0] == ref[0] and out[0][1] in stars, (out, ref)
        # The first token comes from the prefill step; every later one from the
        # one tree.
        assert stats["drafts"] == 1, stats
        assert stats["accepted"] == len(ref[0]) - 1 > BLOCK_SIZE - 1, (stats, ref)


def test_a_repeated_state_replays_the_target_s_last_span(models, scripted_drafter,
                                                        monkeypatch):
    """Span memory end to end: after its first letter the grammar forces "xxx",
    then lets the target choose. A drafter that only proposes a token the
    grammar never allows drafts nothing but the forced run; the second identical
    request also gets the first one's 8 tokens from that state (the run and 5
    chosen letters) as a hint, and accepts all of them in one verify step."""
    from vllm_ddtree.vllm_adapter.grammar_spans import grammar_span_memory

    target, drafter = models
    monkeypatch.setitem(
        CONSTRAINTS, "spans", StructuredOutputsParams(regex="[a-c]x{3}[a-z]{10}")
    )
    request = [(prompts(1, seed=9)[0], "spans")]
    reference, _ = generate(target, request)
    scripted_drafter(only_token(ord("{")))
    llm = make_llm(target, ddtree(drafter, 16))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                 structured_outputs=CONSTRAINTS["spans"])
    accepted = []
    for _ in range(2):
        before = spec_counters(llm)
        out = llm.generate(
            [{"prompt_token_ids": request[0][0]}], params, use_tqdm=False
        )
        assert list(out[0].outputs[0].token_ids) == reference[0][0]
        accepted.append(spec_counters(llm)["accepted"] - before["accepted"])
    memory = grammar_span_memory(
        llm.llm_engine.engine_core.engine_core.scheduler.structured_output_manager
    )
    del llm
    assert accepted[1] == accepted[0] + memory.span_tokens - 3, accepted
    assert memory.hints == 1 and (memory.matched, memory.missed) == (8, 0)


def test_other_grammar_backends_are_refused_per_request(models):
    target, drafter = models
    llm = make_llm(target, ddtree(drafter), max_model_len=256,
                   structured_outputs_config={"backend": "guidance"})
    params = vllm.SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-c]+")
    )
    with pytest.raises(ValueError, match="grammar backend is 'guidance'"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    # The engine keeps serving unconstrained requests.
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}],
        vllm.SamplingParams(max_tokens=4),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4
    del llm


# T > 0: the law of a constrained output, ddtree vs no speculation.
SAMPLED_CHOICES = ["ab", "ac", "ba", "bb", "c"]  # depth-2 rows depend on the path
N_SAMPLED = 3000


def sample_choices(target, speculative_config, temperature):
    """N_SAMPLED seeded requests (seed = i) of one prompt under the choice
    grammar; returns the Counter of outputs and the spec stats."""
    from collections import Counter

    llm = make_llm(target, speculative_config, max_model_len=256)
    params = [
        vllm.SamplingParams(
            temperature=temperature,
            max_tokens=4,
            seed=i,
            structured_outputs=StructuredOutputsParams(choice=SAMPLED_CHOICES),
        )
        for i in range(N_SAMPLED)
    ]
    outs = llm.generate(
        [{"prompt_token_ids": [7, 42, 99]}] * N_SAMPLED, params, use_tqdm=False
    )
    counts = Counter(
        bytes(t for t in o.outputs[0].token_ids if t < 256).decode() for o in outs
    )
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    del llm
    return counts, metrics


def test_sampled_law_matches_non_speculative(models, scripted_drafter):
    """T = 1, choice grammar whose second-token mask depends on the first token.
    The drafter proposes a, b and c at every depth, so trees hold sibling paths
    that the target often accepts. Two-sample TV over the 5 outputs, N = 3000
    each, bound at delta = 1e-6; a negative control (T = 0.6) shows the bound
    has power."""
    target, drafter = models
    reference, _ = sample_choices(target, None, 1.0)
    colder, _ = sample_choices(target, None, 0.6)

    def abc(proposer, runner, req_ids, committed, logits):
        script = torch.zeros_like(logits)
        script[:, list(b"abc")] = torch.tensor([3.0, 2.9, 2.8])
        return script

    scripted_drafter(abc)
    ours, metrics = sample_choices(target, ddtree(drafter, 8), 1.0)
    assert set(ours) <= set(SAMPLED_CHOICES) and set(reference) <= set(SAMPLED_CHOICES)

    def tv(a, b):
        return 0.5 * sum(
            abs(a[c] / N_SAMPLED - b[c] / N_SAMPLED) for c in SAMPLED_CHOICES
        )

    bound = tv_bound(len(SAMPLED_CHOICES), N_SAMPLED, N_SAMPLED)
    drafts = metrics.get("vllm:spec_decode_num_drafts", 0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    print(f"reference {dict(reference)}\nddtree {dict(ours)}\nT=0.6 {dict(colder)}")
    print(f"TV={tv(ours, reference):.4f} control={tv(colder, reference):.4f} "
          f"bound={bound:.4f} drafts={drafts} accepted={accepted}")
    assert tv(colder, reference) > bound  # the bound has power
    assert accepted >= 0.5 * N_SAMPLED  # trees are accepted, not bypassed
    assert tv(ours, reference) <= bound


def test_preemption_mid_grammar(models):
    """A KV cache too small for the batch: constrained requests are preempted
    and recomputed mid-output; the grammar (advanced by committed tokens only,
    never by the tree walk) and the output stay as without speculation."""
    target, drafter = models
    rng = random.Random(11)
    long_prompts = [[rng.randrange(250) for _ in range(rng.randrange(100, 160))]
                    for _ in range(8)]
    kinds = ["json_object", "regex", "json_schema", None] * 2
    kw = dict(num_gpu_blocks_override=10, block_size=32, max_model_len=256)

    def run(spec):
        llm = make_llm(target, spec, **kw)
        params = [vllm.SamplingParams(temperature=0.0, max_tokens=48,
                                      structured_outputs=CONSTRAINTS[k] if k else None)
                  for k in kinds]
        outs = llm.generate([{"prompt_token_ids": p} for p in long_prompts], params,
                            use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        del llm
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
                for o in outs], metrics

    ref, _ = run(None)
    out, metrics = run(ddtree(drafter, 16))
    assert out == ref
    assert all(reason in ("stop", "length") for _, reason in out), out
    assert metrics.get("vllm:num_preemptions", 0) > 0, metrics
