# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the attention-backend tests."""

import torch


def model_with(impl) -> torch.nn.Module:
    """A module tree whose one attention layer (``layers.0.attn``) runs ``impl``."""
    layer = torch.nn.Module()
    layer.impl = impl
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].attn = layer
    return model


def tree_batch_from_block_starts(
    tree, block_starts, query_start_loc, seq_lens, num_drafts, stash_kv=True
):
    """The ``TreeAttentionBatch`` of one tree row per batch request.

    Request ``r``'s tree block starts at batch row ``block_starts[r]`` and has
    ``T = num_drafts[r] + 1`` rows; ``seq_lens[r]`` counts its cached tokens after
    the forward (``num_computed + num_scheduled``), so the root's position is
    ``nc = seq_lens[r] - (query_start_loc[r + 1] - block_starts[r])``. Root-only
    blocks (no drafts) are left out, as the runner leaves them out.
    """
    from vllm_ddtree.vllm_adapter.attn_context import TreeAttentionBatch

    def as_list(x):
        return x.tolist() if isinstance(x, torch.Tensor) else list(x)

    starts, qsl, lens = (
        as_list(block_starts),
        as_list(query_start_loc),
        as_list(seq_lens),
    )
    rows = [r for r, n in enumerate(num_drafts) if n > 0]
    return TreeAttentionBatch.from_tree(
        tree,
        tree_rows=rows,
        req_indices=rows,
        row_offsets=[starts[r] - qsl[r] for r in rows],
        num_rows=[int(num_drafts[r]) + 1 for r in rows],
        prefix_lens=[lens[r] - (qsl[r + 1] - starts[r]) for r in rows],
        stash_kv=stash_kv,
    )


def tree_block_starts(batch) -> list[int]:
    """First tree row (the root) of each listed request of ``batch``, in tree-row
    space (the tree blocks concatenated in list order)."""
    sizes = [r.num_rows for r in batch.requests]
    return [sum(sizes[:k]) for k in range(len(sizes))]


def unpack_prefix(kv_cache, block_table_row, num_tokens: int, isa: str):
    """The first ``num_tokens`` cached K and V of one sequence of the CPU paged
    cache (``[num_blocks, Hkv, block_size, 2 * D]``, ISA-packed), ``[n, Hkv, D]``
    each; ``block_table_row`` is its block ids, ``isa`` the layer's ``isa``."""
    from vllm_ddtree.vllm_adapter.cpu_attention import unpack_blocks

    block_size = kv_cache.shape[2]
    num_blocks = -(-num_tokens // block_size)
    k, v = unpack_blocks(kv_cache, block_table_row[:num_blocks], isa)
    return k[:num_tokens], v[:num_tokens]
