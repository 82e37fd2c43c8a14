# SPDX-License-Identifier: Apache-2.0
"""The commit step shared by every verification path.

The verify forward wrote tree node ``i`` of a request at the ``i``-th slot after
its committed prefix (flat, parents-first order). What is committed is the path
``accepted = [0, p_1, ..., p_a]``: its node at depth ``j`` must end up at slot
``prefix + j``. Because ``p_j`` is strictly increasing with ``p_j >= j``, moving
row ``p_j`` to row ``j`` in increasing ``j`` never overwrites a row still to be
read, so the move is race-free in place (or as one gather-then-scatter).

:func:`plan_commit` turns the verification output into fixed-shape row moves
(no host sync: unused entries are self-moves), used for

* the target's K/V: copy rows ``src -> dst`` in every attention layer's paged
  cache (an identity path moves nothing);
* the hidden states for the next DFlash round: ``hidden.index_select(0, perm)``
  puts each request's accepted path first in its block, in path order;
* the scheduler: ``num_accepted + 1`` tokens are committed per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CommitPlan", "plan_commit"]


@dataclass
class CommitPlan:
    # [R * L] int64. Flat verify rows to copy from (path node p_j of each request).
    src_rows: torch.Tensor
    # [R * L] int64. Flat verify rows to copy to (depth j of each request).
    # Entries past a request's accepted path are self-moves of its root row.
    dst_rows: torch.Tensor
    # [T] int64. Row permutation putting every accepted path first in its block.
    hidden_perm: torch.Tensor
    # [R] int64. Tokens committed per request (accepted drafts + 1 bonus).
    num_committed: torch.Tensor

    def moved(self) -> torch.Tensor:
        """[R * L] bool: entries that really move data (src != dst)."""
        return self.src_rows != self.dst_rows


def plan_commit(
    accepted_indices: torch.Tensor,
    block_starts: torch.Tensor,
    num_rows: int,
) -> CommitPlan:
    """Plans the K/V and hidden-state moves of an accepted path.

    Args:
        accepted_indices: [R, L + 1] local node indices, root (0) first, -1
            padded (:class:`vllm_ddtree.verify.TreeVerifyOutput`).
        block_starts: [R] flat row of each request's root in the verify batch.
        num_rows: T, total flat rows of the verify batch (for the permutation).

    Returns:
        The :class:`CommitPlan`.
    """
    if accepted_indices.dim() != 2 or block_starts.shape != accepted_indices.shape[:1]:
        raise ValueError(
            f"accepted_indices must be [R, L + 1] and block_starts [R], got "
            f"{tuple(accepted_indices.shape)} and {tuple(block_starts.shape)}"
        )
    device = accepted_indices.device
    block_starts = block_starts.to(device=device, dtype=torch.int64)
    path = accepted_indices[:, 1:]  # [R, L] nodes at depth 1..L
    depth = torch.arange(1, path.shape[1] + 1, device=device).unsqueeze(0)
    valid = path >= 0
    start = block_starts.unsqueeze(1)
    src = torch.where(valid, start + path, start).reshape(-1)
    dst = torch.where(valid, start + depth, start).reshape(-1)
    perm = torch.arange(num_rows, device=device)
    # dst rows are distinct across valid entries; padding entries rewrite the
    # root with itself, which is harmless.
    perm[dst] = src
    num_committed = valid.sum(dim=1) + 1
    return CommitPlan(src, dst, perm, num_committed)
