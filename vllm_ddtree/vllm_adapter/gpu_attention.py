# SPDX-License-Identifier: Apache-2.0
"""TRITON_ATTN with ancestor-only attention for DDTree's tree-verify forward (GPU).

``DDTreeTritonAttentionBackend`` replaces vLLM's ``TRITON_ATTN`` (same name,
metadata and KV-cache write). Only when the layer's attention metadata carries a
tree-attention batch (``metadata.tree``, the target's verify forward;
``attn_context``) and only for decoder self-attention layers, the rows of every
listed tree block attend to the committed prefix and to their own ancestors. Every
other row (prefill, plain decode, the drafter's pass, requests without drafts) is
the stock kernel's output.

Two ways, chosen per KV-cache group by the builder:

* **One pass** (groups without a sliding window, where TRITON_ATTN takes a
  per-sequence query-query bias: vLLM with the series' kernel change): the
  builder puts the trees into the metadata as ``qq_bias`` [n, Q, Q] (0 or -inf)
  and ``qq_bias_seq_offsets``, and the batch's own ``unified_attention`` call
  attends ancestor-only, with its own tiling and head sizes. Small tree batches
  (a 2D grid that would under-fill the GPU) split over KV: the builder gives
  them softmax scratch for every query row (the stock scratch has one row per
  decode sequence), and the kernel then takes its 3D path.
* **Recompute** (windowed groups, and vLLM 0.32, whose kernel has one bias for
  the whole batch): the stock call attends the batch, then
  ``ops.tree_attention.tree_attention_triton`` recomputes the tree rows over the
  paged cache, the window counted by node depth (a node at depth d sits at
  position prefix + d; the stock kernel counts linear rows), sinks and softcap.

The per-forward :class:`TreeRowsPlan` (device tensors: the tree rows' batch rows,
prefix and tree lengths, packed masks, block-table rows, the bias) is built once
from the host-side batch and reused by every layer, with no host synchronization.

For the commit, each layer records its cache and its group's slot mapping
(:class:`PagedCacheStash`): accepted K/V are moved inside the paged cache, one
launch of ``ops.kv_commit.commit_kv_triton`` per KV-cache group.

Status: tested on CPU (Triton under ``TRITON_INTERPRET=1``: our kernels, and vLLM's
unified attention kernel with the series' edit, over caches allocated by vLLM's
own ``create_kv_cache_views``); not yet run on a GPU. ddtree refuses CUDA at config
time unless the user opts in (:func:`vllm_ddtree.vllm_adapter.checks.gpu_opted_in`);
the runner's :class:`~vllm_ddtree.vllm_adapter.runner.DDTreeVerifier` then
registers this backend before the model is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.triton_attn import (
    MIN_LAUNCH_GRID_SIZE_2D,
    NUM_PAR_SOFTMAX_SEGMENTS,
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.ops.kv_commit import commit_kv_triton
from vllm_ddtree.ops.tree_attention import (
    tree_attention_launcher,
    tree_attention_tiles,
    tree_attention_triton,
)
from vllm_ddtree.tree import pack_visibility
from vllm_ddtree.vllm_adapter import attn_context

__all__ = [
    "DDTreeTritonAttentionBackend",
    "DDTreeTritonAttentionImpl",
    "DDTreeTritonAttentionMetadataBuilder",
    "PagedCacheStash",
    "TreeRowsPlan",
    "paged_kv_view",
    "register_gpu_tree_attention_backend",
]

BACKEND_PATH = f"{__name__}.DDTreeTritonAttentionBackend"
# Whether TRITON_ATTN adds a query-query bias per sequence (vLLM with the
# "per-sequence query-query bias" kernel change); vLLM 0.32 itself does not.
PER_SEQUENCE_QQ_BIAS = "qq_bias_seq_offsets" in getattr(
    TritonAttentionMetadata, "__dataclass_fields__", {}
)
_UNQUANTIZED_KV = ("auto", "float16", "bfloat16")


@dataclass
class PagedCacheStash:
    """One attention layer's paged cache, for the in-cache commit.

    Nothing is copied: the forward already wrote every tree row's K/V to its slot,
    so the commit moves entries inside the caches.
    """

    # [2, num_blocks, block_size, Hkv, D] view of the layer's cache (K, V).
    kv_cache: torch.Tensor
    # [num_tokens] the forward's cache slot of every batch row.
    slot_mapping: torch.Tensor
    # [M] batch row of every tree row (tree-row order).
    batch_rows: torch.Tensor

    @classmethod
    def commit_all(
        cls,
        batch: attn_context.TreeAttentionBatch,
        moves: tuple[torch.Tensor, torch.Tensor],
        row_space: str,
    ) -> int:
        """``TreeAttentionBatch.commit_kv`` for paged stashes: one launch per
        KV-cache group (its layers share a slot mapping; groups, e.g. the
        sliding-window and full layers of gpt-oss, do not), no host sync.
        Returns the number of moves passed (the kernel skips self-moves)."""
        groups: dict[int, list[PagedCacheStash]] = {}
        for stash in batch.stash.values():
            groups.setdefault(id(stash.slot_mapping), []).append(stash)
        first = next(iter(groups.values()))[0]
        device = first.slot_mapping.device
        src, dst = (
            torch.as_tensor(x, device=device).to(torch.int64).reshape(-1) for x in moves
        )
        if src.shape != dst.shape:
            raise ValueError(
                "src_rows and dst_rows differ in length: "
                f"{src.numel()} vs {dst.numel()}"
            )
        if row_space == "tree":
            # Tree rows -> batch rows: the same in every group's plan.
            src, dst = first.batch_rows[src], first.batch_rows[dst]
        for stashes in groups.values():
            slots = stashes[0].slot_mapping.to(torch.int64)
            commit_kv_triton([s.kv_cache for s in stashes], slots[src], slots[dst])
        return int(src.numel())


class TreeRowsPlan:
    """The listed tree blocks of one verify forward, as device tensors.

    M = total tree rows, n = listed requests, T = the largest tree block.
    """

    def __init__(
        self,
        batch: attn_context.TreeAttentionBatch,
        query_start_loc: torch.Tensor,
        block_table: torch.Tensor,
        requests: Sequence[attn_context.TreeRequest] | None = None,
    ) -> None:
        """Builds the plan (host work and two copies, once per forward).

        Args:
            batch: the runner's tree batch (at least one request).
            query_start_loc: [num_reqs + 1] the forward's query offsets (device).
            block_table: [num_reqs, max_blocks] the forward's block table (device).
            requests: the tree requests to plan (at least one; default: all of
                ``batch``'s).
        """
        device = query_start_loc.device
        reqs = batch.requests if requests is None else tuple(requests)
        sizes = [r.num_rows for r in reqs]
        max_rows = max(sizes)
        masks = torch.zeros(len(reqs), max_rows, max_rows, dtype=torch.bool)
        for k, r in enumerate(reqs):
            masks[k, : r.num_rows, : r.num_rows] = r.visibility
        starts = [0]
        for t in sizes:
            starts.append(starts[-1] + t)
        sizes_host = torch.tensor(sizes)
        # Row i of block k sits at batch row query_start_loc[req_index] +
        # row_offset + i; the offsets are host facts, the starts device ones.
        owner = torch.repeat_interleave(torch.arange(len(reqs)), sizes_host)
        offset = torch.cat([torch.arange(r.num_rows) + r.row_offset for r in reqs])
        # [n, T, ceil(T / 32)] int32 ancestor-or-self bits; [n, T] int32 node
        # depths (ancestors seen, minus one): a node's sequence position is
        # prefix_len + depth (for sliding windows).
        mask_bits = pack_visibility(masks)
        depths = (masks.sum(-1) - 1).clamp(min=0).to(torch.int32)
        # Two copies per forward (one per dtype), pinned and non-blocking on a
        # GPU, instead of one pageable (blocking) copy per tensor.
        (
            self.req_index,  # [n]
            owner_dev,  # [M]
            offset_dev,  # [M]
            self.prefix_lens,  # [n]
            self.tree_lens,  # [n]
            self.tree_start_loc,  # [n + 1] in tree rows
            # [n] first tree row inside each request's query rows.
            self.row_offsets,
        ) = _to_device(
            [
                torch.tensor([r.req_index for r in reqs]),
                owner,
                offset,
                torch.tensor([r.prefix_len for r in reqs]),
                sizes_host,
                torch.tensor(starts),
                torch.tensor([r.row_offset for r in reqs]),
            ],
            torch.int64,
            device,
        )
        self.mask_bits, self.depths = _to_device(
            [mask_bits, depths], torch.int32, device
        )
        # [M] batch row of every tree row, in tree-row order.
        self.rows = (
            query_start_loc.to(torch.int64).index_select(0, self.req_index)[owner_dev]
            + offset_dev
        )
        # [n + 1] each tree block's first batch row, then the end of the last
        # tree request's rows: the tree kernel reads and writes a layer's own
        # query and output rows with it (no gather or scatter per layer).
        last = reqs[-1].req_index
        self.batch_query_start_loc = torch.cat(
            [
                query_start_loc.to(torch.int64).index_select(0, self.req_index)
                + self.row_offsets,
                query_start_loc[last + 1 : last + 2].to(torch.int64),
            ]
        )
        self.block_table = block_table.index_select(0, self.req_index)
        self.num_reqs = query_start_loc.shape[0] - 1
        # Layer kind -> the tree kernel's launch for this forward (checked and
        # built by the kind's first layer; the next ones only launch).
        self.launchers: dict[tuple, object] = {}
        # The largest query of a tree request (tree blocks end their requests'
        # rows).
        self.max_query_len = max(r.row_offset + r.num_rows for r in reqs)
        self.max_tree_rows = batch.max_tree_rows
        self._qq_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def qq_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The trees as TRITON_ATTN's per-sequence query-query bias (built on the
        device from the packed masks, once per forward).

        Returns:
            ``qq_bias`` [n, Q, Q] float32: 0 where a query row may see a query
            key, -inf where an ancestor mask hides it (rows and keys before a
            tree block stay causal), Q the largest tree request's query; and
            ``qq_bias_seq_offsets`` [num_reqs] int32: request ``req_index[k]``
            reads ``qq_bias[k]``, every other request none (-1).
        """
        if self._qq_bias is None:
            device = self.req_index.device
            n, q = self.req_index.shape[0], self.max_query_len
            t = self.mask_bits.shape[1]
            pos = torch.arange(q, device=device)
            node = pos[None, :] - self.row_offsets[:, None]  # [n, Q] tree node
            in_tree = (node >= 0) & (node < self.tree_lens[:, None])
            node = node.clamp(0, t - 1)
            # [n, Q, words] each query row's packed mask, then [n, Q, Q] its
            # bit for each query key.
            row_bits = self.mask_bits.gather(
                1, node[:, :, None].expand(-1, -1, self.mask_bits.shape[2])
            )
            words = row_bits.gather(2, (node // 32)[:, None, :].expand(-1, q, -1))
            visible = (words >> (node % 32)[:, None, :]) & 1
            hidden = in_tree[:, :, None] & in_tree[:, None, :] & (visible == 0)
            bias = torch.zeros(n, q, q, dtype=torch.float32, device=device)
            bias.masked_fill_(hidden, float("-inf"))
            offsets = torch.full(
                (self.num_reqs,), -1, dtype=torch.int32, device=device
            )
            offsets[self.req_index] = (
                torch.arange(n, dtype=torch.int32, device=device) * (q * q)
            )
            self._qq_bias = (bias, offsets)
        return self._qq_bias


def _to_device(
    tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """``tensors`` (host, any shapes) on ``device`` as ``dtype``: one copy of
    their concatenation (pinned and non-blocking on a GPU), split into views.

    Each view starts on a 16-byte boundary, as a tensor of its own would: the
    Triton kernels are specialised on their pointers' alignment, and views at
    offsets that follow the step's sizes would compile new variants mid-serving.
    """
    align = max(16 // torch.empty((), dtype=dtype).element_size(), 1)
    spans = [-(-t.numel() // align) * align for t in tensors]
    flat = torch.zeros(sum(spans), dtype=dtype, pin_memory=device.type == "cuda")
    start = 0
    for t, span in zip(tensors, spans, strict=True):
        flat[start : start + t.numel()] = t.reshape(-1)
        start += span
    flat = flat.to(device=device, non_blocking=True)
    return [
        part[: t.numel()].view(t.shape)
        for part, t in zip(flat.split(spans), tensors, strict=True)
    ]


def _plan(batch, metadata) -> TreeRowsPlan:
    key = ("gpu", id(metadata))
    entry = batch._plans.get(key)
    if entry is None or entry[0] is not metadata:
        entry = (
            metadata,
            TreeRowsPlan(batch, metadata.query_start_loc, metadata.block_table),
        )
        batch._plans[key] = entry
    return entry[1]


def paged_kv_view(
    kv_cache: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRITON_ATTN's ``[num_blocks, Hkv, block_size, 2 * D]`` cache as views:

    ``key_cache``, ``value_cache`` ``[num_blocks, block_size, Hkv, D]`` (what the
    tree-attention kernel reads) and ``kv`` ``[2, num_blocks, block_size, Hkv, D]``
    (what the commit kernel moves). No copy: vLLM's own kernel reads the same
    transpose and split.
    """
    by_slot = kv_cache.transpose(1, 2)  # [nb, bs, Hkv, 2D]
    key_cache, value_cache = by_slot.split(head_size, dim=-1)
    kv = by_slot.unflatten(-1, (2, head_size)).permute(3, 0, 1, 2, 4)
    return key_cache, value_cache, kv


class DDTreeTritonAttentionImpl(
    attn_context.TreeAttentionImplMixin, TritonAttentionImpl
):
    """TRITON_ATTN impl: with a tree in its metadata, tree rows attend ancestor-only."""

    BACKEND_NAME = "TRITON_ATTN"

    def tree_refusals(self) -> dict[str, bool]:
        # Query dtypes need no check: vLLM runs models in fp16, bf16 or fp32 only.
        # Fused output quantization is turned off for ddtree engines
        # (checks.gpu_compilation_settings); _check_tree_call asserts it per
        # forward. Sliding windows, sinks and softcap are honoured by the tree
        # kernel.
        head_size = self.head_size
        # The tree kernel that recomputes tree rows needs a power-of-two head
        # size; a one-pass layer (the trees as TRITON_ATTN's per-sequence bias)
        # takes any head size TRITON_ATTN takes.
        recomputes = self.recomputes_tree_rows
        return {
            "alibi": self.alibi_slopes is not None,
            f"kv cache dtype {self.kv_cache_dtype!r}": self.kv_cache_dtype
            not in _UNQUANTIZED_KV,
            "KV-cache sharing across layers": self.kv_sharing_target_layer_name
            is not None,
            f"head size {head_size} (needs a power of two)": recomputes
            and head_size & (head_size - 1) != 0,
        }

    @property
    def recomputes_tree_rows(self) -> bool:
        """Whether this layer's tree rows are recomputed by the tree kernel
        (stock vLLM 0.32, windowed layers) rather than attended in vLLM's one
        pass with the trees as a per-sequence query-query bias."""
        return not PER_SEQUENCE_QQ_BIAS or self.sliding_window[0] >= 0

    def _tree_forward(
        self, layer, query, key, value, kv_cache, metadata, output, batch
    ) -> None:
        plan = _plan(batch, metadata)
        key_cache, value_cache, kv = paged_kv_view(kv_cache, self.head_size)
        if getattr(metadata, "qq_bias_seq_offsets", None) is None:
            self._recompute_tree_rows(query, key_cache, value_cache, output, plan)
        elif self.sliding_window[0] >= 0:
            raise AssertionError(
                "DDTree tree attention: a windowed layer got the trees as a "
                "query-query bias (its group has no sliding window)"
            )
        # else: the stock call above attended ancestor-only (metadata.qq_bias).
        if batch.stash_kv:
            name = getattr(layer, "layer_name", None) or f"layer@{id(layer)}"
            batch.stash[name] = PagedCacheStash(
                kv_cache=kv, slot_mapping=metadata.slot_mapping, batch_rows=plan.rows
            )

    def _recompute_tree_rows(self, query, key_cache, value_cache, output, plan):
        """The tree rows again, ancestor-only, over the paged cache (the stock
        call attended them causally), read from and written to the layer's own
        query and output rows.

        Layers of one kind (heads, window, sinks, softcap, scale, cache layout)
        share the step's checks, tiles and argument list: the kind's first
        layer builds them, every other one only launches (a few microseconds of
        host time per layer)."""
        static = self.__dict__.get("_tree_kind")
        if static is None:
            static = self._tree_kind = (
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                self.sliding_window,
                self.sinks is None,
                self.logits_soft_cap,
                self.scale,
            )
        kind = (static, query.dtype, output.dtype, key_cache.stride())
        launch = plan.launchers.get(kind)
        if launch is not None:
            # The kernel reads pointers; the strides are the kind's first layer's.
            launch(query, key_cache, value_cache, output, self.sinks)
            return
        num_heads, head_size = self.num_heads, self.head_size
        q_all = query.view(query.shape[0], num_heads, head_size)
        out_all = output.view(output.shape[0], num_heads, -1)
        rows = plan.max_tree_rows or plan.mask_bits.shape[1]
        block_q, block_t = tree_attention_tiles(rows, num_heads, self.num_kv_heads)
        # TRITON_ATTN keeps a decoder window w as (w - 1, 0), none as (-1, -1).
        window = self.sliding_window[0] + 1
        softcap = float(self.logits_soft_cap or 0.0)
        common = dict(
            sliding_window=window,
            softcap=softcap,
            tree_depths=plan.depths,
            block_q=block_q,
            block_t=block_t,
        )
        if out_all.dtype != q_all.dtype:  # computed apart, then cast
            tree_out = tree_attention_triton(
                q_all.index_select(0, plan.rows),
                key_cache,
                value_cache,
                plan.block_table,
                plan.prefix_lens,
                plan.tree_lens,
                plan.tree_start_loc,
                plan.mask_bits,
                self.scale,
                sinks=self.sinks,
                **common,
            )
            out_all.index_copy_(0, plan.rows, tree_out.to(out_all.dtype))
            return
        layout = (
            plan.block_table,
            plan.prefix_lens,
            plan.tree_lens,
            plan.batch_query_start_loc,
            plan.mask_bits,
            self.scale,
        )
        # Checked once per step and kind: shapes, dtypes, devices.
        tree_attention_triton(
            q_all, key_cache, value_cache, *layout, sinks=self.sinks, out=out_all,
            **common,
        )
        plan.launchers[kind] = tree_attention_launcher(
            q_all, key_cache, value_cache, out_all, *layout,
            use_sinks=self.sinks is not None, **common,
        )


class DDTreeTritonAttentionMetadataBuilder(
    attn_context.TreeAttentionMetadataBuilderMixin, TritonAttentionMetadataBuilder
):
    """TRITON_ATTN's builder; a verify step's metadata carries its trees.

    For a layer group without a sliding window, and where TRITON_ATTN takes a
    per-sequence query-query bias, the metadata also carries the trees as that
    bias: the batch's own attention call is then the tree attention. (A window
    counts a query's position by its linear row, not by its node's depth, so
    windowed groups recompute their tree rows instead.)
    """

    def with_tree(self, metadata, batch: attn_context.TreeAttentionBatch):
        metadata = super().with_tree(metadata, batch)
        spec = self.kv_cache_spec
        if (
            PER_SEQUENCE_QQ_BIAS
            and getattr(spec, "sliding_window", None) is None
            and getattr(spec, "attention_chunk_size", None) is None
        ):
            plan = _plan(batch, metadata)
            metadata.qq_bias, metadata.qq_bias_seq_offsets = plan.qq_bias()
            scratch = self._split_kv_scratch()
            metadata.num_par_softmax_segments = NUM_PAR_SOFTMAX_SEGMENTS
            (
                metadata.softmax_segm_output,
                metadata.softmax_segm_max,
                metadata.softmax_segm_expsum,
            ) = scratch
        return metadata

    def _split_kv_scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Softmax scratch of the kernel's split-KV (3D) path for tree batches,
        allocated once: one row per query row, as many rows as leave the 2D
        grid under MIN_LAUNCH_GRID_SIZE_2D programs (the kernel's own rule for
        decodes; a larger batch runs 2D), and never fewer than the stock
        scratch. [rows, Hq, segments, D'] + 2 x [rows, Hq, segments] float32."""
        scratch = getattr(self, "_tree_softmax_scratch", None)
        if scratch is None:
            heads_q, heads_kv = self.num_heads_q, self.num_heads_kv
            per_kv = heads_q // heads_kv
            block_m = 16 if per_kv <= 16 else 1 << (per_kv - 1).bit_length()
            rows = max(
                self.softmax_segm_max.shape[0],
                MIN_LAUNCH_GRID_SIZE_2D * (block_m // per_kv) // heads_kv,
            )
            shape = (rows, heads_q, NUM_PAR_SOFTMAX_SEGMENTS)
            device = self.softmax_segm_max.device
            scratch = (
                torch.empty(
                    *shape,
                    self.softmax_segm_output.shape[-1],
                    dtype=torch.float32,
                    device=device,
                ),
                torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
            )
            self._tree_softmax_scratch = scratch
        return scratch


class DDTreeTritonAttentionBackend(TritonAttentionBackend):
    """``TRITON_ATTN`` (same name, metadata and KV write), DDTree-aware builder
    and impl."""

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_builder_cls() -> type[DDTreeTritonAttentionMetadataBuilder]:
        return DDTreeTritonAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[DDTreeTritonAttentionImpl]:
        return DDTreeTritonAttentionImpl


def register_gpu_tree_attention_backend() -> None:
    """Makes ``AttentionBackendEnum.TRITON_ATTN`` resolve to the DDTree backend.

    Idempotent; see :func:`attn_context.override_attention_backend`.
    """
    attn_context.override_attention_backend("TRITON_ATTN", BACKEND_PATH)


def warm_up_tree_kernels(forward_context: dict, max_tree_rows: int) -> int:
    """Launches, once each, the tree-attention and KV-commit kernel variants a
    verify step of this engine launches, so that Triton compiles them at
    start-up instead of in the first steps that need them (1-2 s each on a
    GPU: the auto budget would time the stall as the cost of drafting).

    Serving launches one variant per layer kind: the kernels' tiles come from
    the engine's largest tree (``max_tree_rows``, B + 1), and the arguments
    that change from step to step are not specialised on. Each launch here
    reads the layer's real cache (a chain of ``max_tree_rows`` rows over block
    0, into a scratch output) and moves slot 0 onto itself: nothing changes.

    Args:
        forward_context: layer name -> layer (vLLM's static forward context),
            the KV caches bound.
        max_tree_rows: the engine's largest tree, B + 1.

    Returns:
        The number of launches.
    """
    launches = 0
    seen: set[tuple] = set()
    commit_groups: dict[tuple, list[torch.Tensor]] = {}
    plans: dict[torch.device, TreeRowsPlan] = {}
    for layer in forward_context.values():
        impl = getattr(layer, "impl", None)
        kv_cache = getattr(layer, "kv_cache", None)
        if not isinstance(impl, DDTreeTritonAttentionImpl) or kv_cache is None:
            continue
        if kv_cache.numel() == 0:
            continue
        key_cache, value_cache, kv = paged_kv_view(kv_cache, impl.head_size)
        commit_groups.setdefault((kv.dtype, kv.stride(), kv.device), []).append(kv)
        if not impl.recomputes_tree_rows:
            continue
        variant = (
            kv_cache.dtype,
            kv_cache.stride(),
            impl.num_heads,
            impl.num_kv_heads,
            impl.head_size,
            impl.sliding_window,
            impl.sinks is not None,
            float(impl.logits_soft_cap or 0.0),
        )
        if variant in seen:
            continue
        seen.add(variant)
        device = kv_cache.device
        if device not in plans:
            plans[device] = _warm_up_plan(max_tree_rows, device)
        plan = plans[device]
        rows = impl.num_heads * impl.head_size
        query = torch.zeros(max_tree_rows, rows, dtype=kv_cache.dtype, device=device)
        impl._recompute_tree_rows(
            query, key_cache, value_cache, torch.empty_like(query), plan
        )
        launches += 1
    for caches in commit_groups.values():
        slot = torch.zeros(1, dtype=torch.int64, device=caches[0].device)
        commit_kv_triton(caches, slot, slot)  # a self-move: the kernel skips it
        launches += 1
    return launches


def _warm_up_plan(max_tree_rows: int, device) -> TreeRowsPlan:
    """A one-request chain of ``max_tree_rows`` rows at positions 0.. over block
    0, laid out as a verify step's plan (the same tensor types)."""
    chain = torch.ones(max_tree_rows, max_tree_rows, dtype=torch.bool).tril()
    request = attn_context.TreeRequest(
        req_index=0,
        row_offset=0,
        num_rows=max_tree_rows,
        prefix_len=0,
        visibility=chain,
    )
    batch = attn_context.TreeAttentionBatch(
        (request,), stash_kv=False, max_tree_rows=max_tree_rows
    )
    query_start_loc = torch.tensor([0, max_tree_rows], dtype=torch.int32, device=device)
    # vLLM's block tables are int32 (the width, not specialised on, covers the
    # chain at any block size).
    block_table = torch.zeros(1, max_tree_rows, dtype=torch.int32, device=device)
    return TreeRowsPlan(batch, query_start_loc, block_table)
