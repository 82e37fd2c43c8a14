# SPDX-License-Identifier: Apache-2.0
"""Structured outputs with ddtree: grammar-built draft trees vs no speculation,
constrained vs unconstrained, side by side (the real pair: SmolLM2-135M-Instruct
and the committed DFlash drafter).

Every method's engine is alive for the whole run and the methods take each chunk
of prompts in turn (bench_real.py's harness: timers, spec-decode counters), for
three workloads on the same prompts: ``plain`` (no constraint), ``json``
(``structured_outputs`` json = :data:`SCHEMA`, free text in a small object) and
``tool`` (json = :data:`TOOL_CALL`, a tool call: several required keys, enums,
an integer), at each batch size and temperature (T = 0: greedy; T = 1: seeded
per request). EOS ends a reply, so a JSON reply ends when the object closes.
It checks that each method's greedy tokens equal no speculation's, that every
finished constrained reply parses and follows its schema, and reads from each
engine's scheduler the grammar-built trees' nodes, how many of them the grammar
makes unreachable (0 by construction; counted from the build's rows) and the
grammar's host time (tree builds, between steps; verify bitmasks, during the
forward).

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
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["search_web", "get_weather", "send_email", "create_event"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 80},
                "priority": {"enum": ["low", "normal", "high"]},
                "format": {"enum": ["text", "markdown", "json"]},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query", "priority", "format", "max_results"],
            "additionalProperties": False,
        },
        "reason": {"type": "string", "maxLength": 80},
    },
    "required": ["name", "arguments", "reason"],
    "additionalProperties": False,
}
SCHEMAS = {"json": SCHEMA, "tool": TOOL_CALL}
WORKLOADS = ("plain", "json", "tool")


def method_specs(drafter: str, budgets: list[int], auto_budget: int) -> dict[str, dict | None]:
    specs: dict[str, dict | None] = {"nospec": None}
    for b in budgets:
        specs[f"ddtree-{b}"] = {"method": "ddtree", "model": drafter,
                                "num_speculative_tokens": b, "ddtree_budget": "fixed"}
    specs["ddtree-auto"] = {"method": "ddtree", "model": drafter,
                            "num_speculative_tokens": auto_budget, "ddtree_budget": "auto"}
    return specs


def params_for(workload: str, max_tokens: int, temperature: float, seeds: list[int]):
    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    constraint = (StructuredOutputsParams(json=SCHEMAS[workload])
                  if workload in SCHEMAS else None)
    return [vllm.SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                seed=seed if temperature > 0 else None,
                                structured_outputs=constraint) for seed in seeds]


def follows_schema(workload: str, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict):
        return False
    if workload == "json":
        return (set(value) == set(SCHEMA["required"]) and isinstance(value["answer"], str)
                and isinstance(value["confidence"], int)
                and isinstance(value["keywords"], list))
    props = TOOL_CALL["properties"]
    arguments = value.get("arguments")
    return (set(value) == set(TOOL_CALL["required"])
            and value["name"] in props["name"]["enum"] and isinstance(arguments, dict)
            and set(arguments) == set(props["arguments"]["required"])
            and arguments["priority"] in ("low", "normal", "high")
            and arguments["format"] in ("text", "markdown", "json")
            and isinstance(arguments["max_results"], int))


STATS_FIELDS = ("nodes", "unreachable", "grammar_trees", "grammar_nodes",
                "build_seconds", "bitmask_seconds", "bitmask_calls")
SPAN_FIELDS = ("hints", "matched", "missed")  # the grammar span memory's
GRAMMAR_FIELDS = STATS_FIELDS + tuple(f"hint_{f}" for f in SPAN_FIELDS)


def grammar_stats(engine) -> dict[str, float]:
    """The engine's scheduler's running TreeBitmaskStats and span memory
    counters."""
    from vllm_ddtree.vllm_adapter.grammar_spans import grammar_span_memory
    from vllm_ddtree.vllm_adapter.structured_output import bitmask_stats

    manager = engine.llm.llm_engine.engine_core.engine_core.scheduler.structured_output_manager
    stats = bitmask_stats(manager)
    memory = grammar_span_memory(manager)
    return {**{f: getattr(stats, f) for f in STATS_FIELDS},
            **{f"hint_{f}": getattr(memory, f) for f in SPAN_FIELDS}}


def run(engines, args, prompt_sets, timers, tokenizer) -> list[dict]:
    """Per (T, batch, workload, dataset): every method the same prompts, ``batch``
    at a time, in a rotating order."""
    rows, turn = [], 0
    for temperature in args.temperatures:
        for batch in args.batch_sizes:
            for workload in WORKLOADS:
                for ds, prompts in prompt_sets.items():
                    rows += _run_one(engines, args, timers, tokenizer, temperature, batch,
                                     workload, ds, prompts, turn)
                    turn += len(prompts)
    return rows


def _run_one(engines, args, timers, tokenizer, temperature, batch, workload, ds, prompts,
             turn) -> list[dict]:
    sums = {e.name: e.new_sums() for e in engines}
    texts = {e.name: [] for e in engines}
    before = {e.name: grammar_stats(e) for e in engines}
    for start in range(0, len(prompts), batch):
        k = (turn + start) % len(engines)
        chunk = prompts[start:start + batch]
        params = params_for(workload, args.max_tokens, temperature,
                            list(range(start, start + len(chunk))))
        for e in engines[k:] + engines[:k]:
            done = len(sums[e.name]["outputs"])
            e.run_chunk(chunk, params, timers, sums[e.name])
            texts[e.name] += [tokenizer.decode(o, skip_special_tokens=True)
                              for o in sums[e.name]["outputs"][done:]]
    rows = []
    for e in engines:
        s = sums[e.name]
        delta = counter_delta(e.spec.snapshot(), s["before"])
        tau, _ = acceptance(delta)
        timers.totals, timers.calls = s["totals"], s["calls"]
        n_out = sum(len(o) for o in s["outputs"])
        finished = [t for o, t in zip(s["outputs"], texts[e.name], strict=True)
                    if len(o) < args.max_tokens]
        after = grammar_stats(e)
        rows.append({
            "method": e.name, "temperature": temperature, "batch": batch,
            "workload": workload, "dataset": ds,
            "wall_s": round(s["wall"], 3), "output_tokens": n_out,
            "tokens_per_s": round(n_out / s["wall"], 3), "tau": tau,
            "verify_steps": delta["drafts"], "split_s": timers.split(),
            "finished": len(finished),
            "grammar": {f: after[f] - before[e.name][f] for f in GRAMMAR_FIELDS},
            "schema_ok": sum(follows_schema(workload, t) for t in finished)
            if workload in SCHEMAS else None,
            "outputs": s["outputs"]})
        print(f"{e.name:12s} T={temperature} bs={batch} {workload:5s} {ds:9s} "
              f"{rows[-1]['tokens_per_s']:7.2f} tok/s "
              f"tau={tau if tau is None else round(tau, 3)}", flush=True)
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (T, batch, workload, method): totals over datasets."""
    out = []
    keys = dict.fromkeys((r["temperature"], r["batch"], r["workload"], r["method"])
                         for r in rows)
    for temperature, batch, workload, method in keys:
        rs = [r for r in rows if (r["temperature"], r["batch"], r["workload"],
                                  r["method"]) == (temperature, batch, workload, method)]
        steps = sum(r["verify_steps"] for r in rs)
        tau = (sum(r["tau"] * r["verify_steps"] for r in rs if r["tau"]) / steps
               if steps else None)
        wall = sum(r["wall_s"] for r in rs)
        tokens = sum(r["output_tokens"] for r in rs)
        out.append({"method": method, "temperature": temperature, "batch": batch,
                    "workload": workload, "tau": tau, "verify_steps": steps,
                    "tokens_per_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
                    "finished": sum(r["finished"] for r in rs),
                    "grammar": {f: sum(r["grammar"][f] for r in rs) for f in GRAMMAR_FIELDS},
                    "schema_ok": None if workload not in SCHEMAS
                    else sum(r["schema_ok"] for r in rs),
                    "split_s": {k: sum(r["split_s"][k] for r in rs) for k in SECTIONS}})
    return out


