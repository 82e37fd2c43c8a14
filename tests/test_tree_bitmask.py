# SPDX-License-Identifier: Apache-2.0
"""The scheduler's tree grammar bitmask (vllm_adapter.structured_output), unit level.

Real xgrammar matchers over the tiny byte tokenizer (id i = byte i), driven
through vLLM's own ``StructuredOutputManager`` methods on a stand-in manager:

* on chains (no stored tree), the tree walk fills exactly the rows of vLLM's
  chain walk (``StructuredOutputManager.grammar_bitmask``, the oracle),
  including invalid drafts, ``-1`` padding and reasoning bounds;
* trees built with the grammar (grammar_draft_tree): every node is reachable,
  their rows, reused by the bitmask, are a fresh matcher's, and the auto
  budget's price keeps the prefix worth it;
* on random trees, every node's row is the bitmask of a fresh matcher fed the
  committed tokens and the node's path (or, below a rejected node, its
  parent's row), and the matcher is left where it was;
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

from vllm_ddtree import tiny_models  # noqa: E402
from vllm_ddtree.vllm_adapter.draft_trees import store_draft_trees  # noqa: E402
from vllm_ddtree.vllm_adapter import structured_output  # noqa: E402
from vllm_ddtree.vllm_adapter.structured_output import (  # noqa: E402
    GrammarCandidates,
    bitmask_stats,
    grammar_draft_tree,
    tree_grammar_bitmask,
)

VOCAB = tiny_models.DEFAULT_VOCAB_SIZE
EOS = tiny_models.EOS_TOKEN_ID
REGEX = r"[a-c]{2}(-[0-9]{1,3}){1,3}"
COMMITTED = b"ab-1"  # the request's output so far (a valid prefix)


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    path = Path(tempfile.mkdtemp())
    tiny_models.write_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS]
    )
    return xgr.GrammarCompiler(info)


def make_grammar(compiler) -> XgrammarGrammar:
    ctx = compiler.compile_regex(REGEX)
    grammar = XgrammarGrammar(
        matcher=xgr.GrammarMatcher(ctx),
        vocab_size=VOCAB,
        ctx=ctx,
    )
    assert grammar.accept_tokens("r", list(COMMITTED))
    return grammar


class ReasonUntil:
    """A reasoner whose reasoning ends with the token ``end`` (not content)."""

    def __init__(self, end: int) -> None:
        self.end = end

    def is_reasoning_end(self, ids) -> bool:
        return self.end in ids

    def is_reasoning_end_streaming(self, ids, delta) -> bool:
        return self.end in ids


def manager(max_spec: int, reasoner=None) -> StructuredOutputManager:
    """vLLM's manager class with the state its bitmask methods read."""
    m = object.__new__(StructuredOutputManager)
    m.vllm_config = SimpleNamespace(
        # Not a ddtree engine: vLLM's own (chain) walk, also with ddtree in-tree.
        speculative_config=None,
        num_speculative_tokens=max_spec,
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(is_diffusion=False),
    )
    m.backend = SimpleNamespace(
        allocate_token_bitmask=lambda n: xgr.allocate_token_bitmask(n, VOCAB),
        vocab_size=VOCAB,
    )
    m._grammar_bitmask = None
    m._full_mask = torch.tensor(-1, dtype=torch.int32)
    m.fill_bitmask_parallel_threshold = 128
    m.enable_in_reasoning = False
    m.reasoner_cls = None if reasoner is None else (lambda **kw: reasoner)
    m.tokenizer = None
    return m


