# SPDX-License-Identifier: Apache-2.0
"""Grammar-guided DDTree construction: a structured request's draft tree.

A constrained request's tree is built from the drafter's per-depth top-K
candidates *and* its grammar: a node is only ever a token the grammar allows
after the node's path, and each node's children are scored with the drafter's
distribution at the child's depth renormalised over the tokens the grammar
allows there. A token the grammar forces (the only one it allows) has
probability 1 whatever the drafter says, so forced runs (keys, punctuation,
enum tails) cost the tree nothing, and, with ``max_depth`` beyond the drafter's
depth L, extend it where the grammar alone decides the tokens.

Scores are non-increasing from a node to its children (log-probabilities are
<= 0), so the best-first heap of the DDTree reference builds the exact top-B
prefix-closed tree of this grammar-shaped score (DDTree,
https://arxiv.org/abs/2604.12989, Prop. 2). Ties break as in the
drafter's tree builder (:mod:`vllm_ddtree.tree`): (-score, depth, parent
position in its depth, rank).

A lookup draft (:class:`~vllm_ddtree.lookup_tree.LookupDraft`; here the
grammar span memory's hint, what the target emitted the last time its grammar
was in this state, :mod:`vllm_ddtree.vllm_adapter.grammar_spans`) is merged
as in the union trees of :mod:`vllm_ddtree.lookup_tree`, by the same rule
(:func:`~vllm_ddtree.lookup_tree.mixture_log_prob`): at a node on the
lookup tree, its lookup children the grammar allows take their
probabilities ``a_t`` and the drafter's allowed candidates share the rest,
``p(t) = a_t + (1 - A) q'(t)`` with ``q'`` the drafter's distribution
renormalised over the allowed candidates. Like forced runs, lookup paths
continue past the drafter's depth.

Lossless whatever the tree: verification masks the target with the same
grammar, so the tree only decides what is *proposed*.

The grammar is reached through three calls (vLLM's
``StructuredOutputGrammar`` has them; :class:`GrammarCursor` adapts it):
``allowed(path) -> (mask, forced)`` for the state after ``path`` (the
committed tokens are already accepted), where ``mask`` answers whether a token
is allowed and ``forced`` is the only allowed token or None; and ``None`` when
the state is terminated (no child at all).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.lookup_tree import LookupDraft, drafter_share, mixture_log_prob

__all__ = [
    "GrammarCursor",
    "GrammarTree",
    "NodeGrammar",
    "build_grammar_tree",
]


@dataclass
class NodeGrammar:
    """The grammar at one node: which tokens it allows next."""

    bitmask_row: np.ndarray  # [ceil(V / 32)] int32, xgrammar's packed row
    forced: int | None  # the only allowed token, or None

    def allows(self, tokens: np.ndarray) -> np.ndarray:
        """[n] bool for token ids ``tokens`` ([n] int64)."""
        words = self.bitmask_row.view(np.uint32)[tokens >> 5]
        return ((words >> (tokens & 31).astype(np.uint32)) & 1).astype(bool)


@dataclass
class GrammarTree:
    """A request's grammar-guided tree, root first (node 0 = the last
    committed token, never re-accepted)."""

    tokens: list[int]  # [n + 1], root first
    parents: list[int]  # [n + 1], -1 for the root
    log_scores: list[float]  # [n + 1] path log-probability (renormalised)
    rows: list[NodeGrammar]  # [n + 1] the grammar after each node's path
    depths: list[int]  # [n + 1] 0 for the root

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1


class GrammarCursor:
    """The grammar state after a path, through vLLM's ``StructuredOutputGrammar``
    (``accept_tokens``, ``rollback``, ``fill_bitmask``, ``is_terminated``): the
    path is accepted, the row filled, and the state rolled back, so the matcher
    ends where it started.

    Args:
        grammar: the request's ``StructuredOutputGrammar`` (its committed
            tokens accepted).
        vocab_size: the grammar's vocabulary size (bitmask width).
        request_id: passed to ``accept_tokens`` (vLLM logs with it).
    """

    def __init__(self, grammar, vocab_size: int, request_id: str = "") -> None:
        self.grammar = grammar
        self.request_id = request_id
        # [1, ceil(V / 32)] the row the grammar fills, reused by every node.
        self._row = torch.empty((1, (vocab_size + 31) // 32), dtype=torch.int32)

    def __call__(self, path: Sequence[int]) -> NodeGrammar | None:
        grammar = self.grammar
        accepted = 0
        try:
            for token in path:
                if not grammar.accept_tokens(self.request_id, [int(token)]):
                    return None  # cannot happen for a path the builder made
                accepted += 1
            if grammar.is_terminated():
                return None
            self._row.fill_(-1)
            grammar.fill_bitmask(self._row, 0)
            bits = self._row[0].numpy().copy()
        finally:
            if accepted:
                grammar.rollback(accepted)
        return NodeGrammar(bits, _only_token(bits))


def _only_token(row: np.ndarray) -> int | None:
    """The single set bit of a packed row, or None if there are 0 or >= 2."""
    words = row.view(np.uint32)
    nonzero = np.flatnonzero(words)
    if nonzero.size != 1:
        return None
    word = int(words[nonzero[0]])
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def build_grammar_tree(
    log_probs: np.ndarray,
    token_ids: np.ndarray,
    budget: int,
    root_token: int,
    grammar_at: Callable[[Sequence[int]], NodeGrammar | None],
    max_depth: int | None = None,
    lookup: LookupDraft | None = None,
) -> GrammarTree:
    """The top-``budget`` grammar-guided tree of one request.

    Args:
        log_probs: [L, K] the drafter's top-K log-probabilities per depth,
            descending (``tree.draft_top_k``).
        token_ids: [L, K] their token ids.
        budget: draft nodes at most (root excluded).
        root_token: the last committed token (row 0).
        grammar_at: the grammar after a path of draft tokens (root excluded),
            or None when it is terminated there (:class:`GrammarCursor`).
        max_depth: the deepest node; beyond the drafter's L only tokens the
            grammar forces, and the lookup's, are added (default L: none
            beyond it).
        lookup: a lookup draft from the root (e.g. the grammar span memory's
            hint), proposed as far as the grammar allows.

    Returns:
        The tree, in best-first order (parents before children), with each
        node's grammar row.
    """
    log_probs = np.asarray(log_probs, dtype=np.float64)
    token_ids = np.asarray(token_ids, dtype=np.int64)
    depth_limit = log_probs.shape[0]
    max_depth = depth_limit if max_depth is None else max(max_depth, 0)
    root_row = grammar_at(())
    tree = GrammarTree([int(root_token)], [-1], [0.0], [root_row], [0])
    if budget <= 0 or root_row is None:
        return tree
    kids = lookup.children() if lookup is not None else {}
    paths: list[tuple[int, ...]] = [()]
    # The lookup node each tree node is (-1: none; the root: -1 too), and
    # whether its path lies on the lookup tree.
    lookup_nodes = [-1]
    on_lookup = [lookup is not None]
    order_in_depth = [0]  # position of a node among popped nodes of its depth
    popped_per_depth: dict[int, int] = {}
    heap: list[tuple] = []

    def push_children(node: int) -> None:
        row = tree.rows[node]
        depth = tree.depths[node]
        if row is None or depth >= max_depth:
            return
        lookup_kids = kids.get(lookup_nodes[node], []) if on_lookup[node] else []
        if lookup_kids:
            kid_tokens = np.array([int(lookup.tokens[c]) for c in lookup_kids])
            allowed = row.allows(kid_tokens)
            lookup_kids = [c for c, ok in zip(lookup_kids, allowed, strict=True) if ok]
        children: list[tuple[int, float, int]] = []  # (token, log p, lookup node)
        if row.forced is not None:
            same = [c for c in lookup_kids if int(lookup.tokens[c]) == row.forced]
            children = [(row.forced, 0.0, same[0] if same else -1)]
        else:
            share = drafter_share([lookup.probs[c] for c in lookup_kids])
            drafted: dict[int, float] = {}  # allowed candidate -> log q'(t)
            if depth < depth_limit:
                cand = token_ids[depth]
                ok = row.allows(cand)
                lp = log_probs[depth][ok]
                if lp.size:
                    norm = float(np.logaddexp.reduce(lp))
                    drafted = {
                        int(t): float(v) - norm
                        for t, v in zip(cand[ok], lp, strict=True)
                    }
            for c in lookup_kids:
                token = int(lookup.tokens[c])
                lp_c = mixture_log_prob(
                    lookup.probs[c], share, drafted.pop(token, -math.inf)
                )
                children.append((token, lp_c, c))
            if share > -math.inf:
                # Best first: a child ranked below the nodes still to add can
                # never be added (each better sibling takes one first).
                room = max(budget - tree.num_nodes - len(children), 0)
                drafted_best = list(drafted.items())[:room]
                children += [(t, share + v, -1) for t, v in drafted_best]
            if not children:
                return
        base = tree.log_scores[node]
        for rank, (token, lp, lookup_node) in enumerate(children):
            score = base + lp
            if score == -math.inf:
                continue
            heapq.heappush(
                heap,
                (-score, depth + 1, order_in_depth[node], rank, node, token,
                 lookup_node),
            )  # fmt: skip

    push_children(0)
    while heap and tree.num_nodes < budget:
        neg, depth, _, _, parent, token, lookup_node = heapq.heappop(heap)
        path = paths[parent] + (token,)
        node = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.log_scores.append(-neg)
        tree.rows.append(grammar_at(path))
        paths.append(path)
        tree.depths.append(depth)
        lookup_nodes.append(lookup_node)
        on_lookup.append(lookup_node >= 0)
        order_in_depth.append(popped_per_depth.get(depth, 0))
        popped_per_depth[depth] = order_in_depth[-1] + 1
        push_children(node)
    return tree
