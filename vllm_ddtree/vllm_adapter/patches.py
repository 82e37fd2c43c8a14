# SPDX-License-Identifier: Apache-2.0
"""Installs ddtree into vLLM 0.32 at run time: the ``vllm.general_plugins`` entry
point calls :func:`install` once per process.

P1-P3 stand in for the series' edits of vLLM's config and model runner
(:mod:`vllm_ddtree.vllm_adapter.plugin_hooks`,
:mod:`vllm_ddtree.vllm_adapter.plugin_runner`); P4-P6 apply the
decorators of :mod:`vllm_ddtree.vllm_adapter.hooks` to the vLLM methods they
decorate in-tree in the upstream patch series (``patches/``):

* P1 ``EngineArgs.create_speculative_config``: accept ``"ddtree"`` (frontend);
  in the series, ``"ddtree"`` and its ``ddtree_*`` fields are part of
  ``SpeculativeConfig``.
* P2 ``VllmConfig._get_v2_model_runner_unsupported_features``: ddtree runs on the
  V1 model runner (in the series: one more name in vLLM's list).
* P13 ``VllmConfig.try_verify_and_update_config``: first the settings ddtree
  needs, made with a warning (prefix caching off on hybrid targets;
  :func:`~vllm_ddtree.vllm_adapter.config.apply_required_settings`), before the
  model's config hooks (in the series: a call before it in ``__post_init__``).
* P3 ``GPUModelRunner.__init__``: with ddtree on, the runner gets its
  ``DDTreeProposer`` and ``DDTreeVerifier`` and becomes a subclass that calls
  the verifier where the series' ``GPUModelRunner`` has ``if self.ddtree is not
  None:`` branches (worker; covers CPUModelRunner).
* P4 ``InputProcessor.process_inputs``: refused sampling features, per request.
* P5 ``EngineCore.preprocess_add_request``: the same refusal for requests that
  reach the engine core without P4 (engine).
* P6 ``LLMEngine.add_request``: the same refusal for a pre-built
  ``EngineCoreRequest``, before the frontend tracks it (frontend).
* P8 ``Scheduler.update_draft_token_ids`` and ``Scheduler.schedule``, P9
  ``StructuredOutputManager.validate_tokens``, P10
  ``StructuredOutputManager.grammar_bitmask``: the trees' structure kept in the
  scheduler and sent back with the scheduled drafts, structured requests' trees
  built with their grammars, no chain cut, one bitmask row per node with the
  grammar state after its path (engine core).
* P7 (CPU only) a vLLM 0.32 bug fix for every DFlash drafter, ddtree or not:
  ``DFlashQwen3Model._normalize_context_k`` normalizes all layers' context keys
  with one ``ops.rms_norm`` call and a stacked ``[num_layers, head_dim]`` weight;
  the CPU op applies row 0 (layer 0's ``k_norm``) to every layer, so layers >= 1
  see wrongly normalized context keys (found by tests/test_drafter_model.py:
  max logit error 0.43 on a 2-layer drafter). The CUDA op selects the row per
  layer; on CPU :func:`normalize_context_k_per_layer` normalizes per layer in
  torch (the patch series' first commit makes the same fix in-tree).
* P11 (CPU only) ``CPUAttentionBackend.get_supported_kernel_block_sizes``
  also declares 16-token blocks, which its kernels run (the ``vec16`` ISA):
  vLLM's CPU MLA kernel takes 16-token blocks only, so a DFlash drafter (CPU
  attention) beside an MLA target (DeepSeek-V3 / Kimi-K2) failed at start-up,
  "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])",
  for ddtree and vLLM's own ``"dflash"`` alike. vLLM keeps the cache's block
  size wherever every backend accepts it, so other models are unchanged (the
  patch series' first commit makes the same change in-tree).
* P12 ``gdn_state.install`` (when a ddtree target has Gated DeltaNet layers):
  vLLM's CPU ``_spec_forward`` and CUDA ``QwenGatedDeltaNetAttention.
  _forward_core`` run the tree path for the layers it marks, and its CPU
  ``_spec_aware_nonspec`` / ``_spec_aware_nonspec_subset`` their prompt rows as
  its non-speculative path does (in the series, an explicit branch in each;
  :func:`plugin_hooks.gdn_install_hook`).
Only P7 and P11 change vLLM's behaviour when ddtree is off (they fix in-tree
``"dflash"`` on CPU); P1-P6, P8-P10, P12 and P13 are no-ops unless an engine
asks for ddtree. The
not-yet-validated CUDA path needs no patch point: the shared start-up checks
admit it when opted in (:func:`~vllm_ddtree.vllm_adapter.checks.gpu_opted_in`),
P1 sets its engine options and the verifier registers its attention backend.

Every target is private vLLM API, so on any vLLM other than 0.32
:func:`install` patches nothing of the above: it warns once and wraps only
``EngineArgs.create_speculative_config`` so that ``"method": "ddtree"`` fails at
start-up naming the supported version (vLLM's own plugin loader does not catch
exceptions, so raising here would break every vLLM process).
"""

