# SPDX-License-Identifier: Apache-2.0
"""DDTree's CPU_ATTN override: ancestor-only tree rows, stock everything else.

No engine: the impl is built directly, the paged cache is filled with vLLM's
``cpu_attn_reshape_and_cache`` (an earlier "prefill", then the verify forward's
own KV write via ``do_kv_cache_update``), and the metadata is built the way
``CPUAttentionMetadataBuilder.build`` does for a causal decoder batch (same
fields, scheduler metadata from ``ops.cpu_attn_get_scheduler_metadata``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm.v1.attention.backends.cpu_attn as cpu_attn  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    _get_attn_isa,
)

from _attn_utils import (  # noqa: E402
    model_with,
    tree_batch_from_block_starts,
    tree_block_starts,
    unpack_prefix,
)
from vllm_ddtree.commit import plan_commit  # noqa: E402
from vllm_ddtree.tree import build_ddtree, tree_from_parents  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context  # noqa: E402
from vllm_ddtree.ops import cpu_ext  # noqa: E402
from vllm_ddtree.vllm_adapter import plugin_cpu_attention  # noqa: E402
from vllm_ddtree.vllm_adapter.cpu_attention import (  # noqa: E402
    BACKEND_PATH,
    DDTreeCPUAttentionBackend,
    DDTreeCPUAttentionImpl,
    packed_layout,
    register_tree_attention_backend,
    unpack_blocks,
)
from vllm_ddtree.vllm_adapter.plugin_cpu_attention import (  # noqa: E402
    PluginCPUAttentionImpl,
)

NUM_HEADS, NUM_KV_HEADS = 4, 2

# The tree-row attention: the series' torch path, and the plugin's compiled op
# (csrc/cpu/tree_attention.cpp), which must give the same rows.
TREE_IMPLS = ["torch", "compiled"]


def tree_impl(name: str):
    """The impl class of ``name``; counts the compiled op's calls (it must run)."""
    if name == "torch":
        return DDTreeCPUAttentionImpl
    if not cpu_ext.tree_attention_available():
        pytest.skip(f"the CPU extension is not loaded: {cpu_ext.load_error()}")
    return PluginCPUAttentionImpl


def compiled_ran(name: str, before: int) -> bool:
    """Whether the compiled op served the calls since ``before`` (torch: none)."""
    after = plugin_cpu_attention.compiled_calls()
    return after > before if name == "compiled" else after == before


@pytest.fixture(autouse=True)
def _model_dtype(monkeypatch):
    """The impl's __init__ reads only model_config.dtype from the current config."""
    holder = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: holder)
    yield holder


def make_impl(cls, head_dim, **kwargs):
    args = dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    args.update(kwargs)
    return cls(NUM_HEADS, head_dim, head_dim**-0.5, NUM_KV_HEADS, **args)


def write_cache(key, value, kv_cache, slots, isa):
    nb, hkv, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def require_isa(isa, dtype, block_size, head_dim):
    """Skips where vLLM's cache write has no kernel for ``isa`` (seen: "amx" on an
    AVX-512 Xeon without AMX tiles refuses every head_dim; an AMD EPYC accepted it)."""
    key = torch.zeros(1, NUM_KV_HEADS, head_dim, dtype=dtype)
    cache = torch.zeros(1, NUM_KV_HEADS, block_size, 2 * head_dim, dtype=dtype)
    try:
        write_cache(key, key, cache, torch.zeros(1, dtype=torch.int64), isa)
    except RuntimeError as exc:
        if "Unsupported CPU attention configuration" not in str(exc):
            raise
        pytest.skip(f"vLLM's CPU attention has no {isa!r} kernel here: {exc}")


