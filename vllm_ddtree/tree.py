# SPDX-License-Identifier: Apache-2.0
"""DDTree draft trees: the data structure and its exact construction.

DDTree (Ringel & Romano, https://arxiv.org/abs/2604.12989) turns the per-position
marginals ``q_1..q_L`` of a block-diffusion drafter (DFlash) into a draft tree:
the ``B`` prefixes ``u = (u_1..u_d)`` with the highest factorized score
``sum_i log q_i(u_i)``. Every descendant scores at most its ancestor, so these
prefixes form a tree (paper Prop. 2) and only the top ``K = min(B, V)`` tokens per
depth can appear in it (Lemma 1).

Total order, ties included. A node is a rank tuple ``(r_1..r_d)``; its score is
accumulated in float32 from the root, ``s(u) = fl(s(parent) + lp[d-1, r_d])``, by
every builder identically. Nodes are ordered by

    (-score, depth, position of the parent within its depth, rank)

where "position within a depth" is the node's index in this same order restricted
to that depth. Parents precede children and rank ``r`` precedes ``r + 1``, so a
best-first heap pops exactly this order (the paper's builder) and the top-``B`` set is
prefix-closed even when float32 sums tie (e.g. a draft probability of exactly 1).
Node indices follow this order: node 0 is the root, parents have smaller indices
than their children, siblings are ordered by draft rank (= draft log-prob).

:func:`build_ddtree` builds the trees batched and vectorized on the logits'
device, with no host synchronization and no Python loop over requests or nodes.
Depth ``d`` keeps the top ``B`` children of depth ``d - 1``'s top ``B`` (exact, see
:func:`_candidate_pairs`), then one top ``B`` over all depths picks the tree. It
returns the same :class:`DraftTree` as the paper's best-first heap, one request at
a time (``build_ddtree_reference`` in the tests' ``references.py``: readable, the
test oracle).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DraftTree",
    "build_ddtree",
    "draft_top_k",
    "tree_from_parents",
    "tree_from_parents_host",
    "tree_from_parents_numpy",
]


@dataclass
class DraftTree:
    """A batch of draft trees, padded to ``N + 1`` rows per request (root = row 0).

    Rows ``1..num_nodes[b]`` of request ``b`` are real nodes; the rest are padding
    (token 0, parent -1, depth 0, score -inf, visible only to themselves, linked
    from nowhere). Every tensor lives on the same device.
    """

    # [R, N + 1] int64. Row 0 is the root (bonus) token; rows 1.. are drafts.
    tokens: torch.Tensor
    # [R, N + 1] int64. Local parent index; -1 for the root and for padding.
    parents: torch.Tensor
    # [R, N + 1] int64. Depth (root 0). Also the RoPE position offset.
    depths: torch.Tensor
    # [R, N + 1] float32. Factorized draft log-prob of the prefix (root 0).
    scores: torch.Tensor
    # [R] int64. Real nodes, root excluded (<= budget).
    num_nodes: torch.Tensor
    # [R, N + 1] int64. Global row b * (N + 1) + i (EAGLE/SGLang contract).
    retrieve_index: torch.Tensor
    # [R, N + 1] int64. First child (lowest rank), -1 if none.
    retrieve_next_token: torch.Tensor
    # [R, N + 1] int64. Next sibling in draft-rank order, -1 if none.
    retrieve_next_sibling: torch.Tensor
    # [R, N + 1, N + 1] bool. visibility[b, i, j]: node j is i or an ancestor of i.
    visibility: torch.Tensor
    # [R, N + 1, ceil((N + 1) / 32)] int32. Bit j % 32 of word j // 32 = column j.
    visibility_packed: torch.Tensor
    # Number of drafted positions L: the deepest possible node.
    max_depth: int

    @property
    def num_reqs(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_rows(self) -> int:
        """N + 1: root plus node capacity."""
        return self.tokens.shape[1]

    @property
    def position_offsets(self) -> torch.Tensor:
        """[R, N + 1] RoPE offsets from the committed length (= depth)."""
        return self.depths

    def to(self, device: torch.device | str) -> DraftTree:
        fields = {
            name: getattr(self, name).to(device)
            for name in self.__dataclass_fields__
            if name != "max_depth"
        }
        return DraftTree(max_depth=self.max_depth, **fields)


def _check_draft_logits(draft_logits: torch.Tensor, validate_values: bool) -> None:
    if not isinstance(draft_logits, torch.Tensor):
        raise ValueError(
            f"draft_logits must be a torch.Tensor, got {type(draft_logits).__name__}"
        )
    if draft_logits.dim() != 3:
        raise ValueError(
            "draft_logits must have shape [num_reqs, L, vocab_size], got "
            f"{tuple(draft_logits.shape)}"
        )
    if not draft_logits.is_floating_point():
        raise ValueError(
            f"draft_logits must be a floating-point tensor, got {draft_logits.dtype}"
        )
    if draft_logits.shape[1] < 1 or draft_logits.shape[2] < 1:
        raise ValueError(
            "draft_logits needs L >= 1 and vocab_size >= 1, got shape "
            f"{tuple(draft_logits.shape)}"
        )
    # Value checks synchronize with the device; hot paths pass validate=False.
    if validate_values and not bool(torch.isfinite(draft_logits).all()):
        raise ValueError("draft_logits contains NaN or infinite values")


def _resolve_budget(
    budget: int | torch.Tensor, num_reqs: int, max_budget: int | None
) -> tuple[int, torch.Tensor | None]:
    """Returns (static node capacity N, per-request budgets or None if uniform)."""
    if isinstance(budget, torch.Tensor):
        if budget.dim() != 1 or budget.shape[0] != num_reqs:
            raise ValueError(
                f"budget must be an int or a [num_reqs={num_reqs}] tensor, got "
                f"shape {tuple(budget.shape)}"
            )
        if budget.dtype.is_floating_point or budget.dtype == torch.bool:
            raise ValueError(f"budget must be an integer tensor, got {budget.dtype}")
        if max_budget is None:
            # Host sync; pass max_budget to keep shapes static without one.
            max_budget = int(budget.max()) if num_reqs else 0
            if num_reqs and int(budget.min()) < 0:
                raise ValueError("budget must be >= 0 for every request")
        if max_budget < 0:
            raise ValueError(f"max_budget must be >= 0, got {max_budget}")
        return max_budget, budget.to(torch.int64)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"budget must be an int or a tensor, got {budget!r}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if max_budget is not None and max_budget != budget:
        raise ValueError(
            f"max_budget ({max_budget}) must equal an int budget ({budget})"
        )
    return int(budget), None


def draft_top_k(
    draft_logits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` draft tokens per position and their log-probs (float32).

    The one vocabulary-sized step, shared by every builder of the same tree.

    Args:
        draft_logits: [num_reqs, L, V] drafter logits (temperature is not applied,
            as in the paper).
        k: tokens kept per position, ``1 <= k <= V``.

    Returns:
        (log_probs, token_ids), each [num_reqs, L, k], sorted by descending log-prob.
    """
    logits = draft_logits.float()
    top = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    return top.values - log_z, top.indices


