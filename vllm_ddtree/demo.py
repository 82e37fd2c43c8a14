# SPDX-License-Identifier: Apache-2.0
"""Demo: DDTree speculative decoding in vLLM, and the core on real-shaped logits.

    python -m vllm_ddtree.demo          # SmolLM2-135M-Instruct, 3 chat prompts
    python -m vllm_ddtree.demo --tiny   # the tiny embedded pair (token ids)
    python -m vllm_ddtree.demo --core   # tree build + verify on synthetic logits

The default converts SmolLM2-135M-Instruct once from its PyPI package
(:func:`vllm_ddtree.assets.smollm2_target`) and answers three chat prompts with
vLLM's offline ``LLM``, without speculation and with
``speculative_config={"method": "ddtree", ...}`` and the committed DFlash drafter
(``vllm_ddtree/drafter/smollm2_135m``). Both engines stay alive and take the
prompts in turn (order alternated), so the machine's speed drifts hit both alike.
It prints the answers, that they are identical (greedy: lossless), tokens/s of
both, the acceptance length tau and the speed-up.

``--tiny``: the same on a tiny Qwen3 target and DFlash drafter written
deterministically by :mod:`vllm_ddtree.tiny_models` (no conversion; the target
mostly repeats its last token, the drafter predicts that, so most drafts are
accepted); prints token ids.

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
        print(
            f"{'  ' * indent}{label}: token {int(tree.tokens[0, node]):6d}  "
            f"q(prefix)={prob:.3f}"
        )
        for c in children.get(node, []):
            show(c, indent + 1)

    show(0, 0)
    if n + 1 > shown:
        print(f"  ... ({n + 1 - shown} more nodes)")


CHAT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in three sentences why the sky is blue.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
)
TINY_PROMPTS = (
    "DDTree verifies a whole draft tree in one forward pass.",
    "The quick brown fox",
    "vLLM + DFlash + DDTree",
)


def spec_counts(llm) -> tuple[float, float]:
    """(verify steps with drafts, accepted drafts) from vLLM's metrics."""
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return (
        metrics.get("vllm:spec_decode_num_drafts") or 0.0,
        metrics.get("vllm:spec_decode_num_accepted_tokens") or 0.0,
    )


def vllm_demo(tiny: bool, budget: int, max_tokens: int, cache_dir: str) -> None:
    """Greedy generation without speculation and with ddtree, side by side."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The answers and the figures, not vLLM's start-up log (set it to see that).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if tiny:
        from vllm_ddtree import tiny_models

        target, drafter = tiny_models.make_pair(
            cache_dir,
            "oracle",
            name="demo",
            seed=0,
            target_oracle_noise=8.0,
            drafter_block_size=9,
        )
        texts = TINY_PROMPTS
        prompts = [{"prompt": p} for p in texts]
    else:
        from transformers import AutoTokenizer

        from vllm_ddtree import assets

        target = assets.smollm2_target(verbose=True)
        drafter = os.path.join(os.path.dirname(__file__), "drafter", "smollm2_135m")
        tokenizer = AutoTokenizer.from_pretrained(target)
        texts = CHAT_PROMPTS
        prompts = [{"prompt": assets.render_chat(tokenizer, p)} for p in texts]
    import vllm

    # ignore_eos on the tiny pair only: its random vocabulary has no real EOS.
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=tiny
    )
    specs = {
        "no speculation": None,
        "ddtree": {
            "method": "ddtree",
            "model": drafter,
            "num_speculative_tokens": budget,
        },
    }
    engines = {}
    # ddtree last: vLLM's metrics are the last engine's.
    for name, spec in specs.items():
        engines[name] = vllm.LLM(
            model=target,
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            disable_log_stats=False,
            speculative_config=spec,
            seed=0,
        )
        engines[name].generate(
            prompts[:1], vllm.SamplingParams(max_tokens=4), use_tqdm=False
        )  # warm-up, untimed
    before = spec_counts(engines["ddtree"])
    outputs = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for i, prompt in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            start = time.perf_counter()
            out = engines[name].generate([prompt], params, use_tqdm=False)[0].outputs[0]
            seconds[name] += time.perf_counter() - start
            outputs[name].append(out)
    after = spec_counts(engines["ddtree"])
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    for i, text in enumerate(texts):
        out = outputs["ddtree"][i]
        print(f"\n>>> {text}")
        print(
            out.text.strip() if not tiny else f"token ids {list(out.token_ids)[:24]}..."
        )
    same = all(
        list(a.token_ids) == list(b.token_ids)
        for a, b in zip(outputs["ddtree"], outputs["no speculation"], strict=True)
    )
    print()
    speed = {}
    for name in engines:
        tokens = sum(len(o.token_ids) for o in outputs[name])
        speed[name] = tokens / seconds[name]
        print(
            f"{name:15s} {tokens} tokens in {seconds[name]:.2f} s: "
            f"{speed[name]:.1f} tok/s"
        )
    tau = f"{1 + accepted / drafts:.2f}" if drafts else "- (no tree verified)"
    print(
        f"ddtree: {int(drafts)} tree verifications, acceptance length tau = {tau} "
        f"tokens per verify step; speed-up "
        f"{speed['ddtree'] / speed['no speculation']:.2f}x"
    )
    print(f"ddtree output == no-speculation output (greedy, token for token): {same}")
    if not same:
        raise SystemExit("lossless check failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--core",
        action="store_true",
        help="the tree build + verification demo, without vLLM",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="vLLM on the tiny embedded pair instead of SmolLM2-135M",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="new tokens per prompt (default 128; 48 with --tiny)",
    )
    parser.add_argument(
        "--cache-dir",
        default=os.path.expanduser("~/.cache/vllm-ddtree"),
        help="where the embedded default models are written",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="tree node budget B (default 32 in vLLM, 64 with --core)",
    )
    parser.add_argument("--depth", type=int, default=15, help="drafted positions L")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=8, help="target draws to verify")
    args = parser.parse_args()
    if not args.core:
        vllm_demo(
            args.tiny,
            args.budget or 32,
            args.max_tokens or (48 if args.tiny else 128),
            args.cache_dir,
        )
        return
    args.budget = args.budget or 64

    draft, favourite = synthetic_logits(args.depth, args.vocab, args.budget, args.seed)
    start = time.perf_counter()
    tree = build_ddtree(draft, args.budget, root_token_ids=torch.tensor([42]))
    build_ms = (time.perf_counter() - start) * 1e3
    print(
        f"DDTree: L={args.depth} V={args.vocab} B={args.budget}: "
        f"{int(tree.num_nodes[0])} nodes, max depth {int(tree.depths.max())}, "
        f"expected acceptance sum q(u) = {float(tree.scores[0, 1:].exp().sum()):.2f} "
        f"(built in {build_ms:.1f} ms)"
    )
    print_tree(tree)

    runs = [("greedy", None, "rejection")]
    sampled = TreeSamplingParams.from_lists(
        [1.0], top_k=[50], top_p=[0.95], seeds=[args.seed]
    )
    runs += [
        ("T=1 sample-walk", sampled, "sample_walk"),
        ("T=1 rejection", sampled, "rejection"),
    ]
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
                print(
                    f"{name:16s} accepted path {path}\n{'':16s} commits {n} drafts + 1 "
                    f"bonus: {tokens}"
                )
    for name, lengths in accepted.items():
        print(
            f"{name:16s} tokens per round over {args.rounds} target draws: {lengths} "
            f"(mean {sum(lengths) / len(lengths):.2f})"
        )


if __name__ == "__main__":
    main()
