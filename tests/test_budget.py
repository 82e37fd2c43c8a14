# SPDX-License-Identifier: Apache-2.0
"""Cost-aware node budgets (vllm_ddtree.budget): the allocation is the exact
optimum (brute force over every per-request prefix choice on small cases), the
calibration follows acceptance, and the cost model recovers an affine step time."""

import itertools
import random

import pytest
import torch

from vllm_ddtree.budget import AcceptanceCalibration, StepCostModel, allocate_nodes


def brute_force(values, fixed, per_row):
    """Best throughput over every choice of a prefix length per request."""
    num_reqs, budget = values.shape
    best = (-1.0, None)
    for counts in itertools.product(range(budget + 1), repeat=num_reqs):
        gain = sum(float(values[r, :n].sum()) for r, n in enumerate(counts))
        rows = num_reqs + sum(counts)
        thr = (num_reqs + gain) / (fixed + per_row * rows)
        if thr > best[0] + 1e-12:
            best = (thr, counts)
    return best


def non_increasing(rng, num_reqs, budget):
    rows = []
    for _ in range(num_reqs):
        v = sorted((rng.random() ** rng.choice([1, 3]) for _ in range(budget)), reverse=True)
        cut = rng.randrange(budget + 1)  # padding nodes: value 0
        rows.append([x if i < cut else 0.0 for i, x in enumerate(v)])
    return torch.tensor(rows)


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_the_exact_optimum(seed):
    rng = random.Random(seed)
    num_reqs, budget = rng.randint(1, 3), rng.randint(1, 4)
    values = non_increasing(rng, num_reqs, budget)
    fixed, per_row = rng.uniform(0.5, 30.0), rng.uniform(0.05, 3.0)
    want_thr, want_counts = brute_force(values, fixed, per_row)
    counts, thr = allocate_nodes(values, fixed, per_row)
    assert thr.item() == pytest.approx(want_thr, rel=1e-5)
    # The chosen counts reach that optimum (ties between choices may differ).
    gain = sum(float(values[r, :n].sum()) for r, n in enumerate(counts.tolist()))
    got = (num_reqs + gain) / (fixed + per_row * (num_reqs + int(counts.sum())))
    assert got == pytest.approx(want_thr, rel=1e-5), (counts, want_counts)


def test_allocation_extremes():
    values = torch.tensor([[0.99, 0.98, 0.97], [0.01, 0.0, 0.0]])
    # Rows nearly free: take every node with value; costly rows: take none.
    counts, _ = allocate_nodes(values, fixed=100.0, per_row=1e-3)
    assert counts.tolist() == [3, 1]
    counts, thr = allocate_nodes(values, fixed=1.0, per_row=100.0)
    assert counts.tolist() == [0, 0]
    assert thr.item() == pytest.approx(2 / (1 + 100 * 2))
    # A confident request gets a large tree and a lost one none.
    counts, _ = allocate_nodes(values, fixed=20.0, per_row=1.0)
    assert counts.tolist() == [3, 0]


def test_allocation_keeps_prefixes_when_values_rise():
    """Calibrated values may rise along a request's node order: they are made
    non-increasing, so a later node is never taken without the ones before it."""
    values = torch.tensor([[0.1, 0.9, 0.9]])
    counts, _ = allocate_nodes(values, fixed=10.0, per_row=0.05)
    assert counts.tolist() == [3]
    counts, _ = allocate_nodes(values, fixed=1.0, per_row=0.2)
    assert counts.tolist() == [0]


