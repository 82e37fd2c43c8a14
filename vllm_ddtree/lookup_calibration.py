# SPDX-License-Identifier: Apache-2.0
"""Lookup probabilities calibrated online against what the target accepted.

A lookup source scores its nodes on its own scale: SuffixDecoding's node
probability is the frequency of a continuation among earlier matches
(https://arxiv.org/abs/2411.04975), an n-gram match has no score at all. The
union tree (:mod:`vllm_ddtree.lookup_tree`) puts lookup nodes and the
drafter's on one scale, the probability that the target emits the node's token
once its parent is accepted, so each lookup node's raw score is mapped to that
probability by what the target did with earlier nodes like it: the same depth,
the same raw-score bucket, and whether the drafter proposed the same token
(agreement is evidence). Per bucket, a Beta posterior whose prior mean is the
node's raw score (``prior_weight`` pseudo-observations), so a new bucket starts
at the source's own estimate and moves to the measured rate:

    p = (accepted + w * raw) / (reached + w)

A node is *reached* when its parent is accepted (the root always is): only then
does the target's choice say anything about it. Each verify step adds its
reached lookup nodes and whether each was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_ddtree.lookup_tree import LookupDraft

__all__ = ["LookupCalibration"]


class LookupCalibration:
    """Calibrated probabilities of lookup nodes, by (depth, raw bucket, agreed).

    Args:
        max_depth: depths past it share its bucket.
        num_bins: equal-width raw-score buckets over (0, 1].
        prior_weight: pseudo-observations at the raw score.
    """

    def __init__(self, max_depth: int = 16, num_bins: int = 5, prior_weight=2.0):
        if max_depth < 1 or num_bins < 1 or prior_weight <= 0:
            raise ValueError(
                "lookup calibration needs max_depth >= 1, num_bins >= 1 and "
                f"prior_weight > 0, got {max_depth}, {num_bins}, {prior_weight}"
            )
        self.max_depth = max_depth
        self.num_bins = num_bins
        self.prior_weight = float(prior_weight)
        shape = (max_depth, num_bins, 2)
        self.reached = np.zeros(shape)
        self.accepted = np.zeros(shape)

    def _buckets(self, depths, raw, agreed) -> tuple[np.ndarray, ...]:
        depths = np.clip(np.asarray(depths, dtype=np.int64), 1, self.max_depth) - 1
        raw = np.asarray(raw, dtype=np.float64)
        bins = np.clip(np.ceil(raw * self.num_bins).astype(np.int64) - 1, 0, None)
        bins = np.minimum(bins, self.num_bins - 1)
        return depths, bins, np.asarray(agreed, dtype=np.int64)

    def probability(self, depths, raw, agreed) -> np.ndarray:
        """Calibrated probabilities of nodes (arrays of one entry per node:
        depth >= 1, raw score in (0, 1], drafter agreement)."""
        d, b, a = self._buckets(depths, raw, agreed)
        w = self.prior_weight
        raw = np.asarray(raw, dtype=np.float64)
        return (self.accepted[d, b, a] + w * raw) / (self.reached[d, b, a] + w)

    def observe(self, depths, raw, agreed, accepted) -> None:
        """Adds reached lookup nodes and whether the target accepted each."""
        d, b, a = self._buckets(depths, raw, agreed)
        # Bucket counts by bincount over the flat index (np.add.at's per-call
        # cost is several times that, and this runs every step).
        flat = np.ravel_multi_index((d, b, a), self.reached.shape)
        size = self.reached.size
        self.reached += np.bincount(flat, minlength=size).reshape(self.reached.shape)
        self.accepted += np.bincount(
            flat, weights=np.asarray(accepted, dtype=np.float64), minlength=size
        ).reshape(self.accepted.shape)

    def calibrate(
        self, draft: LookupDraft, agreed: Sequence[bool] | None = None
    ) -> LookupDraft:
        """``draft`` with calibrated probabilities (siblings scaled down where
        they would sum past 1). ``agreed[i]``: the drafter proposes node i's
        token at its depth too (default: none)."""
        n = len(draft.tokens)
        if n == 0:
            return draft
        depths = draft.depths()
        agreed = np.zeros(n, dtype=bool) if agreed is None else np.asarray(agreed)
        probs = self.probability(depths, draft.probs, agreed)
        parents = np.asarray(draft.parents, dtype=np.int64)
        mass = np.bincount(parents + 1, weights=probs, minlength=n + 1)  # [n + 1]
        scale = np.where(mass > 1.0, (1.0 - 1e-6) / np.maximum(mass, 1e-300), 1.0)
        probs = np.clip(probs * scale[parents + 1], 1e-9, 1.0)
        return LookupDraft(list(draft.tokens), list(draft.parents), probs.tolist())
