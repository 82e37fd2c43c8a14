# SPDX-License-Identifier: Apache-2.0
"""Plugin only: ``"method": "ddtree"`` on an unmodified vLLM 0.32.

vLLM 0.32's ``SpeculativeConfig`` is a pydantic dataclass whose ``method`` is a
closed Literal and which forbids unknown fields, so the plugin cannot add
``"ddtree"`` and its ``ddtree_*`` fields as the upstream series does
(``patches/``: ``vllm/config/speculative.py``). Instead
:func:`speculative_config_hook` (patch point P1) takes the ``ddtree_*`` keys out
of ``--speculative-config``, lets vLLM build its DFlash ``SpeculativeConfig``
for the drafter (every DFlash code path keys on ``method == "dflash"``), and
attaches the resolved :class:`DDTreeConfig` as its ``ddtree`` attribute, which
in the series is a property over the typed fields: every other module reads it
through :func:`~vllm_ddtree.vllm_adapter.config.get_ddtree_config` either way.
:func:`v2_runner_unsupported_hook` (P2) lists ddtree among the V2 model runner's
unsupported features, as the series does in ``vllm/config/vllm.py``. P8-P10 give
structured outputs their tree bitmask in the scheduler
(:mod:`vllm_ddtree.vllm_adapter.structured_output`), where the series calls the
same functions from ``Scheduler`` and ``StructuredOutputManager``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm_ddtree.vllm_adapter import draft_trees
from vllm_ddtree.vllm_adapter.checks import (
    gpu_backend_per_kind,
    gpu_compilation_settings,
    gpu_engine_settings,
)
from vllm_ddtree.vllm_adapter.config import (
    DDTREE_KEYS,
    DDTREE_METHOD,
    DDTreeConfig,
    apply_required_settings,
    check_no_stray_keys,
    get_ddtree_config,
    resolve_ddtree_config,
)
from vllm_ddtree.vllm_adapter.structured_output import (
    grammar_draft_tree,
    tree_grammar_bitmask,
    validate_draft_tree,
)

__all__ = [
    "grammar_bitmask_hook",
    "pop_ddtree_config",
    "schedule_hook",
    "speculative_config_hook",
    "update_draft_token_ids_hook",
    "v2_runner_unsupported_hook",
    "validate_tokens_hook",
]


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
            if self.async_scheduling is None:
                # vLLM 0.32 would turn it on for "dflash": said, not silent.
                from vllm.logger import init_logger

                init_logger(__name__).info(
                    "ddtree: async scheduling off (the tree structure and the KV "
                    "commit live in the worker between steps)"
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
            ddtree = resolve_ddtree_config(
                result,
                ddtree,
                target_model_config,
                self.kv_cache_dtype,
            )
            backend = gpu_engine_settings(
                [
                    self.attention_backend,
                    getattr(self.attention_config, "backend", None),
                ]
            )
            if backend is not None:
                self.attention_backend = backend
                # Before create_engine_config copies attention_config.
                self.attention_config.backend_per_kind = gpu_backend_per_kind(
                    target_model_config.use_mla,
                    self.attention_config.backend_per_kind,
                )
                gpu_compilation_settings(self.compilation_config)
            # A plain attribute: SpeculativeConfig forbids unknown *fields*, not
            # attributes, and pickles its __dict__ to engine and worker processes.
            object.__setattr__(result, "ddtree", ddtree)
        return result

    return wrapper


def v2_runner_unsupported_hook(get_unsupported_features):
    """Lists ddtree among the features the V2 model runner lacks (it runs on V1)."""

    @functools.wraps(get_unsupported_features)
    def wrapper(self):
        features = get_unsupported_features(self)
        if get_ddtree_config(self) is not None:
            features.append("speculative method 'ddtree'")
        return features

    return wrapper


def try_verify_and_update_config_hook(try_verify_and_update_config):
    """Makes the settings a ddtree engine needs before the model's config hooks
    read them (:func:`~vllm_ddtree.vllm_adapter.config.apply_required_settings`;
    in the series, a call before ``try_verify_and_update_config`` in
    ``VllmConfig.__post_init__``)."""

    @functools.wraps(try_verify_and_update_config)
    def wrapper(self):
        apply_required_settings(self)
        return try_verify_and_update_config(self)

    return wrapper


def update_draft_token_ids_hook(update_draft_token_ids):
    """P8, ``Scheduler.update_draft_token_ids``: keeps each request's draft tree
    (``DraftTokenIds.draft_parents``), and builds structured requests' trees
    with their grammars (engine core)."""

    @functools.wraps(update_draft_token_ids)
    def wrapper(self, draft_token_ids):
        if getattr(draft_token_ids, "draft_parents", None) is not None:
            manager = self.structured_output_manager
            draft_trees.store_draft_trees(
                self.requests,
                draft_token_ids,
                functools.partial(grammar_draft_tree, manager),
            )
        return update_draft_token_ids(self, draft_token_ids)

    return wrapper


def schedule_hook(schedule):
    """P8, ``Scheduler.schedule``: the tree of every request's scheduled drafts
    goes to the workers (``SchedulerOutput.scheduled_draft_trees``; engine
    core)."""

    @functools.wraps(schedule)
    def wrapper(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        if get_ddtree_config(self.vllm_config) is not None:
            output.scheduled_draft_trees = draft_trees.scheduled_draft_trees(
                self.requests,
                output.num_scheduled_tokens,
                output.scheduled_spec_decode_tokens,
            )
        return output

    return wrapper


def validate_tokens_hook(validate_tokens):
    """P9, ``StructuredOutputManager.validate_tokens``: a ddtree request's drafts
    are a tree, not cut as a chain (engine core)."""

    @functools.wraps(validate_tokens)
    def wrapper(self, request, spec_tokens):
        if request.use_structured_output and get_ddtree_config(self.vllm_config):
            return validate_draft_tree(spec_tokens)
        return validate_tokens(self, request, spec_tokens)

    return wrapper


def grammar_bitmask_hook(grammar_bitmask):
    """P10, ``StructuredOutputManager.grammar_bitmask``: with ddtree, one row per
    tree node with the grammar state after the node's path (engine core)."""

    @functools.wraps(grammar_bitmask)
    def wrapper(self, requests, structured_output_request_ids, scheduled_tokens):
        if get_ddtree_config(self.vllm_config) is not None:
            return tree_grammar_bitmask(
                self, requests, structured_output_request_ids, scheduled_tokens
            )
        return grammar_bitmask(
            self, requests, structured_output_request_ids, scheduled_tokens
        )

    return wrapper


