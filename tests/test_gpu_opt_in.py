# SPDX-License-Identifier: Apache-2.0
"""The opt-in for ddtree's not-yet-validated CUDA path (config time, no GPU needed).

Off by default: a GPU platform is refused by the shared start-up check. With
``VLLM_DDTREE_UNVALIDATED_GPU=1`` on CUDA the check passes, the engine is set to
the TRITON_ATTN backend (whose DDTree override runs the tree rows) in eager mode,
an MLA target's layers to TRITON_MLA (likewise) -- by the plugin's config hook
(P1) and by the series' ``VllmConfig`` check alike --, another explicitly
requested backend is refused, and the runner's verifier registers the DDTree
backends.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm.platforms  # noqa: E402
from vllm.config import CompilationConfig, CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_ddtree.vllm_adapter import checks, config, plugin_hooks  # noqa: E402
from vllm_ddtree.vllm_adapter.checks import (  # noqa: E402
    gpu_compilation_settings,
    UNVALIDATED_GPU_ENV,
    gpu_backend_per_kind,
    gpu_engine_settings,
    gpu_opted_in,
)
from vllm_ddtree.vllm_adapter.config import DDTreeConfig  # noqa: E402
from vllm_ddtree.vllm_adapter.gpu_attention import BACKEND_PATH  # noqa: E402
from vllm_ddtree.vllm_adapter.gpu_mla_attention import (  # noqa: E402
    BACKEND_PATH as MLA_BACKEND_PATH,
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
    with pytest.raises(ValueError, match="validated for vLLM's CPU") as info:
        checks.check_target_and_platform(None)
    # Only CUDA has a path to opt in to; the message names the switch there.
    assert (UNVALIDATED_GPU_ENV in str(info.value)) is (kind == "cuda")


def test_opted_in_cuda_passes_the_platform_check(on):
    on("cuda", True)
    checks.check_platform()
    assert gpu_opted_in() and gpu_opted_in(platform("cuda"))
    assert not gpu_opted_in(platform("cpu"))
    on("cpu", False)
    checks.check_platform()


def test_mla_targets_get_triton_mla_on_cuda(on):
    """An MLA target's layers go to TRITON_MLA (tree-aware), the drafter's to
    TRITON_ATTN; a per-kind backend without tree attention is refused."""
    on("cuda", True)
    mla = AttentionBackendEnum.TRITON_MLA
    assert gpu_backend_per_kind(True, None) == {"mla_attention": mla}
    assert gpu_backend_per_kind(True, {"mla_attention": "triton_mla"}) == {
        "mla_attention": mla
    }
    assert gpu_backend_per_kind(False, {}) == {}
    for kind, backend in (
        ("mla_attention", "FLASHMLA"),
        ("mla_attention", AttentionBackendEnum.CUTLASS_MLA),
        ("full_attention", "FLASH_ATTN"),
    ):
        with pytest.raises(ValueError, match=f"backend_per_kind\\['{kind}'\\]"):
            gpu_backend_per_kind(True, {kind: backend})
    on("cpu", False)
    assert gpu_backend_per_kind(True, {"mla_attention": "CPU_MLA"}) is None


def test_cuda_engines_use_triton_attention(on):
    on("cuda", True)
    for requested in ([], [None], ["TRITON_ATTN"], [AttentionBackendEnum.TRITON_ATTN]):
        assert gpu_engine_settings(requested) == "TRITON_ATTN"
    on("cpu", False)
    assert gpu_engine_settings(["FLASH_ATTN"]) is None  # CPU: CPU_ATTN, untouched


@pytest.mark.parametrize("requested", ["FLASH_ATTN", AttentionBackendEnum.FLASHINFER])
def test_other_backends_are_refused_on_cuda(on, requested):
    on("cuda", True)
    with pytest.raises(ValueError, match="TRITON_ATTN backend; attention backend FLASH"):
        gpu_engine_settings([None, requested])


@pytest.mark.parametrize(
    ("requested", "resolved"),
    [
        (None, "PIECEWISE"),
        ("FULL_AND_PIECEWISE", "PIECEWISE"),
        ("full_decode_only", "PIECEWISE"),
        ("FULL", "PIECEWISE"),
        ("PIECEWISE", "PIECEWISE"),
        ("NONE", "NONE"),
    ],
)
def test_cuda_engines_capture_piecewise_graphs_only(requested, resolved):
    """A tree plan is built on the host per step: full graphs would replay
    one step's; eager stays eager. Both config forms (object, dict from -cc)."""
    objects = CompilationConfig(
        cudagraph_mode=None if requested is None else CUDAGraphMode[requested.upper()]
    )
    gpu_compilation_settings(objects)
    assert objects.cudagraph_mode == CUDAGraphMode[resolved]
    assert objects.pass_config.fuse_attn_quant is False
    parsed = {} if requested is None else {"cudagraph_mode": requested}
    gpu_compilation_settings(parsed)
    assert parsed["cudagraph_mode"] == CUDAGraphMode[resolved]
    assert parsed["pass_config"] == {"fuse_attn_quant": False}


