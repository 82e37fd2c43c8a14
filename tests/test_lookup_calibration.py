# SPDX-License-Identifier: Apache-2.0
"""Online calibration of lookup probabilities (``lookup_calibration.py``)
on synthetic streams with known acceptance rates (fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_ddtree.lookup_calibration import LookupCalibration
from vllm_ddtree.lookup_tree import LookupDraft


def test_converges_to_each_buckets_rate():
    """Two buckets a source scores alike (raw 0.9, depth 1) that the target
    accepts at 0.3 (drafter disagrees) and 0.8 (drafter agrees), and a deep
    bucket at 0.1. n = 4000 draws each: the calibrated values land within 0.03
    (about 4 standard errors at these rates)."""
    rng = np.random.default_rng(0)
    cal = LookupCalibration()
    rates = {(1, False): 0.3, (1, True): 0.8, (6, False): 0.1}
    n = 4000
    for (depth, agreed), rate in rates.items():
        cal.observe(
            np.full(n, depth), np.full(n, 0.9), np.full(n, agreed), rng.random(n) < rate
        )
    for (depth, agreed), rate in rates.items():
        got = cal.probability([depth], [0.9], [agreed])[0]
        assert abs(got - rate) < 0.03, (depth, agreed, got, rate)
    # An untouched bucket keeps the source's own score.
    assert cal.probability([2], [0.5], [False])[0] == pytest.approx(0.5)


def test_starts_at_the_raw_score_and_moves_with_evidence():
    cal = LookupCalibration(prior_weight=2.0)
    assert cal.probability([1], [0.7], [False])[0] == pytest.approx(0.7)
    cal.observe([1, 1], [0.7, 0.7], [False, False], [False, False])
    assert cal.probability([1], [0.7], [False])[0] == pytest.approx(1.4 / 4)


def test_calibrated_siblings_sum_to_at_most_one():
    cal = LookupCalibration()
    n = 200
    cal.observe(np.ones(n), np.full(n, 0.5), np.zeros(n), np.ones(n, dtype=bool))
    draft = LookupDraft([4, 5, 6], [-1, -1, 0], [0.5, 0.5, 0.5])
    out = cal.calibrate(draft)
    assert out.probs[0] + out.probs[1] <= 1.0
    assert out.probs[0] == pytest.approx(out.probs[1])  # same bucket, same rate
    assert out.tokens == draft.tokens and out.parents == draft.parents


@pytest.mark.parametrize(
    "kwargs", [dict(max_depth=0), dict(num_bins=0), dict(prior_weight=0.0)]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="lookup calibration needs"):
        LookupCalibration(**kwargs)
