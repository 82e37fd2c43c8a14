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
