# SPDX-License-Identifier: Apache-2.0
"""Two-sample law tests shared by the end-to-end sampling tests."""

import math
from collections import Counter

DELTA = 1e-6


def tv_bound(num_cells: int, n1: int, n2: int, delta: float = DELTA) -> float:
    """TV between the empirical laws of two independent samples (n1, n2 draws) of
    one law on at most k cells exceeds this with probability < delta:
    E|p1_i - p2_i| <= sqrt(p_i (1 - p_i) (1/n1 + 1/n2)) and, by Cauchy-Schwarz,
    sum_i sqrt(p_i (1 - p_i)) <= sqrt(k - 1), so E[TV] <= 0.5 sqrt((k - 1) s) with
    s = 1/n1 + 1/n2; a draw moves TV by at most 1/n1 (resp. 1/n2), so McDiarmid gives
    P(TV > E[TV] + t) <= exp(-2 t^2 / s): t = sqrt(ln(1/delta) s / 2)."""
    s = 1.0 / n1 + 1.0 / n2
    return 0.5 * math.sqrt((num_cells - 1) * s) + math.sqrt(math.log(1 / delta) * s / 2)


def joint_tv(a_outs, b_outs, cut) -> tuple[float, int]:
    """TV between the empirical laws of ``o[cut]`` over two lists of outputs, and
    the number of cells the first one visits."""
    a = Counter(tuple(o[cut]) for o in a_outs)
    b = Counter(tuple(o[cut]) for o in b_outs)
    cells = set(a) | set(b)
    tv = 0.5 * sum(abs(a[c] / len(a_outs) - b[c] / len(b_outs)) for c in cells)
    return tv, len(a)
