# SPDX-License-Identifier: Apache-2.0
"""The GDN tree path of hybrid targets (``vllm_adapter/gdn_state.py``) on vLLM's
CPU kernels: every tree row equals a decode of its root path, bit for bit.

A GDN layer stand-in carries what vLLM's CPU GDN code reads (conv weight and
bias, packed at load as vLLM packs it on this CPU, gate parameters, the qkv
split); the caches have vLLM's spec layout (a conv slot ``W - 1 + num_spec``
wide in vLLM's conv-state layout, ``1 + num_spec`` state slots per request, the
state dtype vLLM's engine keeps on this CPU). The oracle is a non-speculative
engine: vLLM's own ``_cpu_gdn_attention_nonspec`` decodes each node's root path
token by token on a copy of the committed caches, ``W - 1`` conv columns wide.
It picks its conv by the CPU (the C++ kernel on AVX-512-BF16, the vectorised
torch one elsewhere), so a tree path taking the other conv fails here on the
CPUs where they round differently.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm._custom_ops  # noqa: E402, F401  (loads vLLM's CPU kernels)

if not hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_cpu"):
    pytest.skip("vLLM's CPU GDN kernels are not built here", allow_module_level=True)

from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    is_conv_state_dim_first,
)
from vllm.model_executor.layers.mamba.ops.cpu import (  # noqa: E402
    gdn_attention as cpu_gdn,
)
from vllm.model_executor.layers.utils import (  # noqa: E402
    dispatch_cpu_unquantized_gemm,
)

from vllm_ddtree.tree import tree_from_parents  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context, gdn_state  # noqa: E402

H, HV, K, W, NUM_SPEC = 1, 2, 128, 4, 7
D = 2 * H * K + HV * K
# vLLM's CPU engine keeps the recurrent state in float32 where its accelerated
# GDN runs (AVX-512-BF16), in the model's bf16 elsewhere.
STATE_DTYPE = torch.float32 if torch.cpu._is_avx512_bf16_supported() else torch.bfloat16


class Layer:
    """What vLLM's CPU GDN path reads of a GDN layer."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(
            (torch.randn(D, 1, W, generator=g) * 0.5).bfloat16(), requires_grad=False
        )
        self.conv1d.bias = torch.nn.Parameter(
            (torch.randn(D, generator=g) * 0.1).bfloat16(), requires_grad=False
        )
        # As vLLM loads it: packed for its C++ conv where that conv runs.
        dispatch_cpu_unquantized_gemm(self.conv1d, remove_weight=False)
        self.activation = "silu"
        self.A_log = (torch.randn(HV, generator=g) * 0.5).bfloat16()
        self.dt_bias = (torch.randn(HV, generator=g) * 0.5).bfloat16()
        self.prefix = "model.layers.0.linear_attn"

    def rearrange_mixed_qkv(self, x):
        q, k, v = x.split([H * K, H * K, HV * K], -1)
        return (
            q.reshape(1, -1, H, K).contiguous(),
            k.reshape(1, -1, H, K).contiguous(),
            v.reshape(1, -1, HV, K).contiguous(),
        )


def conv_cache(slots, width, g) -> torch.Tensor:
    """A conv cache in vLLM's layout, as the ``[slots, D, width]`` view its GDN
    code reads."""
    if is_conv_state_dim_first():
        return torch.randn(slots, D, width, generator=g).bfloat16()
    return torch.randn(slots, width, D, generator=g).bfloat16().transpose(1, 2)


def decode(layer, conv, ssm, slot, x, a, b):
    """vLLM's non-speculative engine decoding one token of the request in
    ``slot``: its ``_cpu_gdn_attention_nonspec`` on caches ``W - 1`` wide."""
    storage = conv if is_conv_state_dim_first() else conv.transpose(1, 2)
    layer.kv_cache = (storage, ssm)
    metadata = SimpleNamespace(
        spec_sequence_masks=None,
        num_accepted_tokens=None,
        non_spec_state_indices_tensor=torch.tensor([slot], dtype=torch.int32),
        non_spec_query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        num_decodes=1,
        num_decode_tokens=1,
        num_prefills=0,
        num_prefill_tokens=0,
    )
    out = torch.zeros(1, HV, K, dtype=torch.bfloat16)
    try:
        cpu_gdn._cpu_gdn_attention_nonspec(
            layer, metadata, x[None], b[None], a[None], out
        )
    finally:
        del layer.kv_cache
    return out[0]


