# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet along a draft tree: each node continues its parent's state.

A Gated DeltaNet layer (https://arxiv.org/abs/2412.06464; Qwen3-Next, Qwen3.5/3.6)
keeps per request a short causal convolution over its last ``W - 1`` inputs and a
recurrent state ``h`` (``[HV, K, V]`` per layer). For token ``t``, after the
convolution (``x -> silu(conv(x))``, then split into ``q, k, v``):

    g    = -exp(A_log) * softplus(a_t + dt_bias)      beta = sigmoid(b_t)
    q, k = l2norm(q_t) * K**-0.5, l2norm(k_t)         (one K-head per HV / H v-heads)
    h    = exp(g) * h
    h    = h + k (beta * (v_t - h^T k))^T             o_t = h^T q

In DDTree's verify pass the rows of a request are a tree, not a sequence: node
``i``'s convolution window is the last ``W - 1`` inputs along its root path (its
ancestors, then the committed conv state), and its recurrence starts from its
parent's state (the root's from the committed state). So every node computes
exactly what the target computes for that node's path, whichever path is
accepted; the commit then keeps the accepted node's state.

Packed layout (tree rows of all requests, request after request, parents before
children as ``vllm_ddtree.tree`` orders them):

* ``parent_rows``: [M] packed row of each row's parent, -1 for a root;
* ``initial_slots``: [M] for a root, the state slot holding its request's
  committed state (read before anything is written); ignored for other rows;
* ``node_slots``: [M] the state slot each row's post-state is written to (a
  child reads its parent's from there). A root may write its own initial slot.

* :func:`tree_conv_windows`: each row's conv window along its root path (a
  gather; vLLM's decode conv kernels then run on the windows), and
  :func:`tree_causal_conv1d`, the convolution over them in torch.
* :func:`tree_gated_delta_rule_triton`: the recurrence, one program per
  (request, v-head, ``BLOCK_V`` values); rows in order, each loading its
  parent's state from its slot (the per-token initial-state index of vLLM's
  recurrent kernel is the parent's slot here). No host synchronization. Tested
  against a torch reference (float32, all nodes of one depth at once). On the
  CPU, vLLM's own decode kernels run the recurrence, one tree depth at a time.

State caches are views ``[num_slots, HV, K, V]`` with any strides (vLLM's CPU
kernels keep ``h[k, v]``, its Triton kernels ``h[v, k]``: pass
``cache.transpose(-1, -2)`` for the latter). Node states are stored in the
cache's dtype and re-read by the children, as a non-speculative decode stores
and re-reads its state after every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = [
    "tree_causal_conv1d",
    "tree_conv_windows",
    "tree_depths",
    "tree_gated_delta_rule_triton",
]


def tree_depths(parent_rows: torch.Tensor) -> torch.Tensor:
    """[M] int64 depth of every packed row (roots 0); parents precede children."""
    parents = parent_rows.to(torch.int64).cpu()
    depth = torch.zeros_like(parents)
    for i, p in enumerate(parents.tolist()):
        if p >= i:
            raise ValueError(f"row {i}'s parent {p} does not precede it")
        if p >= 0:
            depth[i] = depth[p] + 1
    return depth.to(parent_rows.device)


