# SPDX-License-Identifier: Apache-2.0
"""Tree construction: vectorized builder == reference heap == brute force.

The builder under test is the ``build`` fixture, :func:`build_ddtree`; another
builder with its contract runs the same tests by overriding the fixture.
"""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from vllm_ddtree.references import build_ddtree_reference
from vllm_ddtree.tree import (
    DraftTree,
    build_ddtree,
    draft_top_k,
    pack_visibility,
    tree_from_parents,
    tree_from_parents_host,
    tree_from_parents_numpy,
)

FIELDS = [
    "tokens",
    "parents",
    "depths",
    "scores",
    "num_nodes",
    "retrieve_index",
    "retrieve_next_token",
    "retrieve_next_sibling",
    "visibility",
    "visibility_packed",
]


@pytest.fixture
def build():
    """The builder under test."""
    return build_ddtree


def assert_same_tree(a: DraftTree, b: DraftTree) -> None:
    assert a.max_depth == b.max_depth
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, (name, x.shape, y.shape)
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        assert torch.equal(x, y), name


def random_logits(
    seed: int, num_reqs: int, depth: int, vocab: int, kind: str
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, depth, vocab, generator=g) * 3
    if kind == "ties":  # many exactly equal logits and float32 score ties
        logits = torch.round(logits)
    elif kind == "certain":  # log-prob exactly 0 at rank 0: child ties its parent
        logits[..., 0] += 500.0
    elif kind == "uniform":
        logits = torch.zeros_like(logits)
    return logits


CASES = [
    # (num_reqs, L, V, B)
    (1, 1, 2, 0),
    (1, 1, 2, 1),
    (2, 3, 2, 100),  # B larger than the 2 + 4 + 8 possible nodes
    (3, 4, 5, 1),
    (3, 4, 5, 7),
    (2, 5, 7, 33),
    (4, 6, 16, 64),
    (2, 15, 64, 256),
    (1, 3, 3, 39),  # exactly every possible node
]


@pytest.mark.parametrize("kind", ["random", "ties", "certain", "uniform"])
@pytest.mark.parametrize("num_reqs,depth,vocab,budget", CASES)
def test_vectorized_equals_reference(kind, num_reqs, depth, vocab, budget, build):
    for seed in range(3):
        logits = random_logits(seed, num_reqs, depth, vocab, kind)
        roots = torch.arange(num_reqs) + 1
        fast = build(logits, budget, roots)
        ref = build_ddtree_reference(logits, budget, roots.tolist())
        assert_same_tree(fast, ref)
        possible = sum(vocab**d for d in range(1, depth + 1))
        assert fast.num_nodes.tolist() == [min(budget, possible)] * num_reqs
        assert fast.num_rows == budget + 1
        assert fast.tokens[:, 0].tolist() == roots.tolist()


def test_random_sweep_vectorized_equals_reference(build):
    rng = np.random.default_rng(0)
    for seed in range(150):
        num_reqs = int(rng.integers(1, 5))
        depth = int(rng.integers(1, 7))
        vocab = int(rng.integers(2, 12))
        budget = int(rng.integers(0, 60))
        kind = ["random", "ties", "certain"][seed % 3]
        logits = random_logits(seed, num_reqs, depth, vocab, kind)
        assert_same_tree(
            build(logits, budget),
            build_ddtree_reference(logits, budget),
        )


def test_per_request_budgets(build):
    logits = random_logits(7, 4, 5, 9, "random")
    budgets = [0, 3, 17, 40]
    fast = build(logits, torch.tensor(budgets), max_budget=40)
    ref = build_ddtree_reference(logits, budgets)
    assert_same_tree(fast, ref)
    assert fast.num_nodes.tolist() == budgets
    # Each request's tree equals the one built alone with its own budget.
    for b, budget in enumerate(budgets):
        alone = build(logits[b : b + 1], budget)
        n = budget + 1
        assert torch.equal(fast.tokens[b, :n], alone.tokens[0])
        assert torch.equal(fast.parents[b, :n], alone.parents[0])


