# SPDX-License-Identifier: Apache-2.0
"""Lookup sources (``vllm_adapter/lookup.py``) on a stand-in input batch:
vLLM's n-gram matcher everywhere, arctic-inference's SuffixDecodingCache where
it is installed (its trees, the cross-request memory bound)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_ddtree.vllm_adapter import lookup  # noqa: E402


def batch(requests: dict[str, tuple[list[int], list[int]]]):
    """An input batch before a step's bookkeeping: ``req_id -> (prompt, output
    committed before this step)`` (the step's new tokens are passed apart)."""
    ids = list(requests)
    width = max((len(p) + len(o) for p, o in requests.values()), default=0) + 8
    tokens = np.zeros((len(ids), width), dtype=np.int64)
    for i, (p, o) in enumerate(requests.values()):
        tokens[i, : len(p) + len(o)] = p + o
    return SimpleNamespace(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        num_tokens_no_spec=np.array([len(p) + len(o) for p, o in requests.values()]),
        num_prompt_tokens=np.array([len(p) for p, _ in requests.values()]),
        token_ids_cpu=tokens,
    )


def test_ngram_lookup_copies_what_followed_the_last_match(vllm_patched):
    source = lookup.NgramLookup(lookup.LookupSettings(max_spec_tokens=4), 512)
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    drafts = source.propose(batch({"a": (prompt, [])}), [[7]])
    (draft,) = drafts
    assert list(draft.tokens) == [8, 9, 10, 11]
    assert list(draft.parents) == [-1, 0, 1, 2]
    # A prompt chunk (nothing sampled) gets no draft.
    assert source.propose(batch({"a": (prompt, [7])}), [[]]) == [None]


needs_suffix = pytest.mark.skipif(
    not lookup.suffix_decoding_available(), reason="arctic-inference not installed"
)


@needs_suffix
def test_suffix_lookup_proposes_a_tree_from_the_prompt():
    """Prompt ``1 2 3 4 5 6 1 2 3 4 7 8``, output ``9 1 2 3``: after ``1 2 3``
    the prompt continued with ``4`` twice, then ``5`` or ``7``."""
    source = lookup.SuffixLookup(lookup.LookupSettings(min_token_prob=0.0), 512)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8]
    (draft,) = source.propose(batch({"a": (prompt, [9, 1])}), [[2, 3]])
    assert draft.tokens[0] == 4 and draft.parents[0] == -1
    children = {draft.tokens[i] for i, p in enumerate(draft.parents) if p == 0}
    assert {5, 7} <= children
    assert all(0 < p <= 1 for p in draft.probs)


@needs_suffix
def test_suffix_memory_keeps_at_most_max_cached_requests():
    source = lookup.SuffixLookup(lookup.LookupSettings(max_cached_requests=2), 512)
    for k in range(5):
        req = f"r{k}"
        source.propose(batch({req: ([k, k + 1, k + 2], [])}), [[k + 3]])
        source.propose(batch({}), [])  # the request left the batch: stopped
    assert len(source.cache.cached_requests) <= 2
    assert not source.cache.active_requests


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(max_tree_depth=0), "suffix_decoding_max_tree_depth"),
        (dict(min_token_prob=1.5), "suffix_decoding_min_token_prob"),
        (dict(max_spec_factor=-1.0), "suffix_decoding_max_spec_factor"),
        (dict(max_cached_requests=-2), "suffix_decoding_max_cached_requests"),
        (dict(ngram_min=3, ngram_max=2), "ngram_min/ngram_max"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        lookup.LookupSettings(**kwargs)


def test_suffix_drafts_siblings_are_normalised_where_they_pass_one():
    """arctic-inference's frequencies can round past 1 among siblings: those
    siblings are scaled to sum to 1, the others keep their scores, and scores
    are clipped into (0, 1]."""
    draft = SimpleNamespace(
        token_ids=[5, 6, 7, 8, 9],
        parents=[-1, -1, 0, 0, 2],
        probs=[0.7, 0.6, 0.3, 0.2, 0.0],
    )
    out = lookup._from_suffix_draft(draft)
    assert out.tokens == [5, 6, 7, 8, 9] and out.parents == [-1, -1, 0, 0, 2]
    assert out.probs[0] == pytest.approx(0.7 / 1.3)
    assert out.probs[1] == pytest.approx(0.6 / 1.3)
    assert out.probs[2:4] == pytest.approx([0.3, 0.2])  # siblings summing to 0.5
    assert 0 < out.probs[4] <= 1e-8
    assert lookup._from_suffix_draft(SimpleNamespace(token_ids=[], parents=[], probs=[])) is None


def test_settings_from_vllm_keys_take_ddtree_defaults_where_left_at_vllms():
    """vLLM's ``suffix_decoding_*`` keys: the proposal's length factor and
    cut-off left at vLLM's defaults (tuned for the one path its ``"suffix"``
    method verifies) take ddtree's, which the tree trims by value; a value a
    user gives is kept, as are the other keys."""
    from vllm.config import SpeculativeConfig

    fields = SpeculativeConfig.__dataclass_fields__
    keys = [f"suffix_decoding_{n}" for n in lookup.LookupSettings.__dataclass_fields__]
    keys = [k for k in keys if k in fields]
    assert len(keys) == 4

    def spec(**given):
        config = type("Spec", (), {"__dataclass_fields__": fields})()
        for key in keys:
            setattr(config, key, given.get(key, fields[key].default))
        return config

    plain = lookup.LookupSettings.from_speculative_config(spec(), 15)
    assert plain.max_spec_factor == lookup.DDTREE_MAX_SPEC_FACTOR
    assert plain.min_token_prob == lookup.DDTREE_MIN_TOKEN_PROB
    assert plain.max_tree_depth == fields["suffix_decoding_max_tree_depth"].default
    assert plain.max_spec_tokens == 15
    given = lookup.LookupSettings.from_speculative_config(
        spec(
            suffix_decoding_max_spec_factor=2.0,
            suffix_decoding_min_token_prob=0.3,
            suffix_decoding_max_tree_depth=8,
            suffix_decoding_max_cached_requests=3,
        ),
        4,
    )
    assert (given.max_spec_factor, given.min_token_prob) == (2.0, 0.3)
    assert (given.max_tree_depth, given.max_cached_requests) == (8, 3)
