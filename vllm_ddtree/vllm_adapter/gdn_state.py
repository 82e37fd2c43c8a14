# SPDX-License-Identifier: Apache-2.0
"""Gated DeltaNet layers of hybrid targets (Qwen3-Next) in DDTree's verify pass.

vLLM's GDN layers keep, per request, a conv state (the last ``W - 1`` inputs)
and a recurrent state in the mamba cache. With speculative decoding configured,
a request owns ``1 + num_speculative_tokens`` state slots (its block-table
columns) and the conv slot of column 0 is ``W - 1 + num_spec`` inputs wide.
vLLM's own chain path rolls that wide buffer and resumes from the slot of the
last accepted position; a tree has no such linear order.

In a ddtree engine (:func:`install` marks its GDN layers), every speculative
sequence of a GDN layer is a draft tree (CPU: :func:`tree_spec_forward` for
vLLM's ``_spec_forward``; CUDA: ``gpu_gdn.tree_forward_core``), with one layout
between steps, the one vLLM's non-speculative paths (prefill chunks) read and
write: conv inputs in columns ``0 .. W - 2`` of column 0's conv slot, the state
in column 0's slot.

* Verify forward: tree row ``i`` of a request takes its conv window along its
  root path (``ops.tree_gdn.tree_conv_windows``) and its recurrence from its
  parent's state; its post-state goes to the request's state column ``i`` (the
  root's to column 0, which it has just read). On the CPU both are the decode
  kernels of vLLM's non-speculative path (so a row computes bit for bit what
  a non-speculative engine decoding its path computes: on AVX-512-BF16 CPUs
  without AMX, vLLM's speculative paths take another conv, which rounds
  differently). The root is always committed, so its input is appended to the
  conv state at once. A request without drafts is a one-row tree.
* Prompt chunks (CPU, :func:`nonspec_forward`): vLLM's non-speculative path
  computes them, for the same reason.
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

from dataclasses import dataclass, replace

import torch

from vllm_ddtree.ops.tree_gdn import tree_conv_windows, tree_depths

__all__ = [
    "RecurrentStateStash",
    "TREE_STATE_ATTR",
    "TreeSlots",
    "append_root_inputs",
    "cpp_conv",
    "install",
    "is_gdn_layer",
    "nonspec_forward",
    "stash_for_commit",
    "tree_parents",
    "tree_slots",
    "tree_spec_forward",
]

TREE_STATE_ATTR = "ddtree_tree_state"


def is_gdn_layer(module) -> bool:
    from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention

    return isinstance(module, GatedDeltaNetAttention)


def install(model) -> int:
    """Puts the GDN layers of a loaded ddtree target on the tree path; returns
    how many. vLLM's GDN code branches on the mark (:data:`TREE_STATE_ATTR`):
    its CPU ``_spec_forward`` runs :func:`tree_spec_forward`, its CUDA
    ``_forward_core`` ``gpu_gdn.tree_forward_core``. The mark is per layer, so
    other engines in the process keep vLLM's path. vLLM's fused CUDA spec
    decode verifies chains only: off for these layers."""
    layers = [m for m in model.modules() if is_gdn_layer(m)]
    for layer in layers:
        setattr(layer, TREE_STATE_ATTR, True)
        layer.enable_fused_gdn_spec_decode = False
    return len(layers)


def tree_parents(visibility: torch.Tensor) -> torch.Tensor:
    """[T] parent of each node of a tree given by its ancestor-or-self mask
    ``[T, T]`` (parents precede children: the parent is the last ancestor)."""
    t = visibility.shape[0]
    lower = torch.tril(visibility.to(torch.bool), diagonal=-1)
    index = torch.arange(t).expand(t, t)
    return torch.where(lower, index, -1).max(dim=1).values


@dataclass
class TreeSlots:
    """A GDN group's spec rows in one verify forward, shared by its layers.

    vLLM's GDN metadata orders the spec rows sequence after sequence (its
    ``spec_query_start_loc``); a sequence is a request that verifies drafts, and
    a ddtree request's rows are its tree (a request without drafts is a
    one-row tree). Tensors live on the cache's device."""

    parents: torch.Tensor  # [M] int64 packed row of each row's parent, -1 roots
    node_slots: torch.Tensor  # [M] int64 state slot of each row (its column)
    conv_slots: torch.Tensor  # [M] int64 column-0 slot of its request
    start_loc: torch.Tensor  # [S + 1] int64 packed row offsets of the sequences
    # [M] batch row of each spec row (None: spec rows are the batch rows).
    token_rows: torch.Tensor | None
    num_tokens: int  # rows of the batch
    _row_index: torch.Tensor | None = None
    _levels: list[torch.Tensor] | None = None

    def levels(self) -> list[torch.Tensor]:
        """(host) the rows of every depth, root level first (the CPU path's
        decode calls; computed once per forward)."""
        if self._levels is None:
            depth = tree_depths(self.parents.cpu())
            self._levels = [
                torch.nonzero(depth == d).squeeze(1)
                for d in range(int(depth.max()) + 1 if depth.numel() else 0)
            ]
        return self._levels

    def row_index(self) -> torch.Tensor:
        """[num_tokens] (host) spec row of every batch row, -1 if none; read
        once per forward, at the commit."""
        if self._row_index is None:
            index = torch.full((self.num_tokens,), -1, dtype=torch.int64)
            m = self.parents.numel()
            if self.token_rows is None:
                index[:m] = torch.arange(m)
            else:
                index[self.token_rows.cpu().to(torch.int64)] = torch.arange(m)
            self._row_index = index
        return self._row_index


