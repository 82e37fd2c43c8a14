# SPDX-License-Identifier: Apache-2.0
"""Demo: DDTree speculative decoding in vLLM, and the core on real-shaped logits.

    python -m vllm_ddtree.demo              # vLLM generation with "method": "ddtree"
    python -m vllm_ddtree.demo --core [--budget 64] [--vocab 151936] [--seed 0]

The default runs vLLM's offline ``LLM`` twice on the same prompts, without
speculation and with ``speculative_config={"method": "ddtree", ...}``, on the
embedded default models: a tiny Qwen3 target and DFlash drafter written
deterministically by :mod:`vllm_ddtree.tiny_models` (no download; the target
mostly repeats its last token, the drafter predicts that, so most drafts are
accepted). It prints both outputs (identical: lossless), the acceptance metrics
and the wall times.

``--core``: shapes are those of a Qwen3 DFlash b16 drafter (L = 15 drafted positions,
V = 151,936). The logits are synthetic (no model is downloaded): a drafter that
is confident early and unsure later, and a target that agrees with the drafter's
top-1 most of the time and with its runner-up sometimes. Prints the top of the
tree, then the path the target accepts greedily and by both sampling rules.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from vllm_ddtree.sampling import TreeSamplingParams
from vllm_ddtree.tree import DraftTree, build_ddtree
from vllm_ddtree.verify import verify_tree


def synthetic_logits(depth: int, vocab: int, budget: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(1, depth, vocab, generator=g)
    favourite = torch.randint(0, vocab, (depth, 3), generator=g)
    for d in range(depth):  # top-3 candidates per position, confidence decays
        draft[0, d, favourite[d]] += torch.tensor([16.0, 14.8, 14.0]) - 0.12 * d
    return draft, favourite


def target_for(tree: DraftTree, favourite: torch.Tensor, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    rows = tree.num_rows
    target = torch.randn(1, rows, vocab, generator=g)
    for i in range(rows):
        d = int(tree.depths[0, i])
        if d < favourite.shape[0]:
            pick = 0 if torch.rand((), generator=g) < 0.85 else 1
            target[0, i, favourite[d, pick]] += 20.0
    return target


def print_tree(tree: DraftTree, limit: int = 24) -> None:
    n = int(tree.num_nodes[0])
    children: dict[int, list[int]] = {}
    for i in range(1, n + 1):
        children.setdefault(int(tree.parents[0, i]), []).append(i)
    shown = 0

    def show(node: int, indent: int) -> None:
        nonlocal shown
        if shown >= limit:
            return
        shown += 1
        prob = float(tree.scores[0, node].exp())
        label = "root" if node == 0 else f"node {node:3d}"
        print(f"{'  ' * indent}{label}: token {int(tree.tokens[0, node]):6d}  "
              f"q(prefix)={prob:.3f}")
        for c in children.get(node, []):
            show(c, indent + 1)

    show(0, 0)
    if n + 1 > shown:
        print(f"  ... ({n + 1 - shown} more nodes)")


def vllm_demo(budget: int, max_tokens: int, cache_dir: str) -> None:
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_ddtree import tiny_models

    target, drafter = tiny_models.make_pair(
        cache_dir, "oracle", name="demo", seed=0, target_oracle_noise=8.0,
        drafter_block_size=9,
    )
    import vllm

    prompts = ["DDTree verifies a whole draft tree in one forward pass.",
               "The quick brown fox", "vLLM + DFlash + DDTree"]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for name, spec in (
        ("no speculation", None),
        ("ddtree", {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget}),
    ):
        llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024,
                       disable_log_stats=False, speculative_config=spec, seed=0)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        metrics = {m.name: m for m in llm.get_metrics()}
        results[name] = [list(o.outputs[0].token_ids) for o in outs]
        print(f"\n== {name}: {len(prompts)} prompts x {max_tokens} tokens in {elapsed:.2f} s")
        for prompt, out in zip(prompts, outs):
            print(f"  {prompt!r} -> token ids {list(out.outputs[0].token_ids)[:16]}...")
        if spec is not None:
            drafts = metrics["vllm:spec_decode_num_drafts"].value
            accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
            per_depth = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
            print(f"  tree verifications {drafts}, accepted drafts {accepted}, mean "
                  f"acceptance length {1 + accepted / max(drafts, 1):.2f} tokens/step")
            print(f"  accepted per depth {[v for v in per_depth if v]}")
        del llm
    same = results["ddtree"] == results["no speculation"]
    print(f"\nddtree output == no-speculation output: {same}")
    if not same:
        raise SystemExit("lossless check failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", action="store_true",
                        help="the tree build + verification demo, without vLLM")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/vllm-ddtree"),
                        help="where the embedded default models are written")
    parser.add_argument("--budget", type=int, default=64, help="tree node budget B")
    parser.add_argument("--depth", type=int, default=15, help="drafted positions L")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=8, help="target draws to verify")
    args = parser.parse_args()
    if not args.core:
        vllm_demo(args.budget, args.max_tokens, args.cache_dir)
        return

    draft, favourite = synthetic_logits(args.depth, args.vocab, args.budget, args.seed)
    start = time.perf_counter()
    tree = build_ddtree(draft, args.budget, root_token_ids=torch.tensor([42]))
    build_ms = (time.perf_counter() - start) * 1e3
    print(f"DDTree: L={args.depth} V={args.vocab} B={args.budget}: "
          f"{int(tree.num_nodes[0])} nodes, max depth {int(tree.depths.max())}, "
          f"expected acceptance sum q(u) = {float(tree.scores[0, 1:].exp().sum()):.2f} "
          f"(built in {build_ms:.1f} ms)")
    print_tree(tree)

    runs = [("greedy", None, "rejection")]
    sampled = TreeSamplingParams.from_lists([1.0], top_k=[50], top_p=[0.95], seeds=[args.seed])
    runs += [("T=1 sample-walk", sampled, "sample_walk"), ("T=1 rejection", sampled, "rejection")]
    accepted = {name: [] for name, _, _ in runs}
    for round_ in range(args.rounds):  # independent target draws on the same tree
        target = target_for(tree, favourite, args.vocab, args.seed + round_)
        for name, params, method in runs:
            out = verify_tree(tree, target, params, method=method)
            n = int(out.num_accepted[0])
            accepted[name].append(n + 1)
            if round_ == 0:
                path = out.accepted_indices[0, : n + 1].tolist()
                tokens = out.committed_tokens[0, : n + 1].tolist()
                print(f"{name:16s} accepted path {path}\n{'':16s} commits {n} drafts + 1 "
                      f"bonus: {tokens}")
    for name, lengths in accepted.items():
        print(f"{name:16s} tokens per round over {args.rounds} target draws: {lengths} "
              f"(mean {sum(lengths) / len(lengths):.2f})")

if __name__ == "__main__":
    main()
