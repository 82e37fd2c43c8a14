# SPDX-License-Identifier: Apache-2.0
"""KV commit for DDTree: move accepted tree nodes' K/V to contiguous positions.

The verify forward writes tree node ``i`` of a request at sequence position
``prefix_len + i`` of vLLM's paged KV cache. After verification, the accepted path
``[0, p_1, ..., p_a]`` must occupy positions ``prefix_len + j``, so the K/V of
node ``p_j`` moves to depth ``j`` in every attention layer.
``commit.plan_commit`` gives these moves as flat verify rows; the caller maps
rows to cache *slots* with the block table (vLLM's ``slot_mapping`` convention:
``slot = block_id * block_size + block_offset``).

Layout, per layer: any strided view ::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]  # K, V

TRITON_ATTN in vLLM 0.32 allocates ``[num_blocks, num_kv_heads, block_size,
2 * head_dim]`` per layer (logical order; the physical strides follow the
engine's ``KVCacheLayout``, and unquantized caches have no scale padding);
``vllm_adapter.gpu_attention.paged_kv_view`` gives that cache as this view
without a copy. The kernel reads every stride.

Semantics: for every layer, K and V at ``dst_slots[i]`` become what was at
``src_slots[i]`` *before* any write (gather-then-scatter); moves with
``src == dst`` are skipped (``plan_commit`` pads with such self-moves).

:func:`commit_kv_triton` moves every layer in one launch, in place, without a
scratch buffer and without a host sync (tested against a torch reference of these
semantics). It equals gather-then-scatter when the moves are *ordered*: no moving
entry writes a slot that a later moving entry reads, i.e. for ``k < j``
``dst[k] != src[j]``. Accepted paths satisfy this: within a request, depth ``k``
is written (position ``prefix + k``) before depth ``j > k`` reads position
``prefix + p_j`` with ``p_j >= j > k``; a request's positions map to distinct
slots, and requests own disjoint slots. The reverse overlap (``dst[k] ==
src[j]`` for ``j < k``, e.g. ``p_1 = 2`` and ``p_2 = 3``: depth 2 writes the row
depth 1 reads) is common and is handled by the kernel (see below).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vllm_ddtree.ops.triton_verify import _interpreting

__all__ = ["commit_kv_triton"]

_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
# Pointer tables by (device, data pointers): built once per set of caches (vLLM
# allocates its KV cache once), so a commit does not copy host memory to the
# device (a synchronizing copy) each time; after that first call the launch is
# also CUDA-graph capturable.
_PTR_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_PTR_TABLES = 16


def _check_args(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Checks shapes, dtypes and devices (metadata only: no device sync)."""
    if not isinstance(kv_caches, (list, tuple)):
        raise ValueError(
            f"kv_caches must be a list of per-layer tensors, got {type(kv_caches)}"
        )
    first = kv_caches[0] if kv_caches else None
    for i, cache in enumerate(kv_caches):
        if not isinstance(cache, torch.Tensor):
            raise ValueError(f"kv_caches[{i}] must be a tensor, got {type(cache)}")
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(
                f"kv_caches[{i}] must be [2, num_blocks, block_size, num_kv_heads, "
                f"head_dim], got {tuple(cache.shape)}"
            )
        if cache.dtype not in _CACHE_DTYPES:
            raise ValueError(
                f"kv_caches[{i}] dtype must be one of {_CACHE_DTYPES}, got "
                f"{cache.dtype}"
            )
        if (cache.shape, cache.dtype, cache.device) != (
            first.shape,
            first.dtype,
            first.device,
        ):
            raise ValueError(
                f"kv_caches[{i}] is {cache.dtype} {tuple(cache.shape)} on "
                f"{cache.device}, but kv_caches[0] is {first.dtype} "
                f"{tuple(first.shape)} on {first.device}"
            )
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if not isinstance(slots, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(slots)}")
        if slots.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got {tuple(slots.shape)}")
        if slots.dtype not in _SLOT_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {slots.dtype}")
        if first is not None and slots.device != first.device:
            raise ValueError(
                f"{name} is on {slots.device} but kv_caches are on {first.device}"
            )
    if src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"src_slots and dst_slots differ in length: {src_slots.numel()} vs "
            f"{dst_slots.numel()}"
        )