def tree_slots(attn_metadata, device) -> TreeSlots:
    """The :class:`TreeSlots` of ``attn_metadata`` (cached in its tree batch:
    every layer of the group reads the same). The trees come from host data
    only (the tree batch, vLLM's host copy of the spec-sequence mask), copied to
    ``device`` once."""
    batch = getattr(attn_metadata, "tree", None)
    key = ("gdn", id(attn_metadata))
    if batch is not None and key in batch._plans:
        return batch._plans[key]
    trees = {r.req_index: r for r in batch.requests} if batch is not None else {}
    num_spec = attn_metadata.num_spec_decodes
    masks = getattr(attn_metadata, "spec_sequence_masks_cpu", None)
    reqs = (
        torch.nonzero(masks).squeeze(1).tolist()
        if masks is not None
        else list(range(num_spec))
    )[:num_spec]
    parents, owner, columns, lengths = [], [], [], []
    start = 0
    for k, b in enumerate(reqs):
        tree = trees.get(b)
        if tree is None:
            local = torch.tensor([-1])
        else:
            if tree.row_offset != 0:
                raise AssertionError(
                    f"ddtree: GDN spec sequence {b}: its tree must be its whole query"
                )
            local = tree_parents(tree.visibility)
        q = local.numel()
        parents.append(torch.where(local >= 0, local + start, -1))
        owner.append(torch.full((q,), k))
        columns.append(torch.arange(q))
        lengths.append(q)
        start += q
    empty = torch.empty(0, dtype=torch.int64)
    host = [torch.cat(t) if t else empty for t in (parents, owner, columns)]
    host.append(torch.tensor([0, *lengths]).cumsum(0))
    if torch.device(device).type == "cuda":
        host = [t.pin_memory() for t in host]
    parents, owner, columns, start_loc = (t.to(device, non_blocking=True) for t in host)
    indices = attn_metadata.spec_state_indices_tensor.to(device, torch.int64)
    slots = TreeSlots(
        parents=parents,
        node_slots=indices[owner, columns],
        conv_slots=indices[owner, 0],
        start_loc=start_loc,
        token_rows=attn_metadata.spec_token_indx,
        num_tokens=getattr(attn_metadata, "num_actual_tokens", start),
    )
    if batch is not None:
        batch._plans[key] = slots
    return slots


