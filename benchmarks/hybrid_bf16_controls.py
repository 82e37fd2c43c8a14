# SPDX-License-Identifier: Apache-2.0
"""Is a bf16 hybrid (Gated DeltaNet) target's ddtree output vLLM's own
non-speculative output? Controls for issue 44.

The tiny Qwen3-Next target and drafter of ``tests/test_e2e_hybrid.py`` (bf16,
attention output projections silenced, 6 prompts, 32 greedy tokens, emitted
logprobs), each engine in a fresh process:

* ``nospec``: the reference (batch 6); ``nospec_b1``: each prompt alone (is
  vLLM's own output batch-invariant here?);
* ``dflash``: vLLM's own chain (its random tiny drafter, K = 4);
* ``ddtree_random``: ddtree with the same drafter (B = 30; it accepts almost
  nothing, so nearly every row is a tree root);
* ``ddtree_scripted``: ddtree whose drafter puts the reference continuation at
  rank 1 under a wrong rank 0 (every accepted path is a sibling path);
* ``fp32``: the target in float32.

For each: prompts identical to ``nospec``, the first diverging step, the top-2
logprobs of both at that step (the margin a rounding difference flipped), and
the largest logprob difference before any divergence. Writes JSON, markdown and
a PNG; the JSON's ``goals`` are ddtree's: every prompt identical and every
logprob equal (bit for bit).

    .venv/bin/python benchmarks/hybrid_bf16_controls.py \\
        --out benchmarks/results/hybrid_bf16_controls
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["nospec", "nospec_b1", "dflash", "ddtree_random", "ddtree_scripted", "fp32"]
MAX_TOKENS = 32


def cpu_flags() -> list[str]:
    """AVX-512 and AMX flags only (bench_core.cpu_flags without AVX2)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_core import cpu_flags as all_flags

    return [f for f in all_flags() if f.startswith(("avx512", "amx"))]


