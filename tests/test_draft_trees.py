# SPDX-License-Identifier: Apache-2.0
"""The draft trees' round trip (vllm_adapter.draft_trees): the worker sends each
tree's structure with its drafts, the scheduler keeps it and sends back the
structure of exactly what it scheduled; drafts without a tree are a chain."""

from types import SimpleNamespace

import numpy as np
import torch

from vllm_ddtree.tree import build_ddtree
from vllm_ddtree.vllm_adapter import draft_trees
from vllm_ddtree.vllm_adapter.draft_trees import (
    DraftTreeRecord,
    ProposedTrees,
    chain_parents,
    record_of,
    scheduled_draft_trees,
    store_draft_trees,
)


class _Recorder:
    def __init__(self):
        self.messages = []

    def warning_once(self, msg, *args):
        self.messages.append(msg % args if args else msg)


def _trees(budget=16, keep_probs=False):
    logits = torch.randn(2, 2, 20, generator=torch.Generator().manual_seed(1))
    # At most 3 children per node, 2 deep: 3 + 9 < 16 real nodes.
    tree = build_ddtree(logits, budget, torch.tensor([7, 8]), max_children=3)
    proposed = ProposedTrees()
    proposed.keep_path_probs = keep_probs
    drafts = proposed.put(["a", "b"], tree)
    return tree, proposed, drafts


def _request():
    return SimpleNamespace(is_finished=lambda: False)


def _draft_token_ids(req_ids, drafts):
    return SimpleNamespace(req_ids=list(req_ids), draft_token_ids=[list(d) for d in drafts])


def test_put_sends_real_nodes_with_their_parents_and_probabilities():
    tree, proposed, drafts = _trees(keep_probs=True)
    counts = tree.num_nodes.tolist()
    assert [len(d) for d in drafts] == counts and min(counts) < 16
    out = proposed.attach(_draft_token_ids("ab", drafts))
    for b in range(2):
        n = counts[b]
        assert drafts[b] == tree.tokens[b, 1 : n + 1].tolist()
        assert out.draft_parents[b] == tree.parents[b, : n + 1].tolist()
        assert any(p not in (-1, i) for i, p in enumerate(out.draft_parents[b]))
        expected = tree.scores[b, 1 : n + 1].exp()
        assert torch.allclose(torch.tensor(out.draft_path_probs[b]).float(), expected)
    assert out.draft_candidates is None
    assert len(proposed) == 0  # sent once, then forgotten


def test_host_trees_are_sent_as_device_trees_are():
    """put_host (lookup-only trees, host lists) sends what put sends for the
    same trees: drafts, parents, path probabilities."""
    tree, proposed, drafts = _trees(keep_probs=True)
    sent = proposed.attach(_draft_token_ids("ab", drafts))
    host = ProposedTrees()
    host.keep_path_probs = True
    lists = []
    for b in range(2):
        n = int(tree.num_nodes[b])
        lists.append(
            (
                tree.tokens[b, : n + 1].tolist(),
                tree.parents[b, : n + 1].tolist(),
                tree.scores[b, : n + 1].tolist(),
            )
        )
    assert host.put_host(["a", "b"], lists) == drafts
    out = host.attach(_draft_token_ids("ab", drafts))
    assert out.draft_parents == sent.draft_parents
    for got, want in zip(out.draft_path_probs, sent.draft_path_probs, strict=True):
        assert np.allclose(got, want, rtol=1e-6)


def test_drafts_the_pass_did_not_make_go_as_a_chain(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(draft_trees, "logger", recorder)
    _, proposed, drafts = _trees()
    changed = [drafts[0][0] + 1] + drafts[0][1:]
    out = proposed.attach(_draft_token_ids(["a", "c"], [changed, [4, 5]]))
    assert out.draft_parents == [chain_parents(len(changed)), [-1, 0, 1]]
    assert out.draft_path_probs is None and recorder.messages == []
    # vLLM's zeros when the drafter's input would not fit: a chain, and a warning.
    out = ProposedTrees().attach(_draft_token_ids(["a"], [[0, 0, 0]]))
    assert out.draft_parents == [[-1, 0, 1, 2]]
    assert len(recorder.messages) == 1 and "max_model_len" in recorder.messages[0]


def test_the_scheduler_sends_back_the_scheduled_prefix():
    tree, proposed, drafts = _trees(keep_probs=True)
    sent = proposed.attach(_draft_token_ids("ab", drafts))
    requests = {"a": _request(), "b": _request()}
    store_draft_trees(requests, sent)
    n = len(drafts[0])
    for cut in range(n + 1):
        # vLLM shortens drafts under token-budget pressure: a prefix.
        scheduled = {"a": drafts[0][:cut], "b": drafts[1]}
        trees = scheduled_draft_trees(requests, {"a": cut + 1, "b": 1}, scheduled)
        assert trees["b"].parents == sent.draft_parents[1]
        if cut == 0:
            assert "a" not in trees  # no drafts, no tree
            continue
        assert trees["a"].parents == sent.draft_parents[0][: cut + 1]
        assert trees["a"].path_probs == sent.draft_path_probs[0][:cut]
        assert not trees["a"].grammar_shaped
    # Drafts that are not the record's (vLLM's -1 padding): no tree, a chain.
    assert scheduled_draft_trees(requests, {"a": 4}, {"a": [-1] * 3}) == {}
    assert scheduled_draft_trees({"x": _request()}, {"x": 2}, {"x": [1]}) == {}
    # A request scheduled without drafts has no tree.
    assert scheduled_draft_trees(requests, {"a": 1}, {}) == {}


def test_a_grammar_built_tree_replaces_the_workers():
    _, proposed, drafts = _trees()
    sent = proposed.attach(_draft_token_ids("ab", drafts))
    sent.draft_candidates = {"b": "candidates of b"}
    values = ([0.5, 0.4, 0.3, 0.1], [1, 1, 2, 2])  # before the price cut
    built = DraftTreeRecord(
        [9, 8, 7], [-1, 0, 0, 1], [0.5, 0.4, 0.3], True, grammar_values=values
    )
    seen = []

    def grammar_tree(request, candidates):
        seen.append(candidates)
        return built

    requests = {"a": _request(), "b": _request()}
    store_draft_trees(requests, sent, grammar_tree)
    assert seen == ["candidates of b"]
    assert sent.draft_token_ids[1] == [9, 8, 7]  # what vLLM stores as drafts
    assert record_of(requests["b"]) is built
    assert record_of(requests["a"]).tokens == drafts[0]
    trees = scheduled_draft_trees(requests, {"a": 1, "b": 3}, {"b": [9, 8]})
    assert list(trees) == ["b"]
    assert trees["b"].parents == [-1, 0, 0] and trees["b"].grammar_shaped
    assert trees["b"].grammar_values == values
    # Scheduled without drafts (the price kept none): its values still go.
    trees = scheduled_draft_trees(requests, {"b": 1}, {})
    assert trees["b"].parents == [-1] and trees["b"].grammar_values == values
