# SPDX-License-Identifier: Apache-2.0
"""The grammar span memory (vllm_adapter.grammar_spans) with xgrammar through
vLLM's XgrammarGrammar: spans stored per (schema, jump-forward string) once
emitted, proposed to the next request in that state, scored against what the
target then emitted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

from test_tree_bitmask import VOCAB, compiler  # noqa: E402, F401
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

from vllm_ddtree.vllm_adapter.grammar_spans import (  # noqa: E402
    GrammarSpanMemory,
    jump_forward_string,
)

REGEX = r"[a-c]x{3}[a-z]{10}"  # after the first letter the grammar forces "xxx"
PROMPT = [7, 8, 9]


class FakeRequest:
    """What the memory reads of a vLLM Request: its tokens and its schema key."""

    def __init__(self, compiler, key: str = "k"):  # noqa: F811
        ctx = compiler.compile_regex(REGEX)
        self.grammar = XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx),
                                       vocab_size=VOCAB, ctx=ctx)
        self.all_token_ids = list(PROMPT)
        self.structured_output_request = SimpleNamespace(structured_output_key=key)

    def emit(self, text: bytes) -> None:
        assert self.grammar.accept_tokens("r", list(text))
        self.all_token_ids += list(text)


def hint(memory: GrammarSpanMemory, request: FakeRequest) -> tuple[int, ...]:
    return memory.hint(request, jump_forward_string(request.grammar))


def test_a_span_is_proposed_to_the_next_request_in_that_state(compiler):  # noqa: F811
    memory = GrammarSpanMemory(span_tokens=8)
    first = FakeRequest(compiler)
    first.emit(b"b")
    assert hint(memory, first) == ()  # "xxx" is new
    first.emit(b"xxxhel")
    assert hint(memory, first) == () and len(memory) == 0  # 7 of 8
    first.emit(b"lo")
    hint(memory, first)
    assert len(memory) == 1
    # Another request in the same state ("xxx" next) gets the first one's span.
    second = FakeRequest(compiler)
    second.emit(b"c")
    assert hint(memory, second) == tuple(b"xxxhello")
    assert memory.hints == 1 and memory.hint_probs == [0.5] * 8  # nothing scored
    # It emits 6 of the hint's tokens, then leaves it: 6 matched, 1 miss.
    second.emit(b"xxxhelp")
    second.emit(b"s")
    hint(memory, second)
    assert (memory.matched, memory.missed) == (6, 1)
    # Per position: the first 6 reached and matched, the 7th reached and
    # missed, the 8th never reached.
    assert memory.hint_probs == pytest.approx([2 / 3] * 6 + [1 / 3, 1 / 2])
    # Another schema, or another state, has no hint.
    other = FakeRequest(compiler, key="other")
    other.emit(b"a")
    assert hint(memory, other) == ()
    third = FakeRequest(compiler)
    third.emit(b"axxx")  # past the forced run: nothing forced next
    assert hint(memory, third) == ()


def test_least_recently_used_spans_are_dropped(compiler):  # noqa: F811
    memory = GrammarSpanMemory(span_tokens=2, max_spans=1)
    request = FakeRequest(compiler)
    request.emit(b"a")
    hint(memory, request)  # key "xxx"
    request.emit(b"xx")
    hint(memory, request)  # "xxx" stored; key "x"
    request.emit(b"xq")
    hint(memory, request)  # "x" stored, "xxx" dropped
    assert len(memory) == 1
    dropped = FakeRequest(compiler)
    dropped.emit(b"b")
    assert hint(memory, dropped) == ()
    kept = FakeRequest(compiler)
    kept.emit(b"cxx")
    assert hint(memory, kept) == tuple(b"xq")


def test_a_backend_without_jump_forward_gives_no_hint(compiler):  # noqa: F811
    memory = GrammarSpanMemory()
    request = FakeRequest(compiler)
    request.emit(b"a")
    no_matcher = SimpleNamespace(is_terminated=lambda: False)
    assert jump_forward_string(no_matcher) is None
    assert memory.hint(request, None) == ()
