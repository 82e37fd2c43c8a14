# SPDX-License-Identifier: Apache-2.0
"""The plugin's patch points P4-P6: the three request-entry methods ddtree
checks, as decorators (plugin only).

Each refuses, per request, a sampling parameter ddtree does not honour yet,
through :func:`~vllm_ddtree.vllm_adapter.requests.check_request_params`, which
vLLM with ddtree in-tree calls explicitly from the same methods. The hooked
methods and their decorators:

* ``InputProcessor.process_inputs``: :func:`process_inputs_hook`;
* ``EngineCore.preprocess_add_request``: :func:`engine_add_request_hook`;
* ``LLMEngine.add_request``: :func:`llm_engine_add_request_hook`.

Each decorator is a no-op unless the engine's speculative config asks for
``"method": "ddtree"``.
"""

from __future__ import annotations

import functools
import inspect

from vllm_ddtree.sampling import SAMPLING_EPS
from vllm_ddtree.vllm_adapter.config import get_ddtree_config
from vllm_ddtree.vllm_adapter.requests import (
    check_request_params,
    check_sampling_params,
)

__all__ = [
    "engine_add_request_hook",
    "llm_engine_add_request_hook",
    "process_inputs_hook",
]


def process_inputs_hook(orig):
    """``InputProcessor.process_inputs`` with the ddtree request check (see
    :mod:`vllm_ddtree.vllm_adapter.requests`; frontend process).

    vLLM refuses min_p and logit_bias under any speculative decoding; ddtree
    applies them, so they are hidden from vLLM's check (on a private copy) and
    put back on the request's own params, which the worker reads.
    """
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def process_inputs(self, *args, **kwargs):
        if get_ddtree_config(self.vllm_config) is None:
            return orig(self, *args, **kwargs)
        from vllm.sampling_params import SamplingParams

        bound = signature.bind(self, *args, **kwargs)
        params = bound.arguments.get("params")
        if not isinstance(params, SamplingParams):
            return orig(self, *args, **kwargs)
        check_sampling_params(params, self.model_config.get_vocab_size())
        kept = {}
        if params.min_p > SAMPLING_EPS:
            kept["min_p"] = params.min_p
        if params.logit_bias:
            kept["logit_bias"] = dict(params.logit_bias)
        if kept:
            stripped = params.clone()
            stripped.min_p = 0.0
            stripped.logit_bias = None
            bound.arguments["params"] = stripped
        request = orig(*bound.args, **bound.kwargs)
        for name, value in kept.items():
            setattr(request.params, name, value)
        # After vLLM's own checks, as in-tree (they resolve the grammar backend).
        check_request_params(self.vllm_config, request.params)
        return request

    return process_inputs


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
        check_request_params(self.vllm_config, request.sampling_params)
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
        check_request_params(
            self.vllm_config, getattr(prompt, "sampling_params", None)
        )
        return add_request(self, request_id, prompt, *args, **kwargs)

    return wrapper
