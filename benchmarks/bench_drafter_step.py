# SPDX-License-Identifier: Apache-2.0
"""Training throughput of the DFlash drafter: labelled predictions per CPU-second.

Times ``vllm_ddtree.drafter.train.train`` step by step (its own log: seconds and
labelled block positions per step) for several recipes on ONE synthetic work
directory: the real token ids and lengths of the committed generations pack (so
the draft vocabulary covers what it covers in training), random features and
random top-k soft labels (timing does not depend on their values). Each recipe runs
in its own process, recipes interleaved over ``--rounds``; a recipe can run another
checkout's code (``--baseline-commit``: v2's recipe as committed, through
``git worktree``), so "before" and "after" are the same measurement.

Writes ``<out>/<tag>.json`` (per-step rows, machine info, goals), ``.md`` and
``.png``. Pause any background training while this runs.

Usage:
    .venv/bin/python benchmarks/bench_drafter_step.py --baseline-commit f18d66b
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
# A child (--run-one) imports the vllm_ddtree its PYTHONPATH names (maybe another
# checkout's); the parent, this one's.
if "--run-one" not in sys.argv and str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PACK = REPO_ROOT / "vllm_ddtree" / "drafter" / "generations" / "smollm2_135m.jsonl.gz"
WIDTH = 4 * 576  # 4 taps of SmolLM2-135M's hidden size
TOPK = 20

# v2's committed recipe (TRAINING.md: bf16 autocast), the same with fp32 forwards,
# and v3 candidates ("auto": fp32 on CPUs without native bf16 GEMMs).
RECIPES = {
    "v2": dict(seqs_per_step=8, anchors_per_seq=8, autocast="bf16"),
    "v2-fp32": dict(seqs_per_step=8, anchors_per_seq=8, autocast="none"),
    "v3-8x64": dict(seqs_per_step=8, anchors_per_seq=64, bucketed=True, distill=0.5,
                    autocast="auto"),
    "v3-8x32": dict(seqs_per_step=8, anchors_per_seq=32, bucketed=True, distill=0.5,
                    autocast="auto"),
}
COMMON = dict(target_layer_ids=[1, 9, 18, 27], num_layers=3, block_size=16,
              mask_token_id=16, lr=6e-4, loss_decay=7.0, ckpt_every=10**9,
              eval_every=10**9, seed=0, val_every_nth_seq=50, draft_vocab_size=16384,
              warmup=50)


def make_workdir(workdir: Path, num_seqs: int, seed: int) -> None:
    """Synthetic features beside real token ids, in ``data.extract_features``'s
    layout (length order; top-k files only when the checkout reads them)."""
    rng = np.random.default_rng(seed)
    with gzip.open(PACK, "rt") as f:
        rows = [r for r in map(json.loads, f) if len(r.get("output_ids", [])) >= 8]
    picked = [rows[i] for i in rng.choice(len(rows), size=num_seqs, replace=False)]
    picked.sort(key=lambda r: len(r["prompt_ids"]) + len(r["output_ids"]))
    seqs = [r["prompt_ids"] + r["output_ids"] for r in picked]
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    n = len(tokens)
    feats = (rng.standard_normal((n, WIDTH), dtype=np.float32)).astype(np.float32)
    bf16 = (feats.view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine here
    workdir.mkdir(parents=True, exist_ok=True)
    bf16.tofile(workdir / "features.bin")
    tokens.tofile(workdir / "tokens.bin")
    ids = rng.integers(0, 49152, size=(n, TOPK), dtype=np.int32)
    ids[:-1, 0] = tokens[1:]
    ids.tofile(workdir / "topk_ids.bin")
    logp = np.sort(-rng.exponential(2.0, size=(n, TOPK)), axis=1)[:, ::-1]
    logp.astype(np.float16).tofile(workdir / "topk_logprobs.bin")
    lengths = [len(s) for s in seqs]
    index = {"target_layer_ids": COMMON["target_layer_ids"], "hidden_size": 576,
             "offsets": np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist(),
             "lengths": lengths, "prompt_lengths": [len(r["prompt_ids"]) for r in picked],
             "ids": [r["id"] for r in picked], "topk": TOPK}
    (workdir / "index.json").write_text(json.dumps(index))


def run_one(workdir: Path, recipe: str, steps: int, out: Path) -> None:
    """In a child process: ``steps`` training steps of ``recipe`` with whatever
    ``vllm_ddtree`` is first on ``sys.path``."""
    import torch

    from vllm_ddtree import assets
    from vllm_ddtree.drafter import data, train

    fields = {f.name for f in dataclasses.fields(train.TrainConfig)}
    index_fields = {f.name for f in dataclasses.fields(data.FeatureIndex)}
    if "topk" not in index_fields:  # an older checkout: its index has no such key
        meta = json.loads((workdir / "index.json").read_text())
        meta.pop("topk", None)
        (workdir / "index.json").write_text(json.dumps(meta))
    wanted = {**COMMON, **RECIPES[recipe], "steps": steps}
    unknown = set(wanted) - fields
    if unknown:
        raise SystemExit(f"recipe {recipe} needs {sorted(unknown)}: not in this checkout")
    config = train.TrainConfig(**wanted)
    train.train(workdir, assets.smollm2_target(), config)
    log = [json.loads(x) for x in (workdir / train.LOG).read_text().splitlines()]
    rows = [r for r in log if "loss" in r]
    out.write_text(json.dumps({"recipe": recipe, "rows": rows,
                               "threads": torch.get_num_threads()}))


def main() -> None:
    from bench_core import machine_info

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-seqs", type=int, default=400)
    p.add_argument("--baseline-commit", default=None,
                   help="run the v2 recipes with this commit's code (git worktree)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--tag", default="drafter_step_cpu")
    p.add_argument("--run-one", nargs=4, metavar=("WORKDIR", "RECIPE", "STEPS", "OUT"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_one:
        workdir, recipe, steps, out = args.run_one
        run_one(Path(workdir), recipe, int(steps), Path(out))
        return
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_drafter_step_"))
    data_dir = tmp / "data"
    make_workdir(data_dir, args.num_seqs, seed=0)
    baseline = None
    if args.baseline_commit:
        baseline = tmp / "baseline"
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach",
                        str(baseline), args.baseline_commit], check=True,
                       stdout=subprocess.DEVNULL)
    results: dict[str, list[dict]] = {r: [] for r in args.recipes}
    try:
        for rnd in range(args.rounds):
            for recipe in args.recipes:
                work = tmp / f"{recipe}-{rnd}"
                work.mkdir()
                for name in ("features.bin", "tokens.bin", "topk_ids.bin",
                             "topk_logprobs.bin", "index.json"):
                    if name == "index.json":
                        (work / name).write_text((data_dir / name).read_text())
                    else:
                        (work / name).symlink_to(data_dir / name)
                code = baseline if (recipe.startswith("v2") and baseline) else REPO_ROOT
                env = {**os.environ, "PYTHONPATH": str(code)}
                out = work / "result.json"
                subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run-one",
                                str(work), recipe, str(args.steps), str(out)],
                               check=True, env=env, cwd=str(code))
                res = json.loads(out.read_text())
                res["code"] = "baseline " + args.baseline_commit if code == baseline else "HEAD"
                results[recipe].append(res)
                print(f"round {rnd} {recipe}: done", flush=True)
    finally:
        if baseline is not None:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force",
                            str(baseline)], check=False)
    summary = {}
    for recipe, runs in results.items():
        rows = [r for run in runs for r in run["rows"][args.skip:]]
        secs = sum(r["s"] for r in rows)
        preds = sum(r["predictions"] for r in rows)
        threads = runs[0]["threads"]
        summary[recipe] = {
            "code": runs[0]["code"], "steps_timed": len(rows),
            "s_per_step": round(statistics.median(r["s"] for r in rows), 3),
            "predictions_per_step": round(preds / len(rows), 1),
            "predictions_per_s": round(preds / secs, 1),
            "predictions_per_cpu_s": round(preds / secs / threads, 1),
            "per_round_predictions_per_s": [
                round(sum(r["predictions"] for r in run["rows"][args.skip:])
                      / sum(r["s"] for r in run["rows"][args.skip:]), 1) for run in runs],
            "threads": threads,
        }
    goals = []
    if "v2" in summary:
        base = summary["v2"]["predictions_per_cpu_s"]
        for recipe, s in summary.items():
            if recipe.startswith("v3"):
                ratio = s["predictions_per_cpu_s"] / base
                goals.append({"name": f"drafter training throughput {recipe} vs v2",
                              "value": round(ratio, 3), "target": 2.0, "pass": ratio >= 2.0})
    report = {"machine": machine_info(args, command), "recipes": RECIPES, "common": COMMON,
              "summary": summary, "goals": goals, "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    flags = [f for f in report["machine"]["cpu_flags"] if f.startswith(("avx", "amx"))]
    lines = [f"# Drafter training throughput ({args.tag})", "",
             f"`{command}`", "",
             f"CPU: {report['machine']['cpu_model']} ({report['machine']['os_cpu_count']} "
             f"cores; {' '.join(flags)}); commit {report['machine']['git_commit']}; "
             f"{args.num_seqs} sequences with the generations pack's real tokens and "
             f"lengths, random features and top-{TOPK} soft labels; {args.rounds} rounds "
             f"interleaved, {args.steps} steps each, first {args.skip} left out.", "",
             "| recipe | code | seqs x anchors | s / step | labelled predictions / step "
             "| predictions / s | per round | vs v2 |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    for recipe, s in summary.items():
        r = RECIPES[recipe]
        vs = (f"{s['predictions_per_cpu_s'] / summary['v2']['predictions_per_cpu_s']:.2f}x"
              if "v2" in summary else "-")
        lines.append(f"| {recipe} | {s['code']} | {r['seqs_per_step']} x "
                     f"{r['anchors_per_seq']} | {s['s_per_step']} | "
                     f"{s['predictions_per_step']} | {s['predictions_per_s']} | "
                     f"{s['per_round_predictions_per_s']} | {vs} |")
    lines += ["", "Goals:", ""] + [
        f"- {g['name']}: {g['value']} (target >= {g['target']}): "
        f"{'PASS' if g['pass'] else 'FAIL'}" for g in goals]
    (args.out / f"{args.tag}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        names = list(summary)
        ax.barh(names, [summary[n]["predictions_per_s"] for n in names])
        ax.set_xlabel("labelled predictions / s (training)")
        fig.tight_layout()
        fig.savefig(args.out / f"{args.tag}.png", dpi=100)
        plt.close(fig)
    except ImportError:
        pass
    print("\n".join(lines))


if __name__ == "__main__":
    main()
