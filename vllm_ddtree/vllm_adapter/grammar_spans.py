# SPDX-License-Identifier: Apache-2.0
"""Grammar span memory: what the target emitted the last time a grammar was
in a state, proposed as a draft-tree hint the next time it is.

Where a grammar fixes the *characters* (JSON keys, punctuation, enum tails), it
rarely fixes the *tokens*: with a BPE vocabulary a key such as ``"priority"``
has many spellings, whitespace is often optional, and the target picks one
spelling it then repeats. So the tokens a grammar forces (probability 1 in the
tree, :mod:`vllm_ddtree.grammar_tree`) are rare, and jump-forward strings
tokenised canonically are not what the target emits (measured on SmolLM2:
about a quarter of such tokens match).

The memory keys a state by its schema and its jump-forward string (xgrammar's
``find_jump_forward_string``: the characters the grammar forces next) and keeps
the ``span_tokens`` tokens the target emitted from there, across requests
(a service's tool calls share their schemas). When a structured request's
grammar is in a state with a known key, those tokens become the tree's hint:
each proposed with the probability the memory has measured for a hint's
token at that position given the ones before (the key's own tokens are
usually right, what follows the forced characters less often), as far as the
grammar allows them. Like suffix decoding
(https://arxiv.org/abs/2411.04975), but keyed by grammar state rather than by
the last tokens.

Lossless whatever it proposes: hints are verified like any draft node.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["GrammarSpanMemory", "grammar_span_memory", "jump_forward_string"]

# The manager's GrammarSpanMemory; a request's spans still being emitted, and
# its schema's key (vLLM serialises a JSON schema each time it is asked).
_MEMORY_ATTR = "ddtree_grammar_spans"
_PENDING_ATTR = "ddtree_pending_spans"
_SCHEMA_ATTR = "ddtree_schema_key"


@dataclass
class _PendingSpan:
    key: tuple  # (structured output key, jump-forward string)
    start: int  # index of the span's first token in the request's tokens
    hint: tuple[int, ...]  # what the memory proposed there (may be empty)


class GrammarSpanMemory:
    """Spans of emitted tokens per (schema, jump-forward string), least
    recently used dropped beyond ``max_spans``.

    Args:
        span_tokens: tokens kept per span (the longest hint).
        max_spans: spans kept.
    """

    def __init__(self, span_tokens: int = 8, max_spans: int = 4096) -> None:
        self.span_tokens = span_tokens
        self.max_spans = max_spans
        self._spans: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self.hints = 0  # hints looked up
        self.matched = 0  # hint tokens the target then emitted
        self.missed = 0  # hints the target left before their end
        # Per hint position: hints scored that reached it, and the target's
        # token matched there.
        self._reached = [0] * span_tokens
        self._matched_at = [0] * span_tokens

    @property
    def hint_probs(self) -> list[float]:
        """[span_tokens] the measured probability that the target emits a
        hint's i-th token, given it emitted the ones before (Laplace's rule:
        1/2 before any hint reached position i)."""
        return [
            (matched + 1) / (reached + 2)
            for matched, reached in zip(self._matched_at, self._reached, strict=True)
        ]

    def hint(self, request: Any, jump: str | None) -> tuple[int, ...]:
        """Stores the spans ``request``'s committed tokens completed and scores
        their hints; returns the hint for the request's grammar state (after
        its committed tokens), whose jump-forward string is ``jump``
        (:func:`jump_forward_string`), empty if none."""
        tokens = request.all_token_ids
        waiting = []
        for span in getattr(request, _PENDING_ATTR, ()):
            emitted = tuple(tokens[span.start : span.start + self.span_tokens])
            if len(emitted) < self.span_tokens:
                waiting.append(span)
                continue
            self._store(span.key, emitted)
            if span.hint:
                self._score(span.hint, emitted)
        hint: tuple[int, ...] = ()
        if jump:
            schema = getattr(request, _SCHEMA_ATTR, None)
            if schema is None:
                schema = request.structured_output_request.structured_output_key
                setattr(request, _SCHEMA_ATTR, schema)
            key = (schema, jump)
            hint = self._spans.get(key, ())
            if hint:
                self._spans.move_to_end(key)
                self.hints += 1
            waiting.append(_PendingSpan(key, len(tokens), hint))
        setattr(request, _PENDING_ATTR, waiting)
        return hint

    def _score(self, hint: tuple[int, ...], emitted: tuple[int, ...]) -> None:
        matched = _common_prefix(hint, emitted)
        self.matched += matched
        self.missed += matched < len(hint)
        for i in range(min(matched + 1, len(hint))):
            self._reached[i] += 1
            self._matched_at[i] += i < matched

    def _store(self, key: tuple, span: tuple[int, ...]) -> None:
        self._spans[key] = span
        self._spans.move_to_end(key)
        if len(self._spans) > self.max_spans:
            self._spans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._spans)


def grammar_span_memory(manager: Any) -> GrammarSpanMemory:
    """The ``StructuredOutputManager``'s :class:`GrammarSpanMemory`."""
    memory = getattr(manager, _MEMORY_ATTR, None)
    if memory is None:
        memory = GrammarSpanMemory()
        setattr(manager, _MEMORY_ATTR, memory)
    return memory


def jump_forward_string(grammar: Any) -> str | None:
    """The characters a ``StructuredOutputGrammar`` forces next ('' if none or
    terminated; None if its backend cannot say: only xgrammar's matcher can).
    Nothing forced means no forced token either."""
    find = getattr(getattr(grammar, "matcher", None), "find_jump_forward_string", None)
    if find is None:
        return None
    return "" if grammar.is_terminated() else find()


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
