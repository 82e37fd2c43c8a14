# SPDX-License-Identifier: Apache-2.0
"""The trees a worker verifies in one step.

The scheduler sends, with each request's scheduled drafts, their tree structure
(``SchedulerOutput.scheduled_draft_trees``, :mod:`.draft_trees`): the parents
of a prefix of the tree the worker proposed (node order is parents-first, so a
prefix is a valid tree), or of a tree the scheduler built with the request's
grammar. :func:`build_step_trees` lays them out for the verify forward. Drafts
sent without a tree are verified as a chain, which is always lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.utils import torch_utils

from vllm_ddtree.tree import DraftTree, tree_from_parents_host
from vllm_ddtree.vllm_adapter.draft_trees import ScheduledDraftTree, chain_parents

__all__ = ["StepTrees", "build_step_trees", "max_depth", "tree_to_device"]


@dataclass
class StepTrees:
    """The trees verified in one step, for every request of the batch.

    Built on the host from host data (the scheduled drafts and trees, vLLM's
    host-side query layout); ``tree``, ``block_starts`` and ``logit_rows`` are
    copied to the device once, pinned and non-blocking: no host sync.
    """

    tree: DraftTree  # on the device; rows padded to the longest block of the step
    host_tree: DraftTree  # the same tree on the host
    # [R] flat row of each request's root in the step's token layout (device).
    block_starts: torch.Tensor
    # [R, T] the verify row (logits row) of every tree row: padding rows repeat
    # their block's last real row (device).
    logit_rows: torch.Tensor
    # Per request: draft tokens scheduled (tree rows 1..n_r are real).
    num_drafts: list[int]
    # Per request, host lists: parents (root first, -1) and tokens (root first).
    parents: list[list[int]]
    tokens: list[list[int]]
    # Per request, the root's flat row (host).
    block_starts_host: list[int]
    # Per request, the scheduled tree (None: verified as a chain).
    scheduled: list[ScheduledDraftTree | None] = field(default_factory=list)

    def path_tokens(self, b: int) -> list[list[int]]:
        """Request ``b``'s draft tokens on the path root..i (root excluded), for
        every tree row i; padding rows repeat the last real row, as the verify
        rows do. Row i's token history is the committed output + this list."""
        return path_tokens(self.parents[b], self.tokens[b], self.tree.num_rows)


def path_tokens(
    parents: list[int], tokens: list[int], num_rows: int
) -> list[list[int]]:
    """Per tree row, the tokens of its ancestors-or-self below the root."""
    paths: list[list[int]] = [[]]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + [tokens[i]])
    return paths + [paths[-1]] * (num_rows - len(paths))


def build_step_trees(
    req_ids: list[str],
    scheduled: dict[str, list[int]],
    query_end: list[int],
    root_tokens: list[int],
    scheduled_trees: dict[str, ScheduledDraftTree],
    device: torch.device,
) -> StepTrees:
    """The verify trees of the drafts the scheduler scheduled.

    Args:
        req_ids: the batch's requests, in row order.
        scheduled: req_id -> draft tokens scheduled this step (may be absent).
        query_end: per request, the flat row after its last scheduled token.
        root_tokens: per request, the token at its verify block's first row.
        scheduled_trees: req_id -> the scheduled drafts' tree
            (``SchedulerOutput.scheduled_draft_trees``).
        device: where the tree tensors go.
    """
    parents, tokens, num_drafts, starts, trees = [], [], [], [], []
    for b, req_id in enumerate(req_ids):
        drafts = list(scheduled.get(req_id, ()))
        n = len(drafts)
        tree = scheduled_trees.get(req_id)
        if tree is not None and len(tree.parents) != n + 1:
            raise RuntimeError(
                f"ddtree: request {req_id} has {n} scheduled drafts but a tree of "
                f"{len(tree.parents) - 1} nodes"
            )
        trees.append(tree if n else None)
        parents.append(chain_parents(n) if tree is None else list(tree.parents))
        tokens.append([root_tokens[b]] + drafts)
        num_drafts.append(n)
        starts.append(query_end[b] - n - 1)
    depth = max_depth(parents)
    host_tree = tree_from_parents_host(parents, tokens, max_depth=max(depth, 1))
    rows = host_tree.num_rows
    # Verify rows: each request's n_r + 1 rows, request after request.
    sizes = np.asarray(num_drafts, dtype=np.int64) + 1
    first = np.cumsum(sizes) - sizes
    logit_rows = first[:, None] + np.minimum(np.arange(rows)[None, :], sizes[:, None] - 1)
    return StepTrees(
        tree=tree_to_device(host_tree, device),
        host_tree=host_tree,
        block_starts=torch_utils.async_tensor_h2d(starts, device=device, dtype=torch.int64),
        logit_rows=torch_utils.async_tensor_h2d(
            torch.from_numpy(logit_rows), device=device, dtype=torch.int64
        ),
        num_drafts=num_drafts,
        parents=parents,
        tokens=tokens,
        block_starts_host=starts,
        scheduled=trees,
    )


def tree_to_device(tree: DraftTree, device: torch.device) -> DraftTree:
    """A host tree on ``device``: pinned, non-blocking copies (no host sync)."""
    fields = {
        name: torch_utils.async_tensor_h2d(getattr(tree, name), device=device)
        for name in tree.__dataclass_fields__
        if name != "max_depth"
    }
    return DraftTree(max_depth=tree.max_depth, **fields)


def max_depth(parents: list[list[int]]) -> int:
    """The deepest node over per-request parent lists (root first)."""
    best = 0
    for par in parents:
        depth = [0] * len(par)
        for i in range(1, len(par)):
            depth[i] = depth[par[i]] + 1
        best = max(best, max(depth))
    return best
