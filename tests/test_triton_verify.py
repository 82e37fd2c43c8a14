# SPDX-License-Identifier: Apache-2.0
"""Triton tree verification equals the torch reference, integer for integer.

Runs the kernel under TRITON_INTERPRET=1 on CPU (set before triton is imported).
Run with ``TRITON_INTERPRET=0`` on a CUDA machine to test the compiled kernel.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# Triton fixes interpret mode when each @triton.jit function is defined, so
# TRITON_INTERPRET must be set before anything imports triton: tests/conftest.py
# does it for the whole session.
if os.environ["TRITON_INTERPRET"] == "1" and not isinstance(
    triton.language.standard.max, InterpretedFunction
):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

import torch  # noqa: E402

from vllm_ddtree.ops.triton_verify import tree_verify_triton  # noqa: E402
from vllm_ddtree.sampling import TreeSamplingParams  # noqa: E402
from vllm_ddtree.tree import build_ddtree, tree_from_parents  # noqa: E402
from vllm_ddtree.verify import METHOD_IDS, verify_tree, verify_tree_torch  # noqa: E402

DEVICE = torch.device(
    "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"
)
ALMOST_ONE = 1.0 - 2.0**-24  # largest float32 below 1
NEG_INF = float("-inf")
# Greedy (0, 1e-6), plain, hot, cold (e underflows to 0 / denormals) requests.
TEMPERATURES = [0.0, 1.0, 0.5, 1.7, 1e-6, 0.05]

# (seed, requests, L, V, budget, block_v): multi-block vocab with a ragged tail,
# V = 2 with a budget above the 2 + 4 + 8 possible nodes, budgets 0 and 1.
CONFIGS = [
    (0, 6, 4, 50, 12, 16),
    (1, 6, 3, 2, 20, None),
    (2, 3, 5, 37, 0, 8),
    (3, 3, 2, 20, 1, None),
    (4, 6, 6, 64, 24, 32),
]


def make_case(seed, num_reqs, depth, vocab, budget):
    """A random tree, target logits biased toward its children, coins with edge values."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(num_reqs, depth, vocab, generator=g) * 2
    roots = torch.randint(0, vocab, (num_reqs,), generator=g)
    tree = build_ddtree(draft, budget, roots)
    rows = tree.num_rows
    logits = torch.randn(num_reqs, rows, vocab, generator=g) * 2

    # Bias each node's row toward its children's tokens so that walks go deep.
    b, i = torch.nonzero(tree.parents >= 0, as_tuple=True)
    where = (b, tree.parents[b, i], tree.tokens[b, i])
    bias = 5.0 * torch.rand(b.shape[0], generator=g)
    logits.index_put_(where, bias, accumulate=True)
    # Zero-mass children, and a zero-mass token 0 (strict inverse CDF with coin 0).
    dead = torch.rand(b.shape[0], generator=g) < 0.25
    logits[tuple(w[dead] for w in where)] = NEG_INF
    logits[::2, :, 0] = NEG_INF
    # The last request's root keeps a single token: all mass on its first child.
    first = int(tree.retrieve_next_token[-1, 0])
    if first >= 0:
        keep = int(tree.tokens[-1, first])
        logits[-1, 0] = NEG_INF
        logits[-1, 0, keep] = 1.0
    # Every row keeps some mass (an all -inf row is invalid input: NaN everywhere).
    last = logits[..., -1]
    last[torch.isinf(logits).all(dim=-1)] = 0.0

    node_coins = torch.rand(num_reqs, rows, generator=g)
    pick = torch.rand(num_reqs, rows, generator=g)
    node_coins[pick < 0.15] = 0.0
    node_coins[pick > 0.85] = ALMOST_ONE
    final_coins = torch.rand(num_reqs, generator=g)
    final_coins[0] = 0.0
    final_coins[-1] = ALMOST_ONE
    temps = torch.tensor([TEMPERATURES[(seed + r) % len(TEMPERATURES)] for r in range(num_reqs)])
    return tree.to(DEVICE), logits.to(DEVICE), temps.to(DEVICE), (
        node_coins.to(DEVICE), final_coins.to(DEVICE))


def run_triton(tree, logits, temps, coins, method, ts=1.0, ta=1.0, block_v=None):
    return tree_verify_triton(
        logits, tree.tokens, tree.retrieve_next_token, tree.retrieve_next_sibling, temps,
        coins[0], coins[1], tree.max_depth, METHOD_IDS[method], ts, ta, block_v=block_v,
    )


def assert_same(out, ref):
    accepted, committed, num_accepted = out
    assert accepted.tolist() == ref.accepted_indices.tolist()
    assert committed.tolist() == ref.committed_tokens.tolist()
    assert num_accepted.tolist() == ref.num_accepted.tolist()


@pytest.mark.parametrize(
    "method,ts,ta",
    [("sample_walk", 1.0, 1.0), ("rejection", 1.0, 1.0), ("rejection", 0.6, 0.3)],
)
def test_matches_torch_reference(method, ts, ta):
    depths = []
    for seed, num_reqs, depth, vocab, budget, block_v in CONFIGS:
        tree, logits, temps, coins = make_case(seed, num_reqs, depth, vocab, budget)
        params = TreeSamplingParams(temperature=temps)
        ref = verify_tree_torch(tree, logits, params, method, coins, ts, ta)
        out = run_triton(tree, logits, temps, coins, method, ts, ta, block_v)
        assert_same(out, ref)
        depths += [(d, tree.max_depth) for d in ref.num_accepted.tolist()]
    # Not vacuous: walks stop at the root, in the middle and at full depth.
    assert any(d == 0 for d, _ in depths)
    assert any(0 < d < L for d, L in depths)
    assert any(d == L for d, L in depths)


