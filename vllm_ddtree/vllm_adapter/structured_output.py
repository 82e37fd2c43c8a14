# SPDX-License-Identifier: Apache-2.0
"""Structured outputs (grammar-constrained decoding) for ddtree's draft trees.

vLLM computes the grammar bitmask in the scheduler process
(``StructuredOutputManager.grammar_bitmask``): one row per verify row of a
request, which the worker applies to the target's logits before sampling. For a
chain of drafts row ``j`` is the grammar state after drafts ``1..j``; for a tree
it must be the state after the node's *path* (committed tokens + the node's
ancestors), so that every node's distribution is the one non-speculative
constrained decoding would use there. This module makes that so:

1. worker: :func:`attach_draft_parents` sends each request's tree structure
   (parents, node order) with its drafts (``DraftTokenIds.draft_parents``);
2. scheduler: :func:`store_draft_trees` keeps it beside the request's drafts, and
   :func:`validate_draft_tree` lets the tree through whole (vLLM's chain check
   would cut it at the first sibling);
3. scheduler: :func:`fill_tree_bitmask` walks the scheduled tree depth first with
   the request's grammar: accept a node's token on the way down, fill its row,
   roll back on the way up. On a chain it fills exactly the rows vLLM's chain
   walk fills (tested equal), including the reasoning bounds (evaluated per
   path) and padding.

Lossless: a node whose token its parent's grammar state rejects is masked out in
its parent's row, so the target gives it probability 0 and verification never
accepts it; only committed tokens advance the grammar (vLLM's own
``accept_tokens`` after the step), and the walk leaves the matcher where it found
it. Both processes pick the structure by the same rule (the scheduled drafts
must be a prefix of the stored tree, else they are a chain), so the worker
verifies exactly the tree the bitmask describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "TreeBitmaskStats",
    "attach_draft_parents",
    "bitmask_stats",
    "chain_parents",
    "draft_parents",
    "fill_tree_bitmask",
    "store_draft_trees",
    "tree_grammar_bitmask",
    "validate_draft_tree",
]

# The scheduler's copy of a request's last proposed tree: (node tokens, parents
# root first), an attribute of vLLM's Request.
_TREE_ATTR = "ddtree_draft_tree"
# The manager's running TreeBitmaskStats.
_STATS_ATTR = "ddtree_bitmask_stats"


@dataclass
class TreeBitmaskStats:
    """Scheduled draft nodes of constrained requests, and how many of them the
    grammar makes unreachable (masked out of an ancestor's row: verified rows
    that can never be accepted, the budget a grammar-aware pruning would free)."""

    nodes: int = 0
    unreachable: int = 0


def bitmask_stats(manager: Any) -> TreeBitmaskStats:
    """The running :class:`TreeBitmaskStats` of a ``StructuredOutputManager``."""
    stats = getattr(manager, _STATS_ATTR, None)
    if stats is None:
        stats = TreeBitmaskStats()
        setattr(manager, _STATS_ATTR, stats)
    return stats


def draft_parents(
    tree: tuple[list[int], list[int]] | None, scheduled: list[int]
) -> list[int] | None:
    """Parents (root first, ``[n + 1]``) of the ``n`` scheduled drafts when they
    are a prefix of the stored tree's node tokens, else ``None`` (they are then
    verified as a chain, :func:`chain_parents`).

    The one rule both processes use (the worker's ``TreeStash.parents_for`` and
    the scheduler's bitmask), so they always agree on the structure: vLLM may
    shorten the drafts (a prefix keeps the tree) or replace them (padding,
    preemption, blanking near ``max_model_len``: a chain).
    """
    n = len(scheduled)
    if tree is not None and len(tree[0]) >= n and tree[0][:n] == list(scheduled):
        return tree[1][: n + 1]
    return None


def chain_parents(n: int) -> list[int]:
    """Parents (root first) of ``n`` drafts verified as a chain."""
    return [-1] + list(range(n))


# --------------------------------------------------------------------------- #
# Worker
# --------------------------------------------------------------------------- #


def attach_draft_parents(draft_token_ids: Any, stash) -> Any:
    """Adds ``draft_parents`` (per request, root first) to a ``DraftTokenIds``
    from the worker's tree stash; returns it."""
    if draft_token_ids is not None:
        draft_token_ids.draft_parents = [
            draft_parents(stash.stored_tree(req_id), tokens) or chain_parents(len(tokens))
            for req_id, tokens in zip(
                draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
            )
        ]
    return draft_token_ids


# --------------------------------------------------------------------------- #
# Scheduler
# --------------------------------------------------------------------------- #


def store_draft_trees(requests: dict[str, Any], draft_token_ids: Any) -> None:
    """``Scheduler.update_draft_token_ids``: keeps each live request's proposed
    tree (tokens, ``draft_parents``) for its next grammar bitmask."""
    for req_id, tokens, parents in zip(
        draft_token_ids.req_ids,
        draft_token_ids.draft_token_ids,
        draft_token_ids.draft_parents,
        strict=True,
    ):
        request = requests.get(req_id)
        if request is not None:
            setattr(request, _TREE_ATTR, (list(tokens), list(parents)))


def validate_draft_tree(spec_tokens: list[int]) -> list[int]:
    """ddtree's ``validate_tokens`` for a structured request: the drafts minus
    ``-1`` padding, uncut.

    A tree in node order is not a chain, so vLLM's chain check would keep only
    the nodes before the first sibling. Invalid nodes need no cut to stay
    unaccepted: the bitmask masks them out of their parent's row.
    """
    from vllm.v1.structured_output.utils import strip_speculative_padding

    return strip_speculative_padding(spec_tokens)


def tree_grammar_bitmask(
    manager: Any,
    requests: dict[str, Any],
    structured_output_request_ids: list[str],
    scheduled_spec_decode_tokens: dict[str, list[int]],
):
    """ddtree's ``StructuredOutputManager.grammar_bitmask``: per request, one
    row per verify row (root, then the scheduled nodes in node order), each the
    grammar state after the node's path. Returns the int32 numpy bitmask (rows
    request after request, as vLLM's), or ``None`` without requests."""
    if not structured_output_request_ids:
        return None
    if manager._grammar_bitmask is None:
        assert manager.backend is not None
        max_batch_size = manager.vllm_config.scheduler_config.max_num_seqs
        max_rows = max_batch_size * (1 + manager.vllm_config.num_speculative_tokens)
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(max_rows)
    row = 0
    for req_id in structured_output_request_ids:
        request = requests[req_id]
        tokens = scheduled_spec_decode_tokens.get(req_id, [])
        tree = getattr(request, _TREE_ATTR, None)
        parents = draft_parents(tree, tokens) or chain_parents(len(tokens))
        row = fill_tree_bitmask(manager, request, tokens, parents, row)
    bitmask = manager._grammar_bitmask
    if row < bitmask.shape[0]:
        bitmask = bitmask[:row]
    return bitmask.numpy()


def fill_tree_bitmask(
    manager: Any,
    request: Any,
    tokens: list[int],
    parents: list[int],
    first_row: int,
) -> int:
    """Fills rows ``first_row .. first_row + n`` of ``manager._grammar_bitmask``
    for one request's ``n`` scheduled nodes; returns the next free row.

    Row ``v`` (``v = 0`` the root) is the grammar state after the path
    root..v, or the full mask where vLLM's chain walk would not constrain: the
    path holds ``-1`` padding, reasoning has not ended on it, or the grammar
    terminated. A node whose token the grammar cannot take (rejected, or after
    termination) copies its parent's row, and so do its descendants (vLLM's
    chain copies the last valid row after a failed draft); its subtree is not
    walked. The grammar is back in its starting state on return.

    Args:
        manager: the scheduler's ``StructuredOutputManager``.
        request: the vLLM ``Request`` (structured output, not a prefill chunk).
        tokens: [n] the scheduled draft tokens, node order (parents first).
        parents: [n + 1] parent of each node, root first (``parents[0] = -1``).
        first_row: the request's first bitmask row.
    """
    grammar = request.structured_output_request.grammar
    bitmask = manager._grammar_bitmask
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for node in range(1, n + 1):
        children[parents[node]].append(node)
    # Reasoning bounds per path: vLLM's chain function on the path's tokens.
    # Without a reasoner, or once reasoning ended, every path is constrained
    # from its start (the common case: no per-node calls).
    constrained_from_start = manager._get_constraint_bounds(request, ()) == (0, 0)

    def path_tokens(node: int) -> list[int]:
        path = []
        while node > 0:
            path.append(tokens[node - 1])
            node = parents[node]
        return path[::-1]

    def bounds(path: list[int]) -> tuple[int, int]:
        """(grammar_start, constraint_start) of the chain ``path``."""
        if constrained_from_start:
            return 0, 0
        grammar_start, constraint_start = manager._get_constraint_bounds(request, path)
        return grammar_start, constraint_start

    stats = bitmask_stats(manager)
    stats.nodes += sum(token != -1 for token in tokens)

    def copy_subtree(node: int, source_row: int) -> None:
        stack = [node]
        while stack:
            v = stack.pop()
            bitmask[first_row + v].copy_(bitmask[source_row])
            stats.unreachable += 1
            stack.extend(children[v])

    def masked_out(node: int, token: int) -> bool:
        # The token's bit in the node's row (token i: bit i % 32 of word i // 32).
        # Checked first so that a rejected draft never reaches accept_tokens,
        # whose rejections vLLM logs as errors.
        word = int(bitmask[first_row + node, token >> 5])
        return not (word >> (token & 31)) & 1

    # Depth first: the node, its path, whether the path has padding, and the
    # path's reasoning bounds.
    def walk(node: int, path: list[int], padded: bool, path_bounds) -> None:
        apply = not padded and len(path) >= path_bounds[1]
        manager._fill_bitmasks(((grammar, first_row + node, apply),))
        for child in children[node]:
            token = tokens[child - 1]
            child_path = path + [token]
            if padded or token == -1:
                walk(child, child_path, True, (0, 0))  # rows unconstrained
                continue
            child_bounds = bounds(child_path)
            if len(path) < child_bounds[0]:
                walk(child, child_path, False, child_bounds)  # grammar not started
                continue
            if (
                not grammar.is_terminated()
                and not masked_out(node, token)
                and grammar.accept_tokens(request.request_id, [token])
            ):
                walk(child, child_path, False, child_bounds)
                grammar.rollback(1)
            else:
                # The parent's row masks this token out: the subtree can never
                # be accepted; its rows repeat the parent's (as vLLM's chain).
                copy_subtree(child, first_row + node)

    walk(0, [], False, bounds([]))
    return first_row + n + 1
