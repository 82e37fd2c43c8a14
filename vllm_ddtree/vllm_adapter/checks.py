# SPDX-License-Identifier: Apache-2.0
"""Start-up checks of the target model and platform for ddtree (frontend process).

Each refusal is a ValueError that names what is missing, raised while the engine
config is built, before any model is loaded.
"""

from __future__ import annotations

__all__ = ["check_platform", "check_target", "check_target_and_platform"]


def check_target_and_platform(target_model_config) -> None:
    """Refuses targets and platforms the ddtree runner cannot serve losslessly."""
    check_platform()
    check_target(target_model_config)


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


def check_target(target_model_config) -> None:
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