def test_greedy_first_maximum_across_blocks():
    tree, logits, _, coins = make_case(5, 2, 3, 40, 6)
    logits[:, :, [35, 19, 3]] = 100.0  # ties in three vocab blocks of 16
    logits[1, :, 19] = 200.0
    temps = torch.zeros(2, device=DEVICE)
    ref = verify_tree_torch(tree, logits, TreeSamplingParams(temperature=temps),
                            "rejection", coins)
    assert ref.committed_tokens[:, 0].tolist() == [3, 19]
    assert_same(run_triton(tree, logits, temps, coins, "rejection", block_v=16), ref)


@pytest.mark.parametrize(
    "method,ts,coin,first",
    [
        ("sample_walk", 1.0, 0.5, 2),  # prefix sums [0, 1, 2]: first > 1 is token 2
        ("rejection", 1.0, 0.5, 2),  # coin * total == acc at child 1: not accepted
        ("rejection", 0.5, ALMOST_ONE, 1),  # e_child == threshold_single * total
    ],
)
def test_exact_boundaries(method, ts, coin, first):
    # root(0) -> 1(token 1) -> 3(token 3); root -> 2(token 2). The root row puts
    # mass exactly 1 on tokens 1 and 2, so the comparisons hit equality.
    tree = tree_from_parents([[-1, 0, 0, 1]], [[0, 1, 2, 3]], max_depth=2).to(DEVICE)
    logits = torch.zeros(1, 4, 5, device=DEVICE)
    logits[0, 0] = torch.tensor([NEG_INF, 0.0, 0.0, NEG_INF, NEG_INF])
    temps = torch.ones(1, device=DEVICE)
    coins = (torch.tensor([[coin, 0.3, 0.3, 0.3]], device=DEVICE),
             torch.tensor([0.6], device=DEVICE))
    ref = verify_tree_torch(tree, logits, TreeSamplingParams(temperature=temps), method,
                            coins, ts, 1.0)
    assert ref.accepted_indices[0, 1].item() == first
    assert_same(run_triton(tree, logits, temps, coins, method, ts, 1.0, block_v=2), ref)


@pytest.mark.parametrize("method", ["sample_walk", "rejection"])
def test_dispatcher_with_top_k_top_p_min_p(method):
    tree, logits, _, coins = make_case(6, 4, 4, 40, 16)
    params = TreeSamplingParams.from_lists(
        [0.0, 0.8, 1.2, 1.0],
        top_k=[0, 5, -1, 3],
        top_p=[1.0, 0.9, 0.7, 1.0],
        min_p=[0.0, 0.0, 0.05, 0.1],
        device=DEVICE,
    )
    kwargs = dict(method=method, coins=coins, threshold_single=0.9, threshold_acc=0.8)
    ref = verify_tree(tree, logits, params, backend="torch", **kwargs)
    out = verify_tree(tree, logits, params, backend="triton", **kwargs)
    assert_same((out.accepted_indices, out.committed_tokens, out.num_accepted), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    tree, logits, temps, coins = make_case(7, 6, 4, 48, 12)
    logits = logits.to(dtype)
    params = TreeSamplingParams(temperature=temps)
    for method in ("sample_walk", "rejection"):
        ref = verify_tree_torch(tree, logits, params, method, coins)
        assert_same(run_triton(tree, logits, temps, coins, method, block_v=16), ref)


def test_rejects_bad_inputs():
    tree, logits, temps, coins = make_case(8, 2, 2, 8, 3)
    with pytest.raises(ValueError, match="logits"):
        run_triton(tree, logits.double(), temps, coins, "rejection")
    with pytest.raises(ValueError, match="node_coins"):
        run_triton(tree, logits, temps, (coins[0].double(), coins[1]), "rejection")
    with pytest.raises(ValueError, match="block_v"):
        run_triton(tree, logits, temps, coins, "rejection", block_v=12)


@pytest.mark.parametrize("filters", [False, True])
def test_rows_read_in_place_through_row_index(filters):
    """Tree rows scattered among unrelated rows of a strided [M, V] tensor (as
    the target's logits of a whole batch are) read through ``row_index`` give the
    reference's result on the [R, N + 1, V] rows, with and without top-k/top-p."""
    tree, logits, temps, coins = make_case(9, 4, 4, 40, 12)
    num_reqs, rows, vocab = logits.shape
    gen = torch.Generator().manual_seed(3)
    total = num_reqs * rows + 7
    perm = torch.randperm(total, generator=gen)[: num_reqs * rows].to(DEVICE)
    storage = torch.randn(total, vocab + 5, generator=gen).to(DEVICE)
    flat = storage[:, :vocab]  # row stride vocab + 5
    flat[perm] = logits.reshape(-1, vocab)
    row_index = perm.view(num_reqs, rows)
    if filters:
        params = TreeSamplingParams.from_lists(
            temps.tolist(), top_k=[0, 5, -1, 3], top_p=[1.0, 0.9, 0.7, 0.95],
            device=DEVICE)
    else:
        params = TreeSamplingParams(temperature=temps)
    before = flat.clone()
    for method in ("sample_walk", "rejection"):
        ref = verify_tree_torch(tree, logits, params, method, coins)
        out = verify_tree(tree, flat, params, method=method, coins=coins,
                          backend="triton", row_index=row_index)
        assert_same((out.accepted_indices, out.committed_tokens, out.num_accepted), ref)
    assert torch.equal(flat, before)  # the caller's logits are never edited
