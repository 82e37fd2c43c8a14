# SPDX-License-Identifier: Apache-2.0
"""Test-session set-up shared by every test module.

Without a GPU, Triton kernels run only in the interpreter, and TRITON_INTERPRET
must be set before anything (vLLM included) imports triton.
"""

import contextlib
import os
import sys
import weakref

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# --------------------------------------------------------------------------- #
# In-process vLLM (tests that build ``vllm.LLM``)
# --------------------------------------------------------------------------- #

import pytest  # noqa: E402

# Engine in this process (starts in seconds, no spawn) and a 1 GiB CPU KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

_VLLM_PATCHED = False


def patch_vllm_for_tests() -> None:
    """Make several ``vllm.LLM`` instances work in one process (vllm-cpu 0.32.0).

    A second engine fails in ``CpuPlatform.register_triton_kernel_overrides()``
    (``'_lib_fn_wrapper' object has no attribute 'get'``) once numba has been
    imported. Register the C++ kernel overrides once, then make the hook a
    no-op. Imports vLLM, so call it only from tests that need vLLM (or use the
    ``vllm_patched`` fixture). Idempotent.
    """
    global _VLLM_PATCHED
    if _VLLM_PATCHED:
        return
    import vllm  # noqa: F401
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
    type(current_platform).register_triton_kernel_overrides = classmethod(
        lambda cls: None
    )
    _track_engines()
    _VLLM_PATCHED = True


@pytest.fixture(scope="session")
def vllm_patched():
    """Session fixture form of :func:`patch_vllm_for_tests`."""
    patch_vllm_for_tests()


# --------------------------------------------------------------------------- #
# Engines never outlive their test or module
# --------------------------------------------------------------------------- #
#
# vLLM's in-process engine tears down the process's distributed state (its
# model-parallel groups) when it is finalized. An engine alive when a test
# fails is held by the failure's traceback (pytest keeps it in
# ``sys.last_traceback``) and finalized whenever that is dropped: in the middle
# of a later engine's life, which then fails ("tensor model parallel group is
# not initialized"). So every engine made during a failing test, and every
# engine still alive when its module ends, is shut down there.

_ENGINES: list[weakref.ref] = []  # every vllm.LLM made in this process


def _track_engines() -> None:
    """Records every ``vllm.LLM`` made from now on (idempotent)."""
    from vllm import LLM

    if getattr(LLM.__init__, "_tracked", False):
        return
    init = LLM.__init__

    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _ENGINES.append(weakref.ref(self))

    tracked_init._tracked = True
    LLM.__init__ = tracked_init


def _shut_down_engines(since: int) -> None:
    """Shuts down the engines made since ``_ENGINES[since]`` that are alive."""
    for ref in _ENGINES[since:]:
        llm = ref()
        if llm is not None:
            # Never hide the test's own failure.
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
    del _ENGINES[since:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if "vllm" in sys.modules:
        _track_engines()
    since = len(_ENGINES)
    outcome = yield
    if outcome.excinfo is not None:
        _shut_down_engines(since)


@pytest.fixture(scope="module", autouse=True)
def engines_end_with_their_module():
    """Shuts down the module's engines still alive when it ends (after its own
    fixtures' teardown: autouse fixtures are set up first)."""
    if "vllm" in sys.modules:
        _track_engines()
    since = len(_ENGINES)
    yield
    _shut_down_engines(since)


# --------------------------------------------------------------------------- #
# Scripted DDTree drafter (end-to-end tests that need known trees)
# --------------------------------------------------------------------------- #


@pytest.fixture
def scripted_drafter(monkeypatch):
    """``install(script)``: the DDTree drafter's logits become
    ``script(proposer, runner, req_ids, committed, logits)`` ([R * L, V], where
    ``committed[b]`` is request b's committed length: its bonus token sits at
    that index of prompt + output). The tree is built from them as usual."""
    return lambda script: install_scripted_drafter(monkeypatch, script)


def install_scripted_drafter(monkeypatch, script) -> None:
    """:func:`scripted_drafter`'s install, with ``monkeypatch`` (a
    ``pytest.MonkeyPatch``) to undo it; scripts outside pytest call it too."""
    from vllm_ddtree.vllm_adapter import runner as runner_module
    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

    orig_propose = DDTreeProposer.propose

    def scripted_propose(self, num_speculative_tokens, **kw):
        cad = kw["common_attn_metadata"]
        rejected = kw.get("num_rejected_tokens_gpu")
        committed = cad.seq_lens[: cad.num_reqs].clone()
        if rejected is not None:
            committed -= rejected[: cad.num_reqs]
        runner = self.scripted_runner
        req_ids = runner.input_batch.req_ids[: cad.num_reqs]

        def scripted(hidden_states, sampling_metadata):
            logits = self.model.compute_logits(hidden_states)
            draft = script(self, runner, req_ids, committed, logits)
            self._draft_logits = draft.to(logits)
            return self._draft_logits.argmax(dim=-1), None

        self._sample_draft_tokens = scripted
        try:
            return orig_propose(self, num_speculative_tokens, **kw)
        finally:
            del self._sample_draft_tokens

    monkeypatch.setattr(DDTreeProposer, "propose", scripted_propose)
    orig_init = runner_module.DDTreeVerifier.__init__

    def init_and_remember(self, runner):  # scripts read the runner's requests
        orig_init(self, runner)
        runner.drafter.scripted_runner = runner

    monkeypatch.setattr(runner_module.DDTreeVerifier, "__init__", init_and_remember)


@pytest.fixture
def truth_at_rank_1():
    """``make(full)``: a script for :func:`scripted_drafter` putting, at every
    depth, the true continuation (``full[prompt]`` = prompt + reference output)
    at rank 1 and a wrong token at rank 0, so only a tree (a sibling path) can
    accept it."""
    return _truth_at_rank_1


def _truth_at_rank_1(full: dict[tuple, list[int]]):
    def script(proposer, runner, req_ids, committed, logits):
        vocab = logits.shape[-1]
        out = torch.zeros(len(req_ids), proposer.draft_len, vocab)
        for b, req_id in enumerate(req_ids):
            # A prompt the script does not know (a second turn after a first
            # that diverged) gets no truth: the test fails on its output.
            seq = full.get(tuple(runner.requests[req_id].prompt_token_ids), [])
            start = int(committed[b]) + 1  # the bonus sits at index committed
            for j in range(proposer.draft_len):
                if start + j < len(seq):
                    truth = seq[start + j]
                    out[b, j, truth] = 8.0
                    out[b, j, (truth + 1) % 250] = 8.2  # a wrong rank 0
        return out.view(-1, vocab)

    return script