def brute_force_top(logits_row: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """All prefixes scored with the builders' float32 accumulation; best `budget`."""
    depth, vocab = logits_row.shape
    lp = torch.log_softmax(logits_row.float(), dim=-1).numpy()
    scored = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            s = np.float32(0.0)
            for i, tok in enumerate(path):
                s = np.float32(s + lp[i, tok])
            scored.append((-float(s), path))
    scored.sort()
    return [p for _, p in scored[:budget]]


def tree_paths(tree: DraftTree, b: int) -> set[tuple[int, ...]]:
    paths = set()
    for i in range(1, int(tree.num_nodes[b]) + 1):
        path, node = [], i
        while node > 0:
            path.append(int(tree.tokens[b, node]))
            node = int(tree.parents[b, node])
        paths.add(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("depth,vocab", [(1, 5), (2, 4), (3, 3), (4, 2)])
def test_node_set_is_top_budget_by_brute_force(depth, vocab, build):
    for seed in range(4):
        logits = random_logits(100 + seed, 1, depth, vocab, "random")
        possible = sum(vocab**d for d in range(1, depth + 1))
        for budget in sorted({1, 2, 5, possible // 2, possible, possible + 3}):
            tree = build(logits, budget)
            assert tree_paths(tree, 0) == set(brute_force_top(logits[0], budget))


@pytest.mark.parametrize("max_children", [1, 2, 3])
def test_max_children_limits_ranks_per_depth(max_children, build):
    """max_children=K: the top-B prefixes whose every token is in its depth's top K."""
    for seed in range(4):
        logits = random_logits(200 + seed, 2, 4, 5, "random")
        for budget in (1, 6, 30, 200):
            fast = build(logits, budget, max_children=max_children)
            assert_same_tree(
                fast, build_ddtree_reference(logits, budget, max_children=max_children)
            )
            for b in range(2):
                allowed = logits[b].topk(max_children, dim=-1).indices
                want = [
                    p
                    for p in brute_force_top(logits[b], 10**6)
                    if all(t in allowed[i] for i, t in enumerate(p))
                ][:budget]
                assert tree_paths(fast, b) == set(want)
    # K = 1 is the argmax chain.
    chain = build(logits, 3, max_children=1)
    assert chain.parents[0].tolist() == [-1, 0, 1, 2]
    assert chain.tokens[0, 1:].tolist() == logits[0, :3].argmax(-1).tolist()


def test_max_children_rejects_bad_values(build):
    logits = random_logits(0, 1, 2, 3, "random")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_children"):
            build(logits, 4, max_children=bad)


def test_tree_invariants(build):
    logits = random_logits(3, 3, 8, 20, "ties")
    budget = 50
    tree = build(logits, budget)
    lp, _ = draft_top_k(logits, min(budget, 20))
    lp_full = torch.log_softmax(logits.float(), dim=-1)
    for b in range(3):
        n = int(tree.num_nodes[b])
        children: dict[int, list[int]] = {}
        for i in range(1, n + 1):
            p = int(tree.parents[b, i])
            assert 0 <= p < i  # parent before child: prefix-closed, topological
            assert tree.depths[b, i] == tree.depths[b, p] + 1
            children.setdefault(p, []).append(i)
            expected = (
                torch.tensor(tree.scores[b, p].item(), dtype=torch.float32)
                + lp_full[b, int(tree.depths[b, i]) - 1, int(tree.tokens[b, i])]
            )
            assert torch.isclose(tree.scores[b, i], expected, atol=1e-5)
            assert tree.scores[b, i] <= tree.scores[b, p]
        # Scores are non-increasing in node order (pop order of the heap).
        assert torch.all(tree.scores[b, 2 : n + 1] <= tree.scores[b, 1:n])
        for p, kids in children.items():
            toks = [int(tree.tokens[b, k]) for k in kids]
            assert len(set(toks)) == len(toks)  # distinct sibling tokens
            # LCRS: first child then siblings in rank (= index) order.
            walk, c = [], int(tree.retrieve_next_token[b, p])
            while c != -1:
                walk.append(c)
                c = int(tree.retrieve_next_sibling[b, c])
            assert walk == kids
            # Siblings ordered by draft log-prob.
            dep = int(tree.depths[b, kids[0]]) - 1
            probs = [float(lp_full[b, dep, t]) for t in toks]
            assert probs == sorted(probs, reverse=True)
        for i in range(n + 1, tree.num_rows):  # padding is inert
            assert tree.parents[b, i] == -1 and tree.retrieve_next_token[b, i] == -1
            assert tree.visibility[b, i].nonzero().flatten().tolist() == [i]
        for i in range(n + 1):
            anc, node = {i}, i
            while node > 0:
                node = int(tree.parents[b, node])
                anc.add(node)
            assert set(tree.visibility[b, i].nonzero().flatten().tolist()) == anc
        assert torch.equal(
            tree.retrieve_index[b], b * tree.num_rows + torch.arange(tree.num_rows)
        )


def test_packed_visibility_bits():
    vis = torch.rand(2, 70, 70) < 0.5
    packed = pack_visibility(vis)
    assert packed.shape == (2, 70, 3) and packed.dtype == torch.int32
    unpacked = torch.zeros_like(vis)
    for j in range(70):
        word = packed[..., j // 32].to(torch.int64) & 0xFFFFFFFF
        unpacked[..., j] = ((word >> (j % 32)) & 1).bool()
    assert torch.equal(unpacked, vis)


def test_position_offsets_are_depths(build):
    tree = build(random_logits(1, 2, 4, 6, "random"), 12)
    assert torch.equal(tree.position_offsets, tree.depths)
    assert int(tree.depths.max()) <= 4


@pytest.mark.parametrize(
    "logits,budget,match",
    [
        (torch.zeros(2, 3), 4, "draft_logits must have shape"),
        (torch.zeros(1, 2, 3, dtype=torch.int64), 4, "floating-point"),
        (torch.zeros(1, 0, 3), 4, "L >= 1"),
        (torch.tensor([[[0.0, float("nan")]]]), 4, "draft_logits contains NaN"),
        (
            torch.tensor([[[0.0, float("inf")]]]),
            4,
            "draft_logits contains NaN or infinite",
        ),
        (
            torch.tensor([[[0.0, float("-inf")]]]),
            4,
            "draft_logits contains NaN or infinite",
        ),
        (torch.zeros(1, 2, 3), -1, "budget must be >= 0"),
        (torch.zeros(1, 2, 3), 2.5, "budget must be an int"),
        (
            torch.zeros(2, 2, 3),
            torch.tensor([1, 2, 3]),
            r"budget must be an int or a \[num_reqs=2\]",
        ),
        (torch.zeros(2, 2, 3), torch.tensor([1, -2]), "budget must be >= 0"),
        (
            torch.zeros(2, 2, 3),
            torch.tensor([1.0, 2.0]),
            "budget must be an integer tensor",
        ),
    ],
)
def test_bad_input(logits, budget, match, build):
    with pytest.raises(ValueError, match=match):
        build(logits, budget)


def random_parent_lists(rng, num_reqs, max_nodes):
    """Random trees as the worker gets them: per request the root (parent -1)
    then nodes whose parents come before them."""
    parents, tokens, scores = [], [], []
    for _ in range(num_reqs):
        n = int(rng.integers(1, max_nodes + 1))
        chainy = rng.random() < 0.5  # deep chains as well as bushy trees
        parents.append(
            [-1]
            + [
                i - 1 if chainy and rng.random() < 0.8 else int(rng.integers(0, i))
                for i in range(1, n)
            ]
        )
        tokens.append(rng.integers(0, 1000, n).tolist())
        scores.append((-rng.random(n)).tolist())
    return parents, tokens, scores


@pytest.mark.parametrize("seed", range(40))
def test_host_builder_equals_the_loop_builder(seed):
    """``tree_from_parents_numpy`` (pointer jumping) and the worker's
    ``tree_from_parents_host`` against the loop reference
    ``tree_from_parents``: every field, on random trees of 1..40 nodes per
    request, batches of 1..7, with and without scores."""
    rng = np.random.default_rng(seed)
    parents, tokens, scores = random_parent_lists(
        rng, int(rng.integers(1, 8)), int(rng.integers(1, 41))
    )
    from vllm_ddtree.vllm_adapter.step import max_depth

    depth = max_depth(parents)
    given = scores if seed % 2 else None
    want = tree_from_parents(parents, tokens, max(depth, 1), given)
    for build in (tree_from_parents_numpy, tree_from_parents_host):
        got = build(parents, tokens, max(depth, 1), given)
        for field in dataclasses.fields(want):
            a, b = getattr(want, field.name), getattr(got, field.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), field.name
            else:
                assert a == b, field.name


@pytest.mark.parametrize(
    "parents, tokens, max_depth_, message",
    [
        ([[0, 0]], [[1, 2]], 2, "request 0: needs a root"),
        ([[-1, 0], [-1, 1]], [[1, 2], [1, 2]], 2, "request 1: node 1 has parent 1"),
        ([[-1, 0, 1]], [[1, 2, 3]], 1, "request 0: node 2 is deeper than max_depth=1"),
        ([[-1, 0]], [[1]], 2, "one token per node"),
    ],
)
def test_host_builder_refuses_what_the_loop_builder_refuses(
    parents, tokens, max_depth_, message
):
    for build in (tree_from_parents, tree_from_parents_numpy):
        with pytest.raises(ValueError, match=message):
            build(parents, tokens, max_depth_)


@pytest.mark.parametrize("max_children", [None, 3])
def test_device_tree_path_runs_without_host_reads(max_children):
    """A drafting step's device-side tree work (the drafter's top-K, the auto
    budget's allocation, the builder at a fixed or per-request budget) runs on
    the meta device, which has no data: no ``item()``, ``tolist()``,
    ``nonzero()`` or data-dependent shape anywhere (what CUDA-graph capture
    needs, and no host sync per step on a GPU); the output shapes follow the
    batch shape alone."""
    from vllm_ddtree.budget import allocate_nodes

    num_reqs, depth, vocab, budget = 3, 6, 50, 8
    logits = torch.empty(num_reqs, depth, vocab, device="meta")
    roots = torch.empty(num_reqs, dtype=torch.int64, device="meta")
    log_probs, token_ids = draft_top_k(logits, budget)
    assert log_probs.shape == token_ids.shape == (num_reqs, depth, budget)
    values = torch.empty(num_reqs, budget, device="meta")
    seconds = torch.empty(num_reqs * budget + 1, device="meta")
    counts, throughput = allocate_nodes(values, seconds)
    assert counts.shape == (num_reqs,) and throughput.shape == ()
    for tree in (
        build_ddtree(logits, budget, roots, max_children=max_children, validate=False),
        build_ddtree(
            logits, counts, roots, max_budget=budget, max_children=max_children,
            top_k=(log_probs, token_ids), validate=False,
        ),  # fmt: skip
    ):
        assert tree.tokens.shape == (num_reqs, budget + 1)
        assert tree.visibility.shape == (num_reqs, budget + 1, budget + 1)
    # A per-request budget without its static capacity reads budget.max().
    with pytest.raises(RuntimeError, match="meta"):
        build_ddtree(logits, counts, roots, validate=False)
