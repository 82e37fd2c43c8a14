# SPDX-License-Identifier: Apache-2.0
"""Tree attention in MLA's latent space over vLLM's paged latent cache.

Multi-head latent attention (https://arxiv.org/abs/2405.04434; DeepSeek-V2/V3,
Kimi-K2) caches one row per token, ``[kv_c (L) ; k_pe (R)]`` (vLLM's MLA cache
``[num_blocks, block_size, L + R]``), and decodes in absorbed form: the query's
no-RoPE part is projected into the latent space (``q_lat = q_nope @ W_UK``), every
head attends to the same latent rows (multi-query), and the output stays latent
until ``W_UV``:

    s[h, j] = scale * (q_lat[h] . kv_c[j] + q_pe[h] . k_pe[j])
    o_lat[h] = sum_j softmax(s[h])_j kv_c[j]                       # [L]

For the DDTree verify pass, request ``r`` has ``prefix_lens[r]`` committed tokens
and ``tree_lens[r]`` tree rows (root first) whose latent rows are already in the
cache at positions ``prefix_lens[r] ..``; tree row ``i`` attends to every
committed row and to tree row ``j`` iff bit ``j`` of row ``i`` of the packed
ancestor mask is set (``DraftTree.visibility_packed``, the format of
:mod:`vllm_ddtree.ops.tree_attention`).

:func:`mla_tree_attention_triton` runs one program per (request, ``BLOCK_Q``
tree rows, ``BLOCK_H`` heads); the heads are folded with the rows into the
program's query tile (MQA: every head reads the same latent tile), online softmax
in float32 over the prefix, then over the tree rows with the ancestor bits. No
host synchronization. It is tested against a torch reference (one request at a
time, float32).

Rows of no request and rows that see no key are zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.ops.tree_attention import (
    _FLOAT_DTYPES,
    _LOG2E,
    _check_block,
    _check_tensor,
    _check_tree_layout,
    _mma,
    _online_softmax_step,
)
from vllm_ddtree.ops.triton_verify import _interpreting

__all__ = ["mla_tree_attention_triton"]


def _check_inputs(
    q_lat,
    q_pe,
    latent_cache,
    block_table,
    prefix_lens,
    tree_lens,
    query_start_loc,
    tree_mask_bits,
    scale,
) -> None:
    """Shapes, dtypes and devices; reads no tensor values (no host sync)."""
    _check_tensor("q_lat", q_lat, 3, _FLOAT_DTYPES, None)
    device = q_lat.device
    num_tokens, num_heads, lora = q_lat.shape
    _check_tensor("q_pe", q_pe, 3, (q_lat.dtype,), device)
    if q_pe.shape[:2] != (num_tokens, num_heads):
        raise ValueError(
            f"q_pe must be [{num_tokens}, {num_heads}, rope], got {tuple(q_pe.shape)}"
        )
    rope = q_pe.shape[2]
    _check_tensor("latent_cache", latent_cache, 3, (q_lat.dtype,), device)
    if latent_cache.shape[2] != lora + rope:
        raise ValueError(
            f"latent_cache rows must hold kv_lora_rank + rope = {lora + rope} "
            f"entries, got {tuple(latent_cache.shape)}"
        )
    _check_tree_layout(
        device, block_table, prefix_lens, tree_lens, query_start_loc, tree_mask_bits
    )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float, got {scale!r}")


@triton.jit
def _load_latent(
    cache_ptr,
    bt_row_ptr,
    stride_bt,
    pos,
    key_ok,
    offs_l,
    offs_r,
    stride_cb,
    stride_cs,
    LORA: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """kv_c [BLOCK_N, L] and k_pe [BLOCK_N, R] tiles of sequence positions ``pos``."""
    blk = tl.load(bt_row_ptr + (pos // BLOCK_SIZE) * stride_bt, mask=key_ok, other=0)
    row = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
    kv_c = tl.load(
        cache_ptr + row[:, None] + offs_l[None, :], mask=key_ok[:, None], other=0.0
    )
    k_pe = tl.load(
        cache_ptr + row[:, None] + LORA + offs_r[None, :],
        mask=key_ok[:, None],
        other=0.0,
    )
    return kv_c, k_pe


# Mask strides follow the step's largest tree: not specialised on (one compiled
# variant for every step).
@triton.jit(do_not_specialize=["stride_mr", "stride_mi"])
def _mla_tree_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, L], contiguous
    q_lat_ptr,  # [num_tokens, num_heads, L]
    q_pe_ptr,  # [num_tokens, num_heads, R]
    cache_ptr,  # [num_blocks, block_size, L + R], last dim contiguous
    block_table_ptr,  # [num_reqs, max_blocks]
    prefix_lens_ptr,
    tree_lens_ptr,
    query_start_loc_ptr,
    mask_ptr,  # [num_reqs, max_tree_rows, num_words] int32
    scale_log2,  # softmax scale * log2(e)
    num_heads,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_btr,
    stride_btb,
    stride_mr,
    stride_mi,
    stride_mw,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # tree rows per program
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_SIZE: tl.constexpr,  # cache block size
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    req = tl.program_id(0)
    row_start = tl.program_id(1) * BLOCK_Q
    head_start = tl.program_id(2) * BLOCK_H
    tree_len = tl.load(tree_lens_ptr + req).to(tl.int32)
    if row_start >= tree_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + req).to(tl.int32)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    tree_row = row_start + offs_m // BLOCK_H
    head = head_start + offs_m % BLOCK_H
    row_ok = (tree_row < tree_len) & (head < num_heads)
    token = q_start + tree_row
    offs_l = tl.arange(0, LORA)
    offs_r = tl.arange(0, ROPE)
    q_lat = tl.load(
        q_lat_ptr
        + token[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_l[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, L]
    q_pe = tl.load(
        q_pe_ptr
        + token[:, None] * stride_pt
        + head[:, None] * stride_ph
        + offs_r[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, R]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LORA], tl.float32)
    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_btr
    offs_n = tl.arange(0, BLOCK_N)

    # Committed rows: seen by every tree row.
    for start in range(0, prefix_len, BLOCK_N):
        pos = start + offs_n
        key_ok = pos < prefix_len
        kv_c, k_pe = _load_latent(
            cache_ptr,
            bt_row_ptr,
            stride_btb,
            pos,
            key_ok,
            offs_l,
            offs_r,
            stride_cb,
            stride_cs,
            LORA,
            BLOCK_SIZE,
        )
        s = _mma(q_lat, tl.trans(kv_c), UPCAST, IEEE)
        s += _mma(q_pe, tl.trans(k_pe), UPCAST, IEEE)
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, kv_c, m_i, l_i, acc, UPCAST, IEEE)

    # Tree rows: by the ancestor bits.
    mask_row_ptr = mask_ptr + req.to(tl.int64) * stride_mr + tree_row * stride_mi
    for j_start in range(0, tree_len, BLOCK_N):
        j = j_start + offs_n
        key_ok = j < tree_len
        kv_c, k_pe = _load_latent(
            cache_ptr,
            bt_row_ptr,
            stride_btb,
            prefix_len + j,
            key_ok,
            offs_l,
            offs_r,
            stride_cb,
            stride_cs,
            LORA,
            BLOCK_SIZE,
        )
        words = tl.load(
            mask_row_ptr[:, None] + (j[None, :] // 32) * stride_mw,
            mask=row_ok[:, None] & key_ok[None, :],
            other=0,
        )
        visible = ((words >> (j[None, :] % 32)) & 1) != 0
        s = _mma(q_lat, tl.trans(kv_c), UPCAST, IEEE)
        s += _mma(q_pe, tl.trans(k_pe), UPCAST, IEEE)
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, kv_c, m_i, l_i, acc, UPCAST, IEEE)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + token[:, None] * stride_ot
        + head[:, None] * stride_oh
        + offs_l[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def mla_tree_attention_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask_bits: torch.Tensor,
    scale: float,
    *,
    block_q: int | None = None,
    block_h: int | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """Latent-space tree attention, one Triton program per (request, row block,
    head block).

    Args:
        q_lat: [num_tokens, num_heads, L] absorbed queries (``q_nope @ W_UK``).
        q_pe: [num_tokens, num_heads, R] rotary query parts (RoPE applied).
        latent_cache: [num_blocks, block_size, L + R] vLLM's MLA cache.
        block_table, prefix_lens, tree_lens, query_start_loc, tree_mask_bits:
            as ``tree_attention_triton`` (``ops/tree_attention.py``).
        scale: softmax scale (vLLM's MLA ``scale``, for the q.k of the full
            ``qk_nope + qk_rope`` head).
        block_q, block_h: power-of-two tiles: tree rows and heads per program
            (default: 16 query rows in all, heads first).
        block_n: keys per tile, a power of two.

    Returns:
        [num_tokens, num_heads, L] latent outputs in q_lat's dtype (before
        ``W_UV``); rows of no request are zero.

    ``L`` and ``R`` must be powers of two (DeepSeek: 512 and 64); the
    ``[block_q * block_h, L]`` float32 accumulator lives in registers. The
    cache's last dimension must be contiguous.
    """
    _check_inputs(
        q_lat,
        q_pe,
        latent_cache,
        block_table,
        prefix_lens,
        tree_lens,
        query_start_loc,
        tree_mask_bits,
        scale,
    )
    num_tokens, num_heads, lora = q_lat.shape
    rope = q_pe.shape[2]
    min_tile = 1 if _interpreting() else 16
    _check_block("kv_lora_rank", lora, min_tile)
    _check_block("qk_rope_head_dim", rope, min_tile)
    if latent_cache.stride(2) != 1 or q_lat.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError("q_lat, q_pe and latent_cache need a contiguous last dim")
    num_reqs, max_rows = tree_mask_bits.shape[:2]
    if block_h is None:
        block_h = min(triton.next_power_of_2(num_heads), 16)
    if block_q is None:
        block_q = max(16 // block_h, 1)
    _check_block("block_h", block_h, 1)
    _check_block("block_q", block_q, 1)
    if block_q * block_h < min_tile:
        raise ValueError(f"block_q * block_h must be >= {min_tile}")
    _check_block("block_n", block_n, min_tile)
    out = torch.zeros_like(q_lat)
    if num_reqs == 0 or max_rows == 0 or num_tokens == 0:
        return out
    upcast = _interpreting() and q_lat.dtype == torch.bfloat16
    grid = (num_reqs, triton.cdiv(max_rows, block_q), triton.cdiv(num_heads, block_h))
    _mla_tree_attention_kernel[grid](
        out,
        q_lat,
        q_pe,
        latent_cache,
        block_table,
        prefix_lens.contiguous(),
        tree_lens.contiguous(),
        query_start_loc.contiguous(),
        tree_mask_bits,
        float(scale) * _LOG2E.value,
        num_heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        *block_table.stride(),
        *tree_mask_bits.stride(),
        LORA=lora,
        ROPE=rope,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_SIZE=latent_cache.shape[1],
        UPCAST=upcast,
        IEEE=q_lat.dtype == torch.float32 or upcast,
        num_warps=4,
    )
    return out
