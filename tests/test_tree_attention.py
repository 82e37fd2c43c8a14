# SPDX-License-Identifier: Apache-2.0
"""Tree attention over the paged KV cache: torch reference and Triton kernel.

The reference is checked against a naive per-row oracle (python loops, float64,
the dense ``DraftTree.visibility`` instead of the packed bits); the Triton kernel
against the reference. Without CUDA the kernel runs under TRITON_INTERPRET=1
(tests/conftest.py); run with ``TRITON_INTERPRET=0`` on a CUDA machine to test
the compiled kernel (tile sizes below 16 are then skipped).

Cache blocks and slots that no request may read hold NaN, so a kernel that reads
past a length, through an unused block-table column or a wrong block id, fails.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# TRITON_INTERPRET must be set before anything imports triton (tests/conftest.py).
if os.environ["TRITON_INTERPRET"] == "1" and not isinstance(
    triton.language.standard.max, InterpretedFunction
):
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )

import torch  # noqa: E402

from vllm_ddtree.ops.tree_attention import tree_attention_triton  # noqa: E402
from vllm_ddtree.references import tree_attention_reference  # noqa: E402
from vllm_ddtree.tree import (  # noqa: E402
    DraftTree,
    build_ddtree,
    pack_visibility,
    tree_from_parents,
)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = torch.device("cuda" if not INTERPRET and torch.cuda.is_available() else "cpu")
NUM_KV_HEADS = 2
# Small tiles exercise several prefix/tree tiles and row blocks per request;
# tl.dot needs 16 on GPUs, so they run only in the interpreter.
SMALL_TILES = {"block_q": 2, "block_n": 4, "block_t": 4}
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass
class Case:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    prefix_lens: torch.Tensor  # [num_reqs] int32
    tree_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    tree_mask_bits: torch.Tensor  # [num_reqs, rows, words] int32
    visibility: torch.Tensor  # [num_reqs, rows, rows] bool (the oracle's mask)
    scale: float

    def args(self, **replace):
        names = (
            "query",
            "key_cache",
            "value_cache",
            "block_table",
            "prefix_lens",
            "tree_lens",
            "query_start_loc",
            "tree_mask_bits",
            "scale",
        )
        return tuple(replace.get(n, getattr(self, n)) for n in names)


def random_trees(budgets, seed, depth=4, vocab=50, max_children=None) -> DraftTree:
    """Real DDTrees of random draft logits, one per budget (root = row 0)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(budgets), depth, vocab, generator=g) * 2
    return build_ddtree(
        logits,
        torch.tensor(budgets),
        max_budget=max(budgets),
        max_children=max_children,
    )


