# SPDX-License-Identifier: Apache-2.0
"""The six vLLM methods ddtree hooks into, as decorators.

Keeping the integration to six decorators keeps every ddtree code path out of
vLLM's hot paths when ddtree is off. (The vllm-ddtree plugin applies the same
decorators at run time.) The hooked methods and their decorators:

* ``EngineArgs.create_speculative_config``: :func:`speculative_config_hook`;
* ``VllmConfig._get_v2_model_runner_unsupported_features``:
  :func:`v2_runner_unsupported_hook`;
* ``GPUModelRunner.__init__`` (CPUModelRunner too): :func:`model_runner_init_hook`;
* ``InputProcessor.process_inputs``: :func:`process_inputs_hook`;
* ``EngineCore.preprocess_add_request``: :func:`engine_add_request_hook`;
* ``LLMEngine.add_request``: :func:`llm_engine_add_request_hook`.

Each decorator is a no-op unless the engine's speculative config asks for
``"method": "ddtree"``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from vllm.logger import init_logger

from vllm_ddtree.vllm_adapter.checks import check_target_and_platform
from vllm_ddtree.vllm_adapter.config import (
    DDTreeConfig,
    get_ddtree_config,
    pop_ddtree_config,
)

__all__ = [
    "engine_add_request_hook",
    "llm_engine_add_request_hook",
    "model_runner_init_hook",
    "process_inputs_hook",
    "speculative_config_hook",
    "v2_runner_unsupported_hook",
]

logger = init_logger(__name__)


def speculative_config_hook(create_speculative_config):
    """Accepts ``"ddtree"``: takes the ``ddtree_*`` keys out, lets vLLM build its
    DFlash ``SpeculativeConfig`` for the drafter, validates the drafter against
    the target and attaches a :class:`DDTreeConfig` (frontend process)."""

    @functools.wraps(create_speculative_config)
    def wrapper(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if self.spec_method == "ddtree":
            spec = dict(spec or {})
            if "method" in spec:
                raise ValueError(
                    "--spec-method and --speculative-config['method'] are mutually "
                    "exclusive"
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
        result = create_speculative_config(
            self, target_model_config, target_parallel_config
        )
        if ddtree is not None:
            ddtree = _finalize(result, ddtree, target_model_config, self.kv_cache_dtype)
            # A plain attribute: SpeculativeConfig forbids unknown *fields*, not
            # attributes, and pickles its __dict__ to engine and worker processes.
            object.__setattr__(result, "ddtree", ddtree)
        return result

    return wrapper


def _finalize(
    spec,
    ddtree: DDTreeConfig,
    target_model_config,
    kv_cache_dtype: str = "auto",
) -> DDTreeConfig:
    """Checks the drafter against the target and the refused options."""
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
    tensor = getattr(spec.target_parallel_config, "tensor_parallel_size", 1) or 1
    budget_mode = ddtree.budget_mode
    if budget_mode is None:
        budget_mode = "auto" if tensor == 1 else "fixed"
        if tensor != 1:
            logger.info(
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
    return dataclasses.replace(ddtree, draft_len=draft_len, budget_mode=budget_mode)


def v2_runner_unsupported_hook(get_unsupported_features):
    """Lists ddtree among the features the V2 model runner lacks (it runs on V1)."""

    @functools.wraps(get_unsupported_features)
    def wrapper(self):
        features = get_unsupported_features(self)
        if get_ddtree_config(self) is not None:
            features.append("speculative method 'ddtree'")
        return features

    return wrapper


def model_runner_init_hook(init):
    """With ddtree on, turns the constructed V1 runner into a ddtree runner (the
    runner mixin and :class:`DDTreeProposer`) and, on CPU, selects the tree-aware
    attention backend before the model is built (worker process)."""

    @functools.wraps(init)
    def wrapper(self, vllm_config, device, *args, **kwargs):
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is None:
            return init(self, vllm_config, device, *args, **kwargs)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # Before the runner resolves its attention backends.
            from vllm_ddtree.vllm_adapter.cpu_attention import (
                register_tree_attention_backend,
            )

            register_tree_attention_backend()
        init(self, vllm_config, device, *args, **kwargs)
        from vllm_ddtree.vllm_adapter.runner import enable_ddtree

        enable_ddtree(self, ddtree)

    return wrapper


def process_inputs_hook(process_inputs):
    """Per-request checks of the sampling parameters ddtree cannot honour (see
    :mod:`vllm_ddtree.vllm_adapter.requests`; frontend process)."""
    from vllm_ddtree.vllm_adapter.requests import wrap_process_inputs

    return wrap_process_inputs(process_inputs)


def engine_add_request_hook(preprocess_add_request):
    """Engine-side twin of :func:`process_inputs_hook`: a request that reaches
    the engine core without the frontend check (an ``EngineCoreRequest`` built
    by hand and sent to the engine's sockets) and asks for a parameter ddtree
    does not honour is failed instead of being sampled as if the parameter were
    unset (engine process).

    Raising here is vLLM's own route for a request the engine cannot take: the
    multiprocess engine answers that request alone with ``FinishReason.ERROR``
    and keeps serving; called in-process, it raises to the caller before the
    scheduler sees the request."""

    @functools.wraps(preprocess_add_request)
    def wrapper(self, request):
        _check_prebuilt_request(self.vllm_config, request)
        return preprocess_add_request(self, request)

    return wrapper


def llm_engine_add_request_hook(add_request):
    """``LLMEngine.add_request`` takes a pre-built ``EngineCoreRequest`` without
    ``process_inputs`` (:func:`process_inputs_hook`): check it here, before the
    output processor tracks it, so that a refused request raises to the caller
    and leaves no state behind (the in-process engine would otherwise wait
    forever for a request its engine core refused; frontend process)."""

    @functools.wraps(add_request)
    def wrapper(self, request_id, prompt, *args, **kwargs):
        _check_prebuilt_request(self.vllm_config, prompt)
        return add_request(self, request_id, prompt, *args, **kwargs)

    return wrapper


def _check_prebuilt_request(vllm_config, request) -> None:
    """Raises ``DDTreeUnsupportedParameterError`` if ddtree is on and
    ``request`` (an ``EngineCoreRequest``, or anything else: ignored) asks for
    a sampling parameter ddtree does not honour."""
    params = getattr(request, "sampling_params", None)
    if params is None or get_ddtree_config(vllm_config) is None:
        return
    from vllm_ddtree.vllm_adapter.requests import check_sampling_params

    check_sampling_params(params, vllm_config.model_config.get_vocab_size())
