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