def tree_conv_windows(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    conv_slots: torch.Tensor,
    parent_rows: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """[M, D, W - 1] every tree row's conv window: the ``W - 1`` inputs before it
    on its root path, oldest first (its ancestors, and before the root the
    committed inputs: columns ``0 .. W - 2`` of its request's conv slot, the
    newest last, vLLM's layout). A decode of that path holds exactly this conv
    state when it reaches the row.

    Args:
        x: [M, D] the rows' inputs (before the convolution).
        conv_state: [num_slots, D, S] conv states, S >= W - 1.
        conv_slots: [M] the conv slot of each row's request.
        parent_rows: [M] packed parent row, -1 for roots.
        width: the conv kernel size W.
    """
    parents = parent_rows.to(torch.int64)
    slots = conv_slots.to(torch.int64)
    windows = torch.empty(
        x.shape[0], x.shape[1], width - 1, dtype=conv_state.dtype, device=x.device
    )
    # Walk up one ancestor per tap (on the device: no host loop over rows);
    # past the root, read the committed inputs. ``found``: the row's depth,
    # clipped at the taps walked so far.
    ancestor = parents.clone()
    found = torch.zeros_like(parents)
    for dist in range(1, width):
        in_tree = ancestor >= 0
        rows = ancestor.clamp(min=0)
        column = (width - 1 - (dist - found)).clamp(0, width - 2)
        committed = conv_state[slots, :, column]  # [M, D]
        tap = torch.where(
            in_tree[:, None], x.index_select(0, rows).to(windows.dtype), committed
        )
        windows[:, :, width - 1 - dist] = tap
        found = found + in_tree.to(found.dtype)
        ancestor = torch.where(in_tree, parents[rows], ancestor)
    return windows


def tree_causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    conv_slots: torch.Tensor,
    parent_rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise convolution of every tree row over its root path
    (windows: :func:`tree_conv_windows`), in float32.

    Args:
        x, conv_state, conv_slots, parent_rows: as :func:`tree_conv_windows`.
        weight: [D, W] the conv weight (tap ``W - 1`` multiplies the row itself).
        bias: [D] or None.
        activation: ``"silu"`` or None.

    Returns:
        [M, D] in x's dtype.
    """
    width = weight.shape[1]
    windows = tree_conv_windows(x, conv_state, conv_slots, parent_rows, width)
    taps = torch.cat([windows.float(), x.float()[:, :, None]], dim=2)  # [M, D, W]
    out = (taps * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.to(x.dtype)


def _check_inputs(q, k, v, a, b, state, parent_rows, initial_slots, node_slots):
    m, num_k_heads, k_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must be {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != m:
        raise ValueError(f"v must be [{m}, HV, V], got {tuple(v.shape)}")
    num_v_heads, v_dim = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} v-heads are not a multiple of {num_k_heads}")
    for name, t in (("a", a), ("b", b)):
        if t.shape != (m, num_v_heads):
            raise ValueError(
                f"{name} must be [{m}, {num_v_heads}], got {tuple(t.shape)}"
            )
    if state.dim() != 4 or tuple(state.shape[1:]) != (num_v_heads, k_dim, v_dim):
        raise ValueError(
            f"state must be [slots, {num_v_heads}, {k_dim}, {v_dim}], "
            f"got {tuple(state.shape)}"
        )
    for name, t in (
        ("parent_rows", parent_rows),
        ("initial_slots", initial_slots),
        ("node_slots", node_slots),
    ):
        if t.shape != (m,):
            raise ValueError(f"{name} must be [{m}], got {tuple(t.shape)}")


@triton.jit
def _tree_gdn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    out_ptr,
    parent_rows_ptr,
    initial_slots_ptr,
    node_slots_ptr,
    tree_start_loc_ptr,
    scale,
    threshold,
    stride_qm,
    stride_qh,
    stride_vm,
    stride_vh,
    stride_am,
    stride_s_slot,
    stride_s_head,
    stride_s_k,
    stride_s_v,
    GROUP: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    req = tl.program_id(0)
    hv = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K_DIM
    mask_v = offs_v < V_DIM
    mask_h = mask_k[:, None] & mask_v[None, :]
    h_k = hv // GROUP
    a_log = tl.load(a_log_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    h_offs = (
        hv * stride_s_head + offs_k[:, None] * stride_s_k + offs_v[None, :] * stride_s_v
    )
    start = tl.load(tree_start_loc_ptr + req)
    end = tl.load(tree_start_loc_ptr + req + 1)
    for row in range(start, end):
        parent = tl.load(parent_rows_ptr + row)
        if parent >= 0:
            source = tl.load(node_slots_ptr + parent).to(tl.int64)
        else:
            source = tl.load(initial_slots_ptr + row).to(tl.int64)
        # The parent's state was stored by this program (earlier row).
        tl.debug_barrier()
        h = tl.load(state_ptr + source * stride_s_slot + h_offs, mask=mask_h, other=0.0)
        h = h.to(tl.float32)  # [BLOCK_K, BLOCK_V]
        q = tl.load(
            q_ptr + row * stride_qm + h_k * stride_qh + offs_k, mask=mask_k, other=0.0
        ).to(tl.float32)
        k = tl.load(
            k_ptr + row * stride_qm + h_k * stride_qh + offs_k, mask=mask_k, other=0.0
        ).to(tl.float32)
        v = tl.load(
            v_ptr + row * stride_vm + hv * stride_vh + offs_v, mask=mask_v, other=0.0
        ).to(tl.float32)
        if USE_QK_L2NORM:
            q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        q = q * scale
        x = tl.load(a_ptr + row * stride_am + hv).to(tl.float32) + dt_bias
        softplus = tl.where(x <= threshold, tl.log(1.0 + tl.exp(x)), x)
        g = -tl.exp(a_log) * softplus
        beta = tl.sigmoid(tl.load(b_ptr + row * stride_am + hv).to(tl.float32))
        h = h * tl.exp(g)
        delta = (v - tl.sum(h * k[:, None], 0)) * beta  # [BLOCK_V]
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], 0)
        tl.store(out_ptr + row * stride_vm + hv * stride_vh + offs_v, o, mask=mask_v)
        dest = tl.load(node_slots_ptr + row).to(tl.int64)
        tl.store(
            state_ptr + dest * stride_s_slot + h_offs,
            h.to(state_ptr.dtype.element_ty),
            mask=mask_h,
        )


def tree_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    parent_rows: torch.Tensor,
    initial_slots: torch.Tensor,
    node_slots: torch.Tensor,
    tree_start_loc: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    softplus_threshold: float = 20.0,
    block_v: int | None = None,
) -> torch.Tensor:
    """The gated delta rule along the trees, in one Triton launch (float32
    arithmetic).

    Args:
        q, k: [M, H, K] after the convolution.
        v: [M, HV, V].
        a, b: [M, HV] gate inputs (``g`` and ``beta`` are computed here).
        A_log, dt_bias: [HV] the layer's gate parameters.
        state: [num_slots, HV, K, V] state cache (written: every row's
            post-state at ``node_slots``).
        parent_rows, initial_slots, node_slots: see the module docstring.
        tree_start_loc: [R + 1] packed row offsets of the requests (a request's
            rows form one tree; no row may read a slot another request writes).
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: l2-normalize q and k before scaling.
        softplus_threshold: above it, ``softplus(x)`` is taken as ``x``.
        block_v: values per program (default ``min(next_power_of_2(V), 64)``).

    Returns:
        [M, HV, V] outputs in v's dtype; rows of no request are zero.
    """
    _check_inputs(q, k, v, a, b, state, parent_rows, initial_slots, node_slots)
    m, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    scale = k_dim**-0.5 if scale is None else scale
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    a, b = a.contiguous(), b.contiguous()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    num_reqs = tree_start_loc.shape[0] - 1
    block_k = triton.next_power_of_2(k_dim)
    block_v = block_v or min(triton.next_power_of_2(v_dim), 64)
    if num_reqs > 0 and m > 0:
        grid = (num_reqs, num_v_heads, triton.cdiv(v_dim, block_v))
        _tree_gdn_kernel[grid](
            q, k, v, a, b, A_log, dt_bias, state, out,
            parent_rows, initial_slots, node_slots, tree_start_loc,
            scale, softplus_threshold,
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), a.stride(0),
            state.stride(0), state.stride(1), state.stride(2), state.stride(3),
            GROUP=num_v_heads // num_k_heads, K_DIM=k_dim, V_DIM=v_dim,
            BLOCK_K=block_k, BLOCK_V=block_v, USE_QK_L2NORM=use_qk_l2norm,
        )  # fmt: skip
    return out.to(v.dtype)
