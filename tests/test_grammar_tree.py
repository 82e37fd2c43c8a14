# SPDX-License-Identifier: Apache-2.0
"""Grammar-guided tree construction (vllm_ddtree.grammar_tree) with
xgrammar, through vLLM's XgrammarGrammar: every node reachable, the exact top-B
of the renormalised score (brute force), forced runs free and past the
drafter's depth, the matcher left where it was."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

from test_tree_bitmask import VOCAB, compiler  # noqa: E402, F401
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

from vllm_ddtree.grammar_tree import GrammarCursor, build_grammar_tree  # noqa: E402
from vllm_ddtree.lookup_tree import LookupDraft  # noqa: E402

ALPHABET = list(b"abc-0123456789x{}\":")


def grammar_for(compiler, regex: str, committed: bytes = b"") -> XgrammarGrammar:  # noqa: F811
    ctx = compiler.compile_regex(regex)
    grammar = XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx), vocab_size=VOCAB, ctx=ctx)
    assert grammar.accept_tokens("r", list(committed))
    return grammar


def drafter_top_k(rng: np.random.Generator, depth: int, k: int):
    """[L, K] descending log-probs over K distinct tokens of ALPHABET per depth."""
    tokens = np.stack([rng.choice(ALPHABET, size=k, replace=False) for _ in range(depth)])
    logits = rng.normal(size=(depth, len(ALPHABET))) * 2
    lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    idx = np.array([[ALPHABET.index(t) for t in row] for row in tokens])
    chosen = np.take_along_axis(lp, idx, axis=1)
    order = np.argsort(-chosen, axis=1)
    return np.take_along_axis(chosen, order, 1), np.take_along_axis(tokens, order, 1)


def allowed_tokens(grammar) -> list[int]:
    """Every token the matcher accepts next (tried one by one)."""
    out = []
    for token in range(VOCAB):
        if grammar.matcher.accept_token(token):
            grammar.matcher.rollback(1)
            out.append(token)
    return out


def brute_force(grammar, log_probs, token_ids, budget, lookup=None, max_depth=None):
    """Every grammar-valid path, scored with each depth's candidates
    renormalised over those the grammar allows after the path (a token the
    grammar forces: probability 1) and, on the lookup tree, mixed with the
    lookup children the grammar allows: p(t) = a_t + (1 - A) q'(t); the top
    ``budget`` by score."""
    depth_limit = log_probs.shape[0]
    max_depth = depth_limit if max_depth is None else max_depth
    kids = {}
    if lookup is not None:
        for i, parent in enumerate(lookup.parents):
            kids.setdefault(parent, []).append(i)
    scored = {}
    # (path, score, lookup node or None when off the lookup tree)
    frontier = [((), 0.0, -1 if lookup is not None else None)]
    for depth in range(max_depth):
        nxt = []
        for path, score, node in frontier:
            assert grammar.accept_tokens("r", list(path))
            if grammar.is_terminated():
                grammar.rollback(len(path))
                continue
            allowed = allowed_tokens(grammar)
            if path:
                grammar.rollback(len(path))
            mine = {} if node is None else {
                int(lookup.tokens[c]): c for c in kids.get(node, [])
                if int(lookup.tokens[c]) in allowed
            }
            if len(allowed) == 1:
                t = allowed[0]
                nxt.append((path + (t,), score, mine.get(t)))
                continue
            q = {}
            if depth < depth_limit:
                ok = np.isin(token_ids[depth], allowed)
                if ok.any():
                    lp = log_probs[depth][ok]
                    q = {int(t): math.exp(v - np.logaddexp.reduce(lp))
                         for t, v in zip(token_ids[depth][ok], lp, strict=True)}
            rest = 1.0 - sum(lookup.probs[c] for c in mine.values())
            for t in set(q) | set(mine):
                p = (lookup.probs[mine[t]] if t in mine else 0.0) + rest * q.get(t, 0.0)
                if p > 0:
                    nxt.append((path + (t,), score + math.log(min(p, 1.0)), mine.get(t)))
        for path, score, _ in nxt:
            scored[path] = score
        frontier = nxt
    best = sorted(scored.items(), key=lambda kv: -kv[1])[:budget]
    return {p for p, _ in best}, scored


def tree_paths(tree):
    paths = [()]
    for node in range(1, len(tree.tokens)):
        paths.append(paths[tree.parents[node]] + (tree.tokens[node],))
    return paths


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_is_the_top_b_of_reachable_paths(compiler, seed):  # noqa: F811
    rng = np.random.default_rng(seed)
    regex = r"[a-c]{2}(-[0-9]{1,3}){1,3}x"
    grammar = grammar_for(compiler, regex, b"ab")
    log_probs, token_ids = drafter_top_k(rng, depth=5, k=6)
    budget = 12
    before = grammar.num_processed_tokens
    tree = build_grammar_tree(
        log_probs, token_ids, budget, root_token=ord("b"),
        grammar_at=GrammarCursor(grammar, VOCAB),
    )
    assert grammar.num_processed_tokens == before  # the matcher is where it was
    paths = tree_paths(tree)
    # Every node is reachable: its path is accepted by a fresh matcher.
    for path in paths[1:]:
        assert grammar.accept_tokens("r", list(path)), path
        grammar.rollback(len(path))
    # Parents first, scores non-increasing along each path and in node order.
    assert all(tree.parents[i] < i for i in range(1, len(paths)))
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(tree.log_scores))
    want, _ = brute_force(grammar, log_probs, token_ids, budget)
    assert set(paths[1:]) == want
    assert 0 < tree.num_nodes <= budget


def test_forced_tokens_are_free_and_reach_past_the_drafter(compiler):  # noqa: F811
    """After '{' the grammar forces '"k":"' (5 tokens); the drafter proposes
    none of them. Their probability is 1: the whole run is in the tree (score
    0), deeper than the drafter's 3 positions when max_depth allows."""
    grammar = grammar_for(compiler, r'\{"k":"[ab]+"\}', b"{")
    rng = np.random.default_rng(0)
    log_probs, token_ids = drafter_top_k(rng, depth=3, k=4)
    token_ids[:] = np.array([ord("0"), ord("1"), ord("2"), ord("3")])  # never allowed
    forced = list(b'"k":"')
    shallow = build_grammar_tree(log_probs, token_ids, 8, ord("{"),
                                 GrammarCursor(grammar, VOCAB))
    assert shallow.tokens[1:] == forced[:3]
    assert shallow.log_scores == [0.0] * 4
    deep = build_grammar_tree(log_probs, token_ids, 8, ord("{"),
                              GrammarCursor(grammar, VOCAB), max_depth=8)
    assert deep.tokens[1:6] == forced and deep.parents[1:6] == [0, 1, 2, 3, 4]
    # Past the forced run ("[ab]+") the drafter has no depth left: nothing more.
    assert deep.num_nodes == 5
    assert all(math.isclose(s, 0.0) for s in deep.log_scores)