@triton.jit
def _slot_offset(slot, block_size, stride_block, stride_offset):
    """Element offset of a slot's (block, offset) row, int64."""
    return (slot // block_size) * stride_block + (slot % block_size) * stride_offset


# num_moves changes every step: not specialised on (a value of 1 or a multiple of
# 16 would each compile a variant mid-serving).
@triton.jit(do_not_specialize=["num_moves"])
def _commit_kv_kernel(
    cache_ptrs,  # [num_layers] int64: data pointer of each layer's cache
    layer0_cache,  # kv_caches[0]: only its element type is used
    src_slots_ptr,  # [num_moves] int32/int64
    dst_slots_ptr,  # [num_moves] int32/int64
    num_moves,
    block_size,
    head_dim,
    stride_kv,  # element strides of [2, num_blocks, block_size, heads, head_dim]
    stride_block,
    stride_offset,
    stride_head,
    stride_dim,
    ADDR_ALIGN: tl.constexpr,  # bytes every cache's data pointer is a multiple of
    NUM_D_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # moves per tile
    BLOCK_D: tl.constexpr,  # head_dim elements per program
):
    layer = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2) // NUM_D_CHUNKS
    d_chunk = tl.program_id(2) % NUM_D_CHUNKS

    base = tl.load(cache_ptrs + layer).to(
        tl.pointer_type(layer0_cache.dtype.element_ty)
    )
    # The cast drops the alignment Triton assumes for pointer arguments; without
    # this hint (on the pointer: a hint on the integer is lost in the cast) every
    # access is a 2-byte load/store instead of 16 bytes.
    base = tl.multiple_of(base, ADDR_ALIGN)
    base += kv * stride_kv + head.to(tl.int64) * stride_head

    d = d_chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    d_off = d.to(tl.int64) * stride_dim

    for start in range(0, num_moves, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        m_mask = m < num_moves
        src = tl.load(src_slots_ptr + m, mask=m_mask, other=0).to(tl.int64)
        dst = tl.load(dst_slots_ptr + m, mask=m_mask, other=0).to(tl.int64)
        # Self-moves (plan_commit's padding) touch no memory.
        move = m_mask & (src != dst)
        src_row = _slot_offset(src, block_size, stride_block, stride_offset)
        dst_row = _slot_offset(dst, block_size, stride_block, stride_offset)
        mask = move[:, None] & d_mask[None, :]
        x = tl.load(base + src_row[:, None] + d_off[None, :], mask=mask)
        # Threads write other threads' rows: a tile may write a row it also reads
        # (dst[k] == src[j], j < k, common on accepted paths), so every read of
        # the tile completes before any write.
        tl.debug_barrier()
        tl.store(base + dst_row[:, None] + d_off[None, :], x, mask=mask)
        # Tiles run in move order: the next tile reads after this one has written.
        tl.debug_barrier()


def _ptr_table(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """[num_layers] int64 data pointers on the caches' device (cached)."""
    device = kv_caches[0].device
    ptrs = tuple(cache.data_ptr() for cache in kv_caches)
    key = (device, ptrs)
    table = _PTR_TABLES.get(key)
    if table is None:
        if len(_PTR_TABLES) >= _MAX_PTR_TABLES:
            _PTR_TABLES.clear()
        table = torch.tensor(ptrs, dtype=torch.int64, device=device)
        _PTR_TABLES[key] = table
    return table


def _check_ordered_moves(
    src_slots: torch.Tensor, dst_slots: torch.Tensor, num_slots: int
) -> None:
    """Raises ValueError unless the kernel's precondition holds (syncs)."""
    src, dst = src_slots.long(), dst_slots.long()
    for name, slots in (("src_slots", src), ("dst_slots", dst)):
        if bool(((slots < 0) | (slots >= num_slots)).any()):
            raise ValueError(f"{name} has a slot outside [0, {num_slots})")
    moving = src != dst
    src, dst = src[moving], dst[moving]
    if dst.numel() == 0:
        return
    sorted_dst, writer = dst.sort()
    if bool((sorted_dst[1:] == sorted_dst[:-1]).any()):
        raise ValueError("dst_slots: two moving entries write the same slot")
    # For each read, the (unique) moving entry writing that slot, if any.
    pos = torch.searchsorted(sorted_dst, src).clamp_(max=dst.numel() - 1)
    written = sorted_dst[pos] == src
    reader = torch.arange(src.numel(), device=src.device)
    if bool((written & (writer[pos] < reader)).any()):
        raise ValueError(
            "src_slots/dst_slots are not ordered: an entry reads a slot that an "
            "earlier entry writes (dst[k] == src[j] with k < j)"
        )


def commit_kv_triton(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    validate: bool = False,
    block_moves: int = 32,
) -> None:
    """Copies K/V from ``src_slots`` to ``dst_slots`` in every layer, one launch.

    Grid ``(num_layers, 2, num_kv_heads * ceil(head_dim / BLOCK_D))``: a program
    owns one (layer, K or V, head, head_dim chunk), so programs never touch the
    same memory. It walks the moves in order, ``block_moves`` at a time: it loads
    the tile's source rows, waits for the whole tile (a CTA barrier), stores them,
    and waits again. Within a tile this is exactly gather-then-scatter; across
    tiles it is sequential, which equals gather-then-scatter when the moves are
    ordered (module doc) -- always true for accepted paths from ``plan_commit``.

    Nothing to move never costs a host sync: zero moves return before launching;
    when every entry is a self-move the kernel still launches (finding that out
    on the host would synchronize) and its masks skip every load and store.

    Args:
        kv_caches: per-layer [2, num_blocks, block_size, num_kv_heads, head_dim]
            float16/bfloat16/float32 caches of one shape, dtype, device and
            strides (vLLM allocates every layer alike); modified in place.
        src_slots: [num_moves] int32/int64 slots to read, in range (unchecked
            unless ``validate``).
        dst_slots: [num_moves] int32/int64 slots to write. Moving entries must
            have distinct destinations and be ordered (module doc).
        validate: also check that slots are in range, that moving entries have
            distinct destinations, and that the moves are ordered (no
            ``dst[k] == src[j]`` with ``k < j``); synchronizes the device.
        block_moves: moves per tile (a power of two); a tuning knob.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or strides, an
            unusable device, or (with ``validate``) unordered or out-of-range
            moves.
    """
    _check_args(kv_caches, src_slots, dst_slots)
    if block_moves < 1 or block_moves & (block_moves - 1):
        raise ValueError(f"block_moves must be a power of two, got {block_moves}")
    if not kv_caches or src_slots.numel() == 0:
        return
    first = kv_caches[0]
    if first.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"kv_caches are on {first.device}: the Triton kernel needs a GPU "
            "(or TRITON_INTERPRET=1)"
        )
    for i, cache in enumerate(kv_caches):
        if cache.stride() != first.stride():
            raise ValueError(
                f"kv_caches[{i}] has strides {cache.stride()}, kv_caches[0] has "
                f"{first.stride()}: every layer must share one layout"
            )
    _, num_blocks, block_size, num_kv_heads, head_dim = first.shape
    if validate:
        _check_ordered_moves(src_slots, dst_slots, num_blocks * block_size)

    # Largest power of two (<= 16 bytes) dividing every layer's address, for the
    # kernel's alignment hint; tensors are element-aligned, so it stops there.
    addr_align = 16
    while any(cache.data_ptr() % addr_align for cache in kv_caches):
        addr_align //= 2
    block_d = min(triton.next_power_of_2(head_dim), 128)
    num_d_chunks = triton.cdiv(head_dim, block_d)
    grid = (len(kv_caches), 2, num_kv_heads * num_d_chunks)
    _commit_kv_kernel[grid](
        _ptr_table(kv_caches),
        first,
        src_slots.contiguous(),
        dst_slots.contiguous(),
        src_slots.numel(),
        block_size,
        head_dim,
        *first.stride(),
        ADDR_ALIGN=addr_align,
        NUM_D_CHUNKS=num_d_chunks,
        BLOCK_M=block_moves,
        BLOCK_D=block_d,
    )
