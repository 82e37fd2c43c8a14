# SPDX-License-Identifier: Apache-2.0
"""Every Triton kernel variant a verify step launches is compiled at start-up.

Triton compiles a kernel once per *specialisation*: its constexprs (tiles) and,
for other integer arguments, whether a value is 1 or a multiple of 16 (pointers:
their dtype and 16-byte alignment). On a GPU each new one costs a 1-2 s compile,
and one that first shows up mid-serving is timed by the auto budget as the cost
of drafting. Here, on CPU, each launch is recorded instead of run, and its
specialisation is computed by Triton's own binder for a CUDA target (sm_90): the
launches of a varied run of verify steps (trees of 1 to B + 1 rows, 1 to 3
requests, both verify methods, raw and float32 logits, 1 to many KV moves) must
all be ones the start-up warm-up made. Each test also shows that the check sees
the bug: without the engine's fixed tiles, or with Triton's default
specialisation, the steps launch variants the warm-up did not compile.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.runtime.jit import (  # noqa: E402
    JITFunction,
    create_function_from_signature,
)
from vllm.v1.attention.backends import triton_attn  # noqa: E402

from vllm_ddtree.ops import kv_commit, tree_attention, triton_verify  # noqa: E402
from vllm_ddtree.sampling import TreeSamplingParams  # noqa: E402
from vllm_ddtree.tree import tree_from_parents  # noqa: E402
from vllm_ddtree.verify import verify_tree  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context  # noqa: E402
from vllm_ddtree.vllm_adapter.gpu_attention import (  # noqa: E402
    DDTreeTritonAttentionImpl,
    warm_up_tree_kernels,
)

BUDGET = 20  # B: trees of up to 21 rows (past 16: the divisibility boundary)
VOCAB = 1000
_BACKEND = CUDABackend(GPUTarget("cuda", 90, 32))


def _binder(kernel, specialize: bool):
    """Triton's argument binder of ``kernel`` for a CUDA target (interpreted or
    compiled kernel alike); ``specialize=False``: Triton's default
    specialisation, as if the kernel named no ``do_not_specialize``."""
    fn = getattr(kernel, "fn", kernel)
    names = ("do_not_specialize", "do_not_specialize_on_alignment")
    if isinstance(kernel, JITFunction):
        options = {name: getattr(kernel, name) for name in names}
    else:
        options = {name: kernel.kwargs.get(name) for name in names}
    jit = JITFunction(fn, **(options if specialize else {}))
    return create_function_from_signature(jit.signature, jit.params, _BACKEND)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` records
    the launch's specialisation key (with and without the kernel's
    ``do_not_specialize``) and runs nothing."""

    def __init__(self, kernel):
        self.binders = (_binder(kernel, True), _binder(kernel, False))
        self.keys: list[str] = []
        self.default_keys: list[str] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for binder, keys in zip(self.binders, (self.keys, self.default_keys),
                                    strict=True):
                _, specialization, options = binder(*args, **kwargs)
                keys.append(repr((specialization, sorted(options.items()))))

        return launch

    def clear(self) -> None:
        self.keys.clear()
        self.default_keys.clear()


@pytest.fixture
def record(monkeypatch):
    def patch(module, name) -> Recorder:
        recorder = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorder)
        return recorder

    return patch


def _random_tree(rng: random.Random, num_rows: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, num_rows)]


def test_verify_steps_launch_only_the_warmed_up_variants(record):
    kernel = record(triton_verify, "_tree_verify_kernel")
    assert triton_verify.warm_up_tree_verify(
        VOCAB, (torch.bfloat16, torch.float32), BUDGET, 1.0, 1.0, torch.device("cpu")
    ) == 4
    warm = set(kernel.keys)
    kernel.clear()

    def steps(max_tree_depth):
        rng = random.Random(0)
        for num_rows in (1, 2, 3, 5, 16, 17, BUDGET + 1):
            for num_reqs in (1, 3):
                parents = [_random_tree(rng, num_rows) for _ in range(num_reqs)]
                parents[0] = [-1] + list(range(num_rows - 1))  # a chain: the deepest
                tokens = [[rng.randrange(VOCAB) for _ in p] for p in parents]
                depth = max(num_rows - 1, 1)
                tree = tree_from_parents(parents, tokens, depth)
                rows = num_reqs * num_rows
                for dtype in (torch.bfloat16, torch.float32):
                    logits = torch.randn(rows + 2, VOCAB).to(dtype)
                    flat_rows = torch.arange(rows).view(num_reqs, num_rows)
                    params = TreeSamplingParams(
                        temperature=torch.full((num_reqs,), 0.7)
                    )
                    for method in ("rejection", "sample_walk"):
                        verify_tree(tree, logits, params, method=method,
                                    backend="triton", validate=False,
                                    row_index=flat_rows, max_tree_depth=max_tree_depth)

    steps(BUDGET)
    assert set(kernel.keys) <= warm, set(kernel.keys) - warm
    # The check sees the bug: Triton's default specialisation (the rows and the
    # depth of a step: 1, multiples of 16) and a path tile per step's depth.
    assert not set(kernel.default_keys) <= warm
    kernel.clear()
    steps(None)
    assert not set(kernel.keys) <= warm


