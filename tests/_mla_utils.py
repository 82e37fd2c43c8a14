# SPDX-License-Identifier: Apache-2.0
"""A batch over an MLA latent cache, shared by the CPU_MLA and TRITON_MLA tests.

The impl is built as vLLM's MLA layer builds it (a ``kv_b_proj`` and the MLA
dimensions; ``process_weights_after_loading`` splits W_UK / W_UV). The latent
cache ``[num_blocks, 16, kv_lora_rank + rope]`` is filled at random (prefixes and
the tree blocks' own rows, as the layer's cache write leaves it). Request 0 is a
plain decode row, requests 1 and 2 are tree blocks after 37 and 32 (a block
boundary) committed tokens. The oracle decompresses the latent rows (k = [kv_c
W_UK ; k_pe], v = kv_c W_UV: vLLM's MHA form) and attends in float64 over the
prefix and each node's ancestors.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from vllm_ddtree.commit import plan_commit
from vllm_ddtree.tree import build_ddtree
from vllm_ddtree.vllm_adapter import attn_context

LORA, ROPE, NOPE, V_DIM, HEADS, BLOCK = 512, 64, 32, 32, 4, 16
MARKER = 7.0


def make_impl(impl_cls, seed=0, dtype=torch.float32):
    """An MLA impl of ``impl_cls`` with random ``kv_b_proj`` weights, loaded."""
    g = torch.Generator().manual_seed(seed)
    kv_b_proj = nn.Linear(LORA, HEADS * (NOPE + V_DIM), bias=False, dtype=dtype)
    with torch.no_grad():
        kv_b_proj.weight.copy_(torch.randn(kv_b_proj.weight.shape, generator=g) / 8)
    kv_b_proj.quant_method = UnquantizedLinearMethod()
    # MLACommonImpl reads the parallel config (decode context parallelism).
    with set_current_vllm_config(VllmConfig()):
        impl = impl_cls(
            HEADS, LORA + ROPE, (NOPE + ROPE) ** -0.5, 1, None, None, "auto", None,
            "decoder", None, q_lora_rank=None, kv_lora_rank=LORA,
            qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, qk_head_dim=NOPE + ROPE,
            v_head_dim=V_DIM, kv_b_proj=kv_b_proj,
        )
    impl.process_weights_after_loading(dtype)
    return impl


def weights(impl) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, N, P] W_UK and [L, N, V] W_UV of ``impl``'s ``kv_b_proj``, float64."""
    w = impl.kv_b_proj.weight.detach().double().T.view(LORA, HEADS, NOPE + V_DIM)
    return w[..., :NOPE], w[..., NOPE:]


class Scenario:
    """Three requests; ``num_decodes`` of them form the decode part (vLLM's MLA
    orders decodes first), the rest the prefill part."""

    def __init__(self, seed=0, num_decodes=1, device="cpu"):
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
        self.device = device
        self.metadata = SimpleNamespace(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=self.block_table.to(device),
            num_actual_tokens=n,
            num_decodes=num_decodes,
            num_decode_tokens=qsl[num_decodes],
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )

    def slot(self, r, pos) -> int:
        return int(self.block_table[r, pos // BLOCK]) * BLOCK + pos % BLOCK

    def batch(self) -> attn_context.TreeAttentionBatch:
        return attn_context.TreeAttentionBatch.from_tree(
            self.tree, [0, 1], [1, 2], [0, 0], self.sizes[1:], self.prefix[1:]
        )

    def oracle_row(self, impl, r, i, visibility=None) -> torch.Tensor:
        """float64 MHA over the decompressed latent rows: prefix + ancestors."""
        nc = self.prefix[r]
        vis = (self.tree.visibility if visibility is None else visibility)[r - 1, i]
        positions = list(range(nc)) + [nc + j for j in range(len(vis)) if vis[j]]
        latent = torch.stack(
            [self.cache.view(-1, LORA + ROPE)[self.slot(r, p)] for p in positions]
        ).double()
        kv_c, k_pe = latent[:, :LORA], latent[:, LORA:]
        w_uk, w_uv = weights(impl)
        k_nope = torch.einsum("sl,lnp->snp", kv_c, w_uk)
        keys = torch.cat([k_nope, k_pe[:, None].expand(-1, HEADS, -1)], -1)
        values = torch.einsum("sl,lnv->snv", kv_c, w_uv)
        q = self.q[self.qsl[r] + i].double()  # [N, P + R]
        probs = (torch.einsum("nd,snd->ns", q, keys) * impl.scale).softmax(-1)
        return torch.einsum("ns,snv->nv", probs, values).reshape(-1)

    def accepted_paths(self) -> list[list[int]]:
        """Per tree request, the root path of its deepest node (highest index
        among the deepest): a sibling path in this scenario."""
        paths = []
        for k in range(2):
            parents = self.tree.parents[k].tolist()
            depth = self.tree.visibility[k].sum(-1) - 1
            leaf = max(range(self.sizes[k + 1]), key=lambda i: (int(depth[i]), i))
            path = [leaf]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            paths.append(path[::-1])
        return paths

    def commit_and_check(self, batch, cache, row_space="tree") -> None:
        """Commits the accepted paths through ``batch`` and checks that the path's
        latent rows land at its slots (request 2's crosses a block boundary)."""
        paths = self.accepted_paths()
        assert any(p != list(range(len(p))) for p in paths)  # a sibling path
        width = max(len(p) for p in paths)
        accepted = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
        starts = torch.tensor([0, self.sizes[1]])
        plan = plan_commit(accepted, starts, sum(self.sizes[1:]))
        src, dst = plan.src_rows, plan.dst_rows
        if row_space == "batch":  # tree rows follow request 0's one row
            src, dst = src + self.sizes[0], dst + self.sizes[0]
        before = cache.clone().view(-1, LORA + ROPE)
        batch.commit_kv((src, dst), row_space=row_space)
        flat = cache.view(-1, LORA + ROPE)
        for k, path in enumerate(paths):
            r = k + 1
            for depth, node in enumerate(path):
                dst_slot = self.slot(r, self.prefix[r] + depth)
                src_slot = self.slot(r, self.prefix[r] + node)
                assert torch.equal(flat[dst_slot].cpu(), before[src_slot].cpu())
        assert len(paths[1]) > 1 and self.prefix[2] % BLOCK == 0