def test_a_terminated_path_has_no_children(compiler):  # noqa: F811
    grammar = grammar_for(compiler, r"a[0-9]", b"a")
    log_probs = np.log(np.full((3, 2), 0.5))
    token_ids = np.array([[ord("1"), ord("2")]] * 3)
    tree = build_grammar_tree(log_probs, token_ids, 8, ord("a"),
                              GrammarCursor(grammar, VOCAB))
    # After a digit only the stop token is allowed (forced), then nothing.
    assert sorted(tree.tokens[1:3]) == [ord("1"), ord("2")]
    assert all(math.isclose(s, math.log(0.5)) for s in tree.log_scores[1:3])
    assert all(tree.rows[i] is None or tree.rows[i].forced is not None
               for i in range(1, 3))


def random_lookup(rng, nodes, alphabet):
    """A random lookup tree over ``alphabet``: distinct tokens per parent,
    sibling probabilities summing to at most 1."""
    tokens, parents, probs = [], [], []
    for i in range(nodes):
        parent = int(rng.integers(-1, i)) if i else -1
        used = {tokens[j] for j in range(i) if parents[j] == parent}
        token = int(rng.choice([t for t in alphabet if t not in used]))
        mass = sum(probs[j] for j in range(i) if parents[j] == parent)
        tokens.append(token)
        parents.append(parent)
        probs.append(float(rng.uniform(0.05, 1.0)) * (1.0 - mass))
    return LookupDraft(tokens, parents, probs)