@functools.lru_cache(maxsize=64)
def _candidate_pairs(
    budget: int, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent position i, child rank r) pairs that can be in a top-``budget`` tree.

    The i + 1 parents ranked at or before i (their scores are >= and they win ties)
    each have r + 1 children of rank <= r that score >= the pair's child (float
    addition is monotone) and win ties, so a pair with (i + 1)(r + 1) > budget is
    never among the top ``budget`` of its depth. About budget * ln(budget) pairs
    remain instead of budget * k. Sorted by (i, r): the tie-break order.
    Built on the host once per (budget, k, device): nonzero() on a GPU would sync.
    """
    i = torch.arange(budget).unsqueeze(1)
    r = torch.arange(k).unsqueeze(0)
    pi, pr = torch.nonzero((i + 1) * (r + 1) <= budget, as_tuple=True)
    return pi.to(device), pr.to(device)


def _top_in_order(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest scores per row, best first, ties to the
    lower index.

    Scores are log-probabilities, in [-inf, 0], so a larger score has a smaller
    float32 magnitude, and the magnitude's bits order like the magnitude. One
    top-k over distinct int64 keys (magnitude bits, then the index) replaces a
    stable sort of the whole row: same order, a fraction of the work.
    """
    magnitude = scores.view(torch.int32) & 0x7FFFFFFF  # -0.0 ranks as +0.0
    index = torch.arange(scores.shape[1], device=scores.device)
    keys = (magnitude.to(torch.int64) << 32) | index
    return keys.topk(count, dim=1, largest=False, sorted=True).indices


