# SPDX-License-Identifier: Apache-2.0
"""Start-up checks of the target model and platform for ddtree (frontend process).

Each refusal is a ValueError that names what is missing, raised while the engine
config is built, before any model is loaded. What only the built model knows
(a layer's sliding window, alibi, sinks, softcap) is checked again, layer by
layer, when the worker loads the model
(:func:`vllm_ddtree.vllm_adapter.attn_context.check_model_tree_attention`), still
before the engine serves.

Platforms: the CPU runs tree attention in the CPU_ATTN backend (validated end to
end). CUDA has a tree-aware TRITON_ATTN backend (Triton tree attention over the
paged cache, in-cache KV commit) and, for MLA targets, a tree-aware TRITON_MLA
(latent-space tree attention), whose kernels are tested against the torch
references, but no engine has run them on a GPU yet: they start only when the
user opts in with ``VLLM_DDTREE_UNVALIDATED_GPU=1``, and then with piecewise CUDA
graphs only (:func:`gpu_engine_settings`, :func:`gpu_backend_per_kind`,
:func:`gpu_compilation_settings`). Every other
platform is refused.
"""

from __future__ import annotations

import os

__all__ = [
    "GPU_MLA_TREE_ATTENTION_BACKEND",
    "GPU_TREE_ATTENTION_BACKEND",
    "gpu_backend_per_kind",
    "gpu_compilation_settings",
    "UNVALIDATED_GPU_ENV",
    "check_hybrid_target",
    "check_platform",
    "check_target",
    "check_target_and_platform",
    "gpu_engine_settings",
    "gpu_opted_in",
]

UNVALIDATED_GPU_ENV = "VLLM_DDTREE_UNVALIDATED_GPU"
GPU_TREE_ATTENTION_BACKEND = "TRITON_ATTN"
# The tree-aware backend of MLA layers (DeepSeek-V2/V3, Kimi-K2 targets) on CUDA;
# the drafter's layers stay on GPU_TREE_ATTENTION_BACKEND.
GPU_MLA_TREE_ATTENTION_BACKEND = "TRITON_MLA"
_MLA_KIND = "mla_attention"


def check_target_and_platform(
    target_model_config, kv_cache_dtype: str = "auto"
) -> None:
    """Refuses targets and platforms the ddtree runner cannot serve losslessly."""
    check_platform()
    if getattr(target_model_config, "is_hybrid", False):
        check_hybrid_target()
    check_target(target_model_config, kv_cache_dtype)


