# SPDX-License-Identifier: Apache-2.0
"""Diagnostic: where a verify step's target forward goes, against a plain decode step.

Two engines (no speculation; ddtree with a fixed budget B, lookup off, so every
step verifies a drafter tree), one after the other, the same prompts; per engine
the mean target forward (``_model_forward``, prefills included) and torch's
profiler table grouped by input shape, so that the verify forward's [B + 1, ...]
GEMMs, the attention layer calls (stock kernel, ``tree_attention_cpu``, the K/V
stash) and the drafter's calls can be told apart. Prints the CPU flags it ran
with; compare within one run only.

    .venv/bin/python benchmarks/profile_verify_step.py --budget 4 --tokens 48
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rows", type=int, default=30, help="profiler table rows")
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()

    import torch
    import vllm
    from bench_core import cpu_flags, cpu_model
    from bench_real import DEFAULT_DRAFTER
    from transformers import AutoTokenizer

    import vllm_ddtree
    from vllm_ddtree import assets

    vllm_ddtree.register()
    flags = " ".join(cpu_flags())
    print(f"machine: {cpu_model()} ({os.cpu_count()} CPUs; flags {flags})")
    target = assets.smollm2_target()
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = assets.load_prompts("mtbench", args.prompts + 1, tokenizer, seed=1,
                                max_prompt_tokens=200)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    specs = {
        "nospec": None,
        f"ddtree-{args.budget}": {
            "method": "ddtree", "model": str(DEFAULT_DRAFTER),
            "num_speculative_tokens": args.budget, "ddtree_budget": "fixed",
            "ddtree_lookup": "off",
        },
    }
    params = vllm.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for name, spec in specs.items():
        llm = vllm.LLM(model=target, dtype="float32", enforce_eager=args.eager, seed=0,
                       max_model_len=512, max_num_seqs=1, enable_prefix_caching=False,
                       speculative_config=spec)
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        forward = {"s": 0.0, "n": 0}
        model_forward = runner._model_forward

        def timed(*a, _f=model_forward, _acc=forward, **k):
            t0 = time.perf_counter()
            out = _f(*a, **k)
            _acc["s"] += time.perf_counter() - t0
            _acc["n"] += 1
            return out

        runner._model_forward = timed
        # The first prompt warms up; the rest are profiled.
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        forward["s"], forward["n"] = 0.0, 0
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params,
                         use_tqdm=False)
        print(f"== {name}: {forward['n']} target forwards, "
              f"{forward['s'] / forward['n'] * 1e3:.2f} ms each (prefills included)")
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=args.rows,
            max_name_column_width=40, max_shapes_column_width=70))
        del llm


if __name__ == "__main__":
    main()
