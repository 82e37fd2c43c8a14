# SPDX-License-Identifier: Apache-2.0
"""The union tree of the drafter's distributions and a lookup tree
(``lookup_tree.py``) against brute force.

The oracle scores every token path up to ``max_depth`` with the mixture rule,
written here path by path (walk the lookup tree along the path; where the path
leaves it, the drafter alone), and keeps the ``B`` best: random continuous
probabilities leave no ties. The builder sees only the drafter's top
``min(B, V)`` tokens per depth, the oracle the whole vocabulary (DDTree's
Lemma 1, kept by the mixture). Without a lookup the builder is DDTree's
(``tree.build_ddtree``).
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from vllm_ddtree.lookup_tree import (
    FROM_DRAFTER,
    FROM_LOOKUP,
    LookupDraft,
    build_union_tree,
)
from vllm_ddtree.tree import build_ddtree, draft_top_k


def random_lookup(rng: random.Random, vocab: int, size: int, deepest: int):
    """A random lookup tree: ``size`` nodes, siblings' tokens distinct, their
    probabilities summing below 1 (or exactly 1 for a lone child, sometimes)."""
    tokens, parents, depths = [], [], {-1: 0}
    for i in range(size):
        options = [-1] + [j for j in range(i) if depths[j] < deepest]
        parent = rng.choice(options)
        used = {t for t, p in zip(tokens, parents, strict=True) if p == parent}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            break
        tokens.append(rng.choice(free))
        parents.append(parent)
        depths[len(tokens) - 1] = depths[parent] + 1
    probs = [0.0] * len(tokens)
    for parent in set(parents):
        kids = [i for i, p in enumerate(parents) if p == parent]
        if len(kids) == 1 and rng.random() < 0.3:
            probs[kids[0]] = 1.0
            continue
        weights = [rng.random() + 0.05 for _ in kids]
        total = sum(weights) / rng.uniform(0.3, 0.95)
        for k, w in zip(kids, weights, strict=True):
            probs[k] = w / total
    return LookupDraft(tokens, parents, probs)


def path_score(path, q, lookup: LookupDraft | None) -> float:
    """log p(path) under the mixture rule, walked token by token."""
    kids = lookup.children() if lookup is not None else {}
    at, on, score = -1, lookup is not None, 0.0
    for depth, token in enumerate(path):
        children = {lookup.tokens[c]: c for c in kids.get(at, [])} if on else {}
        taken = sum(lookup.probs[c] for c in children.values())
        drafter = float(q[depth, token]) if depth < q.shape[0] else 0.0
        prob = (1.0 - taken) * drafter
        if token in children:
            prob += lookup.probs[children[token]]
            at = children[token]
        else:
            on = False
        if prob <= 0.0:
            return -math.inf
        score += math.log(prob)
    return score


def brute_force(q, lookup, budget, max_depth):
    vocab = q.shape[1]
    scored = []
    for depth in range(1, max_depth + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            s = path_score(path, q, lookup)
            if s > -math.inf:
                scored.append((s, path))
    scored.sort(key=lambda x: -x[0])
    return {path: s for s, path in scored[:budget]}


def tree_paths(tree) -> dict[tuple[int, ...], float]:
    paths = {0: ()}
    for i in range(1, len(tree.tokens)):
        paths[i] = paths[tree.parents[i]] + (tree.tokens[i],)
    return {paths[i]: tree.log_scores[i] for i in range(1, len(tree.tokens))}


def union(q, lookup, budget, max_depth):
    log_q = torch.from_numpy(np.log(q)).float()[None]
    lp, ids = draft_top_k(log_q, min(budget, q.shape[1]))
    depths = {-1: 0}
    shares = []  # the drafter's log q of each lookup token at its depth
    for i, (token, parent) in enumerate(zip(lookup.tokens, lookup.parents, strict=True)):
        depths[i] = depths[parent] + 1
        d = depths[i] - 1
        shares.append(math.log(q[d, token]) if d < q.shape[0] else -math.inf)
    return build_union_tree(
        lp[0].numpy(), ids[0].numpy(), budget, 7, lookup, max_depth, shares
    )


@pytest.mark.parametrize("seed", range(40))
def test_top_b_equals_brute_force(seed):
    rng = random.Random(seed)
    gen = np.random.default_rng(seed)
    depth_limit, vocab = 3, 5
    q = gen.dirichlet(np.full(vocab, 0.4), size=depth_limit)  # [L, V]
    lookup = random_lookup(rng, vocab, rng.randrange(1, 9), deepest=5)
    max_depth = rng.choice([depth_limit, 5])
    budget = rng.randrange(1, 24)
    tree = union(q, lookup, budget, max_depth)
    want = brute_force(q, lookup, budget, max_depth)
    got = tree_paths(tree)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for path, score in got.items():
        assert score == pytest.approx(want[path], abs=1e-5)
    # Best-first, parents first, each node's source as proposed.
    assert all(tree.parents[i] < i for i in range(1, len(tree.tokens)))
    for i in range(1, len(tree.tokens)):
        on_lookup = tree.lookup_nodes[i] >= 0
        assert bool(tree.sources[i] & FROM_LOOKUP) == on_lookup
        assert on_lookup or tree.sources[i] == FROM_DRAFTER
        if tree.sources[i] & FROM_DRAFTER:
            assert tree.depths[i] <= depth_limit


def test_a_lookup_path_past_the_drafter_depth_is_kept_whole():
    """A confident lookup path of 6 tokens past a 2-deep drafter: all of it is
    in a budget-8 tree, and the drafter's rank-0 tokens too."""
    q = np.array([[0.7, 0.1, 0.1, 0.05, 0.05], [0.6, 0.2, 0.1, 0.05, 0.05]])
    path = [3, 4, 2, 1, 4, 3]
    lookup = LookupDraft(path, list(range(-1, len(path) - 1)), [0.9] * len(path))
    tree = union(q, lookup, 8, max_depth=8)
    got = tree_paths(tree)
    assert tuple(path) in got
    assert (0,) in got  # the drafter's best first token, beside the lookup
    # Past the drafter's depth the lookup alone proposes.
    deep = [i for i in range(1, len(tree.tokens)) if tree.depths[i] > 2]
    assert len(deep) == 4 and all(tree.sources[i] == FROM_LOOKUP for i in deep)


