# SPDX-License-Identifier: Apache-2.0
"""``ddtree_budget="auto"``: per-step node budgets and drafter skipping (worker).

Each step the runner reports what it measured (rows verified, seconds spent in
the target step and in the drafter pass, accepted depths); the controller keeps

* a ``StepCostModel`` (budget.py) of the plain target step (no drafts: the
  stock attention only), seconds as a piecewise-linear function of the rows,
  started from a start-up profile (vLLM's dummy forward at 1, 2, 4, ... rows,
  :meth:`BudgetController.profile`) and refined from every plain step; and one
  of what a tree step costs beyond a plain step of as many rows, per request
  verifying a tree, by tree requests (tree attention and the verify's
  bookkeeping work per tree: on CPU a recompute per tree and layer, so a model
  over rows alone read a 16-request tree step at half its measured cost), and
  costs per node fitted jointly (``NodeCostModel``): per draft node (a
  verify row's logits and attention over the request's context, which the
  profile's dummy rows lack; on recurrent targets also its state copy) and
  per branch row (a node off its tree's leading chain, the rows the CPU
  attention recomputes);
* drafter cost models: the full DFlash pass (block queries, draft logits
  for ``draft_depth`` positions, trees), by requests, one per depth, and the
  context-only pass (the drafter's context K/V of the new tokens, no drafter
  forward, nothing drafted), by requests;
* an ``AcceptanceCalibration`` (budget.py) of the draft path
  probabilities, per depth, from what the target accepted.

When the drafter has built the batch's trees, :meth:`choose` trims each
request's tree to the prefix that maximises the batch's expected committed
tokens per second with drafting on (``allocate_nodes``: verify step + the next
full drafter pass). Whether to keep drafting is a decision about the trees to
come, not this one: per-tree values spread widely (one step's drafts are sure,
the next step's not), so the controller keeps running means of what the best
prefix of each drafted batch commits and of what decoding without drafts (plain
step + context-only pass) would commit in the same time, and drafts while their
ratio, the *advantage*, stays above 1 (with hysteresis: it starts above 1 +
``min_gain``, stops below 1 - ``max_loss``). When it stops, the next passes are
context-only (every committed token's target hidden states still reach the
drafter's K/V, so later drafts are what they would have been) and a probe
drafts again after as many skipped steps as keep the probes' expected loss
within ``explore_share`` of the time: soon when drafting is near break-even,
rarely when it is far below (at most ``max_skip``). The tree a probe drafted is
verified only as far as it beats one plain step (its pass is paid). While the
chosen trees stay shallow the drafter drafts the depths in use only (a shorter
block: its forward and its LM head over the vocabulary shrink with it), and the
whole block every ``full_depth_every``-th pass. Lookup-only trees (steps
without a drafter pass) are verified as far as they beat a plain step; when
none does, the best of them is still verified now and then, within the same
``explore_share``, since a stale price (a few slow steps, early rejections)
is corrected only by verified trees.

Lossless: budgets depend on the draft scores and on timings only, never on the
target's samples of the step being verified; a trimmed tree is a prefix of the
DDTree, verified exactly as any tree.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from vllm.utils import torch_utils

from vllm_ddtree.budget import (
    AcceptanceCalibration,
    NodeCostModel,
    OutlierFilter,
    ProfiledStepCost,
    StepCostModel,
    allocate_nodes,
    # >>> lookup
    allocate_nodes_host,
    # <<< lookup
    allocation_order,
    # >>> lookup
    allocation_order_host,
    # <<< lookup
)
# >>> lookup
from vllm_ddtree.lookup_tree import UnionTree
# <<< lookup
from vllm_ddtree.tree import DraftTree

__all__ = ["BudgetController", "StepPrices"]


class StepPrices(NamedTuple):
    """A drafted batch as the controller prices it."""

    values: torch.Tensor  # [R, B] calibrated expected accepted tokens per node
    full: float  # seconds of the next full drafter pass (at draft_depth)
    context: float  # seconds of a context-only pass instead
    plain: float  # seconds of a plain target step of the batch


class DraftingSwitch:
    """Whether drafting pays, from running means over drafted batches (weight
    ``memory`` on the past, about 1 / (1 - memory) batches): the tokens the
    best prefix commits, the seconds of that step (verify + next full pass),
    and the tokens the alternative (no drafter pass) commits in those
    seconds. A ratio of means, not a mean of ratios: a long step weighs what
    it costs."""

    def __init__(self) -> None:
        self.mean_tokens = 0.0
        self.mean_seconds = 0.0
        self.mean_plain_tokens = 0.0
        # Whether drafting is on; the first drafted batch must show a gain.
        self.drafting = False
        # Context-only passes left before the next probe.
        self.skip_left = 0

    @property
    def advantage(self) -> float | None:
        """Tokens per second drafting over the alternative (None before the
        first drafted batch)."""
        if self.mean_plain_tokens <= 0:
            return None
        return self.mean_tokens / self.mean_plain_tokens

    def record(
        self, tokens: float, seconds: float, plain_tokens: float, memory: float
    ) -> None:
        """One drafted batch (the first sets the means)."""
        memory = memory if self.mean_plain_tokens > 0 else 0.0
        self.mean_tokens = memory * self.mean_tokens + (1 - memory) * tokens
        self.mean_seconds = memory * self.mean_seconds + (1 - memory) * seconds
        self.mean_plain_tokens = (
            memory * self.mean_plain_tokens + (1 - memory) * plain_tokens
        )


class BudgetController:
    """Chooses each step's node budget per request, and when to draft at all."""

    def __init__(
        self,
        max_depth: int,
        budget: int,
        device,
        max_rows: int,
        max_reqs: int,
        max_skip: int = 256,
    ):
        self.budget = budget
        self.max_skip = max_skip
        self.plain_step_cost = ProfiledStepCost(max_rows)
        # Seconds per tree request beyond a plain step of as many rows, by tree
        # requests (none before the first tree step: trees cost their rows).
        self.tree_overhead_cost = StepCostModel(max_reqs)
        # Hybrid targets (:meth:`track_recurrent_state`): seconds per draft node
        # beyond a plain row. A GDN layer's tree row first gets its parent's
        # state (``HV x K x V`` elements per node and layer, copied on the CPU)
        # and the CPU path runs one decode call per depth level, work that grows
        # with the nodes, not with the tree requests. None for other targets.
        self.tree_node_cost: NodeCostModel | None = None
        # Whether every node is charged (recurrent targets) or only branch
        # rows (:meth:`track_branch_rows`).
        self.charge_all_nodes = False
        self._tree_warmed_up = False
        # Stalls (a compile on a kernel variant's first launch, a descheduled
        # process) kept out of the timing samples: the target's steps and the
        # drafter's passes, each with its own run of slow samples.
        self.step_outliers = OutlierFilter()
        self.drafter_outliers = OutlierFilter()
        # The full pass by requests, one model per draft depth (the drafter's
        # block forward, the same at every depth, plus the LM head over
        # ``depth`` positions per request): one model over requests * (depth +
        # 1) read shallow passes ~30% low, so probes came too often.
        self._max_reqs = max_reqs
        self._full_drafter_costs: dict[int, StepCostModel] = {}
        self.context_drafter_cost = StepCostModel(max_reqs)
        self.calibration = AcceptanceCalibration(max_depth, device)
        # Trees the scheduler builds with a request's grammar: path
        # probabilities renormalised over the allowed tokens, and forced runs
        # past the drafter's depth (up to B deep), calibrated apart.
        self.grammar_calibration = AcceptanceCalibration(budget, device)
        # >>> lookup
        # Trees holding lookup nodes (union trees, lookup-only trees): their
        # lookup nodes' probabilities are calibrated already (by the lookup's
        # own calibration), and lookup paths run past the drafter's depth (up
        # to B deep), so they are calibrated apart too. On the host, as the
        # lookup trees are: fed from the committed tokens the lookup reads
        # anyway (:meth:`observe_lookup_trees`), read without a device sync.
        self.lookup_calibration = AcceptanceCalibration(budget, "cpu")
        # <<< lookup
        # This step's price of a node in expected accepted tokens (the chosen
        # step's throughput times a node's marginal seconds): the scheduler
        # keeps a grammar-built tree's nodes worth at least that.
        self._node_price = 0.0
        self._grammar_factors: list[float] | None = None
        self.max_depth = max_depth
        # Depths the next drafter pass drafts (its block length): the deepest node
        # chosen in the last ``depth_window`` trees + ``depth_margin``, and every
        # ``full_depth_every``-th pass the whole block (so deeper trees that
        # start to pay are seen).
        self.draft_depth = max_depth
        self.depth_margin = 2
        self.depth_window = 8
        self.full_depth_every = 16
        self._deepest: list[int] = []
        self._drafted = 0
        # [B + 1] int64: request-steps of drafted steps that got 0, 1, ..., B
        # nodes (device); the request-steps of context-only steps (0 nodes) are
        # counted on the host. ``chosen_histogram`` is both.
        self._drafted_histogram = torch.zeros(
            budget + 1, dtype=torch.int64, device=device
        )
        self._skipped_request_steps = 0
        # >>> lookup
        # [B + 1] request-steps of lookup-only steps by nodes verified (host).
        self._lookup_only_histogram = np.zeros(budget + 1, dtype=np.int64)
        # Request-steps of the last draft_next if it skipped (a lookup-only
        # step then counts them by the nodes it verifies instead).
        self._last_skipped = 0
        # <<< lookup
        self.num_skipped_steps = 0
        # Whether drafting pays (running means over drafted batches, weight
        # ``advantage_memory`` on the past) against decoding without drafts.
        self.advantage_memory = 0.75
        self._switch = DraftingSwitch()
        # >>> lookup
        # Batches with lookup trees weigh drafting against verifying those
        # trees alone, batches without against plain steps: one switch each,
        # so a drafter that does not pay beside lookup still drafts where
        # the lookup has nothing to propose.
        self._switches = {False: self._switch, True: DraftingSwitch()}
        # <<< lookup
        # Hysteresis of the draft / skip switch on the advantage: drafting starts
        # above 1 + min_gain and stops below 1 - max_loss (step times on a shared
        # CPU spread by +-30%, and a switch costs a drafter pass or a probe run).
        # A probe's tree is verified as far as it beats a plain step by min_gain.
        self.min_gain = 0.03
        self.max_loss = 0.03
        # While drafting does not pay, a probe (a full pass instead of a
        # context-only one, its tree verified as far as it pays) is
        # exploration: its expected loss is kept within this share of the time.
        self.explore_share = 0.005
        # >>> lookup
        # Declined lookup-only steps' exploration allowance (a share of a
        # step each), spent on verifying their best tree anyway.
        self._lookup_explore_credit = 0.0
        self.num_lookup_explorations = 0
        # <<< lookup
        self._steps = 0
        self.retime_every = 512

    @property
    def full_drafter_cost(self) -> StepCostModel:
        """The full pass's cost model at the whole block's depth (an empty one
        before that depth's first pass)."""
        return self._full_drafter_costs.get(self.max_depth) or StepCostModel(
            self._max_reqs
        )

    def full_pass_seconds(self, num_reqs: int, depth: int) -> float | None:
        """Predicted seconds of a full drafter pass at ``depth``: from that
        depth's model, else the next deeper one measured (never an
        underestimate), else None."""
        for d in sorted(self._full_drafter_costs):
            if d >= depth and self._full_drafter_costs[d].ready:
                return self._full_drafter_costs[d].predict(num_reqs)
        return None

    @property
    def advantage(self) -> float | None:
        """Committed tokens per second drafting every step over decoding
        without drafts, from the drafted batches so far (None before the first)."""
        return self._switch.advantage

    # ------------------------------------------------------------------ #
    # Measurements
    # ------------------------------------------------------------------ #

    def profile(self, runner, max_rows: int, repeats: int = 3) -> None:
        """Start-up samples of the plain step model's shape: vLLM's dummy
        forward and the target's LM head over every row, at 1, 2, 4, ... rows
        up to ``max_rows`` (the first run of each size is a warm-up), the
        drafter's share of each run taken out. A verify step computes logits
        at all its rows; the dummy run computes none (measured on a 2-core
        AVX-512 Xeon, SmolLM2-135M fp32: 23.1 ms at 1 row against 29.6 ms for
        a real step, 35.5 ms at 16 rows against ~50 ms)."""
        import time

        drafter = runner.drafter
        dummy_run = drafter.dummy_run
        spent = [0.0]

        def timed_dummy_run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return dummy_run(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started

        drafter.dummy_run = timed_dummy_run
        sync = (
            torch.cuda.synchronize
            if torch.device(runner.device).type == "cuda"
            else (lambda: None)
        )
        try:
            rows = 1
            while True:
                for repeat in range(repeats):
                    spent[0] = 0.0
                    sync()
                    started = time.perf_counter()
                    hidden_states, _ = runner._dummy_run(rows)
                    runner.model.compute_logits(hidden_states[:rows])
                    sync()  # device work is asynchronous: time it all
                    seconds = time.perf_counter() - started - spent[0]
                    if repeat:
                        self.plain_step_cost.add_profile_sample(rows, seconds)
                if rows >= max_rows:
                    break
                rows = min(2 * rows, max_rows)
        finally:
            del drafter.dummy_run  # the class's method again

    def track_recurrent_state(self) -> None:
        """The target has recurrent (GDN) layers: every draft node of a tree
        step also copies its parent's state (:attr:`tree_node_cost`, one kind:
        every node)."""
        self.tree_node_cost = NodeCostModel(kinds=1)
        self.charge_all_nodes = True

    def track_branch_rows(self) -> None:
        """Tree steps are charged per draft node and, apart, per *branch
        row*: a node off its tree's leading chain (on CPU the attention
        recomputes exactly those rows per layer; a chain's rows and a tree's
        leading spine are the stock kernel's). Lookup drafts are often
        chains, the drafter's trees branch: charged per tree request alone, a
        15-node branching tree was priced like a 15-node chain, and read ~20%
        cheap."""
        self.tree_node_cost = NodeCostModel(kinds=2)
        self.charge_all_nodes = False

    @staticmethod
    def branch_rows(parents: list[int]) -> int:
        """Nodes of a tree (``parents``, root first) off its leading chain."""
        spine = 1
        while spine < len(parents) and parents[spine] == spine - 1:
            spine += 1
        return len(parents) - spine

    def node_kinds(self, tree: DraftTree) -> torch.Tensor | None:
        """[K, R, B] float: per kind of :attr:`tree_node_cost`, 1 for each
        node of that kind (kind 0: every real node; kind 1, dense targets:
        the branch rows), or None without a per-node model."""
        if self.tree_node_cost is None:
            return None
        parents = tree.parents[:, 1:]  # [R, B]
        index = torch.arange(parents.shape[1], device=parents.device)
        real = index < tree.num_nodes.unsqueeze(1)
        if self.charge_all_nodes:
            return real.float().unsqueeze(0)
        # Node i (column i - 1) is on the leading spine iff every node up to
        # it is the child of the one before it.
        spine = torch.cumprod((parents == index).to(torch.int32), dim=1).bool()
        return torch.stack([real, real & ~spine]).float()

    def _charged_seconds(self, values: torch.Tensor, tree: DraftTree):
        """[R * B + 1] (device) the per-node seconds of the best k nodes, k =
        0 .. R * B, in :func:`allocate_nodes`' order; None without a model."""
        kinds = self.node_kinds(tree)
        if kinds is None or not self.tree_node_cost.ready:
            return None
        # [R, B] seconds per node (host floats as scalars: no host -> device copy)
        slopes = self.tree_node_cost.slopes
        per_node = sum(kind * s for kind, s in zip(kinds, slopes, strict=True))
        _, order = allocation_order(values)
        cumulative = per_node.t().reshape(-1)[order].cumsum(0)
        return torch.cat([cumulative.new_zeros(1), cumulative])

    def record_step(
        self,
        rows: int,
        target_seconds: float,
        tree_requests: int = 0,
        tree_nodes: int = 0,
        branch_rows: int = 0,
    ) -> None:
        """One target step of ``rows`` rows, ``tree_requests`` of its requests
        verifying ``tree_nodes`` draft nodes in all, ``branch_rows`` of them
        off their trees' leading chains (0 requests: a plain step).

        With a per-node model the step's extra time is split: the node slopes
        from a joint fit (:class:`NodeCostModel`), the per-request model from
        what the nodes leave (steps of different nodes per tree request tell
        them apart; at one ratio any split predicts the same)."""
        if rows <= 0 or target_seconds <= 0:
            return
        timed = not tree_requests or self._tree_warmed_up
        if self.plain_step_cost.ready and timed:
            predicted = float(self.tree_step_seconds(rows, tree_requests))
            if not self.step_outliers.accept(target_seconds, predicted):
                return
        if not tree_requests:
            self.plain_step_cost.update(rows, target_seconds)
        elif not self._tree_warmed_up:
            # The engine's first tree step sets up the tree attention (layout
            # probe, plans): a warm-up, not a sample.
            self._tree_warmed_up = True
        elif self.plain_step_cost.ready:
            # Not clipped at 0: a step's time scatters by a few ms either way,
            # and clipping its residuals biased the mean overhead upward (the
            # fitted curve is clipped instead).
            extra = target_seconds - float(self.plain_step_cost.predict(rows))
            per_node = self.tree_node_cost
            if per_node is None or tree_nodes <= 0:
                self.tree_overhead_cost.update(tree_requests, extra / tree_requests)
                return
            counts = self._node_counts(tree_nodes, branch_rows)
            per_node.update(tree_requests, counts, extra)
            by_nodes = per_node.predict(counts)
            self.tree_overhead_cost.update(
                tree_requests, (extra - by_nodes) / tree_requests
            )

    def _node_counts(self, nodes, branch_rows=0) -> tuple:
        """Counts of each kind of :attr:`tree_node_cost` (every node; and the
        branch rows on dense targets)."""
        return (nodes,) if self.charge_all_nodes else (nodes, branch_rows)

    def _tree_seconds(self, tree_requests: int) -> float:
        if not tree_requests or not self.tree_overhead_cost.ready:
            return 0.0
        return tree_requests * float(self.tree_overhead_cost.predict(tree_requests))

    def _node_seconds(self, nodes):
        """Seconds of ``nodes`` draft nodes (a number or an array) at the
        every-node slope (branch rows are charged by the callers that see
        the trees)."""
        model = self.tree_node_cost
        if model is None or not model.ready:
            return 0.0
        return model.slopes[0] * np.asarray(nodes, dtype=np.float64)

    def tree_step_seconds(self, rows, tree_requests: int, per_node: bool = True):
        """Predicted seconds of a verify step of ``rows`` rows (a number or an
        array) with ``tree_requests`` requests verifying trees (and ``rows -
        tree_requests`` draft nodes: the root rows are the requests', all
        charged per node when ``per_node``; :meth:`choose` charges the nodes
        of its trees itself)."""
        seconds = self.plain_step_cost.predict(rows)
        if tree_requests:
            nodes = np.maximum(np.asarray(rows) - tree_requests, 0)
            seconds = seconds + self._tree_seconds(tree_requests)
            if per_node:
                seconds = seconds + self._node_seconds(nodes)
        return seconds

    def record_drafter(
        self, full: bool, num_reqs: int, seconds: float, depth: int | None = None
    ) -> None:
        """One drafter pass: ``full`` (drafting, logits for ``depth`` positions
        per request) or context-only."""
        if num_reqs > 0 and seconds > 0:
            if full:
                depth = self.max_depth if depth is None else depth
                model = self._full_drafter_costs.get(depth)
                if model is None:
                    model = StepCostModel(self._max_reqs)
                    self._full_drafter_costs[depth] = model
            else:
                model = self.context_drafter_cost
            predicted = float(model.predict(num_reqs)) if model.ready else None
            if self.drafter_outliers.accept(seconds, predicted):
                model.update(num_reqs, seconds)

    @property
    def chosen_histogram(self) -> torch.Tensor:
        """[B + 1] int64 request-steps that got 0, 1, ..., B nodes (a new tensor;
        context-only steps count as 0)."""
        histogram = self._drafted_histogram.clone()
        # >>> lookup
        histogram += torch.from_numpy(self._lookup_only_histogram).to(histogram.device)
        # <<< lookup
        histogram[0] += self._skipped_request_steps
        return histogram

    def stats_line(self) -> str:
        """The chosen-nodes statistics so far, one log line: mean nodes per
        request-step, the histogram's non-empty bins, skipped drafter steps."""
        histogram = self.chosen_histogram.tolist()
        total = sum(histogram)
        mean = sum(k * c for k, c in enumerate(histogram)) / max(total, 1)
        bins = ", ".join(f"{k}: {c}" for k, c in enumerate(histogram) if c)
        line = (
            f"DDTree auto budget: mean nodes per request-step {mean:.2f} over "
            f"{total} request-steps (nodes: request-steps {bins or '-'}); drafter "
            f"skipped {self.num_skipped_steps} of {self._steps} steps; draft depth "
            f"{self.draft_depth}; timing samples dropped as stalls (> "
            f"{self.step_outliers.factor:g}x predicted) "
            f"{self.step_outliers.num_dropped} target steps, "
            f"{self.drafter_outliers.num_dropped} drafter passes"
        )
        # >>> lookup
        line += (
            "; lookup-only trees verified to explore "
            f"{self.num_lookup_explorations}"
        )
        # <<< lookup
        return line

    # ------------------------------------------------------------------ #
    # Decisions
    # ------------------------------------------------------------------ #

    def _record_advantage(
        self, tokens: float, seconds: float, plain_tokens: float
    ) -> None:
        """One drafted batch: ``tokens`` its best prefix commits in ``seconds``
        (verify step + next full pass), ``plain_tokens`` what decoding without
        drafts commits in as long. The first batch sets the means."""
        self._switch.record(tokens, seconds, plain_tokens, self.advantage_memory)

    def draft_next(
        self,
        num_reqs: int,
        # >>> lookup
        with_lookup: bool = False,
        # <<< lookup
    ) -> bool:
        """Whether the coming drafter pass over ``num_reqs`` requests should
        draft (else: context only; its requests count as 0 nodes chosen)."""
        # >>> lookup
        # ``with_lookup``: the batch has lookup trees this step.
        self._switch = self._switches[bool(with_lookup)]
        # <<< lookup
        self._steps += 1
        skip = bool(self._full_drafter_costs) and (
            not self.context_drafter_cost.ready or self._steps % self.retime_every == 0
        )  # time a context-only pass now and then: what skipping would save
        if not skip and self._switch.skip_left > 0:
            self._switch.skip_left -= 1
            skip = True
        if skip:
            self.num_skipped_steps += 1
            self._skipped_request_steps += num_reqs
            # >>> lookup
            self._last_skipped = num_reqs
            # <<< lookup
            return False
        # >>> lookup
        self._last_skipped = 0
        # <<< lookup
        self._drafted += 1
        if self._drafted % self.full_depth_every == 0 or not self._deepest:
            self.draft_depth = self.max_depth
        else:
            deepest = max(self._deepest) + self.depth_margin
            self.draft_depth = max(1, min(self.max_depth, deepest))
        return True

    def grammar_node_price(self) -> tuple[float, list[float]]:
        """(price of a node, [B + 1] calibration factors by depth) for the
        scheduler's grammar-built trees this step (one host read per step)."""
        if self._grammar_factors is None:
            self._grammar_factors = self.grammar_calibration.factors().tolist()
        return self._node_price, self._grammar_factors

    def node_values(
        self,
        tree: DraftTree,
        grammar_values=None,
        # >>> lookup
        lookup_rows=None,
        # <<< lookup
    ) -> torch.Tensor:
        """[R, B] calibrated expected accepted tokens of ``tree``'s nodes;
        ``grammar_values`` as in :meth:`choose`, ``lookup_rows`` [Rl] (device)
        the rows whose trees hold lookup nodes (None: none)."""
        nodes = tree.scores[:, 1:]  # [R, B] log path probabilities
        first = torch.arange(nodes.shape[1], device=nodes.device)  # [B]
        probs = torch.where(first < tree.num_nodes.unsqueeze(1), nodes.exp(), 0.0)
        depths = tree.depths[:, 1:]
        values = self.calibration.node_values(probs, depths)
        # >>> lookup
        if lookup_rows is not None:
            lookup_factors = torch_utils.async_tensor_h2d(
                self.lookup_calibration.factors(), device=probs.device
            )
            values = values.index_copy(
                0,
                lookup_rows,
                self.lookup_calibration.node_values(
                    probs.index_select(0, lookup_rows),
                    depths.index_select(0, lookup_rows),
                    lookup_factors,
                ),
            )
        # <<< lookup
        if grammar_values is not None:
            rows, grammar_probs, grammar_depths = grammar_values
            values = values.index_copy(
                0, rows, self.grammar_calibration.node_values(grammar_probs, grammar_depths)
            )
        return values

    def prices(
        self,
        tree: DraftTree,
        grammar_values=None,
        # >>> lookup
        lookup_rows=None,
        # <<< lookup
    ) -> StepPrices | None:
        """What :meth:`choose` weighs for ``tree``'s batch (None while the cost
        models warm up); ``grammar_values``, ``lookup_rows`` as in
        :meth:`node_values`."""
        num_reqs = tree.num_reqs
        full = self.full_pass_seconds(num_reqs, self.draft_depth)
        if not self.plain_step_cost.ready or full is None:
            return None
        values = self.node_values(
            tree,
            grammar_values,
            # >>> lookup
            lookup_rows,
            # <<< lookup
        )
        # Until a context-only pass was timed (the first one comes soon, see
        # draft_next), assume it saves nothing.
        context = self.context_drafter_cost.estimate(num_reqs)
        context = full if context is None else min(context, full)
        plain = float(self.plain_step_cost.predict(num_reqs))
        return StepPrices(values, full, context, plain)

    # >>> lookup
    def observe_lookup_trees(
        self,
        path_probs: list[list[float]],
        depths: list[list[int]],
        num_accepted: list[int],
    ) -> None:
        """What the target accepted of the verified trees that held lookup
        nodes (host lists, one entry per such tree): each tree's verified
        nodes' path probabilities and depths, and how deep its accepted path
        went."""
        if path_probs:
            self.lookup_calibration.update_host(path_probs, depths, num_accepted)

    def _lookup_only_step(
        self, trees: list[UnionTree | None], context: float
    ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """What :func:`allocate_nodes_host` weighs for lookup-only trees
        ``trees`` (None: a request without one) verified with a context-only
        drafter pass after them: ``(values [R, B], seconds [R * B + 1] of the
        step with the best k nodes, k = 0: a plain step; the allocation
        order)``. On the host, where the trees are built: the choice comes
        before their one copy to the device."""
        num_reqs = len(trees)
        width = max((t.num_nodes for t in trees if t is not None), default=0)
        values = np.zeros((num_reqs, width))  # [R, B]
        charged = np.zeros((num_reqs, width))  # [R, B] per-node seconds
        node_cost = self.tree_node_cost
        slopes = node_cost.slopes if node_cost is not None and node_cost.ready else None
        factors = self.lookup_calibration.factors().tolist()  # [B + 1]
        deepest = len(factors) - 1
        for r, tree in enumerate(trees):
            n = 0 if tree is None else tree.num_nodes
            if not n:
                continue
            # A few nodes: floats, not numpy calls (this runs every step).
            values[r, :n] = [
                min(math.exp(score) * factors[min(depth, deepest)], 1.0)
                for score, depth in zip(tree.log_scores[1:], tree.depths[1:], strict=True)
            ]
            if slopes is not None:
                charged[r, :n] = self._charged_host(tree.parents, slopes)
        rows = num_reqs + np.arange(values.size + 1)
        order = allocation_order_host(values)
        # The fixed tree cost is paid per request that verifies a tree: with
        # the best k nodes, the requests among the first k in the order (one
        # request's lookup tree must not price the others' in).
        first_seen = np.zeros(values.size + 1)
        if values.size:
            owners = order[1] % num_reqs
            _, first = np.unique(owners, return_index=True)
            first_seen[first + 1] = 1.0
        tree_reqs = np.cumsum(first_seen)  # [R * B + 1]
        curve = self.plain_step_cost.predict(rows) + context
        if self.tree_overhead_cost.ready:
            per_request = self.tree_overhead_cost.predict(np.maximum(tree_reqs, 1))
            curve = curve + tree_reqs * per_request
        if slopes is not None:
            curve[1:] += np.cumsum(charged.T.reshape(-1)[order[1]])
        return values, curve, order

    def _lookup_only_choice(
        self, trees: list[UnionTree | None], context: float
    ) -> tuple[np.ndarray, float]:
        """(nodes per request [R], expected committed tokens per second) of
        the best prefixes of lookup-only trees (:meth:`_lookup_only_step`)."""
        values, curve, order = self._lookup_only_step(trees, context)
        return allocate_nodes_host(values, curve, order=order)

    def _charged_host(self, parents: list[int], slopes: list[float]) -> list[float]:
        """[n] per-node seconds of one host tree (``parents``, root first):
        :meth:`node_kinds` at ``slopes``."""
        n = len(parents) - 1
        if self.charge_all_nodes:
            return [slopes[0]] * n
        branch = self.branch_rows(parents)
        return [slopes[0]] * (n - branch) + [slopes[0] + slopes[1]] * branch

    def choose_lookup_only(self, trees: list[UnionTree | None]) -> list[int]:
        """Nodes to keep per request of lookup-only trees (a step whose
        drafter pass was skipped; None: a request without one): the prefixes
        that beat a plain step, or none.

        When none pays, the best choice of at least one node is verified now
        and then (exploration), as many times as keep its expected loss
        within ``explore_share`` of the declined steps: a lookup tree's price
        is learned only from verified trees (the tree steps' cost, the lookup
        calibration), so a few slow steps or early rejections would otherwise
        price lookup out for good."""
        num_reqs = len(trees)
        sizes = [0 if t is None else t.num_nodes for t in trees]
        context = self.context_drafter_cost.estimate(num_reqs)
        if not self.plain_step_cost.ready or context is None:
            return sizes  # warming up: what the lookup proposes
        values, curve, order = self._lookup_only_step(trees, context)
        counts, rate = allocate_nodes_host(values, curve, order=order)
        if not counts.any() and any(sizes):
            self._lookup_explore_credit += self.explore_share
            probe, probe_rate = allocate_nodes_host(values, curve, 1, order)
            loss = 1.0 - probe_rate / max(rate, 1e-12)
            if loss <= self._lookup_explore_credit:
                self._lookup_explore_credit -= loss
                self.num_lookup_explorations += 1
                counts = probe
        counts = np.minimum(counts, sizes)
        # A skipped step's request-steps count as 0 nodes (draft_next); a
        # lookup-only step's are counted by the nodes it verifies instead.
        histogram = self._lookup_only_histogram
        histogram += np.bincount(counts, minlength=histogram.shape[0])
        self._skipped_request_steps -= min(self._last_skipped, num_reqs)
        self._last_skipped = 0
        return counts.tolist()
    # <<< lookup

    def choose(
        self,
        tree: DraftTree,
        grammar_values=None,
        # >>> lookup
        lookup_rows=None,
        lookup_only: list[UnionTree | None] | None = None,
        # <<< lookup
    ) -> torch.Tensor:
        """[R] nodes to keep per request (a prefix of each tree).

        Args:
            tree: the batch's drafter trees (union trees on ``lookup_rows``).
            grammar_values: ``(rows [Rc], path probabilities [Rc, B], depths
                [Rc, B])`` on the device, or None: the requests whose trees the
                scheduler builds with their grammars are valued by the
                grammar-shaped tree it built for them last (the best estimate
                of the one it builds next: the drafter's own tree does not see
                the grammar), calibrated with :attr:`grammar_calibration`.
        """
        num_nodes = tree.num_nodes
        num_reqs = tree.num_reqs
        self._node_price = 0.0
        self._grammar_factors = None
        prices = self.prices(
            tree,
            grammar_values,
            # >>> lookup
            lookup_rows,
            # <<< lookup
        )
        if prices is None:
            return num_nodes  # warming up: the whole budget
        values, full, context, plain_target = prices
        node_depths = tree.depths[:, 1:]  # [R, B]
        first = torch.arange(values.shape[1], device=values.device)  # [B]
        # [R * B + 1] the verify step with k nodes in all, plus the drafter pass
        # after it: full (drafting on) or context-only (skipping). With k >= 1
        # every request is charged a tree's overhead (an upper bound: some may
        # keep none).
        rows = num_reqs + np.arange(values.numel() + 1)
        verify = self.tree_step_seconds(rows, num_reqs, per_node=False)
        verify[0] = plain_target  # k = 0: no tree
        # Both step-time curves to the device in one pinned, non-blocking copy.
        curves = torch_utils.async_tensor_h2d(
            np.stack([verify + full, verify + context]),
            device=values.device,
            dtype=torch.float32,
        )
        # Per-node charges of the best k nodes (branch rows, or every node of
        # a recurrent target), on the device.
        charged = self._charged_seconds(values, tree)
        if charged is None:
            charged = torch.zeros_like(curves[0])
        curves = curves + charged
        counts, drafting = allocate_nodes(values, curves[0])
        skip_counts, skipping = allocate_nodes(values, curves[1])
        # [s] a step without drafts: plain target step + context-only pass.
        plain_step = plain_target + context
        plain = num_reqs / plain_step
        # >>> lookup
        # Without drafter passes the lookup trees are still verified: what
        # they commit per second is what drafting is weighed against.
        if lookup_only is not None:
            plain = max(plain, self._lookup_only_choice(lookup_only, context)[1])
        # <<< lookup

        def deepest(n):  # the deepest node among each request's first n[r]
            return torch.where(first < n.unsqueeze(1), node_depths, 0).max()

        # One host read for the whole decision (the trees go to the host next
        # anyway, for the scheduler).
        drafted_nodes = counts.sum()
        (
            drafting,
            skipping,
            deepest_drafting,
            deepest_skipping,
            drafted_charges,
            drafted_nodes,
        ) = torch.stack(
            [
                drafting,
                skipping,
                deepest(counts).float(),
                deepest(skip_counts).float(),
                # gather, not charged[drafted_nodes]: no host read of the index
                charged.gather(0, drafted_nodes.view(1)).squeeze(0).float(),
                drafted_nodes.float(),
            ]
        ).tolist()
        deepest_chosen = int(deepest_drafting)
        # This batch as a sample of drafting every step: its best prefix's step.
        seconds = float(verify[int(drafted_nodes)] + drafted_charges + full)
        self._record_advantage(drafting * seconds, seconds, plain * seconds)
        if self._switch.drafting:
            self._switch.drafting = self.advantage >= 1 - self.max_loss
        else:
            self._switch.drafting = self.advantage > 1 + self.min_gain
        if not self._switch.drafting:
            # Context-only passes, then a probe. Its expected loss against
            # decoding without drafts: at most its pass over a context-only
            # one (its tree is then verified only as far as it pays), at most
            # what a drafting step loses on average.
            loss = min(
                max(full - context, 0.0),
                max(self._switch.mean_seconds - self._switch.mean_tokens / plain, 0.0),
            )
            # Skipped steps per probe such that loss <= share * (run + 1) steps.
            self._switch.skip_left = int(
                min(
                    self.max_skip,
                    max(
                        1,
                        math.ceil(loss / (self.explore_share * max(plain_step, 1e-9)))
                        - 1,
                    ),
                )
            )
            # This tree is drafted already (its pass is paid): verify the prefix
            # that beats one plain step, or nothing.
            if skipping > plain * (1 + self.min_gain):
                counts, deepest_chosen = skip_counts, int(deepest_skipping)
            else:
                counts, deepest_chosen = torch.zeros_like(skip_counts), 0
        # A node of a grammar-built tree pays when its value beats the rate of
        # this step (or of plain decoding, when no drafted prefix does) over the
        # seconds one more verify row costs (past the first node: the tree's
        # own overhead is the drafting decision's, not a node's).
        rate = drafting if self._switch.drafting else max(skipping, plain)
        k = min(max(int(drafted_nodes), 1), verify.shape[0] - 2)
        self._node_price = max(rate * float(verify[k + 1] - verify[k]), 0.0)
        counts = torch.minimum(counts, num_nodes)
        self._drafted_histogram.index_add_(
            0, counts, torch.ones_like(counts, dtype=torch.int64)
        )
        self._deepest = [*self._deepest[1 - self.depth_window :], deepest_chosen]
        return counts
