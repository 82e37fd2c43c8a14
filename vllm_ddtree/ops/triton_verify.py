# SPDX-License-Identifier: Apache-2.0
"""Triton kernel for DDTree tree verification (https://arxiv.org/abs/2604.12989).

After the target model scores every row of a batch of draft trees, each request
walks its tree from the root and decides which draft path to accept plus one
bonus/correction token. This kernel runs one program per request and touches
only the logits rows its walk visits (at most ``L + 1`` of the ``N + 1``), read in
place through a row index (tree row -> row of the target's logits), so neither an
``[R, N + 1, V]`` gather nor a probability buffer is ever materialized.

It reproduces :func:`vllm_ddtree.verify.verify_tree_torch` exactly
(integer outputs), with the canonical arithmetic of
:mod:`vllm_ddtree.verify`:

* ``z = logits.float() / T`` (IEEE division; greedy rows are not divided and take
  the first index of the maximum), ``e = exp(z - max z)`` in float32;
* totals and prefix sums in float64; the inverse CDF picks the first token whose
  inclusive prefix sum is ``> u * total`` and falls back to the last token with
  ``e > 0`` when rounding leaves none;
* ``method`` 0 (sample-then-walk): one draw per visited node with that node's
  coin; descend into the child carrying it, else it is the bonus token;
* ``method`` 1 (target-only rejection): children are scanned in draft-rank (LCRS)
  order accumulating their mass; the first child with ``e > 0`` and
  ``coin * total * threshold_acc < acc`` or ``e >= threshold_single * total`` is
  accepted. At the stop node the bonus is drawn with the request's final coin
  from ``e`` with every child token removed (from ``e`` itself if rounding left
  no residual mass).

Float64 sums are accumulated block by block here and sequentially in torch, so a
pick can differ from the reference only when a coin lands within rounding of a
prefix-sum boundary; likewise ``exp`` may differ from torch's by an ulp.

Runs under ``TRITON_INTERPRET=1`` (CPU) as well: there ``tl.exp`` replaces the
libdevice ``exp`` that the compiled kernel uses to match torch's ``expf``.
"""

from __future__ import annotations

import functools
import os
import struct

import torch
import triton
import triton.language as tl

from vllm_ddtree.sampling import SAMPLING_EPS

__all__ = ["tree_verify_triton", "warm_up_tree_verify"]
_MAX_BLOCK_V = 1024


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        try:
            return bool(knobs.runtime.interpret)
        except AttributeError:
            pass
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


if _interpreting():

    @triton.jit
    def _exp(x):
        # numpy's exp: the interpreter cannot call libdevice.
        return tl.exp(x)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(x):
        # Full-precision expf (tl.exp lowers to the approximate ex2 on NVIDIA).
        return libdevice.exp(x)


@triton.jit
def _block_weights(row_ptr, offs, vocab, t, m):
    """[BLOCK_V] float32 e = exp(x / t - m) of one vocab block, 0 outside the row."""
    mask = offs < vocab
    x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    e = _exp(tl.math.div_rn(x, t) - m)
    return tl.where(mask, e, 0.0)


@triton.jit
def _child_token_mask(offs, child, tok_ptr, sib_ptr):
    """[BLOCK_V] bool: offs equals the token of ``child`` or of a later sibling."""
    hit = offs < 0
    while child >= 0:
        hit = hit | (offs == tl.load(tok_ptr + child))
        child = tl.load(sib_ptr + child)
    return hit


@triton.jit
def _row_max(row_ptr, vocab, t, BLOCK_V: tl.constexpr):
    """(max z float32, first index of the max int32) over the row; z = x / t."""
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        z = tl.math.div_rn(x, t)
        block_max = tl.max(z, axis=0)
        block_idx = tl.min(tl.where(mask & (z == block_max), offs, vocab), axis=0)
        better = block_max > best  # strict: earlier blocks win ties
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_max, best)
    return best, best_idx