def evaluate_goals(rows: list[dict], agg: list[dict], args) -> list[dict]:
    def get(method, temperature, batch, workload):
        return next(r for r in agg if (r["method"], r["temperature"], r["batch"],
                                       r["workload"]) == (method, temperature, batch, workload))

    greedy = [r for r in rows if r["temperature"] == 0]
    ref = {(r["batch"], r["workload"], r["dataset"]): r["outputs"]
           for r in greedy if r["method"] == "nospec"}
    identical = all(r["outputs"] == ref[(r["batch"], r["workload"], r["dataset"])]
                    for r in greedy)
    constrained = [r for r in agg if r["workload"] in SCHEMAS]
    schema_ok = all(r["schema_ok"] == r["finished"] for r in constrained)
    unreachable = sum(r["grammar"]["unreachable"] for r in constrained)
    goals = [
        {"name": "greedy token-identical to no speculation (every workload and batch)",
         "value": 1.0 if identical else 0.0, "target": 1.0, "pass": identical},
        {"name": "every finished constrained reply follows its schema",
         "value": 1.0 if schema_ok else 0.0, "target": 1.0, "pass": schema_ok},
        {"name": "unreachable scheduled nodes of constrained requests",
         "value": unreachable, "target": 0, "pass": unreachable == 0},
    ]
    for temperature in args.temperatures:
        for batch in args.batch_sizes:
            target = 1.2 if batch == 1 else 1.0
            for workload in SCHEMAS:
                ratio = (get("ddtree-auto", temperature, batch, workload)["tokens_per_s"]
                         / get("nospec", temperature, batch, workload)["tokens_per_s"])
                goals.append({
                    "name": f"ddtree-auto tok/s / no speculation, {workload}, batch {batch}, "
                            f"T = {temperature:g}",
                    "value": round(ratio, 3), "target": target, "pass": ratio >= target})
            for method in [m for m in dict.fromkeys(r["method"] for r in agg)
                           if m != "nospec"]:
                plain = get(method, temperature, batch, "plain")["tau"]
                for workload in SCHEMAS:
                    tau = get(method, temperature, batch, workload)["tau"]
                    if plain is None or tau is None:
                        continue
                    goals.append({
                        "name": f"tau {method}, {workload} (grammar) / plain, batch {batch}, "
                                f"T = {temperature:g}",
                        "value": round(tau / plain, 3), "target": 1.0,
                        "pass": tau >= plain})
    return goals


