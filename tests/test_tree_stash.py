# SPDX-License-Identifier: Apache-2.0
"""TreeStash: the worker re-attaches the stored tree structure to the drafts the
scheduler sent back, and falls back to a chain (lossless) otherwise."""

import torch

from vllm_ddtree.tree import build_ddtree
from vllm_ddtree.vllm_adapter import step


class _Recorder:
    def __init__(self):
        self.messages = []

    def warning_once(self, msg, *args):
        self.messages.append(msg % args if args else msg)


def _stash_with_tree(budget=6):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 20, generator=gen)
    tree = build_ddtree(logits, budget, torch.tensor([7]))
    stash = step.TreeStash()
    stash.put(["r"], tree)
    n = int(tree.num_nodes[0])
    tokens = tree.tokens[0, 1 : n + 1].tolist()
    parents = tree.parents[0, : n + 1].tolist()
    return stash, tokens, parents


def test_prefix_of_stored_tree_gets_its_parents():
    stash, tokens, parents = _stash_with_tree()
    assert any(p not in (-1, i) for i, p in enumerate(parents)), "tree is a chain"
    for n in range(len(tokens) + 1):
        assert stash.parents_for("r", tokens[:n]) == parents[: n + 1]


def test_other_drafts_are_a_chain(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(step, "logger", recorder)
    stash, tokens, _ = _stash_with_tree()
    changed = [tokens[0] + 1] + tokens[1:]
    assert stash.parents_for("r", changed) == [-1] + list(range(len(changed)))
    assert stash.parents_for("unknown", [0, 0]) == [-1, 0, 1]
    assert recorder.messages == []


def test_blanked_drafts_warn(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(step, "logger", recorder)
    stash, tokens, _ = _stash_with_tree()
    blank = [0] * len(tokens)
    assert stash.parents_for("r", blank) == [-1] + list(range(len(blank)))
    assert len(recorder.messages) == 1
    assert "max_model_len" in recorder.messages[0]


def test_put_returns_real_nodes_only_and_trees_stay_until_dropped():
    """A tree with fewer real nodes than B sends only those to the scheduler; a
    request missing from a step keeps its tree until it finishes or is preempted."""
    logits = torch.randn(2, 2, 20, generator=torch.Generator().manual_seed(1))
    # At most 3 children per node: 3 + 9 = 12 < 16 nodes.
    tree = build_ddtree(logits, 16, torch.tensor([7, 8]), max_children=3)
    stash = step.TreeStash()
    drafts = stash.put(["a", "b"], tree)
    counts = tree.num_nodes.tolist()
    assert [len(d) for d in drafts] == counts and max(counts) < 16
    assert drafts[0] == tree.tokens[0, 1 : counts[0] + 1].tolist()
    parents = tree.parents[1, : counts[1] + 1].tolist()
    stash.drop(None)
    stash.drop(["a"])
    assert len(stash) == 1
    assert stash.parents_for("b", drafts[1]) == parents
    assert stash.num_chain_fallbacks == 0
    assert stash.parents_for("a", drafts[0]) == [-1] + list(range(counts[0]))
    assert stash.num_chain_fallbacks == 1
