# SPDX-License-Identifier: Apache-2.0
"""The draft trees' round trip: worker -> scheduler -> worker.

The worker drafts; the scheduler decides what is verified (it may shorten a
request's drafts under token-budget pressure, and it owns the grammars of
structured requests); the worker verifies. The tree structure follows the
tokens so that both sides verify the same tree *by construction*:

1. worker (``take_draft_token_ids``): :class:`ProposedTrees` sends each
   request's node tokens with their parents (``DraftTokenIds.draft_parents``),
   their draft path probabilities when the auto budget calibrates with them
   (``draft_path_probs``), and, for structured requests, the drafter's per-depth
   top-K candidates (``draft_candidates``,
   :class:`~vllm_ddtree.vllm_adapter.structured_output.GrammarCandidates`);
2. scheduler (``update_draft_token_ids``): :func:`store_draft_trees` keeps a
   :class:`DraftTreeRecord` per request beside its drafts; a structured request
   whose grammar constrains its next token gets a tree built with its grammar
   from the candidates instead (:mod:`.structured_output`), which replaces its
   drafts;
3. scheduler (end of ``schedule``): :func:`scheduled_draft_trees` gives every
   request with scheduled drafts the structure of what was scheduled (a prefix
   of its record in node order, parents first, hence a tree) in
   ``SchedulerOutput.scheduled_draft_trees``;
4. worker (``_prepare_inputs``): the verify trees are built from those parents
   (:func:`~vllm_ddtree.vllm_adapter.step.build_step_trees`).

Drafts that carry no record (vLLM's ``-1`` padding of a resumed request) are
verified as a chain, which is always lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_ddtree.tree import DraftTree

__all__ = [
    "DraftTreeRecord",
    "ProposedTrees",
    "ScheduledDraftTree",
    "chain_parents",
    "scheduled_draft_trees",
    "store_draft_trees",
]

logger = init_logger(__name__)

# The scheduler's record of a request's drafts: an attribute of vLLM's Request.
RECORD_ATTR = "ddtree_draft_tree"


def chain_parents(n: int) -> list[int]:
    """Parents (root first) of ``n`` drafts verified as a chain."""
    return [-1] + list(range(n))


@dataclass
class ScheduledDraftTree:
    """The tree of one request's scheduled drafts (scheduler -> worker)."""

    parents: list[int]  # [n + 1] root first, node order (parents first)
    # [n] each node's draft path probability (the auto budget's calibration),
    # or None when not kept.
    path_probs: list[float] | None = None
    # Built with the request's grammar (its path probabilities renormalised over
    # the tokens the grammar allows): calibrated apart from the drafter's own.
    grammar_shaped: bool = False
    # Grammar-built with the auto budget: (path probabilities, depths) of the
    # whole best-first tree before the node price cut it, what the budget
    # values the request's next tree by.
    grammar_values: tuple[list[float], list[int]] | None = None


@dataclass
class DraftTreeRecord:
    """The scheduler's copy of a request's proposed tree."""

    tokens: list[int]  # [n] node order
    parents: list[int]  # [n + 1] root first
    path_probs: list[float] | None = None  # [n]
    grammar_shaped: bool = False
    # Built with the grammar: each node's bitmask row ([n + 1], root first; None
    # where the grammar terminated), valid while the request's token count is
    # ``num_tokens`` (the grammar has not moved).
    grammar_rows: list[Any] | None = None
    num_tokens: int = -1
    grammar_values: tuple[list[float], list[int]] | None = None

    def scheduled(self, tokens: list[int]) -> ScheduledDraftTree | None:
        """The tree of the scheduled ``tokens`` (a prefix of the record's), or
        None when they are not one (then they are verified as a chain)."""
        n = len(tokens)
        if n > len(self.tokens) or self.tokens[:n] != list(tokens):
            return None
        probs = None if self.path_probs is None else self.path_probs[:n]
        return ScheduledDraftTree(
            self.parents[: n + 1], probs, self.grammar_shaped, self.grammar_values
        )


# --------------------------------------------------------------------------- #
# Worker
# --------------------------------------------------------------------------- #