from __future__ import annotations

import torch

from vllm_ddtree.vllm_adapter import hooks, plugin_hooks, plugin_runner

SUPPORTED_VLLM = "0.32."
_installed = False


def install() -> None:
    """Installs P1-P12 (idempotent)."""
    global _installed
    if _installed:
        return
    import vllm

    version = str(getattr(vllm, "__version__", ""))
    if not version.startswith(SUPPORTED_VLLM):
        _refuse_ddtree_on(version)
        _installed = True
        return
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    EngineArgs.create_speculative_config = plugin_hooks.speculative_config_hook(
        EngineArgs.create_speculative_config
    )
    VllmConfig._get_v2_model_runner_unsupported_features = (
        plugin_hooks.v2_runner_unsupported_hook(
            VllmConfig._get_v2_model_runner_unsupported_features
        )
    )
    VllmConfig.try_verify_and_update_config = (
        plugin_hooks.try_verify_and_update_config_hook(
            VllmConfig.try_verify_and_update_config
        )
    )
    GPUModelRunner.__init__ = plugin_runner.model_runner_init_hook(
        GPUModelRunner.__init__
    )
    InputProcessor.process_inputs = hooks.process_inputs_hook(
        InputProcessor.process_inputs
    )
    EngineCore.preprocess_add_request = hooks.engine_add_request_hook(
        EngineCore.preprocess_add_request
    )
    LLMEngine.add_request = hooks.llm_engine_add_request_hook(LLMEngine.add_request)
    Scheduler.update_draft_token_ids = plugin_hooks.update_draft_token_ids_hook(
        Scheduler.update_draft_token_ids
    )
    Scheduler.schedule = plugin_hooks.schedule_hook(Scheduler.schedule)
    StructuredOutputManager.validate_tokens = plugin_hooks.validate_tokens_hook(
        StructuredOutputManager.validate_tokens
    )
    StructuredOutputManager.grammar_bitmask = plugin_hooks.grammar_bitmask_hook(
        StructuredOutputManager.grammar_bitmask
    )
    from vllm_ddtree.vllm_adapter import gdn_state

    gdn_state.install = plugin_hooks.gdn_install_hook(gdn_state.install)
    _fix_cpu_dflash_context_k_norm()
    _declare_cpu_attention_16_token_blocks()
    _installed = True


def unsupported_version_message(version: str) -> str:
    return (
        f"vllm-ddtree supports vLLM {SUPPORTED_VLLM}x only, and this is vLLM "
        f"{version!r}: speculative method 'ddtree' is unavailable (vLLM itself is "
        "unchanged). Install vllm==0.32.0 to use ddtree"
    )


def _refuse_ddtree_on(version: str) -> None:
    """Unsupported vLLM: one warning, and ``"ddtree"`` refused at start-up.

    Never raises: the plugin must not break a vLLM it does not support.
    """
    import functools
    import logging

    logging.getLogger(__name__).warning(
        "%s (the vllm-ddtree plugin patched nothing)",
        unsupported_version_message(version),
    )
    try:
        from vllm.engine.arg_utils import EngineArgs

        create = EngineArgs.create_speculative_config
    except Exception:  # another layout: vLLM's own error will name the method
        return

    @functools.wraps(create)
    def create_speculative_config(self, *args, **kwargs):
        spec = getattr(self, "speculative_config", None)
        method = spec.get("method") if isinstance(spec, dict) else None
        if "ddtree" in (method, getattr(self, "spec_method", None)):
            raise ValueError(unsupported_version_message(version))
        return create(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config


def normalize_context_k_per_layer(
    all_k: torch.Tensor, k_norm_weights: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMS-normalizes each layer's context keys with that layer's ``k_norm``.

    Args:
        all_k: [num_layers, num_ctx, num_kv_heads, head_dim] context keys.
        k_norm_weights: [num_layers, head_dim] stacked ``k_norm`` weights.
        eps: the RMSNorm epsilon.
    """
    x = all_k.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x.to(all_k.dtype) * k_norm_weights[:, None, None, :]).to(all_k.dtype)


def _fix_cpu_dflash_context_k_norm() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    def _normalize_context_k(self, all_k):
        return normalize_context_k_per_layer(
            all_k, self._k_norm_weights, self._rms_norm_eps
        )

    DFlashQwen3Model._normalize_context_k = _normalize_context_k


def cpu_attention_kernel_block_sizes(kv_cache_spec=None) -> list:
    """CPU_ATTN's kernel block sizes with 16-token blocks (its ``vec16`` kernels)."""
    from vllm.v1.attention.backend import MultipleOf

    return [16, MultipleOf(32)]


def _declare_cpu_attention_16_token_blocks() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        cpu_attention_kernel_block_sizes
    )