def test_calibration_follows_acceptance():
    """A drafter that claims 0.8 per node where the target accepts depth 1 half
    the time and never depth 2: the factors move to 0.5/0.8 and 0."""
    cal = AcceptanceCalibration(max_depth=2, device="cpu", prior=1.0, decay=1.0)
    probs = torch.tensor([[0.8, 0.64]])
    depths = torch.tensor([[1, 2]])
    verified = torch.ones(1, 2, dtype=torch.bool)
    for step in range(2000):
        cal.update(probs, depths, verified, torch.tensor([step % 2]))
    f = cal.factors()
    assert f[1].item() == pytest.approx(0.5 / 0.8, rel=0.01)
    assert f[2].item() == pytest.approx(0.0, abs=0.01)
    values = cal.node_values(probs, depths)
    assert values[0, 0].item() == pytest.approx(0.5, rel=0.01)


def test_cost_model_recovers_an_affine_step():
    rng = random.Random(0)
    model = StepCostModel(decay=1.0)
    with pytest.raises(ValueError, match="two row counts"):
        model.coefficients()
    for _ in range(200):
        rows = rng.randint(1, 300)
        model.update(rows, 0.020 + 0.0011 * rows + rng.gauss(0, 0.0005))
    fixed, per_row = model.coefficients()
    assert fixed == pytest.approx(0.020, abs=0.001)
    assert per_row == pytest.approx(0.0011, rel=0.02)
    assert model.predict(100) == pytest.approx(0.130, rel=0.02)


def test_cost_model_forgets_old_load():
    model = StepCostModel(decay=0.9)
    for rows in (1, 50, 100) * 30:
        model.update(rows, 0.010 + 0.001 * rows)
    for rows in (1, 50, 100) * 30:  # the machine got twice as slow
        model.update(rows, 2 * (0.010 + 0.001 * rows))
    fixed, per_row = model.coefficients()
    assert per_row == pytest.approx(0.002, rel=0.05)


def _controller(per_row, full=0.010, context=0.002):
    from vllm_ddtree.vllm_adapter.budget_control import BudgetController

    controller = BudgetController(max_depth=4, budget=8, device="cpu")
    for rows in (1, 8, 32, 64, 128):
        controller.record_step(rows, 0.020 + per_row * rows)
    for num_reqs in (1, 2, 4):
        controller.record_drafter(True, num_reqs, full * num_reqs)
        controller.record_drafter(False, num_reqs, context * num_reqs)
    return controller


def _trees(sharpness, num_reqs=2, seed=0):
    from vllm_ddtree.tree import build_ddtree

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, 4, 50, generator=g)
    logits[..., 7] += sharpness  # token 7 is the drafter's favourite at every depth
    return build_ddtree(logits, 8, torch.zeros(num_reqs, dtype=torch.int64))


def test_controller_keeps_confident_trees_when_rows_are_cheap():
    pytest.importorskip("vllm")
    controller = _controller(per_row=1e-5)
    counts = controller.choose(_trees(sharpness=12.0))
    # The favourite chain (q ~ 1 per depth) at least; rows are nearly free.
    assert (counts >= 4).all(), counts
    assert controller.draft_next(2)
    assert controller.chosen_histogram.sum() == 2


def test_controller_stops_drafting_then_probes_back():
    """Expensive rows and unsure drafts: no node is worth its row and a
    context-only pass is cheaper than drafting, so the drafter skips 1, 2, 4 ...
    steps between probes."""
    pytest.importorskip("vllm")
    controller = _controller(per_row=0.01)
    pattern = []
    for _ in range(4):
        counts = controller.choose(_trees(sharpness=0.0))
        assert counts.tolist() == [0, 0]
        skipped = 0
        while not controller.draft_next(2):
            skipped += 1
        pattern.append(skipped)
    assert pattern == [1, 2, 4, 8]
    # Every context-only step's requests count as 0 nodes chosen.
    assert controller.chosen_histogram[0] == 2 * (4 + sum(pattern))
    # Confident drafts again: drafting pays, and the skip length resets.
    controller = _controller(per_row=1e-5)
    controller.choose(_trees(sharpness=0.0))
    assert controller.choose(_trees(sharpness=12.0)).min() >= 4
    assert controller.draft_next(2)
