# SPDX-License-Identifier: Apache-2.0
"""KV commit: accepted tree nodes' K/V land at contiguous positions, every layer.

The torch reference is checked against a naive loop and against accepted paths
of real verified trees mapped to paged-cache slots; the Triton kernel (under
TRITON_INTERPRET=1 on CPU, compiled on CUDA) must equal the reference bit for bit.
"""

import os

import pytest
import torch

from vllm_ddtree.commit import plan_commit
from vllm_ddtree.ops import kv_commit
from vllm_ddtree.ops.kv_commit import commit_kv_triton
from vllm_ddtree.references import commit_kv_reference
from vllm_ddtree.sampling import TreeSamplingParams
from vllm_ddtree.tree import build_ddtree
from vllm_ddtree.verify import verify_tree

DEVICE = torch.device(
    "cuda"
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    else "cpu"
)
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 3, 2, 8


def make_caches(num_blocks, block_size, dtype=torch.float32, seed=0, **shape):
    heads = shape.get("num_kv_heads", NUM_KV_HEADS)
    head_dim = shape.get("head_dim", HEAD_DIM)
    layers = shape.get("num_layers", NUM_LAYERS)
    g = torch.Generator().manual_seed(seed)
    full = (layers, 2, num_blocks, block_size, heads, head_dim)
    # One allocation sliced per layer, as vLLM does.
    return list(torch.randn(full, generator=g).to(dtype).to(DEVICE).unbind(0))


def clone(caches):
    return [c.clone() for c in caches]


def naive_commit(caches, src, dst):
    """Oracle: one (K, V) row at a time, every read from a snapshot."""
    block_size = caches[0].shape[2]
    out = clone(caches)
    for old, new in zip(caches, out, strict=True):
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            if s != d:
                new[:, d // block_size, d % block_size] = old[
                    :, s // block_size, s % block_size
                ]
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for layer, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"layer {layer} differs"


# --------------------------------------------------------------------------- #
# Moves of real accepted paths
# --------------------------------------------------------------------------- #


