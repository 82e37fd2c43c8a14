# SPDX-License-Identifier: Apache-2.0
"""What DDTree's MLA tree backends share (``CPU_MLA`` on the CPU, ``TRITON_MLA`` on
CUDA): the commit inside the latent cache and the whole-batch tables that vLLM's
MLA metadata keeps split into decodes and prefills.

MLA (https://arxiv.org/abs/2405.04434) caches one latent row per token,
``[kv_c_normed (L) ; k_pe (R)]``, one cache tensor ``[num_blocks, block_size, L +
R]`` per layer. The verify forward has already written every tree row's latent
row to its slot, so the commit moves rows inside the caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.vllm_adapter import attn_context

__all__ = ["LatentCacheStash", "WholeBatchTablesMixin"]


@dataclass
class LatentCacheStash:
    """One MLA layer's latent cache, for the in-cache commit (nothing copied)."""

    # [num_blocks, block_size, L + R] the layer's latent cache (a reference).
    kv_cache: torch.Tensor
    # [num_tokens] the forward's cache slot of every batch row.
    slot_mapping: torch.Tensor
    # [M] int64 batch rows of the tree rows (tree-row order).
    batch_rows: torch.Tensor

    @classmethod
    def commit_all(
        cls,
        batch: attn_context.TreeAttentionBatch,
        moves: tuple[torch.Tensor, torch.Tensor],
        row_space: str,
    ) -> int:
        """``TreeAttentionBatch.commit_kv`` for latent stashes: per layer, every
        source row is gathered before any slot is written (so moves may chain),
        with no host synchronization. Returns the number of moves passed."""
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
        src_slots, dst_slots = slots[src], slots[dst]
        for stash in stashes:
            flat = stash.kv_cache.view(-1, stash.kv_cache.shape[-1])
            flat.index_copy_(0, dst_slots, flat.index_select(0, src_slots))
        return int(src.numel())


class WholeBatchTablesMixin:
    """An MLA metadata builder (put it before the stock builder) whose metadata
    also carries the whole batch's ``seq_lens`` and ``block_table``, which
    vLLM's MLA metadata keeps only split into decodes and prefills: the tree
    plans index them by request."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.seq_lens = common_attn_metadata.seq_lens
        metadata.block_table = common_attn_metadata.block_table_tensor
        return metadata
