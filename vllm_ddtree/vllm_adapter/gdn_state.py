# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet layers of hybrid targets (Qwen3-Next) in DDTree's verify pass.

vLLM's GDN layers keep, per request, a conv state (the last ``W - 1`` inputs)
and a recurrent state in the mamba cache. With speculative decoding configured,
a request owns ``1 + num_speculative_tokens`` state slots (its block-table
columns) and the conv slot of column 0 is ``W - 1 + num_spec`` inputs wide.
vLLM's own chain path rolls that wide buffer and resumes from the slot of the
last accepted position; a tree has no such linear order.

In a ddtree engine (:func:`install`), every speculative sequence of a GDN layer
runs here instead (CPU: vLLM's ``_spec_forward``), with one layout between
steps, the one vLLM's non-speculative paths (prefill chunks) read and write:
conv inputs in columns ``0 .. W - 2`` of column 0's conv slot, the state in
column 0's slot.

* Verify forward: tree row ``i`` of a request takes its conv window along its
  root path (``ops.tree_gdn.tree_conv_windows``) and its recurrence from its
  parent's state, with vLLM's own CPU decode kernels; its post-state goes to the
  request's state column ``i`` (the root's to column 0, which it has just
  read). The root is always
  committed, so its input is appended to the conv state at once. A request
  without drafts is a one-row tree.
* Commit (:meth:`RecurrentStateStash.commit`): for an accepted path of ``n``
  nodes, column 0's state becomes that of its last node and the conv state gets
  the path's inputs after the root. Rejected branches leave nothing behind
  (their states sit in columns the next step overwrites).