def build_ddtree(
    draft_logits: torch.Tensor,
    budget: int | torch.Tensor,
    root_token_ids: torch.Tensor | None = None,
    *,
    max_budget: int | None = None,
    top_k: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_children: int | None = None,
    validate: bool = True,
) -> DraftTree:
    """Builds the DDTree of every request, batched and on device.

    Args:
        draft_logits: [num_reqs, L, V] per-position drafter logits.
        budget: node budget B (root excluded): an int, or a [num_reqs] int tensor.
        root_token_ids: [num_reqs] bonus tokens stored at row 0 (default 0).
        max_budget: static node capacity N when ``budget`` is a tensor (avoids a
            host sync); defaults to ``budget.max()``.
        top_k: precomputed :func:`draft_top_k` output with k >= min(N, V,
            max_children) (log-probs, so every score is <= 0).
        max_children: draft tokens considered per depth, hence children per node
            at most (the paper's K = min(B, V) when None). 1 gives the DFlash
            chain (the argmax path, truncated to B nodes).
        validate: check values (NaN/inf) too; this synchronizes with the device.

    Returns:
        The :class:`DraftTree` with N = max budget node rows per request.
    """
    _check_draft_logits(draft_logits, validate)
    num_reqs, depth_limit, _ = draft_logits.shape
    device = draft_logits.device
    cap, per_req_budget = _resolve_budget(budget, num_reqs, max_budget)
    if cap == 0:
        return _empty_tree(num_reqs, depth_limit, root_token_ids, device)

    k, log_probs, token_ids = _draft_candidates(draft_logits, cap, max_children, top_k)

    # Per depth, the top `cap` nodes in tie-break order: their scores, and which
    # (parent position in the previous depth's list, draft rank) pair made each.
    pair_parent, pair_rank = _candidate_pairs(cap, k, device)
    # Pair ids: depth 1 uses ids 0..cap-1 (parent = root, rank = id); deeper depths
    # use cap + index into the (pair_parent, pair_rank) list.
    all_pair_parent = torch.cat(
        [torch.zeros(cap, dtype=torch.int64, device=device), pair_parent]
    )
    all_pair_rank = torch.cat([torch.arange(cap, device=device), pair_rank])
    # Depth 1: the root's children are the top ranks, already sorted.
    first = torch.full((num_reqs, cap), float("-inf"), device=device)
    first[:, :k] = log_probs[:, 0, :k]
    level_scores = [first]
    level_pairs = [torch.arange(cap, device=device).expand(num_reqs, cap)]
    for d in range(1, depth_limit):
        # [R, C] candidate scores; an invalid parent (-inf) stays -inf.
        cand = level_scores[-1].index_select(1, pair_parent) + log_probs[
            :, d
        ].index_select(1, pair_rank)
        # Ties keep the (parent position, rank) order of the pair list.
        order = _top_in_order(cand, cap)
        level_scores.append(cand.gather(1, order))
        level_pairs.append(order + cap)

    # One top-`cap` over all depths; ties broken by (depth, position).
    flat_scores = torch.stack(level_scores, dim=1).reshape(num_reqs, depth_limit * cap)
    sel = _top_in_order(flat_scores, cap)  # [R, cap]
    sel_pair = torch.stack(level_pairs, dim=1).reshape(num_reqs, -1).gather(1, sel)
    sel_scores = flat_scores.gather(1, sel)

    node_slot = torch.arange(cap, device=device).unsqueeze(0)
    valid = sel_scores > float("-inf")
    if per_req_budget is not None:
        valid &= node_slot < per_req_budget.to(device).unsqueeze(1)
    sel_depth0 = sel // cap  # 0-based depth level

    # Local index (1-based) of every (depth, position) entry that made the tree.
    local_of_entry = torch.zeros(
        num_reqs, depth_limit * cap, dtype=torch.int64, device=device
    )
    local_of_entry.scatter_(1, sel, torch.where(valid, node_slot + 1, 0))
    parent_pos = all_pair_parent[sel_pair]
    parent_entry = (sel_depth0 - 1).clamp(min=0) * cap + parent_pos
    parent_local = torch.where(
        sel_depth0 == 0, 0, local_of_entry.gather(1, parent_entry)
    )
    rank = all_pair_rank[sel_pair]
    # token_ids[b, depth, rank] for each selected node.
    flat_ids = token_ids.reshape(num_reqs, depth_limit * k)
    node_tokens = flat_ids.gather(1, sel_depth0 * k + rank.clamp(max=k - 1))

    zero = torch.zeros(num_reqs, 1, dtype=torch.int64, device=device)
    roots = (
        zero
        if root_token_ids is None
        else root_token_ids.to(device=device, dtype=torch.int64).reshape(num_reqs, 1)
    )
    tokens = torch.cat([roots, torch.where(valid, node_tokens, 0)], dim=1)
    parents = torch.cat([zero - 1, torch.where(valid, parent_local, -1)], dim=1)
    depths = torch.cat([zero, torch.where(valid, sel_depth0 + 1, 0)], dim=1)
    scores = torch.cat(
        [
            torch.zeros(num_reqs, 1, device=device),
            sel_scores.masked_fill(~valid, float("-inf")),
        ],
        dim=1,
    )
    num_nodes = valid.sum(dim=1)
    return _finish_tree(tokens, parents, depths, scores, num_nodes, depth_limit)


