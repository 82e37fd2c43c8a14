# SPDX-License-Identifier: Apache-2.0
"""The drafter campaign's LR choice (scripts/drafter_sweep_best.py): the run
with the highest held-out chain tau at its last evaluation, and no choice
while the sweep's runs end at different steps (a sweep still running)."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "drafter_sweep_best",
    Path(__file__).resolve().parents[1] / "scripts" / "drafter_sweep_best.py",
)
sweep_best = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sweep_best)


def _run(sweep: Path, lr: str, evals: list[tuple[int, float]]) -> None:
    d = sweep / f"lr-{lr}"
    d.mkdir(parents=True)
    rows = []
    for step, tau in evals:
        rows.append({"step": step - 1, "loss": 1.0})  # a training row, no eval
        rows.append({"step": step, "loss": 1.0, "val_tau_chain": tau})
    (d / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_best_last_evaluation_wins(tmp_path):
    # 3e-4 led early, 6e-4 ends best: the last evaluation decides.
    _run(tmp_path, "3e-4", [(50, 1.40), (100, 1.45)])
    _run(tmp_path, "6e-4", [(50, 1.30), (100, 1.50)])
    _run(tmp_path, "1.2e-3", [(50, 1.35), (100, 1.48)])
    assert sweep_best.best_lr(tmp_path) == "6e-4"


def test_an_unfinished_sweep_picks_nothing(tmp_path):
    _run(tmp_path, "3e-4", [(50, 1.40), (100, 1.45)])
    _run(tmp_path, "6e-4", [(50, 1.50)])
    with pytest.raises(SystemExit, match="different steps"):
        sweep_best.best_lr(tmp_path)
    with pytest.raises(SystemExit, match="no evaluated sweep run"):
        sweep_best.best_lr(tmp_path / "empty")