@dataclass
class RecurrentStateStash:
    """One GDN layer's inputs and slots of a verify forward, for the commit."""

    conv_buf: torch.Tensor  # [num_slots, D, S] the conv cache (a view)
    ssm_state: torch.Tensor  # [num_slots, HV, K, V] the state cache (a view)
    width: int  # conv kernel size W
    slots: TreeSlots  # the forward's spec rows and their slots
    inputs: torch.Tensor  # [M, D] conv inputs of the spec rows

    def commit(self, paths: torch.Tensor, num_committed: torch.Tensor) -> None:
        """Makes the accepted paths the committed state: one gather / scatter
        for the states and one for the conv windows, whatever the batch.

        Args:
            paths: [R, L] (host) batch rows of each request's accepted nodes at
                depths 1 .. L (``CommitPlan.src_rows`` per request; the root,
                committed by the forward, is not listed).
            num_committed: [R] (host) path lengths (accepted drafts + 1).
        """
        moved = num_committed > 1  # the root alone: committed by the forward
        if not bool(moved.any()):
            return
        device = self.inputs.device
        keep = self.width - 1
        lengths = num_committed[moved].to(torch.int64) - 1  # [C] nodes after the root
        depth = torch.arange(paths.shape[1])
        # [C, L] spec rows of the path (past its end: its last node, never read)
        rows = self.slots.row_index()[
            torch.where(depth < lengths[:, None], paths[moved], paths[moved, :1])
            .to(torch.int64)
            .clamp(min=0)
        ]
        if bool((rows < 0).any()):
            raise IndexError("commit: an accepted node is not a GDN spec row")
        last = rows.gather(1, (lengths - 1)[:, None]).squeeze(1)
        rows, last = rows.to(device), last.to(device)
        slots = self.slots.conv_slots[rows[:, 0]]  # [C]
        self.ssm_state[slots] = self.ssm_state[self.slots.node_slots[last]]
        # The conv state: the last W - 1 of (committed inputs, path inputs).
        window = self.conv_buf[slots, :, :keep]  # [C, D, W - 1]
        path_inputs = self.inputs[rows].transpose(1, 2).to(window.dtype)  # [C, D, L]
        joined = torch.cat([window, path_inputs], dim=2)
        take = lengths.to(device)[:, None] + torch.arange(keep, device=device)
        self.conv_buf[slots, :, :keep] = joined.gather(
            2, take[:, None, :].expand(-1, joined.shape[1], -1)
        )


def stash_for_commit(layer, attn_metadata, slots, inputs, conv_buf, ssm_state):
    """Keeps a layer's spec rows for :meth:`RecurrentStateStash.commit` (when
    the tree batch commits)."""
    batch = getattr(attn_metadata, "tree", None)
    if batch is None or not batch.stash_kv or not batch.requests:
        return
    batch.recurrent_stash[layer.prefix] = RecurrentStateStash(
        conv_buf=conv_buf,
        ssm_state=ssm_state,
        width=layer.conv1d.weight.shape[-1],
        slots=slots,
        inputs=inputs,
    )


def append_root_inputs(x, conv_buf, slots: TreeSlots, width: int) -> None:
    """The roots are committed whatever is accepted: their inputs join the
    conv state (call after every window has been read)."""
    keep = width - 1
    roots = slots.start_loc[:-1]
    root_slots = slots.conv_slots[roots]
    window = conv_buf[root_slots, :, 1:keep]
    conv_buf[root_slots, :, :keep] = torch.cat(
        [window, x[roots, :, None].to(window.dtype)], dim=2
    )