def _draft_candidates(
    draft_logits: torch.Tensor,
    cap: int,
    max_children: int | None,
    top_k: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(k, log-probs, token ids)``: the k = min(cap, V, max_children)
    candidate draft tokens per depth every builder chooses from ([R, L, k]
    float32 and ids), from ``top_k`` when given."""
    k = _children_per_depth(cap, draft_logits.shape[-1], max_children)
    if top_k is None:
        return k, *draft_top_k(draft_logits, k)
    return k, top_k[0][..., :k].float(), top_k[1][..., :k]


def _children_per_depth(cap: int, vocab: int, max_children: int | None) -> int:
    if max_children is None:
        return min(cap, vocab)
    if (
        isinstance(max_children, bool)
        or not isinstance(max_children, (int, np.integer))
        or max_children < 1
    ):
        raise ValueError(
            f"max_children must be None or an int >= 1, got {max_children!r}"
        )
    return min(cap, vocab, int(max_children))


def _empty_tree(
    num_reqs: int, depth_limit: int, root_token_ids: torch.Tensor | None, device
) -> DraftTree:
    zero = torch.zeros(num_reqs, 1, dtype=torch.int64, device=device)
    tokens = (
        zero
        if root_token_ids is None
        else root_token_ids.to(device=device, dtype=torch.int64).reshape(num_reqs, 1)
    )
    return _finish_tree(
        tokens,
        zero - 1,
        zero.clone(),
        torch.zeros(num_reqs, 1, device=device),
        torch.zeros(num_reqs, dtype=torch.int64, device=device),
        depth_limit,
    )


def _finish_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    scores: torch.Tensor,
    num_nodes: torch.Tensor,
    max_depth: int,
) -> DraftTree:
    """Derives LCRS links and visibility from parents (parent index < child index)."""
    num_reqs, rows = tokens.shape
    device = tokens.device
    idx = torch.arange(rows, device=device).unsqueeze(0).expand(num_reqs, rows)
    is_node = parents >= 0  # root and padding are not children of anything

    # First child = lowest-index child; scatter_reduce over a sentinel `rows`.
    first_child = torch.full(
        (num_reqs, rows + 1), rows, dtype=torch.int64, device=device
    )
    first_child.scatter_reduce_(
        1, torch.where(is_node, parents, rows), torch.where(is_node, idx, rows), "amin"
    )
    first_child = first_child[:, :rows]
    first_child = torch.where(first_child == rows, -1, first_child)

    # Next sibling: sort children by (parent, index); neighbours with one parent.
    key = torch.where(is_node, parents * rows + idx, rows * rows + idx)
    sorted_key, order = torch.sort(key, dim=1)
    same_parent = (sorted_key[:, 1:] // rows == sorted_key[:, :-1] // rows) & (
        sorted_key[:, 1:] < rows * rows
    )
    nxt = torch.where(same_parent, order[:, 1:], -1)
    next_sibling = torch.full((num_reqs, rows), -1, dtype=torch.int64, device=device)
    next_sibling.scatter_(1, order[:, :-1], nxt)

    # Ancestor-or-self visibility by pointer jumping up to max_depth levels.
    visibility = torch.eye(rows, dtype=torch.bool, device=device).repeat(num_reqs, 1, 1)
    hop = torch.where(is_node, parents, idx)  # root/padding point to themselves
    anc = hop
    for _ in range(max_depth):
        visibility.scatter_(2, anc.unsqueeze(2), True)
        anc = hop.gather(1, anc)

    retrieve_index = (
        torch.arange(num_reqs, device=device).unsqueeze(1) * rows + idx
    ).contiguous()
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        scores=scores,
        num_nodes=num_nodes,
        retrieve_index=retrieve_index,
        retrieve_next_token=first_child.contiguous(),
        retrieve_next_sibling=next_sibling,
        visibility=visibility,
        visibility_packed=pack_visibility(visibility),
        max_depth=max_depth,
    )


def pack_visibility(visibility: torch.Tensor) -> torch.Tensor:
    """[..., rows, rows] bool -> [..., rows, ceil(rows / 32)] int32 little-endian
    bits."""
    rows = visibility.shape[-1]
    words = (rows + 31) // 32
    bits = torch.nn.functional.pad(visibility, (0, words * 32 - rows)).view(torch.uint8)
    bits = bits.reshape(*visibility.shape[:-1], words * 4, 8)
    packed_bytes = bits[..., 0].clone()
    for bit in range(1, 8):
        packed_bytes |= bits[..., bit] << bit
    # Four little-endian bytes are one int32 word (bit j % 32 of word j // 32).
    return packed_bytes.view(torch.int32)


def tree_from_parents(
    parents: list[list[int]],
    tokens: list[list[int]],
    max_depth: int,
    scores: list[list[float]] | None = None,
    device: torch.device | str = "cpu",
) -> DraftTree:
    """Builds a :class:`DraftTree` from explicit per-request node lists, with loops.

    ``parents[b]`` and ``tokens[b]`` list the root first (parent -1) and then the
    nodes; a node's parent must have a smaller index. Requests are padded to the
    longest. Derived fields are computed with plain Python loops, independently of
    the vectorized builder: hand-built trees in tests and the reference builder use
    it.
    """
    num_reqs = len(parents)
    rows = max((len(p) for p in parents), default=1)
    tok = np.zeros((num_reqs, rows), dtype=np.int64)
    par = np.full((num_reqs, rows), -1, dtype=np.int64)
    dep = np.zeros((num_reqs, rows), dtype=np.int64)
    sco = np.full((num_reqs, rows), -np.inf, dtype=np.float32)
    first_child = np.full((num_reqs, rows), -1, dtype=np.int64)
    next_sibling = np.full((num_reqs, rows), -1, dtype=np.int64)
    vis = np.zeros((num_reqs, rows, rows), dtype=bool)
    for b in range(num_reqs):
        n = len(parents[b])
        if n < 1 or parents[b][0] != -1 or len(tokens[b]) != n:
            raise ValueError(
                f"request {b}: needs a root with parent -1 and one token per node"
            )
        sco[b, 0] = 0.0
        last_child: dict[int, int] = {}
        for i in range(rows):
            vis[b, i, i] = True
        for i in range(n):
            p = parents[b][i]
            tok[b, i] = tokens[b][i]
            if i == 0:
                continue
            if not 0 <= p < i:
                raise ValueError(
                    f"request {b}: node {i} has parent {p}, need 0 <= parent < {i}"
                )
            par[b, i] = p
            dep[b, i] = dep[b, p] + 1
            if dep[b, i] > max_depth:
                raise ValueError(
                    f"request {b}: node {i} is deeper than max_depth={max_depth}"
                )
            sco[b, i] = scores[b][i] if scores is not None else 0.0
            vis[b, i, :i] = vis[b, p, :i]  # the paper's visibility recurrence
            if p in last_child:
                next_sibling[b, last_child[p]] = i
            else:
                first_child[b, p] = i
            last_child[p] = i
    num_nodes = np.asarray([len(p) - 1 for p in parents], dtype=np.int64)
    return _host_arrays_to_tree(
        tok, par, dep, sco, num_nodes, first_child, next_sibling, vis, max_depth, device
    )


def _host_arrays_to_tree(
    tok, par, dep, sco, num_nodes, first_child, next_sibling, vis, max_depth, device
) -> DraftTree:
    """A :class:`DraftTree` of host arrays (``[R, N]``, ``vis`` ``[R, N, N]``)."""
    num_reqs, rows = tok.shape
    # The packed bits on the host (one numpy call where pack_visibility's
    # torch ops cost ~50 us a tree on CPU), laid out as pack_visibility's.
    words = (rows + 31) // 32
    padded = np.zeros((num_reqs, rows, words * 32), dtype=bool)
    padded[..., :rows] = vis
    packed = np.packbits(padded, axis=-1, bitorder="little").view(np.int32)
    rows_idx = np.arange(rows)
    return DraftTree(
        tokens=torch.from_numpy(tok).to(device),
        parents=torch.from_numpy(par).to(device),
        depths=torch.from_numpy(dep).to(device),
        scores=torch.from_numpy(sco).to(device),
        num_nodes=torch.from_numpy(num_nodes).to(device),
        retrieve_index=torch.from_numpy(
            np.arange(num_reqs)[:, None] * rows + rows_idx[None, :]
        ).to(device),
        retrieve_next_token=torch.from_numpy(first_child).to(device),
        retrieve_next_sibling=torch.from_numpy(next_sibling).to(device),
        visibility=torch.from_numpy(vis).to(device),
        visibility_packed=torch.from_numpy(packed).to(device),
        max_depth=max_depth,
    )


# Below this many nodes in a batch, the loops of tree_from_parents beat
# numpy's per-call overhead (2-core Xeon: 52 against 94 us at one tree of 16
# nodes, 130 against 124 us at 4 x 16, 231 against 144 us at 8 x 16, 6.4
# against 1.7 ms at 64 trees of 65).
HOST_LOOP_MAX_NODES = 64


def tree_from_parents_host(
    parents: list[list[int]],
    tokens: list[list[int]],
    max_depth: int,
    scores: list[list[float]] | None = None,
) -> DraftTree:
    """:func:`tree_from_parents` on the host at the lower cost of its loops
    (few nodes) or of :func:`tree_from_parents_numpy` (many): the worker's
    per-step trees."""
    if sum(len(p) for p in parents) <= HOST_LOOP_MAX_NODES:
        return tree_from_parents(parents, tokens, max_depth, scores)
    return tree_from_parents_numpy(parents, tokens, max_depth, scores)


def tree_from_parents_numpy(
    parents: list[list[int]],
    tokens: list[list[int]],
    max_depth: int,
    scores: list[list[float]] | None = None,
) -> DraftTree:
    """:func:`tree_from_parents` without per-node Python: the same tree (on
    the host) from the same lists, its derived fields by numpy pointer
    jumping (ancestors and depths in log2(depth) rounds), children's order by
    one sort per batch. The loop version stays the reference it is tested
    against."""
    num_reqs = len(parents)
    counts = np.fromiter((len(p) for p in parents), np.int64, num_reqs)
    malformed = [
        not p or p[0] != -1 or b >= len(tokens) or len(tokens[b]) != len(p)
        for b, p in enumerate(parents)
    ]
    if any(malformed):
        raise ValueError(
            f"request {malformed.index(True)}: needs a root with parent -1 and one "
            "token per node"
        )
    rows = int(counts.max()) if num_reqs else 1
    node = np.arange(rows)
    real = node[None, :] < counts[:, None]  # [R, N]
    par = np.full((num_reqs, rows), -1, dtype=np.int64)
    par[real] = np.fromiter(itertools.chain.from_iterable(parents), np.int64)
    tok = np.zeros((num_reqs, rows), dtype=np.int64)
    tok[real] = np.fromiter(itertools.chain.from_iterable(tokens), np.int64)
    bad = real & (node[None, :] > 0) & ((par < 0) | (par >= node[None, :]))
    if bad.any():
        b, i = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"request {b}: node {i} has parent {int(par[b, i])}, need 0 <= parent < {i}"
        )
    # Pointer jumping: ``jump[i]`` is i's ancestor 2^k levels up (the root,
    # and padding rows, point to themselves), ``dist[i]`` how many levels that
    # is, ``vis[i]`` i and its ancestors up to there.
    batch = np.arange(num_reqs)[:, None]
    jump = np.where(par >= 0, par, node[None, :])
    dist = (par >= 0).astype(np.int64)
    vis = np.zeros((num_reqs, rows, rows), dtype=bool)
    vis[:, node, node] = True
    vis[batch, node[None, :], jump] = True
    while True:
        up = jump[batch, jump]  # [R, N]
        if (up == jump).all():
            break
        vis |= vis[batch, jump]
        dist = dist + dist[batch, jump]
        jump = up
    dep = dist
    if num_reqs and int(dep.max()) > max_depth:
        b, i = map(int, np.argwhere(dep > max_depth)[0])
        raise ValueError(f"request {b}: node {i} is deeper than max_depth={max_depth}")
    sco = np.full((num_reqs, rows), -np.inf, dtype=np.float32)
    if scores is not None:
        sco[real] = np.fromiter(itertools.chain.from_iterable(scores), np.float64)
    else:
        sco[real] = 0.0
    sco[:, 0] = 0.0
    # Children in index order: sort each request's non-root nodes by
    # (parent, index); a node's next sibling follows it in that order.
    child = real & (node[None, :] > 0)
    key = np.where(child, par * rows + node[None, :], rows * rows + node[None, :])
    order = np.argsort(key, axis=1, kind="stable")  # [R, N]
    sorted_par = np.where(child[batch, order], par[batch, order], -1)
    first_child = np.full((num_reqs, rows), -1, dtype=np.int64)
    next_sibling = np.full((num_reqs, rows), -1, dtype=np.int64)
    same = (sorted_par[:, 1:] == sorted_par[:, :-1]) & (sorted_par[:, 1:] >= 0)
    b, k = np.nonzero(same)
    next_sibling[b, order[b, k]] = order[b, k + 1]
    starts = (sorted_par >= 0) & np.concatenate(
        [np.ones((num_reqs, 1), dtype=bool), ~same], axis=1
    )
    b, k = np.nonzero(starts)
    first_child[b, sorted_par[b, k]] = order[b, k]
    return _host_arrays_to_tree(
        tok, par, dep, sco, counts - 1, first_child, next_sibling, vis, max_depth, "cpu"
    )
