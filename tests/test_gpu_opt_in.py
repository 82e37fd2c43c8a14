# SPDX-License-Identifier: Apache-2.0
"""The opt-in for ddtree's not-yet-validated CUDA path (config time, no GPU needed).

Off by default: a GPU platform is refused. With ``VLLM_DDTREE_UNVALIDATED_GPU=1``
on CUDA the platform check passes, the engine is set to the TRITON_ATTN backend
(whose DDTree override runs the tree rows) in eager mode, another explicitly
requested backend is refused, and the worker registers the DDTree backend.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm.platforms  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_ddtree.vllm_adapter import checks  # noqa: E402
from vllm_ddtree.vllm_adapter.gpu_attention import BACKEND_PATH  # noqa: E402
from vllm_ddtree.vllm_adapter.gpu_opt_in import (  # noqa: E402
    UNVALIDATED_GPU_ENV,
    gpu_opted_in,
    platform_check_hook,
    runner_init_hook,
    speculative_config_hook,
    use_gpu_tree_attention,
)


def platform(kind: str) -> SimpleNamespace:
    return SimpleNamespace(is_cpu=lambda: kind == "cpu", is_cuda=lambda: kind == "cuda")


@pytest.fixture
def on(monkeypatch):
    """Switches the current platform (and optionally the opt-in)."""

    def switch(kind: str, opt_in: bool) -> None:
        monkeypatch.setattr(vllm.platforms, "_current_platform", platform(kind))
        if opt_in:
            monkeypatch.setenv(UNVALIDATED_GPU_ENV, "1")
        else:
            monkeypatch.delenv(UNVALIDATED_GPU_ENV, raising=False)

    return switch


@pytest.mark.parametrize(
    "kind,opt_in", [("cuda", False), ("rocm", False), ("rocm", True)]
)
def test_gpu_platforms_are_refused_unless_opted_in_on_cuda(on, kind, opt_in):
    on(kind, opt_in)
    original = getattr(checks.check_platform, "__wrapped__", checks.check_platform)
    with pytest.raises(ValueError, match="implemented for vLLM's CPU"):
        platform_check_hook(original)()
    with pytest.raises(ValueError, match="implemented for vLLM's CPU"):
        checks.check_target_and_platform(None)  # wrapped by the plugin or not


def test_opted_in_cuda_passes_the_platform_check(on):
    on("cuda", True)
    refusing = pytest.fail  # the original check must not be reached
    assert platform_check_hook(refusing)() is None
    assert gpu_opted_in() and gpu_opted_in(platform("cuda"))
    assert not gpu_opted_in(platform("cpu"))


def engine_args(backend=None, config_backend=None):
    return SimpleNamespace(
        attention_backend=backend,
        attention_config=SimpleNamespace(backend=config_backend),
    )


def test_opted_in_engines_use_triton_attention_in_eager_mode(on):
    args, model = engine_args(), SimpleNamespace(enforce_eager=False)
    use_gpu_tree_attention(args, model)
    assert args.attention_backend == "TRITON_ATTN" and model.enforce_eager
    for args in (
        engine_args("TRITON_ATTN"),
        engine_args(config_backend=AttentionBackendEnum.TRITON_ATTN),
    ):
        use_gpu_tree_attention(args, SimpleNamespace(enforce_eager=False))
    # Through the EngineArgs hook: only ddtree engines, only when opted in.
    ddtree_result = SimpleNamespace(ddtree=object())
    for result, opt_in, changed in (
        (ddtree_result, True, True),
        (ddtree_result, False, False),
        (SimpleNamespace(), True, False),
    ):
        on("cuda", opt_in)
        hooked = speculative_config_hook(lambda self, m, p, r=result: r)
        args, model = engine_args(), SimpleNamespace(enforce_eager=False)
        assert hooked(args, model, None) is result
        assert model.enforce_eager is changed
        assert (args.attention_backend == "TRITON_ATTN") is changed


@pytest.mark.parametrize(
    "args",
    [
        engine_args("FLASH_ATTN"),
        engine_args(config_backend=AttentionBackendEnum.FLASHINFER),
    ],
)
def test_other_backends_are_refused(args):
    with pytest.raises(
        ValueError, match="TRITON_ATTN backend; attention backend FLASH"
    ):
        use_gpu_tree_attention(args, SimpleNamespace(enforce_eager=False))


def test_the_worker_registers_the_tree_backend_only_when_opted_in(on, monkeypatch):
    monkeypatch.setattr(
        "vllm_ddtree.vllm_adapter.config.get_ddtree_config", lambda config: config
    )
    was = AttentionBackendEnum.TRITON_ATTN.get_path()
    calls = []
    init = runner_init_hook(
        lambda self, config, device: calls.append(
            AttentionBackendEnum.TRITON_ATTN.get_path()
        )
    )
    try:
        on("cuda", False)
        init(None, "ddtree-config", "cuda")
        on("cuda", True)
        init(None, None, "cuda")  # not a ddtree engine
        init(None, "ddtree-config", "cuda")
        assert calls == [was, was, BACKEND_PATH]
    finally:
        if was != BACKEND_PATH:
            AttentionBackendEnum.TRITON_ATTN.clear_override()


def test_the_plugin_installs_the_opt_in():
    from vllm_ddtree.vllm_adapter import patches

    patches.install()
    assert checks.check_platform is not checks.check_platform.__wrapped__
    assert checks.check_platform.__wrapped__.__module__ == checks.__name__