Memory: vLLM allocates the ``1 + B`` state slots per request and layer itself
(``num_speculative_tokens = B``) and counts them in its KV-cache budget; a tree
of ``T <= B + 1`` nodes uses ``T`` of them, each ``HV * K * V`` state elements
(plus the conv slot vLLM allocates beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.ops.tree_gdn import tree_conv_windows, tree_depths

__all__ = ["RecurrentStateStash", "install", "is_gdn_layer", "tree_parents"]

_TAG = "_ddtree_tree_state"


def is_gdn_layer(module) -> bool:
    from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention

    return isinstance(module, GatedDeltaNetAttention)


def install(model) -> int:
    """Puts the GDN layers of a loaded ddtree target on the tree path; returns
    how many. Other engines in the process keep vLLM's path (the tag is per
    layer)."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    layers = [m for m in model.modules() if is_gdn_layer(m)]
    for layer in layers:
        setattr(layer, _TAG, True)
    if layers and not getattr(gdn_attention._spec_forward, "_ddtree", False):
        stock = gdn_attention._spec_forward

        def spec_forward(layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm, *args):
            if not getattr(layer, _TAG, False):
                return stock(
                    layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm, *args
                )
            return _tree_forward(layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm)

        spec_forward._ddtree = True
        gdn_attention._spec_forward = spec_forward
    return len(layers)


def tree_parents(visibility: torch.Tensor) -> torch.Tensor:
    """[T] parent of each node of a tree given by its ancestor-or-self mask
    ``[T, T]`` (parents precede children: the parent is the last ancestor)."""
    t = visibility.shape[0]
    lower = torch.tril(visibility.to(torch.bool), diagonal=-1)
    index = torch.arange(t).expand(t, t)
    return torch.where(lower, index, -1).max(dim=1).values


@dataclass
class RecurrentStateStash:
    """One GDN layer's inputs and slots of a verify forward, for the commit."""

    conv_buf: torch.Tensor  # [num_slots, D, S] the conv cache (a view)
    ssm_state: torch.Tensor  # [num_slots, HV, K, V] the state cache (a view)
    width: int  # conv kernel size W
    # [num_tokens] position in ``inputs`` of each batch row, -1 if not a spec row.
    row_index: torch.Tensor
    inputs: torch.Tensor  # [M, D] conv inputs of the spec rows
    node_slots: torch.Tensor  # [M] state slot of each spec row
    conv_slots: torch.Tensor  # [M] conv (and committed-state) slot of its request

    def commit(self, paths: torch.Tensor, num_committed: torch.Tensor) -> None:
        """Makes the accepted paths the committed state.

        Args:
            paths: [R, L] batch rows of each request's accepted nodes at depths
                1 .. L (``CommitPlan.src_rows`` per request; the root, committed
                by the forward, is not listed).
            num_committed: [R] path lengths (accepted drafts + 1).
        """
        keep = self.width - 1
        for path, n in zip(paths.tolist(), num_committed.tolist(), strict=True):
            if n < 2:
                continue  # the root alone: committed by the forward
            rows = self.row_index[torch.tensor(path[: n - 1])]
            slot = int(self.conv_slots[rows[0]])
            self.ssm_state[slot] = self.ssm_state[int(self.node_slots[rows[-1]])]
            window = self.conv_buf[slot, :, :keep]
            appended = torch.cat([window, self.inputs[rows].T.to(window.dtype)], 1)
            window.copy_(appended[:, -keep:])


def _sequence_trees(attn_metadata, num_spec: int):
    """Per spec token: parent (packed index, -1 for roots) and state column."""
    batch = getattr(attn_metadata, "tree", None)
    trees = {r.req_index: r for r in batch.requests} if batch is not None else {}
    qsl = attn_metadata.spec_query_start_loc[: num_spec + 1].tolist()
    masks = attn_metadata.spec_sequence_masks
    reqs = (
        torch.nonzero(masks).squeeze(1).tolist()
        if masks is not None
        else list(range(num_spec))
    )
    parents, columns = [], []
    for k, b in enumerate(reqs):
        start, q = qsl[k], qsl[k + 1] - qsl[k]
        tree = trees.get(b)
        if tree is None:
            if q > 1:
                raise AssertionError(
                    f"ddtree: GDN spec sequence {b} has {q} rows but no tree"
                )
            local = torch.tensor([-1] * q)
        else:
            if tree.row_offset != 0 or tree.num_rows != q:
                raise AssertionError(
                    f"ddtree: GDN spec sequence {b}: its tree must be its whole query"
                )
            local = tree_parents(tree.visibility)
        parents.append(torch.where(local >= 0, local + start, -1))
        columns.append(torch.arange(q))
    return reqs, torch.cat(parents), torch.cat(columns), batch


def _decode_conv(layer, x, windows):
    """vLLM's CPU decode conv (the kernel its non-speculative decodes run) on
    one window per row; the windows are scratch."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    # Slot 0 is vLLM's null block (skipped by the kernels): rows use 1 .. M.
    windows = torch.cat([windows[:1], windows])
    slots = torch.arange(1, x.shape[0] + 1, dtype=torch.int32)
    if torch.cpu._is_amx_tile_supported() or cpu_gdn.is_arm_bf16():
        return cpu_gdn._causal_conv1d_update_cpu(
            x=x,
            conv_states=windows,
            weight=layer.conv1d.weight,
            bias=layer.conv1d.bias,
            silu_activation=layer.activation == "silu",
            conv_state_indices=slots,
            is_weight_packed=True,
        )
    return cpu_gdn.causal_conv1d_update_cpu(
        x=x,
        conv_state=windows,
        weight=cpu_gdn._unpacked_conv_weight(layer),
        bias=layer.conv1d.bias,
        activation=layer.activation,
        conv_state_indices=slots,
    )


def _tree_forward(layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm_state):
    """vLLM's ``_spec_forward`` contract: the GDN core outputs of the spec
    tokens (in ``spec_query_start_loc`` order), caches updated.

    Every row is a decode of its root path with vLLM's own CPU decode kernels
    (the conv on the row's window, the fused gated delta rule on a state slot),
    one depth level at a time, so a tree row computes bit for bit what decoding
    its path computes. Row ``i``'s slot starts as a copy of its parent's."""
    from vllm import _custom_ops as ops

    num_spec = attn_metadata.num_spec_decodes
    reqs, parents, columns, batch = _sequence_trees(attn_metadata, num_spec)
    qsl = attn_metadata.spec_query_start_loc[: num_spec + 1]
    owner = torch.repeat_interleave(torch.arange(num_spec), qsl.diff().cpu())
    indices = attn_metadata.spec_state_indices_tensor[:num_spec].to(torch.int64).cpu()
    node_slots = indices[owner, columns]
    conv_slots = indices[owner, 0]
    width = layer.conv1d.weight.shape[-1]
    keep = width - 1

    windows = tree_conv_windows(mixed_qkv, conv_buf, conv_slots, parents, width)
    conv_out = _decode_conv(layer, mixed_qkv, windows)
    # The roots are committed whatever is accepted: their inputs join the
    # conv state now (after every window has been read).
    for root in torch.nonzero(parents < 0).squeeze(1).tolist():
        window = conv_buf[int(conv_slots[root]), :, :keep]
        x_root = mixed_qkv[root, :, None].to(window.dtype)
        window.copy_(torch.cat([window[:, 1:], x_root], dim=1))

    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    out = torch.empty_like(value[0])  # [M, HV, V]
    depth = tree_depths(parents)
    for level in range(int(depth.max()) + 1):
        rows = torch.nonzero(depth == level).squeeze(1)
        if level > 0:
            ssm_state[node_slots[rows]] = ssm_state[node_slots[parents[rows]]]
        level_out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=layer.A_log,
            dt_bias=layer.dt_bias,
            q=query[:, rows],
            k=key[:, rows],
            v=value[:, rows],
            a=a[rows],
            b=b[rows],
            initial_state_source=ssm_state,
            initial_state_indices=node_slots[rows].to(torch.int32),
            cu_seqlens=torch.arange(rows.numel() + 1, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True,
        )
        out[rows] = level_out.squeeze(1)
    if batch is not None and batch.stash_kv and batch.requests:
        token_rows = attn_metadata.spec_token_indx
        if token_rows is None:
            token_rows = torch.arange(mixed_qkv.shape[0])
        row_index = torch.full((int(token_rows.max()) + 1,), -1, dtype=torch.int64)
        row_index[token_rows.to(torch.int64)] = torch.arange(token_rows.numel())
        batch.recurrent_stash[layer.prefix] = RecurrentStateStash(
            conv_buf=conv_buf,
            ssm_state=ssm_state,
            width=width,
            row_index=row_index,
            inputs=mixed_qkv,
            node_slots=node_slots,
            conv_slots=conv_slots,
        )
    return out