def pop_ddtree_config(spec: dict[str, Any]) -> DDTreeConfig | None:
    """Takes the ddtree keys out of a ``--speculative-config`` dict.

    Returns None (and leaves ``spec`` alone) unless ``spec["method"] == "ddtree"``.
    Otherwise rewrites the method to ``"dflash"`` and returns the validated
    :class:`DDTreeConfig`. Raises ValueError naming the offending key.
    """
    if spec.get("method") != DDTREE_METHOD:
        check_no_stray_keys(
            [k for k in spec if str(k).replace("-", "_").startswith("ddtree_")],
            spec.get("method"),
        )
        return None
    unknown = sorted(
        k
        for k in spec
        if k.replace("-", "_").startswith("ddtree")
        and k.replace("-", "_") not in DDTREE_KEYS
    )
    if unknown:
        raise ValueError(
            f"unknown ddtree key(s) {unknown} in speculative_config; known: "
            f"{sorted(DDTREE_KEYS)}"
        )
    if not spec.get("model"):
        raise ValueError(
            'speculative_config with "method": "ddtree" needs "model": the path of a '
            'DFlash drafter checkpoint (the format vLLM\'s "dflash" method loads)'
        )
    fields: dict[str, Any] = {}
    for key in list(spec):
        norm = key.replace("-", "_")
        if norm in DDTREE_KEYS:
            fields[DDTREE_KEYS[norm]] = spec.pop(key)
    cfg = DDTreeConfig(budget=spec.get("num_speculative_tokens"), **fields)
    spec["method"] = "dflash"
    return cfg


def gdn_install_hook(install):
    """P12: ``gdn_state.install`` also routes vLLM's GDN code to the tree path
    for the layers it marks (in the series, an explicit branch in vLLM's CPU
    ``_spec_forward``, ``_spec_aware_nonspec`` and ``_spec_aware_nonspec_subset``
    and in the CUDA ``_forward_core``)."""

    def hooked(model) -> int:
        count = install(model)
        if count:
            _route_gdn_layers()
        return count

    return hooked


def _route_gdn_layers() -> None:
    """The branches of the series, as wrappers (idempotent; unmarked layers
    keep vLLM's code)."""
    from vllm.platforms import current_platform

    from vllm_ddtree.vllm_adapter import gdn_state

    marked = gdn_state.TREE_STATE_ATTR
    if current_platform.is_cuda():
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention as layer_class,
        )

        from vllm_ddtree.vllm_adapter import gpu_gdn

        stock = layer_class._forward_core
        if getattr(stock, "_ddtree", False):
            return

        def _forward_core(self, mixed_qkv, b, a, core_attn_out):
            if getattr(self, marked, False) and gpu_gdn.tree_forward_core(
                self, mixed_qkv, b, a, core_attn_out
            ):
                return None
            return stock(self, mixed_qkv, b, a, core_attn_out)

        _forward_core._ddtree = True
        layer_class._forward_core = _forward_core
        return
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    stock_spec = gdn_attention._spec_forward
    if getattr(stock_spec, "_ddtree", False):
        return

    def _spec_forward(layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm, *args):
        if getattr(layer, marked, False):
            return gdn_state.tree_spec_forward(
                layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm
            )
        return stock_spec(layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm, *args)

    stock_nonspec = gdn_attention._spec_aware_nonspec

    def _spec_aware_nonspec(layer, attn_metadata, mixed_qkv, b, a, out, *args):
        if getattr(layer, marked, False) and (
            gdn_state.nonspec_forward(layer, attn_metadata, mixed_qkv, b, a, out)
            is not None
        ):
            return None
        return stock_nonspec(layer, attn_metadata, mixed_qkv, b, a, out, *args)

    stock_subset = gdn_attention._spec_aware_nonspec_subset

    def _spec_aware_nonspec_subset(layer, attn_metadata, mixed_qkv, b, a, *args):
        if getattr(layer, marked, False):
            out = gdn_state.nonspec_forward(layer, attn_metadata, mixed_qkv, b, a)
            if out is not None:
                return out
        return stock_subset(layer, attn_metadata, mixed_qkv, b, a, *args)

    for wrapper in (_spec_forward, _spec_aware_nonspec, _spec_aware_nonspec_subset):
        wrapper._ddtree = True
        setattr(gdn_attention, wrapper.__name__, wrapper)
