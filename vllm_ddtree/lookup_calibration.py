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

import math
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

    # A step brings a few trees of a few nodes: per-node float arithmetic on
    # the host, where numpy's per-call overhead was most of the time.

    def _bucket(self, depth: int, raw: float, agreed: bool) -> tuple[int, int, int]:
        """The (depth, raw bucket, agreed) index of one node."""
        depth = min(max(int(depth), 1), self.max_depth) - 1
        bucket = min(max(math.ceil(raw * self.num_bins) - 1, 0), self.num_bins - 1)
        return depth, bucket, int(bool(agreed))

    def probability(self, depths, raw, agreed) -> np.ndarray:
        """Calibrated probabilities of nodes (sequences of one entry per node:
        depth >= 1, raw score in (0, 1], drafter agreement)."""
        w = self.prior_weight
        out = []
        for d, r, a in zip(depths, raw, agreed, strict=True):
            key = self._bucket(d, float(r), a)
            out.append((self.accepted[key] + w * r) / (self.reached[key] + w))
        return np.asarray(out, dtype=np.float64)

    def observe(self, depths, raw, agreed, accepted) -> None:
        """Adds reached lookup nodes and whether the target accepted each."""
        for d, r, a, hit in zip(depths, raw, agreed, accepted, strict=True):
            key = self._bucket(d, float(r), a)
            self.reached[key] += 1.0
            self.accepted[key] += float(hit)

    def calibrate(
        self, draft: LookupDraft, agreed: Sequence[bool] | None = None
    ) -> LookupDraft:
        """``draft`` with calibrated probabilities (siblings scaled down where
        they would sum past 1). ``agreed[i]``: the drafter proposes node i's
        token at its depth too (default: none)."""
        n = len(draft.tokens)
        if n == 0:
            return draft
        agreed = [False] * n if agreed is None else agreed
        probs = self.probability(draft.depth_list(), draft.probs, agreed).tolist()
        mass = [0.0] * (n + 1)  # children's sum per parent slot (0: the root)
        for parent, p in zip(draft.parents, probs, strict=True):
            mass[parent + 1] += p
        scale = [(1.0 - 1e-6) / m if m > 1.0 else 1.0 for m in mass]
        probs = [
            min(max(p * scale[parent + 1], 1e-9), 1.0)
            for parent, p in zip(draft.parents, probs, strict=True)
        ]
        return LookupDraft(list(draft.tokens), list(draft.parents), probs)
