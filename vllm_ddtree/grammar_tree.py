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

A *hint* (a token path from the root, e.g. what the target emitted the last
time its grammar was in this state,
:mod:`vllm_ddtree.vllm_adapter.grammar_spans`) is proposed next to the
drafter's candidates: while a node lies on the hint, its hint child (the
hint's i-th token) takes probability ``hint_probs[i]`` and the drafter's
allowed candidates share the rest. Like forced runs, a hint continues past the
drafter's depth.

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
    hint: Sequence[int] = (),
    hint_probs: Sequence[float] = (),
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
            grammar forces, and the hint's, are added (default L: none beyond
            it).
        hint: token path from the root, proposed as far as the grammar allows.
        hint_probs: the probability of each hint token given the ones
            before it, in (0, 1), one per hint token.

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
    hint = [int(t) for t in hint]
    if len(hint_probs) < len(hint) or not all(0 < p < 1 for p in hint_probs):
        raise ValueError(
            "need one hint_probs entry in (0, 1) per hint token, got "
            f"{list(hint_probs)} for {len(hint)} tokens"
        )
    hint_lp = [math.log(p) for p in hint_probs]
    rest_lp = [math.log1p(-p) for p in hint_probs]
    paths: list[tuple[int, ...]] = [()]
    on_hint = [bool(hint)]  # the node's path is a prefix of the hint
    order_in_depth = [0]  # position of a node among popped nodes of its depth
    popped_per_depth: dict[int, int] = {}
    heap: list[tuple[float, int, int, int, int, int]] = []

    def push_children(node: int) -> None:
        row = tree.rows[node]
        depth = tree.depths[node]
        if row is None or depth >= max_depth:
            return
        hinted = None
        if on_hint[node] and depth < len(hint):
            hinted = hint[depth]
            if not row.allows(np.array([hinted]))[0]:
                hinted = None
        if row.forced is not None:
            children = [(row.forced, 0.0)]
        else:
            children = [] if hinted is None else [(hinted, hint_lp[depth])]
            shared = 0.0 if hinted is None else rest_lp[depth]
            if depth < depth_limit:
                cand = token_ids[depth]
                ok = row.allows(cand)
                if hinted is not None:
                    ok &= cand != hinted
                lp = log_probs[depth][ok]
                if lp.size:
                    norm = float(np.logaddexp.reduce(lp)) - shared
                    # Best first: a child ranked below the nodes still to add
                    # can never be added (each better sibling takes one first).
                    room = budget - tree.num_nodes - len(children)
                    children += [
                        (int(t), float(v) - norm)
                        for t, v in zip(cand[ok][:room], lp[:room], strict=True)
                    ]
            if not children:
                return
        base = tree.log_scores[node]
        for rank, (token, lp) in enumerate(children):
            score = base + lp
            if score == -math.inf:
                continue
            heapq.heappush(
                heap, (-score, depth + 1, order_in_depth[node], rank, node, token)
            )

    push_children(0)
    while heap and tree.num_nodes < budget:
        neg, depth, _, _, parent, token = heapq.heappop(heap)
        path = paths[parent] + (token,)
        node = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.log_scores.append(-neg)
        tree.rows.append(grammar_at(path))
        paths.append(path)
        tree.depths.append(depth)
        on_hint.append(
            on_hint[parent] and depth <= len(hint) and hint[depth - 1] == token
        )
        order_in_depth.append(popped_per_depth.get(depth, 0))
        popped_per_depth[depth] = order_in_depth[-1] + 1
        push_children(node)
    return tree
