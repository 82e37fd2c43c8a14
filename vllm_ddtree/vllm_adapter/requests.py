# SPDX-License-Identifier: Apache-2.0
"""Request-time checks of ``SamplingParams`` when ddtree is on (frontend process).

ddtree verifies a *tree* of drafts: every node's target distribution is the one a
non-speculative sampler would use after the path root..node. Parameters that only
need the node's depth or nothing at all are honoured by the runner
(:mod:`vllm_ddtree.vllm_adapter.runner`):

* temperature, top_k, top_p, min_p, seed, n;
* min_tokens (stop tokens are masked at the nodes whose depth is still below it);
* logit_bias, allowed_token_ids (the same vocabulary edit on every node);
* presence/frequency/repetition penalties and bad_words, per node with the node's
  own history: the committed output + the drafts on its path (vLLM's chain rule
  for speculative decoding, generalised to a tree);
* logprobs (of the emitted tokens, any ``logprobs_mode``), prompt_logprobs;
* stop, stop_token_ids, ignore_eos, max_tokens (applied by the scheduler to the
  committed tokens, as without speculation).

Structured outputs (json, regex, choice, grammar, response_format) are honoured
with the xgrammar backend: the scheduler fills one bitmask row per tree node with
the grammar state after the node's path (:mod:`.structured_output`); other
grammar backends are refused. The thinking budget needs a reasoning state per
tree node; vLLM's implementation assumes a chain. Refusals are per request,
with :class:`DDTreeUnsupportedParameterError`: ``LLM.generate`` raises
it, the OpenAI server answers HTTP 400 (a streamed request: HTTP 200 and one
error event, as for vLLM's own checks), and the engine keeps serving. Requests
that skip ``process_inputs`` are checked where they enter instead
(``EngineCore.preprocess_add_request``, ``LLMEngine.add_request``), all through
:func:`check_request_params`.

vLLM 0.32 itself refuses ``min_p`` and ``logit_bias`` under speculative decoding
(``SamplingParams._validate_spec_decode``) and builds no min-p / logit-bias logits
processor then. With ddtree on they are let through, because the ddtree runner
applies them: in-tree, ``_validate_spec_decode`` skips ddtree; the plugin hides
them from vLLM's check (:func:`vllm_ddtree.vllm_adapter.hooks.process_inputs_hook`).
"""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError

from vllm_ddtree.vllm_adapter.config import get_ddtree_config

__all__ = [
    "DDTreeUnsupportedParameterError",
    "check_request_params",
    "check_sampling_params",
]


class DDTreeUnsupportedParameterError(VLLMValidationError, ValueError):
    """A request asks for a sampling feature ddtree does not support.

    A ``ValueError`` (what ``LLM.generate`` callers catch) and a vLLM
    ``VLLMValidationError`` (the OpenAI server maps it to HTTP 400 and reports
    ``parameter``).
    """


def _refuse(parameter: str, value: Any, why: str) -> None:
    raise DDTreeUnsupportedParameterError(
        f"speculative method 'ddtree' does not support the sampling parameter "
        f"{parameter}={value!r}: {why}. Drop {parameter} from the request, or serve "
        "it without ddtree.",
        parameter=parameter,
        value=value,
    )


_HISTORY = (
    "its effect depends on the tokens generated so far, and ddtree verifies a tree "
    "of draft paths"
)


def check_sampling_params(params, vocab_size: int | None = None) -> None:
    """Raises :class:`DDTreeUnsupportedParameterError` naming the first refused
    parameter of ``params`` (a vLLM ``SamplingParams``); validates what ddtree
    takes over from vLLM's spec-decode check (logit_bias token ids)."""
    if getattr(params, "thinking_token_budget", None) is not None:
        _refuse("thinking_token_budget", params.thinking_token_budget, _HISTORY)
    if getattr(params, "logprob_token_ids", None) is not None:
        _refuse(
            "logprob_token_ids",
            params.logprob_token_ids,
            "only logprobs=<k> is implemented for tree verification",
        )
    if getattr(params, "prompt_logprob_token_ids", None) is not None:
        _refuse(
            "prompt_logprob_token_ids",
            "<array>",
            "it needs vLLM's V2 model runner, and ddtree runs on V1",
        )
    if params.logit_bias and vocab_size is not None:
        bad = [t for t in params.logit_bias if not 0 <= int(t) < vocab_size]
        if bad:
            raise DDTreeUnsupportedParameterError(
                f"token_id(s) {bad} in logit_bias are outside the vocabulary "
                f"[0, {vocab_size})",
                parameter="logit_bias",
                value=bad,
            )


def check_request_params(vllm_config, params) -> None:
    """The per-request check where a request enters an engine: a no-op unless
    ddtree is on and ``params`` is a ``SamplingParams`` (``None`` and pooling
    params pass); else :func:`check_sampling_params`.

    In vLLM with ddtree in-tree, ``InputProcessor._validate_params``,
    ``EngineCore.preprocess_add_request`` and ``LLMEngine.add_request`` (for a
    pre-built ``EngineCoreRequest``) call it; the plugin calls it from
    decorators on the same methods (:mod:`.hooks`).
    """
    if params is None or get_ddtree_config(vllm_config) is None:
        return
    from vllm.sampling_params import SamplingParams

    if isinstance(params, SamplingParams):
        check_sampling_params(params, vllm_config.model_config.get_vocab_size())
        if params.structured_outputs is not None:
            _check_structured_output_backend(vllm_config, params.structured_outputs)


# Grammar backends whose tree walk is validated (vllm_adapter.structured_output).
TREE_GRAMMAR_BACKENDS = ("xgrammar",)


def _check_structured_output_backend(vllm_config, structured_outputs) -> None:
    """Structured outputs on draft trees: the request's grammar backend must be
    one whose matcher the tree walk is validated with."""
    backend = getattr(structured_outputs, "_backend", None) or getattr(
        vllm_config.structured_outputs_config, "backend", None
    )
    if backend not in TREE_GRAMMAR_BACKENDS:
        _refuse(
            "structured_outputs",
            _set_fields(structured_outputs),
            f"its grammar backend is {backend!r}, and ddtree walks draft trees "
            f"with {' / '.join(TREE_GRAMMAR_BACKENDS)} matchers only (set "
            "structured_outputs_config backend='xgrammar', or a grammar "
            "xgrammar supports)",
        )


def _set_fields(obj) -> str:
    """``StructuredOutputsParams(json_object=True)``: the fields that are set."""
    fields = getattr(obj, "__dataclass_fields__", None) or {}
    shown = [
        f"{name}={getattr(obj, name)!r}"
        for name in fields
        if not name.startswith("_") and getattr(obj, name, None) not in (None, False)
    ]
    text = f"{type(obj).__name__}({', '.join(shown)})"
    return text if len(text) <= 200 else text[:197] + "..."