def run_one(method: str, models: Path, reference: Path | None) -> dict:
    """One engine (in this process): tokens and emitted logprobs (top 2)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest
    import pytest

    conftest.patch_vllm_for_tests()
    import vllm
    from test_e2e_hybrid import BLOCK_SIZE, BUDGET, _silence_attention, prompts

    from vllm_ddtree import tiny_models

    target, drafter = models / "target", models / "drafter"
    if not (drafter / "config.json").exists():
        tiny_models.make_arch_target(target, "qwen3_next", seed=1, dtype="bfloat16")
        _silence_attention(target)
        tiny_models.make_dflash_drafter(
            drafter,
            target,
            block_size=BLOCK_SIZE,
            seed=2,
            num_layers=1,
            dtype="bfloat16",
        )
    p = prompts()
    ddtree = {
        "method": "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": BUDGET,
        "ddtree_budget": "fixed",
    }
    spec = {
        "dflash": {
            "method": "dflash",
            "model": str(drafter),
            "num_speculative_tokens": 4,
        },
        "ddtree_random": ddtree,
        "ddtree_scripted": ddtree,
    }.get(method)
    if method == "ddtree_scripted":
        ref = json.loads(reference.read_text())["tokens"]
        full = {tuple(q): q + r for q, r in zip(p, ref, strict=True)}
        conftest.install_scripted_drafter(
            pytest.MonkeyPatch(), conftest._truth_at_rank_1(full)
        )
    try:
        llm = vllm.LLM(
            model=str(target),
            dtype="float32" if method == "fp32" else "bfloat16",
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=512,
            speculative_config=spec,
            seed=0,
            disable_log_stats=False,
        )
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2
    )
    groups = [[q] for q in p] if method == "nospec_b1" else [p]
    tokens, logprobs = [], []
    for group in groups:
        for out in llm.generate(
            [{"prompt_token_ids": q} for q in group], params, use_tqdm=False
        ):
            tokens.append(list(out.outputs[0].token_ids))
            logprobs.append(
                [
                    {str(t): v.logprob for t, v in d.items()}
                    for d in out.outputs[0].logprobs
                ]
            )
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "drafts": metrics.get("vllm:spec_decode_num_drafts"),
        "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens"),
    }


def compare(ref: dict, run: dict) -> dict:
    if "error" in run:
        return {"error": run["error"]}
    first, worst, margins = [], 0.0, []
    for k, (a, b) in enumerate(zip(ref["tokens"], run["tokens"], strict=True)):
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first.append(d)
        for i in range(len(a) if d is None else d):
            for t, v in ref["logprobs"][k][i].items():
                if t in run["logprobs"][k][i]:
                    worst = max(worst, abs(v - run["logprobs"][k][i][t]))
        if d is not None:
            top = [
                sorted(
                    ((int(t), round(v, 4)) for t, v in lp[k][d].items()),
                    key=lambda x: -x[1],
                )
                for lp in (ref["logprobs"], run["logprobs"])
            ]
            margins.append(
                {"prompt": k, "step": d, "nospec_top2": top[0], "this_top2": top[1]}
            )
    return {
        "identical": sum(d is None for d in first),
        "prompts": len(first),
        "first_divergence": first,
        "max_logprob_diff_before_divergence": worst,
        "divergences": margins,
        "drafts": run.get("drafts"),
        "accepted": run.get("accepted"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/hybrid_bf16_controls")
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    ap.add_argument("--reference", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        ref = Path(args.reference) if args.reference else None
        result = run_one(args.one, Path(args.models), ref)
        Path(args.result).write_text(json.dumps(result))
        return
    work = Path(tempfile.mkdtemp(prefix="hybrid_controls_"))
    runs = {}
    for method in METHODS:
        out = work / f"{method}.json"
        cmd = [
            sys.executable,
            __file__,
            "--one",
            method,
            "--models",
            str(work / "models"),
        ]
        cmd += ["--result", str(out), "--reference", str(work / "nospec.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        runs[method] = (
            json.loads(out.read_text())
            if out.exists()
            else {"error": proc.stderr.strip().splitlines()[-1][:300]}
        )
        print(method, "done", flush=True)
    table = {m: compare(runs["nospec"], runs[m]) for m in METHODS if m != "nospec"}
    goals = []
    for m in ("ddtree_random", "ddtree_scripted"):
        row = table[m]
        goals.append(
            {
                "name": f"{m}: prompts greedy-identical to no speculation",
                "value": row.get("identical", 0),
                "target": row.get("prompts", 6),
                "pass": row.get("identical") == row.get("prompts"),
            }
        )
        diff = row.get("max_logprob_diff_before_divergence")
        goals.append(
            {
                "name": f"{m}: max |logprob - no speculation's|",
                "value": diff,
                "target": 0.0,
                "pass": diff == 0.0,
            }
        )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu_flags": cpu_flags(),
        "env": {
            k: os.environ[k]
            for k in (
                "PYTHONPATH",
                "EMULATE_AVX2",
                "ATEN_CPU_CAPABILITY",
                "ONEDNN_MAX_CPU_ISA",
            )
            if k in os.environ
        },
        "controls": table,
        "goals": goals,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [
        "# bf16 hybrid (tiny Qwen3-Next) vs no speculation: controls",
        "",
        f"`{result['command']}`; CPU flags: {', '.join(result['cpu_flags']) or 'no AVX-512'}"
        + (f"; env {result['env']}" if result["env"] else ""),
        "",
        "| run | identical | first divergence | max logprob diff before it | drafts / accepted |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for m, row in table.items():
        if "error" in row:
            lines.append(f"| {m} | refused: {row['error']} | | | |")
            continue
        lines.append(
            f"| {m} | {row['identical']}/{row['prompts']} | {row['first_divergence']} "
            f"| {row['max_logprob_diff_before_divergence']:.3g} "
            f"| {row['drafts']} / {row['accepted']} |"
        )
    lines += [
        "",
        "Divergences (top-2 logprobs of both runs at the diverging step):",
        "",
    ]
    for m, row in table.items():
        for d in row.get("divergences", []):
            lines.append(
                f"- {m}, prompt {d['prompt']} step {d['step']}: no speculation "
                f"{d['nospec_top2']}, {m} {d['this_top2']}"
            )
    lines += ["", "Goals:", ""]
    lines += [
        f"- {g['name']}: {g['value']} (target {g['target']}, {'pass' if g['pass'] else 'FAIL'})"
        for g in goals
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m, row in table.items() if "error" not in row]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].bar(names, [table[m]["identical"] for m in names])
    axes[0].set_title("prompts greedy-identical (of 6)")
    axes[1].bar(names, [table[m]["max_logprob_diff_before_divergence"] for m in names])
    axes[1].set_title("max |logprob diff| before divergence")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