def test_a_token_both_propose_is_one_node_with_both_shares():
    q = np.array([[0.5, 0.3, 0.1, 0.05, 0.05]])
    lookup = LookupDraft([1], [-1], [0.4])
    tree = union(q, lookup, 3, max_depth=1)
    assert sorted(tree.tokens[1:]) == [0, 1, 2]
    node = tree.tokens.index(1)
    assert tree.sources[node] == FROM_DRAFTER | FROM_LOOKUP
    assert math.exp(tree.log_scores[node]) == pytest.approx(0.4 + 0.6 * 0.3)
    assert math.exp(tree.log_scores[tree.tokens.index(0)]) == pytest.approx(0.6 * 0.5)


@pytest.mark.parametrize("seed", range(5))
def test_without_lookup_it_is_ddtrees_tree(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 4, 50, generator=g) * 2
    budget = 12
    want = build_ddtree(logits, budget, torch.tensor([7]))
    lp, ids = draft_top_k(logits, budget)
    tree = build_union_tree(lp[0].numpy(), ids[0].numpy(), budget, 7)
    n = int(want.num_nodes[0]) + 1
    assert tree.tokens == want.tokens[0, :n].tolist()
    assert tree.parents == want.parents[0, :n].tolist()
    assert all(s == FROM_DRAFTER for s in tree.sources[1:])


@pytest.mark.parametrize(
    "tokens, parents, probs, message",
    [
        ([1, 2], [-1], [0.5, 0.5], "one parent and one probability"),
        ([1], [0], [0.5], "need -1 <= parent < 0"),
        ([1], [-1], [0.0], "need 0 < p <= 1"),
        ([1], [-1], [1.5], "need 0 < p <= 1"),
        ([1, 2], [-1, -1], [0.7, 0.6], "sum past 1"),
        ([1, 1], [-1, -1], [0.3, 0.3], "repeats token 1"),
    ],
)
def test_bad_lookup_drafts_are_refused(tokens, parents, probs, message):
    with pytest.raises(ValueError, match=message):
        LookupDraft(tokens, parents, probs)