def request(compiler, req_id: str, reasoning: bool = False):
    structured = SimpleNamespace(
        grammar=make_grammar(compiler),
        reasoning_ended=None if reasoning else True,
        reasoner=None,
        reasoning_parser_kwargs=None,
        structured_output_key=("regex", REGEX),
    )
    return SimpleNamespace(
        request_id=req_id,
        structured_output_request=structured,
        prompt_token_ids=[1, 2],
        all_token_ids=[1, 2, *COMMITTED],
        num_tokens=2 + len(COMMITTED),
        is_prefill_chunk=False,
        is_finished=lambda: False,
        use_structured_output=True,
    )


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """Mostly plausible bytes for the regex, some invalid, a few stops."""
    pool = list(b"abc-0123456789") + [ord("z"), EOS]
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("seed", range(12))
def test_chains_match_vllms_chain_walk(compiler, seed):
    rng = random.Random(seed)
    reasoning = seed % 3 == 2
    end = ord("-")
    reqs, scheduled = {}, {}
    for k in range(3):
        req_id = f"r{k}"
        reqs[req_id] = request(compiler, req_id, reasoning=reasoning)
        tokens = random_tokens(rng, rng.randrange(0, 7))
        if seed % 4 == 1 and tokens:
            cut = rng.randrange(len(tokens))
            tokens[cut:] = [-1] * (len(tokens) - cut)  # vLLM's padding drafts
        scheduled[req_id] = tokens
    ids = list(reqs)
    reasoner = ReasonUntil(end) if reasoning else None
    ours = tree_grammar_bitmask(manager(8, reasoner), reqs, ids, scheduled)
    for r in reqs.values():  # fresh reasoning state for the oracle
        r.structured_output_request.reasoning_ended = None if reasoning else True
    theirs = StructuredOutputManager.grammar_bitmask(
        manager(8, reasoner), reqs, ids, scheduled
    )
    assert ours.shape == theirs.shape
    assert (ours == theirs).all(), (seed, scheduled)


def fresh_row(compiler, path: list[int]) -> torch.Tensor | None:
    """The bitmask after COMMITTED + path, or None if the path is rejected."""
    grammar = make_grammar(compiler)
    for token in path:
        if grammar.is_terminated() or not grammar.accept_tokens("r", [token]):
            return None
    row = xgr.allocate_token_bitmask(1, VOCAB)
    if grammar.is_terminated():
        row.fill_(-1)
    else:
        grammar.fill_bitmask(row, 0)
    return row[0]


@pytest.mark.parametrize("seed", range(8))
def test_tree_rows_are_the_state_after_each_path(compiler, seed):
    rng = random.Random(100 + seed)
    n = rng.randrange(1, 14)
    parents = [-1] + [rng.randrange(0, i) for i in range(1, n + 1)]
    tokens = random_tokens(rng, n)
    req = request(compiler, "r")
    reqs = {"r": req}
    # The worker sent this tree; the scheduler schedules all of it.
    store_draft_trees(
        reqs,
        SimpleNamespace(req_ids=["r"], draft_token_ids=[tokens], draft_parents=[parents]),
    )
    grammar = req.structured_output_request.grammar
    before = grammar.matcher.find_jump_forward_string()
    # vLLM logs every rejected accept_tokens as an error: the walk must test a
    # draft against its parent's row first.
    answers = []
    accept = grammar.accept_tokens
    object.__setattr__(
        grammar, "accept_tokens",
        lambda rid, toks: answers.append(accept(rid, toks)) or answers[-1])
    m = manager(16)
    bitmask = tree_grammar_bitmask(m, reqs, ["r"], {"r": tokens})
    object.__delattr__(grammar, "accept_tokens")
    assert all(answers), answers
    assert bitmask.shape[0] == n + 1
    expected, unreachable = {}, 0
    for node in range(n + 1):
        path, v = [], node
        while v > 0:
            path.append(tokens[v - 1])
            v = parents[v]
        row = fresh_row(compiler, path[::-1])
        # Below a rejected node every row repeats the deepest accepted
        # ancestor's (the parent's row masks the subtree out).
        expected[node] = row if row is not None else expected[parents[node]]
        assert torch.equal(torch.from_numpy(bitmask[node]), expected[node]), (
            seed, node, path[::-1])
        unreachable += row is None
    # Nodes whose path the grammar rejects: the rows pruning would free.
    assert (bitmask_stats(m).nodes, bitmask_stats(m).unreachable) == (n, unreachable)
    after = grammar.matcher.find_jump_forward_string()
    assert before == after and req.structured_output_request.grammar.accept_tokens(
        "r", [ord("-")]
    )


def random_candidates(seed: int, depth: int = 4, k: int = 10):
    """[depth][k] drafter candidates: distinct tokens per depth, mostly from the
    regex's alphabet, log-probs descending."""
    rng = random.Random(seed)
    pool = list(b"abc-0123456789z") + [EOS]
    ids = [rng.sample(pool, k) for _ in range(depth)]
    log_probs = [sorted((-rng.expovariate(0.5) for _ in range(k)), reverse=True)
                 for _ in range(depth)]
    return log_probs, ids


