# SPDX-License-Identifier: Apache-2.0
"""Offline replay: how much of the target's greedy output lookup drafts predict
(issue 45), with no model.

The committed generations pack (``vllm_ddtree/drafter/generations``: SmolLM2-
135M-Instruct's greedy continuations of prompts from the four datasets) is
replayed in its order through arctic-inference's ``SuffixDecodingCache`` as
vLLM's ``"suffix"`` method keeps it (each prompt's suffix tree, earlier
responses across requests). At each verify step the lookup proposes (up to
``--max-spec`` tokens); the step accepts the longest proposed path the target's
output follows, plus the bonus token. Variants: the cache's tree
(``use_tree_spec=True``, what ddtree's union tree takes) or its single path
(what vLLM's ``"suffix"`` verifies), with and without the cross-request memory
(``max_cached_requests`` 0: each request's own prompt and output only), the
tree at ``suffix_decoding_max_spec_factor`` 2 and 4 (longer proposals, more
rows); and vLLM's n-gram matcher (prompt lookup, 1..3-grams). Reported: acceptance length
tau (tokens per verify step) over the first 64 and 256 output tokens, and the
mean lookup nodes per step (what they cost a node budget).

    .venv/bin/python benchmarks/replay_lookup.py --rows 1500 \\
        --out benchmarks/results/replay_lookup
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PACK = ROOT / "vllm_ddtree/drafter/generations/smollm2_135m.jsonl.gz"


def load_rows(count: int) -> list[dict]:
    rows = []
    with gzip.open(PACK, "rt") as f:
        for line in f:
            row = json.loads(line)
            if "output_ids" in row and row.get("temperature", 0.0) == 0.0:
                rows.append(row)
    return rows[-count:]


def accepted_along(draft_tokens, parents, truth) -> int:
    """Nodes of the longest root path in the draft that ``truth`` follows."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(draft_tokens, parents, strict=True)):
        children.setdefault(int(parent), {})[int(token)] = i
    node, n = -1, 0
    for token in truth:
        node = children.get(node, {}).get(int(token))
        if node is None:
            break
        n += 1
    return n


def replay(rows, horizon: int, propose, start=None, add=None, stop=None, observe=None):
    """tau over each output's first ``horizon`` tokens, and lookup nodes per step;
    ``observe(draft_tokens, parents, truth)`` sees each draft beside the output
    it is verified against."""
    steps = tokens = nodes = 0
    for k, row in enumerate(rows):
        prompt = np.asarray(row["prompt_ids"], dtype=np.int32)
        output = list(row["output_ids"])[:horizon]
        if start is not None:
            start(k, prompt)
        t = 0
        while t < len(output):
            context = np.concatenate([prompt, np.asarray(output[:t], dtype=np.int32)])
            draft_tokens, parents = propose(k, context)
            if observe is not None:
                observe(draft_tokens, parents, output[t:])
            nodes += len(draft_tokens)
            # The drafts follow the committed tokens; the step commits the
            # matched drafts and the target's next token.
            gained = min(1 + accepted_along(draft_tokens, parents, output[t:]),
                         len(output) - t)  # fmt: skip
            if add is not None:
                add(k, output[t : t + gained])
            t += gained
            steps += 1
            tokens += gained
        if stop is not None:
            stop(k)
    return tokens / max(steps, 1), nodes / max(steps, 1)


def bucket(depth: int, path_prob: float) -> tuple[int, int]:
    """A lookup node's calibration cell: depth and half-octave of its path
    probability (what the engine's lookup calibration keys on)."""
    return min(depth, 24), int(
        np.clip(np.floor(2 * np.log2(max(path_prob, 1e-6))), -40, 0)
    )


def node_cells(draft_tokens, parents, probs) -> list[tuple[int, int]]:
    """[n] the calibration cell of each node (parents before children)."""
    depth: list[int] = []
    path: list[float] = []
    for p, q in zip(parents, probs, strict=True):
        depth.append(1 if p < 0 else depth[p] + 1)
        path.append(q if p < 0 else path[p] * q)
    return [bucket(d, q) for d, q in zip(depth, path, strict=True)]


def node_accepted(draft_tokens, parents, truth) -> list[bool]:
    """[n] whether each node's root path is a prefix of ``truth``."""
    ok: list[bool] = []
    for i, (token, p) in enumerate(zip(draft_tokens, parents, strict=True)):
        depth = 0
        j = p
        while j >= 0:
            depth += 1
            j = parents[j]
        ok.append((p < 0 or ok[p]) and depth < len(truth) and truth[depth] == token)
    return ok


