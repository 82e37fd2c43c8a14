# SPDX-License-Identifier: Apache-2.0
"""Times tree build and verification backends on a CUDA device (scripts/gpu_check.sh).

Side by side in one process, CUDA events, medians over repeats, identical inputs;
integer outputs of every backend are compared with the torch reference.
"""

import argparse
import json
import statistics

import torch

from vllm_ddtree.ops import available_backends
from vllm_ddtree.sampling import TreeSamplingParams, draw_coins
from vllm_ddtree.tree import build_ddtree, draft_top_k
from vllm_ddtree.verify import verify_tree


def cuda_ms(fn, repeats=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernel_timing.json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    depth, vocab = 15, 151_936
    rows = []
    for num_reqs in (1, 16, 64):
        for budget in (16, 64, 256, 512):
            g = torch.Generator(device=dev).manual_seed(0)
            draft = torch.randn(num_reqs, depth, vocab, device=dev, generator=g)
            draft[:, torch.arange(depth), torch.randint(0, vocab, (depth,), device=dev)] += 12
            shared = cuda_ms(lambda: draft_top_k(draft, min(budget, vocab)))
            tk = draft_top_k(draft, min(budget, vocab))
            build = cuda_ms(lambda: build_ddtree(draft, budget, top_k=tk, validate=False))
            tree = build_ddtree(draft, budget, top_k=tk, validate=False)
            target = torch.randn(num_reqs, tree.num_rows, vocab, device=dev,
                                 dtype=torch.bfloat16, generator=g)
            coins = draw_coins(num_reqs, tree.num_rows, dev)
            row = {"num_reqs": num_reqs, "budget": budget, "top_k_ms": shared,
                   "build_ms": build}
            for label, params, method in (
                ("greedy", None, "rejection"),
                ("t1_sample_walk", TreeSamplingParams.from_lists([1.0] * num_reqs, device=dev),
                 "sample_walk"),
                ("t1_rejection", TreeSamplingParams.from_lists([1.0] * num_reqs, device=dev),
                 "rejection"),
            ):
                ref = verify_tree(tree, target, params, method=method, coins=coins,
                                  backend="torch", validate=False)
                for backend in available_backends(dev):
                    fn = lambda: verify_tree(tree, target, params, method=method,  # noqa: E731
                                             coins=coins, backend=backend, validate=False)
                    out = fn()
                    same = torch.equal(out.committed_tokens, ref.committed_tokens)
                    row[f"{label}_{backend}_ms"] = cuda_ms(fn)
                    row[f"{label}_{backend}_equal"] = same
            print(json.dumps(row))
            rows.append(row)
            del draft, target
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