def test_plugin_config_hook_sets_the_cuda_engine_up(on, monkeypatch):
    """P1: on opted-in CUDA a ddtree engine gets TRITON_ATTN, piecewise CUDA
    graphs only and no attention-quant fusion; other methods and the CPU are left
    alone."""
    monkeypatch.setattr(
        plugin_hooks, "resolve_ddtree_config", lambda result, ddtree, *a: ddtree
    )
    hooked = plugin_hooks.speculative_config_hook(lambda self, m, p: SimpleNamespace())
    for kind, method, changed, use_mla in (
        ("cuda", "ddtree", True, False),
        ("cuda", "ddtree", True, True),
        ("cpu", "ddtree", False, True),
        ("cuda", "dflash", False, True),
    ):
        on(kind, kind == "cuda")
        args = SimpleNamespace(
            spec_method=None,
            speculative_config={
                "method": method, "model": "drafter", "num_speculative_tokens": 4
            },
            async_scheduling=False,
            attention_backend=None,
            attention_config=SimpleNamespace(backend=None, backend_per_kind={}),
            kv_cache_dtype="auto",
            enable_prefix_caching=False,
        )
        args.compilation_config = CompilationConfig()
        model = SimpleNamespace(enforce_eager=False, use_mla=use_mla)
        hooked(args, model, None)
        assert not model.enforce_eager  # compiled, with piecewise graphs
        assert (args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE) is (
            changed
        )
        assert (args.compilation_config.pass_config.fuse_attn_quant is False) is changed
        assert (args.attention_backend == "TRITON_ATTN") is changed
        mla_backend = args.attention_config.backend_per_kind.get("mla_attention")
        assert (mla_backend is AttentionBackendEnum.TRITON_MLA) is (changed and use_mla)


def test_series_config_check_sets_the_cuda_engine_up(on, monkeypatch):
    """The series' VllmConfig check does the same on the built config."""
    monkeypatch.setattr(config, "resolve_ddtree_config", lambda spec, ddtree, *a: ddtree)
    for kind, changed, use_mla in (
        ("cuda", True, False),
        ("cuda", True, True),
        ("cpu", False, True),
    ):
        on(kind, kind == "cuda")
        spec = SimpleNamespace(
            method="ddtree", ddtree=DDTreeConfig(budget=4, budget_mode="fixed")
        )
        vllm_config = SimpleNamespace(
            speculative_config=spec,
            model_config=SimpleNamespace(enforce_eager=False, use_mla=use_mla),
            compilation_config=CompilationConfig(
                cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE
            ),
            cache_config=SimpleNamespace(cache_dtype="auto"),
            attention_config=SimpleNamespace(backend=None, backend_per_kind={}),
        )
        config.verify_speculative_config(vllm_config)
        assert not vllm_config.model_config.enforce_eager
        mode = vllm_config.compilation_config.cudagraph_mode
        assert mode == (
            CUDAGraphMode.PIECEWISE if changed else CUDAGraphMode.FULL_AND_PIECEWISE
        )
        backend = vllm_config.attention_config.backend
        assert (backend is AttentionBackendEnum.TRITON_ATTN) is changed
        per_kind = vllm_config.attention_config.backend_per_kind
        assert (per_kind.get("mla_attention") is AttentionBackendEnum.TRITON_MLA) is (
            changed and use_mla
        )
        assert spec.ddtree_budget == "fixed"  # resolved options written back


