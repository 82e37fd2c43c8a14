# SPDX-License-Identifier: Apache-2.0
"""The worker's lookup step (``vllm_adapter/lookup_step.py``): union trees in
the batch's tree, drafter rows untouched, and what a verified step teaches the
calibration (reached / accepted lookup nodes, read from the committed tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.lookup_tree import FROM_LOOKUP, LookupDraft, build_union_tree
from vllm_ddtree.tree import build_ddtree, draft_top_k, tree_from_parents
from vllm_ddtree.vllm_adapter.lookup_step import BatchLookup
from vllm_ddtree.vllm_adapter.step import max_depth

BUDGET = 6
DEPTH = 3
VOCAB = 40


class FixedSource:
    """A lookup source that proposes the given drafts, and records its calls."""

    name = "fixed"

    def __init__(self, drafts):
        self.drafts = drafts
        self.calls = []

    def propose(self, input_batch, committed, skip=frozenset()):
        self.calls.append([list(c) for c in committed])
        return [None if b in skip else d for b, d in enumerate(self.drafts)]


def batch(req_ids):
    return SimpleNamespace(req_ids=list(req_ids))


def lookup_only(lookup, req_ids, rows, num_nodes=None):
    """This step's lookup-only trees of ``rows``, cut to ``num_nodes`` per
    row (None: whole), as verified (their nodes remembered)."""
    unions = lookup.lookup_only_unions(rows)
    if num_nodes is None:
        num_nodes = [0 if u is None else u.num_nodes for u in unions]
    trees = lookup.lookup_only_trees(req_ids, unions, num_nodes)
    if trees is None:
        return None
    tokens, parents, log_scores = (list(x) for x in zip(*trees, strict=True))
    return tree_from_parents(
        parents, tokens, max_depth=max(max_depth(parents), 1), scores=log_scores
    )


def drafter_trees(num_reqs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, DEPTH, VOCAB, generator=gen) * 3
    roots = torch.tensor([7 + b for b in range(num_reqs)])
    tree = build_ddtree(logits, BUDGET, root_token_ids=roots)
    log_probs, token_ids = draft_top_k(logits, BUDGET)
    return logits, tree, log_probs, token_ids


def test_union_rows_replace_only_lookup_rows():
    _, tree, log_probs, token_ids = drafter_trees(3)
    # Row 1 gets a lookup path the drafter never proposes.
    path = LookupDraft([31, 32, 33, 34], [-1, 0, 1, 2], [0.9, 0.9, 0.9, 0.9])
    lookup = BatchLookup(FixedSource([None, path, None]), BUDGET)
    lookup.propose(batch(["a", "b", "c"]), [[7], [8], [9]])
    assert lookup.rows() == [1]
    rows = [1]
    union, replaced = lookup.union_trees(
        ["a", "b", "c"], tree, (rows, log_probs[rows], token_ids[rows])
    )
    assert replaced == [1]
    for b in (0, 2):  # the drafter's trees, node for node
        n = int(tree.num_nodes[b])
        assert int(union.num_nodes[b]) == n
        for name in ("tokens", "parents", "depths"):
            assert getattr(union, name)[b, : n + 1].tolist() == getattr(tree, name)[
                b, : n + 1
            ].tolist()
        assert torch.allclose(union.scores[b, : n + 1], tree.scores[b, : n + 1])
    # Row 1 is the union tree the builder makes from the same inputs (its
    # lookup probabilities calibrated: an empty calibration keeps them).
    expected = build_union_tree(
        log_probs[1].numpy(), token_ids[1].numpy(), BUDGET, 8, lookup=path,
        max_depth=BUDGET,
    )  # fmt: skip
    n = expected.num_nodes
    assert union.tokens[1, : n + 1].tolist() == expected.tokens
    assert union.parents[1, : n + 1].tolist() == expected.parents
    # The lookup path runs past the drafter's depth.
    assert int(union.depths[1].max()) == 4 > DEPTH
    assert set(lookup.pending) == {"b"}


def test_a_verified_step_teaches_the_calibration():
    # Lookup-only tree: 31 -> 32 -> 33, and 41 beside 31.
    draft = LookupDraft([31, 32, 33, 41], [-1, 0, 1, -1], [0.5, 0.5, 0.5, 0.25])
    lookup = BatchLookup(FixedSource([draft]), BUDGET)
    lookup.propose(batch(["a"]), [[7]])
    tree = lookup_only(lookup, ["a"], [0])
    n = int(tree.num_nodes[0])
    parents = tree.parents[0, : n + 1].tolist()
    tokens = tree.tokens[0, : n + 1].tolist()
    assert sorted(tokens[1:]) == [31, 32, 33, 41]
    # The target accepted 31 and 32, then said 99 (33 rejected); 41 was
    # reached (a child of the root) and rejected.
    lookup.observe(["a"], [parents], [tokens], [n], [[31, 32, 99]])
    probs, depths, accepted = lookup.verified_trees
    # What the auto budget calibrates the tree by: every verified node's path
    # probability and depth, and the accepted path's length.
    assert accepted == [2] and sorted(depths[0]) == [1, 1, 2, 3]
    assert np.allclose(probs[0], tree.scores[0, 1 : n + 1].exp().tolist())
    assert lookup.num_reached == 4  # 31, 41 (root's children), 32, 33
    assert lookup.num_accepted == 2
    assert lookup.accepted_by_source == {"drafter": 0, "lookup": 2, "both": 0}
    # The calibration reads the committed tokens when the next step starts.
    cal = lookup.calibration
    assert cal.reached.sum() == 0
    lookup.propose(batch(["a"]), [[31, 32, 99]])
    assert cal.reached.sum() == 4 and cal.accepted.sum() == 2
    # Depth 3's bucket saw one rejection: its probability fell below the raw 0.5.
    assert float(cal.probability([3], [0.5], [False])[0]) < 0.5
    assert float(cal.probability([1], [0.5], [False])[0]) > 0.5


def test_trees_not_verified_teach_the_calibration_in_hindsight():
    """A lookup node is a deterministic proposal: whether the target accepts
    it once its parent is accepted is whether the target emits its token
    there, which the request's committed tokens say whether or not the node
    was verified. A tree the auto budget verified none of (valued low: its
    raw path probabilities are small) is read against the tokens committed in
    the next steps, one token a step here; calibrated on verified nodes
    alone, its buckets never moved from the raw score."""
    draft = LookupDraft([31, 32, 33], [-1, 0, 1], [0.1, 0.1, 0.1])
    lookup = BatchLookup(FixedSource([draft]), BUDGET)
    cal = lookup.calibration
    lookup.propose(batch(["a"]), [[7]])
    assert lookup_only(lookup, ["a"], [0], num_nodes=[0]) is None  # none verified
    before = float(cal.probability([2], [0.1], [False])[0])
    for token in (31, 32):  # plain steps: one committed token each
        lookup.propose(batch(["a"]), [[token]])
        lookup.lookup_only_unions([0])  # this step's tree is watched too
    # The first tree: 31 and 32 accepted (depths 1, 2), 33 still open.
    # The second (rooted at 31): 31 rejected at depth 1 (the target said 32).
    assert cal.reached.sum() == 3 and cal.accepted.sum() == 2
    assert float(cal.probability([2], [0.1], [False])[0]) > before
    lookup.propose(batch(["a"]), [[33]])  # decides the first tree's depth 3
    assert cal.reached[2].sum() == 1 and cal.accepted[2].sum() == 1
    # A request that leaves the batch takes its trees along.
    lookup.lookup_only_unions([0])
    lookup.propose(batch(["b"]), [[5]])
    assert "a" not in lookup.watched


def test_only_the_proposed_tree_is_read():
    draft = LookupDraft([31, 32], [-1, 0], [0.5, 0.5])
    lookup = BatchLookup(FixedSource([draft]), BUDGET)
    lookup.propose(batch(["a"]), [[7]])
    tree = lookup_only(lookup, ["a"], [0])
    parents = tree.parents[0, :3].tolist()
    # The scheduler sent other drafts (a chain of other tokens): not ours.
    assert lookup.union_rows(["a"], [parents], [[7, 50, 51]], [2]) == [False]
    lookup.observe(["a"], [parents], [[7, 50, 51]], [2], [[50, 51, 3]])
    assert lookup.num_reached == 0
    # A prefix of ours is.
    assert lookup.union_rows(["a"], [[-1, 0]], [[7, 31]], [1]) == [True]


def test_only_verified_lookup_nodes_are_remembered():
    draft = LookupDraft([31, 32, 33], [-1, 0, 1], [0.9, 0.8, 0.7])
    lookup = BatchLookup(FixedSource([draft]), BUDGET)
    lookup.propose(batch(["a"]), [[7]])
    # A yardstick (not verified) is not remembered; a tree cut to nothing is
    # not sent at all.
    lookup.lookup_only_unions([0])
    assert lookup_only(lookup, ["a"], [0], num_nodes=[0]) is None
    assert not lookup.pending and lookup.num_proposed == 0
    # A tree cut to its first two nodes: those are remembered, not the third.
    tree = lookup_only(lookup, ["a"], [0], num_nodes=[2])
    assert tree.tokens[0, :3].tolist() == [7, 31, 32] and int(tree.num_nodes[0]) == 2
    assert lookup.pending["a"].tokens == [31, 32] and lookup.num_proposed == 2
    # The next step's proposal replaces it; a finished request is forgotten.
    lookup.propose(batch(["a"]), [[31]])
    assert not lookup.pending
    lookup_only(lookup, ["a"], [0])
    lookup.forget(["a"])
    assert not lookup.pending


@pytest.mark.parametrize("seed", range(3))
def test_union_trees_keep_the_budget_and_node_order(seed):
    rng = np.random.default_rng(seed)
    _, tree, log_probs, token_ids = drafter_trees(2, seed)
    drafts = []
    for _ in range(2):
        n = int(rng.integers(1, 8))
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        tokens, seen = [], set()
        for p in parents:
            t = int(rng.integers(0, VOCAB))
            while (p, t) in seen:
                t = int(rng.integers(0, VOCAB))
            seen.add((p, t))
            tokens.append(t)
        probs = [float(rng.uniform(0.05, 1.0 / n)) for _ in parents]
        drafts.append(LookupDraft(tokens, parents, probs))
    lookup = BatchLookup(FixedSource(drafts), BUDGET)
    lookup.propose(batch(["a", "b"]), [[7], [8]])
    union, _ = lookup.union_trees(
        ["a", "b"], tree, ([0, 1], log_probs, token_ids)
    )
    for b in range(2):
        n = int(union.num_nodes[b])
        assert n <= BUDGET
        parents = union.parents[b, : n + 1].tolist()
        assert all(parents[i] < i for i in range(1, n + 1))
        scores = union.scores[b, 1 : n + 1]
        # Best first: a node never outscores the node before it in order.
        assert bool((scores[1:] <= scores[:-1] + 1e-6).all())
        pending = lookup.pending[["a", "b"][b]]
        assert all(pending.sources[i - 1] & FROM_LOOKUP for i in pending.nodes)


def test_requests_whose_lookup_trees_are_never_kept_back_off():
    """Lookup-only trees the auto budget keeps no node of: the request's next
    trees come after 1, then 3, ... skipped steps (its tokens still reach the
    source every step); a kept tree starts it over. Another request is not
    affected."""
    draft = LookupDraft([31], [-1], [0.5])
    source = FixedSource([draft, draft])
    lookup = BatchLookup(source, BUDGET)
    req_ids = ["a", "b"]

    def step(kept_a):
        lookup.propose(batch(req_ids), [[7], [8]])
        built = [d is not None for d in lookup.drafts]
        rows = lookup.rows()
        lookup.note_lookup_only_choice(
            req_ids, rows, [kept_a if b == 0 else 1 for b in range(2)]
        )
        return built[0], built[1]

    built = [step(kept_a=0) for _ in range(8)]
    # a: built, missed -> wait 1; built, missed -> wait 3; built ...
    assert [a for a, _ in built] == [True, False, True, False, False, False, True, False]
    assert all(b for _, b in built)
    assert len(source.calls) == 8  # every step's tokens reached the source
    # A kept tree resets the back-off: built again the next step.
    while not step(kept_a=0)[0]:
        pass
    lookup.note_lookup_only_choice(req_ids, [0], [2, 0])
    assert step(kept_a=1)[0] and step(kept_a=1)[0]
    lookup.forget(["a"])
    assert "a" not in lookup._backoff
