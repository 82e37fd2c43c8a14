# SPDX-License-Identifier: Apache-2.0
"""The GDN tree path of hybrid targets (``vllm_adapter/gdn_state.py``) on vLLM's
CPU kernels: every tree row equals a decode of its root path, bit for bit.

A GDN layer stand-in carries what vLLM's CPU GDN code reads (conv weight and
bias, gate parameters, the qkv split); the caches have vLLM's spec layout (a
conv slot ``W - 1 + num_spec`` wide, ``1 + num_spec`` state slots per request).
The oracle decodes each node's root path token by token with vLLM's own CPU
decode kernels (``causal_conv1d_update_cpu``, ``fused_sigmoid_gating_delta_rule_
update_cpu``) from a copy of the committed caches.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402

if not hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_cpu"):
    pytest.skip("vLLM's CPU GDN kernels are not built here", allow_module_level=True)

from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (  # noqa: E402
    causal_conv1d_update_cpu,
)

from vllm_ddtree.tree import tree_from_parents  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context, gdn_state  # noqa: E402

H, HV, K, W, NUM_SPEC = 1, 2, 128, 4, 7
D = 2 * H * K + HV * K


class Layer:
    """What vLLM's CPU GDN path reads of a GDN layer."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.conv1d = SimpleNamespace(
            weight=(torch.randn(D, 1, W, generator=g) * 0.5).bfloat16(),
            bias=(torch.randn(D, generator=g) * 0.1).bfloat16(),
        )
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


def decode(layer, conv, ssm, slot, x, a, b):
    """vLLM's non-speculative decode of one token of the request in ``slot``."""
    y = causal_conv1d_update_cpu(
        x=x[None],
        conv_state=conv[:, :, : W - 1],
        weight=layer.conv1d.weight.view(D, W),
        bias=layer.conv1d.bias,
        activation="silu",
        conv_state_indices=torch.tensor([slot], dtype=torch.int32),
    )
    q, k, v = layer.rearrange_mixed_qkv(y)
    return ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        q=q,
        k=k,
        v=v,
        a=a[None],
        b=b[None],
        initial_state_source=ssm,
        initial_state_indices=torch.tensor([slot], dtype=torch.int32),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
    ).reshape(HV, K)


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
        self.conv = torch.randn(slots, D, W - 1 + NUM_SPEC, generator=g).bfloat16()
        self.ssm = (torch.randn(slots, HV, K, K, generator=g) * 0.3).bfloat16()
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
        conv, ssm = self.conv.clone(), self.ssm.clone()
        slot = int(self.columns[0])
        for node in self.path(i):
            out = decode(
                layer, conv, ssm, slot, self.x[node], self.a[node], self.b[node]
            )
        return out, conv[slot, :, : W - 1], ssm[slot]

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
    out = gdn_state.tree_spec_forward(layer, metadata, case.x, case.b, case.a, conv, ssm)
    want, want_conv, want_state = case.oracle(layer, 0)
    slot = int(case.columns[0])
    assert torch.equal(out[0], want)
    assert torch.equal(conv[slot, :, : W - 1], want_conv)
    assert torch.equal(ssm[slot], want_state)