def cpp_conv() -> bool:
    """Whether vLLM's non-speculative CPU GDN path runs its C++ conv kernels
    (``_cpu_gdn_attention_nonspec``'s ``use_cpp_conv``: any AVX-512-BF16 or
    bf16 aarch64 CPU, the CPUs where the conv weight is packed at load). Its
    speculative paths take them on AMX only, and the two convs round
    differently (the C++ one accumulates in VDPBF16PS), so a ddtree engine
    follows this predicate, not theirs."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    return torch.cpu._is_avx512_bf16_supported() or cpu_gdn.is_arm_bf16()


def _decode_conv(layer, x, windows):
    """vLLM's CPU decode conv (the kernel its non-speculative decodes run) on
    one window per row; the windows are scratch."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    # Slot 0 is vLLM's null block (skipped by the kernels): rows use 1 .. M.
    windows = torch.cat([windows[:1], windows])
    slots = torch.arange(1, x.shape[0] + 1, dtype=torch.int32)
    if cpp_conv():
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


def nonspec_forward(layer, attn_metadata, mixed_qkv, b, a, core_attn_out=None):
    """The non-speculative rows (prompt chunks: a speculative engine counts
    every decode as a speculative sequence) of a marked layer, computed by
    vLLM's non-speculative CPU GDN path, so a ddtree engine's prompts leave the
    states and outputs a non-speculative engine's leave.

    Args:
        attn_metadata: the layer's GDN metadata.
        mixed_qkv, b, a: the non-speculative rows only, in
            ``non_spec_query_start_loc`` order (vLLM's builder counts a
            speculative batch's non-speculative rows as prefills).
        core_attn_out: [N, HV, V] the rows' output (None: a new tensor).

    Returns:
        The output, or None (the caller runs vLLM's speculative-engine code)
        where both paths run the same kernels.
    """
    if not cpp_conv():
        return None
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    if core_attn_out is None:
        heads, v_dim = layer.kv_cache[1].shape[1:3]  # [slots, HV, V, K]
        core_attn_out = mixed_qkv.new_zeros(mixed_qkv.shape[0], heads, v_dim)
    # vLLM's C++ convs read and write the first W - 1 columns of the wide conv
    # slots of a speculative engine, as they do a non-speculative engine's. The
    # slots are column 0 of a speculative engine's wider block table.
    slots = attn_metadata.non_spec_state_indices_tensor.contiguous()
    cpu_gdn._cpu_gdn_attention_nonspec(
        layer,
        replace(
            attn_metadata,
            non_spec_state_indices_tensor=slots,
            spec_sequence_masks=None,
            num_accepted_tokens=None,
        ),
        mixed_qkv,
        b,
        a,
        core_attn_out,
    )
    return core_attn_out


def tree_spec_forward(layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm_state):
    """vLLM's ``_spec_forward`` contract: the GDN core outputs of the spec
    tokens (in ``spec_query_start_loc`` order), caches updated.

    Every row is a decode of its root path with vLLM's own CPU decode kernels
    (the conv on the row's window, the fused gated delta rule on a state slot),
    one depth level at a time, so a tree row computes bit for bit what decoding
    its path computes. Row ``i``'s slot starts as a copy of its parent's."""
    from vllm import _custom_ops as ops

    slots = tree_slots(attn_metadata, mixed_qkv.device)
    parents, node_slots = slots.parents, slots.node_slots
    qsl = attn_metadata.spec_query_start_loc[: attn_metadata.num_spec_decodes + 1]
    if not torch.equal(slots.start_loc, qsl.to(torch.int64)):
        raise AssertionError(
            f"ddtree: GDN spec sequences {qsl.tolist()} are not the trees "
            f"{slots.start_loc.tolist()} (each tree must be its request's query)"
        )
    width = layer.conv1d.weight.shape[-1]
    windows = tree_conv_windows(mixed_qkv, conv_buf, slots.conv_slots, parents, width)
    conv_out = _decode_conv(layer, mixed_qkv, windows)
    append_root_inputs(mixed_qkv, conv_buf, slots, width)

    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    out = torch.empty_like(value[0])  # [M, HV, V]
    for level, rows in enumerate(slots.levels()):
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
    stash_for_commit(layer, attn_metadata, slots, mixed_qkv, conv_buf, ssm_state)
    return out