def test_the_verifier_registers_the_tree_backend_on_cuda(on):
    from vllm_ddtree.vllm_adapter.runner import DDTreeVerifier

    ddtree = DDTreeConfig(budget=4, draft_len=3, budget_mode="fixed")
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(ddtree=ddtree)),
        max_num_reqs=2,
        max_num_tokens=16,
        device=torch.device("cpu"),
    )
    was = {
        AttentionBackendEnum.TRITON_ATTN: AttentionBackendEnum.TRITON_ATTN.get_path(),
        AttentionBackendEnum.TRITON_MLA: AttentionBackendEnum.TRITON_MLA.get_path(),
    }
    ours = {
        AttentionBackendEnum.TRITON_ATTN: BACKEND_PATH,
        AttentionBackendEnum.TRITON_MLA: MLA_BACKEND_PATH,
    }
    try:
        on("cuda", True)
        DDTreeVerifier(runner)
        for backend, path in ours.items():
            assert backend.get_path() == path
    finally:
        for backend, path in was.items():
            if path != ours[backend]:
                backend.clear_override()


def test_tree_builders_declare_no_cuda_graph_support():
    """Every tree-aware metadata builder reports ``AttentionCGSupport.NEVER``
    (the stock TRITON_ATTN builder says ALWAYS): its tree plans are host-built
    per step, so vLLM must not capture full graphs of these layers."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    from vllm_ddtree.vllm_adapter import (
        cpu_attention,
        cpu_mla_attention,
        gpu_attention,
        gpu_mla_attention,
    )

    builders = [
        cpu_attention.DDTreeCPUAttentionMetadataBuilder,
        cpu_mla_attention.DDTreeCPUMLAMetadataBuilder,
        cpu_mla_attention.DDTreeAMXMLAMetadataBuilder,
        gpu_attention.DDTreeTritonAttentionMetadataBuilder,
        gpu_mla_attention.DDTreeTritonMLAMetadataBuilder,
    ]
    assert TritonAttentionMetadataBuilder.get_cudagraph_support(None, None) == (
        AttentionCGSupport.ALWAYS
    )
    for builder in builders:
        assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER, (
            builder
        )



def test_what_ddtree_changes_on_cuda_is_said(on, caplog):
    """The backend (vLLM's default would be FLASH_ATTN on Hopper: prefill and TTFT
    move with it) and the graph mode are changed with a log line, not silently; a
    backend the user named is not re-announced."""
    import logging

    on("cuda", True)
    caplog.set_level(logging.INFO)
    # vLLM's loggers do not propagate to the root logger caplog hooks.
    logger = logging.getLogger("vllm_ddtree.vllm_adapter.checks")
    logger.addHandler(caplog.handler)
    try:
        _check_the_lines_said(caplog)
    finally:
        logger.removeHandler(caplog.handler)


def _check_the_lines_said(caplog):
    gpu_engine_settings([None])
    assert "attention backend set to TRITON_ATTN" in caplog.text
    caplog.clear()
    gpu_engine_settings(["TRITON_ATTN"])
    assert "attention backend" not in caplog.text
    gpu_compilation_settings({"cudagraph_mode": "FULL_AND_PIECEWISE"})
    assert "cudagraph_mode FULL_AND_PIECEWISE -> PIECEWISE" in caplog.text
    caplog.clear()
    gpu_compilation_settings({"cudagraph_mode": "PIECEWISE"})
    assert "cudagraph_mode" not in caplog.text


def test_the_profile_run_counts_a_verify_steps_logits():
    """vLLM's profiling run samples one row per request; a verify step holds the
    target's logits of R (B + 1) rows (at most the step's tokens), a float32 copy,
    and the drafter's logits over its own vocabulary: what the profile allocates."""
    from vllm_ddtree.vllm_adapter.runner import DDTreeVerifier

    def runner(max_tokens, d2t):
        return SimpleNamespace(
            max_num_tokens=max_tokens, max_num_reqs=8, device=torch.device("cpu"),
            model_config=SimpleNamespace(get_vocab_size=lambda: 151_936,
                                         dtype=torch.bfloat16),
            drafter=SimpleNamespace(model=SimpleNamespace(draft_id_to_target_id=d2t)))

    verifier = SimpleNamespace(runner=runner(8192, torch.zeros(32_768)),
                               config=SimpleNamespace(budget=64, draft_len=15))
    assert DDTreeVerifier._verify_peak_tensors(verifier) == [
        ((8 * 65, 151_936), torch.bfloat16),
        ((8 * 65, 151_936), torch.float32),
        ((8 * 15, 32_768), torch.float32),
    ]
    verifier.runner = runner(256, None)  # the step's tokens cap the rows
    assert DDTreeVerifier._verify_peak_tensors(verifier) == [
        ((256, 151_936), torch.bfloat16),
        ((256, 151_936), torch.float32),
        ((8 * 15, 151_936), torch.float32),
    ]
    DDTreeVerifier.profile_verify_memory(verifier)  # nothing to profile on CPU