def report(out_dir: Path, tag: str, info: dict, agg: list[dict], goals: list[dict]) -> None:
    lines = [f"# Structured outputs: grammar-built DDTrees vs no speculation ({tag})",
             "", f"Command: `{info['command']}`", "",
             f"Machine: {info['cpu_model']} ({info['os_cpu_count']} CPUs), torch "
             f"{info['torch_version']}, {info['date_utc']}, commit {info['git_commit']}.", "",
             info["setup"], "", "## Goals", ""]
    lines += [f"- {g['name']}: {g['value']} (target {g['target']}) "
              f"{'PASS' if g['pass'] else 'FAIL'}" for g in goals]
    lines += ["", "| T | batch | workload | method | tau | tok/s | vs nospec | finished | "
              "schema ok | grammar trees | nodes/tree | unreachable | build ms/step | "
              "build us/node | bitmask ms/call | hints | hint tokens emitted | " + " | ".join(f"{s} %" for s in SECTIONS)
              + " |", "|---:|---:|---|---|" + "---:|" * (13 + len(SECTIONS))]
    for r in agg:
        base = next(b for b in agg if b["method"] == "nospec" and (
            b["temperature"], b["batch"], b["workload"]) == (
            r["temperature"], r["batch"], r["workload"]))
        total = sum(r["split_s"].values()) or 1.0
        g = r["grammar"]
        steps = max(r["verify_steps"], 1)
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        if g["grammar_trees"]:
            grammar = (f"{g['grammar_trees']} | {g['grammar_nodes'] / g['grammar_trees']:.1f} | "
                       f"{g['unreachable']} of {g['nodes']} | "
                       f"{1e3 * g['build_seconds'] / steps:.2f} | "
                       f"{1e6 * g['build_seconds'] / max(g['grammar_nodes'], 1):.0f} | "
                       f"{1e3 * g['bitmask_seconds'] / max(g['bitmask_calls'], 1):.2f} | "
                       f"{g['hint_hints']} | {g['hint_matched']} "
                       f"({g['hint_missed']} left early)")
        else:
            grammar = "- | - | - | - | - | - | - | -"
        lines.append(
            f"| {r['temperature']:g} | {r['batch']} | {r['workload']} | {r['method']} | {tau} | "
            f"{r['tokens_per_s']:.2f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{r['finished']} | {'-' if r['schema_ok'] is None else r['schema_ok']} | "
            f"{grammar} | " + " | ".join(f"{100 * r['split_s'][s] / total:.1f}"
                                         for s in SECTIONS) + " |")
    lines += ["", "tau = 1 + accepted drafts per verify step. Constrained requests' trees are "
              "built in the scheduler with their grammar (`grammar trees`, their mean nodes, "
              "the build's host time per verify step and per node: between steps, on the "
              "critical path); the verify bitmask reuses the build's rows (`bitmask ms/call`, "
              "one call per step with a constrained request, while the forward runs, in "
              "`other`). `hints`: trees given a span the target emitted the last time "
              "its grammar was in that state (grammar span memory), `hint tokens emitted`: "
              "how many of their tokens the target then emitted (and how many hints it "
              "left before their end). `unreachable` = scheduled nodes "
              "their parent's grammar row masks out; `finished` = replies that ended before "
              "max_tokens.", ""]
    (out_dir / f"{tag}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, prompts_per_dataset=6, max_tokens=96)
    ap.set_defaults(datasets=["mtbench", "gsm8k"])
    ap.set_defaults(prompts_per_dataset=8)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8])
    ap.add_argument("--auto-budget", type=int, default=32,
                    help="num_speculative_tokens of ddtree-auto (its bound)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="structured_cpu")
    args = ap.parse_args(argv)
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
               for name, spec in method_specs(args.drafter, args.budgets,
                                              args.auto_budget).items()]
    rows = run(engines, args, prompt_sets, timers, tokenizer)
    agg = aggregate(rows)
    goals = evaluate_goals(rows, agg, args)
    info = machine_info(args, command)
    info["setup"] = (
        f"Target {args.target} ({args.dtype}), drafter {args.drafter}; datasets "
        f"{', '.join(f'{k} ({len(v)})' for k, v in prompt_sets.items())}; batch "
        f"{args.batch_sizes}, T {args.temperatures} (seeded per request), up to "
        f"{args.max_tokens} new tokens (EOS ends a reply); json = structured_outputs json "
        f"schema {json.dumps(SCHEMA)}; tool = json schema {json.dumps(TOOL_CALL)} "
        f"(xgrammar).")
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
