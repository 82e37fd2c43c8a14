# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet along draft trees (``ops/tree_gdn.py``).

The oracle runs each node's root path as a chain, in float64, from the committed
conv inputs and state: a plain per-token loop of the gated delta rule and a
``conv1d`` over [committed inputs ; path inputs]. Every node's output and stored
state must be that chain's last output and final state. The torch reference is
also checked, on chains, against vLLM's own CPU decode kernel
(``fused_sigmoid_gating_delta_rule_update_cpu``, token by token), which fixes the
CPU state layout (``h[k, v]``) and the gating. The Triton kernel runs under
``TRITON_INTERPRET=1`` (tests/conftest.py).
"""

from __future__ import annotations

import _gdn_utils
import pytest
import torch

from vllm_ddtree.ops.tree_gdn import tree_causal_conv1d, tree_gated_delta_rule_triton
from vllm_ddtree.references import tree_gated_delta_rule_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Case(_gdn_utils.Case):
    def run(self, fn, state=None, dtype=torch.float32, parents=None):
        parents = self.parents if parents is None else parents
        y = tree_causal_conv1d(
            self.x.to(DEVICE, dtype),
            self.conv_state.to(DEVICE, dtype),
            self.conv_slots.to(DEVICE),
            parents.to(DEVICE),
            self.weight.to(DEVICE),
            self.bias.to(DEVICE),
        )
        q, k, v = self.split(y)
        state = self.state.to(DEVICE, dtype) if state is None else state
        args = (
            q,
            k,
            v,
            self.a.to(DEVICE, dtype),
            self.b.to(DEVICE, dtype),
            self.A_log.to(DEVICE),
            self.dt_bias.to(DEVICE),
            state,
            parents.to(DEVICE),
            self.initial_slots.to(DEVICE),
            self.node_slots.to(DEVICE),
        )
        if fn is tree_gated_delta_rule_triton:
            args = args + (self.start_loc.to(DEVICE),)
        return fn(*args), state


IMPLS = [tree_gated_delta_rule_reference, tree_gated_delta_rule_triton]


@pytest.mark.parametrize("fn", IMPLS, ids=["reference", "triton"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_node_equals_its_root_path_run_as_a_chain(fn, seed):
    case = Case(seed=seed)
    out, state = case.run(fn)
    for i in range(sum(case.sizes)):
        want_out, want_state = case.chain(i)
        torch.testing.assert_close(
            out[i].cpu().double(), want_out, atol=2e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            state[case.node_slots[i]].cpu().double(), want_state, atol=2e-5, rtol=1e-4
        )
    # The committed states are read, never overwritten (roots write elsewhere).
    committed = case.conv_slots.unique()
    torch.testing.assert_close(state[committed].cpu(), case.state[committed])


def test_the_oracle_sees_a_parent_taken_from_the_previous_row():
    """Mutation: each row continuing the previous row's state (a chain over the
    rows) and its conv window along the rows both differ from the oracle on
    branching rows: the comparison above can fail."""
    case = Case(seed=0)
    chain_parents = torch.where(
        case.parents < 0, -1, torch.arange(len(case.parents)) - 1
    )
    out, _ = case.run(tree_gated_delta_rule_reference, parents=chain_parents)
    branching = [
        i
        for i in range(sum(case.sizes))
        if case.parents[i] >= 0 and case.parents[i] != i - 1
    ]
    assert len(branching) >= 5
    worst = max(
        (out[i].cpu().double() - case.chain(i)[0]).abs().max() for i in branching
    )
    assert worst > 1e-2


def test_triton_equals_reference_with_a_bf16_state_in_vk_layout():
    """vLLM's Triton GDN kernels keep ``h[v, k]``: the kernel reads and writes a
    transposed view; node states are stored (and re-read) in bfloat16."""
    case = Case(sizes=(9, 5), kd=32, vd=32, seed=3)
    outs, states = [], []
    for fn in IMPLS:
        vk = case.state.to(DEVICE, torch.bfloat16).transpose(-1, -2).contiguous()
        out, _ = case.run(fn, state=vk.transpose(-1, -2), dtype=torch.bfloat16)
        outs.append(out.float().cpu())
        states.append(vk.float().cpu())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(states[0], states[1], atol=2e-2, rtol=2e-2)


def test_reference_on_chains_equals_vllms_cpu_decode_kernel():
    """Token by token on chains (bf16, head size 128 as the CPU kernel needs),
    vLLM's fused CPU decode kernel and the reference agree: same gating, same
    ``h[k, v]`` state layout."""
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_cpu"):
        pytest.skip("vLLM's CPU GDN kernels are not built here")
    g = torch.Generator().manual_seed(5)
    steps, reqs, h, hv, kd = 4, 2, 1, 2, 128
    q = torch.randn(steps, reqs, h, kd, generator=g).bfloat16()
    k = torch.randn(steps, reqs, h, kd, generator=g).bfloat16()
    v = torch.randn(steps, reqs, hv, kd, generator=g).bfloat16()
    a = torch.randn(steps, reqs, hv, generator=g).bfloat16()
    b = torch.randn(steps, reqs, hv, generator=g).bfloat16()
    A_log = (torch.randn(hv, generator=g) * 0.5).bfloat16()
    dt_bias = (torch.randn(hv, generator=g) * 0.5).bfloat16()
    init = (torch.randn(reqs + 1, hv, kd, kd, generator=g) * 0.3).bfloat16()
    theirs, ours = init.clone(), init.clone()
    slots = torch.arange(1, reqs + 1)
    for t in range(steps):
        want = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log,
            dt_bias,
            q[t][None],
            k[t][None],
            v[t][None],
            a[t],
            b[t],
            theirs,
            slots.to(torch.int32),
            torch.arange(reqs + 1, dtype=torch.int32),
            True,
        ).reshape(reqs, hv, kd)
        got = tree_gated_delta_rule_reference(
            q[t],
            k[t],
            v[t],
            a[t],
            b[t],
            A_log,
            dt_bias,
            ours,
            torch.full((reqs,), -1),
            slots,
            slots,
        )
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=3e-2, rtol=3e-2)
    assert not torch.equal(ours, init)
