# SPDX-License-Identifier: Apache-2.0
"""Structured outputs with ddtree: tau and tokens/s with a JSON schema vs without,
ddtree vs no speculation, side by side (the real pair: SmolLM2-135M-Instruct and
the committed DFlash drafter).

Every method's engine is alive for the whole run and the methods take each chunk
of prompts in turn (bench_real.py's harness: timers, spec-decode counters), for
two workloads on the same prompts: ``plain`` (no constraint) and ``json``
(``structured_outputs`` json = :data:`SCHEMA`, xgrammar). Greedy (T = 0) and
EOS-terminated, so a JSON reply ends when the object closes. It checks that
each method's tokens equal no speculation's, and that every finished JSON reply
parses and follows the schema.

Writes ``<out>/<tag>.json`` (with a top-level ``"goals"`` list) and
``<out>/<tag>.md``.

    .venv/bin/python benchmarks/bench_structured.py --tag structured_cpu
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import bench_real  # noqa: F401  (sets the engine's environment first)
from bench_core import machine_info
from bench_real import (
    REPO_ROOT,
    SECTIONS,
    MethodEngine,
    StepTimers,
    acceptance,
    add_workload_args,
    counter_delta,
    load_prompt_sets,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 160},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24},
                     "maxItems": 3},
    },
    "required": ["answer", "confidence", "keywords"],
    "additionalProperties": False,
}
WORKLOADS = ("plain", "json")


def method_specs(drafter: str, budgets: list[int]) -> dict[str, dict | None]:
    specs: dict[str, dict | None] = {"nospec": None}
    for b in budgets:
        specs[f"ddtree-{b}"] = {"method": "ddtree", "model": drafter,
                                "num_speculative_tokens": b, "ddtree_budget": "fixed"}
    specs["ddtree-auto"] = {"method": "ddtree", "model": drafter,
                            "num_speculative_tokens": max(budgets), "ddtree_budget": "auto"}
    return specs


def params_for(workload: str, max_tokens: int):
    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    return vllm.SamplingParams(
        temperature=0.0, max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA) if workload == "json" else None)


def follows_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["answer"], str) and isinstance(value["confidence"], int)
            and isinstance(value["keywords"], list))


def tree_stats(engine) -> tuple[int, int]:
    """(scheduled draft nodes of constrained requests, of which unreachable under
    the grammar) so far, from the engine's scheduler."""
    from vllm_ddtree.vllm_adapter.structured_output import bitmask_stats

    core = engine.llm.llm_engine.engine_core.engine_core
    stats = bitmask_stats(core.scheduler.structured_output_manager)
    return stats.nodes, stats.unreachable


def run(engines, args, prompt_sets, timers, tokenizer) -> list[dict]:
    """Per (workload, dataset): every method the same prompts, batch 1 at a time,
    in a rotating order."""
    rows, turn = [], 0
    for workload in WORKLOADS:
        params = params_for(workload, args.max_tokens)
        for ds, prompts in prompt_sets.items():
            sums = {e.name: e.new_sums() for e in engines}
            texts = {e.name: [] for e in engines}
            nodes_before = {e.name: tree_stats(e) for e in engines}
            for start in range(len(prompts)):
                k = turn % len(engines)
                turn += 1
                for e in engines[k:] + engines[:k]:
                    before = len(sums[e.name]["outputs"])
                    e.run_chunk(prompts[start:start + 1], params, timers, sums[e.name])
                    texts[e.name] += [tokenizer.decode(o, skip_special_tokens=True)
                                      for o in sums[e.name]["outputs"][before:]]
            for e in engines:
                s = sums[e.name]
                delta = counter_delta(e.spec.snapshot(), s["before"])
                tau, _ = acceptance(delta)
                timers.totals, timers.calls = s["totals"], s["calls"]
                split = timers.split()
                n_out = sum(len(o) for o in s["outputs"])
                finished = [t for o, t in zip(s["outputs"], texts[e.name], strict=True)
                            if len(o) < args.max_tokens]
                nodes, unreachable = (a - b for a, b in zip(
                    tree_stats(e), nodes_before[e.name], strict=True))
                rows.append({
                    "method": e.name, "workload": workload, "dataset": ds,
                    "wall_s": round(s["wall"], 3), "output_tokens": n_out,
                    "tokens_per_s": round(n_out / s["wall"], 3), "tau": tau,
                    "verify_steps": delta["drafts"], "split_s": split,
                    "finished": len(finished),
                    "constrained_nodes": nodes, "unreachable_nodes": unreachable,
                    "schema_ok": sum(follows_schema(t) for t in finished),
                    "outputs": s["outputs"]})
                print(f"{e.name:12s} {workload:5s} {ds:9s} {rows[-1]['tokens_per_s']:7.2f} "
                      f"tok/s tau={tau if tau is None else round(tau, 3)}", flush=True)
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    out = []
    for workload in WORKLOADS:
        for method in dict.fromkeys(r["method"] for r in rows):
            rs = [r for r in rows if r["method"] == method and r["workload"] == workload]
            steps = sum(r["verify_steps"] for r in rs)
            tau = (sum(r["tau"] * r["verify_steps"] for r in rs if r["tau"]) / steps
                   if steps else None)
            wall = sum(r["wall_s"] for r in rs)
            tokens = sum(r["output_tokens"] for r in rs)
            out.append({"method": method, "workload": workload, "tau": tau,
                        "tokens_per_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
                        "finished": sum(r["finished"] for r in rs),
                        "constrained_nodes": sum(r["constrained_nodes"] for r in rs),
                        "unreachable_nodes": sum(r["unreachable_nodes"] for r in rs),
                        "schema_ok": sum(r["schema_ok"] for r in rs),
                        "split_s": {k: sum(r["split_s"][k] for r in rs) for k in SECTIONS}})
    return out


