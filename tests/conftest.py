# SPDX-License-Identifier: Apache-2.0
"""Test-session set-up shared by every test module.

Without a GPU, Triton kernels run only in the interpreter, and TRITON_INTERPRET
must be set before anything (vLLM included) imports triton.
"""

import os

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
    _VLLM_PATCHED = True


@pytest.fixture(scope="session")
def vllm_patched():
    """Session fixture form of :func:`patch_vllm_for_tests`."""
    patch_vllm_for_tests()


# --------------------------------------------------------------------------- #
# Scripted DDTree drafter (end-to-end tests that need known trees)
# --------------------------------------------------------------------------- #


@pytest.fixture
def scripted_drafter(monkeypatch):
    """``install(script)``: the DDTree drafter's logits become
    ``script(proposer, runner, req_ids, committed, logits)`` ([R * L, V], where
    ``committed[b]`` is request b's committed length: its bonus token sits at
    that index of prompt + output). The tree is built from them as usual."""
    from vllm_ddtree.vllm_adapter import runner as runner_module
    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

    def install(script) -> None:
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

    return install


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
            seq = full[tuple(runner.requests[req_id].prompt_token_ids)]
            start = int(committed[b]) + 1  # the bonus sits at index committed
            for j in range(proposer.draft_len):
                if start + j < len(seq):
                    truth = seq[start + j]
                    out[b, j, truth] = 8.0
                    out[b, j, (truth + 1) % 250] = 8.2  # a wrong rank 0
        return out.view(-1, vocab)

    return script
