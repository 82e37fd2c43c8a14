# SPDX-License-Identifier: Apache-2.0
"""Tree attention for the DDTree verify pass over vLLM's paged KV cache.

In the verify forward, request ``r`` has ``prefix_lens[r]`` committed tokens
(sequence positions ``0 .. p - 1``) followed by its draft tree's
``tree_lens[r]`` rows (positions ``p .. p + t - 1``). As everywhere in vLLM, the
forward writes the tree rows' K/V into the paged cache before attention runs,
so every key of the request is read through its block table. Tree row ``i``
attends to

* every prefix key (position ``< p``), and
* tree key ``j`` (position ``p + j``) iff bit ``j`` of row ``i`` of the
  request's ancestor mask is set: a node sees itself and its ancestors only,
  never its siblings' subtrees.

The layer's own attention features carry over, as vLLM's kernels apply them to
the rows of the accepted path:

* ``sliding_window = w > 0``: a node at depth ``d`` (``tree_depths``) has
  sequence position ``p + d``, and sees a key at position ``s`` (a committed
  key, or an ancestor at ``p + depth``) only while ``p + d - s < w``;
* ``sinks`` (gpt-oss): one logit per query head joins the softmax denominator,
  with no value;
* ``softcap > 0``: scores become ``softcap * tanh(scale * q.k / softcap)``
  before masking.

The mask is :attr:`vllm_ddtree.tree.DraftTree.visibility_packed` as is:
``[num_reqs, max_tree_rows, ceil(max_tree_rows / 32)]`` int32, bit ``j % 32``
(little-endian, bit 31 is the sign bit) of word ``j // 32`` of row ``i`` is
column ``j``. A request uses the top-left ``t x t`` corner of its slice.

:func:`tree_attention_triton` runs one Triton program per (request, block of
``BLOCK_Q`` tree rows, KV head). The ``G`` query heads that share the KV head
are folded with the tree rows into the program's ``BLOCK_Q * G`` query rows, so
each K/V tile read through the block table is reused by all of them in one
tensor-core ``tl.dot``, and the (long) prefix is read once per row block instead
of once per query row. Online softmax in float32 runs over the prefix in
``BLOCK_N``-key tiles (bounds mask only), then over the tree keys in
``BLOCK_T``-key tiles with the ancestor bits (all ``t`` of them: any mask works,
not only lower-triangular ones). The launch needs only the mask's static shape
(``max_tree_rows``); lengths are read on device, so the wrapper never
synchronizes. It is tested against a torch reference (K/V gathered in torch, the
boolean mask, float32 softmax, one request at a time).

Query rows that belong to no request (e.g. CUDA-graph padding past
``query_start_loc[-1]``) are returned as zeros, as are rows that see no key at
all (possible only with ``prefix_len == 0`` and a mask row without its own
diagonal bit).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from vllm_ddtree.ops.triton_verify import _interpreting

__all__ = ["tree_attention_launcher", "tree_attention_tiles", "tree_attention_triton"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
# log2(e): the kernel computes exp(x) as exp2(x * log2(e)).
_LOG2E = tl.constexpr(1.4426950408889634)


# --------------------------------------------------------------------------- #
# Input validation (shared by both implementations)
# --------------------------------------------------------------------------- #


def _check_tensor(
    name: str,
    x: object,
    dim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None,
) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        allowed = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {allowed}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on {device} (query's device), got {x.device}")
    return x


def _check_tree_layout(
    device: torch.device,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask_bits: torch.Tensor,
) -> tuple[int, int]:
    """The per-request tensors every tree-attention kernel takes (lengths,
    offsets, block table, packed masks); returns ``(num_reqs, max_tree_rows)``.
    Reads no tensor values."""
    _check_tensor("prefix_lens", prefix_lens, 1, _INDEX_DTYPES, device)
    num_reqs = prefix_lens.shape[0]
    for name, x, shape in (
        ("tree_lens", tree_lens, (num_reqs,)),
        ("query_start_loc", query_start_loc, (num_reqs + 1,)),
    ):
        _check_tensor(name, x, 1, _INDEX_DTYPES, device)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    _check_tensor("block_table", block_table, 2, _INDEX_DTYPES, device)
    if block_table.shape[0] != num_reqs:
        raise ValueError(
            f"block_table must have num_reqs={num_reqs} rows, got "
            f"{tuple(block_table.shape)}"
        )
    _check_tensor("tree_mask_bits", tree_mask_bits, 3, (torch.int32,), device)
    max_rows = tree_mask_bits.shape[1]
    if tree_mask_bits.shape[0] != num_reqs or tree_mask_bits.shape[2] != (
        (max_rows + 31) // 32
    ):
        raise ValueError(
            "tree_mask_bits must be [num_reqs, max_tree_rows, "
            f"ceil(max_tree_rows / 32)] with num_reqs={num_reqs}, got "
            f"{tuple(tree_mask_bits.shape)}"
        )
    return num_reqs, max_rows


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask_bits: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    tree_depths: torch.Tensor | None = None,
) -> None:
    """Shapes, dtypes and devices; reads no tensor values (no host sync)."""
    _check_tensor("query", query, 3, _FLOAT_DTYPES, None)
    device = query.device
    _, num_q_heads, head_dim = query.shape
    _check_tensor("key_cache", key_cache, 4, (query.dtype,), device)
    _check_tensor("value_cache", value_cache, 4, (query.dtype,), device)
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if block_size < 1 or num_kv_heads < 1:
        raise ValueError(
            "key_cache must be [num_blocks, block_size >= 1, num_kv_heads >= 1, "
            f"head_dim], got {tuple(key_cache.shape)}"
        )
    if cache_head_dim != head_dim:
        raise ValueError(
            f"key_cache head_dim ({cache_head_dim}) must equal query's ({head_dim})"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query's num_heads ({num_q_heads}) must be a multiple of key_cache's "
            f"num_kv_heads ({num_kv_heads})"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache must have key_cache's shape {tuple(key_cache.shape)}, got "
            f"{tuple(value_cache.shape)}"
        )
    num_reqs, max_rows = _check_tree_layout(
        device, block_table, prefix_lens, tree_lens, query_start_loc, tree_mask_bits
    )
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(f"sliding_window must be an int, got {sliding_window!r}")
    if sliding_window > 0:
        if tree_depths is None:
            raise ValueError(
                "sliding_window needs tree_depths (each tree row's depth gives its "
                "sequence position)"
            )
        _check_tensor("tree_depths", tree_depths, 2, _INDEX_DTYPES, device)
        if tuple(tree_depths.shape) != (num_reqs, max_rows):
            raise ValueError(
                f"tree_depths must be [num_reqs, max_tree_rows] = "
                f"{(num_reqs, max_rows)}, got {tuple(tree_depths.shape)}"
            )
    if sinks is not None:
        _check_tensor("sinks", sinks, 1, _FLOAT_DTYPES, device)
        if sinks.shape[0] != num_q_heads:
            raise ValueError(
                f"sinks must have one logit per query head ({num_q_heads}), got "
                f"{tuple(sinks.shape)}"
            )
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise ValueError(f"softcap must be a finite float >= 0, got {softcap!r}")


def _check_values(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask_bits: torch.Tensor,
) -> None:
    """Lengths, offsets and used block ids. Synchronizes with the device."""
    num_blocks, block_size = key_cache.shape[:2]
    max_rows = tree_mask_bits.shape[1]
    prefix = prefix_lens.long()
    tree = tree_lens.long()
    qsl = query_start_loc.long()
    if bool((prefix < 0).any()):
        raise ValueError("prefix_lens must be >= 0")
    if bool(((tree < 0) | (tree > max_rows)).any()):
        raise ValueError(
            f"tree_lens must be in [0, max_tree_rows={max_rows}] (tree_mask_bits)"
        )
    if bool((qsl[1:] - qsl[:-1] != tree).any()) or not (
        int(qsl[0]) >= 0 and int(qsl[-1]) <= query.shape[0]
    ):
        raise ValueError(
            "query_start_loc must give each request tree_lens[r] rows within "
            f"query's {query.shape[0]} tokens"
        )
    needed = (prefix + tree + block_size - 1) // block_size  # [num_reqs]
    if bool((needed > block_table.shape[1]).any()):
        raise ValueError(
            "block_table has too few columns for prefix_lens + tree_lens with "
            f"block_size={block_size}"
        )
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols.unsqueeze(0) < needed.unsqueeze(1)
    ids = block_table.long()[used]
    if bool(((ids < 0) | (ids >= num_blocks)).any()):
        raise ValueError(f"block_table's used entries must be in [0, {num_blocks})")


# --------------------------------------------------------------------------- #
# Triton kernel
# --------------------------------------------------------------------------- #


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """[M, K] @ [K, N] with float32 accumulation."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        # float32 inputs: the default would round them to TF32 on NVIDIA.
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_kv(
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,
    stride_bt,
    pos,
    key_ok,
    kv_head,
    offs_d,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V tiles, [BLOCK_N, HEAD_DIM] each, of sequence positions ``pos``."""
    # BLOCK_SIZE is constexpr: // and % compile to shifts (or a multiply).
    blk = tl.load(bt_row_ptr + (pos // BLOCK_SIZE) * stride_bt, mask=key_ok, other=0)
    blk = blk.to(tl.int64)  # num_blocks * block stride can exceed int32
    slot = pos % BLOCK_SIZE
    k_off = (
        blk[:, None] * stride_kb
        + slot[:, None] * stride_ks
        + kv_head * stride_kh
        + offs_d[None, :] * stride_kd
    )
    v_off = (
        blk[:, None] * stride_vb
        + slot[:, None] * stride_vs
        + kv_head * stride_vh
        + offs_d[None, :] * stride_vd
    )
    k = tl.load(k_cache_ptr + k_off, mask=key_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + v_off, mask=key_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, UPCAST, IEEE):
    """log2-scaled scores of a tile: ``scale * q.k``, softcapped, times log2(e)
    (exp2 replaces exp)."""
    s = _mma(q, tl.trans(k), UPCAST, IEEE) * scale
    if USE_SOFTCAP:
        # softcap * tanh(s / softcap), with tanh(y) = 1 - 2 / (exp(2y) + 1): it
        # saturates at +-1 instead of overflowing to inf / inf.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s * _LOG2E


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Folds one tile of log2-scaled scores ``s`` (-inf = hidden) into the state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids
    # -inf - -inf = NaN and still gives p = 0, alpha = 0 for it.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P is rounded to V's dtype for the tensor-core dot, as in FlashAttention.
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, UPCAST, IEEE)
    return m_new, l_i, acc


# The mask and depth strides follow the step's largest tree: not specialised on
# (Triton compiles a variant for a value of 1 and for multiples of 16), so every
# step runs the engine's one compiled variant; nor the block table's width (a
# start-up warm-up need not know it).
@triton.jit(do_not_specialize=["stride_btr", "stride_mr", "stride_mi", "stride_dr"])
def _tree_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_blocks_per_req]
    prefix_lens_ptr,  # [num_reqs]
    tree_lens_ptr,  # [num_reqs]
    query_start_loc_ptr,  # [num_reqs + 1]
    mask_ptr,  # [num_reqs, max_tree_rows, num_words] int32
    depths_ptr,  # [num_reqs, max_tree_rows] (read with a sliding window only)
    sinks_ptr,  # [num_heads] (read with USE_SINKS only)
    scale,  # softmax scale
    softcap,  # logit softcap (read with USE_SOFTCAP only)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_btr,
    stride_btb,
    stride_mr,
    stride_mi,
    stride_mw,
    stride_dr,
    SLIDING_WINDOW: tl.constexpr,  # the layer's window (0: none)
    USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two of GROUP
    BLOCK_Q: tl.constexpr,  # tree rows per program
    BLOCK_N: tl.constexpr,  # prefix keys per tile
    BLOCK_T: tl.constexpr,  # tree keys per tile
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    UPCAST: tl.constexpr,  # dot in float32 (interpreter with bfloat16)
    IEEE: tl.constexpr,  # float32 dot without TF32 rounding
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    req = tl.program_id(0)
    row_start = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)

    tree_len = tl.load(tree_lens_ptr + req).to(tl.int32)
    # The grid covers max_tree_rows; shorter trees leave trailing programs idle.
    if row_start >= tree_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + req).to(tl.int32)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)

    # Program row m is tree row row_start + m // GROUP_PAD, query head
    # kv_head * GROUP + m % GROUP_PAD: rows of one KV group share every K/V tile.
    offs_m = tl.arange(0, BLOCK_M)
    tree_row = row_start + offs_m // GROUP_PAD  # [BLOCK_M]
    head_in_group = offs_m % GROUP_PAD
    row_ok = (tree_row < tree_len) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    token = q_start + tree_row  # int64
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr
        + token[:, None] * stride_qt
        + q_head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    if USE_SINKS:
        # The sink is a key of logit sinks[h] and no value: the softmax starts
        # with it (m = its log2-scaled logit, l = 1).
        m_i = tl.load(sinks_ptr + q_head, mask=row_ok, other=float("-inf"))
        m_i = m_i.to(tl.float32) * _LOG2E
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_btr
    depth_row_ptr = depths_ptr + req.to(tl.int64) * stride_dr
    if SLIDING_WINDOW > 0:
        # Row m sits at position prefix_len + its depth.
        q_pos = prefix_len + tl.load(depth_row_ptr + tree_row, mask=row_ok, other=0)
        # The shallowest row (the root, depth 0) sees the oldest keys.
        first = tl.maximum(prefix_len - SLIDING_WINDOW + 1, 0)
    else:
        first = 0

    # Prefix: every tree row sees every committed key (inside its window).
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(first, prefix_len, BLOCK_N):
        pos = start + offs_n
        key_ok = pos < prefix_len
        k, v = _load_kv(
            k_cache_ptr,
            v_cache_ptr,
            bt_row_ptr,
            stride_btb,
            pos,
            key_ok,
            kv_head,
            offs_d,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            BLOCK_SIZE,
        )
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, UPCAST, IEEE)
        visible = key_ok[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (q_pos[:, None] - pos[None, :] < SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, UPCAST, IEEE)

    # Tree keys p + j: visible iff bit j of the row's packed ancestor mask is set.
    offs_t = tl.arange(0, BLOCK_T)
    mask_row_ptr = mask_ptr + req.to(tl.int64) * stride_mr + tree_row * stride_mi
    for j_start in range(0, tree_len, BLOCK_T):
        j = j_start + offs_t
        key_ok = j < tree_len
        k, v = _load_kv(
            k_cache_ptr,
            v_cache_ptr,
            bt_row_ptr,
            stride_btb,
            prefix_len + j,
            key_ok,
            kv_head,
            offs_d,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            BLOCK_SIZE,
        )
        words = tl.load(
            mask_row_ptr[:, None] + (j[None, :] // 32) * stride_mw,
            mask=row_ok[:, None] & key_ok[None, :],
            other=0,
        )  # [BLOCK_M, BLOCK_T] int32
        visible = ((words >> (j[None, :] % 32)) & 1) != 0
        if SLIDING_WINDOW > 0:
            k_pos = prefix_len + tl.load(depth_row_ptr + j, mask=key_ok, other=0)
            visible = visible & (q_pos[:, None] - k_pos[None, :] < SLIDING_WINDOW)
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, UPCAST, IEEE)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, UPCAST, IEEE)

    # l == 0 only for a row that saw no key (or a padding row): output 0.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + token[:, None] * stride_ot
        + q_head[:, None] * stride_oh
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def _check_block(name: str, value: int, minimum: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or value & (value - 1)
    ):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")
    return value


def _next_power_of_2(n: int) -> int:
    # triton.next_power_of_2 is a jit callable: ~7 us a call on the host path.
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=64)
def tree_attention_tiles(
    max_tree_rows: int, num_heads: int, num_kv_heads: int
) -> tuple[int, int]:
    """``(block_q, block_t)`` for trees of up to ``max_tree_rows`` rows.

    ``block_q``: about 64 query rows per program (``block_q`` tree rows times the
    padded GQA group), at least 16 (the smallest tensor-core tile), at most the
    padded tree; ``block_t``: the padded tree clamped to [16, 64]. An engine
    takes them from its largest tree (B + 1 rows) once, so every step runs one
    compiled variant (the defaults of :func:`tree_attention_triton` follow each
    call's own largest tree).
    """
    group_pad = _next_power_of_2(num_heads // num_kv_heads)
    rows = _next_power_of_2(max(max_tree_rows, 1))
    block_q = max(min(max(64 // group_pad, 1), rows), max(16 // group_pad, 1))
    block_t = min(max(rows, 16), 64)
    return block_q, block_t


def tree_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask_bits: torch.Tensor,
    scale: float,
    *,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    tree_depths: torch.Tensor | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    block_t: int | None = None,
    validate: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention with one Triton program per (request, row block, KV head).

    Args:
        query: [num_tokens, num_heads, head_dim] float16/bfloat16/float32 query
            rows of the tree tokens (RoPE already applied).
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim] paged keys
            (vLLM's FlashAttention layout, any strides), query's dtype;
            ``num_heads`` is a multiple of ``num_kv_heads`` (GQA: query head
            ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
        value_cache: like ``key_cache``.
        block_table: [num_reqs, max_blocks_per_req] int32/int64. Position ``s``
            of request ``r`` lives at block ``block_table[r, s // block_size]``,
            offset ``s % block_size``.
        prefix_lens: [num_reqs] int32/int64 committed tokens per request.
        tree_lens: [num_reqs] int32/int64 tree rows per request (root included),
            at most ``max_tree_rows``; their K/V are already in the cache at
            positions ``prefix_lens[r] ..``.
        query_start_loc: [num_reqs + 1] int32/int64; request ``r``'s query rows
            are ``query[query_start_loc[r]:query_start_loc[r + 1]]``.
        tree_mask_bits: [num_reqs, max_tree_rows, ceil(max_tree_rows / 32)] int32
            ancestor-or-self mask packed like
            :func:`vllm_ddtree.tree.pack_visibility`.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: the layer's window ``w`` (``<= 0``: none).
        sinks: [num_heads] float, the layer's attention sinks, or None.
        softcap: the layer's logit softcap (0: none).
        tree_depths: [num_reqs, max_tree_rows] int32/int64, each tree row's
            depth (root 0); needed with a sliding window.
        block_q: tree rows per program, a power of two; the program's query tile
            is ``block_q * next_power_of_2(G)`` rows (G = num_heads //
            num_kv_heads). Default: about 64 query rows, at least 16 (the
            smallest tensor-core tile), at most the (padded) tree.
        block_n: prefix keys per tile, a power of two (default 64).
        block_t: tree keys per tile, a power of two (default
            ``next_power_of_2(max_tree_rows)`` clamped to [16, 64]).
        validate: also check lengths, offsets and block ids against the tensors
            (synchronizes with the device; off on the hot path).
        out: [num_tokens, num_heads, head_dim], unit stride in head_dim: written
            in place, the tree rows only (every other row untouched). With the
            whole batch's ``query`` and ``query_start_loc`` pointing at each tree
            block's first batch row, a layer reads and writes its own rows: no
            gather, scatter or new tensor.

    Returns:
        ``out``, or a new [num_tokens, num_heads, head_dim] tensor in query's
        dtype whose rows of no request are zero, as are rows that see no key.

    ``head_dim`` must be a power of two (``tl.arange``). Tiles and head_dim below
    16 are accepted only under ``TRITON_INTERPRET=1``: ``tl.dot`` needs 16 on
    GPUs. float32 inputs use IEEE dots (no TF32 rounding); float16/bfloat16 use
    tensor cores with float32 accumulation, P rounded to V's dtype.
    """
    _check_inputs(
        query,
        key_cache,
        value_cache,
        block_table,
        prefix_lens,
        tree_lens,
        query_start_loc,
        tree_mask_bits,
        scale,
        sliding_window,
        sinks,
        softcap,
        tree_depths,
    )
    if validate:
        _check_values(
            query,
            key_cache,
            block_table,
            prefix_lens,
            tree_lens,
            query_start_loc,
            tree_mask_bits,
        )
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    num_reqs, max_rows = tree_mask_bits.shape[:2]
    interpreting = _interpreting()
    group = num_heads // num_kv_heads
    group_pad = _next_power_of_2(group)
    if block_q is None or block_t is None:
        default_q, default_t = tree_attention_tiles(max_rows, num_heads, num_kv_heads)
        block_q = default_q if block_q is None else block_q
        block_t = default_t if block_t is None else block_t
    block_n = 64 if block_n is None else block_n
    min_tile = 1 if interpreting else 16
    _check_block("query's head_dim", head_dim, min_tile)
    _check_block("block_q", block_q, 1)
    if block_q * group_pad < min_tile:
        raise ValueError(
            f"block_q * next_power_of_2(G) must be >= {min_tile}, got {block_q} * "
            f"{group_pad}"
        )
    _check_block("block_n", block_n, min_tile)
    _check_block("block_t", block_t, min_tile)

    if out is None:
        # Zero-filled: rows of no request (CUDA-graph padding) stay defined.
        out = torch.zeros(
            (num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device
        )
    elif (
        out.shape != query.shape or out.stride(-1) != 1 or out.device != query.device
    ):
        raise ValueError(
            f"out must be {list(query.shape)} with unit stride in head_dim on "
            f"{query.device}, got {list(out.shape)}, strides {out.stride()} on "
            f"{out.device}"
        )
    if num_reqs == 0 or max_rows == 0 or num_tokens == 0:
        return out
    launch = _launcher(
        query, key_cache, value_cache, out, block_table, prefix_lens, tree_lens,
        query_start_loc, tree_mask_bits, scale, sliding_window, sinks is not None,
        softcap, tree_depths, (block_q, block_n, block_t), interpreting,
    )
    launch(query, key_cache, value_cache, out, sinks)
    return out


def tree_attention_launcher(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask_bits: torch.Tensor,
    scale: float,
    *,
    sliding_window: int = 0,
    use_sinks: bool = False,
    softcap: float = 0.0,
    tree_depths: torch.Tensor | None = None,
    block_q: int,
    block_t: int,
    block_n: int = 64,
):
    """:func:`tree_attention_triton` for every layer of one kind in one step:
    the tree layout, tiles and argument list are built once, and each layer
    then launches with its own ``(query, key_cache, value_cache, out, sinks)``
    of the shapes, strides and dtypes given here (unchecked: the caller checked
    them, e.g. with one :func:`tree_attention_triton` call). ``out`` is written
    in place, the tree rows only."""
    return _launcher(
        query, key_cache, value_cache, out, block_table, prefix_lens, tree_lens,
        query_start_loc, tree_mask_bits, scale, sliding_window, use_sinks, softcap,
        tree_depths, (block_q, block_n, block_t), _interpreting(),
    )


def _launcher(
    query, key_cache, value_cache, out, block_table, prefix_lens, tree_lens,
    query_start_loc, tree_mask_bits, scale, sliding_window, use_sinks, softcap,
    tree_depths, tiles, interpreting,
):
    block_q, block_n, block_t = tiles
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    num_reqs, max_rows = tree_mask_bits.shape[:2]
    group = num_heads // num_kv_heads
    window = max(int(sliding_window), 0)
    is_fp32 = query.dtype == torch.float32
    # Triton 3.9's interpreter multiplies bfloat16 dot operands as their raw
    # uint16 bits; upcast them there (the rounding of P to bfloat16 is kept).
    upcast = interpreting and query.dtype == torch.bfloat16
    grid = (num_reqs, -(-max_rows // block_q), num_kv_heads)
    layout = (
        block_table,
        # [num_reqs], [num_reqs], [num_reqs + 1]: read with unit stride.
        prefix_lens.contiguous(),
        tree_lens.contiguous(),
        query_start_loc.contiguous(),
        tree_mask_bits,
        # Unused pointers get any tensor of the device (never read).
        tree_depths if window > 0 else tree_lens,
    )
    numbers = (
        float(scale),
        float(softcap),
        *query.stride(),
        out.stride(0),
        out.stride(1),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_table.stride(),
        *tree_mask_bits.stride(),
        tree_depths.stride(0) if window > 0 else 0,
    )
    # The numbers, then the constexprs in the kernel's order (positional: a
    # layer's launch builds no keyword dict).
    tail = (
        *numbers,
        window,  # SLIDING_WINDOW
        use_sinks,  # USE_SINKS
        softcap > 0,  # USE_SOFTCAP
        group,  # GROUP
        _next_power_of_2(group),  # GROUP_PAD
        block_q,  # BLOCK_Q
        block_n,  # BLOCK_N
        block_t,  # BLOCK_T
        head_dim,  # HEAD_DIM
        block_size,  # BLOCK_SIZE
        upcast,  # UPCAST
        is_fp32 or upcast,  # IEEE
    )

    def launch(query, key_cache, value_cache, out, sinks=None) -> None:
        _tree_attention_kernel[grid](
            out,
            query,
            key_cache,
            value_cache,
            *layout,
            query if sinks is None else sinks,
            *tail,
            num_warps=4,
        )

    return launch

