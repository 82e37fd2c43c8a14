# SPDX-License-Identifier: Apache-2.0
"""The worker-side tree of each request between proposing and verifying.

Only the real node tokens of a tree (at most B: a drafter step can yield fewer)
travel to the scheduler and back. The structure (parents, hence depths and the
mask) stays here, keyed by request id, and is re-attached to the tokens the
scheduler actually scheduled: a prefix of the node list (node order is
parents-first, so a prefix is a valid tree). A tree is kept until its request
is drafted again, finishes or is preempted, so a request the scheduler skips for
a step (token-budget pressure) still verifies its tree when it comes back. When
the scheduled tokens are not a prefix of the stored tree (no tree was stored,
drafts were replaced), the drafts are verified as a chain, which is always
lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.utils import torch_utils

from vllm_ddtree.tree import DraftTree, tree_from_parents
from vllm_ddtree.vllm_adapter.structured_output import chain_parents, draft_parents

__all__ = ["TreeStash", "StepTrees", "build_step_trees", "tree_to_device"]

logger = init_logger(__name__)


class TreeStash:
    """req_id -> (node tokens [n], parents [n + 1]) of the last proposed tree."""

    def __init__(self) -> None:
        self._trees: dict[str, tuple[list[int], list[int]]] = {}
        # >>> auto budget
        # Set by the auto budget: req_id -> draft path probability of each
        # stored node, what its acceptance calibration learns from.
        self.keep_path_probs = False
        self._path_probs: dict[str, list[float]] = {}
        # <<< auto budget
        # Requests whose scheduled drafts matched no stored tree (verified as a
        # chain): vLLM blanked or replaced them, or the tree was lost.
        self.num_chain_fallbacks = 0

    def put(self, req_ids: list[str], tree: DraftTree) -> list[list[int]]:
        """Stores the batch's trees; returns each request's real node tokens
        (node order), the drafts the scheduler gets: padding rows of a tree with
        fewer than B nodes are never verified."""
        # One device->host copy per step for the whole batch: tokens, parents,
        # node counts (and path probabilities) as one float64 tensor (exact for
        # token ids < 2**53 and for float32 probabilities).
        rows = tree.tokens.shape[1]
        parts = [tree.tokens, tree.parents, tree.num_nodes.unsqueeze(1)]
        # >>> auto budget
        if self.keep_path_probs:
            parts.append(tree.scores.exp())
        # <<< auto budget
        host = torch.cat([x.double() for x in parts], dim=1).cpu()
        tokens = host[:, :rows].long().tolist()
        parents = host[:, rows : 2 * rows].long().tolist()
        counts = host[:, 2 * rows].long().tolist()
        drafts = []
        for b, req_id in enumerate(req_ids):
            n = counts[b]
            self._trees[req_id] = (tokens[b][1 : n + 1], parents[b][: n + 1])
            drafts.append(tokens[b][1 : n + 1])
        # >>> auto budget
        if self.keep_path_probs:
            probs = host[:, 2 * rows + 1 :].float().tolist()
            for b, req_id in enumerate(req_ids):
                self._path_probs[req_id] = probs[b][1 : counts[b] + 1]
        # <<< auto budget
        return drafts

    # >>> auto budget
    def path_probs_for(self, req_id: str, scheduled: list[int]) -> list[float] | None:
        """Draft path probabilities of the scheduled drafts, if they are a
        prefix of the stored tree (else None: nothing to calibrate with)."""
        stored = self._trees.get(req_id)
        probs = self._path_probs.get(req_id)
        n = len(scheduled)
        if stored is None or probs is None or stored[0][:n] != list(scheduled):
            return None
        return probs[:n]

    # <<< auto budget
    def drop(self, req_ids) -> None:
        """Forgets the trees of ``req_ids`` (finished or preempted requests)."""
        for req_id in req_ids or ():
            self._trees.pop(req_id, None)
            # >>> auto budget
            self._path_probs.pop(req_id, None)
            # <<< auto budget

    def __len__(self) -> int:
        return len(self._trees)

    def stored_tree(self, req_id: str) -> tuple[list[int], list[int]] | None:
        """(node tokens, parents root first) of the request's last tree."""
        return self._trees.get(req_id)

    def parents_for(self, req_id: str, scheduled: list[int]) -> list[int]:
        """Parents (root first) of the scheduled drafts: the stored tree's or a
        chain (:func:`~vllm_ddtree.vllm_adapter.structured_output.draft_parents`,
        the rule the scheduler's grammar bitmask uses too)."""
        stored = self._trees.get(req_id)
        n = len(scheduled)
        parents = draft_parents(stored, scheduled)
        if parents is not None:
            return parents
        if n > 0:
            self.num_chain_fallbacks += 1
        if stored is not None and n > 0 and not any(scheduled):
            # vLLM 0.32's scheduler replaces every draft of a request by token 0
            # when its drafts would not fit under max_model_len.
            logger.warning_once(
                "ddtree: vLLM blanked the draft tree of a request whose prompt + "
                "output + num_speculative_tokens exceeds max_model_len; such steps "
                "accept nothing. Leave num_speculative_tokens of room under "
                "max_model_len to keep the speed-up near the end of long requests."
            )
        return chain_parents(n)


@dataclass
class StepTrees:
    """The trees verified in one step, for every request of the batch.

    Built on the host from host data (the scheduled drafts, the stash, vLLM's
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
    stash: TreeStash,
    device: torch.device,
) -> StepTrees:
    """Re-attaches tree structure to the drafts the scheduler scheduled.

    Args:
        req_ids: the batch's requests, in row order.
        scheduled: req_id -> draft tokens scheduled this step (may be absent).
        query_end: per request, the flat row after its last scheduled token.
        root_tokens: per request, the token at its verify block's first row.
        stash: trees stored when they were proposed.
        device: where the tree tensors go.
    """
    parents, tokens, num_drafts, starts = [], [], [], []
    for b, req_id in enumerate(req_ids):
        drafts = list(scheduled.get(req_id, ()))
        n = len(drafts)
        parents.append(stash.parents_for(req_id, drafts))
        tokens.append([root_tokens[b]] + drafts)
        num_drafts.append(n)
        starts.append(query_end[b] - n - 1)
    depth = _max_depth(parents)
    host_tree = tree_from_parents(parents, tokens, max_depth=max(depth, 1))
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
    )


def tree_to_device(tree: DraftTree, device: torch.device) -> DraftTree:
    """A host tree on ``device``: pinned, non-blocking copies (no host sync)."""
    fields = {
        name: torch_utils.async_tensor_h2d(getattr(tree, name), device=device)
        for name in tree.__dataclass_fields__
        if name != "max_depth"
    }
    return DraftTree(max_depth=tree.max_depth, **fields)


def _max_depth(parents: list[list[int]]) -> int:
    best = 0
    for par in parents:
        depth = [0] * len(par)
        for i in range(1, len(par)):
            depth[i] = depth[par[i]] + 1
        best = max(best, max(depth))
    return best
