# SPDX-License-Identifier: Apache-2.0
"""The hooks that make ``"method": "ddtree"`` work in vLLM 0.32, installed once
per process by the ``vllm.general_plugins`` entry point.

* P1 ``EngineArgs.create_speculative_config``: accept ``"ddtree"``, take the
  ``ddtree_*`` keys out, build vLLM's DFlash config, validate against the drafter,
  attach a :class:`DDTreeConfig` (frontend process).
* P2 ``VllmConfig._get_v2_model_runner_unsupported_features``: ddtree runs on the
  V1 model runner.
* P3 ``GPUModelRunner.__init__``: when ddtree is on, swap in the DDTree runner
  mixin and the :class:`DDTreeProposer` (worker process; covers CPUModelRunner).
* P4 the ``CPU_ATTN`` attention backend: ancestor-only attention inside trees.
* P5 request validation (refused sampling features, at request time).
* P6 (CPU only) a vLLM 0.32 bug fix for every DFlash drafter, ddtree or not:
  ``DFlashQwen3Model._normalize_context_k`` normalizes all layers' context keys
  with one ``ops.rms_norm`` call and a stacked ``[num_layers, head_dim]`` weight;
  the CPU op applies row 0 (layer 0's ``k_norm``) to every layer, so layers >= 1
  see wrongly normalized context keys (found by tests/test_drafter_model.py:
  max logit error 0.43 on a 2-layer drafter). The CUDA op selects the row per
  layer; on CPU the fix normalizes per layer in torch.

Every target is private vLLM API, so :func:`install` refuses other versions.
"""

from __future__ import annotations

import functools
import os

from vllm_ddtree.vllm_adapter.checks import check_target_and_platform
from vllm_ddtree.vllm_adapter.config import DDTreeConfig, get_ddtree_config, pop_ddtree_config

SUPPORTED_VLLM = "0.32."
_installed = False


def install() -> None:
    """Installs P1-P6 (idempotent)."""
    global _installed
    if _installed:
        return
    import vllm

    version = getattr(vllm, "__version__", "")
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-ddtree supports vLLM {SUPPORTED_VLLM}x, found {version!r}; "
            "unset VLLM_PLUGINS=ddtree or install vllm 0.32"
        )
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    EngineArgs.create_speculative_config = _wrap_create_speculative_config(
        EngineArgs.create_speculative_config
    )
    VllmConfig._get_v2_model_runner_unsupported_features = _wrap_v2_unsupported(
        VllmConfig._get_v2_model_runner_unsupported_features
    )
    GPUModelRunner.__init__ = _wrap_runner_init(GPUModelRunner.__init__)
    from vllm_ddtree.vllm_adapter.cpu_attention import register_tree_attention_backend

    register_tree_attention_backend()
    _wrap_request_validation()
    _fix_cpu_dflash_context_k_norm()
    _installed = True


def _fix_cpu_dflash_context_k_norm() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    def _normalize_context_k(self, all_k):
        # all_k: [num_layers, num_ctx, num_kv_heads, head_dim]; one k_norm per layer.
        x = all_k.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self._rms_norm_eps)
        weight = self._k_norm_weights[:, None, None, :]
        return (x.to(all_k.dtype) * weight).to(all_k.dtype)

    DFlashQwen3Model._normalize_context_k = _normalize_context_k


def _wrap_create_speculative_config(orig):
    @functools.wraps(orig)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if self.spec_method == "ddtree":
            spec = dict(spec or {})
            if "method" in spec:
                raise ValueError(
                    "--spec-method and --speculative-config['method'] are mutually exclusive"
                )
            spec["method"] = "ddtree"
            self.spec_method = None
        ddtree = None
        if isinstance(spec, dict):
            spec = {k.replace("-", "_"): v for k, v in spec.items()}
            ddtree = pop_ddtree_config(spec)
            self.speculative_config = spec
        if ddtree is not None:
            if self.async_scheduling:
                raise ValueError(
                    "ddtree needs synchronous scheduling (the tree structure and the "
                    "KV commit live in the worker between steps); drop async_scheduling"
                )
            self.async_scheduling = False
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
                raise ValueError(
                    "ddtree runs on the V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER"
                )
        result = orig(self, target_model_config, target_parallel_config)
        if ddtree is not None:
            ddtree = _finalize(result, ddtree, target_model_config)
            # A plain attribute: SpeculativeConfig forbids unknown *fields*, not
            # attributes, and pickles its __dict__ to engine and worker processes.
            object.__setattr__(result, "ddtree", ddtree)
        return result

    return create_speculative_config


