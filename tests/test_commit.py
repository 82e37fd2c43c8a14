# SPDX-License-Identifier: Apache-2.0
"""The commit plan: accepted paths land at contiguous rows, for every verify path."""

import pytest
import torch

from vllm_ddtree.commit import plan_commit
from vllm_ddtree.sampling import TreeSamplingParams
from vllm_ddtree.tree import build_ddtree
from vllm_ddtree.verify import verify_tree


def verified_batch(seed, method):
    g = torch.Generator().manual_seed(seed)
    num_reqs, depth, vocab = 5, 4, 6
    draft = torch.randn(num_reqs, depth, vocab, generator=g)
    budgets = torch.tensor([0, 3, 9, 14, 9])
    tree = build_ddtree(draft, budgets, max_budget=14)
    target = torch.randn(num_reqs, tree.num_rows, vocab, generator=g)
    for b in range(num_reqs):  # agree with the draft's favourite often: deep paths
        for i in range(tree.num_rows):
            d = int(tree.depths[b, i])
            if d < depth:
                target[b, i, draft[b, d].argmax()] += 3.0
    params = TreeSamplingParams.from_lists([0.0, 1.0, 0.8, 1.0, 0.0])
    return tree, verify_tree(tree, target, params, method=method), budgets


@pytest.mark.parametrize("method", ["sample_walk", "rejection"])
def test_moves_put_paths_first(method):
    for seed in range(10):
        tree, out, budgets = verified_batch(seed, method)
        # Ragged flat layout: each request's block holds its root + real nodes only.
        sizes = budgets + 1
        starts = torch.cumsum(sizes, 0) - sizes
        total = int(sizes.sum())
        plan = plan_commit(out.accepted_indices, starts, total)
        rows = torch.randn(total, 3)  # stands for one layer's K (or V, or hidden) rows

        in_place = rows.clone()
        for s, d in zip(plan.src_rows.tolist(), plan.dst_rows.tolist(), strict=True):
            in_place[d] = in_place[s]  # increasing depth order: race-free
        gathered = rows.index_select(0, plan.hidden_perm)
        scattered = rows.clone()
        scattered[plan.dst_rows] = rows[plan.src_rows]
        for b in range(tree.num_reqs):
            a = int(out.num_accepted[b])
            for j in range(a + 1):
                want = rows[starts[b] + out.accepted_indices[b, j]]
                for got in (in_place, gathered, scattered):
                    assert torch.equal(got[starts[b] + j], want)
        assert torch.equal(plan.num_committed, out.num_accepted + 1)
        moved = plan.moved().view(tree.num_reqs, -1)
        for b in range(tree.num_reqs):
            acc = out.accepted_indices[b]
            identity = all(
                int(acc[j]) == j for j in range(int(out.num_accepted[b]) + 1)
            )
            assert bool(moved[b].any()) != identity


def test_identity_and_empty_paths_move_nothing():
    accepted = torch.tensor([[0, 1, 2, -1], [0, -1, -1, -1]])
    plan = plan_commit(accepted, torch.tensor([0, 5]), 8)
    assert not plan.moved().any()
    assert torch.equal(plan.hidden_perm, torch.arange(8))
    assert plan.num_committed.tolist() == [3, 1]


def test_bad_shapes():
    with pytest.raises(ValueError, match="accepted_indices"):
        plan_commit(torch.zeros(3, dtype=torch.int64), torch.zeros(3), 3)