@triton.jit
def _row_total(row_ptr, vocab, t, m, excluded, tok_ptr, sib_ptr, BLOCK_V: tl.constexpr):
    """float64 sum of e over the row, without the tokens of the ``excluded``
    sibling list."""
    total = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        e = _block_weights(row_ptr, offs, vocab, t, m)
        e = tl.where(_child_token_mask(offs, excluded, tok_ptr, sib_ptr), 0.0, e)
        total += tl.sum(e.to(tl.float64), axis=0)
    return total


@triton.jit
def _inverse_cdf(
    row_ptr, vocab, t, m, u, total, excluded, tok_ptr, sib_ptr, BLOCK_V: tl.constexpr
):
    """int64 first index whose prefix sum of e (excluded tokens 0) is > u * total.

    Falls back to the last index with e > 0 (vocab - 1 if none). Stops scanning at
    the first block that contains the pick.
    """
    target = u.to(tl.float64) * total
    carry = tl.full([], 0.0, tl.float64)
    pick = vocab + tl.full([], 0, tl.int32)
    last = tl.full([], -1, tl.int32)
    start = tl.full([], 0, tl.int32)
    while (start < vocab) & (pick >= vocab):
        offs = start + tl.arange(0, BLOCK_V)
        e = _block_weights(row_ptr, offs, vocab, t, m)
        e = tl.where(_child_token_mask(offs, excluded, tok_ptr, sib_ptr), 0.0, e)
        e64 = e.to(tl.float64)
        cdf = carry + tl.cumsum(e64, axis=0)
        hit = (cdf > target) & (offs < vocab)
        pick = tl.minimum(pick, tl.min(tl.where(hit, offs, vocab), axis=0))
        last = tl.maximum(last, tl.max(tl.where(e > 0.0, offs, -1), axis=0))
        carry += tl.sum(e64, axis=0)
        start += BLOCK_V
    last = tl.where(last >= 0, last, vocab - 1)
    return tl.where(pick < vocab, pick, last).to(tl.int64)


@triton.jit
def _child_with_token(child, token, tok_ptr, sib_ptr):
    """int64 first child (LCRS order from ``child``) whose token is ``token``,
    else -1."""
    found = tl.full([], -1, tl.int64)
    while (child >= 0) & (found < 0):
        found = tl.where(tl.load(tok_ptr + child) == token, child, found)
        child = tl.load(sib_ptr + child)
    return found


@triton.jit
def _rejection_child(
    child, row_ptr, vocab, t, m, coin, total, ts, ta, tok_ptr, sib_ptr
):
    """int64 first child accepted by target-only rejection, else -1."""
    bound = coin.to(tl.float64) * total * ta
    single = ts * total
    acc = tl.full([], 0.0, tl.float64)
    found = tl.full([], -1, tl.int64)
    while (child >= 0) & (found < 0):
        tok = tl.load(tok_ptr + child)
        ok = (tok >= 0) & (tok < vocab)
        x = tl.load(row_ptr + tok, mask=ok, other=float("-inf")).to(tl.float32)
        e = _exp(tl.math.div_rn(x, t) - m).to(tl.float64)
        acc += e
        take = (e > 0.0) & ((bound < acc) | (e >= single))
        found = tl.where(take, child, found)
        child = tl.load(sib_ptr + child)
    return found