def time_replay(rows, horizon, settings, node_cost, cells=None, value_cut=None):
    """Committed tokens per unit of time, a verify step costing ``1 + node_cost
    x nodes`` plain steps, for SuffixDecoding proposals at ``settings`` =
    (max_spec_tokens, max_spec_factor, min_token_prob, tree); ``cells`` and
    ``value_cut`` as in :func:`suffix_variant`."""
    max_spec, factor, min_prob, tree = settings
    variant = suffix_variant(max_spec, tree, 10000, factor, min_prob, cells, value_cut)
    tau, nodes = replay(rows, horizon, **variant)
    return {
        "tau": round(tau, 3),
        "nodes_per_step": round(nodes, 2),
        "tokens_per_time": tau / (1 + node_cost * nodes),
    }


def time_bound(rows, horizon: int, node_costs: list[float]) -> dict:
    """How far lookup trees can beat vLLM's ``"suffix"`` when each verified
    node costs ``node_cost`` of a plain step: per node cost, vLLM's path (its
    defaults: 15 tokens, factor 1, min prob 0.1) against SuffixDecoding trees
    at wider settings, verified whole or cut by an oracle calibration at 1x
    and 2x the node cost (the auto budget's rule: a node pays when its
    acceptance probability beats its cost). Host work is free here: a bound."""
    trees = {
        "tree f1 p0.1": (16, 1.0, 0.1, True),
        "tree f2 p0.05": (16, 2.0, 0.05, True),
        "tree f4 p0.02": (16, 4.0, 0.02, True),
    }
    cells_of = {}
    for name, settings in trees.items():
        cells: dict = {}
        time_replay(rows, horizon, settings, 0.0, cells=cells)
        cells_of[name] = {c: float(np.mean(v)) for c, v in cells.items()}
    out = {}
    for cost in node_costs:
        base = time_replay(rows, horizon, (15, 1.0, 0.1, False), cost)
        entry = {"vLLM suffix path": {**base, "vs_suffix": 1.0}}
        for name, settings in trees.items():
            for cut in (None, cost, 2 * cost):
                r = time_replay(
                    rows, horizon, settings, cost,
                    cells=None if cut is None else cells_of[name], value_cut=cut,
                )  # fmt: skip
                label = f"{name}, " + ("whole" if cut is None else f"cut {cut:g}")
                r["vs_suffix"] = round(
                    r["tokens_per_time"] / base["tokens_per_time"], 3
                )
                entry[label] = r
            print(
                cost,
                name,
                {k: v for k, v in entry.items() if k.startswith(name)},
                flush=True,
            )
        out[str(cost)] = entry
    return out


