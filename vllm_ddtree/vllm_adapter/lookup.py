# SPDX-License-Identifier: Apache-2.0
"""Lookup sources for DDTree's union trees: what was already said, as drafts.

Two sources, one interface (:meth:`propose`: a
:class:`~vllm_ddtree.lookup_tree.LookupDraft` or None per request of
the input batch, after its newly sampled tokens):

* :class:`SuffixLookup`: SuffixDecoding (https://arxiv.org/abs/2411.04975)
  through arctic-inference's ``SuffixDecodingCache``, the cache vLLM's
  ``"suffix"`` method keeps, maintained as vLLM's ``SuffixDecodingProposer``
  maintains it (a suffix tree per active request's prompt, earlier responses
  across requests up to ``max_cached_requests``), asked for a *tree*
  (``use_tree_spec=True``) with a probability per node;
* :class:`NgramLookup`: vLLM's n-gram matcher over the request's own tokens
  (one path), where arctic-inference is not installed.

The raw probabilities are the sources' own; the union tree uses them calibrated
(:mod:`vllm_ddtree.lookup_calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_ddtree.lookup_tree import LookupDraft

__all__ = [
    "LookupSettings",
    "NgramLookup",
    "SuffixLookup",
    "make_lookup",
    "suffix_decoding_available",
]

# An n-gram match has no score of its own: its calibration starts here.
NGRAM_RAW_PROB = 0.5


# vLLM's "suffix" method verifies the cache's one best path whole, so its
# defaults (max_spec_factor 1.0, min_token_prob 0.1) keep proposals short and
# likely. A ddtree tree keeps each lookup node by its calibrated value (the top
# B, or under the auto budget only the nodes that pay for their rows), so it
# asks for longer and less likely proposals and lets the tree choose: replayed
# on the target's greedy outputs, these reach tau 2.59 against 2.37 for vLLM's
# path (benchmarks/results/replay_lookup.md, time bound). Wider still (4.0,
# 0.02: tau 2.72) paid at batch 1 on a 2-core CPU but lost ~10% at batch 8
# there (benchmarks/results/lookup_t0_wide.md and an A/B of the settings).
DDTREE_MAX_SPEC_FACTOR = 2.0
DDTREE_MIN_TOKEN_PROB = 0.05


@dataclass(frozen=True)
class LookupSettings:
    """vLLM's SuffixDecoding settings (the names of its ``SpeculativeConfig``;
    ddtree's defaults for the proposal's length and cut-off, see
    :meth:`from_speculative_config`), and the drafts' size."""

    max_tree_depth: int = 24  # suffix_decoding_max_tree_depth
    max_spec_factor: float = DDTREE_MAX_SPEC_FACTOR  # suffix_decoding_max_spec_factor
    min_token_prob: float = DDTREE_MIN_TOKEN_PROB  # suffix_decoding_min_token_prob
    max_cached_requests: int = 10000  # suffix_decoding_max_cached_requests
    max_spec_tokens: int = 16  # nodes per lookup tree at most
    ngram_min: int = 1  # the n-gram fallback's shortest match
    ngram_max: int = 3  # and longest

    def __post_init__(self) -> None:
        checks = {
            "suffix_decoding_max_tree_depth": self.max_tree_depth >= 1,
            "suffix_decoding_max_spec_factor": self.max_spec_factor > 0,
            "suffix_decoding_min_token_prob": 0.0 <= self.min_token_prob <= 1.0,
            "suffix_decoding_max_cached_requests": self.max_cached_requests >= -1,
            "max_spec_tokens": self.max_spec_tokens >= 1,
            "ngram_min/ngram_max": 1 <= self.ngram_min <= self.ngram_max,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"ddtree lookup: invalid {', '.join(bad)} ({self})")

    @classmethod
    def from_speculative_config(cls, spec, max_spec_tokens: int) -> LookupSettings:
        """The settings of vLLM's ``suffix_decoding_*`` keys in ``spec`` (a
        ``SpeculativeConfig``). ``max_spec_factor`` and ``min_token_prob`` left
        at vLLM's defaults, which suit the one path its ``"suffix"`` method
        verifies, take ddtree's (:data:`DDTREE_MAX_SPEC_FACTOR`,
        :data:`DDTREE_MIN_TOKEN_PROB`); any other value is used as given."""
        fields = getattr(type(spec), "__dataclass_fields__", {})
        values = {}
        for name in (
            "max_tree_depth",
            "max_spec_factor",
            "min_token_prob",
            "max_cached_requests",
        ):
            key = f"suffix_decoding_{name}"
            value = getattr(spec, key, None)
            vllm_default = getattr(fields.get(key), "default", None)
            ours = name in ("max_spec_factor", "min_token_prob")
            if value is None or (ours and value == vllm_default):
                continue  # LookupSettings' default
            values[name] = value
        return cls(**values, max_spec_tokens=max_spec_tokens)


