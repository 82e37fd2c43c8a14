# SPDX-License-Identifier: Apache-2.0
"""Plugin only: the proposer a ddtree engine gets from the plugin.

:class:`PluginDDTreeProposer` is the series' ``DDTreeProposer`` plus the compiled
CPU tree builder (``vllm_ddtree._C_cpu``, :mod:`vllm_ddtree.ops.cpu_ext`), which
the upstream series does not ship: on CPU draft logits, where the torch build's
time is per-operator overhead, it builds the same trees with the compiled
best-first heap. :func:`~vllm_ddtree.vllm_adapter.plugin_runner.enable_ddtree`
creates it.
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops import cpu_ext
from vllm_ddtree.tree import DraftTree
from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

__all__ = ["PluginDDTreeProposer"]


class PluginDDTreeProposer(DDTreeProposer):
    """``DDTreeProposer`` building CPU trees with the compiled heap when the CPU
    extension is loaded (the same trees as ``build_ddtree``)."""

    def _build_tree(
        self, draft_logits: torch.Tensor, root_token_ids: torch.Tensor
    ) -> DraftTree:
        if draft_logits.device.type != "cpu" or not cpu_ext.available():
            return super()._build_tree(draft_logits, root_token_ids)
        return cpu_ext.build_ddtree_cpu(
            draft_logits,
            self.ddtree.budget,
            root_token_ids=root_token_ids,
            max_children=self.ddtree.max_children,
            validate=False,
        )
