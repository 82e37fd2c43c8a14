# SPDX-License-Identifier: Apache-2.0
"""The drafter's linear layers and LM head in int8 on CPU
(``ddtree_drafter_quantization``).

A drafter pass on CPU is bound by the weights it streams: one pass of a DFlash
drafter reads every weight of its layers and of its LM head once for a handful
of query rows (block size x requests), so its time is the bytes of its weights
over the memory bandwidth. Measured at batch 1 on a 2-core AVX-512 Xeon (SmolLM2
-135M target, 3-layer drafter, 16,384-token draft LM head, fp32): forward
3.5 ms, LM head 1.8 ms of a 7.7 ms pass, against a 33 ms plain target step.
vLLM's own W8A8 GEMM (oneDNN, int8 weights per output channel, activations
quantized per token; :class:`CPUInt8ScaledMMLinearKernel`) reads a quarter of
the bytes.

Drafts only steer speed: every drafted token is verified by the target, so the
output is the target's whatever the drafter's arithmetic (greedy identical, the
tree samplers lossless for any tree). What int8 can change is which tokens are
drafted, hence the acceptance length; the benchmark reports both.

The target's layers are never touched: the swap is made only while the drafter
loads (:func:`int8_linears_while_loading`), where vLLM's CPU linear layers pick
their GEMM (``dispatch_cpu_unquantized_gemm``, from
``process_weights_after_loading``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["int8_linears_while_loading", "int8_supported"]

# Names under which a swapped layer keeps its int8 weight and its scales (the
# layer's own ``weight`` stays what vLLM leaves there).
_PARAM_NAMES = (
    "ddtree_weight_int8",  # [K, N] int8 (vLLM's kernel transposes it)
    "ddtree_weight_scale",  # [N, 1] float32, per output channel
    "ddtree_input_scale",  # absent: activations quantized per token
    "ddtree_input_zero_point",  # absent: symmetric
    "ddtree_azp_adj",  # set by vLLM's kernel
)


def int8_supported() -> tuple[bool, str]:
    """Whether vLLM's CPU int8 GEMM can run here, and why not."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False, "int8 drafter weights run on CPU only"
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        return False, "this vLLM build has no oneDNN GEMM"
    return True, ""


def _int8_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Puts vLLM's W8A8 CPU kernel under ``layer``'s GEMM (``layer.cpu_linear``)."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
        CPUInt8ScaledMMLinearKernel,
    )
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        Int8ScaledMMLinearLayerConfig,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    weight = layer.weight.detach()  # [N, K]
    dtype = weight.dtype
    # Symmetric per output channel: w ~ scale[n] * q[n, k], q in [-127, 127].
    scale = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    quantized = torch.round(weight.float() / scale).clamp_(-127, 127).to(torch.int8)
    layer.register_parameter(
        _PARAM_NAMES[0], torch.nn.Parameter(quantized, requires_grad=False)
    )
    layer.register_parameter(
        _PARAM_NAMES[1], torch.nn.Parameter(scale, requires_grad=False)
    )
    # Dynamic symmetric activations: no input scale or zero point.
    layer.register_parameter(_PARAM_NAMES[2], None)
    layer.register_parameter(_PARAM_NAMES[3], None)
    # vLLM's kernel reads the fused widths of a merged layer (one here: the
    # scales are per channel already).
    layer.logical_widths = [weight.shape[0]]
    kernel = CPUInt8ScaledMMLinearKernel(
        Int8ScaledMMLinearLayerConfig(
            is_static_input_scheme=False, is_channelwise=True, input_symmetric=True
        ),
        layer_param_names=_PARAM_NAMES,
    )
    with set_default_torch_dtype(dtype):  # the kernel's output dtype
        if dtype in (torch.bfloat16, torch.float16):
            kernel.process_weights_after_loading(layer)
        else:
            # On AMX CPUs vLLM's kernel picks its AMX int8 GEMM, which takes
            # bf16 / fp16 activations only ("expect A to be bfloat16 or
            # half"): float32 layers take its oneDNN path on every CPU.
            kernel.process_weights_for_onednn(layer)
            kernel.linear_method = kernel._apply_weights_onednn
    layer.ddtree_int8_kernel = kernel
    layer.cpu_linear = lambda x, weight, bias: kernel.apply_weights(layer, x, bias)
    if remove_weight:
        # As vLLM's own dispatch does: the kernel holds the packed weight.
        layer.weight = torch.nn.Parameter(
            torch.empty(0, dtype=dtype, device=weight.device), requires_grad=False
        )


@contextlib.contextmanager
def int8_linears_while_loading() -> Iterator[list[torch.nn.Module]]:
    """While the drafter loads: its linear layers and LM head get vLLM's int8
    GEMM instead of the float one; yields the list of the layers swapped.

    Embedding tables (a lookup, not a GEMM) and weights that are not 2-D keep
    vLLM's dispatch.
    """
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    stock = utils.dispatch_cpu_unquantized_gemm
    swapped: list[torch.nn.Module] = []

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if (
            isinstance(layer, (LinearBase, ParallelLMHead))
            and not layer.weight.is_meta
            and layer.weight.ndim == 2
            and layer.weight.numel() > 0
        ):
            _int8_linear(layer, remove_weight)
            swapped.append(layer)
        else:
            stock(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield swapped
    finally:
        utils.dispatch_cpu_unquantized_gemm = stock
