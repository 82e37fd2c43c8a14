# SPDX-License-Identifier: Apache-2.0
"""The ``ddtree`` keys of ``--speculative-config`` and their validation.

vLLM 0.32's ``SpeculativeConfig`` is a pydantic dataclass whose ``method`` is a
closed Literal and which forbids unknown keys. Every DFlash code path (aux hidden
states, drafter loading, parallel drafting, lookahead KV slots) keys on
``method == "dflash"``, so ``"ddtree"`` is accepted at the user boundary
(``EngineArgs.create_speculative_config``), the ``ddtree_*`` keys are taken out,
the engine runs its DFlash plumbing, and a :class:`DDTreeConfig` rides along on
the ``SpeculativeConfig`` instance (it survives pickling to engine and worker
processes).

This module must import cheaply and without vLLM: configs are unpickled in new
processes before the rest of ddtree is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DDTreeConfig", "DDTREE_KEYS", "pop_ddtree_config", "get_ddtree_config"]

DDTREE_METHOD = "ddtree"


@dataclass(frozen=True)
class DDTreeConfig:
    """DDTree options (``num_speculative_tokens`` is the node budget B)."""

    budget: int
    """Tree node budget B: draft nodes verified per request per step (root excluded)."""
    draft_len: int | None = None
    """Drafted positions L (maximum tree depth). Default: the drafter's
    ``block_size - 1``."""
    verify: str = "rejection"
    """Sampling rule at temperature > 0: ``"rejection"`` (target-only tree rejection
    sampling) or ``"sample_walk"`` (one target sample per node). Both are lossless;
    temperature 0 always uses the greedy walk."""
    threshold_single: float = 1.0
    """EAGLE-style relaxation of the rejection rule; 1.0 is exact (lossless)."""
    threshold_acc: float = 1.0
    """EAGLE-style relaxation of the rejection rule; 1.0 is exact (lossless)."""
    max_children: int | None = None
    """Draft tokens considered per depth, hence children per node at most (the
    paper's K; default min(B, vocab)). 1 verifies the DFlash argmax chain with
    the lossless tree sampler."""
    kernel_backend: str = "auto"
    """Verification backend: ``"auto"`` (CUDA extension > Triton > torch), ``"cuda"``,
    ``"triton"`` or ``"torch"``."""
    budget_mode: str | None = None
    """``"auto"``: B is the largest budget; each step keeps, per request, the tree
    prefix that maximises the batch's expected tokens per second under step-cost
    models fitted online, and skips the drafter forward (its context K/V is still
    written) while drafting does not pay
    (:mod:`vllm_ddtree.vllm_adapter.budget_control`).
    ``"fixed"``: every tree has B nodes (``num_speculative_tokens``).
    Unset (None) resolves at start-up to ``"auto"``, or to ``"fixed"`` where auto
    is unsupported (tensor parallelism)."""


# User-facing key -> DDTreeConfig field.
DDTREE_KEYS = {
    "ddtree_draft_len": "draft_len",
    "ddtree_verify": "verify",
    "ddtree_threshold_single": "threshold_single",
    "ddtree_threshold_acc": "threshold_acc",
    "ddtree_kernel_backend": "kernel_backend",
    "ddtree_max_children": "max_children",
    "ddtree_budget": "budget_mode",
}


def pop_ddtree_config(spec: dict[str, Any]) -> DDTreeConfig | None:
    """Takes the ddtree keys out of a ``--speculative-config`` dict.

    Returns None (and leaves ``spec`` alone) unless ``spec["method"] == "ddtree"``.
    Otherwise rewrites the method to ``"dflash"`` and returns the validated
    :class:`DDTreeConfig`. Raises ValueError naming the offending key.
    """
    if spec.get("method") != DDTREE_METHOD:
        stray = sorted(
            k for k in spec if str(k).replace("-", "_").startswith("ddtree_")
        )
        if stray:
            raise ValueError(
                f'speculative_config keys {stray} need "method": "ddtree" '
                f"(got method={spec.get('method')!r})"
            )
        return None
    unknown = sorted(
        k
        for k in spec
        if k.replace("-", "_").startswith("ddtree")
        and k.replace("-", "_") not in DDTREE_KEYS
    )
    if unknown:
        raise ValueError(
            f"unknown ddtree key(s) {unknown} in speculative_config; known: "
            f"{sorted(DDTREE_KEYS)}"
        )
    if not spec.get("model"):
        raise ValueError(
            'speculative_config with "method": "ddtree" needs "model": the path of a '
            'DFlash drafter checkpoint (the format vLLM\'s "dflash" method loads)'
        )
    budget = spec.get("num_speculative_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            'speculative_config "num_speculative_tokens" is the ddtree node budget B '
            f"and must be an integer >= 1, got {budget!r}"
        )
    fields: dict[str, Any] = {}
    for key in list(spec):
        norm = key.replace("-", "_")
        if norm in DDTREE_KEYS:
            fields[DDTREE_KEYS[norm]] = spec.pop(key)
    cfg = DDTreeConfig(budget=budget, **fields)
    _validate(cfg)
    spec["method"] = "dflash"
    return cfg


def _validate(cfg: DDTreeConfig) -> None:
    if cfg.draft_len is not None and (
        isinstance(cfg.draft_len, bool)
        or not isinstance(cfg.draft_len, int)
        or cfg.draft_len < 1
    ):
        raise ValueError(
            f"ddtree_draft_len must be an integer >= 1, got {cfg.draft_len!r}"
        )
    if cfg.max_children is not None and (
        isinstance(cfg.max_children, bool)
        or not isinstance(cfg.max_children, int)
        or cfg.max_children < 1
    ):
        raise ValueError(
            f"ddtree_max_children must be an integer >= 1, got {cfg.max_children!r}"
        )
    if cfg.verify not in ("rejection", "sample_walk"):
        raise ValueError(
            f"ddtree_verify must be 'rejection' or 'sample_walk', got {cfg.verify!r}"
        )
    for name in ("threshold_single", "threshold_acc"):
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise ValueError(f"ddtree_{name} must be in (0, 1], got {value!r}")
    if cfg.budget_mode not in (None, "auto", "fixed"):
        raise ValueError(
            f"ddtree_budget must be 'auto' or 'fixed', got {cfg.budget_mode!r}"
        )
    if cfg.kernel_backend not in ("auto", "cuda", "triton", "torch"):
        raise ValueError(
            "ddtree_kernel_backend must be 'auto', 'cuda', 'triton' or 'torch', got "
            f"{cfg.kernel_backend!r}"
        )


def get_ddtree_config(vllm_config: Any) -> DDTreeConfig | None:
    """The DDTreeConfig of an engine, or None when ddtree is not on."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "ddtree", None) if spec is not None else None
