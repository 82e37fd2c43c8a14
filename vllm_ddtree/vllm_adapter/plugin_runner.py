# SPDX-License-Identifier: Apache-2.0
"""Plugin only: the V1 model runner of a ddtree engine on an unmodified vLLM 0.32.

In the upstream series ``GPUModelRunner`` creates the ``DDTreeProposer`` and the
:class:`~vllm_ddtree.vllm_adapter.runner.DDTreeVerifier` in ``__init__`` and
calls the verifier from explicit ``if self.ddtree is not None:`` branches
(``RUNNER_BRANCHES`` in ``scripts/make_patches.py``). On an installed vLLM the
plugin cannot edit those methods, so :func:`enable_ddtree` (called by patch point
P3, ``GPUModelRunner.__init__``) makes the constructed runner an instance of a
subclass whose overrides make the same calls around the stock methods;
``tests/test_upstream_patches.py`` checks that both call the verifier from the
same runner methods.
"""

from __future__ import annotations

import functools

from vllm_ddtree.vllm_adapter.config import get_ddtree_config
from vllm_ddtree.vllm_adapter.runner import DDTreeVerifier

__all__ = ["DDTreeRunnerMixin", "enable_ddtree", "model_runner_init_hook"]

_MIXED_CLASSES: dict[type, type] = {}


def model_runner_init_hook(init):
    """P3, ``GPUModelRunner.__init__`` (CPUModelRunner too): with ddtree on, the
    constructed runner becomes a ddtree runner (worker process)."""

    @functools.wraps(init)
    def wrapper(self, vllm_config, device, *args, **kwargs):
        init(self, vllm_config, device, *args, **kwargs)
        if get_ddtree_config(vllm_config) is not None:
            enable_ddtree(self)

    return wrapper


def enable_ddtree(runner) -> None:
    """Turns a constructed V1 runner into a ddtree runner: its drafter becomes a
    ``DDTreeProposer`` (the plugin's subclass, ``plugin_proposer.py``) and
    ``runner.ddtree`` its :class:`DDTreeVerifier`."""
    from vllm_ddtree.vllm_adapter.plugin_proposer import PluginDDTreeProposer

    cls = type(runner)
    if cls not in _MIXED_CLASSES:
        name = f"DDTree{cls.__name__}"
        _MIXED_CLASSES[cls] = type(name, (DDTreeRunnerMixin, cls), {})
    runner.__class__ = _MIXED_CLASSES[cls]
    runner.drafter = PluginDDTreeProposer(runner.vllm_config, runner.device, runner)
    runner.ddtree = DDTreeVerifier(runner)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # After the series' CPU_ATTN override (DDTreeVerifier): the same backend
        # with the compiled tree-row attention (plugin_cpu_attention.py).
        from vllm_ddtree.vllm_adapter.plugin_cpu_attention import (
            register_plugin_tree_attention_backend,
        )

        register_plugin_tree_attention_backend()


class DDTreeRunnerMixin:
    """The series' ``GPUModelRunner`` branches, as overrides."""

    ddtree: DDTreeVerifier

    def execute_model(self, scheduler_output, *args, **kwargs):
        self.ddtree.step_started(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        self.ddtree.step_finished()
        return out

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if not kwargs.get("is_profiling", args[0] if args else False):
            self.ddtree.kv_cache_ready()

    def profile_run(self, *args, **kwargs):
        out = super().profile_run(*args, **kwargs)
        # Inside vLLM's memory profiling: the peak counts a verify step's logits.
        self.ddtree.profile_verify_memory()
        return out

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        return self.ddtree.input_fits_in_drafter(common_attn_metadata)

    def _update_states(self, scheduler_output):
        self.ddtree.drop_requests(scheduler_output)
        return super()._update_states(scheduler_output)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.ddtree.prepare_tree_inputs(scheduler_output, out[1])
        return out

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec_decode_common_attn_metadata = (
            super()._build_attention_metadata(*args, **kwargs)
        )
        self.ddtree.attach_tree_metadata(attn_metadata)
        return attn_metadata, spec_decode_common_attn_metadata

    def _sample(self, logits, spec_decode_metadata):
        if logits is None:
            return super()._sample(logits, spec_decode_metadata)
        return self.ddtree.sample(logits, spec_decode_metadata)

    def propose_draft_token_ids(
        self,
        scheduler_output,
        sampled_token_ids,
        sampling_metadata,
        hidden_states,
        sample_hidden_states,
        aux_hidden_states,
        spec_decode_metadata,
        common_attn_metadata,
        slot_mappings,
    ):
        aux_hidden_states = self.ddtree.before_propose(
            aux_hidden_states, sampled_token_ids
        )
        skipped = self.ddtree.skip_drafter(
            scheduler_output, hidden_states, aux_hidden_states, common_attn_metadata
        )
        if skipped is not None:
            return skipped
        draft = super().propose_draft_token_ids(
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            spec_decode_metadata,
            common_attn_metadata,
            slot_mappings,
        )
        return self.ddtree.after_propose(draft)

    def take_draft_token_ids(self):
        return self.ddtree.attach_draft_trees(super().take_draft_token_ids())
