# SPDX-License-Identifier: Apache-2.0
"""CPU_MLA and AMX_MLA with ancestor-only attention for DDTree's tree-verify forward.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) caches one latent row per
token: ``[kv_c_normed (L) ; k_pe (R)]`` (L = kv_lora_rank, R = qk_rope_head_dim),
one cache tensor per layer, no separate K and V. ``DDTreeCPUMLABackend`` and
``DDTreeAMXMLABackend`` replace vLLM's ``CPU_MLA`` and ``AMX_MLA`` (same names,
kernels, metadata and cache writes; AMX_MLA is vLLM's choice on AMX CPUs, with the
same flat latent cache in 32-token blocks): the stock layer computes every row
as usual (verify rows are prefills with a cached context there, exactly causal
over linear positions), then, while the layer's
metadata carries a tree batch (``attn_context``), the tree rows whose ancestors
are not exactly the block rows before them are recomputed in the latent space,
as MLA's absorbed decode computes a row:

    q_lat = q_nope @ W_UK                      # [F, N, L]  (W_UK: [L, N, P])
    s     = scale * (q_lat . kv_c + q_pe . k_pe)   over the committed latent
            rows and the tree block's own (masked to the row's ancestors)
    o     = softmax(s) @ kv_c @ W_UV           # [F, N, V]  (W_UV: [L, N, V])

``W_UK`` / ``W_UV`` are split from the layer's ``kv_b_proj`` once, after the
weights are loaded (float32 copies; AMX_MLA releases ``kv_b_proj``'s weight
right after its impl has packed its own). The KV commit moves latent rows inside the
cache (:class:`~vllm_ddtree.vllm_adapter.mla_common.LatentCacheStash`): the
forward has already written every tree row's latent entry to its slot.

https://arxiv.org/abs/2405.04434 (MLA), https://arxiv.org/abs/2604.12989 (DDTree).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend, AMXMLAImpl
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from vllm_ddtree.vllm_adapter import attn_context
from vllm_ddtree.vllm_adapter.cpu_attention import plan_for
from vllm_ddtree.vllm_adapter.mla_common import LatentCacheStash, WholeBatchTablesMixin

__all__ = [
    "DDTreeAMXMLABackend",
    "DDTreeAMXMLAImpl",
    "DDTreeAMXMLAMetadataBuilder",
    "DDTreeCPUMLABackend",
    "DDTreeCPUMLAImpl",
    "DDTreeCPUMLAMetadataBuilder",
    "register_mla_tree_attention_backend",
]

BACKEND_PATH = f"{__name__}.DDTreeCPUMLABackend"
AMX_BACKEND_PATH = f"{__name__}.DDTreeAMXMLABackend"


class LatentTreeRowsMixin(attn_context.TreeAwareImpl):
    """A CPU MLA impl (put it before the stock impl) whose ``forward_mha``
    recomputes the tree rows in the latent space (see the module docstring).
    Both CPU MLA builders take single-row decodes only, so every tree block (two
    rows or more) is in the prefill part."""

    def tree_refusals(self) -> dict[str, bool]:
        # vLLM's CPU MLA impls refuse windows, softcap, alibi and KV sharing.
        return {
            f"kv cache dtype {self.kv_cache_dtype!r}": self.kv_cache_dtype != "auto",
        }

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # [L, N, P] and [L, N, V], float32: the absorbed query and value paths.
        w_uk, w_uv = split_kv_b_proj(
            self.kv_b_proj,
            torch.float32,
            self.kv_lora_rank,
            self.num_heads,
            self.qk_nope_head_dim,
            self.v_head_dim,
        )
        self._w_uk = w_uk.contiguous()
        self._w_uv = w_uv.contiguous()

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        super().forward_mha(
            q,
            kv_c_normed,
            k_pe,
            kv_c_and_k_pe_cache,
            attn_metadata,
            k_scale,
            output,
            output_scale,
        )
        batch = getattr(attn_metadata, "tree", None)
        if batch is not None and batch.requests:
            if output_scale is not None:
                raise AssertionError(
                    "DDTree tree attention: an MLA layer passed the start-up "
                    "check but its forward fuses output quantization"
                )
            self._tree_forward(q, kv_c_and_k_pe_cache, attn_metadata, output, batch)

    def _tree_forward(self, q, kv_cache, metadata, output, batch) -> None:
        """Recomputes the tree rows. ``q`` and ``output`` hold the prefill rows
        only (vLLM's MLA puts decodes first): batch row ``b`` is row ``b -
        num_decode_tokens`` here. Every tree block has at least two rows, so it
        is a prefill."""
        plan = plan_for(batch, metadata, kv_cache.shape[1])
        first_row = metadata.num_decode_tokens
        lora, rope, nope = (
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.qk_nope_head_dim,
        )
        num_heads, v_dim = self.num_heads, self.v_head_dim
        flat = kv_cache.view(-1, lora + rope)
        out = output.view(output.shape[0], num_heads, v_dim)
        for k, entry in enumerate(plan.entries):
            _, bias = plan.windowed(k, 0)  # MLA layers have no window
            # [S, L + R]: the committed latent rows, then the tree block's.
            latent = flat.index_select(0, plan.slots(k, 0)).float()
            kv_c, k_pe = latent[:, :lora], latent[:, lora:]
            rows = entry.rows - first_row
            q_nope, q_pe = q.index_select(0, rows).float().split([nope, rope], -1)
            q_lat = torch.einsum("fnp,lnp->nfl", q_nope, self._w_uk)  # [N, F, L]
            # [N, F, S]: latent and rotary parts, scaled, masked.
            scores = torch.baddbmm(
                bias.expand(num_heads, -1, -1),
                q_lat,
                kv_c.T.expand(num_heads, -1, -1),
                alpha=self.scale,
            )
            scores.baddbmm_(
                q_pe.transpose(0, 1), k_pe.T.expand(num_heads, -1, -1), alpha=self.scale
            )
            o_lat = torch.softmax(scores, dim=-1) @ kv_c  # [N, F, L]
            o = torch.einsum("nfl,lnv->fnv", o_lat, self._w_uv)  # [F, N, V]
            out.index_copy_(0, rows, o.to(out.dtype))
        if batch.stash_kv and plan.rows.numel():
            batch.stash[f"mla@{id(kv_cache)}"] = LatentCacheStash(
                kv_cache=kv_cache,
                slot_mapping=metadata.slot_mapping,
                batch_rows=plan.rows,
            )


class DDTreeCPUMLAImpl(LatentTreeRowsMixin, CPUMLAImpl):
    """CPU_MLA impl: with a tree in its metadata, tree rows attend ancestor-only."""

    BACKEND_NAME = "CPU_MLA"


class DDTreeAMXMLAImpl(LatentTreeRowsMixin, AMXMLAImpl):
    """AMX_MLA impl: with a tree in its metadata, tree rows attend ancestor-only."""

    BACKEND_NAME = "AMX_MLA"


class DDTreeCPUMLAMetadataBuilder(
    attn_context.TreeAttentionMetadataBuilderMixin,
    WholeBatchTablesMixin,
    CPUMLABackend.get_builder_cls(),
):
    """CPU_MLA's builder; a verify step's metadata carries its trees, and the
    whole batch's sequence lengths and block table."""


class DDTreeCPUMLABackend(CPUMLABackend):
    """``CPU_MLA`` (same name, kernels and cache write), DDTree-aware builder and
    impl."""

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [16]

    @staticmethod
    def get_builder_cls() -> type[DDTreeCPUMLAMetadataBuilder]:
        return DDTreeCPUMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[DDTreeCPUMLAImpl]:
        return DDTreeCPUMLAImpl


class DDTreeAMXMLAMetadataBuilder(
    attn_context.TreeAttentionMetadataBuilderMixin,
    WholeBatchTablesMixin,
    AMXMLABackend.get_builder_cls(),
):
    """AMX_MLA's builder; a verify step's metadata carries its trees, and the
    whole batch's sequence lengths and block table."""


class DDTreeAMXMLABackend(AMXMLABackend):
    """``AMX_MLA`` (same name, kernels and cache write), DDTree-aware builder and
    impl."""

    @staticmethod
    def get_name() -> str:
        return "AMX_MLA"

    @staticmethod
    def get_builder_cls() -> type[DDTreeAMXMLAMetadataBuilder]:
        return DDTreeAMXMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[DDTreeAMXMLAImpl]:
        return DDTreeAMXMLAImpl


def register_mla_tree_attention_backend() -> None:
    """Makes ``AttentionBackendEnum.CPU_MLA`` and ``AMX_MLA`` resolve to the
    DDTree backends.

    Idempotent; see :func:`attn_context.override_attention_backend`.
    """
    attn_context.override_attention_backend("CPU_MLA", BACKEND_PATH)
    attn_context.override_attention_backend("AMX_MLA", AMX_BACKEND_PATH)