def suffix_variant(
    max_spec: int,
    tree: bool,
    cached: int,
    factor: float = 1.0,
    min_prob: float = 0.1,
    cells: dict | None = None,
    value_cut: float | None = None,
):
    """SuffixDecoding as vLLM keeps it. With ``value_cut``, each proposal keeps
    the prefix-closed set of nodes whose acceptance rate in ``cells`` (an
    oracle calibration: acceptance per :func:`bucket`, measured on the same
    rows) is at least the cut; with ``cells`` and no cut, every proposed
    node's acceptance is collected into it."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=cached)
    last_probs: list[float] = []  # the last proposal's, for observe

    def start(k, prompt):
        cache.start_request(k, prompt)

    def propose(k, context):
        draft = cache.speculate(
            k,
            context[-24:],
            max_spec_tokens=max_spec,
            max_spec_factor=factor,
            min_token_prob=min_prob,
            use_tree_spec=tree,
        )
        tokens = list(draft.token_ids)
        parents = list(draft.parents) if tree else list(range(-1, len(tokens) - 1))
        last_probs[:] = draft.probs
        if value_cut is None:
            return tokens, parents
        kept: dict[int, int] = {}  # proposal index -> kept index
        for i, cell in enumerate(node_cells(tokens, parents, last_probs)):
            if cells.get(cell, 0.0) >= value_cut and (
                parents[i] < 0 or parents[i] in kept
            ):
                kept[i] = len(kept)
        return (
            [tokens[i] for i in kept],
            [kept[parents[i]] if parents[i] >= 0 else -1 for i in kept],
        )

    def observe(draft_tokens, parents, truth):
        accepted = node_accepted(draft_tokens, parents, truth)
        cellwise = node_cells(draft_tokens, parents, last_probs)
        for cell, ok in zip(cellwise, accepted, strict=True):
            cells.setdefault(cell, []).append(ok)

    def add(k, tokens):
        cache.add_active_response(k, list(tokens))

    def stop(k):
        cache.stop_request(k)

    variant = dict(propose=propose, start=start, add=add, stop=stop)
    if cells is not None and value_cut is None:
        variant["observe"] = observe
    return variant


def ngram_variant(max_spec: int):
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as match,
    )

    def propose(k, context):
        path = match(context.astype(np.int64), 1, 3, 1 << 30, max_spec)
        return path.tolist(), list(range(-1, len(path) - 1))

    return dict(propose=propose)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1500)
    ap.add_argument("--max-spec", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/replay_lookup"))
    ap.add_argument(
        "--node-costs",
        type=float,
        nargs="*",
        default=[0.005, 0.02, 0.035],
        help="verify cost per draft node, in plain steps, for the time bound "
        "(none: skip it)",
    )
    ap.add_argument("--bound-rows", type=int, default=300)
    args = ap.parse_args()
    rows = load_rows(args.rows)
    variants = {
        "suffix tree, cross-request": lambda: suffix_variant(
            args.max_spec, True, 10000
        ),
        "suffix path, cross-request (vLLM suffix)": lambda: suffix_variant(
            args.max_spec, False, 10000
        ),
        "suffix tree, own request only": lambda: suffix_variant(args.max_spec, True, 0),
        "suffix path, own request only": lambda: suffix_variant(
            args.max_spec, False, 0
        ),
        "n-gram (vLLM ngram, 1-3)": lambda: ngram_variant(args.max_spec),
        # vLLM's suffix_decoding_max_spec_factor: a proposal's length is capped
        # at factor x the match length (1.0: vLLM's default).
        "suffix tree, cross-request, max_spec_factor 2": lambda: suffix_variant(
            args.max_spec, True, 10000, 2.0
        ),
        "suffix tree, cross-request, max_spec_factor 4": lambda: suffix_variant(
            args.max_spec, True, 10000, 4.0
        ),
    }
    table = {}
    for name, make in variants.items():
        entry = {}
        for horizon in (64, 256):
            started = time.perf_counter()
            tau, nodes = replay(rows, horizon, **make())
            entry[f"tau_{horizon}"] = round(tau, 3)
            entry[f"nodes_per_step_{horizon}"] = round(nodes, 2)
            entry[f"seconds_{horizon}"] = round(time.perf_counter() - started, 1)
        table[name] = entry
        print(name, entry, flush=True)
    tree, path = (
        table["suffix tree, cross-request"],
        table["suffix path, cross-request (vLLM suffix)"],
    )
    bound = (
        time_bound(rows[-args.bound_rows :], 256, args.node_costs)
        if args.node_costs
        else {}
    )
    result = {
        "command": " ".join(
            ["python", "benchmarks/replay_lookup.py", f"--rows {len(rows)}"]
            + [f"--node-costs {' '.join(map(str, args.node_costs))}"]
            + [f"--bound-rows {args.bound_rows}"]
        ),
        "rows": len(rows),
        "output_tokens_mean": round(
            float(np.mean([len(r["output_ids"]) for r in rows])), 1
        ),
        "variants": table,
        "time_bound": bound,
        "goals": [
            {
                "name": "lookup tree tau_256 / lookup path tau_256 (suffix, cross-request)",
                "value": round(tree["tau_256"] / path["tau_256"], 3),
                "target": 1.0,
                "pass": tree["tau_256"] >= path["tau_256"],
            }
        ],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Lookup drafts replayed on the target's greedy outputs (no model)",
        "",
        f"`{result['command']}`: {result['rows']} greedy rows of the generations "
        f"pack (outputs {result['output_tokens_mean']} tokens on average), "
        f"up to {args.max_spec} lookup tokens per step.",
        "",
        "| lookup | tau (first 64) | tau (first 256) | lookup nodes / step (256) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, e in table.items():
        lines.append(
            f"| {name} | {e['tau_64']} | {e['tau_256']} | {e['nodes_per_step_256']} |"
        )
    if bound:
        lines += [
            "",
            "## Time bound: lookup trees against vLLM's suffix path",
            "",
            f"The last {args.bound_rows} rows, first 256 tokens. A verify step costs "
            "`1 + c x nodes` plain steps; host work is free. Trees are "
            "SuffixDecoding's "
            "at 16 tokens and the given `max_spec_factor` (f) and `min_token_prob` "
            "(p), verified whole or cut to the nodes whose acceptance rate (an "
            "oracle calibration per depth and half-octave of path probability, "
            "measured on the same rows) is at least the cut: an upper bound on what "
            "a calibrated tree of one lookup source gains over vLLM's path at "
            "that node cost.",
            "",
            "| c (node / plain step) | proposal | tau | nodes / step "
            "| tokens / time vs vLLM suffix |",
            "| ---: | --- | ---: | ---: | ---: |",
        ]
        for cost, entry in bound.items():
            for name, e in entry.items():
                lines.append(
                    f"| {cost} | {name} | {e['tau']} | {e['nodes_per_step']} | "
                    f"{e['vs_suffix']:.3f} |"
                )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(table)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [table[n]["tau_64"] for n in names], 0.4, label="first 64")
    ax.bar(x + 0.2, [table[n]["tau_256"] for n in names], 0.4, label="first 256")
    ax.set_xticks(x, [n.replace(", ", "\n") for n in names], fontsize=7)
    ax.set_ylabel("tau (tokens / verify step)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