# Integer arguments that change from step to step are not specialised on (Triton
# compiles a variant for a value of 1 and for multiples of 16): a compile stall
# mid-serving would be timed as a verify step. Nor is the coins' alignment: they
# are columns of one [R, N + 2] draw (draw_coins), 16-byte aligned or not by N.
@triton.jit(
    do_not_specialize=["num_rows", "max_depth"],
    do_not_specialize_on_alignment=["node_coins_ptr", "final_coins_ptr"],
)
def _tree_verify_kernel(
    logits_ptr,  # [M, V] float32/float16/bfloat16, vocab contiguous
    row_index_ptr,  # [R, N + 1] int64: tree row -> row of logits
    tokens_ptr,  # [R, N + 1] int64
    first_child_ptr,  # [R, N + 1] int64, -1 = none
    next_sibling_ptr,  # [R, N + 1] int64, -1 = none
    temperature_ptr,  # [R] float32
    node_coins_ptr,  # [R, N + 1] float32
    final_coins_ptr,  # [R] float32
    accepted_ptr,  # [R, L + 1] int64 out
    committed_ptr,  # [R, L + 1] int64 out
    num_accepted_ptr,  # [R] int64 out
    num_rows,  # N + 1
    logits_row_stride,  # elements between rows of logits
    vocab,  # V
    max_depth,  # L
    ts_bits,  # threshold_single, float64 bits as int64
    ta_bits,  # threshold_acc, float64 bits as int64
    GREEDY_EPS: tl.constexpr,  # temperature < eps (compared in float32) => greedy
    METHOD: tl.constexpr,  # 0 = sample_walk, 1 = rejection
    BLOCK_V: tl.constexpr,  # vocab block
    BLOCK_W: tl.constexpr,  # >= L + 1, power of two
):
    b = tl.program_id(0).to(tl.int64)
    req_row = b * num_rows  # int64: first row of this request
    tok_ptr = tokens_ptr + req_row
    first_ptr = first_child_ptr + req_row
    sib_ptr = next_sibling_ptr + req_row
    coin_ptr = node_coins_ptr + req_row
    row_idx_ptr = row_index_ptr + req_row
    ts = ts_bits.to(tl.int64).to(tl.float64, bitcast=True)
    ta = ta_bits.to(tl.int64).to(tl.float64, bitcast=True)

    temp = tl.load(temperature_ptr + b)
    greedy = temp < tl.full([], GREEDY_EPS, tl.float32)
    t = tl.where(greedy, 1.0, temp)

    cols = tl.arange(0, BLOCK_W)
    accepted = tl.where(cols == 0, 0, -1).to(tl.int64)  # [BLOCK_W]
    committed = tl.full([BLOCK_W], -1, tl.int64)
    none = tl.full([], -1, tl.int64)
    cur = tl.full([], 0, tl.int64)
    depth = tl.full([], 0, tl.int64)
    walking = depth == 0
    while walking:  # at most L + 1 iterations: depth grows each time we descend
        # int64 offset: the visited row is read in place, never gathered.
        row_ptr = logits_ptr + tl.load(row_idx_ptr + cur) * logits_row_stride
        m, argmax = _row_max(row_ptr, vocab, t, BLOCK_V)
        children = tl.load(first_ptr + cur)
        first = tl.where(depth < max_depth, children, none)
        token = argmax.to(tl.int64)  # the next token for greedy requests
        nxt = none
        if greedy:
            nxt = _child_with_token(first, token, tok_ptr, sib_ptr)
        else:
            total = _row_total(row_ptr, vocab, t, m, none, tok_ptr, sib_ptr, BLOCK_V)
            coin = tl.load(coin_ptr + cur)
            if METHOD == 0:
                token = _inverse_cdf(
                    row_ptr, vocab, t, m, coin, total, none, tok_ptr, sib_ptr, BLOCK_V
                )
                nxt = _child_with_token(first, token, tok_ptr, sib_ptr)
            else:
                nxt = _rejection_child(
                    first, row_ptr, vocab, t, m, coin, total, ts, ta, tok_ptr, sib_ptr
                )
                if nxt < 0:
                    # Residual draw: the target without the (rejected) children.
                    final_coin = tl.load(final_coins_ptr + b)
                    residual = _row_total(
                        row_ptr, vocab, t, m, children, tok_ptr, sib_ptr, BLOCK_V
                    )
                    if residual > 0.0:
                        token = _inverse_cdf(
                            row_ptr,
                            vocab,
                            t,
                            m,
                            final_coin,
                            residual,
                            children,
                            tok_ptr,
                            sib_ptr,
                            BLOCK_V,
                        )
                    else:  # all mass on rejected children: float rounding only
                        token = _inverse_cdf(
                            row_ptr,
                            vocab,
                            t,
                            m,
                            final_coin,
                            total,
                            none,
                            tok_ptr,
                            sib_ptr,
                            BLOCK_V,
                        )
        walking = nxt >= 0
        if walking:
            committed = tl.where(cols == depth, tl.load(tok_ptr + nxt), committed)
            depth += 1
            accepted = tl.where(cols == depth, nxt, accepted)
            cur = nxt
        else:
            committed = tl.where(cols == depth, token, committed)

    out = b * (max_depth + 1) + cols
    keep = cols <= max_depth
    tl.store(accepted_ptr + out, accepted, mask=keep)
    tl.store(committed_ptr + out, committed, mask=keep)
    tl.store(num_accepted_ptr + b, depth)


