# SPDX-License-Identifier: Apache-2.0
"""The CPU extension ``vllm_ddtree._C_cpu`` (sources in ``csrc/cpu/``): loader and
the compiled tree builder. Plugin only: the upstream series ships the torch
builder alone.

``setup.py`` builds it wherever torch and a C++ compiler are present. :func:`load`
never raises; it returns ``None`` when the extension is missing or cannot be loaded
(:func:`available` is then False, and the plugin's proposer builds its trees with
:func:`vllm_ddtree.tree.build_ddtree`).

Operators (``torch.ops.vllm_ddtree``):

* ``build_tree_cpu``: the DDTree of every request, field for field the
  :class:`vllm_ddtree.tree.DraftTree` of :func:`vllm_ddtree.tree.build_ddtree`
  (best-first heap per request, compiled; see ``csrc/cpu/tree_build.cpp``).
  Wrapped by :func:`build_ddtree_cpu`. On CPU tensors it is ~10x faster than the
  torch build, whose time there is per-operator overhead (a dozen small ops per
  depth), not arithmetic.
* ``tree_attention_cpu``: the ancestor-only attention of a verify step's
  recomputed tree rows, one call per layer, straight from vLLM's paged CPU cache
  (``csrc/cpu/tree_attention.cpp``; used by
  :class:`~vllm_ddtree.vllm_adapter.plugin_cpu_attention.PluginCPUAttentionImpl`,
  the torch path of ``cpu_attention`` is its reference).
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops.extension import load_extension
from vllm_ddtree.tree import (
    DraftTree,
    _check_draft_logits,
    _draft_candidates,
    _empty_tree,
    _resolve_budget,
)

__all__ = [
    "available",
    "build_ddtree_cpu",
    "load",
    "load_error",
    "tree_attention_available",
]

EXTENSION = "vllm_ddtree._C_cpu"
NAMESPACE = "vllm_ddtree"


def load():
    """The ``torch.ops.vllm_ddtree`` namespace if the extension loads, else ``None``."""
    return load_extension(EXTENSION, "build_tree_cpu", NAMESPACE)[0]


def load_error() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it loaded)."""
    return load_extension(EXTENSION, "build_tree_cpu", NAMESPACE)[1]


def available() -> bool:
    """Whether the compiled tree builder (:func:`build_ddtree_cpu`) can run."""
    return load() is not None


def tree_attention_available() -> bool:
    """Whether the compiled CPU tree attention (``tree_attention_cpu``, used by
    :mod:`vllm_ddtree.vllm_adapter.plugin_cpu_attention`) can run: an
    extension built before it was added lacks the operator."""
    ops = load()
    return ops is not None and hasattr(ops, "tree_attention_cpu")


def build_ddtree_cpu(
    draft_logits: torch.Tensor,
    budget: int | torch.Tensor,
    root_token_ids: torch.Tensor | None = None,
    *,
    max_budget: int | None = None,
    top_k: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_children: int | None = None,
    validate: bool = True,
) -> DraftTree:
    """:func:`vllm_ddtree.tree.build_ddtree` on CPU tensors, with the compiled
    best-first heap (``build_tree_cpu``): same arguments, checks and tree.

    Args:
        draft_logits: [num_reqs, L, V] per-position drafter logits, on the CPU.
        budget: node budget B (root excluded): an int, or a [num_reqs] int tensor.
        root_token_ids: [num_reqs] bonus tokens stored at row 0 (default 0).
        max_budget: static node capacity N when ``budget`` is a tensor; defaults
            to ``budget.max()``.
        top_k: precomputed :func:`vllm_ddtree.tree.draft_top_k` output with
            k >= min(N, V, max_children).
        max_children: draft tokens considered per depth (default min(B, V)).
        validate: check values (NaN/inf) too.

    Returns:
        The :class:`~vllm_ddtree.tree.DraftTree` with N = max budget node rows per
        request, equal field for field to ``build_ddtree``'s.

    Raises:
        ValueError: invalid arguments (as ``build_ddtree``), tensors not on the
            CPU, or the extension not loaded (:func:`load_error` says why).
    """
    _check_draft_logits(draft_logits, validate)
    ops = load()
    if draft_logits.device.type != "cpu" or ops is None:
        raise ValueError(
            "build_ddtree_cpu needs CPU tensors and the compiled CPU extension "
            f"(device {draft_logits.device}; extension: {load_error() or 'loaded'})"
        )
    num_reqs, depth_limit, _ = draft_logits.shape
    cap, per_req_budget = _resolve_budget(budget, num_reqs, max_budget)
    if cap == 0:
        return _empty_tree(num_reqs, depth_limit, root_token_ids, draft_logits.device)
    _, log_probs, token_ids = _draft_candidates(draft_logits, cap, max_children, top_k)
    if per_req_budget is None:
        budgets = torch.full((num_reqs,), cap, dtype=torch.int64)
    else:
        budgets = per_req_budget.to(device="cpu", dtype=torch.int64).contiguous()
    if root_token_ids is None:
        roots = torch.zeros(num_reqs, dtype=torch.int64)
    else:
        roots = root_token_ids.to(device="cpu", dtype=torch.int64).reshape(num_reqs)
    # The operator returns DraftTree's tensor fields in declaration order.
    fields = ops.build_tree_cpu(
        log_probs.contiguous(),
        token_ids.to(torch.int64).contiguous(),
        budgets,
        roots.contiguous(),
        cap,
    )
    return DraftTree(*fields, max_depth=depth_limit)