class ProposedTrees:
    """The trees of the worker's last drafter pass, until
    ``take_draft_token_ids`` sends them to the scheduler (then forgotten: what
    the worker verifies comes back in the scheduler's output)."""

    def __init__(self) -> None:
        # req_id -> (node tokens [n], parents [n + 1], path probabilities [n]).
        self._trees: dict[str, tuple[list[int], list[int], list[float] | None]] = {}
        # req_id -> the drafter's candidates for a grammar-built tree.
        self._candidates: dict[str, Any] = {}
        # Set by the auto budget: send each node's draft path probability.
        self.keep_path_probs = False

    def __len__(self) -> int:
        return len(self._trees)

    def clear(self) -> None:
        self._trees.clear()
        self._candidates.clear()

    def put(
        self,
        req_ids: list[str],
        tree: DraftTree,
        candidates: tuple[list[int], torch.Tensor, torch.Tensor] | None = None,
        make_candidates=None,
    ) -> list[list[int]]:
        """Keeps the batch's trees; returns each request's real node tokens
        (node order), the drafts the scheduler gets (padding rows of a tree with
        fewer than B nodes are never verified).

        Args:
            req_ids: the batch's requests, in row order.
            tree: the batch's trees (device).
            candidates: ``(rows, log_probs [Rc, L, K], token_ids [Rc, L, K])``
                of the batch rows whose requests are structured, or None.
            make_candidates: ``(row, log_probs [L][K], token_ids [L][K]) ->
                GrammarCandidates``, with ``candidates``.
        """
        self.clear()
        # One device->host copy per step for the whole batch: tokens, parents,
        # node counts, path probabilities and candidates as one float64 vector
        # (exact for token ids < 2**53 and for float32 probabilities).
        num_reqs, rows = tree.tokens.shape
        parts = [tree.tokens, tree.parents, tree.num_nodes.unsqueeze(1)]
        if self.keep_path_probs:
            parts.append(tree.scores.exp())
        flat = [torch.cat([x.double() for x in parts], dim=1).reshape(-1)]
        if candidates is not None:
            flat += [candidates[1].double().reshape(-1), candidates[2].double().reshape(-1)]
        host = torch.cat(flat).cpu().numpy()
        width = 3 * rows + 1 if self.keep_path_probs else 2 * rows + 1
        per_req = host[: num_reqs * width].reshape(num_reqs, width)
        tokens = per_req[:, :rows].astype(np.int64).tolist()
        parents = per_req[:, rows : 2 * rows].astype(np.int64).tolist()
        counts = per_req[:, 2 * rows].astype(np.int64).tolist()
        drafts = []
        for b, req_id in enumerate(req_ids):
            n = counts[b]
            probs = per_req[b, 2 * rows + 2 : 2 * rows + 2 + n].tolist() if (
                self.keep_path_probs
            ) else None
            self._trees[req_id] = (tokens[b][1 : n + 1], parents[b][: n + 1], probs)
            drafts.append(tokens[b][1 : n + 1])
        start = num_reqs * width
        self._put_candidates(req_ids, host, start, candidates, make_candidates)
        return drafts

    # >>> lookup
    def put_host(
        self,
        req_ids: list[str],
        trees: list[tuple[list[int], list[int], list[float]]],
    ) -> list[list[int]]:
        """:meth:`put` for trees built on the host (lookup-only steps): per
        request ``(tokens, parents, log path probabilities)``, root first,
        kept as they are (no device tree to build and read back)."""
        self.clear()
        drafts = []
        for req_id, (tokens, parents, log_scores) in zip(req_ids, trees, strict=True):
            probs = np.exp(log_scores[1:]).tolist() if self.keep_path_probs else None
            self._trees[req_id] = (list(tokens[1:]), list(parents), probs)
            drafts.append(list(tokens[1:]))
        return drafts

    # <<< lookup
    def _put_candidates(self, req_ids, host, start, candidates, make_candidates):
        """The grammar candidates of :meth:`put` (``host[start:]``)."""
        if candidates is not None:
            cand_rows, log_probs, _ = candidates
            size = log_probs.numel()
            values = host[start : start + size].reshape(log_probs.shape)
            ids = host[start + size : start + 2 * size].reshape(log_probs.shape)
            for i, b in enumerate(cand_rows):
                self._candidates[req_ids[b]] = make_candidates(
                    b, values[i].tolist(), ids[i].astype(np.int64).tolist()
                )

    # >>> auto budget
    def put_forced_only(self, req_ids: list[str], rows: list[int], make_candidates) -> None:
        """A pass without drafts (the auto budget skipped the drafter): the
        structured requests at batch rows ``rows`` get trees of the tokens their
        grammar forces, candidates with no drafted position (``make_candidates``
        as in :meth:`put`); after :meth:`put` (the step's lookup-only trees)
        or :meth:`clear`."""
        for b in rows:
            self._candidates[req_ids[b]] = make_candidates(b, [], [])

    # <<< auto budget
    def attach(self, draft_token_ids: Any) -> Any:
        """Adds each request's parents (root first), path probabilities and
        grammar candidates to a ``DraftTokenIds``; returns it. Drafts this pass
        did not make (vLLM's zeros when the drafter's input would not fit under
        ``max_model_len``) go as a chain."""
        if draft_token_ids is None:
            return None
        parents, probs = [], []
        for req_id, tokens in zip(
            draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
        ):
            stored = self._trees.get(req_id)
            if stored is not None and stored[0] == list(tokens):
                parents.append(stored[1])
                probs.append(stored[2])
                continue
            parents.append(chain_parents(len(tokens)))
            probs.append(None)
            if tokens and not any(tokens):
                logger.warning_once(
                    "ddtree: vLLM blanked the draft tree of a request whose prompt + "
                    "output + the drafter's block exceeds max_model_len; such steps "
                    "accept nothing. Leave num_speculative_tokens of room under "
                    "max_model_len to keep the speed-up near the end of long requests."
                )
        draft_token_ids.draft_parents = parents
        draft_token_ids.draft_path_probs = probs if self.keep_path_probs else None
        draft_token_ids.draft_candidates = dict(self._candidates) or None
        self.clear()
        return draft_token_ids