def check_hybrid_target() -> None:
    """Refuses what a hybrid (Gated DeltaNet) target cannot do exactly with
    ddtree: the tree path of its recurrent layers runs on the CPU
    (``gdn_state``) and, opted in, on CUDA (``gpu_gdn``); without vLLM's prefix
    caching of recurrent states, which the engine config turns off
    (:func:`~vllm_ddtree.vllm_adapter.config.apply_required_settings`)."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or gpu_opted_in(current_platform)):
        raise ValueError(
            "ddtree serves hybrid (Gated DeltaNet) targets on the CPU, and on CUDA "
            f"with {UNVALIDATED_GPU_ENV}=1 (the Triton tree recurrence, not yet "
            "run on a GPU): their recurrent layers must follow the tree"
        )


def gpu_opted_in(platform=None) -> bool:
    """True on CUDA when the user opted in to the not-yet-validated GPU path."""
    if os.environ.get(UNVALIDATED_GPU_ENV) != "1":
        return False
    if platform is None:
        from vllm.platforms import current_platform as platform
    return platform.is_cuda()


def check_platform() -> None:
    """Refuses platforms without a validated ancestor-only tree attention backend
    (CUDA passes when opted in, see :func:`gpu_opted_in`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or gpu_opted_in(current_platform):
        return
    # Any other backend would run tree rows causally: wrong tokens.
    hint = (
        f" (the CUDA path is written but has not run on a GPU yet: "
        f"{UNVALIDATED_GPU_ENV}=1 enables it, with TRITON_ATTN)"
        if current_platform.is_cuda()
        else ""
    )
    raise ValueError(
        "ddtree's ancestor-only tree attention is validated for vLLM's CPU "
        "attention backend only; on this platform the verify pass could attend "
        f"causally across tree branches, so ddtree is refused here{hint}"
    )


def gpu_engine_settings(requested_backends) -> str | None:
    """The attention backend a ddtree engine must use on this platform.

    Returns ``None`` on the CPU (vLLM's CPU_ATTN, made tree-aware by the worker)
    and ``"TRITON_ATTN"`` on CUDA, where the caller also limits CUDA graphs to
    piecewise ones (:func:`gpu_compilation_settings`).

    Args:
        requested_backends: the attention backends the user asked for (enum
            members or names; ``None`` entries are ignored).

    Raises:
        ValueError: on CUDA, another backend was requested.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    requested = [b for b in requested_backends if b is not None]
    for backend in requested:
        name = getattr(backend, "name", str(backend))
        if name != GPU_TREE_ATTENTION_BACKEND:
            raise ValueError(
                f"ddtree on CUDA runs tree attention in the "
                f"{GPU_TREE_ATTENTION_BACKEND} backend; attention backend {name} "
                "was requested"
            )
    if not requested:
        # vLLM would pick its own default (FLASH_ATTN on Hopper): prefill and
        # time to first token move with the switch, so it is said.
        from vllm.logger import init_logger

        init_logger(__name__).warning(
            "ddtree: attention backend set to %s for every layer (vLLM's "
            "default backend has no tree attention); prefill and time to first "
            "token run on it too. Pass --attention-backend %s to make this "
            "explicit.",
            GPU_TREE_ATTENTION_BACKEND,
            GPU_TREE_ATTENTION_BACKEND,
        )
    return GPU_TREE_ATTENTION_BACKEND


def gpu_compilation_settings(compilation) -> None:
    """Limits a ddtree engine on CUDA to piecewise CUDA graphs and leaves
    attention unfused, in place.

    Piecewise graphs only: a verify step's tree plan (ancestor masks, the
    query-query bias, commit slots) is built on the host for that step, so a
    full graph would replay one step's plan for every later step. Piecewise
    graphs capture what lies between attention layers (attention, MLA and
    Gated DeltaNet cores are vLLM's splitting ops, run eagerly with the step's
    metadata), and the tree positions are written into the runner's persistent
    ``positions`` buffer before the forward. The tree-aware builders declare
    ``AttentionCGSupport.NEVER``, which vLLM would also meet by downgrading
    full graphs when the runner starts; deciding here makes the resolved
    config say so. ``NONE`` (eager) stays ``NONE``. Output quantization fused
    into attention (``fuse_attn_quant``) is turned off: the tree attention
    writes unquantized outputs.

    Args:
        compilation: the engine's ``CompilationConfig``, or its dict form (as
            parsed from ``-cc`` / JSON).
    """
    from vllm.config import CUDAGraphMode

    def get(obj, key):
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    def put(obj, key, value) -> None:
        if isinstance(obj, dict):
            obj[key] = value
        else:
            setattr(obj, key, value)

    mode = get(compilation, "cudagraph_mode")
    if isinstance(mode, str):
        mode = CUDAGraphMode[mode.upper()]
    if mode is None or mode.has_full_cudagraphs():
        from vllm.logger import init_logger

        init_logger(__name__).warning(
            "ddtree: cudagraph_mode %s -> PIECEWISE (a verify step's tree plan "
            "is built per step; a full graph would replay one step's)",
            "vLLM's default" if mode is None else mode.name,
        )
        mode = CUDAGraphMode.PIECEWISE
    put(compilation, "cudagraph_mode", mode)
    passes = get(compilation, "pass_config")
    if passes is None:
        passes = {}
        put(compilation, "pass_config", passes)
    put(passes, "fuse_attn_quant", False)


def gpu_backend_per_kind(use_mla: bool, requested: dict | None) -> dict | None:
    """The per-KV-cache-kind backends (``AttentionConfig.backend_per_kind``) a
    ddtree engine must use on this platform.

    Returns ``None`` off CUDA (nothing to set). On CUDA: ``requested`` (as
    ``AttentionBackendEnum`` members) with an MLA target's layers on
    ``TRITON_MLA`` (the tree-aware MLA backend, beside the drafter's
    ``TRITON_ATTN``).

    Args:
        use_mla: the target uses multi-head latent attention.
        requested: the user's ``backend_per_kind`` (kind -> enum member or name).

    Raises:
        ValueError: on CUDA, a kind was given a backend without tree attention.
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if not current_platform.is_cuda():
        return None
    per_kind = {}
    for kind, backend in (requested or {}).items():
        name = getattr(backend, "name", str(backend)).upper()
        wanted = (
            GPU_MLA_TREE_ATTENTION_BACKEND
            if "mla" in kind
            else GPU_TREE_ATTENTION_BACKEND
        )
        if name != wanted:
            raise ValueError(
                f"ddtree on CUDA runs tree attention in {wanted} for "
                f"{kind!r} layers; backend_per_kind[{kind!r}] = {name} was requested"
            )
        per_kind[kind] = AttentionBackendEnum[name]
    if use_mla:
        per_kind.setdefault(
            _MLA_KIND, AttentionBackendEnum[GPU_MLA_TREE_ATTENTION_BACKEND]
        )
    return per_kind


def check_target(target_model_config, kv_cache_dtype: str = "auto") -> None:
    """Refuses targets the DFlash drafter or the tree verify cannot serve."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    model_cls, arch = ModelRegistry.resolve_model_cls(
        target_model_config.architectures, target_model_config
    )
    if not supports_eagle3(model_cls):
        raise ValueError(
            f"ddtree needs a target that returns aux hidden states for the DFlash "
            "drafter (vLLM's SupportsEagle3: Llama, Qwen2, Qwen3, ...); "
            f"{arch} does not"
        )
    if getattr(target_model_config, "uses_mrope", False):
        raise ValueError(
            "ddtree does not support M-RoPE targets (positions are per depth)"
        )
    # Sliding windows (per layer), attention sinks and logit softcap are the
    # tree attention's to honour or refuse, layer by layer, when the worker
    # loads the model (attn_context.check_model_tree_attention).
    hf = target_model_config.hf_text_config
    if getattr(hf, "alibi", False) or getattr(hf, "position_embedding_type", None) == (
        "alibi"
    ):
        raise ValueError("ddtree does not support ALiBi targets")
    if getattr(hf, "num_kv_shared_layers", 0):
        raise ValueError(
            "ddtree does not support KV-cache sharing across layers (the target's "
            f"num_kv_shared_layers={hf.num_kv_shared_layers})"
        )
    if kv_cache_dtype not in ("auto", None):
        raise ValueError(
            f"ddtree does not support kv_cache_dtype={kv_cache_dtype!r}: the tree "
            "attention and the KV commit read and move unquantized K/V; use "
            "kv_cache_dtype='auto'"
        )