@pytest.mark.parametrize("seed", range(6))
def test_a_lookup_draft_is_merged_by_the_union_rule(compiler, seed):  # noqa: F811
    """With a lookup draft (the span memory's hints; here random trees whose
    nodes the grammar may reject), the tree is the exact top-B under p(t) =
    a_t + (1 - A) q'(t) on the lookup tree (brute force), past the drafter's
    depth where the lookup reaches."""
    rng = np.random.default_rng(100 + seed)
    # After "ab-" a digit (not forced), so the lookup's first tokens count.
    grammar = grammar_for(compiler, r"[a-c]{2}(-[0-9]{1,3}){1,3}x", b"ab-")
    log_probs, _ = drafter_top_k(rng, depth=3, k=6)
    # Drafter and lookup draw from the tokens this grammar allows here, so
    # that both often propose the same token.
    allowed = list(b"-0123456789x")
    token_ids = np.stack([rng.choice(allowed, size=6, replace=False) for _ in range(3)])
    lookup = random_lookup(rng, nodes=12, alphabet=allowed)
    tree = build_grammar_tree(log_probs, token_ids, 12, ord("-"),
                              GrammarCursor(grammar, VOCAB), max_depth=6,
                              lookup=lookup)
    _, scored = brute_force(grammar, log_probs, token_ids, 12, lookup, max_depth=6)
    paths = tree_paths(tree)
    # Each node scored as the rule says; the nodes are the top 12 (ties at
    # the cut may pick either path).
    for path, got in zip(paths[1:], tree.log_scores[1:], strict=True):
        assert math.isclose(got, scored[path], abs_tol=1e-9), path
    top = sorted(scored.values(), reverse=True)[: tree.num_nodes]
    assert tree.log_scores[1:] == pytest.approx(top)
    assert tree.num_nodes == min(12, len(scored))



def test_a_hint_takes_its_probability_and_reaches_past_the_drafter(compiler):  # noqa: F811
    """A hint of 6 tokens (a one-path lookup draft), the drafter 2 positions
    deep: at a depth the drafter reaches, the hint's token takes its
    probability plus the drafter's share of the rest; past it, its own."""
    grammar = grammar_for(compiler, r"[a-c]{8}")
    log_probs = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    token_ids = np.array([[ord("a"), ord("b"), ord("9")], [ord("c"), ord("b"), ord("a")]])
    hint = list(b"bcabca")
    probs = [0.9, 0.8, 0.9, 0.7, 0.9, 0.6]
    tree = build_grammar_tree(log_probs, token_ids, 10, ord("x"),
                              GrammarCursor(grammar, VOCAB), max_depth=10,
                              lookup=LookupDraft.chain(hint, probs))
    paths = tree_paths(tree)
    score = dict(zip(paths, tree.log_scores, strict=True))
    # Root: 'a' and 'b' allowed ('9' is not): q' = 0.625, 0.375.
    path_probs = [0.9 + 0.1 * 0.375, 0.8 + 0.2 * 0.6, *probs[2:]]
    for k in range(1, len(hint) + 1):
        assert math.isclose(score[tuple(hint[:k])], math.log(math.prod(path_probs[:k])))
    assert math.isclose(score[(ord("a"),)], math.log(0.1 * 0.625))
    # Depth 2 under the hint's 'b': 'b' gets the drafter's share of 0.2.
    assert math.isclose(score[(ord("b"), ord("b"))], math.log(path_probs[0] * 0.2 * 0.3))
    assert tree.num_nodes == 10


def test_a_hint_stops_where_the_grammar_rejects_it(compiler):  # noqa: F811
    grammar = grammar_for(compiler, r"[a-c]{8}")
    log_probs = np.zeros((0, 0))
    token_ids = np.zeros((0, 0), dtype=np.int64)
    tree = build_grammar_tree(log_probs, token_ids, 10, ord("x"),
                              GrammarCursor(grammar, VOCAB), max_depth=10,
                              lookup=LookupDraft.chain(b"ab9c", [0.8] * 4))
    # No drafted position: the tree is the hint's allowed prefix alone.
    assert tree.tokens[1:] == list(b"ab") and tree.parents[1:] == [0, 1]
    for bad in ([1.5], []):
        with pytest.raises(ValueError, match="probabilit"):
            LookupDraft.chain([1], bad)
