# SPDX-License-Identifier: Apache-2.0
"""Draft trees from two sources: the drafter's distributions and a lookup tree.

A DFlash drafter gives one distribution ``q_d`` per depth ``d``; a lookup source
(SuffixDecoding's suffix tree, https://arxiv.org/abs/2411.04975; a prompt n-gram
match; the grammar span memory's hint) proposes token paths from the root, each
node with a probability given its parent's path (calibrated against what the
target accepted). One tree holds both, under one node budget ``B``: the top-B
prefixes under the score

    s(u) = sum_i log p(u_i | u_<i)

where, at a node ``v`` of depth ``d`` whose path lies on the lookup tree, with
lookup children ``c`` of probabilities ``a_c`` (``A = sum_c a_c <= 1``), the
children are the mixture

    p(t | v) = a_t + (1 - A) q_{d+1}(t)       (a_t = 0 for non-lookup t)

(the drafter's candidates share what the lookup leaves; a token both propose is
one node, with both shares), and off the lookup tree ``p(t | v) = q_{d+1}(t)``:
the drafter's tree of DDTree (https://arxiv.org/abs/2604.12989), exactly.
Lookup branches may run past the drafter's depth ``L`` (to ``max_depth``), where
only lookup children exist. Every ``p <= 1``, so scores never increase from a
node to its children, the top-B set is prefix-closed (DDTree, Prop. 2) and the
best-first heap of the DDTree reference builds it. Ties break as in
:mod:`vllm_ddtree.tree`: (-score, depth, parent position in its depth,
rank); lookup children rank first (by probability), then the drafter's by rank.

The tree only decides what is proposed: verification (greedy, and both
sampling rules of :mod:`vllm_ddtree.verify`) reads the target alone, so
any tree is lossless.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    # >>> lookup
    "FROM_DRAFTER",
    "FROM_LOOKUP",
    # <<< lookup
    "LookupDraft",
    # >>> lookup
    "UnionTree",
    "build_union_tree",
    # <<< lookup
    "drafter_share",
    "mixture_log_prob",
]
# >>> lookup

FROM_DRAFTER = 1  # a node the drafter's candidates proposed
FROM_LOOKUP = 2  # a node the lookup tree proposed (both: 3)
# <<< lookup


@dataclass
class LookupDraft:
    """A lookup source's tree for one request, rooted at the last committed
    token (not listed).

    ``parents[i]`` indexes ``tokens`` (-1: a child of the root) and precedes
    ``i``; ``probs[i]`` is the probability of ``tokens[i]`` given its parent's
    path, in (0, 1], and siblings' probabilities sum to at most 1."""

    tokens: Sequence[int]
    parents: Sequence[int]
    probs: Sequence[float]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or len(self.probs) != n:
            raise ValueError(
                "a lookup draft needs one parent and one probability per token, "
                f"got {n} tokens, {len(self.parents)} parents, "
                f"{len(self.probs)} probabilities"
            )
        mass: dict[int, float] = {}
        seen: set[tuple[int, int]] = set()
        for i, (parent, prob) in enumerate(zip(self.parents, self.probs, strict=True)):
            if not -1 <= parent < i:
                raise ValueError(
                    f"lookup node {i} has parent {parent}, need -1 <= parent < {i}"
                )
            if not 0.0 < prob <= 1.0:
                raise ValueError(
                    f"lookup node {i} has probability {prob}, need 0 < p <= 1"
                )
            if (parent, int(self.tokens[i])) in seen:
                raise ValueError(
                    f"lookup node {i} repeats token {self.tokens[i]} under parent "
                    f"{parent}"
                )
            seen.add((parent, int(self.tokens[i])))
            mass[parent] = mass.get(parent, 0.0) + prob
        over = {p: m for p, m in mass.items() if m > 1.0 + 1e-6}
        if over:
            raise ValueError(
                f"lookup children's probabilities sum past 1 under parents {over}"
            )

    @classmethod
    def chain(cls, tokens: Sequence[int], probs: Sequence[float]) -> LookupDraft:
        """A one-path draft: ``tokens[i]`` the child of ``tokens[i - 1]``, with
        probability ``probs[i]`` given the ones before."""
        tokens = [int(t) for t in tokens]
        return cls(tokens, list(range(-1, len(tokens) - 1)), list(probs[: len(tokens)]))

    def depths(self) -> np.ndarray:
        """[n] int64 each node's depth (a child of the root: 1)."""
        return np.asarray(self.depth_list(), dtype=np.int64)

    def depth_list(self) -> list[int]:
        """:meth:`depths` as a list."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def children(self) -> dict[int, list[int]]:
        """Lookup children of each lookup node (-1: the root), most probable
        first (index order on ties)."""
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents):
            kids.setdefault(int(parent), []).append(i)
        for nodes in kids.values():
            nodes.sort(key=lambda i: (-self.probs[i], i))
        return kids


def drafter_share(lookup_probs: Sequence[float]) -> float:
    """``log(1 - A)``: the log of what a node's lookup children (of
    probabilities ``lookup_probs``, summing to ``A``) leave to the drafter's
    candidates (-inf when nothing)."""
    taken = float(sum(lookup_probs))
    return math.log1p(-taken) if taken < 1.0 else -math.inf


def mixture_log_prob(lookup_prob: float, share: float, drafter_log_prob: float) -> float:
    """``log p(t | v) = log(a_t + (1 - A) q(t))``: a lookup child's score given
    its parent (``lookup_prob`` a_t; ``share`` :func:`drafter_share`;
    ``drafter_log_prob`` log q(t), -inf where the drafter does not propose t).
    The rule of every tree with lookup nodes (:func:`build_union_tree`, and the
    grammar-built trees' hints, :mod:`vllm_ddtree.grammar_tree`)."""
    prob = lookup_prob
    if drafter_log_prob > -math.inf and share > -math.inf:
        prob += math.exp(share + drafter_log_prob)
    return math.log(min(prob, 1.0))


# >>> lookup
@dataclass
class UnionTree:
    """One request's tree in best-first order (node 0 the root, parents before
    children)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    log_scores: list[float]
    # FROM_DRAFTER | FROM_LOOKUP per node (root 0).
    sources: list[int]
    # The lookup node each node is (-1: none; the root: -1 too).
    lookup_nodes: list[int] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        """Draft nodes (root excluded)."""
        return len(self.tokens) - 1


def build_union_tree(
    log_probs: np.ndarray,
    token_ids: np.ndarray,
    budget: int,
    root_token: int,
    lookup: LookupDraft | None = None,
    max_depth: int | None = None,
    lookup_drafter_log_probs: Sequence[float] | None = None,
) -> UnionTree:
    """The top-``budget`` tree over the drafter's candidates and a lookup tree.

    Args:
        log_probs: [L, K] the drafter's top-K log-probabilities per depth,
            descending (``tree.draft_top_k``); L = 0 for no drafter pass.
        token_ids: [L, K] their token ids.
        budget: draft nodes at most (root excluded).
        root_token: the last committed token (row 0).
        lookup: the lookup tree (None: the drafter's tree alone).
        max_depth: the deepest node (default L; lookup nodes only past L).
        lookup_drafter_log_probs: per lookup node, the drafter's log-probability
            of its token at its depth (-inf past L): the drafter's share of a
            token both propose, whether or not it is among the K candidates
            (default: read from the candidates, 0 outside them).

    Returns:
        The tree (see the module docstring for the score).
    """
    log_probs = np.asarray(log_probs, dtype=np.float64)
    token_ids = np.asarray(token_ids, dtype=np.int64)
    depth_limit = log_probs.shape[0] if log_probs.ndim == 2 else 0
    max_depth = depth_limit if max_depth is None else max(int(max_depth), 0)
    tree = UnionTree([int(root_token)], [-1], [0], [0.0], [0], [-1])
    if budget <= 0:
        return tree
    kids = lookup.children() if lookup is not None else {}
    # The drafter's candidates per depth: the same under every node.
    cand_tokens = [token_ids[d].tolist() for d in range(depth_limit)]
    cand_lps = [log_probs[d].tolist() for d in range(depth_limit)]
    cand_of = [
        dict(zip(t, v, strict=True)) for t, v in zip(cand_tokens, cand_lps, strict=True)
    ]
    on_lookup = [lookup is not None]  # the node's path lies on the lookup tree
    order_in_depth = [0]  # position of a node among the popped nodes of its depth
    popped_per_depth: dict[int, int] = {}
    # Per node: log of the drafter's share, the tokens its lookup children
    # took, and their count (the drafter's ranks come after them).
    shares: list[float] = []
    taken_tokens: list[set[int]] = []
    first_rank: list[int] = []
    heap: list[tuple] = []

    def push(
        node: int,
        lp: float,
        rank: int,
        token: int,
        source: int,
        lookup_node: int,
        r: int,
    ):
        score = tree.log_scores[node] + lp
        if score > -math.inf:
            heapq.heappush(
                heap,
                (-score, tree.depths[node] + 1, order_in_depth[node], rank, node,
                 token, source, lookup_node, r),
            )  # fmt: skip

    def push_drafter(node: int, r: int) -> None:
        """The node's drafter child of candidate rank ``r`` or the next one not
        taken by a lookup child: siblings are pushed one at a time, each when
        the one before it is added (they score in rank order)."""
        depth = tree.depths[node]
        tokens, taken = cand_tokens[depth], taken_tokens[node]
        while r < len(tokens) and tokens[r] in taken:
            r += 1
        if r < len(tokens):
            lp = shares[node] + cand_lps[depth][r]
            push(node, lp, first_rank[node] + r, tokens[r], FROM_DRAFTER, -1, r)

    def push_children(node: int) -> None:
        depth = tree.depths[node]
        lookup_kids = kids.get(tree.lookup_nodes[node], []) if on_lookup[node] else []
        share = drafter_share([lookup.probs[c] for c in lookup_kids])
        shares.append(share)
        taken_tokens.append({int(lookup.tokens[c]) for c in lookup_kids})
        first_rank.append(len(lookup_kids))
        if depth >= max_depth:
            return
        candidates = cand_of[depth] if depth < depth_limit else {}
        for rank, c in enumerate(lookup_kids):
            token = int(lookup.tokens[c])
            source = FROM_LOOKUP
            drafter_lp = (
                candidates.get(token, -math.inf)
                if lookup_drafter_log_probs is None
                else lookup_drafter_log_probs[c]
            )
            if token in candidates:
                source |= FROM_DRAFTER
            lp = mixture_log_prob(lookup.probs[c], share, drafter_lp)
            push(node, lp, rank, token, source, c, -1)
        if share > -math.inf and depth < depth_limit:
            push_drafter(node, 0)

    push_children(0)
    while heap and tree.num_nodes < budget:
        neg, depth, _, _, parent, token, source, lookup_node, r = heapq.heappop(heap)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.log_scores.append(-neg)
        tree.sources.append(source)
        tree.lookup_nodes.append(lookup_node)
        on_lookup.append(lookup_node >= 0)
        order_in_depth.append(popped_per_depth.get(depth, 0))
        popped_per_depth[depth] = order_in_depth[-1] + 1
        push_children(len(tree.tokens) - 1)
        if r >= 0:
            push_drafter(parent, r + 1)
    return tree
# <<< lookup