def _f64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


@functools.cache
def _launch_options(device_type: str) -> tuple[tuple[str, bool], ...]:
    """Compiler options that keep the arithmetic identical to torch's on CUDA."""
    if device_type != "cuda" or _interpreting() or torch.version.hip is not None:
        return ()
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return ()
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    # No FMA contraction; libdevice expf keeps denormal results like torch's.
    wanted = (("enable_fp_fusion", False), ("enable_reflect_ftz", False))
    return tuple((k, v) for k, v in wanted if k in fields)


def tree_verify_triton(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    temperature: torch.Tensor,
    node_coins: torch.Tensor,
    final_coins: torch.Tensor,
    max_depth: int,
    method: int,
    threshold_single: float,
    threshold_acc: float,
    *,
    row_index: torch.Tensor | None = None,
    block_v: int | None = None,
    block_w: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verifies R draft trees with one Triton program per request.

    Args:
        logits: [R, N + 1, V] float32/float16/bfloat16 target logits (rows already
            min-p/top-k/top-p processed when the batch uses them); with
            ``row_index``: [M, V], any rows with a contiguous vocab dimension (e.g.
            the target's logits of the whole batch), read in place.
        tokens, next_token, next_sibling: [R, N + 1] int64 tree tokens and LCRS links.
        temperature: [R] float32; < 1e-5 means greedy.
        node_coins: [R, N + 1] float32; final_coins: [R] float32, uniforms in [0, 1).
        max_depth: L, the deepest possible node.
        method: 0 = sample_walk, 1 = rejection.
        threshold_single, threshold_acc: rejection relaxations (1.0 = exact).
        row_index: [R, N + 1] int64: tree row i of request b is
            ``logits[row_index[b, i]]`` (entries are not range-checked here).
        block_v: vocab block per loop step, a power of two (default
            ``min(1024, next_power_of_2(V))``); tests use small ones.
        block_w: the path tile, a power of two > ``max_depth`` (default: the
            smallest). An engine passes one for its deepest possible tree, so
            every step runs one compiled variant.

    Returns:
        (accepted_indices [R, L + 1], committed_tokens [R, L + 1], num_accepted [R]),
        all int64, as :func:`vllm_ddtree.verify.verify_tree_torch`.
    """
    want_dims = 3 if row_index is None else 2
    if logits.dim() != want_dims or logits.dtype not in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ):
        want = "[R, N + 1, V]" if row_index is None else "[M, V]"
        raise ValueError(
            f"logits must be {want} float32/float16/bfloat16, got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    device = logits.device
    if row_index is None:
        num_reqs, num_rows, vocab = logits.shape
        logits = logits.reshape(num_reqs * num_rows, vocab)  # a view when contiguous
        row_index = torch.arange(
            num_reqs * num_rows, dtype=torch.int64, device=device
        ).view(num_reqs, num_rows)
    else:
        if row_index.dim() != 2:
            raise ValueError(
                f"row_index must be [R, N + 1], got {tuple(row_index.shape)}"
            )
        num_reqs, num_rows = row_index.shape
        vocab = logits.shape[1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if vocab < 1:
        raise ValueError("logits needs vocab_size >= 1")
    for name, x, shape, dtype in (
        ("row_index", row_index, (num_reqs, num_rows), torch.int64),
        ("tokens", tokens, (num_reqs, num_rows), torch.int64),
        ("next_token", next_token, (num_reqs, num_rows), torch.int64),
        ("next_sibling", next_sibling, (num_reqs, num_rows), torch.int64),
        ("temperature", temperature, (num_reqs,), torch.float32),
        ("node_coins", node_coins, (num_reqs, num_rows), torch.float32),
        ("final_coins", final_coins, (num_reqs,), torch.float32),
    ):
        if tuple(x.shape) != shape or x.dtype != dtype or x.device != device:
            raise ValueError(
                f"{name} must be {list(shape)} {dtype} on {device}, got "
                f"{list(x.shape)} {x.dtype} on {x.device}"
            )
    max_depth = int(max_depth)
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if method not in (0, 1):
        raise ValueError(
            f"method must be 0 (sample_walk) or 1 (rejection), got {method}"
        )
    if block_v is None:
        block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if vocab >= 2**31 - block_v:
        raise ValueError(f"vocab_size {vocab} is too large")

    width = max_depth + 1
    if block_w is None:
        block_w = triton.next_power_of_2(width)
    if block_w < width or block_w & (block_w - 1):
        raise ValueError(
            f"block_w must be a power of two >= max_depth + 1 = {width}, got {block_w}"
        )
    accepted = torch.empty((num_reqs, width), dtype=torch.int64, device=device)
    committed = torch.empty((num_reqs, width), dtype=torch.int64, device=device)
    num_accepted = torch.empty((num_reqs,), dtype=torch.int64, device=device)
    if num_reqs == 0:
        return accepted, committed, num_accepted

    _tree_verify_kernel[(num_reqs,)](
        logits,
        row_index.contiguous(),
        tokens.contiguous(),
        next_token.contiguous(),
        next_sibling.contiguous(),
        temperature.contiguous(),
        node_coins.contiguous(),
        final_coins.contiguous(),
        accepted,
        committed,
        num_accepted,
        num_rows,
        logits.stride(0),
        vocab,
        max_depth,
        _f64_bits(threshold_single),
        _f64_bits(threshold_acc),
        GREEDY_EPS=SAMPLING_EPS,
        METHOD=int(method),
        BLOCK_V=block_v,
        BLOCK_W=block_w,
        num_warps=4,
        **dict(_launch_options(device.type)),
    )
    return accepted, committed, num_accepted


def warm_up_tree_verify(
    vocab_size: int,
    logits_dtypes: tuple[torch.dtype, ...],
    max_tree_depth: int,
    threshold_single: float,
    threshold_acc: float,
    device: torch.device,
) -> int:
    """Launches, once each, the verify kernel variants an engine's steps launch
    (both methods: a seeded request switches to ``sample_walk``; each logits
    dtype: raw logits, and the float32 rows of filtered or edited requests),
    so Triton compiles them at start-up. ``max_tree_depth`` fixes the path tile
    as the engine's steps do (:func:`vllm_ddtree.verify.verify_tree`'s
    ``max_tree_depth``). Returns the number of launches."""
    block_w = triton.next_power_of_2(max_tree_depth + 1)
    index = torch.zeros(1, 1, dtype=torch.int64, device=device)
    none = torch.full_like(index, -1)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    launches = 0
    for dtype in dict.fromkeys(logits_dtypes):
        logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)
        for method in (0, 1):
            tree_verify_triton(
                logits,
                index,
                none,
                none,
                ones,
                torch.zeros(1, 1, dtype=torch.float32, device=device),
                torch.zeros(1, dtype=torch.float32, device=device),
                1,
                method,
                threshold_single,
                threshold_acc,
                row_index=index,
                block_w=block_w,
            )
            launches += 1
    return launches
