# SPDX-License-Identifier: Apache-2.0
"""The three request-entry methods ddtree checks, as decorators.

Each refuses, per request, a sampling parameter ddtree does not honour yet,
keeping every ddtree check out of vLLM's request path when ddtree is off. (The
vllm-ddtree plugin applies the same decorators at run time.) The hooked methods
and their decorators:

* ``InputProcessor.process_inputs``: :func:`process_inputs_hook`;
* ``EngineCore.preprocess_add_request``: :func:`engine_add_request_hook`;
* ``LLMEngine.add_request``: :func:`llm_engine_add_request_hook`.

Each decorator is a no-op unless the engine's speculative config asks for
``"method": "ddtree"``.
"""

from __future__ import annotations

import functools

from vllm_ddtree.vllm_adapter.config import get_ddtree_config

__all__ = [
    "engine_add_request_hook",
    "llm_engine_add_request_hook",
    "process_inputs_hook",
]


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