def suffix_decoding_available() -> bool:
    """Whether arctic-inference's SuffixDecoding extension imports here."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError:
        return False
    return True


class SuffixLookup:
    """Lookup trees from arctic-inference's ``SuffixDecodingCache``."""

    name = "suffix (arctic-inference SuffixDecodingCache, trees)"

    def __init__(self, settings: LookupSettings, max_model_len: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.settings = settings
        self.max_model_len = max_model_len
        self.cache = SuffixDecodingCache(
            max_tree_depth=settings.max_tree_depth,
            max_cached_requests=settings.max_cached_requests,
        )

    def propose(
        self, input_batch, sampled_token_ids: list[list[int]], skip=frozenset()
    ) -> list[LookupDraft | None]:
        """One lookup tree (or None) per request of ``input_batch``.

        Args:
            input_batch: vLLM's input batch, before this step's bookkeeping
                (its token buffer ends at the tokens committed before this
                step).
            sampled_token_ids: per batch row, the tokens this step committed
                (empty for a prompt chunk or a discarded row).
            skip: batch rows that get no tree this step (their tokens are
                still learned).

        The cache learns each request's new tokens; requests no longer in the
        batch are stopped (their responses join the cross-request memory).
        """
        cache, settings = self.cache, self.settings
        drafts: list[LookupDraft | None] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append(None)  # a prompt chunk: nothing committed
                continue
            req_id = input_batch.req_ids[i]
            if req_id not in cache.active_requests:
                history = _history(input_batch, i, sampled)
                if req_id in cache.cached_requests:
                    cache.evict_cached_response(req_id)
                num_prompt = int(input_batch.num_prompt_tokens[i])
                cache.start_request(req_id, history[:num_prompt])
                # Resumed after preemption: its output so far, not only this
                # step's tokens.
                cache.add_active_response(req_id, history[num_prompt:].tolist())
            else:
                cache.add_active_response(req_id, list(sampled))
            num_tokens = int(input_batch.num_tokens_no_spec[i]) + len(sampled)
            room = self.max_model_len - num_tokens - 1
            if room < 1 or i in skip:
                drafts.append(None)
                continue
            draft = cache.speculate(
                req_id,
                _history(input_batch, i, sampled, settings.max_tree_depth),
                max_spec_tokens=min(settings.max_spec_tokens, room),
                max_spec_factor=settings.max_spec_factor,
                min_token_prob=settings.min_token_prob,
                use_tree_spec=True,
            )
            drafts.append(_from_suffix_draft(draft))
        for req_id in cache.active_requests - input_batch.req_id_to_index.keys():
            cache.stop_request(req_id)
        return drafts


def _history(
    input_batch, row: int, sampled: list[int], last: int | None = None
) -> np.ndarray:
    """[n] int32: the row's committed tokens, this step's included (the
    ``last`` ones only, when given)."""
    committed = int(input_batch.num_tokens_no_spec[row])
    start = 0 if last is None else max(0, committed + len(sampled) - last)
    return np.concatenate(
        [
            np.asarray(
                input_batch.token_ids_cpu[row, min(start, committed) : committed],
                dtype=np.int32,
            ),
            np.asarray(sampled, dtype=np.int32)[max(0, start - committed) :],
        ]
    )


def _from_suffix_draft(draft) -> LookupDraft | None:
    """A ``SuffixDecodingDraft`` tree (``parents`` index ``token_ids``, -1: the
    root) as a :class:`LookupDraft`; siblings' frequencies are normalised
    where rounding lets them pass 1."""
    if not draft.token_ids:
        return None
    parents = [int(p) for p in draft.parents]
    probs = np.clip(np.asarray(draft.probs, dtype=np.float64), 1e-9, 1.0)
    slots = np.asarray(parents) + 1  # [n] the parent's slot (0: the root)
    mass = np.bincount(slots, weights=probs, minlength=len(parents) + 1)
    probs = probs / np.maximum(mass[slots], 1.0)
    return LookupDraft([int(t) for t in draft.token_ids], parents, probs.tolist())


class NgramLookup:
    """One lookup path per request from vLLM's n-gram matcher."""

    name = "ngram (vLLM's n-gram matcher, paths)"

    def __init__(self, settings: LookupSettings, max_model_len: int):
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as match,
        )

        self._match = match
        self.settings = settings
        self.max_model_len = max_model_len

    def propose(
        self, input_batch, sampled_token_ids: list[list[int]], skip=frozenset()
    ) -> list[LookupDraft | None]:
        """As :meth:`SuffixLookup.propose`: one path (or None) per request."""
        settings = self.settings
        drafts: list[LookupDraft | None] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled or i in skip:
                drafts.append(None)
                continue
            history = _history(input_batch, i, sampled)
            room = self.max_model_len - history.shape[0] - 1
            if room < 1:
                drafts.append(None)
                continue
            path = self._match(
                history,
                settings.ngram_min,
                settings.ngram_max,
                self.max_model_len,
                min(settings.max_spec_tokens, room),
            )
            if len(path) == 0:
                drafts.append(None)
                continue
            drafts.append(
                LookupDraft(
                    [int(t) for t in path],
                    list(range(-1, len(path) - 1)),
                    [NGRAM_RAW_PROB] * len(path),
                )
            )
        return drafts


def make_lookup(settings: LookupSettings, max_model_len: int):
    """SuffixDecoding where arctic-inference imports, else the n-gram matcher."""
    if suffix_decoding_available():
        return SuffixLookup(settings, max_model_len)
    return NgramLookup(settings, max_model_len)