def evaluate_goals(rows: list[dict], agg: list[dict]) -> list[dict]:
    def get(method, workload):
        return next(r for r in agg if r["method"] == method and r["workload"] == workload)

    ref = {(r["workload"], r["dataset"]): r["outputs"] for r in rows if r["method"] == "nospec"}
    identical = all(r["outputs"] == ref[(r["workload"], r["dataset"])] for r in rows)
    json_rows = [r for r in agg if r["workload"] == "json"]
    schema_ok = all(r["schema_ok"] == r["finished"] for r in json_rows)
    base = get("nospec", "json")["tokens_per_s"]
    auto = get("ddtree-auto", "json")["tokens_per_s"]
    return [
        {"name": "greedy token-identical to no speculation (plain and json)",
         "value": 1.0 if identical else 0.0, "target": 1.0, "pass": identical},
        {"name": "every finished json reply follows the schema",
         "value": 1.0 if schema_ok else 0.0, "target": 1.0, "pass": schema_ok},
        {"name": "ddtree-auto tok/s / no speculation, json schema, batch 1",
         "value": round(auto / base, 3), "target": 1.0, "pass": auto >= base},
    ]


def report(out_dir: Path, tag: str, info: dict, agg: list[dict], goals: list[dict]) -> None:
    lines = [f"# Structured outputs: ddtree vs no speculation, JSON schema vs plain ({tag})",
             "", f"Command: `{info['command']}`", "",
             f"Machine: {info['cpu_model']} ({info['os_cpu_count']} CPUs), torch "
             f"{info['torch_version']}, {info['date_utc']}, commit {info['git_commit']}.", "",
             info["setup"], "", "## Goals", ""]
    lines += [f"- {g['name']}: {g['value']} (target {g['target']}) "
              f"{'PASS' if g['pass'] else 'FAIL'}" for g in goals]
    lines += ["", "| workload | method | tau | tok/s | vs nospec | finished | schema ok | "
              "unreachable nodes | " + " | ".join(f"{s} %" for s in SECTIONS) + " |",
              "|---|---|" + "---:|" * (6 + len(SECTIONS))]
    for r in agg:
        base = next(b for b in agg if b["method"] == "nospec" and b["workload"] == r["workload"])
        total = sum(r["split_s"].values()) or 1.0
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(
            f"| {r['workload']} | {r['method']} | {tau} | {r['tokens_per_s']:.2f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['finished']} | "
            f"{r['schema_ok'] if r['workload'] == 'json' else '-'} | "
            + (f"{100 * r['unreachable_nodes'] / r['constrained_nodes']:.0f}% of "
               f"{r['constrained_nodes']} | " if r["constrained_nodes"] else "- | ")
            + " | ".join(f"{100 * r['split_s'][s] / total:.1f}" for s in SECTIONS) + " |")
    lines += ["", "tau = 1 + accepted drafts per verify step. The grammar bitmask is filled "
              "in the scheduler during the step (`other`); `finished` = replies that ended "
              "before max_tokens; `unreachable nodes` = scheduled draft nodes of constrained "
              "requests that the grammar masks out of an ancestor's row (verified, never "
              "accepted: the rows a grammar-aware pruning would free).", ""]
    (out_dir / f"{tag}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, prompts_per_dataset=6, max_tokens=96)
    ap.set_defaults(datasets=["mtbench", "gsm8k"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="structured_cpu")
    args = ap.parse_args(argv)
    args.batch_sizes = [1]
    command = "python benchmarks/bench_structured.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    import vllm_ddtree

    vllm_ddtree.register()
    timers = StepTimers()
    timers.install()
    if args.target is None:
        from vllm_ddtree import assets

        args.target = assets.smollm2_target()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompt_sets = load_prompt_sets(args, tokenizer)
    engines = [MethodEngine(name, spec, args, args.target, timers)
               for name, spec in method_specs(args.drafter, args.budgets).items()]
    rows = run(engines, args, prompt_sets, timers, tokenizer)
    agg = aggregate(rows)
    goals = evaluate_goals(rows, agg)
    info = machine_info(args, command)
    info["setup"] = (
        f"Target {args.target} ({args.dtype}), drafter {args.drafter}; datasets "
        f"{', '.join(f'{k} ({len(v)})' for k, v in prompt_sets.items())}; batch 1, T = 0, "
        f"up to {args.max_tokens} new tokens (EOS ends a reply); json = structured_outputs "
        f"json schema {json.dumps(SCHEMA)} (xgrammar).")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"goals": goals, "info": info, "args": {k: str(v) if isinstance(v, Path) else v
                                                     for k, v in vars(args).items()},
              "rows": agg, "per_dataset": [{k: v for k, v in r.items() if k != "outputs"}
                                           for r in rows]}
    (args.out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    report(args.out, args.tag, info, agg, goals)
    for g in goals:
        print(g)
    return result


if __name__ == "__main__":
    main()
