# SPDX-License-Identifier: Apache-2.0
"""Lookup drafts in a ddtree step (worker): union trees, and what they taught.

Each step, after the target's verification (``DDTreeVerifier.before_propose``):

1. :meth:`BatchLookup.observe` reads what the target did with last step's
   verified lookup nodes (from the tokens it committed: a node is *reached*
   when its parent was accepted), for the counters and the auto budget;
2. :meth:`BatchLookup.propose` reads the newly committed tokens against every
   lookup tree built in the last steps, verified or not, into the lookup
   calibration (hindsight, see :class:`Hindsight`), then asks the lookup
   source (:mod:`.lookup`) for each request's lookup tree, after its new
   tokens;
3. with a drafter pass, :meth:`BatchLookup.union_trees` replaces the drafter's
   tree of each request that has a lookup tree by the union tree
   (:func:`~vllm_ddtree.lookup_tree.build_union_tree`, the drafter's
   top-K per depth and the calibrated lookup tree, under one node budget);
   without one (the auto budget skipped the drafter),
   :meth:`BatchLookup.lookup_only_trees` gives lookup trees alone.

Trees are built on the host (lookup sources live there) in node order
(parents first, best first), so the auto budget's prefix choice and the
scheduler's round trip are the drafter's: union trees leave as one
:class:`~vllm_ddtree.tree.DraftTree`
beside the drafter's, lookup-only trees go to the scheduler as the host lists
they are. The verifier keeps, per request, which nodes of the tree it proposed
were lookup nodes (``pending``), to read their fate a step later. Lossless
whatever the lookup proposes: verification reads the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.lookup_calibration import LookupCalibration
from vllm_ddtree.lookup_tree import (
    FROM_DRAFTER,
    FROM_LOOKUP,
    LookupDraft,
    UnionTree,
    build_union_tree,
)
from vllm_ddtree.tree import DraftTree, tree_from_parents_host
from vllm_ddtree.vllm_adapter.step import max_depth, tree_to_device

__all__ = ["BatchLookup", "PendingLookupNodes"]


@dataclass
class PendingLookupNodes:
    """The lookup nodes of the tree proposed for a request (node order)."""

    tokens: list[int]  # [n] every node's token (root excluded)
    sources: list[int]  # [n] FROM_DRAFTER | FROM_LOOKUP of every node
    nodes: list[int]  # tree nodes (1..n) that are lookup nodes
    path_probs: list[float]  # [n] every node's path probability (the tree's)
    node_depths: list[int]  # [n] every node's depth


@dataclass
class Hindsight:
    """A lookup tree built for a request, read against the tokens the request
    commits next, whether or not its nodes were verified.

    A lookup node is a deterministic proposal, so the probability that the
    target accepts it once its parent is accepted is the probability that the
    target emits its token there (greedy: that the token is the argmax;
    sampled: the chance of a draft that is a point mass, under lossless
    verification), and the request's committed tokens are that emission,
    whatever was verified. Calibrating on verified nodes alone was biased:
    the auto budget verifies the nodes it values most, so the buckets of the
    low-valued nodes (deep nodes of long chains: path probabilities of a few
    percent) kept their source's raw score (measured: nodes valued under 0.05
    were accepted 47% of the time) and were never verified to learn
    otherwise."""

    children: list[list[int]]  # [n + 1] per slot (0: root, i + 1: node i)
    tokens: list[int]  # [n]
    depths: list[int]  # [n]
    raw: list[float]  # [n] the source's probabilities
    agreed: list[bool]  # [n] the drafter proposed the same token there
    at: int = 0  # slot of the deepest node on the committed path so far

    def read(self, committed: list[int], out: tuple[list, list, list, list]) -> bool:
        """Appends the nodes ``committed`` (the request's next tokens)
        decides to ``out`` (depths, raw, agreed, accepted); False once the
        whole tree is decided."""
        for token in committed:
            children = self.children[self.at]
            if not children:
                return False
            nxt = 0
            for i in children:
                out[0].append(self.depths[i])
                out[1].append(self.raw[i])
                out[2].append(self.agreed[i])
                hit = self.tokens[i] == token
                out[3].append(hit)
                if hit:
                    nxt = i + 1
            if not nxt:
                return False
            self.at = nxt
        return bool(self.children[self.at])


class BatchLookup:
    """A ddtree worker's lookup source, its calibration and pending nodes.

    Args:
        source: a lookup source (:func:`~vllm_ddtree.vllm_adapter.lookup.
            make_lookup`).
        budget: the node budget B (the union tree's nodes and depth at most).
    """

    def __init__(self, source, budget: int):
        self.source = source
        self.budget = budget
        self.calibration = LookupCalibration(max_depth=max(budget, 1))
        # This step's lookup trees, raw, per batch row (None: none).
        self.drafts: list[LookupDraft | None] = []
        # Per batch row, its last committed token (the trees' root; 0: none).
        self.last_tokens: list[int] = []
        # req_id -> lookup nodes of the tree last proposed for it.
        self.pending: dict[str, PendingLookupNodes] = {}
        # req_id -> its lookup trees built in the last steps, not yet
        # decided by the tokens it committed since (:class:`Hindsight`).
        self.watched: dict[str, list[Hindsight]] = {}
        # This step's batch rows' request ids (:meth:`propose`).
        self._req_ids: list[str] = []
        # Counters (host): lookup nodes proposed, reached and accepted; the
        # accepted nodes of union trees by source (drafter only, lookup only,
        # both).
        self.num_proposed = 0
        self.num_reached = 0
        self.num_accepted = 0
        self.accepted_by_source = {"drafter": 0, "lookup": 0, "both": 0}
        # req_id -> (lookup-only trees in a row the auto budget verified no
        # node of, steps left before its next lookup tree). Such a request
        # backs off: its trees are built after 1, 3, 7, ... skipped steps (at
        # most ``max_backoff``), so where lookup does not pay (T = 1, text that
        # does not repeat) a step does not pay the host work of building,
        # valuing and dropping a tree per request. Lookup stays lossless
        # either way: it changes what is proposed, never what is accepted.
        self._backoff: dict[str, tuple[int, int]] = {}
        self.max_backoff = 15
        # The last observe's verified trees that held lookup nodes: their
        # verified nodes' path probabilities and depths, and their accepted
        # paths' lengths (what the auto budget calibrates such trees by).
        self.verified_trees: tuple[list[list[float]], list[list[int]], list[int]]
        self.verified_trees = ([], [], [])

    # ------------------------------------------------------------------ #
    # After verification
    # ------------------------------------------------------------------ #

    def union_rows(
        self, req_ids: list[str], step_parents, step_tokens, num_drafts
    ) -> list[bool]:
        """Per batch row: whether its verified tree was a union tree this
        worker proposed (its scheduled drafts are a prefix of that tree)."""
        rows = []
        for b, req_id in enumerate(req_ids):
            pending = self.pending.get(req_id)
            n = num_drafts[b]
            rows.append(
                pending is not None
                and n > 0
                and pending.tokens[:n] == list(step_tokens[b][1 : n + 1])
                and any(node <= n for node in pending.nodes)
            )
        return rows

    def observe(
        self,
        req_ids: list[str],
        step_parents: list[list[int]],
        step_tokens: list[list[int]],
        num_drafts: list[int],
        committed: list[list[int]],
    ) -> None:
        """Counts what the target did with the verified lookup nodes (the
        calibration reads every built tree in :meth:`propose`):
        ``committed[b]`` is what request ``b`` committed this step (its
        accepted path, then the bonus token); siblings' tokens differ, so the
        accepted path is found by its tokens. Sets :attr:`verified_trees`."""
        union = self.union_rows(req_ids, step_parents, step_tokens, num_drafts)
        tree_probs, tree_depths, tree_accepted = [], [], []
        for b, req_id in enumerate(req_ids):
            if not union[b] or not committed[b]:
                continue
            pending = self.pending[req_id]
            parents, tokens, n = step_parents[b], step_tokens[b], num_drafts[b]
            on_path = {0}
            node = 0
            for token in committed[b][:-1]:
                child = next(
                    (
                        i
                        for i in range(1, n + 1)
                        if parents[i] == node and tokens[i] == token
                    ),
                    None,
                )
                if child is None:
                    break
                on_path.add(child)
                node = child
                source = pending.sources[child - 1]
                key = (
                    "both"
                    if source == FROM_DRAFTER | FROM_LOOKUP
                    else "lookup" if source == FROM_LOOKUP else "drafter"
                )
                self.accepted_by_source[key] += 1
            for node_i in pending.nodes:
                if node_i <= n and parents[node_i] in on_path:  # reached
                    self.num_reached += 1
                    self.num_accepted += node_i in on_path
            tree_probs.append(pending.path_probs[:n])
            tree_depths.append(pending.node_depths[:n])
            tree_accepted.append(len(on_path) - 1)
        # (The calibration reads every built tree, verified or not, in
        # :meth:`propose`.)
        self.verified_trees = (tree_probs, tree_depths, tree_accepted)

    def propose(self, input_batch, committed: list[list[int]]) -> None:
        """This step's lookup trees (:attr:`drafts`), after each request's
        newly ``committed`` tokens (before vLLM's bookkeeping); none for
        requests backing off (the source still reads their tokens). First the
        calibration reads those tokens against the trees built before."""
        self._req_ids = list(input_batch.req_ids[: len(committed)])
        self._read_hindsight(self._req_ids, committed)
        resting = set()
        for b, req_id in enumerate(input_batch.req_ids[: len(committed)]):
            misses, wait = self._backoff.get(req_id, (0, 0))
            if wait > 0:
                resting.add(b)
                self._backoff[req_id] = (misses, wait - 1)
        self.drafts = self.source.propose(input_batch, committed, skip=resting)
        self.last_tokens = [tokens[-1] if tokens else 0 for tokens in committed]
        # This step's trees replace theirs (requests out of the batch keep
        # theirs: the scheduler may still schedule those drafts).
        for req_id in input_batch.req_ids[: len(committed)]:
            self.pending.pop(req_id, None)

    def _read_hindsight(self, req_ids: list[str], committed: list[list[int]]) -> None:
        """The calibration's evidence: each request's watched trees read
        against its newly committed tokens (trees of requests that left the
        batch are dropped)."""
        watched = self.watched
        if not watched:
            return
        out: tuple[list, list, list, list] = ([], [], [], [])
        for req_id, tokens in zip(req_ids, committed, strict=True):
            trees = watched.get(req_id)
            if trees and tokens:
                trees[:] = [t for t in trees if t.read(tokens, out)]
        current = set(req_ids)
        for req_id in [r for r in watched if r not in current]:
            del watched[req_id]
        if out[0]:
            self.calibration.observe(*out)

    def _watch(self, row: int, draft: LookupDraft, depths, agreed) -> None:
        """Reads ``draft`` (built for batch row ``row`` this step) against
        the tokens its request commits next."""
        children: list[list[int]] = [[] for _ in range(len(draft.tokens) + 1)]
        for i, parent in enumerate(draft.parents):
            children[parent + 1].append(i)
        trees = self.watched.setdefault(self._req_ids[row], [])
        # At least one token is committed per step, so a tree is decided
        # within its depth in steps: more are left over from a request that
        # committed nothing (a discarded row), the oldest first.
        if len(trees) >= 2 * self.budget:
            del trees[0]
        trees.append(
            Hindsight(children, list(draft.tokens), list(depths),
                      [float(p) for p in draft.probs], list(agreed))
        )  # fmt: skip

    def rows(self, excluded: list[int] = ()) -> list[int]:
        """Batch rows with a lookup tree this step, but ``excluded``."""
        skip = set(excluded)
        return [b for b, d in enumerate(self.drafts) if d is not None and b not in skip]

    # ------------------------------------------------------------------ #
    # Trees
    # ------------------------------------------------------------------ #

    def _union_tree(
        self,
        row: int,
        root: int,
        log_probs: np.ndarray,
        token_ids: np.ndarray,
        watch: bool = True,
    ) -> UnionTree:
        """Batch row ``row``'s union tree; ``log_probs``/``token_ids`` [L, K]
        (L = 0 without a drafter pass). ``watch``: its lookup tree is read
        against the request's next tokens (once per row and step)."""
        draft = self.drafts[row]
        depths = draft.depth_list()
        num_depths = log_probs.shape[0]
        candidates = [set(token_ids[d].tolist()) for d in range(num_depths)]
        agreed = [
            bool(d <= num_depths and int(t) in candidates[d - 1])
            for t, d in zip(draft.tokens, depths, strict=True)
        ]
        calibrated = self.calibration.calibrate(draft, agreed)
        if watch:
            self._watch(row, draft, depths, agreed)
        return build_union_tree(
            log_probs,
            token_ids,
            self.budget,
            root,
            lookup=calibrated,
            max_depth=self.budget,
        )

    def _remember(self, req_id: str, tree: UnionTree) -> None:
        """The lookup nodes of ``tree``, proposed for ``req_id`` this step
        (read a step later by :meth:`observe`)."""
        nodes = [i for i in range(1, len(tree.tokens)) if tree.lookup_nodes[i] >= 0]
        self.pending[req_id] = PendingLookupNodes(
            tokens=tree.tokens[1:],
            sources=tree.sources[1:],
            nodes=nodes,
            path_probs=np.exp(tree.log_scores[1:]).tolist(),
            node_depths=tree.depths[1:],
        )
        self.num_proposed += len(nodes)

    def union_trees(
        self,
        req_ids: list[str],
        tree: DraftTree,
        candidates: tuple[list[int], torch.Tensor, torch.Tensor] | None,
    ) -> tuple[DraftTree, list[int]]:
        """The drafter's trees with each lookup row's replaced by its union
        tree. ``candidates``: the drafter's top-K (log-probs, target ids) per
        depth of the lookup rows (``DDTreeProposer.last_lookup_candidates``).

        Returns:
            The batch's trees (device of ``tree``) and the rows replaced.
        """
        if candidates is None:
            return tree, []
        rows, log_probs, token_ids = candidates
        # One device -> host copy of what the host builds from, as one float64
        # vector (exact for token ids < 2**53 and float32 scores).
        parts = (tree.tokens, tree.parents, tree.scores, tree.num_nodes,
                 log_probs, token_ids)  # fmt: skip
        flat = torch.cat([x.double().reshape(-1) for x in parts]).cpu().numpy()
        host, start = [], 0
        for x in parts:
            host.append(flat[start : start + x.numel()].reshape(x.shape))
            start += x.numel()
        tokens, parents, scores, counts, log_probs, token_ids = host
        tokens, parents, counts = (
            tokens.astype(np.int64), parents.astype(np.int64), counts.astype(np.int64)
        )
        token_ids = token_ids.astype(np.int64)
        lists = _rows_of(tokens, parents, scores, counts)
        for i, b in enumerate(rows):
            union = self._union_tree(b, int(tokens[b, 0]), log_probs[i], token_ids[i])
            lists[b] = (union.tokens, union.parents, union.log_scores)
            self._remember(req_ids[b], union)
        return _to_tree(lists, tree.tokens.device), rows

    def lookup_only_unions(
        self, rows: list[int], watch: bool = True
    ) -> list[UnionTree | None]:
        """Per batch row, its tree of lookup nodes alone (no drafter pass this
        step), rooted at its last committed token, or None: rows not in
        ``rows``. ``watch=False``: a yardstick beside union trees built for
        the same rows (which are the ones read against the next tokens)."""
        empty = np.zeros((0, 1))
        unions: list[UnionTree | None] = [None for _ in self.last_tokens]
        for b in rows:
            unions[b] = self._union_tree(
                b, self.last_tokens[b], empty, empty.astype(np.int64), watch
            )
        return unions

    def lookup_only_trees(
        self,
        req_ids: list[str],
        unions: list[UnionTree | None],
        num_nodes: list[int],
    ) -> list[tuple[list[int], list[int], list[float]]] | None:
        """The batch's trees to verify, on the host (what the scheduler gets:
        no device tree is built): each row's lookup-only tree
        (:meth:`lookup_only_unions`) cut to its first ``num_nodes[b]`` nodes
        (a prefix: parents come first) as (tokens, parents, log path
        probabilities), root first, its lookup nodes remembered to be read a
        step later; None when no row keeps a node."""
        if not any(num_nodes):
            return None
        lists = []
        for b, (union, n) in enumerate(zip(unions, num_nodes, strict=True)):
            if union is None or n == 0:
                lists.append(([self.last_tokens[b]], [-1], [0.0]))
                continue
            union = _prefix(union, n)
            lists.append((union.tokens, union.parents, union.log_scores))
            self._remember(req_ids[b], union)
        return lists

    def forget(self, req_ids: list[str]) -> None:
        """Proposed trees that will not be verified (none sent)."""
        for req_id in req_ids:
            self.pending.pop(req_id, None)
            self._backoff.pop(req_id, None)

    def note_lookup_only_choice(
        self, req_ids: list[str], rows: list[int], num_nodes: list[int]
    ) -> None:
        """How many nodes the auto budget kept of each lookup-only tree (batch
        ``rows``): a request whose trees keep none backs off, one whose tree
        is kept starts over."""
        for b in rows:
            req_id = req_ids[b]
            if num_nodes[b]:
                self._backoff.pop(req_id, None)
                continue
            misses = self._backoff.get(req_id, (0, 0))[0] + 1
            self._backoff[req_id] = (misses, min((1 << misses) - 1, self.max_backoff))
        if len(self._backoff) > 4 * max(len(req_ids), 64):
            current = set(req_ids)
            self._backoff = {k: v for k, v in self._backoff.items() if k in current}

    def stats(self) -> str:
        rate = self.num_accepted / max(self.num_reached, 1)
        by_source = ", ".join(f"{k} {v}" for k, v in self.accepted_by_source.items())
        return (
            f"lookup nodes proposed {self.num_proposed}, reached {self.num_reached}, "
            f"accepted {self.num_accepted} ({rate:.2f} of reached); accepted nodes "
            f"of trees with lookup nodes by source: {by_source}"
        )


def _prefix(tree: UnionTree, num_nodes: int) -> UnionTree:
    """The first ``num_nodes`` nodes of ``tree`` (and its root): a tree, as
    parents come before their children."""
    end = num_nodes + 1
    return UnionTree(
        tokens=tree.tokens[:end],
        parents=tree.parents[:end],
        depths=tree.depths[:end],
        log_scores=tree.log_scores[:end],
        sources=tree.sources[:end],
        lookup_nodes=tree.lookup_nodes[:end],
    )


def _rows_of(tokens, parents, scores, counts):
    """Per row (tokens, parents, scores) of a host tree's real nodes."""
    return [
        (
            tokens[b, : n + 1].tolist(),
            parents[b, : n + 1].tolist(),
            scores[b, : n + 1].tolist(),
        )
        for b, n in enumerate(counts.tolist())
    ]


def _to_tree(lists, device) -> DraftTree:
    """One :class:`DraftTree` of per-row (tokens, parents, log scores)."""
    parents = [p for _, p, _ in lists]
    host = tree_from_parents_host(
        parents, [t for t, _, _ in lists], max_depth=max(max_depth(parents), 1),
        scores=[s for _, _, s in lists],
    )  # fmt: skip
    return tree_to_device(host, torch.device(device))
