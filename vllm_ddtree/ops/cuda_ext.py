# SPDX-License-Identifier: Apache-2.0
"""The CUDA tree-verify operator: loader and Python API.

Sources: ``tree_verify.cuh`` (the kernel, torch-free) and ``tree_verify.cu`` (its
stable-ABI torch binding) in ``csrc/``. The library ``_EXTENSION`` registers the
operator as ``torch.ops.<_NAMESPACE>.<_OPERATOR>``: this package's optional
extension (built by ``setup.py`` only where a CUDA build of torch and the CUDA
toolkit are both present), or, with ddtree in-tree, vLLM's own stable-ABI
library. :func:`load` never raises; it returns ``None`` when the operator is
missing or cannot be loaded (e.g. built against another torch), and the
dispatcher then falls back to Triton or torch.

The operator: tree verification with the contract of
``verify.verify_tree_torch`` (greedy requests, ``sample_walk`` and target-only
``rejection``), one thread block per request. Wrapped by
:func:`tree_verify_cuda`; its fake (meta) implementation, for tracing, is
registered here on load.
"""

from __future__ import annotations

import functools

import torch

from vllm_ddtree.ops.extension import load_extension

__all__ = ["load", "load_error", "tree_verify_cuda"]

# Where the operator lives (the patch series points these at vLLM's library).
_EXTENSION = "vllm_ddtree._C"
_NAMESPACE = "vllm_ddtree"
_OPERATOR = "tree_verify"
_METHODS = {"sample_walk": 0, "rejection": 1}
_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _load() -> tuple[object | None, str | None]:
    ops, why = load_extension(_EXTENSION, _OPERATOR, _NAMESPACE)
    if ops is None:
        return None, why
    try:
        _register_fake(f"{_NAMESPACE}::{_OPERATOR}")
    except Exception as exc:  # e.g. another library registered one already
        return None, f"registering the fake implementation failed: {exc}"
    return getattr(ops, _OPERATOR), None


@functools.cache
def _register_fake(name: str) -> None:
    # The operator only writes its outputs in place: nothing to compute.
    torch.library.register_fake(name)(lambda *args: None)


def load():
    """The tree-verify operator if the extension loads, else ``None``.

    Imports the extension on first use (which registers the operator) and caches
    the outcome; never raises.
    """
    return _load()[0]


def load_error() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it loaded)."""
    return _load()[1]


def tree_verify_cuda(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    temperature: torch.Tensor | None,
    node_coins: torch.Tensor | None,
    final_coins: torch.Tensor | None,
    max_depth: int,
    method: int | str,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    row_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verifies a batch of draft trees with the CUDA kernel (one block per request).

    Same contract as the torch reference and the Triton kernel. Kernels see only
    temperature: apply min-p / top-k / top-p first (``ops.kernel_inputs``).
    R requests, N + 1 tree rows, V vocab.

    Args:
        logits: [R, N + 1, V] float32 / float16 / bfloat16 target logits; row i is
            the target's next-token logits after the path root..i. Only the vocab
            dimension must be contiguous. With ``row_index``: [M, V], any rows
            (e.g. the target's logits of the whole batch), read in place.
        tokens: [R, N + 1] int64 node tokens (row 0 = root, unused).
        next_token: [R, N + 1] int64 LCRS first child, -1 if none.
        next_sibling: [R, N + 1] int64 LCRS next sibling in draft-rank order, -1 if
            none.
        temperature: [R] float32; < 1e-5 means greedy (argmax of the raw row).
            ``None`` runs the greedy-only kernel (the coins are then not needed).
        node_coins: [R, N + 1] float32 uniforms in [0, 1), one per node.
        final_coins: [R] float32 uniforms in [0, 1) for the rejection method's
            residual draw.
        max_depth: L, the deepest possible node (``DraftTree.max_depth``).
        method: 0 / ``"sample_walk"`` or 1 / ``"rejection"`` for sampled requests.
        threshold_single, threshold_acc: EAGLE relaxations in (0, 1]; 1.0 is exact.
        row_index: [R, N + 1] int64: tree row i of request b is
            ``logits[row_index[b, i]]`` (entries are not range-checked).

    Returns:
        ``(accepted_indices [R, L + 1] int64`` (local node ids, root first, -1
        padded), ``committed_tokens [R, L + 1] int64`` (accepted drafts then one
        bonus token, -1 padded), ``num_accepted [R] int64)``. The kernel writes
        every entry, padding included, so the outputs are not pre-filled.

    Raises:
        RuntimeError: the extension is not available, or the operator rejected its
            inputs.
    """
    op = load()
    if op is None:
        raise RuntimeError(
            f"the DDTree CUDA operator {_NAMESPACE}.{_OPERATOR} ({_EXTENSION}) is "
            f"not available ({load_error()}): build the extension where a CUDA "
            "build of torch and the CUDA toolkit are installed, or use "
            "backend='triton' or backend='torch'."
        )
    dims = 3 if row_index is None else 2
    if not isinstance(logits, torch.Tensor) or logits.dim() != dims:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
        want = "[num_reqs, N + 1, vocab_size]" if dims == 3 else "[num_logits, vocab]"
        raise ValueError(f"logits must have shape {want}, got {shape}")
    if isinstance(method, str):
        if method not in _METHODS:
            raise ValueError(
                f"method must be one of {sorted(_METHODS)}, got {method!r}"
            )
        method = _METHODS[method]
    max_depth = int(max_depth)
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")

    device = logits.device
    if logits.dtype not in _LOGIT_DTYPES:
        logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()

    def as_long(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.int64).contiguous()

    def as_float(t: torch.Tensor | None) -> torch.Tensor | None:
        return (
            None if t is None else t.to(device=device, dtype=torch.float32).contiguous()
        )

    num_reqs = logits.shape[0] if row_index is None else row_index.shape[0]
    width = max_depth + 1
    accepted = torch.empty((num_reqs, width), dtype=torch.int64, device=device)
    committed = torch.empty((num_reqs, width), dtype=torch.int64, device=device)
    num_accepted = torch.empty((num_reqs,), dtype=torch.int64, device=device)
    op(
        accepted,
        committed,
        num_accepted,
        logits,
        as_long(tokens),
        as_long(next_token),
        as_long(next_sibling),
        as_float(temperature),
        as_float(node_coins),
        as_float(final_coins),
        max_depth,
        int(method),
        float(threshold_single),
        float(threshold_acc),
        None if row_index is None else as_long(row_index),
    )
    return accepted, committed, num_accepted
