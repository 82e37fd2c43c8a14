# SPDX-License-Identifier: Apache-2.0
"""Plugin only: the CPU tree attention as one compiled op per layer call.

:class:`PluginCPUAttentionImpl` is the series' ``DDTreeCPUAttentionImpl`` whose
recomputed tree rows go through ``torch.ops.vllm_ddtree.tree_attention_cpu``
(``csrc/cpu/tree_attention.cpp``, :mod:`vllm_ddtree.ops.cpu_ext`) when the CPU
extension is loaded: the same arithmetic as the torch path (which stays the
reference, and the fallback), reading K and V straight from the paged,
ISA-packed cache, all tree requests and KV heads of the layer in one call. The
torch path spends a gather of every visible prefix position and a dozen small
operators per tree request and layer (the verify step's "fixed tree cost").

The op's flat arguments (rows, masks, block ids of every tree request) are made
once per forward (:func:`compiled_plan`) and shared by its layers.
``VLLM_DDTREE_CPU_TREE_ATTENTION=torch`` keeps the torch path (read when a
layer first attends a tree).
"""

from __future__ import annotations

import functools
import os
import weakref

import torch

from vllm_ddtree.ops import cpu_ext
from vllm_ddtree.vllm_adapter import attn_context
from vllm_ddtree.vllm_adapter.cpu_attention import (
    DDTreeCPUAttentionBackend,
    DDTreeCPUAttentionImpl,
    packed_layout,
)

__all__ = [
    "PLUGIN_BACKEND_PATH",
    "PluginCPUAttentionBackend",
    "PluginCPUAttentionImpl",
    "compiled_calls",
    "compiled_plan",
    "layout_args",
    "register_plugin_tree_attention_backend",
]

PLUGIN_BACKEND_PATH = f"{__name__}.PluginCPUAttentionBackend"
ENV_PATH = "VLLM_DDTREE_CPU_TREE_ATTENTION"

# Layer calls served by the compiled op in this process (tests and benchmarks
# read it to see which path ran).
_COMPILED_CALLS = [0]
# Per forward plan (weakly: a plan lives for one forward).
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_calls() -> int:
    """Layer calls the compiled op has served in this process."""
    return _COMPILED_CALLS[0]


@functools.cache
def layout_args(
    isa: str, dtype: torch.dtype, block_size: int, head_dim: int
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """The op's cache-layout arguments ``(plain_layout, k_index, v_index)``, once
    per layout: the probed unpack indices (cpu_attention's ``packed_layout``) and
    whether they are the "vec" layout the op reads in place (K block transposed
    ``[D, bs]``, V block plain ``[bs, D]``)."""
    k_index, v_index = packed_layout(isa, dtype, block_size, head_dim)
    plain = torch.arange(block_size * head_dim)
    transposed = (plain % head_dim) * block_size + plain // head_dim
    plain_layout = torch.equal(k_index, transposed) and torch.equal(v_index, plain)
    return plain_layout, k_index, v_index


def compiled_plan(plan) -> tuple[torch.Tensor, ...]:
    """The op's plan arguments for a forward's ``plan`` (cpu_attention's
    ``_ForwardPlan``): ``(rows [F], row_start [E + 1], prefix_len [E],
    block_rows [E], block_ids [E, max_blocks], visibility [F, max_T],
    row_depths [F], key_depths [E, max_T])``, made by the forward's first layer."""
    args = _PLANS.get(plan)
    if args is None:
        entries = plan.entries
        num_rows = [e.rows.numel() for e in entries]
        max_t = max(e.num_rows for e in entries)
        max_blocks = max(e.block_ids.numel() for e in entries)
        block_ids = torch.zeros(len(entries), max_blocks, dtype=torch.int64)
        visibility = torch.zeros(sum(num_rows), max_t, dtype=torch.bool)
        key_depths = torch.zeros(len(entries), max_t, dtype=torch.int64)
        at = 0
        for i, e in enumerate(entries):
            block_ids[i, : e.block_ids.numel()] = e.block_ids
            visibility[at : at + num_rows[i], : e.num_rows] = e.visibility
            key_depths[i, : e.num_rows] = e.key_depths
            at += num_rows[i]
        row_start = torch.zeros(len(entries) + 1, dtype=torch.int64)
        row_start[1:] = torch.tensor(num_rows).cumsum(0)
        args = (
            torch.cat([e.rows for e in entries]),
            row_start,
            torch.tensor([e.prefix_len for e in entries], dtype=torch.int64),
            torch.tensor([e.num_rows for e in entries], dtype=torch.int64),
            block_ids,
            visibility,
            torch.cat([e.row_depths for e in entries]).to(torch.int64),
            key_depths,
        )
        _PLANS[plan] = args
    return args


class PluginCPUAttentionImpl(DDTreeCPUAttentionImpl):
    """``DDTreeCPUAttentionImpl`` with the compiled tree-row attention where the
    CPU extension has it (the torch path otherwise)."""

    _use_compiled: bool | None = None

    def _attend_tree_rows(self, plan, isa, query, kv_cache, output, window) -> None:
        if self._use_compiled is None:
            self._use_compiled = (
                os.environ.get(ENV_PATH, "compiled") != "torch"
                and cpu_ext.tree_attention_available()
            )
        if not self._use_compiled or not plan.entries:
            super()._attend_tree_rows(plan, isa, query, kv_cache, output, window)
            return
        num_heads, head_dim = self.num_heads, self.head_size
        _, _, block_size, two_d = kv_cache.shape
        plain_layout, k_index, v_index = layout_args(
            isa, kv_cache.dtype, block_size, two_d // 2
        )
        cpu_ext.load().tree_attention_cpu(
            query.view(query.shape[0], num_heads, head_dim),
            kv_cache,
            k_index,
            v_index,
            output.view(output.shape[0], num_heads, head_dim),
            *compiled_plan(plan),
            float(self.scale),
            float(self.logits_soft_cap or 0.0),
            int(window),
            self.sinks,
            plain_layout,
        )
        _COMPILED_CALLS[0] += 1


class PluginCPUAttentionBackend(DDTreeCPUAttentionBackend):
    """The series' CPU_ATTN override with :class:`PluginCPUAttentionImpl`."""

    @staticmethod
    def get_impl_cls() -> type[PluginCPUAttentionImpl]:
        return PluginCPUAttentionImpl


def register_plugin_tree_attention_backend() -> None:
    """Makes ``CPU_ATTN`` resolve to :class:`PluginCPUAttentionBackend`
    (idempotent; after the series' own registration, which it replaces)."""
    attn_context.override_attention_backend("CPU_ATTN", PLUGIN_BACKEND_PATH)
