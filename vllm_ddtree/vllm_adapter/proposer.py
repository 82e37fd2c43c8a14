# SPDX-License-Identifier: Apache-2.0
"""DDTree proposer: one DFlash drafter pass, then the draft tree of every request.

``DFlashProposer`` drafts the whole block in one pass and keeps only the argmax
per position. ``DDTreeProposer`` keeps the per-position logits of that pass and
builds the DDTree of each request on device
(:func:`vllm_ddtree.tree.build_ddtree`, no host sync), rooted at the
request's bonus token. The scheduler receives the
tree's B node tokens in node order (parents first, best first), so any prefix it
keeps is itself a valid tree; the structure stays in the worker
(:attr:`last_tree`).
"""

from __future__ import annotations

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.tree import DraftTree, build_ddtree
from vllm_ddtree.vllm_adapter.config import DDTreeConfig

__all__ = ["DDTreeProposer"]


class DDTreeProposer(DFlashProposer):
    """DFlash drafting + DDTree construction (https://arxiv.org/abs/2604.12989)."""

    def __init__(
        self, vllm_config, device: torch.device, ddtree: DDTreeConfig, runner=None
    ):
        super().__init__(vllm_config, device, runner)
        self.ddtree = ddtree
        # Drafted positions per request: the tree's maximum depth.
        self.draft_len = min(ddtree.draft_len, ddtree.budget)
        self._draft_logits: torch.Tensor | None = None
        self.last_tree: DraftTree | None = None
        # False: the next pass only writes the drafter's context K/V (vLLM's
        # K = 0 path) and drafts nothing (set by the auto budget).
        self.draft_this_step = True

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # [R * L, V] full target-vocab logits of the mask positions.
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        return logits.argmax(dim=-1), None

    def propose(self, num_speculative_tokens: int, **kwargs) -> torch.Tensor:
        """Returns [R, B] draft node tokens (tree rows 1..B; padding rows are 0)."""
        next_token_ids = kwargs["next_token_ids"]
        self._draft_logits = None
        self.last_tree = None
        if not self.draft_this_step:
            # [R, 0]: the context K/V of this step's tokens is still written.
            return super().propose(num_speculative_tokens=0, **kwargs)
        super().propose(num_speculative_tokens=self.draft_len, **kwargs)
        logits = self._draft_logits
        assert logits is not None, "the DFlash pass produced no draft logits"
        num_reqs = next_token_ids.shape[0]
        self.last_tree = build_ddtree(
            logits.view(num_reqs, self.draft_len, -1),
            self.ddtree.budget,
            root_token_ids=next_token_ids,
            max_children=self.ddtree.max_children,
            validate=False,
        )
        self._draft_logits = None
        return self.last_tree.tokens[:, 1:]