# --------------------------------------------------------------------------------
# Layout: unpack(pack(x)) == x
# --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("isa", ["auto", "amx"])
def test_unpack_inverts_pack(dtype, block_size, head_dim, isa):
    if isa == "auto":
        isa = _get_attn_isa(dtype, block_size, head_dim)
    else:
        require_isa(isa, dtype, block_size, head_dim)
    g = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks = 5
    n = num_blocks * block_size
    key = torch.randn(n, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    value = torch.randn(n, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    slots = torch.randperm(n, generator=g)[: n - 7]  # some slots stay unwritten
    cache = torch.zeros(num_blocks, NUM_KV_HEADS, block_size, 2 * head_dim, dtype=dtype)
    write_cache(key[: n - 7], value[: n - 7], cache, slots, isa)

    k_all, v_all = unpack_blocks(cache, torch.arange(num_blocks), isa)
    assert torch.equal(k_all[slots], key[: n - 7])
    assert torch.equal(v_all[slots], value[: n - 7])

    # One sequence through a scrambled block table, cut mid-block.
    table = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    seq = torch.arange(n) // block_size
    seq_slots = table[seq].to(torch.int64) * block_size + torch.arange(n) % block_size
    cache.zero_()
    write_cache(key, value, cache, seq_slots, isa)
    k, v = unpack_prefix(cache, table, n - 11, isa)
    assert torch.equal(k, key[: n - 11]) and torch.equal(v, value[: n - 11])


def test_vec_layout_facts():
    """What the probe finds for ``vec``: K transposed [D, bs], V plain [bs, D]."""
    bs, d = 32, 64
    k_index, v_index = packed_layout("vec", torch.float32, bs, d)
    t, dim = torch.arange(bs).view(bs, 1), torch.arange(d).view(1, d)
    assert torch.equal(k_index.view(bs, d), dim * bs + t)
    assert torch.equal(v_index.view(bs, d), t * d + dim)


# --------------------------------------------------------------------------------
# A mixed verify batch: tree requests, a prefill chunk, a tree after plain rows.
# --------------------------------------------------------------------------------


@dataclass
class Req:
    prefix: int  # tokens cached before this forward
    plain_rows: int  # causal rows of this forward before the tree block
    budget: int | None  # tree budget, or None: no tree


def ancestors_or_self(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return sorted(out)


class Scenario:
    """Prefill-ed paged cache + one verify forward's inputs and metadata."""

    def __init__(
        self, dtype, block_size, head_dim, reqs, seed=0, padding=3, window=-1
    ):
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.block_size, self.head_dim = dtype, block_size, head_dim
        self.isa = _get_attn_isa(dtype, block_size, head_dim)
        self.reqs = reqs
        tree_reqs = [r for r in reqs if r.budget is not None]
        # Trees: random drafter logits, L = 4, V = 6, so B > L forces branching.
        logits = torch.randn(len(tree_reqs), 4, 6, generator=g)
        budgets = torch.tensor([r.budget for r in tree_reqs])
        self.tree = build_ddtree(logits, budgets, max_budget=int(budgets.max()))
        sizes, k = [], 0
        for r in reqs:
            if r.budget is None:
                sizes.append(0)
            else:
                sizes.append(int(self.tree.num_nodes[k]) + 1)
                k += 1
        self.tree_sizes = sizes
        q_lens = [r.plain_rows + t for r, t in zip(reqs, sizes)]
        seq_lens = [r.prefix + q for r, q in zip(reqs, q_lens)]
        num_blocks_per = [-(-s // block_size) for s in seq_lens]
        total_blocks = sum(num_blocks_per) + 2
        perm = torch.randperm(total_blocks, generator=g)
        max_blocks = max(num_blocks_per)
        block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
        at = 0
        for b, nb in enumerate(num_blocks_per):
            block_table[b, :nb] = perm[at : at + nb].to(torch.int32)
            at += nb
        self.block_table = block_table

        def slot(b, pos):
            return int(block_table[b, pos // block_size]) * block_size + pos % block_size

        hkv, d = NUM_KV_HEADS, head_dim
        self.cache = torch.zeros(total_blocks, hkv, block_size, 2 * d, dtype=dtype)
        # The earlier "prefill": every request's cached prefix.
        self.prefix_k, self.prefix_v = [], []
        for b, r in enumerate(reqs):
            pk = torch.randn(r.prefix, hkv, d, generator=g).to(dtype)
            pv = torch.randn(r.prefix, hkv, d, generator=g).to(dtype)
            self.prefix_k.append(pk)
            self.prefix_v.append(pv)
            if r.prefix:
                slots = torch.tensor([slot(b, p) for p in range(r.prefix)])
                write_cache(pk, pv, self.cache, slots, self.isa)
        # This forward's rows (+ padding rows, slot -1, as vLLM pads).
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        n_actual = qsl[-1]
        n = n_actual + padding
        self.query = torch.randn(n, NUM_HEADS, d, generator=g).to(dtype)
        self.key = torch.randn(n, hkv, d, generator=g).to(dtype)
        self.value = torch.randn(n, hkv, d, generator=g).to(dtype)
        slot_mapping = torch.full((n,), -1, dtype=torch.int64)
        for b, r in enumerate(reqs):
            for i in range(q_lens[b]):
                slot_mapping[qsl[b] + i] = slot(b, r.prefix + i)
        self.slot_fn = slot
        self.qsl, self.q_lens, self.seq_lens, self.n_actual = qsl, q_lens, seq_lens, n_actual
        query_start_loc = torch.tensor(qsl, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(reqs),
            num_heads=NUM_HEADS,
            num_kv_heads=hkv,
            head_dim=d,
            seq_lens=seq_lens_t,
            dtype=dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=window,
            isa=self.isa,
            enable_kv_split=False,
        )
        self.metadata = CPUAttentionMetadata(
            num_actual_tokens=n_actual,
            max_query_len=max(q_lens),
            query_start_loc=query_start_loc,
            max_seq_len=max(seq_lens),
            seq_lens=seq_lens_t,
            block_table=block_table,
            slot_mapping=slot_mapping,
            scheduler_metadata=sched,
            causal=True,
        )
        self.layer = SimpleNamespace(
            isa=self.isa,
            _k_scale_float=1.0,
            _v_scale_float=1.0,
            layer_name="model.layers.0.self_attn.attn",
        )

    def tree_batch(self, **kwargs) -> attn_context.TreeAttentionBatch:
        rows, idx, offs, sizes, prefix = [], [], [], [], []
        k = 0
        for b, r in enumerate(self.reqs):
            if r.budget is None:
                continue
            rows.append(k)
            idx.append(b)
            offs.append(r.plain_rows)
            sizes.append(self.tree_sizes[b])
            prefix.append(r.prefix + r.plain_rows)
            k += 1
        return attn_context.TreeAttentionBatch.from_tree(
            self.tree, rows, idx, offs, sizes, prefix, **kwargs
        )

    def tree_rows(self) -> list[int]:
        return [
            self.qsl[b] + r.plain_rows + i
            for b, r in enumerate(self.reqs)
            for i in range(self.tree_sizes[b])
        ]

    def run(self, impl, cache=None, batch=None, write_kv=True):
        """The layer's two steps: KV write, then attention (on a copy of the cache)."""
        cache = self.cache.clone() if cache is None else cache
        if write_kv:
            impl.do_kv_cache_update(
                self.layer, self.key, self.value, cache, self.metadata.slot_mapping
            )
        out = torch.zeros(self.query.shape[0], NUM_HEADS, self.head_dim, dtype=self.dtype)
        metadata = self.metadata
        if batch is not None:
            metadata = attn_context.metadata_with_tree(metadata, batch)
        impl.forward(self.layer, self.query, self.key, self.value, cache, metadata, out)
        return out, cache

    def reference_tree_rows(
        self, drop_mask=False, window=0, sinks=None, softcap=0.0
    ) -> dict[int, torch.Tensor]:
        """Per tree row: softmax attention over prefix + its ancestors-or-self only
        (float64, explicit loops over nodes and heads). A node at depth d sits at
        position prefix + d; ``window`` keeps keys at positions p - j < window;
        ``sinks`` [H] join each head's denominator; ``softcap`` caps the scaled
        scores. ``drop_mask``: every row sees the block rows before it, at its
        linear position (what the stock causal kernel computes)."""
        ref = {}
        scale = self.head_dim**-0.5
        group = NUM_HEADS // NUM_KV_HEADS
        k = 0
        for b, r in enumerate(self.reqs):
            if r.budget is None:
                continue
            q0 = self.qsl[b]
            pre_k = torch.cat([self.prefix_k[b], self.key[q0 : q0 + r.plain_rows]])
            pre_v = torch.cat([self.prefix_v[b], self.value[q0 : q0 + r.plain_rows]])
            nc = pre_k.shape[0]
            t = self.tree_sizes[b]
            parents = self.tree.parents[k, :t].tolist()
            tree_q0 = q0 + r.plain_rows
            for i in range(t):
                seen = list(range(i + 1)) if drop_mask else ancestors_or_self(parents, i)
                keys = torch.cat([pre_k, self.key[[tree_q0 + j for j in seen]]]).double()
                vals = torch.cat([pre_v, self.value[[tree_q0 + j for j in seen]]]).double()
                # positions: a node's depth = its number of ancestors
                key_pos = list(range(nc)) + [
                    nc + (j if drop_mask else len(ancestors_or_self(parents, j)) - 1)
                    for j in seen
                ]
                pos = key_pos[-1]  # the row itself
                hidden = torch.tensor([window > 0 and pos - j >= window for j in key_pos])
                row = torch.empty(NUM_HEADS, self.head_dim, dtype=torch.float64)
                for h in range(NUM_HEADS):
                    q = self.query[tree_q0 + i, h].double()
                    scores = (keys[:, h // group] @ q) * scale
                    if softcap:
                        scores = softcap * torch.tanh(scores / softcap)
                    scores = scores.masked_fill(hidden, float("-inf"))
                    if sinks is not None:
                        scores = torch.cat([scores, sinks[h : h + 1].double()])
                    probs = torch.softmax(scores, 0)[: keys.shape[0]]
                    row[h] = probs @ vals[:, h // group]
                ref[tree_q0 + i] = row
            k += 1
        return ref


REQS = [
    Req(prefix=37, plain_rows=0, budget=9),  # tree, prefix ends mid-block
    Req(prefix=5, plain_rows=20, budget=None),  # a prefill chunk
    Req(prefix=148, plain_rows=2, budget=12),  # plain rows, then the tree
    Req(prefix=128, plain_rows=0, budget=6),  # prefix ends on a block boundary
    Req(prefix=70, plain_rows=0, budget=40),  # more rows than one compiled task holds
]


@pytest.mark.parametrize("impl", TREE_IMPLS)
@pytest.mark.parametrize(
    "dtype,block_size,head_dim,atol",
    [
        (torch.float32, 32, 64, 1e-5),
        (torch.float32, 128, 128, 1e-5),
        # The compiled op reads float32 "vec" blocks in place; these convert
        # each block first: a head_dim off its 64-wide tiles, the "vec16"
        # layout (small blocks), half-precision caches.
        (torch.float32, 32, 96, 1e-5),
        (torch.float32, 16, 80, 1e-5),
        (torch.bfloat16, 32, 64, 2e-2),
        (torch.float16, 32, 64, 4e-3),
    ],
)
def test_tree_rows_match_dense_reference(dtype, block_size, head_dim, atol, impl):
    sc = Scenario(dtype, block_size, head_dim, REQS, seed=block_size)
    for k in range(sc.tree.num_reqs):  # non-vacuous: every tree branches
        t = int(sc.tree.num_nodes[k]) + 1
        assert not torch.equal(
            sc.tree.visibility[k, :t, :t], torch.ones(t, t, dtype=torch.bool).tril()
        )
    stock = make_impl(CPUAttentionBackendImpl, head_dim)
    ours = make_impl(tree_impl(impl), head_dim)

    stock_out, stock_cache = sc.run(stock)
    plain_out, plain_cache = sc.run(ours)  # no context: pure pass-through
    assert torch.equal(plain_out, stock_out)
    assert torch.equal(plain_cache, stock_cache)

    batch = sc.tree_batch()
    calls = plugin_cpu_attention.compiled_calls()
    tree_out, tree_cache = sc.run(ours, batch=batch)
    assert compiled_ran(impl, calls)
    assert torch.equal(tree_cache, stock_cache)  # attention never writes the cache
    tree_rows = sc.tree_rows()
    others = [i for i in range(sc.query.shape[0]) if i not in set(tree_rows)]
    assert torch.equal(tree_out[others], stock_out[others])  # incl. padding rows

    ref = sc.reference_tree_rows()
    assert sorted(ref) == tree_rows
    worst = max((tree_out[i].double() - ref[i]).abs().max().item() for i in tree_rows)
    assert worst <= atol, worst

    # The stock kernel on the same rows is causal over linear positions; it must
    # match the dropped-mask reference and differ from the tree reference.
    causal_ref = sc.reference_tree_rows(drop_mask=True)
    worst_causal = max(
        (stock_out[i].double() - causal_ref[i]).abs().max().item() for i in tree_rows
    )
    assert worst_causal <= atol, worst_causal
    assert max((stock_out[i].double() - ref[i]).abs().max().item() for i in tree_rows) > 0.05

    # K/V stash of the single layer: the forward's own tree rows and slots.
    (stash,) = batch.stash.values()
    rows = torch.tensor(tree_rows)
    assert torch.equal(stash.key, sc.key[rows]) and torch.equal(stash.value, sc.value[rows])
    assert torch.equal(stash.slot_mapping, sc.metadata.slot_mapping[rows])
    assert torch.equal(stash.batch_rows, rows)
    assert stash.key.data_ptr() != sc.key.data_ptr()


SINKS = torch.tensor([1.5, -0.5, 2.5, 0.25])

# Per-layer features the tree rows must honour, as vLLM's layers pass them. The
# windows: 8 cuts every prefix, 3 is shorter than the deepest trees (ancestors
# fall out of it too); gpt-oss layers combine a window with sinks.
LAYER_FEATURES = {
    "window-8": dict(sliding_window=8),
    "window-3": dict(sliding_window=3),
    "sinks": dict(sinks=SINKS),
    "softcap": dict(logits_soft_cap=0.8),
    "window+sinks": dict(sliding_window=8, sinks=SINKS),
}


def _reference_args(kwargs) -> dict:
    return dict(
        window=kwargs.get("sliding_window", 0),
        sinks=kwargs.get("sinks"),
        softcap=kwargs.get("logits_soft_cap", 0.0),
    )


@pytest.mark.parametrize("impl", TREE_IMPLS)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("features", list(LAYER_FEATURES))
def test_tree_rows_honour_window_sinks_and_softcap(features, dtype, atol, impl):
    """Each tree row equals the reference with the layer's window (by the node's
    depth, not its row), sinks and softcap; the reference's semantics are the
    stock kernel's (checked on the stock kernel's own causal rows), and leaving
    the feature out of the reference changes the tree rows (non-vacuous)."""
    kwargs = LAYER_FEATURES[features]
    window = kwargs.get("sliding_window", -1)
    # 64-row blocks: a window starts mid-block (the compiled op reads from a key
    # tile inside the block on).
    sc = Scenario(dtype, 64, 64, REQS, seed=11, window=window)
    stock = make_impl(CPUAttentionBackendImpl, 64, **kwargs)
    ours = make_impl(tree_impl(impl), 64, **kwargs)
    stock_out, _ = sc.run(stock)
    calls = plugin_cpu_attention.compiled_calls()
    tree_out, _ = sc.run(ours, batch=sc.tree_batch())
    assert compiled_ran(impl, calls)
    tree_rows = sc.tree_rows()
    others = [i for i in range(sc.query.shape[0]) if i not in set(tree_rows)]
    assert torch.equal(tree_out[others], stock_out[others])

    def worst(out, ref):
        return max((out[i].double() - ref[i]).abs().max().item() for i in ref)

    args = _reference_args(kwargs)
    assert worst(stock_out, sc.reference_tree_rows(drop_mask=True, **args)) <= atol
    assert worst(tree_out, sc.reference_tree_rows(**args)) <= atol
    plain = sc.reference_tree_rows()  # the same trees without the feature
    assert worst(tree_out, plain) > 0.05


@pytest.mark.parametrize("features", ["none", "window-8"])
def test_compiled_packed_layout_path_matches_in_place_reads(monkeypatch, features):
    """The compiled op's general path (each block gathered through the probed
    k_index / v_index, as for AMX's packed layouts) gives the in-place float32
    reads' rows bit for bit (the "vec" layout, told to it as packed)."""
    kwargs = LAYER_FEATURES.get(features, {})
    window = kwargs.get("sliding_window", -1)
    sc = Scenario(torch.float32, 64, 64, REQS, seed=5, window=window)
    impl_cls = tree_impl("compiled")
    in_place, _ = sc.run(make_impl(impl_cls, 64, **kwargs), batch=sc.tree_batch())
    layout = plugin_cpu_attention.layout_args
    assert layout(sc.isa, torch.float32, 64, 64)[0]  # read in place above
    monkeypatch.setattr(
        plugin_cpu_attention,
        "layout_args",
        lambda *a: (False, *layout(*a)[1:]),
    )
    calls = plugin_cpu_attention.compiled_calls()
    gathered, _ = sc.run(make_impl(impl_cls, 64, **kwargs), batch=sc.tree_batch())
    assert compiled_ran("compiled", calls)
    assert torch.equal(gathered, in_place)
    ref = sc.reference_tree_rows(**_reference_args(kwargs))
    assert max((gathered[i].double() - ref[i]).abs().max().item() for i in ref) <= 1e-5


@pytest.mark.parametrize("impl", TREE_IMPLS)
@pytest.mark.parametrize("features", list(LAYER_FEATURES))
def test_chain_rows_keep_the_stock_kernel_output(features, impl):
    """Rows that see exactly the block rows before them (a chain; a tree's spine) are
    not recomputed: their output is the stock causal kernel's, bit for bit, with
    the layer's window, sinks and softcap."""
    kwargs = LAYER_FEATURES[features]
    sc = Scenario(torch.float32, 32, 64, REQS, seed=3)
    sizes = [t for t in sc.tree_sizes if t]
    chains = [[-1] + list(range(t - 1)) for t in sizes]
    tokens = [[1] * t for t in sizes]
    sc.tree = tree_from_parents(chains, tokens, max_depth=max(sizes) - 1)
    stock_out, _ = sc.run(make_impl(CPUAttentionBackendImpl, 64, **kwargs))
    batch = sc.tree_batch()
    tree_out, _ = sc.run(make_impl(tree_impl(impl), 64, **kwargs), batch=batch)
    assert torch.equal(tree_out, stock_out)
    ref = sc.reference_tree_rows(**_reference_args(kwargs))
    assert max((tree_out[i].double() - ref[i]).abs().max().item() for i in ref) <= 1e-5
    (stash,) = batch.stash.values()  # the commit still gets every tree row's K/V
    assert torch.equal(stash.batch_rows, torch.tensor(sc.tree_rows()))


def test_batch_from_block_starts_matches_explicit_batch():
    sc = Scenario(torch.float32, 32, 64, REQS, seed=3)
    # One tree row per batch request (a root-only row for the prefill chunk).
    tree_of_req = {b: k for k, b in enumerate(b for b, r in enumerate(sc.reqs) if r.budget)}
    parents, tokens, drafts = [], [], []
    for b, r in enumerate(sc.reqs):
        if r.budget is None:
            parents.append([-1])
            tokens.append([0])
            drafts.append(0)
        else:
            t = sc.tree_sizes[b]
            parents.append(sc.tree.parents[tree_of_req[b], :t].tolist())
            tokens.append(sc.tree.tokens[tree_of_req[b], :t].tolist())
            drafts.append(t - 1)
    step_tree = tree_from_parents(parents, tokens, max_depth=4)
    starts = [sc.qsl[b + 1] - drafts[b] - 1 for b in range(len(sc.reqs))]
    batch = tree_batch_from_block_starts(
        step_tree, starts, sc.metadata.query_start_loc, sc.metadata.seq_lens, drafts
    )
    want = sc.tree_batch()
    def fields(b):
        return [(r.req_index, r.row_offset, r.num_rows, r.prefix_len) for r in b.requests]

    assert fields(batch) == fields(want)
    for got, exp in zip(batch.requests, want.requests):
        assert torch.equal(got.visibility, exp.visibility)


def test_wrong_prefix_len_is_rejected():
    sc = Scenario(torch.float32, 32, 64, REQS[:1], seed=4)
    r = sc.tree_batch().requests[0]
    wrong = attn_context.TreeRequest(
        r.req_index, r.row_offset, r.num_rows, r.prefix_len + 1, r.visibility
    )
    bad = attn_context.TreeAttentionBatch((wrong,))
    with pytest.raises(ValueError, match="prefix_len"):
        sc.run(make_impl(DDTreeCPUAttentionImpl, 64), batch=bad)


def test_non_decoder_layers_pass_through_under_context():
    sc = Scenario(torch.float32, 32, 64, REQS[:2], seed=5)
    stock = make_impl(CPUAttentionBackendImpl, 64)
    ours = make_impl(DDTreeCPUAttentionImpl, 64)
    ours.attn_type = "encoder_decoder"
    stock.attn_type = "encoder_decoder"
    batch = sc.tree_batch()
    assert torch.equal(sc.run(ours, batch=batch)[0], sc.run(stock)[0])
    assert not batch.stash


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
        dict(kv_cache_dtype="fp8"),
    ],
)
def test_refusals_at_model_load(kwargs):
    """Checked when the engine loads the model, never inside a forward."""
    impl = make_impl(DDTreeCPUAttentionImpl, 64, **kwargs)
    with pytest.raises(ValueError, match="layers.0.attn: DDTree tree attention"):
        attn_context.check_model_tree_attention(model_with(impl))


def test_model_load_check_passes_plain_layers_and_refuses_stock_impls():
    attn_context.check_model_tree_attention(
        model_with(make_impl(DDTreeCPUAttentionImpl, 64))
    )
    for kwargs in LAYER_FEATURES.values():  # honoured, so not refused
        attn_context.check_model_tree_attention(
            model_with(make_impl(DDTreeCPUAttentionImpl, 64, **kwargs))
        )
    encoder = make_impl(CPUAttentionBackendImpl, 64)
    encoder.attn_type = "encoder_only"  # no tree rows: left alone
    attn_context.check_model_tree_attention(model_with(encoder))
    with pytest.raises(ValueError, match="no ancestor-only tree attention"):
        attn_context.check_model_tree_attention(
            model_with(make_impl(CPUAttentionBackendImpl, 64))
        )



def test_commit_moves_accepted_path_to_contiguous_slots():
    sc = Scenario(torch.float32, 32, 64, REQS, seed=7)
    ours = make_impl(DDTreeCPUAttentionImpl, 64)
    batch = sc.tree_batch()
    _, cache = sc.run(ours, batch=batch)

    # Accept the path to each tree's last node (index > depth: non-identity).
    depth_cap = sc.tree.max_depth
    accepted = torch.full((len(batch.requests), depth_cap + 1), -1, dtype=torch.int64)
    for k, req in enumerate(batch.requests):
        path = ancestors_or_self(sc.tree.parents[k, : req.num_rows].tolist(), req.num_rows - 1)
        accepted[k, : len(path)] = torch.tensor(path)
    plan = plan_commit(accepted, torch.tensor(tree_block_starts(batch)), batch.num_tree_rows)
    assert bool(plan.moved().any())

    before = cache.clone()
    moved = batch.commit_kv((plan.src_rows, plan.dst_rows))
    assert moved == int(plan.moved().sum())

    tree_rows = sc.tree_rows()
    for k, req in enumerate(batch.requests):
        path = [p for p in accepted[k].tolist() if p >= 0]
        b, nc = req.req_index, req.prefix_len
        k_all, v_all = unpack_prefix(cache, sc.block_table[b], nc + len(path), sc.isa)
        k_old, v_old = unpack_prefix(before, sc.block_table[b], nc, sc.isa)
        assert torch.equal(k_all[:nc], k_old) and torch.equal(v_all[:nc], v_old)
        start = tree_block_starts(batch)[k]
        for j, p in enumerate(path):
            row = tree_rows[start + p]
            assert torch.equal(k_all[nc + j], sc.key[row])
            assert torch.equal(v_all[nc + j], sc.value[row])

    # The same moves expressed in batch rows give the same cache.
    again = before.clone()
    for stash in batch.stash.values():
        stash.kv_cache = again
    rows = torch.tensor(tree_rows)
    batch.commit_kv((rows[plan.src_rows], rows[plan.dst_rows]), row_space="batch")
    assert torch.equal(again, cache)
    with pytest.raises(IndexError):
        batch.commit_kv((torch.tensor([sc.qsl[1]]), torch.tensor([0])), row_space="batch")


def test_register_backend_is_idempotent():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    was = AttentionBackendEnum.CPU_ATTN.get_path()
    try:
        register_tree_attention_backend()
        register_tree_attention_backend()
        assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
        cls = AttentionBackendEnum.CPU_ATTN.get_class()
        assert cls is DDTreeCPUAttentionBackend
        assert cls.get_name() == "CPU_ATTN"
        assert cls.get_impl_cls() is DDTreeCPUAttentionImpl
    finally:
        if was != BACKEND_PATH:
            AttentionBackendEnum.CPU_ATTN.clear_override()