# --------------------------------------------------------------------------- #
# Scheduler
# --------------------------------------------------------------------------- #


def store_draft_trees(
    requests: dict[str, Any], draft_token_ids: Any, grammar_tree=None
) -> None:
    """``Scheduler.update_draft_token_ids``, before vLLM stores the drafts:
    keeps each live request's tree as a :class:`DraftTreeRecord`.

    Args:
        requests: the scheduler's requests by id.
        draft_token_ids: the worker's ``DraftTokenIds`` (with ``draft_parents``);
            a request's drafts are replaced in place by its grammar-built tree.
        grammar_tree: ``(request, GrammarCandidates) -> DraftTreeRecord | None``,
            the grammar-built tree of a structured request (None: keep the
            worker's tree).
    """
    probs = getattr(draft_token_ids, "draft_path_probs", None)
    candidates = getattr(draft_token_ids, "draft_candidates", None) or {}
    for i, (req_id, tokens, parents) in enumerate(
        zip(
            draft_token_ids.req_ids,
            draft_token_ids.draft_token_ids,
            draft_token_ids.draft_parents,
            strict=True,
        )
    ):
        request = requests.get(req_id)
        if request is None or request.is_finished():
            continue  # vLLM skips it too
        record = None
        if grammar_tree is not None and req_id in candidates:
            record = grammar_tree(request, candidates[req_id])
        if record is not None:
            draft_token_ids.draft_token_ids[i] = list(record.tokens)
        else:
            record = DraftTreeRecord(
                list(tokens), list(parents), None if probs is None else probs[i]
            )
        setattr(request, RECORD_ATTR, record)


def scheduled_draft_trees(
    requests: dict[str, Any],
    num_scheduled_tokens: dict[str, int],
    scheduled_spec_decode_tokens: dict[str, list[int]],
) -> dict[str, ScheduledDraftTree]:
    """End of ``Scheduler.schedule``: the tree of every request's scheduled
    drafts (``SchedulerOutput.scheduled_draft_trees``); requests without one are
    verified as a chain. A scheduled request whose grammar-built tree kept no
    node gets an empty tree too: it carries the tree's values for the auto
    budget."""
    trees = {}
    for req_id in num_scheduled_tokens:
        tokens = scheduled_spec_decode_tokens.get(req_id, ())
        record = record_of(requests.get(req_id))
        if record is None or not (tokens or record.grammar_values):
            continue
        tree = record.scheduled(tokens)
        if tree is not None:
            trees[req_id] = tree
    return trees


def record_of(request: Any) -> DraftTreeRecord | None:
    """A request's :class:`DraftTreeRecord`, if any."""
    return getattr(request, RECORD_ATTR, None)
