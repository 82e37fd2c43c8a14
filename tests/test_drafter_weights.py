# SPDX-License-Identifier: Apache-2.0
"""The drafter's int8 GEMMs (``ddtree_drafter_quantization``,
vllm_adapter/drafter_weights.py): vLLM's CPU W8A8 kernel under a layer's GEMM
computes the layer within the rounding bound of int8 weights per output channel
and int8 activations per token; the swap lasts only while the drafter loads.
Which engine layers are swapped (the drafter's, never the target's) and that the
output stays the target's: test_e2e_cpu.py."""

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.model_executor.layers import utils  # noqa: E402

from vllm_ddtree.vllm_adapter import drafter_weights  # noqa: E402

pytestmark = pytest.mark.skipif(
    not drafter_weights.int8_supported()[0], reason="vLLM's CPU int8 GEMM"
)


class _Linear(torch.nn.Module):
    """What the swap reads and writes of a vLLM linear layer."""

    def __init__(self, n, k, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # Rows of very different scales: one scale for the whole matrix would
        # lose the small rows.
        row_scale = torch.logspace(-2, 1, n).view(n, 1)
        self.weight = torch.nn.Parameter(
            (torch.randn(n, k, generator=g) * row_scale).to(dtype), requires_grad=False
        )
        self.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_int8_gemm_within_the_rounding_bound(dtype, rows):
    n, k = 96, 160
    layer = _Linear(n, k, dtype, seed=rows)
    w = layer.weight.detach().double()  # [N, K]
    b = layer.bias.detach().double()
    drafter_weights._int8_linear(layer, remove_weight=True)
    assert layer.weight.numel() == 0  # the kernel holds the packed weight
    g = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-1, 1, rows).view(-1, 1))
    x = x.to(dtype)
    y = layer.cpu_linear(x, layer.weight, layer.bias)  # [rows, N]
    assert y.shape == (rows, n) and y.dtype == dtype
    x64 = x.double()
    exact = x64 @ w.T + b
    # |x w - q(x) q(w)| <= sum_k |x| s_w / 2 + |w| s_x / 2 + s_x s_w / 4, with
    # s_w = max_k |w[n]| / 127 per row and s_x = max_k |x[m]| / 127 per token.
    s_w = w.abs().amax(1) / 127  # [N]
    s_x = x64.abs().amax(1, keepdim=True) / 127  # [rows, 1]
    bound = (
        x64.abs().sum(1, keepdim=True) * s_w / 2
        + s_x * w.abs().sum(1) / 2
        + k * s_x * s_w / 4
    )
    if dtype == torch.bfloat16:  # the output's own rounding
        bound = bound + exact.abs() * 2**-8
    err = (y.double() - exact).abs()
    assert (err <= bound * 1.01 + 1e-6).all(), (err / bound).max()
    # And close in the mean (a worst-case bound sums every rounding one way).
    assert err.mean() < 0.01 * exact.abs().mean()


def test_swap_lasts_only_while_loading():
    stock = utils.dispatch_cpu_unquantized_gemm
    with drafter_weights.int8_linears_while_loading() as swapped:
        assert utils.dispatch_cpu_unquantized_gemm is not stock
        assert swapped == []
    assert utils.dispatch_cpu_unquantized_gemm is stock
    with pytest.raises(RuntimeError), drafter_weights.int8_linears_while_loading():
        raise RuntimeError("a failed load")
    assert utils.dispatch_cpu_unquantized_gemm is stock


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_dispatch_keeps_float32_layers_on_onednn(monkeypatch, dtype):
    """On AMX CPUs vLLM's int8 kernel takes its AMX GEMM, which refuses
    float32 activations: a float32 drafter would fail in its first forward.
    vLLM's AMX choice forced here: float32 layers compute as on any CPU,
    bf16 layers take the AMX kernel's path (which runs on AVX-512 too)."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(3)).to(dtype)
    plain = _Linear(96, 160, dtype, seed=4)
    drafter_weights._int8_linear(plain, remove_weight=True)
    expected = plain.cpu_linear(x, plain.weight, plain.bias)
    monkeypatch.setattr(cpu, "check_cpu_sgl_kernel", lambda n, k, dtype: True)
    has_amx_gemm = hasattr(torch.ops._C, "int8_scaled_mm_with_quant")
    if dtype == torch.bfloat16 and not has_amx_gemm:
        pytest.skip("the vLLM kernels loaded here have no AMX int8 GEMM")
    amx = _Linear(96, 160, dtype, seed=4)
    drafter_weights._int8_linear(amx, remove_weight=True)
    got = amx.cpu_linear(x, amx.weight, amx.bias)
    if dtype == torch.float32:
        assert torch.equal(got, expected)
    else:  # another kernel: within the rounding of its bf16 output and inputs
        atol = 0.05 * expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0.05, atol=atol)