def accepted_paths(seed, num_reqs=6, depth=5, vocab=5, max_budget=16):
    """(budgets [R], accepted_indices [R, L + 1], num_accepted [R]) of real trees."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(num_reqs, depth, vocab, generator=g)
    budgets = torch.randint(0, max_budget + 1, (num_reqs,), generator=g)
    tree = build_ddtree(draft, budgets, max_budget=max_budget)
    target = torch.randn(num_reqs, tree.num_rows, vocab, generator=g)
    # The target mostly agrees with the draft's favourite token, sometimes with its
    # runner-up: deep paths that leave the top chain (nodes p_j > j move).
    top2 = draft.topk(2, dim=-1).indices
    runner_up = (torch.rand(num_reqs, depth, generator=g) < 0.3).long()
    liked = top2.gather(-1, runner_up.unsqueeze(-1)).squeeze(-1)
    for b in range(num_reqs):
        for i in range(tree.num_rows):
            d = int(tree.depths[b, i])
            if d < depth:
                target[b, i, liked[b, d]] += 4.0
    params = TreeSamplingParams.from_lists([0.0, 1.0, 0.7, 1.0, 0.0, 1.0][:num_reqs])
    # Explicit coins: drawn ones would come from the global RNG.
    coins = (
        torch.rand(num_reqs, tree.num_rows, generator=g),
        torch.rand(num_reqs, generator=g),
    )
    out = verify_tree(tree, target, params, method="rejection", coins=coins)
    return budgets, out.accepted_indices, out.num_accepted


def paged_moves(seed, block_size, slot_dtype=torch.int64):
    """Slot moves of a verified batch through a random block table.

    Returns (src_slots, dst_slots, num_blocks, expected) where ``expected(caches)``
    builds the committed caches straight from the accepted paths.
    """
    budgets, accepted, num_accepted = accepted_paths(seed)
    num_reqs = budgets.numel()
    g = torch.Generator().manual_seed(1000 + seed)
    prefix = torch.randint(0, 40, (num_reqs,), generator=g)
    sizes = budgets + 1  # ragged verify rows: root + real nodes per request
    starts = torch.cumsum(sizes, 0) - sizes
    plan = plan_commit(accepted, starts, int(sizes.sum()))

    blocks_per_req = -(-(40 + int(sizes.max())) // block_size)
    num_blocks = num_reqs * blocks_per_req + 3  # a few blocks nobody owns
    block_table = torch.randperm(num_blocks, generator=g)[
        : num_reqs * blocks_per_req
    ].view(num_reqs, blocks_per_req)

    def slot(req, pos):
        return int(block_table[req, pos // block_size]) * block_size + pos % block_size

    def row_slot(row):
        req = int(torch.searchsorted(starts, row, right=True)) - 1
        return slot(req, int(prefix[req]) + row - int(starts[req]))

    src = [row_slot(r) for r in plan.src_rows.tolist()]
    dst = [row_slot(r) for r in plan.dst_rows.tolist()]

    def expected(caches):
        out = clone(caches)
        for b in range(num_reqs):
            for j in range(int(num_accepted[b]) + 1):
                d = slot(b, int(prefix[b]) + j)
                s = slot(b, int(prefix[b]) + int(accepted[b, j]))
                for old, new in zip(caches, out, strict=True):
                    new[:, d // block_size, d % block_size] = old[
                        :, s // block_size, s % block_size
                    ]
        return out, {
            slot(b, int(prefix[b]) + j)
            for b in range(num_reqs)
            for j in range(1, int(num_accepted[b]) + 1)
        }

    def as_slots(x):
        return torch.tensor(x, dtype=slot_dtype, device=DEVICE)

    return as_slots(src), as_slots(dst), num_blocks, expected


def test_paged_moves_are_realistic():
    """The seeds the tests use move data, cross blocks at block_size 16, and
    write rows that earlier moves read (dst[k] == src[j], j < k)."""
    crossing = chained = 0
    for seed in range(3):
        src, dst, _, _ = paged_moves(seed, 16)
        real = src != dst
        assert int(real.sum()) > 0
        crossing += int((real & (src // 16 != dst // 16)).sum())
        s, d = src[real].tolist(), dst[real].tolist()
        chained += sum(d[k] in s[:k] for k in range(len(d)))
    assert crossing > 0 and chained > 0


# --------------------------------------------------------------------------- #
# Reference
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_naive_loop(seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size = 6, 4
    caches = make_caches(num_blocks, block_size, seed=seed)
    n = 10
    dst = torch.randperm(num_blocks * block_size, generator=g)[:n]
    src = torch.randint(0, num_blocks * block_size, (n,), generator=g)
    src[::4] = dst[::4]  # self-moves are skipped
    src, dst = src.to(DEVICE), dst.to(DEVICE)
    want = naive_commit(caches, src, dst)
    got = clone(caches)
    commit_kv_reference(got, src, dst)
    assert_same(got, want)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_reference_commits_accepted_paths(seed, block_size):
    src, dst, num_blocks, expected = paged_moves(seed, block_size)
    caches = make_caches(num_blocks, block_size, seed=seed)
    want, written = expected(caches)
    got = clone(caches)
    commit_kv_reference(got, src, dst)
    assert_same(got, want)
    # Every slot no accepted node lands on keeps its K and V.
    for old, new in zip(caches, got, strict=True):
        flat_old = old.flatten(1, 2)
        flat_new = new.flatten(1, 2)
        untouched = torch.ones(
            flat_old.shape[1], dtype=torch.bool, device=flat_old.device
        )
        untouched[list(written)] = False
        assert torch.equal(flat_new[:, untouched], flat_old[:, untouched])


# --------------------------------------------------------------------------- #
# Triton kernel == reference
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "dtype,slot_dtype",
    [
        (torch.float32, torch.int64),
        (torch.bfloat16, torch.int32),
        (torch.float16, torch.int64),
    ],
)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("block_moves", [32, 4])
def test_triton_equals_reference_on_accepted_paths(
    dtype, slot_dtype, block_size, block_moves
):
    for seed in range(2):
        src, dst, num_blocks, expected = paged_moves(seed, block_size, slot_dtype)
        caches = make_caches(num_blocks, block_size, dtype, seed=seed)
        want = clone(caches)
        commit_kv_reference(want, src, dst)
        assert_same(want, expected(caches)[0])
        got = clone(caches)
        commit_kv_triton(got, src, dst, validate=True, block_moves=block_moves)
        assert_same(got, want)


@pytest.mark.parametrize("head_dim", [12, 160])
def test_triton_ragged_head_dim_and_strided_layout(head_dim):
    """head_dim not a power of two / over one program's chunk; caches stored
    [2, num_blocks, heads, block_size, head_dim] and viewed in the FA order."""
    src, dst, num_blocks, _ = paged_moves(0, 16)
    g = torch.Generator().manual_seed(7)
    physical = torch.randn(2, 2, num_blocks, 3, 16, head_dim, generator=g).to(DEVICE)
    caches = [layer.transpose(2, 3) for layer in physical.unbind(0)]
    want = clone(caches)
    commit_kv_reference(want, src, dst)
    commit_kv_triton(caches, src, dst, validate=True)
    assert_same(caches, want)


def chain_moves():
    # One request, prefix 0, accepted path [0, 2, 3, 5, 6]: depth j reads p_j.
    path = [2, 3, 5, 6]
    src = torch.tensor(path, device=DEVICE)
    dst = torch.arange(1, len(path) + 1, device=DEVICE)
    return src, dst


@pytest.mark.parametrize("block_moves", [32, 2, 1])
def test_in_place_order_matters(block_moves):
    """dst[1] == src[0] (depth 2 overwrites the row depth 1 reads): a scatter that
    lets a later move write first corrupts depth 1; the kernel does not."""
    src, dst = chain_moves()
    assert int(dst[1]) == int(src[0])
    caches = make_caches(4, 2)  # block_size 2: moves cross blocks
    want = naive_commit(caches, src, dst)

    parallel = clone(caches)  # an unsynchronized parallel scatter may run this
    for s, d in reversed(list(zip(src.tolist(), dst.tolist(), strict=True))):
        for c in parallel:
            c[:, d // 2, d % 2] = c[:, s // 2, s % 2]
    assert not torch.equal(parallel[0], want[0])

    got = clone(caches)
    commit_kv_triton(got, src, dst, validate=True, block_moves=block_moves)
    assert_same(got, want)


def test_unordered_moves_are_rejected_by_validate():
    """dst[0] == src[1]: an earlier move writes what a later one reads. Tile by
    tile (here one move per tile) that read sees the new value."""
    src = torch.tensor([5, 1], device=DEVICE)
    dst = torch.tensor([1, 0], device=DEVICE)
    caches = make_caches(4, 2)
    want = clone(caches)
    commit_kv_reference(want, src, dst)
    sequential = clone(caches)
    commit_kv_triton(sequential, src, dst, block_moves=1)
    assert not torch.equal(sequential[0], want[0])
    one_tile = clone(caches)  # both moves in one tile: gather-then-scatter
    commit_kv_triton(one_tile, src, dst, block_moves=2)
    assert_same(one_tile, want)
    with pytest.raises(ValueError, match="not ordered"):
        commit_kv_triton(clone(caches), src, dst, validate=True)


# --------------------------------------------------------------------------- #
# No-ops and bad inputs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fn", [commit_kv_reference, commit_kv_triton])
def test_identity_moves_change_nothing(fn):
    caches = make_caches(4, 4)
    slots = torch.tensor([3, 3, 9, 0, 15], device=DEVICE)
    got = clone(caches)
    fn(got, slots, slots.clone())
    assert_same(got, caches)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    fn(got, empty, empty)
    fn([], empty, empty)
    assert_same(got, caches)


def test_no_moves_no_launch(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched with nothing to move")

    monkeypatch.setattr(kv_commit, "_commit_kv_kernel", NoLaunch())
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    commit_kv_triton(make_caches(2, 2), empty, empty)


def _bad_inputs():
    caches = make_caches(2, 4, num_layers=2)
    s = torch.tensor([1, 2], device=DEVICE)
    d = torch.tensor([0, 1], device=DEVICE)
    other = make_caches(3, 4, num_layers=1)[0]
    return [
        ("kv_caches must be a list", caches[0], s, d),
        (r"kv_caches\[0\] must be a tensor", [s.tolist()], s, d),
        (r"kv_caches\[0\] must be \[2,", [caches[0][0]], s, d),
        (r"kv_caches\[1\] dtype", [caches[0], caches[1].double()], s, d),
        (r"kv_caches\[1\] is", [caches[0], other], s, d),
        (r"kv_caches\[1\] is", [caches[0], caches[1].half()], s, d),
        ("src_slots must be int32", caches, s.float(), d),
        ("dst_slots must be 1-D", caches, s, d.view(1, 2)),
        ("src_slots must be a tensor", caches, [1, 2], d),
        ("src_slots is on meta", caches, s.to("meta"), d),
        ("dst_slots is on meta", caches, s, d.to("meta")),
        ("differ in length", caches, s, d[:1]),
    ]


@pytest.mark.parametrize("fn", [commit_kv_reference, commit_kv_triton])
@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_bad_inputs(fn, case):
    match, caches, src, dst = _bad_inputs()[case]
    with pytest.raises(ValueError, match=match):
        fn(caches, src, dst)


def test_triton_only_checks(monkeypatch):
    caches = make_caches(2, 4, num_layers=2)
    s = torch.tensor([1, 2], device=DEVICE)
    d = torch.tensor([0, 1], device=DEVICE)
    strided = [caches[0], caches[1].transpose(3, 4).contiguous().transpose(3, 4)]
    with pytest.raises(ValueError, match=r"kv_caches\[1\] has strides"):
        commit_kv_triton(strided, s, d)
    with pytest.raises(ValueError, match="block_moves"):
        commit_kv_triton(caches, s, d, block_moves=3)
    with pytest.raises(ValueError, match="src_slots has a slot outside"):
        commit_kv_triton(caches, s + 6, d, validate=True)
    with pytest.raises(ValueError, match="dst_slots has a slot outside"):
        commit_kv_triton(caches, s, d - 1, validate=True)
    with pytest.raises(ValueError, match="write the same slot"):
        commit_kv_triton(caches, s, torch.zeros_like(d), validate=True)
    if DEVICE.type == "cpu":
        monkeypatch.setattr(kv_commit, "_interpreting", lambda: False)
        with pytest.raises(ValueError, match="needs a GPU"):
            commit_kv_triton(caches, s, d)
