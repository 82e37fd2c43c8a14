# SPDX-License-Identifier: Apache-2.0
"""Readable torch references: the test oracles of the tree builder and the kernels.

Each reference states the contract its fast counterpart is tested against, written
for reading, not speed (loops over requests or tree depths, float32 arithmetic,
host synchronization):

* :func:`build_ddtree_reference`: the paper's best-first heap, in numpy
  (``tree.build_ddtree`` returns the same :class:`DraftTree`);
* :func:`tree_attention_reference`: tree attention over the paged KV cache
  (``ops.tree_attention.tree_attention_triton``);
* :func:`mla_tree_attention_reference`: the same in MLA's latent space
  (``ops.mla_tree_attention.mla_tree_attention_triton``);
* :func:`tree_gated_delta_rule_reference`: the gated delta rule along a tree
  (``ops.tree_gdn.tree_gated_delta_rule_triton``);
* :func:`commit_kv_reference`: moving accepted K/V to contiguous slots
  (``ops.kv_commit.commit_kv_triton``).

The kernel references validate their inputs with their kernel module's own
checks, imported when called: those modules import Triton, which the tree
builder's tests do not need (and the tests set ``TRITON_INTERPRET`` before Triton
is first imported).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from vllm_ddtree.tree import (
    DraftTree,
    _check_draft_logits,
    _children_per_depth,
    _empty_tree,
    draft_top_k,
    pack_visibility,
    tree_from_parents,
)

__all__ = [
    "build_ddtree_reference",
    "commit_kv_reference",
    "mla_tree_attention_reference",
    "tree_attention_reference",
    "tree_gated_delta_rule_reference",
]


# --------------------------------------------------------------------------- #
# Draft trees (tree.py)
# --------------------------------------------------------------------------- #


def build_ddtree_reference(
    draft_logits: torch.Tensor,
    budget: int | list[int],
    root_token_ids: list[int] | None = None,
    *,
    top_k: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_children: int | None = None,
) -> DraftTree:
    """The paper's best-first heap (Prop. 3), one request at a time. Test oracle.

    Heap entries are keyed by the total order of this module; a popped node pushes
    its next sibling and its first child. Returns the same :class:`DraftTree` as
    :func:`build_ddtree` (padded to the largest budget).
    """
    _check_draft_logits(draft_logits, validate_values=True)
    num_reqs, depth_limit, vocab = draft_logits.shape
    budgets = [budget] * num_reqs if isinstance(budget, int) else list(budget)
    if any(b < 0 for b in budgets):
        raise ValueError("budget must be >= 0")
    cap = max(budgets, default=0)
    if cap == 0:
        roots = torch.tensor(root_token_ids) if root_token_ids is not None else None
        return _empty_tree(num_reqs, depth_limit, roots, draft_logits.device)
    k = _children_per_depth(cap, vocab, max_children)
    if top_k is None:
        top_k = draft_top_k(draft_logits, k)
    lp_all = top_k[0][..., :k].float().cpu().numpy()
    ids_all = top_k[1][..., :k].cpu().numpy()

    all_parents, all_tokens, all_scores = [], [], []
    for b in range(num_reqs):
        lp, ids = lp_all[b], ids_all[b]
        root = root_token_ids[b] if root_token_ids is not None else 0
        parents, tokens, scores = [-1], [int(root)], [0.0]
        count_at_depth = [0] * (depth_limit + 1)
        # (-score, depth, parent position in its depth, rank, parent index,
        #  parent score)
        zero = np.float32(0.0)
        heap = [(-np.float32(zero + lp[0, 0]), 1, 0, 0, 0, zero)]
        while heap and len(parents) - 1 < budgets[b]:
            neg, depth, parent_pos, rank, parent, parent_score = heapq.heappop(heap)
            score = -neg
            index = len(parents)
            pos = count_at_depth[depth]
            count_at_depth[depth] += 1
            parents.append(parent)
            tokens.append(int(ids[depth - 1, rank]))
            scores.append(float(score))
            if rank + 1 < k:  # next sibling
                s = np.float32(parent_score + lp[depth - 1, rank + 1])
                heapq.heappush(
                    heap, (-s, depth, parent_pos, rank + 1, parent, parent_score)
                )
            if depth < depth_limit:  # first child
                s = np.float32(score + lp[depth, 0])
                heapq.heappush(heap, (-s, depth + 1, pos, 0, index, score))
        all_parents.append(parents)
        all_tokens.append(tokens)
        all_scores.append(scores)

    # Pad every request to `cap` node rows like the vectorized builder.
    tree = tree_from_parents(all_parents, all_tokens, depth_limit, all_scores)
    pad = cap + 1 - tree.num_rows
    if pad > 0:
        tree = _pad_tree(tree, pad)
    return tree.to(draft_logits.device)


def _pad_tree(tree: DraftTree, pad: int) -> DraftTree:
    num_reqs, rows = tree.tokens.shape
    f = torch.nn.functional

    def pad_rows(x: torch.Tensor, value) -> torch.Tensor:
        return f.pad(x, (0, pad), value=value)

    new_rows = rows + pad
    vis = torch.zeros(num_reqs, new_rows, new_rows, dtype=torch.bool)
    vis[:, :rows, :rows] = tree.visibility
    vis[:, torch.arange(rows, new_rows), torch.arange(rows, new_rows)] = True
    return DraftTree(
        tokens=pad_rows(tree.tokens, 0),
        parents=pad_rows(tree.parents, -1),
        depths=pad_rows(tree.depths, 0),
        scores=pad_rows(tree.scores, float("-inf")),
        num_nodes=tree.num_nodes,
        retrieve_index=torch.arange(num_reqs).unsqueeze(1) * new_rows
        + torch.arange(new_rows).unsqueeze(0),
        retrieve_next_token=pad_rows(tree.retrieve_next_token, -1),
        retrieve_next_sibling=pad_rows(tree.retrieve_next_sibling, -1),
        visibility=vis,
        visibility_packed=pack_visibility(vis),
        max_depth=tree.max_depth,
    )


# --------------------------------------------------------------------------- #
# Tree attention (ops/tree_attention.py)
# --------------------------------------------------------------------------- #


def _unpack_tree_mask(words: torch.Tensor, num_cols: int) -> torch.Tensor:
    """[..., ceil(n / 32)] int32 packed rows -> [..., num_cols] bool."""
    cols = torch.arange(num_cols, device=words.device)
    # An arithmetic shift of a negative word still leaves the wanted bit at 0.
    return ((words[..., cols // 32] >> (cols % 32)) & 1).bool()


def tree_attention_reference(
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
) -> torch.Tensor:
    """Tree attention in torch, one request at a time, in float32.

    Same arguments, contract and result as ``tree_attention_triton``
    (``ops/tree_attention.py``, which documents them), without its tile sizes; the
    values are always checked (host sync).
    """
    from vllm_ddtree.ops.tree_attention import _check_inputs, _check_values

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
    _check_values(
        query,
        key_cache,
        block_table,
        prefix_lens,
        tree_lens,
        query_start_loc,
        tree_mask_bits,
    )
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = query.shape[1] // num_kv_heads
    device = query.device
    out = torch.zeros_like(query)
    for r, (p, t, q0) in enumerate(
        zip(
            prefix_lens.tolist(),
            tree_lens.tolist(),
            query_start_loc[:-1].tolist(),
            strict=True,
        )
    ):
        if t == 0:
            continue
        # Committed keys older than the root's window are seen by no row (and
        # are not read: vLLM may have freed their blocks).
        first = max(p - sliding_window + 1, 0) if sliding_window > 0 else 0
        pos = torch.arange(first, p + t, device=device)
        n = pos.numel()
        blocks = block_table[r].long()[pos // block_size]
        # [n, num_heads, head_dim]: each KV head repeated for its G q heads.
        k = key_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)
        v = value_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)
        q = query[q0 : q0 + t].float()  # [t, num_heads, head_dim]
        visible = torch.cat(
            [
                torch.ones(t, p - first, dtype=torch.bool, device=device),
                _unpack_tree_mask(tree_mask_bits[r, :t], t),
            ],
            dim=1,
        )  # [t, n]
        if sliding_window > 0:
            depth = tree_depths[r, :t].long()
            key_pos = torch.cat([pos[: p - first], p + depth])
            visible &= (p + depth)[:, None] - key_pos[None, :] < sliding_window
        # [num_heads, t, n]
        scores = torch.einsum("thd,shd->hts", q, k) * float(scale)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, t, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :n]
        # A row that sees nothing (and has no sink): NaN; the contract says zero.
        probs = torch.nan_to_num(probs, nan=0.0)
        o = torch.einsum("hts,shd->thd", probs, v)
        out[q0 : q0 + t] = o.to(query.dtype)
    return out


# --------------------------------------------------------------------------- #
# MLA tree attention (ops/mla_tree_attention.py)
# --------------------------------------------------------------------------- #


def mla_tree_attention_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask_bits: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Latent-space tree attention in torch, one request at a time, float32.

    Same arguments, contract and result as ``mla_tree_attention_triton``
    (``ops/mla_tree_attention.py``, which documents them), without its tile sizes.
    """
    from vllm_ddtree.ops.mla_tree_attention import _check_inputs

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
    block_size = latent_cache.shape[1]
    lora = q_lat.shape[2]
    out = torch.zeros_like(q_lat)
    for r, (p, t, q0) in enumerate(
        zip(
            prefix_lens.tolist(),
            tree_lens.tolist(),
            query_start_loc[:-1].tolist(),
            strict=True,
        )
    ):
        if t == 0:
            continue
        pos = torch.arange(p + t, device=q_lat.device)
        rows = latent_cache[block_table[r].long()[pos // block_size], pos % block_size]
        kv_c, k_pe = rows[:, :lora].float(), rows[:, lora:].float()  # [S, L], [S, R]
        visible = torch.cat(
            [
                torch.ones(t, p, dtype=torch.bool, device=q_lat.device),
                _unpack_tree_mask(tree_mask_bits[r, :t], t),
            ],
            dim=1,
        )  # [t, S]
        scores = (
            torch.einsum("thl,sl->hts", q_lat[q0 : q0 + t].float(), kv_c)
            + torch.einsum("thr,sr->hts", q_pe[q0 : q0 + t].float(), k_pe)
        ) * float(scale)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # a row that sees nothing: zero
        out[q0 : q0 + t] = torch.einsum("hts,sl->thl", probs, kv_c).to(out.dtype)
    return out


# --------------------------------------------------------------------------- #
# Gated DeltaNet along a tree (ops/tree_gdn.py)
# --------------------------------------------------------------------------- #


def _gating(a, b, A_log, dt_bias, threshold):
    x = a.float() + dt_bias.float()
    softplus = torch.where(x <= threshold, torch.log1p(torch.exp(x)), x)
    g = -torch.exp(A_log.float()) * softplus  # [M, HV]
    return g, torch.sigmoid(b.float())


def tree_gated_delta_rule_reference(
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
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """The gated delta rule along the tree, in torch (float32 arithmetic), all
    nodes of one depth at once.

    Same arguments, contract and result as ``tree_gated_delta_rule_triton``
    (``ops/tree_gdn.py``, which documents them), without ``tree_start_loc`` and
    ``block_v``.
    """
    from vllm_ddtree.ops.tree_gdn import _check_inputs, tree_depths

    _check_inputs(q, k, v, a, b, state, parent_rows, initial_slots, node_slots)
    m, num_k_heads, k_dim = q.shape
    num_v_heads = v.shape[1]
    scale = k_dim**-0.5 if scale is None else scale
    group = num_v_heads // num_k_heads
    qf = q.float().repeat_interleave(group, dim=1)  # [M, HV, K]
    kf = k.float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf = qf * scale
    g, beta = _gating(a, b, A_log, dt_bias, softplus_threshold)
    parents = parent_rows.to(torch.int64)
    depth = tree_depths(parents)
    node_slots = node_slots.to(torch.int64)
    source = torch.where(
        parents >= 0, node_slots[parents.clamp(min=0)], initial_slots.to(torch.int64)
    )
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for level in range(int(depth.max()) + 1 if m else 0):
        rows = torch.nonzero(depth == level).squeeze(1)
        h = state[source[rows]].float()  # [n, HV, K, V]
        h = h * torch.exp(g[rows])[..., None, None]
        kr, vr = kf[rows], v[rows].float()
        delta = (vr - torch.einsum("nhkv,nhk->nhv", h, kr)) * beta[rows][..., None]
        h = h + kr[..., :, None] * delta[..., None, :]
        out[rows] = torch.einsum("nhkv,nhk->nhv", h, qf[rows])
        state[node_slots[rows]] = h.to(state.dtype)
    return out.to(v.dtype)


# --------------------------------------------------------------------------- #
# KV commit (ops/kv_commit.py)
# --------------------------------------------------------------------------- #


def commit_kv_reference(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Copies K/V from ``src_slots`` to ``dst_slots`` in every layer (torch).

    The definition ``commit_kv_triton`` (``ops/kv_commit.py``) is tested against
    (gather-then-scatter, self-moves skipped). Filters the self-moves with
    a boolean mask, which synchronizes a GPU.

    Args:
        kv_caches: per-layer [2, num_blocks, block_size, num_kv_heads, head_dim]
            float16/bfloat16/float32 caches of one shape, dtype and device;
            modified in place.
        src_slots: [num_moves] int32/int64 slots to read.
        dst_slots: [num_moves] int32/int64 slots to write. Moving entries
            (``src != dst``) must have distinct destinations.

    Raises:
        ValueError: on mismatched shapes, dtypes or devices.
    """
    from vllm_ddtree.ops.kv_commit import _check_args

    _check_args(kv_caches, src_slots, dst_slots)
    if not kv_caches or src_slots.numel() == 0:
        return
    block_size = kv_caches[0].shape[2]
    moving = src_slots != dst_slots
    src = src_slots[moving].long()
    dst = dst_slots[moving].long()
    src_block, src_offset = src // block_size, src % block_size
    dst_block, dst_offset = dst // block_size, dst % block_size
    for cache in kv_caches:
        # Advanced indexing gathers into a new tensor before the scatter, so every
        # source is read before anything is written.
        cache[:, dst_block, dst_offset] = cache[:, src_block, src_offset]
