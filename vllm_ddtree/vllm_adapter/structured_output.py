# SPDX-License-Identifier: Apache-2.0
"""Structured outputs (grammar-constrained decoding) for ddtree's draft trees.

vLLM keeps grammars in the scheduler (``StructuredOutputManager``); the drafts
come from the worker. A structured request's tree is built in the scheduler,
with its grammar (:func:`grammar_draft_tree`, DDTree's best-first build over
the tokens the grammar allows, :mod:`vllm_ddtree.grammar_tree`), from the
drafter's per-depth top-K candidates the worker sends
(:class:`GrammarCandidates`): every node is reachable, forced tokens are free,
and the tree's structure goes back to the worker with the scheduled drafts
(:mod:`.draft_trees`). A structured request whose grammar does not constrain
its next token yet (reasoning not ended) keeps the worker's tree.

The verify bitmask (``StructuredOutputManager.grammar_bitmask``) has one row
per verify row of a request, each the grammar state after the node's *path*
(committed tokens + the node's ancestors), so that every node's distribution is
the one non-speculative constrained decoding would use there:
:func:`tree_grammar_bitmask` copies the rows the grammar-built tree already
holds, and walks any other tree depth first with the request's grammar
(:func:`fill_tree_bitmask`: accept a node's token on the way down, fill its
row, roll back on the way up; on a chain it fills exactly the rows vLLM's chain
walk fills, tested equal, including the reasoning bounds and padding).

Lossless whatever the tree: a node whose token its parent's grammar state
rejects is masked out in its parent's row, so the target gives it probability
0 and verification never accepts it; only committed tokens advance the grammar
(vLLM's own ``accept_tokens`` after the step), and both the build and the walk
leave the matcher where they found it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_ddtree.grammar_tree import GrammarCursor, build_grammar_tree
from vllm_ddtree.lookup_tree import LookupDraft
from vllm_ddtree.vllm_adapter.draft_trees import (
    DraftTreeRecord,
    chain_parents,
    record_of,
)
from vllm_ddtree.vllm_adapter.grammar_spans import (
    grammar_span_memory,
    jump_forward_string,
)

__all__ = [
    "GrammarCandidates",
    "TreeBitmaskStats",
    "bitmask_stats",
    "fill_tree_bitmask",
    "grammar_draft_tree",
    "tree_grammar_bitmask",
    "validate_draft_tree",
]

# The manager's running TreeBitmaskStats.
_STATS_ATTR = "ddtree_bitmask_stats"


@dataclass
class GrammarCandidates:
    """What the worker sends the scheduler to build a structured request's tree.

    The drafter's top-K tokens per drafted position, and how many nodes the
    tree may take: a grammar-built tree keeps its best-first prefix of at most
    ``max_nodes`` nodes whose calibrated value (``depth_factors[depth] * path
    probability``, made non-increasing along the node order) is at least
    ``min_value``, the auto budget's price of a node this step
    (:meth:`~vllm_ddtree.vllm_adapter.budget_control.BudgetController.choose`).
    """

    log_probs: list[list[float]]  # [L][K] descending, per depth
    token_ids: list[list[int]]  # [L][K] target token ids
    max_nodes: int
    min_value: float = 0.0
    depth_factors: list[float] | None = None  # [D + 1] index = depth


@dataclass
class TreeBitmaskStats:
    """Structured requests' draft trees in the scheduler.

    ``nodes``: scheduled draft nodes of constrained requests; ``unreachable``:
    those the grammar masks out of an ancestor's row (verified rows that can
    never be accepted); ``grammar_trees`` / ``grammar_nodes`` /
    ``build_seconds``: trees built with the grammar, their nodes and the host
    time of building them (on the scheduler's critical path, between steps);
    ``bitmask_seconds`` / ``bitmask_calls``: host time of the verify bitmasks
    (overlapped with the target's forward by vLLM's engine loop), and how many
    there were (one per step with a constrained request).
    """

    nodes: int = 0
    unreachable: int = 0
    grammar_trees: int = 0
    grammar_nodes: int = 0
    build_seconds: float = 0.0
    bitmask_seconds: float = 0.0
    bitmask_calls: int = 0


def bitmask_stats(manager: Any) -> TreeBitmaskStats:
    """The running :class:`TreeBitmaskStats` of a ``StructuredOutputManager``."""
    stats = getattr(manager, _STATS_ATTR, None)
    if stats is None:
        stats = TreeBitmaskStats()
        setattr(manager, _STATS_ATTR, stats)
    return stats


def grammar_draft_tree(
    manager: Any, request: Any, candidates: GrammarCandidates
) -> DraftTreeRecord | None:
    """``Scheduler.update_draft_token_ids``: a structured request's tree, built
    with its grammar (after this step's committed tokens) from the drafter's
    candidates; None when the grammar does not constrain the request's next
    token (not compiled, reasoning not ended): then the worker's tree stays.

    Past the drafter's L positions the tree continues where the grammar alone
    decides the tokens (forced runs, up to ``max_nodes`` deep): such a node
    costs one verify row and is accepted whenever its parent is, since the
    target, masked by the same grammar, can only sample the forced token. With
    no drafted position (a pass the auto budget skipped) the tree is the forced
    run alone, and the hint.

    The hint is what the target emitted the last time a request with this
    schema was in this grammar state (:mod:`.grammar_spans`): a lookup draft,
    merged with the drafter's candidates by the union trees' rule.
    """
    so_request = request.structured_output_request
    grammar = None if so_request is None else so_request.grammar
    if (
        grammar is None
        or request.is_prefill_chunk
        or manager._get_constraint_bounds(request, ()) != (0, 0)
    ):
        return None
    started = time.perf_counter()
    memory = grammar_span_memory(manager)
    jump = jump_forward_string(grammar)
    hint = memory.hint(request, jump)
    if not candidates.log_probs and jump == "":
        # A skipped drafter pass in a state where nothing is forced or hinted:
        # the tree is empty, known without filling a row.
        return _empty_record(request, candidates)
    cursor = GrammarCursor(grammar, manager.backend.vocab_size, request.request_id)
    tree = build_grammar_tree(
        _per_depth(candidates.log_probs, np.float64),
        _per_depth(candidates.token_ids, np.int64),
        candidates.max_nodes,
        request.all_token_ids[-1],
        cursor,
        max_depth=candidates.max_nodes,
        lookup=LookupDraft.chain(hint, memory.hint_probs) if hint else None,
    )
    probs = [math.exp(s) for s in tree.log_scores[1:]]
    depths = tree.depths[1:]
    n = _valued_prefix(probs, depths, candidates)
    values = None if candidates.depth_factors is None else (probs, depths)
    record = DraftTreeRecord(
        tokens=tree.tokens[1 : n + 1],
        parents=tree.parents[: n + 1],
        path_probs=probs[:n],
        grammar_shaped=True,
        grammar_rows=[None if r is None else r.bitmask_row for r in tree.rows[: n + 1]],
        num_tokens=request.num_tokens,
        grammar_values=values,
    )
    stats = bitmask_stats(manager)
    stats.grammar_trees += 1
    stats.grammar_nodes += n
    stats.build_seconds += time.perf_counter() - started
    return record


def _empty_record(request: Any, candidates: GrammarCandidates) -> DraftTreeRecord:
    return DraftTreeRecord(
        tokens=[],
        parents=[-1],
        path_probs=[],
        grammar_shaped=True,
        grammar_rows=None,
        num_tokens=request.num_tokens,
        grammar_values=None if candidates.depth_factors is None else ([], []),
    )


def _per_depth(values: list[list], dtype) -> np.ndarray:
    """[L, K] candidates as an array ([0, 0] without a drafted position)."""
    if not values:
        return np.zeros((0, 0), dtype=dtype)
    return np.asarray(values, dtype=dtype).reshape(len(values), -1)


def _valued_prefix(
    probs: list[float], depths: list[int], candidates: GrammarCandidates
) -> int:
    """Nodes of the best-first prefix (path probabilities ``probs``, depths
    ``depths``) whose calibrated value reaches ``candidates.min_value`` (all of
    them without a price)."""
    if candidates.min_value <= 0 or candidates.depth_factors is None:
        return len(probs)
    factors = candidates.depth_factors
    running = 1.0
    for i, (prob, depth) in enumerate(zip(probs, depths, strict=True)):
        running = min(running, factors[min(depth, len(factors) - 1)] * prob, 1.0)
        if running < candidates.min_value:
            return i
    return len(probs)


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
    started = time.perf_counter()
    if manager._grammar_bitmask is None:
        assert manager.backend is not None
        max_batch_size = manager.vllm_config.scheduler_config.max_num_seqs
        max_rows = max_batch_size * (1 + manager.vllm_config.num_speculative_tokens)
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(max_rows)
    row = 0
    for req_id in structured_output_request_ids:
        request = requests[req_id]
        tokens = scheduled_spec_decode_tokens.get(req_id, [])
        record = record_of(request)
        tree = None if record is None else record.scheduled(tokens)
        if (
            tree is not None
            and record.grammar_rows is not None
            and record.num_tokens == request.num_tokens
        ):
            row = _copy_grammar_rows(manager, record, tree.parents, row)
        else:
            parents = chain_parents(len(tokens)) if tree is None else tree.parents
            row = fill_tree_bitmask(manager, request, tokens, parents, row)
    bitmask = manager._grammar_bitmask
    if row < bitmask.shape[0]:
        bitmask = bitmask[:row]
    stats = bitmask_stats(manager)
    stats.bitmask_seconds += time.perf_counter() - started
    stats.bitmask_calls += 1
    return bitmask.numpy()


def _copy_grammar_rows(
    manager: Any, record: DraftTreeRecord, parents: list[int], first_row: int
) -> int:
    """The rows of a grammar-built tree's scheduled nodes, as its build filled
    them (a terminated state: the full mask, as vLLM fills it); returns the next
    free row. Counts any node its parent's row masks out (none, by
    construction: the count checks it)."""
    bitmask = manager._grammar_bitmask
    n = len(parents) - 1
    stats = bitmask_stats(manager)
    stats.nodes += n
    rows = record.grammar_rows
    for node in range(n + 1):
        target = bitmask[first_row + node]
        if rows[node] is None:
            target.fill_(manager._full_mask)
        else:
            target.copy_(torch.from_numpy(rows[node]))
        if node:
            token = record.tokens[node - 1]
            parent_row = rows[parents[node]]
            if parent_row is None or not (
                (int(parent_row[token >> 5]) >> (token & 31)) & 1
            ):
                stats.unreachable += 1
    return first_row + n + 1


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
