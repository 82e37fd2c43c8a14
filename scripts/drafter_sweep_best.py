# SPDX-License-Identifier: Apache-2.0
"""Prints the learning rate of the drafter LR sweep's best run (issue 47).

    python scripts/drafter_sweep_best.py WORKDIR/sweep

Each run is a directory ``lr-<LR>`` with its ``train_log.jsonl``; the best is
the highest held-out chain tau (``val_tau_chain``) at the run's last
evaluation, all runs at the same step (the sweep's length). Runs not at that
step are an error: a sweep still running picks nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def last_evaluation(log: Path) -> dict | None:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("val_tau_chain") is not None]
    return evals[-1] if evals else None


def best_lr(sweep: Path) -> str:
    runs = {}
    for log in sorted(sweep.glob("lr-*/train_log.jsonl")):
        last = last_evaluation(log)
        if last is not None:
            runs[log.parent.name.removeprefix("lr-")] = last
    if not runs:
        raise SystemExit(f"no evaluated sweep run under {sweep}")
    steps = {r["step"] for r in runs.values()}
    if len(steps) != 1:
        raise SystemExit(f"sweep runs end at different steps {sorted(steps)}: not finished")
    return max(runs, key=lambda lr: runs[lr]["val_tau_chain"])


if __name__ == "__main__":
    print(best_lr(Path(sys.argv[1])))
