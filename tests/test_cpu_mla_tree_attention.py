# SPDX-License-Identifier: Apache-2.0
"""DDTree's CPU_MLA override: tree rows in MLA's latent space, the latent commit.

No engine: the impl is built as vLLM's MLA layer builds it (a ``kv_b_proj`` and
the MLA dimensions; ``process_weights_after_loading`` splits W_UK / W_UV), the
latent cache ``[num_blocks, 16, kv_lora_rank + rope]`` is filled at random
(prefixes and the tree blocks' own rows, as the layer's cache write leaves it),
and the tree path runs on the prefill rows of a batch whose first request is a
plain decode (vLLM's MLA orders decodes first). The oracle decompresses the
latent rows (k = [kv_c W_UK ; k_pe], v = kv_c W_UV: vLLM's MHA form) and attends
in float64 over the prefix and each node's ancestors.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from torch import nn  # noqa: E402
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402

from vllm_ddtree.commit import plan_commit  # noqa: E402
from vllm_ddtree.tree import build_ddtree  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context  # noqa: E402
from vllm_ddtree.vllm_adapter.cpu_mla_attention import (  # noqa: E402
    BACKEND_PATH,
    DDTreeCPUMLABackend,
    DDTreeCPUMLAImpl,
    LatentCacheStash,
    register_mla_tree_attention_backend,
)

LORA, ROPE, NOPE, V_DIM, HEADS, BLOCK = 512, 64, 32, 32, 4, 16
MARKER = 7.0


def make_impl(seed=0) -> DDTreeCPUMLAImpl:
    g = torch.Generator().manual_seed(seed)
    kv_b_proj = nn.Linear(LORA, HEADS * (NOPE + V_DIM), bias=False)
    with torch.no_grad():
        kv_b_proj.weight.copy_(torch.randn(kv_b_proj.weight.shape, generator=g) / 8)
    kv_b_proj.quant_method = UnquantizedLinearMethod()
    impl = DDTreeCPUMLAImpl(
        HEADS, LORA + ROPE, (NOPE + ROPE) ** -0.5, 1, None, None, "auto", None,
        "decoder", None, q_lora_rank=None, kv_lora_rank=LORA, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, qk_head_dim=NOPE + ROPE, v_head_dim=V_DIM,
        kv_b_proj=kv_b_proj,
    )
    impl.process_weights_after_loading(torch.float32)
    return impl


class Scenario:
    """Request 0: a plain decode row; requests 1 and 2: tree blocks after 37 and
    32 (a block boundary) committed tokens."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(2, 4, 6, generator=g)  # L = 4, V = 6: branching
        self.tree = build_ddtree(logits, torch.tensor([9, 12]), max_budget=12)
        self.sizes = [1] + [int(n) + 1 for n in self.tree.num_nodes]
        self.prefix = [20, 37, 32]
        seq_lens = [p + t for p, t in zip(self.prefix, self.sizes, strict=True)]
        blocks = [-(-s // BLOCK) for s in seq_lens]
        perm = torch.randperm(sum(blocks) + 2, generator=g)
        self.block_table = torch.zeros(3, max(blocks) + 1, dtype=torch.int32)
        at = 0
        for r, n in enumerate(blocks):
            self.block_table[r, :n] = perm[at : at + n]
            at += n
        self.cache = torch.randn(len(perm), BLOCK, LORA + ROPE, generator=g)
        qsl = [0]
        for t in self.sizes:
            qsl.append(qsl[-1] + t)
        self.qsl = qsl
        n = qsl[-1]
        self.q = torch.randn(n, HEADS, NOPE + ROPE, generator=g)
        slots = []
        for r, t in enumerate(self.sizes):
            for pos in range(self.prefix[r], self.prefix[r] + t):
                slots.append(self.slot(r, pos))
        self.metadata = SimpleNamespace(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=self.block_table,
            num_actual_tokens=n,
            num_decode_tokens=1,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )

    def slot(self, r, pos) -> int:
        return int(self.block_table[r, pos // BLOCK]) * BLOCK + pos % BLOCK

    def batch(self) -> attn_context.TreeAttentionBatch:
        return attn_context.TreeAttentionBatch.from_tree(
            self.tree, [0, 1], [1, 2], [0, 0], self.sizes[1:], self.prefix[1:]
        )

    def run(self, impl, batch, cache=None):
        """The tree path on the prefill rows (rows 1 ..), output pre-filled."""
        cache = self.cache if cache is None else cache
        out = torch.full((self.q.shape[0], HEADS * V_DIM), MARKER)
        metadata = attn_context.metadata_with_tree(self.metadata, batch)
        impl._tree_forward(self.q[1:], cache, metadata, out[1:], batch)
        return out

    def oracle_row(self, impl, r, i) -> torch.Tensor:
        """float64 MHA over the decompressed latent rows: prefix + ancestors."""
        k = r - 1  # tree row
        nc = self.prefix[r]
        vis = self.tree.visibility[k, i]
        positions = list(range(nc)) + [nc + j for j in range(len(vis)) if vis[j]]
        latent = torch.stack(
            [self.cache.view(-1, LORA + ROPE)[self.slot(r, p)] for p in positions]
        ).double()
        kv_c, k_pe = latent[:, :LORA], latent[:, LORA:]
        w_uk, w_uv = impl._w_uk.double(), impl._w_uv.double()
        k_nope = torch.einsum("sl,lnp->snp", kv_c, w_uk)
        keys = torch.cat([k_nope, k_pe[:, None].expand(-1, HEADS, -1)], -1)
        values = torch.einsum("sl,lnv->snv", kv_c, w_uv)
        q = self.q[self.qsl[r] + i].double()  # [N, P + R]
        probs = (torch.einsum("nd,snd->ns", q, keys) * impl.scale).softmax(-1)
        return torch.einsum("ns,snv->nv", probs, values).reshape(-1)


def test_tree_rows_attend_ancestors_in_latent_space():
    sc, impl = Scenario(), make_impl()
    out = sc.run(impl, sc.batch())
    recomputed = []
    for r in (1, 2):
        vis = sc.tree.visibility[r - 1]
        for i in range(sc.sizes[r]):
            row = sc.qsl[r] + i
            spine = torch.equal(vis[i, : i + 1], torch.ones(i + 1, dtype=torch.bool))
            if spine:  # sees exactly the rows before it: the stock output stays
                assert bool((out[row] == MARKER).all())
                continue
            recomputed.append(row)
            torch.testing.assert_close(
                out[row].double(), sc.oracle_row(impl, r, i), atol=1e-4, rtol=1e-4
            )
    assert len(recomputed) > 10
    assert bool((out[0] == MARKER).all())  # the decode row is not touched


def test_a_causal_tree_row_would_be_caught():
    """The oracle depends on the mask: causal attention over the block differs."""
    sc, impl = Scenario(), make_impl()
    out = sc.run(impl, sc.batch())
    vis = sc.tree.visibility[0].clone()
    sc.tree.visibility[0] = torch.ones_like(vis).tril()
    causal = [sc.oracle_row(impl, 1, i) for i in range(sc.sizes[1])]
    sc.tree.visibility[0] = vis
    rows = [
        i for i in range(sc.sizes[1])
        if not torch.equal(vis[i, : i + 1], torch.ones(i + 1, dtype=torch.bool))
    ]
    worst = max((out[sc.qsl[1] + i].double() - causal[i]).abs().max() for i in rows)
    assert worst > 1e-2


def test_commit_moves_latent_rows_across_a_block_boundary():
    """Request 1 (prefix 37) accepts a sibling path; request 2 (prefix 32) a path
    whose rows start a new block: the latent rows land at the path's slots."""
    sc, impl = Scenario(), make_impl()
    batch = sc.batch()
    cache = sc.cache.clone()
    sc.run(impl, batch, cache)
    (stash,) = batch.stash.values()
    assert isinstance(stash, LatentCacheStash)
    paths = []
    for k in range(2):
        parents = sc.tree.parents[k].tolist()
        depth = sc.tree.visibility[k].sum(-1) - 1
        leaf = max(range(sc.sizes[k + 1]), key=lambda i: (int(depth[i]), i))
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    assert any(p != list(range(len(p))) for p in paths)  # a sibling path
    width = max(len(p) for p in paths)
    accepted = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
    starts = torch.tensor([0, sc.sizes[1]])
    plan = plan_commit(accepted, starts, sum(sc.sizes[1:]))
    before = cache.clone().view(-1, LORA + ROPE)
    batch.commit_kv((plan.src_rows, plan.dst_rows))
    flat = cache.view(-1, LORA + ROPE)
    for k, path in enumerate(paths):
        r = k + 1
        for depth, node in enumerate(path):
            dst = sc.slot(r, sc.prefix[r] + depth)
            src = sc.slot(r, sc.prefix[r] + node)
            assert torch.equal(flat[dst], before[src])
    # Request 2's path crosses from block boundary 32 into its next block.
    assert len(paths[1]) > 1 and sc.prefix[2] % BLOCK == 0


def test_backend_is_cpu_mla_with_tree_aware_parts():
    was = None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    was = AttentionBackendEnum.CPU_MLA.get_path()
    try:
        register_mla_tree_attention_backend()
        register_mla_tree_attention_backend()
        assert AttentionBackendEnum.CPU_MLA.get_path() == BACKEND_PATH
        cls = AttentionBackendEnum.CPU_MLA.get_class()
        assert cls is DDTreeCPUMLABackend and cls.get_name() == "CPU_MLA"
        assert cls.get_impl_cls() is DDTreeCPUMLAImpl
        assert issubclass(
            cls.get_builder_cls(), attn_context.TreeAttentionMetadataBuilderMixin
        )
    finally:
        if was != BACKEND_PATH:
            AttentionBackendEnum.CPU_MLA.clear_override()


def test_model_load_check_accepts_the_mla_impl_and_refuses_fp8():
    from _attn_utils import model_with

    impl = make_impl()
    attn_context.check_model_tree_attention(model_with(impl))
    impl.kv_cache_dtype = "fp8"
    with pytest.raises(ValueError, match="kv cache dtype 'fp8'"):
        attn_context.check_model_tree_attention(model_with(impl))


def test_amx_mla_is_refused_with_the_backend_to_select():
    """AMX CPUs get vLLM's AMX_MLA, which has no tree path: the load check names
    the layer and the backend that has one."""
    from _attn_utils import model_with
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    amx = type("AMXMLAImpl", (CPUMLAImpl,), {})  # vLLM's class needs AMX to build
    with pytest.raises(ValueError, match="layers.0.attn runs AMXMLAImpl.*'CPU_MLA'"):
        attn_context.check_model_tree_attention(model_with(object.__new__(amx)))
