# SPDX-License-Identifier: Apache-2.0
"""``ddtree_budget="auto"``: per-step node budgets and drafter skipping (worker).

Each step the runner reports what it measured (rows verified, seconds spent in
the target step and in the drafter pass, accepted depths); the controller keeps

* a ``StepCostModel`` (budget.py) of the target step, seconds =
  ``fixed + per_row * rows``: a start-up profile (vLLM's dummy forward at a few
  row counts, :meth:`BudgetController.profile`), then every measured step;
* two drafter cost models, seconds = ``a + b * R``: the full DFlash pass (block
  queries, draft logits, trees) and the context-only pass (the drafter's
  context K/V of the new tokens, no drafter forward, nothing drafted);
* an ``AcceptanceCalibration`` (budget.py) of the draft path
  probabilities, per depth, from what the target accepted.

When the drafter has built the batch's trees, :meth:`choose` trims each
request's tree to the prefix that maximises the batch's expected committed
tokens per second (``allocate_nodes``). If even the
best tree does not beat decoding without drafts (a context-only drafter pass and
R rows), the drafter runs context-only for the next steps (the drafter's context
stays complete: every committed token's target hidden states still reach its
K/V) and is tried again after 1, 2, 4, ... skipped steps (at most
``max_skip``), so the controller notices when drafting pays again.

Lossless: budgets depend on the draft scores and on timings only, never on the
target's samples of the step being verified; a trimmed tree is a prefix of the
DDTree, verified exactly as any tree.
"""

from __future__ import annotations

import torch

from vllm_ddtree.budget import AcceptanceCalibration, StepCostModel, allocate_nodes
from vllm_ddtree.tree import DraftTree

__all__ = ["BudgetController"]


class BudgetController:
    """Chooses each step's node budget per request, and when to draft at all."""

    def __init__(self, max_depth: int, budget: int, device, max_skip: int = 64):
        self.budget = budget
        self.max_skip = max_skip
        self.target_cost = StepCostModel()
        self.full_drafter_cost = StepCostModel()
        self.context_drafter_cost = StepCostModel()
        self.calibration = AcceptanceCalibration(max_depth, device)
        self._skip_left = 0
        self._skip_len = 1
        # [B + 1] int64: request-steps that got 0, 1, ..., B nodes (device);
        # context-only steps count as 0.
        self.chosen_histogram = torch.zeros(
            budget + 1, dtype=torch.int64, device=device
        )
        self.num_skipped_steps = 0
        self._steps = 0
        self.retime_every = 512

    # ------------------------------------------------------------------ #
    # Measurements
    # ------------------------------------------------------------------ #

    def profile(self, runner, max_rows: int, repeats: int = 3) -> None:
        """Start-up fit of the target step: vLLM's dummy forward at a few row
        counts up to ``max_rows`` (the first run of each size is a warm-up),
        the drafter's share of each run taken out. Afterwards the online fit
        may not go below a quarter of the profiled per-row cost (a guard
        against steps slowed by other load)."""
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
        try:
            sizes = sorted({1, 8, 32, 64, 128, 256, 512, max_rows})
            for rows in [n for n in sizes if n <= max_rows]:
                for repeat in range(repeats):
                    spent[0] = 0.0
                    started = time.perf_counter()
                    runner._dummy_run(rows)
                    seconds = time.perf_counter() - started - spent[0]
                    if repeat:
                        self.target_cost.update(rows, seconds)
        finally:
            del drafter.dummy_run  # the class's method again
        if self.target_cost.ready:
            self.target_cost.min_per_row = 0.25 * self.target_cost.coefficients()[1]

    def record_step(self, rows: int, target_seconds: float) -> None:
        if rows > 0 and target_seconds > 0:
            self.target_cost.update(rows, target_seconds)

    def record_drafter(self, full: bool, num_reqs: int, seconds: float) -> None:
        if num_reqs > 0 and seconds > 0:
            model = self.full_drafter_cost if full else self.context_drafter_cost
            model.update(num_reqs, seconds)

    # ------------------------------------------------------------------ #
    # Decisions
    # ------------------------------------------------------------------ #

    def draft_next(self, num_reqs: int) -> bool:
        """Whether the coming drafter pass over ``num_reqs`` requests should
        draft (else: context only; its requests count as 0 nodes chosen)."""
        self._steps += 1
        skip = self.full_drafter_cost.has_samples and (
            not self.context_drafter_cost.has_samples
            or self._steps % self.retime_every == 0
        )  # time a context-only pass now and then: what skipping would save
        if not skip and self._skip_left > 0:
            self._skip_left -= 1
            skip = True
        if skip:
            self.num_skipped_steps += 1
            self.chosen_histogram[0] += num_reqs
        return not skip

    def choose(self, tree: DraftTree) -> torch.Tensor:
        """[R] nodes to keep per request (a prefix of each tree)."""
        num_nodes = tree.num_nodes
        full = self.full_drafter_cost.estimate(tree.num_reqs)
        if not self.target_cost.ready or full is None:
            return num_nodes  # warming up: the whole budget
        fixed, per_row = self.target_cost.coefficients()
        nodes = tree.scores[:, 1:]
        real = torch.arange(nodes.shape[1], device=nodes.device) < num_nodes.unsqueeze(
            1
        )
        probs = torch.where(real, nodes.exp(), 0.0)
        values = self.calibration.node_values(probs, tree.depths[:, 1:])
        # The next step's drafter pass is paid whatever the tree: part of fixed.
        counts, throughput = allocate_nodes(values, fixed + full, per_row)
        counts = torch.minimum(counts, num_nodes)
        # Until a context-only pass was timed (the first one comes soon, see
        # draft_next), assume it saves nothing.
        context = self.context_drafter_cost.estimate(tree.num_reqs)
        context = full if context is None else min(context, full)
        plain = tree.num_reqs / (fixed + per_row * tree.num_reqs + context)
        if float(throughput) <= plain * (1 + 1e-6):
            # Drafting does not pay at this load: context-only passes, then a probe.
            self._skip_left = self._skip_len
            self._skip_len = min(2 * self._skip_len, self.max_skip)
        else:
            self._skip_left = 0
            self._skip_len = 1
        self.chosen_histogram.index_add_(
            0, counts, torch.ones_like(counts, dtype=torch.int64)
        )
        return counts