def _forward_context(dtype, features: dict):
    num_heads, num_kv_heads, head, block_size = 4, 2, 16, 16
    impl = DDTreeTritonAttentionImpl(
        num_heads, head, head**-0.5, num_kv_heads, alibi_slopes=None,
        kv_cache_dtype="auto", **{"sliding_window": None, **features},
    )
    # TRITON_ATTN's layout [num_blocks, Hkv, block_size, 2 * D].
    cache = torch.randn(12, num_kv_heads, block_size, 2 * head).to(dtype)
    return {"layers.0.attn": SimpleNamespace(impl=impl, kv_cache=cache,
                                             layer_name="layers.0.attn")}, block_size


@pytest.mark.parametrize("features", [{}, {"sliding_window": 8, "logits_soft_cap": 30.0}])
def test_attention_and_commit_launch_only_the_warmed_up_variants(
    record, monkeypatch, features
):
    monkeypatch.setattr(
        triton_attn.TritonAttentionImpl, "forward",
        lambda self, layer, query, key, value, kv_cache, md, output, *a: output,
    )
    attention = record(tree_attention, "_tree_attention_kernel")
    commit = record(kv_commit, "_commit_kv_kernel")
    context, block_size = _forward_context(torch.bfloat16, features)
    assert warm_up_tree_kernels(context, BUDGET + 1) == 2
    warm_attention, warm_commit = set(attention.keys), set(commit.keys)
    attention.clear()
    commit.clear()
    layer = context["layers.0.attn"]

    def steps(max_tree_rows):
        rng = random.Random(1)
        for sizes in ([2], [3, 1 + BUDGET], [17, 16, 5], [1 + BUDGET] * 2, [1, 2]):
            reqs, qsl, slots = [], [0], []
            prefixes = [rng.randrange(0, 40) for _ in sizes]
            table = torch.tensor([[rng.randrange(12) for _ in range(5)] for _ in sizes],
                                 dtype=torch.int32)
            for r, (t, nc) in enumerate(zip(sizes, prefixes, strict=True)):
                tree = tree_from_parents([_random_tree(rng, t)], [[0] * t], max(t - 1, 1))
                reqs.append(attn_context.TreeRequest(
                    req_index=r, row_offset=0, num_rows=t, prefix_len=nc,
                    visibility=tree.visibility[0, :t, :t]))
                qsl.append(qsl[-1] + t)
                for pos in range(nc, nc + t):
                    slots.append(int(table[r, pos // block_size]) * block_size
                                 + pos % block_size)
            metadata = SimpleNamespace(
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                block_table=table,
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
            )
            batch = attn_context.TreeAttentionBatch(tuple(reqs),
                                                    max_tree_rows=max_tree_rows)
            rows = qsl[-1]
            query = torch.randn(rows, 4 * 16).to(torch.bfloat16)
            layer.impl.forward(layer, query, None, None, layer.kv_cache,
                               attn_context.metadata_with_tree(metadata, batch),
                               torch.zeros_like(query))
            moves = rng.choice([1, 2, 16, rows])
            src = torch.tensor([rng.randrange(rows) for _ in range(moves)])
            batch.commit_kv((src, torch.arange(moves)), row_space="tree")

    steps(BUDGET + 1)
    assert set(attention.keys) <= warm_attention, set(attention.keys) - warm_attention
    assert set(commit.keys) <= warm_commit, set(commit.keys) - warm_commit
    # The check sees the bug: default specialisation (mask strides, block-table
    # width, the number of moves) and tiles that follow each step's largest tree.
    assert not set(attention.default_keys) <= warm_attention
    assert not set(commit.default_keys) <= warm_commit
    attention.clear()
    steps(None)
    assert not set(attention.keys) <= warm_attention