def _finalize(spec, ddtree: DDTreeConfig, target_model_config) -> DDTreeConfig:
    """Checks the drafter against the target and the refused options."""
    import dataclasses

    refused = {
        "disable_padded_drafter_batch": spec.disable_padded_drafter_batch,
        "use_local_argmax_reduction": getattr(spec, "use_local_argmax_reduction", False),
    }
    for key, value in refused.items():
        if value:
            raise ValueError(f"ddtree does not support speculative_config {key}=True")
    if getattr(spec, "draft_sample_method", "greedy") != "greedy":
        raise ValueError("ddtree builds trees from the draft logits; draft_sample_method "
                         "must stay 'greedy'")
    if getattr(spec, "rejection_sample_method", "standard") != "standard":
        raise ValueError("ddtree verifies trees with its own sampler; "
                         "rejection_sample_method must stay 'standard'")
    if getattr(spec, "num_speculative_tokens_per_batch_size", None):
        raise ValueError("ddtree does not support num_speculative_tokens_per_batch_size")
    if spec.draft_tensor_parallel_size not in (None, 1) or (
        target_model_config is not None
        and getattr(spec.target_parallel_config, "tensor_parallel_size", 1) != 1
    ):
        raise ValueError("ddtree supports tensor_parallel_size=1 only (for now)")

    check_target_and_platform(target_model_config)
    draft_hf = spec.draft_model_config.hf_config
    target_hf = target_model_config.hf_text_config
    dflash_cfg = getattr(draft_hf, "dflash_config", None) or {}
    if getattr(draft_hf, "hidden_size", None) != getattr(target_hf, "hidden_size", None):
        raise ValueError(
            f"DFlash drafter hidden_size {getattr(draft_hf, 'hidden_size', None)} does not "
            f"match the target's {getattr(target_hf, 'hidden_size', None)}"
        )
    target_vocab = target_model_config.get_vocab_size()
    draft_vocab = getattr(draft_hf, "vocab_size", target_vocab)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"DFlash drafter vocab_size {draft_vocab} does not match the target's "
            f"{target_vocab} (ddtree needs full target-vocab draft logits)"
        )
    mask_token = dflash_cfg.get("mask_token_id", getattr(draft_hf, "mask_token_id", None))
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
                "cannot read the drafter's block_size; set ddtree_draft_len (the number "
                "of positions the DFlash drafter predicts, block_size - 1)"
            )
        draft_len = int(block) - 1
    return dataclasses.replace(ddtree, draft_len=draft_len)


def _wrap_v2_unsupported(orig):
    @functools.wraps(orig)
    def unsupported(self):
        features = orig(self)
        if get_ddtree_config(self) is not None:
            features.append("speculative method 'ddtree'")
        return features

    return unsupported


def _wrap_runner_init(orig):
    @functools.wraps(orig)
    def __init__(self, vllm_config, device, *args, **kwargs):
        orig(self, vllm_config, device, *args, **kwargs)
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is not None:
            from vllm_ddtree.vllm_adapter.runner import enable_ddtree

            enable_ddtree(self, ddtree)

    return __init__


def _wrap_request_validation() -> None:
    """P5 ``InputProcessor.process_inputs`` (frontend): with ddtree on, refuse per
    request the sampling parameters ddtree cannot honour (a ValueError for that
    request only) and let through min_p / logit_bias, which vLLM refuses under
    speculative decoding but the ddtree runner applies
    (:mod:`vllm_ddtree.vllm_adapter.requests`)."""
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_ddtree.vllm_adapter.requests import wrap_process_inputs

    InputProcessor.process_inputs = wrap_process_inputs(InputProcessor.process_inputs)
