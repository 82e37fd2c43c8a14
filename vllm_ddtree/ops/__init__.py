# SPDX-License-Identifier: Apache-2.0
"""Kernel dispatch: CUDA extension > Triton > torch, by device and availability.

Every backend implements the same contract as the torch reference
(:func:`vllm_ddtree.verify.verify_tree_torch`) and is tested equal to it.
Kernels see only temperature; a request's min-p / top-k / top-p are applied here
in torch first (vLLM's own sampler does the same amount of work on its rows).
"""

from __future__ import annotations

import functools
import os

import torch

from vllm_ddtree.sampling import TreeSamplingParams, apply_sampling_params
from vllm_ddtree.tree import DraftTree

BACKENDS = ("cuda", "triton", "torch")


@functools.cache
def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_extension_available() -> bool:
    from vllm_ddtree.ops import cuda_ext

    return cuda_ext.load() is not None


def available_backends(device: torch.device) -> list[str]:
    """Backends that can run on ``device``, fastest first."""
    out = []
    if device.type == "cuda" and cuda_extension_available():
        out.append("cuda")
    if _triton_usable() and (
        device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        out.append("triton")
    out.append("torch")
    return out


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS + ("auto",):
        raise ValueError(
            f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}"
        )
    usable = available_backends(device)
    if backend == "auto":
        # Under TRITON_INTERPRET the Triton "kernels" are numpy: correct but slow.
        return next(b for b in usable if not (b == "triton" and device.type != "cuda"))
    if backend not in usable:
        raise ValueError(
            f"backend {backend!r} is not available on {device} (have {usable})"
        )
    return backend


def kernel_inputs(
    target_logits: torch.Tensor,
    row_index: torch.Tensor | None,
    params: TreeSamplingParams,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(logits, row_index, temperature) for kernels that only apply temperature.

    Without min-p/top-k/top-p the kernels read ``target_logits`` in place. With
    them, the tree rows are copied once to float32 (as vLLM's rejection sampler
    does) and processed there, temperature included, by vLLM's own top-k/top-p
    (no full-vocabulary sort on GPU); they are then passed with temperature 1.
    Greedy requests get no filters, so their rows keep the raw argmax.
    """
    if params.top_k is None and params.top_p is None and params.min_p is None:
        return target_logits, row_index, params.temperature
    vocab = target_logits.shape[-1]
    if row_index is None:
        num_reqs, rows = target_logits.shape[:2]
        # copy=True: never edit the caller's logits, even when already float32.
        rows_f32 = target_logits.reshape(-1, vocab).to(torch.float32, copy=True)
    else:
        num_reqs, rows = row_index.shape
        rows_f32 = target_logits[row_index.reshape(-1)].float()  # indexing copies
    greedy = params.is_greedy
    row_params = TreeSamplingParams(
        temperature=params.temperature,
        top_k=None if params.top_k is None else torch.where(greedy, 0, params.top_k),
        top_p=None if params.top_p is None else torch.where(greedy, 1.0, params.top_p),
        min_p=None if params.min_p is None else torch.where(greedy, 0.0, params.min_p),
    )
    row_req = torch.arange(num_reqs, device=target_logits.device).repeat_interleave(
        rows
    )
    processed = apply_sampling_params(rows_f32, row_params.select(row_req))
    temperature = torch.where(greedy, 0.0, 1.0)
    return processed.view(num_reqs, rows, vocab), None, temperature


def tree_verify_dispatch(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: TreeSamplingParams,
    method: str,
    coins: tuple[torch.Tensor, torch.Tensor],
    threshold_single: float,
    threshold_acc: float,
    backend: str = "auto",
    row_index: torch.Tensor | None = None,
    max_tree_depth: int | None = None,
):
    from vllm_ddtree.verify import METHOD_IDS, TreeVerifyOutput, verify_tree_torch

    backend = resolve_backend(backend, target_logits.device)
    if backend == "torch":
        return verify_tree_torch(
            tree,
            target_logits,
            params,
            method,
            coins,
            threshold_single,
            threshold_acc,
            row_index,
        )
    logits, row_index, temperature = kernel_inputs(target_logits, row_index, params)
    options = {}
    if backend == "triton":
        from vllm_ddtree.ops.triton_verify import tree_verify_triton as kernel

        if max_tree_depth is not None:
            # One path tile for every step of the engine: one compiled variant.
            options["block_w"] = _next_power_of_2(max_tree_depth + 1)
    else:
        from vllm_ddtree.ops.cuda_ext import tree_verify_cuda as kernel

        if params.all_greedy:
            temperature = None  # the greedy-only kernel: no distributions at all
    accepted, committed, num_accepted = kernel(
        logits,
        tree.tokens,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        temperature,
        coins[0],
        coins[1],
        tree.max_depth,
        METHOD_IDS[method],
        threshold_single,
        threshold_acc,
        row_index=row_index,
        **options,
    )
    return TreeVerifyOutput(accepted, committed, num_accepted)


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 without importing Triton (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