def make_case(
    prefix_lens,
    tree: DraftTree,
    *,
    group=1,
    head_dim=16,
    block_size=16,
    dtype=torch.float32,
    seed=0,
    kv_view=False,
    num_kv_heads=NUM_KV_HEADS,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    tree_lens = (tree.num_nodes + 1).tolist()
    seq_lens = [p + t for p, t in zip(prefix_lens, tree_lens, strict=True)]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2  # + a NaN block for unused columns + a spare
    ids = torch.randperm(num_blocks, generator=g)
    poison = int(ids[-1])
    block_table = torch.full((len(seq_lens), max(needed) + 1), poison)
    start = 0
    for r, n in enumerate(needed):
        block_table[r, :n] = ids[start : start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(*shape, generator=g)
    value_cache = torch.randn(*shape, generator=g)
    for cache in (key_cache, value_cache):
        cache[poison] = float("nan")
        for r, s in enumerate(seq_lens):  # slots past the sequence's end
            if s % block_size:
                cache[block_table[r, s // block_size], s % block_size :] = float("nan")
    qsl = [0]
    for t in tree_lens:
        qsl.append(qsl[-1] + t)
    # One padding token past the last request (its output must be 0).
    query = torch.randn(qsl[-1] + 1, num_kv_heads * group, head_dim, generator=g)

    def dev(x, dt=None):
        return x.to(device=DEVICE, dtype=dt or x.dtype)

    if kv_view:  # a [num_blocks, 2, ...] cache: K and V are strided views
        kv = dev(torch.stack([key_cache, value_cache], dim=1), dtype)
        key_cache, value_cache = kv[:, 0], kv[:, 1]
        assert not key_cache.is_contiguous()
    else:
        key_cache, value_cache = dev(key_cache, dtype), dev(value_cache, dtype)
    i32 = torch.int32
    return Case(
        query=dev(query, dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=dev(block_table, i32),
        prefix_lens=torch.tensor(prefix_lens, dtype=i32, device=DEVICE),
        tree_lens=torch.tensor(tree_lens, dtype=i32, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=i32, device=DEVICE),
        tree_mask_bits=dev(tree.visibility_packed),
        visibility=tree.visibility.cpu(),
        scale=head_dim**-0.5,
    )


def tree_depths(case: Case) -> torch.Tensor:
    """[num_reqs, rows] depth of every tree row (ancestors it sees, minus one)."""
    return (case.visibility.sum(-1) - 1).clamp(min=0).to(torch.int32).to(DEVICE)


def naive_tree_attention(
    case: Case, sliding_window=0, sinks=None, softcap=0.0
) -> torch.Tensor:
    """Per row and head: softmax over the listed visible keys, in float64. A node
    at depth d sits at position p + d and sees keys at positions s with
    p + d - s < sliding_window; a sink joins each head's denominator; softcap
    caps the scaled scores."""
    q_all = case.query.cpu().double()
    kc, vc = case.key_cache.cpu().double(), case.value_cache.cpu().double()
    bt = case.block_table.cpu().tolist()
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = q_all.shape[1] // num_kv_heads
    out = torch.zeros_like(q_all)
    for r, (p, t, q0) in enumerate(
        zip(
            case.prefix_lens.tolist(),
            case.tree_lens.tolist(),
            case.query_start_loc[:-1].tolist(),
            strict=True,
        )
    ):
        depth = case.visibility[r].sum(-1) - 1
        for i in range(t):
            seen = [j for j in range(t) if case.visibility[r, i, j]]
            keys = list(range(p)) + [p + j for j in seen]
            key_pos = list(range(p)) + [p + int(depth[j]) for j in seen]
            if sliding_window > 0:
                row_pos = p + int(depth[i])
                inside = [row_pos - s < sliding_window for s in key_pos]
                keys = [s for s, ok in zip(keys, inside, strict=True) if ok]
            blocks = [bt[r][s // block_size] for s in keys]
            slots = [s % block_size for s in keys]
            for h in range(q_all.shape[1]):
                k = kc[blocks, slots, h // group]  # [num_keys, head_dim]
                v = vc[blocks, slots, h // group]
                scores = k @ q_all[q0 + i, h] * case.scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double().cpu()])
                w = torch.softmax(scores, dim=0)[: len(keys)]
                out[q0 + i, h] = w @ v
    return out


def causal_attention(case: Case, window: int = 0) -> torch.Tensor:
    """Plain causal attention over each request's whole sequence, float64 (with
    ``window``: a row at position s' sees positions s' - window < s <= s')."""
    kc, vc = case.key_cache.cpu().double(), case.value_cache.cpu().double()
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = case.query.shape[1] // num_kv_heads
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    for r, (p, t, q0) in enumerate(
        zip(
            case.prefix_lens.tolist(),
            case.tree_lens.tolist(),
            case.query_start_loc[:-1].tolist(),
            strict=True,
        )
    ):
        pos = torch.arange(p + t)
        blocks = case.block_table[r].cpu().long()[pos // block_size]
        k = kc[blocks, pos % block_size].repeat_interleave(group, 1).transpose(0, 1)
        v = vc[blocks, pos % block_size].repeat_interleave(group, 1).transpose(0, 1)
        q = case.query[q0 : q0 + t].cpu().double().transpose(0, 1)
        scores = q @ k.transpose(1, 2) * case.scale  # [heads, t, p + t]
        future = pos.unsqueeze(0) > (p + torch.arange(t)).unsqueeze(1)
        if window:
            future |= (p + torch.arange(t)).unsqueeze(1) - pos.unsqueeze(0) >= window
        w = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out[q0 : q0 + t] = (w @ v).transpose(0, 1)
    return out


def assert_close(actual, expected, dtype=torch.float32):
    torch.testing.assert_close(
        actual.cpu().double(), expected.cpu().double(), **TOLERANCE[dtype]
    )


# Different prefix lengths (37: not a multiple of 16; 0) and tree lengths
# (8 rows, 4 rows, the root alone).
PREFIX_LENS = [37, 0, 20]
BUDGETS = [7, 3, 0]


@pytest.mark.parametrize(
    "block_size,group", [(1, 1), (16, 4), (3, 2)], ids=["bs1-g1", "bs16-g4", "bs3-g2"]
)
def test_reference_matches_naive_oracle(block_size, group):
    tree = random_trees(BUDGETS, seed=1)
    assert tree.num_nodes.tolist() == BUDGETS
    assert bool((tree.parents[0, 1:] != torch.arange(7)).any()), "not branching"
    case = make_case(PREFIX_LENS, tree, group=group, block_size=block_size, seed=2)
    expected = naive_tree_attention(case)
    out = tree_attention_reference(*case.args())
    assert_close(out, expected)
    assert not bool(out[-1].any()), "padding token must be zero"


def test_chain_tree_is_causal_attention():
    tree = random_trees([7, 5], seed=3, max_children=1, depth=8)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, 5, 6]
    case = make_case([21, 0], tree, group=2, seed=4)
    expected = causal_attention(case)
    assert_close(tree_attention_reference(*case.args()), expected)
    assert_close(tree_attention_triton(*case.args(), validate=True), expected)


TRITON_CASES = {
    # id: (block_size, group, dtype, head_dim, kv_view, tiles)
    "bs1-g1-fp32": (1, 1, torch.float32, 16, False, None),
    "bs16-g4-fp32": (16, 4, torch.float32, 16, False, None),
    "bs16-g1-fp32-small-tiles": (16, 1, torch.float32, 16, False, SMALL_TILES),
    "bs1-g4-fp32-small-tiles": (1, 4, torch.float32, 16, False, SMALL_TILES),
    "bs16-g4-bf16": (16, 4, torch.bfloat16, 16, False, None),
    "bs1-g1-bf16-small-tiles": (1, 1, torch.bfloat16, 16, False, SMALL_TILES),
    "bs16-g4-fp16-d32-kv-view": (16, 4, torch.float16, 32, True, None),
}


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_matches_reference(name):
    block_size, group, dtype, head_dim, kv_view, tiles = TRITON_CASES[name]
    if tiles is not None and not INTERPRET:
        pytest.skip("tiles below 16 need the interpreter")
    tree = random_trees(BUDGETS, seed=5)
    case = make_case(
        PREFIX_LENS,
        tree,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=6,
        kv_view=kv_view,
    )
    expected = tree_attention_reference(*case.args())
    out = tree_attention_triton(*case.args(), **(tiles or {}))
    assert out.dtype == dtype and out.shape == case.query.shape
    assert_close(out, expected, dtype)
    assert not bool(out[-1].any()), "padding token must be zero"
    if dtype == torch.float32:
        assert_close(out, naive_tree_attention(case))


# Layer features (vLLM passes them per layer): windows of 6 (cuts the prefixes) and
# 2 (shorter than the trees: ancestors fall out too), sinks, softcap, both
# gpt-oss features together.
SINKS = [1.5, -0.5, 2.5, 0.25, -1.0, 0.75, 3.0, 0.0]
LAYER_FEATURES = {
    "window-6": dict(sliding_window=6),
    "window-2": dict(sliding_window=2),
    "sinks": dict(sinks=SINKS),
    "softcap": dict(softcap=0.6),
    "window-sinks": dict(sliding_window=6, sinks=SINKS),
}


def _layer_args(case: Case, features: dict, group: int) -> dict:
    kw = dict(features)
    if "sinks" in kw:
        kw["sinks"] = torch.tensor(kw["sinks"][: NUM_KV_HEADS * group], device=DEVICE)
    if kw.get("sliding_window", 0) > 0:
        kw["tree_depths"] = tree_depths(case)
    return kw


def _poison_outside_windows(case: Case, window: int) -> None:
    """NaN in the committed keys older than every row's window: never read."""
    block_size = case.key_cache.shape[1]
    for r, p in enumerate(case.prefix_lens.tolist()):
        for s in range(max(p - window + 1, 0)):
            blk = int(case.block_table[r, s // block_size])
            case.key_cache[blk, s % block_size] = float("nan")
            case.value_cache[blk, s % block_size] = float("nan")


@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["default-tiles", "small"])
@pytest.mark.parametrize("features", list(LAYER_FEATURES))
def test_layer_features_match_naive_oracle(features, tiles):
    """Window by node depth, sinks and softcap: the reference and the kernel equal
    the float64 oracle, and dropping the feature changes the rows (non-vacuous)."""
    if tiles is not None and not INTERPRET:
        pytest.skip("tiles below 16 need the interpreter")
    group = 4
    tree = random_trees(BUDGETS, seed=21)
    case = make_case(PREFIX_LENS, tree, group=group, block_size=3, seed=22)
    kw = _layer_args(case, LAYER_FEATURES[features], group)
    window = kw.get("sliding_window", 0)
    oracle_kw = {k: v for k, v in kw.items() if k != "tree_depths"}
    expected = naive_tree_attention(case, **oracle_kw)
    assert (naive_tree_attention(case) - expected).abs().max() > 0.05
    if window:
        _poison_outside_windows(case, window)
    assert_close(tree_attention_reference(*case.args(), **kw), expected)
    out = tree_attention_triton(*case.args(), validate=True, **kw, **(tiles or {}))
    assert_close(out, expected)
    assert not bool(out[-1].any()), "padding token must be zero"


@pytest.mark.parametrize("window", [3, 8])
def test_windowed_chain_is_windowed_causal_attention(window):
    """On a chain (depth = row), the window is the stock kernels' rule: a row at
    position s' sees positions s with s' - s < window."""
    tree = random_trees([7, 5], seed=3, max_children=1, depth=8)
    case = make_case([21, 0], tree, group=2, seed=4)
    kw = _layer_args(case, {"sliding_window": window}, 2)
    expected = causal_attention(case, window=window)
    assert_close(tree_attention_reference(*case.args(), **kw), expected)
    assert_close(tree_attention_triton(*case.args(), **kw), expected)


def test_mask_words_beyond_32_columns():
    # 40 rows: column j >= 32 lives in word 1; column 31 is word 0's sign bit.
    tree = random_trees([39], seed=7, depth=6, vocab=12)
    assert tree.num_nodes.tolist() == [39] and tree.visibility_packed.shape[2] == 2
    assert bool((tree.visibility_packed[0, :, 0] < 0).any()), "bit 31 unused"
    case = make_case([5], tree, num_kv_heads=1, seed=8)
    expected = naive_tree_attention(case)
    assert_close(tree_attention_reference(*case.args()), expected)
    assert_close(tree_attention_triton(*case.args()), expected)


def test_wrong_mask_is_detected():
    # Root 0 with children 1, 2; 3 under 1; 4 under 2; 5 under 1: row i sees far
    # fewer tree keys than a causal (all earlier rows) mask would give it.
    tree = tree_from_parents([[-1, 0, 0, 1, 2, 1]], [[0, 1, 2, 3, 4, 5]], 2)
    case = make_case([9], tree, group=2, seed=9)
    expected = naive_tree_attention(case)
    causal = pack_visibility(torch.ones(1, 6, 6, dtype=torch.bool).tril()).to(DEVICE)
    transposed = pack_visibility(tree.visibility.transpose(1, 2)).to(DEVICE)
    for fn in (tree_attention_reference, tree_attention_triton):
        assert_close(fn(*case.args()), expected)
        for wrong in (causal, transposed):
            out = fn(*case.args(tree_mask_bits=wrong))
            # Rows 0 and 1 see the same keys under the causal mask.
            diff = (out.cpu().double() - expected)[2:6].abs().amax(dim=(1, 2))
            assert bool((diff > 1e-2).all()), (fn.__name__, diff)


def _bad_inputs(case: Case):
    """(argument name in the message, replaced arguments) for each bad call."""
    q, kc, bt = case.query, case.key_cache, case.block_table
    i32 = torch.int32
    return {
        "query-2d": ("query", {"query": q[0]}),
        "query-int": ("query", {"query": q.to(i32)}),
        "query-heads": ("query", {"query": q[:, :1].expand(-1, 3, -1)}),
        "key-dtype": ("key_cache", {"key_cache": kc.half()}),
        "key-head-dim": ("key_cache", {"key_cache": kc[..., :8]}),
        "value-shape": ("value_cache", {"value_cache": case.value_cache[:-1]}),
        "table-float": ("block_table", {"block_table": bt.float()}),
        "table-rows": ("block_table", {"block_table": bt[:1]}),
        "table-device": ("block_table", {"block_table": bt.to("meta")}),
        "prefix-2d": ("prefix_lens", {"prefix_lens": case.prefix_lens[:, None]}),
        "tree-len": ("tree_lens", {"tree_lens": case.tree_lens[:1]}),
        "qsl-len": ("query_start_loc", {"query_start_loc": case.query_start_loc[1:]}),
        "mask-dtype": (
            "tree_mask_bits",
            {"tree_mask_bits": case.tree_mask_bits.long()},
        ),
        "mask-words": (
            "tree_mask_bits",
            {"tree_mask_bits": torch.zeros(3, 8, 2, dtype=i32, device=DEVICE)},
        ),
        "scale-nan": ("scale", {"scale": float("nan")}),
        "scale-tensor": ("scale", {"scale": torch.tensor(0.25)}),
    }


def _bad_values(case: Case):
    """Bad values: checked by the reference and by the kernel with validate=True."""
    tl_, qsl, bt = case.tree_lens, case.query_start_loc, case.block_table
    return {
        "prefix-negative": (
            "prefix_lens",
            {"prefix_lens": case.prefix_lens - torch.tensor([0, 1, 0], device=DEVICE)},
        ),
        "tree-too-long": ("tree_lens", {"tree_lens": tl_ + 1}),
        "qsl-mismatch": ("query_start_loc", {"query_start_loc": qsl * 2}),
        "table-narrow": ("block_table", {"block_table": bt[:, :1]}),
        "table-id": ("block_table", {"block_table": bt + 1000}),
    }


BAD_CASE = make_case(PREFIX_LENS, random_trees(BUDGETS, seed=10))


@pytest.mark.parametrize("fn", [tree_attention_reference, tree_attention_triton])
@pytest.mark.parametrize("bad", list(_bad_inputs(BAD_CASE)))
def test_bad_inputs_raise(fn, bad):
    name, replace = _bad_inputs(BAD_CASE)[bad]
    with pytest.raises(ValueError, match=name):
        fn(*BAD_CASE.args(**replace))


@pytest.mark.parametrize("bad", list(_bad_values(BAD_CASE)))
def test_bad_values_raise(bad):
    name, replace = _bad_values(BAD_CASE)[bad]
    with pytest.raises(ValueError, match=name):
        tree_attention_reference(*BAD_CASE.args(**replace))
    with pytest.raises(ValueError, match=name):
        tree_attention_triton(*BAD_CASE.args(**replace), validate=True)


@pytest.mark.parametrize(
    "tiles,name",
    [
        ({"block_n": 3}, "block_n"),
        ({"block_t": 0}, "block_t"),
        ({"block_q": 6}, "block_q"),
    ],
)
def test_bad_tiles_raise(tiles, name):
    with pytest.raises(ValueError, match=name):
        tree_attention_triton(*BAD_CASE.args(), **tiles)


def test_rows_that_see_nothing_are_zero():
    # prefix_len 0 and a mask row without its diagonal bit: no visible key.
    tree = random_trees([3], seed=11)
    case = make_case([0], tree, seed=12)
    bits = case.tree_mask_bits.clone()
    bits[0, 2] = 0
    for fn in (tree_attention_reference, tree_attention_triton):
        out = fn(*case.args(tree_mask_bits=bits))
        assert not bool(out[2].any()) and bool(out[3].abs().sum() > 0)
        assert bool(torch.isfinite(out).all())