@pytest.mark.parametrize("seed", range(4))
def test_grammar_built_trees_reach_every_node_and_reuse_their_rows(
    compiler, seed, monkeypatch
):
    log_probs, ids = random_candidates(seed)
    req = request(compiler, "r")
    reqs = {"r": req}
    m = manager(16)
    grammar = req.structured_output_request.grammar
    before = grammar.matcher.find_jump_forward_string()
    store_draft_trees(
        reqs,
        SimpleNamespace(req_ids=["r"], draft_token_ids=[[]], draft_parents=[[-1]],
                        draft_candidates={"r": GrammarCandidates(log_probs, ids, 12)}),
        lambda request, c: grammar_draft_tree(m, request, c),
    )
    record = req.ddtree_draft_tree
    n = len(record.tokens)
    assert record.grammar_shaped and 0 < n <= 12
    assert grammar.matcher.find_jump_forward_string() == before
    # The bitmask copies the build's rows (no walk) ...
    monkeypatch.setattr(structured_output, "fill_tree_bitmask", None)
    bitmask = tree_grammar_bitmask(m, reqs, ["r"], {"r": record.tokens})
    assert bitmask.shape[0] == n + 1
    for node in range(n + 1):
        path, v = [], node
        while v > 0:
            path.append(record.tokens[v - 1])
            v = record.parents[v]
        row = fresh_row(compiler, path[::-1])
        # ... which are a fresh matcher's after each node's path: reachable.
        assert row is not None, (seed, path[::-1])
        assert torch.equal(torch.from_numpy(bitmask[node]), row), (seed, node)
    assert (bitmask_stats(m).nodes, bitmask_stats(m).unreachable) == (n, 0)
    assert bitmask_stats(m).grammar_trees == 1 and bitmask_stats(m).grammar_nodes == n
    # Once the grammar has moved (a token committed since), the rows are walked.
    monkeypatch.undo()
    req.num_tokens += 1
    walked = tree_grammar_bitmask(manager(16), reqs, ["r"], {"r": record.tokens[:3]})
    assert (walked == bitmask[:4]).all()


def test_the_node_price_keeps_the_prefix_worth_it(compiler):
    log_probs, ids = random_candidates(7)
    whole = grammar_draft_tree(
        manager(16), request(compiler, "r"), GrammarCandidates(log_probs, ids, 12)
    )
    probs = whole.path_probs
    assert len(probs) >= 4 and probs == sorted(probs, reverse=True)
    for factor, price in ((1.0, probs[3]), (2.0, probs[3]), (0.5, probs[1])):
        depth_factors = [factor] * 13
        kept = grammar_draft_tree(
            manager(16), request(compiler, "r"),
            GrammarCandidates(log_probs, ids, 12, price, depth_factors),
        )
        expected = sum(1 for p in probs if min(factor * p, 1.0) >= price)
        assert len(kept.tokens) == expected and kept.tokens == whole.tokens[:expected]


def test_without_drafts_the_tree_is_the_forced_run(compiler):
    """A pass the auto budget skipped sends no drafted position: the tree is the
    run the grammar forces (here "xyz" after the committed "ab-1"), which stops
    where the grammar allows a choice."""
    ctx = compiler.compile_regex(r"ab-1xyz(0|1)")
    grammar = XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx), vocab_size=VOCAB, ctx=ctx)
    assert grammar.accept_tokens("r", list(COMMITTED))
    req = request(compiler, "r")
    req.structured_output_request.grammar = grammar
    record = grammar_draft_tree(manager(16), req, GrammarCandidates([], [], 12))
    assert record.tokens == list(b"xyz") and record.parents == [-1, 0, 1, 2]
    assert record.path_probs == [1.0, 1.0, 1.0]
    assert grammar.accept_tokens("r", [ord("x")])  # the matcher did not move


def test_without_drafts_a_free_state_builds_nothing(compiler, monkeypatch):
    """A skipped pass where the grammar forces nothing (and the span memory has
    no hint): an empty tree, without filling a single row."""
    req = request(compiler, "r")  # after "ab-1": a digit, '-' or the end
    grammar = req.structured_output_request.grammar
    fills = []
    monkeypatch.setattr(grammar, "fill_bitmask", lambda *a: fills.append(a))
    candidates = GrammarCandidates([], [], 12, 0.1, [1.0] * 13)
    record = grammar_draft_tree(manager(16), req, candidates)
    assert record.tokens == [] and record.parents == [-1] and fills == []
    assert record.grammar_values == ([], [])
