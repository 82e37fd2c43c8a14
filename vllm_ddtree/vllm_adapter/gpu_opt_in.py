# SPDX-License-Identifier: Apache-2.0
"""Opt-in for ddtree's CUDA path, which has not run on a GPU yet (plugin only).

ddtree refuses every non-CPU platform at config time
(:func:`~vllm_ddtree.vllm_adapter.checks.check_platform`): vLLM's GPU backends would
attend causally across tree branches. The CUDA path exists -- the TRITON_ATTN
override of :mod:`vllm_ddtree.vllm_adapter.gpu_attention` (tree rows by the
ancestor mask, in-cache KV commit), tested on CPU under ``TRITON_INTERPRET=1`` --
but no engine has run it on a GPU. With ``VLLM_DDTREE_UNVALIDATED_GPU=1`` on CUDA,
the decorators below lift the refusal and set the engine up for it:

* the platform check passes;
* the engine uses the TRITON_ATTN backend (another explicitly requested backend is
  refused) in eager mode (tree shapes are not captured in CUDA graphs yet);
* the worker registers the DDTree TRITON_ATTN backend before the model is built.

Not part of the upstream series (``patches/``): that ships the CPU path only.
"""

from __future__ import annotations

import functools
import os

__all__ = [
    "UNVALIDATED_GPU_ENV",
    "gpu_opted_in",
    "install",
    "platform_check_hook",
    "runner_init_hook",
    "speculative_config_hook",
    "use_gpu_tree_attention",
]

UNVALIDATED_GPU_ENV = "VLLM_DDTREE_UNVALIDATED_GPU"
TREE_ATTENTION_BACKEND = "TRITON_ATTN"


def gpu_opted_in(platform=None) -> bool:
    """True on CUDA when the user opted in to the not-yet-validated GPU path."""
    if os.environ.get(UNVALIDATED_GPU_ENV) != "1":
        return False
    if platform is None:
        from vllm.platforms import current_platform as platform
    return platform.is_cuda()


def use_gpu_tree_attention(engine_args, target_model_config) -> None:
    """The CUDA path's engine settings: TRITON_ATTN, eager mode."""
    requested = [
        backend
        for backend in (
            engine_args.attention_backend,
            getattr(engine_args.attention_config, "backend", None),
        )
        if backend is not None
    ]
    for backend in requested:
        name = getattr(backend, "name", str(backend))
        if name != TREE_ATTENTION_BACKEND:
            raise ValueError(
                f"ddtree on CUDA runs tree attention in the {TREE_ATTENTION_BACKEND} "
                f"backend; attention backend {name} was requested"
            )
    if not requested:
        engine_args.attention_backend = TREE_ATTENTION_BACKEND
    target_model_config.enforce_eager = True


def platform_check_hook(check_platform):
    """Lets opted-in CUDA platforms through ``checks.check_platform``."""

    @functools.wraps(check_platform)
    def wrapper():
        if gpu_opted_in():
            return None
        return check_platform()

    return wrapper


def speculative_config_hook(create_speculative_config):
    """Outside the ddtree hook: opted-in CUDA engines get the path's settings."""

    @functools.wraps(create_speculative_config)
    def wrapper(self, target_model_config, target_parallel_config):
        result = create_speculative_config(
            self, target_model_config, target_parallel_config
        )
        if getattr(result, "ddtree", None) is not None and gpu_opted_in():
            use_gpu_tree_attention(self, target_model_config)
        return result

    return wrapper


def runner_init_hook(init):
    """Registers the DDTree TRITON_ATTN backend before an opted-in ddtree runner
    resolves its attention backends (worker process)."""

    @functools.wraps(init)
    def wrapper(self, vllm_config, device, *args, **kwargs):
        from vllm_ddtree.vllm_adapter.config import get_ddtree_config

        if get_ddtree_config(vllm_config) is not None and gpu_opted_in():
            from vllm_ddtree.vllm_adapter.gpu_attention import (
                register_gpu_tree_attention_backend,
            )

            register_gpu_tree_attention_backend()
        return init(self, vllm_config, device, *args, **kwargs)

    return wrapper


def install() -> None:
    """Applies the three decorators (each a no-op unless opted in on CUDA)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.vllm_adapter import checks

    checks.check_platform = platform_check_hook(checks.check_platform)
    EngineArgs.create_speculative_config = speculative_config_hook(
        EngineArgs.create_speculative_config
    )
    GPUModelRunner.__init__ = runner_init_hook(GPUModelRunner.__init__)
