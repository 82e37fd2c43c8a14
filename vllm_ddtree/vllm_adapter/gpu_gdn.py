# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet layers of hybrid targets on CUDA (opt-in, not yet run on a GPU).

vLLM's CUDA GDN layer verifies a chain: its conv kernel rolls a
``W - 1 + num_spec`` window per request and its recurrent kernel reads the
state of the last accepted position (``num_accepted_tokens``) and writes one
state per draft position. A tree has no such order, so for a verify forward
with spec sequences, :func:`tree_forward_core` replaces the spec part of the
layer's ``_forward_core`` (its non-spec part, prefill chunks, stays vLLM's own)
in the layers ``gdn_state.install`` marked:

* conv: each row's window along its root path (``ops.tree_gdn.
  tree_causal_conv1d``), then the roots' inputs join the committed conv state
  (``gdn_state.append_root_inputs``), as on the CPU;
* recurrence: ``ops.tree_gdn.tree_gated_delta_rule_triton``, one launch, each
  row starting from its parent's state slot (the per-token initial-state index
  of vLLM's recurrent kernel is the parent's slot here), its post-state in its
  own column's slot; vLLM's Triton layout keeps ``h[v, k]``, viewed here as
  ``[slots, HV, K, V]``;
* the commit is the CPU path's (``gdn_state.RecurrentStateStash``): column 0
  gets the accepted node's state, the conv state the path's inputs.

The layout between steps is the one vLLM's non-speculative paths read (conv
inputs in columns ``0 .. W - 2`` of column 0's slot, the state in column 0's
slot), so prefill chunks need nothing else. ``gdn_state.install`` turns the
fused spec-decode path (``enable_fused_gdn_spec_decode``) off for these layers:
it verifies chains only.
"""

from __future__ import annotations

import copy

import torch

from vllm_ddtree.ops.tree_gdn import (
    tree_causal_conv1d,
    tree_gated_delta_rule_triton,
)
from vllm_ddtree.vllm_adapter.gdn_state import (
    append_root_inputs,
    stash_for_commit,
    tree_slots,
)

__all__ = ["tree_forward_core", "tree_rows"]


def _forward_metadata() -> dict | None:
    """The forward's layer name -> attention metadata (None outside one)."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    return metadata if isinstance(metadata, dict) else None


def tree_forward_core(layer, mixed_qkv, b, a, core_attn_out) -> bool:
    """The GDN layer's ``_forward_core`` with the spec part on the trees (same
    contract: ``core_attn_out`` filled); False, with nothing done, for a
    forward without spec sequences (vLLM's code runs it).

    A spec sequence without a tree (a request without drafts in a step of a
    ddtree engine) is a one-row tree: vLLM's chain path would roll the conv
    state out of the layout above. The non-spec part of a mixed batch (prefill
    chunks) goes back through the layer's ``_forward_core`` with a metadata
    without spec sequences."""
    context = _forward_metadata()
    metadata = context.get(layer.prefix) if context is not None else None
    if metadata is None or metadata.spec_sequence_masks is None:
        return False
    n = metadata.num_actual_tokens
    mixed_qkv, b, a = mixed_qkv[:n], b[:n], a[:n]
    has_non_spec = metadata.num_prefills > 0 or metadata.num_decodes > 0
    # vLLM's token indices (int64 from its argsort; int32 where it builds them).
    spec = metadata.spec_token_indx.to(torch.int64) if has_non_spec else None

    def spec_rows(t):
        return t if spec is None else t.index_select(0, spec)

    out = tree_rows(layer, metadata, spec_rows(mixed_qkv), spec_rows(b), spec_rows(a))
    if spec is None:
        core_attn_out[:n] = out
        return True
    core_attn_out.index_copy_(0, spec, out)
    # The non-spec part (prefill chunks), by vLLM's own code on a metadata
    # without spec sequences.
    rows = metadata.non_spec_token_indx.to(torch.int64)
    non_spec = copy.copy(metadata)
    non_spec.spec_sequence_masks = None
    non_spec.spec_sequence_masks_cpu = None
    non_spec.num_spec_decodes = 0
    non_spec.num_spec_decode_tokens = 0
    non_spec.spec_token_indx = None
    non_spec.non_spec_token_indx = None
    non_spec.spec_query_start_loc = None
    non_spec.spec_state_indices_tensor = None
    non_spec.num_accepted_tokens = None
    non_spec.num_actual_tokens = (
        metadata.num_prefill_tokens + metadata.num_decode_tokens
    )
    non_spec.tree = None
    non_spec_out = torch.zeros(
        (rows.numel(), *core_attn_out.shape[1:]),
        dtype=core_attn_out.dtype,
        device=core_attn_out.device,
    )
    context[layer.prefix] = non_spec
    try:
        layer._forward_core(
            mixed_qkv.index_select(0, rows),
            b.index_select(0, rows),
            a.index_select(0, rows),
            non_spec_out,
        )
    finally:
        context[layer.prefix] = metadata
    core_attn_out.index_copy_(0, rows, non_spec_out)
    return True


def tree_rows(layer, metadata, mixed_qkv, b, a) -> torch.Tensor:
    """[M, HV, V] the GDN core outputs of the spec rows (trees, packed in
    ``spec_query_start_loc`` order); the layer's caches updated and its rows
    stashed for the commit.

    Args:
        layer: a vLLM GDN layer (``conv1d``, ``A_log``, ``dt_bias``,
            ``kv_cache`` = (conv state, recurrent state),
            ``rearrange_mixed_qkv``).
        metadata: its ``GDNAttentionMetadata`` with ``tree``.
        mixed_qkv: [M, D] the spec rows' conv inputs.
        b, a: [M, HV] their gate inputs.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv_cache, ssm_cache = layer.kv_cache[0], layer.kv_cache[1]
    # [slots, D, S] and [slots, HV, K, V] views of vLLM's layouts.
    conv_state = (
        conv_cache if is_conv_state_dim_first() else conv_cache.transpose(-1, -2)
    )
    ssm_state = ssm_cache.transpose(-1, -2)
    slots = tree_slots(metadata, mixed_qkv.device)
    weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], -1)  # [D, W]
    conv_out = tree_causal_conv1d(
        mixed_qkv,
        conv_state,
        slots.conv_slots,
        slots.parents,
        weight,
        layer.conv1d.bias,
        layer.activation,
    )
    append_root_inputs(mixed_qkv, conv_state, slots, weight.shape[1])
    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    out = tree_gated_delta_rule_triton(
        query[0],
        key[0],
        value[0],
        a,
        b,
        layer.A_log,
        layer.dt_bias,
        ssm_state,
        slots.parents,
        slots.conv_slots,
        slots.node_slots,
        slots.start_loc,
    )
    stash_for_commit(layer, metadata, slots, mixed_qkv, conv_state, ssm_state)
    return out
