# SPDX-License-Identifier: Apache-2.0
"""Tree verification: exact results, edge cases, seeding, mixed batches, bad input."""

import pytest
import torch

from vllm_ddtree.sampling import TreeSamplingParams, draw_coins
from vllm_ddtree.tree import build_ddtree, tree_from_parents
from vllm_ddtree.verify import verify_tree

METHODS = ["sample_walk", "rejection"]
NEG = -1e4

# root(7) -> a(1) -> c(3) -> e(5)
#         -> b(2) -> d(4)
#         -> f(6)
PARENTS = [-1, 0, 0, 1, 2, 3, 0]
TOKENS = [7, 1, 2, 3, 4, 5, 6]
VOCAB = 8


def hand_tree(num_reqs=1):
    return tree_from_parents([PARENTS] * num_reqs, [TOKENS] * num_reqs, max_depth=3)


def peaked_logits(choices: dict[int, int], num_rows=7, gap=60.0) -> torch.Tensor:
    """Row i puts (almost) all mass on choices[i] (default token 0)."""
    logits = torch.full((1, num_rows, VOCAB), NEG)
    for row in range(num_rows):
        logits[0, row, choices.get(row, 0)] = gap
    return logits


def greedy_walk_oracle(parents, tokens, logits_row_argmax):
    """Plain-Python greedy walk on a hand tree."""
    path, node = [0], 0
    while True:
        want = logits_row_argmax[node]
        kids = [i for i, p in enumerate(parents) if p == node]
        nxt = [k for k in kids if tokens[k] == want]
        if not nxt:
            return path, [tokens[i] for i in path[1:]] + [want]
        node = nxt[0]
        path.append(node)


@pytest.mark.parametrize("params_kind", ["greedy", "sample_walk", "rejection"])
@pytest.mark.parametrize(
    "choices,path,committed",
    [
        (
            {0: 1, 1: 3, 3: 5, 5: 2},
            [0, 1, 3, 5],
            [1, 3, 5, 2],
        ),  # full depth, bonus at leaf
        ({0: 2, 2: 4, 4: 7}, [0, 2, 4], [2, 4, 7]),  # second sibling, stop at leaf
        ({0: 6, 6: 3}, [0, 6], [6, 3]),  # third sibling, leaf
        (
            {0: 1, 1: 4},
            [0, 1],
            [1, 4],
        ),  # accepted then mismatch (4 is b's child, not a's)
        ({0: 5}, [0], [5]),  # immediate correction
    ],
)
def test_exact_paths(params_kind, choices, path, committed):
    tree = hand_tree()
    logits = peaked_logits(choices)
    if params_kind == "greedy":
        out = verify_tree(tree, logits)
    else:
        params = TreeSamplingParams.from_lists([1.0])
        out = verify_tree(tree, logits, params, method=params_kind)
    width = 4
    assert out.accepted_indices.tolist() == [path + [-1] * (width - len(path))]
    assert out.committed_tokens.tolist() == [
        committed + [-1] * (width - len(committed))
    ]
    assert out.num_accepted.tolist() == [len(path) - 1]


def test_root_only_tree_emits_one_token():
    logits = torch.randn(3, 4, 10)
    tree = build_ddtree(logits, 0, torch.tensor([1, 2, 3]))
    target = torch.randn(3, 1, 10)
    out = verify_tree(tree, target)
    assert out.num_accepted.tolist() == [0, 0, 0]
    assert out.accepted_indices[:, 0].tolist() == [0, 0, 0]
    assert out.committed_tokens[:, 0].tolist() == target[:, 0].argmax(-1).tolist()
    assert (out.committed_tokens[:, 1:] == -1).all()