class Case:
    def __init__(self, parents, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.parents = parents
        t = len(parents)
        self.tree = tree_from_parents([parents], [[9] * t], NUM_SPEC)
        self.x = torch.randn(t, D, generator=g).bfloat16()
        self.a = torch.randn(t, HV, generator=g).bfloat16()
        self.b = torch.randn(t, HV, generator=g).bfloat16()
        slots = 2 + NUM_SPEC + 1
        self.conv = conv_cache(slots, W - 1 + NUM_SPEC, g)  # [slots, D, S]
        self.ssm = (torch.randn(slots, HV, K, K, generator=g) * 0.3).to(STATE_DTYPE)
        self.columns = torch.arange(2, 2 + NUM_SPEC + 1)  # the request's slots

    def metadata(self, stash=True):
        t = len(self.parents)
        batch = attn_context.TreeAttentionBatch.from_tree(
            self.tree, [0], [0], [0], [t], [10], stash_kv=stash
        )
        return SimpleNamespace(
            num_spec_decodes=1,
            spec_query_start_loc=torch.tensor([0, t], dtype=torch.int32),
            spec_sequence_masks=None,
            spec_state_indices_tensor=self.columns[None],
            spec_token_indx=None,
            tree=batch,
        ), batch

    def path(self, i):
        path = [i]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def oracle(self, layer, i):
        """(output, conv window, state) after decoding node ``i``'s root path
        in a non-speculative engine holding the committed caches."""
        conv = self.conv[:, :, : W - 1].clone()
        if not is_conv_state_dim_first():  # the same layout, W - 1 wide
            conv = conv.transpose(1, 2).contiguous().transpose(1, 2)
        ssm = self.ssm.clone()
        slot = int(self.columns[0])
        for node in self.path(i):
            out = decode(
                layer, conv, ssm, slot, self.x[node], self.a[node], self.b[node]
            )
        return out, conv[slot], ssm[slot]

    def run(self, layer, stash=True):
        metadata, batch = self.metadata(stash)
        conv, ssm = self.conv.clone(), self.ssm.clone()
        out = gdn_state.tree_spec_forward(
            layer, metadata, self.x, self.b, self.a, conv, ssm
        )
        return out, conv, ssm, batch


TREE = [-1, 0, 0, 1, 2, 2, 4, 3]  # siblings at depths 1 and 2, depth 4


def test_every_tree_row_is_a_decode_of_its_path_bit_for_bit():
    case, layer = Case(TREE), Layer()
    out, _, ssm, _ = case.run(layer)
    for i in range(len(TREE)):
        want, _, want_state = case.oracle(layer, i)
        assert torch.equal(out[i], want), i
        assert torch.equal(ssm[case.columns[i]], want_state), i


@pytest.mark.parametrize("leaf", [0, 3, 6, 5])
def test_commit_leaves_the_caches_of_a_decode_of_the_accepted_path(leaf):
    """After the commit, column 0's state and the conv window are what decoding
    the accepted path leaves (root alone, the spine, a sibling path)."""
    case, layer = Case(TREE), Layer()
    _, conv, ssm, batch = case.run(layer)
    path = case.path(leaf)
    paths = torch.full((1, NUM_SPEC), 0)
    paths[0, : len(path) - 1] = torch.tensor(path[1:])
    batch.commit_recurrent(paths, torch.tensor([len(path)]))
    _, want_conv, want_state = case.oracle(layer, leaf)
    slot = int(case.columns[0])
    assert torch.equal(ssm[slot], want_state)
    assert torch.equal(conv[slot, :, : W - 1], want_conv)


def test_a_request_without_drafts_is_one_decode():
    case, layer = Case([-1]), Layer()
    metadata, _ = case.metadata()
    metadata.tree = None
    conv, ssm = case.conv.clone(), case.ssm.clone()
    out = gdn_state.tree_spec_forward(
        layer, metadata, case.x, case.b, case.a, conv, ssm
    )
    want, want_conv, want_state = case.oracle(layer, 0)
    slot = int(case.columns[0])
    assert torch.equal(out[0], want)
    assert torch.equal(conv[slot, :, : W - 1], want_conv)
    assert torch.equal(ssm[slot], want_state)
