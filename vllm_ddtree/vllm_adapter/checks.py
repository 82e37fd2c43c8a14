# SPDX-License-Identifier: Apache-2.0
"""Start-up checks of the target model and platform for ddtree (frontend process).

Each refusal is a ValueError that names what is missing, raised while the engine
config is built, before any model is loaded. What only the built model knows
(a layer's sliding window, alibi, sinks, softcap) is checked again, layer by
layer, when the worker loads the model
(:func:`vllm_ddtree.vllm_adapter.attn_context.check_model_tree_attention`), still
before the engine serves.
"""

from __future__ import annotations

__all__ = ["check_platform", "check_target", "check_target_and_platform"]


def check_target_and_platform(
    target_model_config, kv_cache_dtype: str = "auto"
) -> None:
    """Refuses targets and platforms the ddtree runner cannot serve losslessly."""
    check_platform()
    check_target(target_model_config, kv_cache_dtype)


def check_platform() -> None:
    """Refuses platforms without an ancestor-only tree attention backend."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        # The GPU attention backends would run tree rows causally: wrong tokens.
        raise ValueError(
            "ddtree's ancestor-only tree attention is implemented for vLLM's CPU "
            "attention backend only (this build); on this platform the verify pass "
            "would attend causally across tree branches, so ddtree is refused here"
        )


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
    if getattr(target_model_config, "is_hybrid", False):
        raise ValueError(
            "ddtree does not support hybrid (recurrent-state) targets: their state "
            "would need a tree-aware scan"
        )
    hf = target_model_config.hf_text_config
    window = target_model_config.get_sliding_window()
    if window is not None:
        raise ValueError(
            f"ddtree does not support sliding-window attention (the target's "
            f"sliding_window={window}): the tree attention attends to the whole "
            "prefix. Serve it with disable_sliding_window=True (max_model_len is "
            "then capped at the window), or without ddtree"
        )
    for key in ("attn_logit_softcapping", "attn_softcapping"):
        if getattr(hf, key, None):
            raise ValueError(
                f"ddtree does not support attention logit softcapping (the target's "
                f"{key}={getattr(hf, key)})"
            )
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