def random_case(seed, num_reqs=6, depth=4, vocab=12, budget=20, agree=0.8):
    """Built trees and target logits that often agree with the draft."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(num_reqs, depth, vocab, generator=g) * 2
    tree = build_ddtree(
        draft, budget, torch.randint(0, vocab, (num_reqs,), generator=g)
    )
    rows = tree.num_rows
    target = torch.randn(num_reqs, rows, vocab, generator=g) * 2
    # Row of node i leans towards the draft's favourite at depth(i) + 1.
    for b in range(num_reqs):
        for i in range(rows):
            d = int(tree.depths[b, i])
            if d < depth and torch.rand((), generator=g) < agree:
                target[b, i, draft[b, d].argmax()] += 6
    return tree, target


def test_greedy_matches_python_oracle():
    for seed in range(20):
        tree, target = random_case(seed)
        out = verify_tree(tree, target)
        for b in range(tree.num_reqs):
            n = int(tree.num_nodes[b]) + 1
            path, committed = greedy_walk_oracle(
                tree.parents[b, :n].tolist(),
                tree.tokens[b, :n].tolist(),
                target[b, :n].argmax(-1).tolist(),
            )
            got = out.accepted_indices[b]
            assert got[: len(path)].tolist() == path and (got[len(path) :] == -1).all()
            assert out.committed_tokens[b, : len(committed)].tolist() == committed
            assert out.num_accepted[b] == len(path) - 1


@pytest.mark.parametrize("method", METHODS)
def test_low_temperature_equals_greedy(method):
    for seed in range(10):
        tree, target = random_case(seed)
        target = target * 50  # top-2 gaps >> T
        greedy = verify_tree(tree, target)
        params = TreeSamplingParams.from_lists([1e-3] * tree.num_reqs)
        sampled = verify_tree(tree, target, params, method=method)
        assert torch.equal(greedy.committed_tokens, sampled.committed_tokens)
        assert torch.equal(greedy.accepted_indices, sampled.accepted_indices)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("coin", [0.0, 1.0 - 2**-24])
def test_zero_mass_children_never_accepted(method, coin):
    tree = hand_tree()
    logits = torch.zeros(1, 7, VOCAB)
    logits[0, 0, 1] = 4.0  # root: token 1 (child a) is the top token
    logits[0, 0, 6] = 3.0
    # top_k=1 leaves only token 1 at the root: b (2) and f (6) have zero mass.
    params = TreeSamplingParams.from_lists([1.0], top_k=[1])
    coins = (torch.full((1, 7), coin), torch.full((1,), coin))
    out = verify_tree(tree, logits, params, method=method, coins=coins)
    assert out.committed_tokens[0, 0] == 1 and out.accepted_indices[0, 1] == 1
    # At node a every token is equally likely; with top_p the child token 3 survives.
    logits[0, 1, 3] = -1e9  # zero mass for child c at node a
    out = verify_tree(tree, logits, params, method=method, coins=coins)
    assert out.num_accepted.item() == 1
    assert out.committed_tokens[0, 1] != 3  # the zero-mass child token is never emitted


@pytest.mark.parametrize("method", METHODS)
def test_coin_endpoints_pick_first_and_last_positive_mass(method):
    # Root has no children here (B=0): the bonus is an inverse-CDF draw.
    tree = tree_from_parents([[-1]], [[0]], max_depth=2)
    logits = torch.tensor(
        [[[float("-inf"), 0.0, 1.0, float("-inf"), 0.5, float("-inf")]]]
    )
    params = TreeSamplingParams.from_lists([1.0])
    for coin, want in ((0.0, 1), (1.0 - 2**-24, 4)):
        coins = (torch.full((1, 1), coin), torch.full((1,), coin))
        out = verify_tree(tree, logits, params, method=method, coins=coins)
        assert out.committed_tokens[0, 0] == want


@pytest.mark.parametrize("method", METHODS)
def test_seeded_requests_reproduce_and_ignore_the_batch(method):
    tree, target = random_case(3, num_reqs=4, vocab=6)
    target = target * 0.3  # high entropy
    make = lambda seeds: TreeSamplingParams.from_lists([1.0] * 4, seeds=seeds)  # noqa: E731
    a = verify_tree(tree, target, make([11, 12, 13, 14]), method=method)
    b = verify_tree(tree, target, make([11, 12, 13, 14]), method=method)
    assert torch.equal(a.committed_tokens, b.committed_tokens)
    assert torch.equal(a.accepted_indices, b.accepted_indices)
    # Request 0 keeps its result whatever the others do.
    for others in range(5):
        c = verify_tree(
            tree, target, make([11, None, 100 + others, None]), method=method
        )
        assert torch.equal(c.committed_tokens[0], a.committed_tokens[0])
    outs = {
        tuple(
            verify_tree(tree, target, make([s, 12, 13, 14]), method=method)
            .committed_tokens[0]
            .tolist()
        )
        for s in range(20)
    }
    assert len(outs) > 1  # the seed matters


@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_equals_requests_alone(method):
    tree, target = random_case(5, num_reqs=5, vocab=10)
    params = TreeSamplingParams.from_lists(
        temperature=[0.0, 1.0, 0.7, 0.0, 1.3],
        top_k=[-1, 3, 0, 2, 5],
        top_p=[1.0, 0.9, 0.5, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.1, 0.3, 0.05],
    )
    coins = draw_coins(5, tree.num_rows, "cpu")
    batch = verify_tree(tree, target, params, method=method, coins=coins)
    for b in range(5):
        sub = tree_from_parents(
            [tree.parents[b].tolist()[: int(tree.num_nodes[b]) + 1]],
            [tree.tokens[b].tolist()[: int(tree.num_nodes[b]) + 1]],
            tree.max_depth,
        )
        n = sub.num_rows
        alone = TreeSamplingParams.from_lists(
            [params.temperature[b].item()],
            [int(params.top_k[b])],
            [params.top_p[b].item()],
            [params.min_p[b].item()],
        )
        out = verify_tree(
            sub,
            target[b : b + 1, :n],
            alone,
            method=method,
            coins=(coins[0][b : b + 1, :n], coins[1][b : b + 1]),
        )
        assert torch.equal(out.committed_tokens[0], batch.committed_tokens[b])
        assert torch.equal(out.accepted_indices[0], batch.accepted_indices[b])
    # Greedy requests in the mixed batch are exact argmax walks.
    greedy = verify_tree(tree, target)
    for b in (0, 3):
        assert torch.equal(batch.committed_tokens[b], greedy.committed_tokens[b])


def test_threshold_single_relaxation_accepts_likely_child():
    # Lossy by design: a child with target prob >= threshold_single is accepted
    # whatever the coin.
    tree = hand_tree()
    logits = torch.zeros(1, 7, VOCAB)
    logits[0, 0, 2] = 1.5  # child b has prob ~0.35 at the root
    params = TreeSamplingParams.from_lists([1.0])
    coins = (torch.full((1, 7), 0.99), torch.full((1,), 0.5))
    exact = verify_tree(tree, logits, params, method="rejection", coins=coins)
    assert exact.num_accepted.item() == 0
    relaxed = verify_tree(
        tree, logits, params, method="rejection", coins=coins, threshold_single=0.3
    )
    assert relaxed.accepted_indices[0, 1] == 2


def test_output_contract_invariants():
    for seed in range(10):
        tree, target = random_case(seed, num_reqs=8)
        params = TreeSamplingParams.from_lists([0.0, 1.0] * 4)
        for method in METHODS:
            out = verify_tree(tree, target, params, method=method)
            for b in range(8):
                n = int(out.num_accepted[b])
                acc = out.accepted_indices[b]
                assert (acc[: n + 1] >= 0).all() and (acc[n + 1 :] == -1).all()
                assert (out.committed_tokens[b, : n + 1] >= 0).all()
                assert (out.committed_tokens[b, n + 1 :] == -1).all()
                for j in range(1, n + 1):  # a path: parent links and depths
                    assert tree.parents[b, acc[j]] == acc[j - 1]
                    assert tree.depths[b, acc[j]] == j
                    assert out.committed_tokens[b, j - 1] == tree.tokens[b, acc[j]]


def _good():
    tree = hand_tree()
    return tree, torch.randn(1, 7, VOCAB)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t, logits: (t, logits[0]), "target_logits must have shape"),
        (lambda t, logits: (t, logits[:, :5]), "expected"),
        (lambda t, logits: (t, logits.long()), "floating point"),
        (lambda t, logits: (t, logits.to("meta")), "is on meta"),
        (
            lambda t, logits: (
                t,
                logits.index_fill(2, torch.tensor([3]), float("nan")),
            ),
            "NaN",
        ),
        (
            lambda t, logits: (
                t,
                logits.index_fill(2, torch.tensor([3]), float("inf")),
            ),
            r"\+inf",
        ),
        (
            lambda t, logits: (
                t,
                logits.index_fill(1, torch.tensor([2]), float("-inf")),
            ),
            "every value is -inf",
        ),
    ],
)
def test_bad_logits(mutate, match):
    tree, logits = mutate(*_good())
    with pytest.raises(ValueError, match=match):
        verify_tree(tree, logits)


def test_bad_params_and_options():
    tree, logits = _good()
    with pytest.raises(ValueError, match="method"):
        verify_tree(tree, logits, method="leviathan")
    for name in ("threshold_single", "threshold_acc"):
        with pytest.raises(ValueError, match=name):
            verify_tree(tree, logits, **{name: 0.0})
    with pytest.raises(ValueError, match="temperature"):
        verify_tree(tree, logits, TreeSamplingParams(temperature=torch.tensor([-1.0])))
    with pytest.raises(ValueError, match="top_p"):
        verify_tree(
            tree, logits, TreeSamplingParams(torch.ones(1), top_p=torch.tensor([0.0]))
        )
    with pytest.raises(ValueError, match="top_k"):
        verify_tree(
            tree, logits, TreeSamplingParams(torch.ones(1), top_k=torch.tensor([-3]))
        )
    with pytest.raises(ValueError, match="min_p"):
        verify_tree(
            tree, logits, TreeSamplingParams(torch.ones(1), min_p=torch.tensor([2.0]))
        )
    with pytest.raises(ValueError, match=r"temperature must be a \[1\] tensor"):
        verify_tree(tree, logits, TreeSamplingParams(torch.ones(2)))
    with pytest.raises(ValueError, match="coins must be"):
        verify_tree(
            tree,
            logits,
            TreeSamplingParams(torch.ones(1)),
            coins=(torch.rand(1, 3), torch.rand(1)),
        )
    with pytest.raises(ValueError, match=r"coins must lie in \[0, 1\)"):
        verify_tree(
            tree,
            logits,
            TreeSamplingParams(torch.ones(1)),
            coins=(torch.ones(1, 7), torch.rand(1)),
        )
    with pytest.raises(ValueError, match="backend"):
        verify_tree(tree, logits, backend="fortran")


@pytest.mark.parametrize("method", METHODS)
def test_placeholder_tokens_are_never_accepted(method):
    # vLLM pads missing drafts with -1; such a node has no target mass.
    tree = tree_from_parents([[-1, 0, 1]], [[3, -1, -1]], max_depth=2)
    logits = torch.full((1, 3, VOCAB), -50.0)
    logits[:, :, 0] = 50.0  # token 0 takes all the mass: clamping -1 to 0 would accept
    params = TreeSamplingParams.from_lists([1.0])
    for coin in (0.0, 0.5, 1.0 - 2**-24):
        coins = (torch.full((1, 3), coin), torch.full((1,), coin))
        out = verify_tree(tree, logits, params, method=method, coins=coins)
        assert out.num_accepted.item() == 0 and out.committed_tokens[0, 0] == 0
    assert verify_tree(tree, logits).num_accepted.item() == 0


@pytest.mark.parametrize("all_greedy", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("method", METHODS)
def test_row_index_reads_rows_in_place(method, backend, all_greedy):
    """target_logits [M, V] + row_index [R, N + 1] (the runner's padded batches,
    read without a copy) == the same rows as [R, N + 1, V]; rows outside the
    index never matter (all greedy: the torch walk's one argmax over every
    row, then the index)."""
    import os

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs here only under TRITON_INTERPRET=1")
    if backend == "triton":
        pytest.importorskip("triton")
    tree, target = random_case(11, num_reqs=4, vocab=10)
    params = TreeSamplingParams.from_lists(
        temperature=[0.0, 1.0, 0.7, 1.3],
        top_k=[-1, 3, 0, 0],
        top_p=[1.0, 0.9, 1.0, 1.0],
    )
    if all_greedy:
        params = TreeSamplingParams.greedy(4)
    coins = draw_coins(4, tree.num_rows, "cpu")
    want = verify_tree(tree, target, params, method=method, coins=coins)
    num_reqs, rows, vocab = target.shape
    # The rows scattered among garbage rows (+inf would fail validation if read).
    order = torch.randperm(num_reqs * rows, generator=torch.Generator().manual_seed(3))
    flat = torch.full((num_reqs * rows + 5, vocab), 1e4)
    row_index = (order + 5).view(num_reqs, rows)
    flat[row_index.reshape(-1)] = target.reshape(-1, vocab)
    got = verify_tree(
        tree,
        flat,
        params,
        method=method,
        coins=coins,
        backend=backend,
        row_index=row_index,
    )
    for name in ("accepted_indices", "committed_tokens", "num_accepted"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(ValueError, match="row_index"):
        verify_tree(tree, flat, params, row_index=row_index[:, :-1])
    with pytest.raises(ValueError, match="outside"):
        verify_tree(tree, flat, params, row_index=row_index + 100)
