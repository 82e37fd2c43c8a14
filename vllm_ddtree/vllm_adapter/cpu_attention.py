# SPDX-License-Identifier: Apache-2.0
"""CPU_ATTN with ancestor-only attention for DDTree's tree-verify forward.

``DDTreeCPUAttentionBackend`` replaces vLLM's ``CPU_ATTN`` (same name, builder,
metadata and KV-cache write). Its impl runs the stock kernel for the whole batch,
then, only while a tree-attention batch is active (``attn_context``, set by the
runner around the target forward) and only for decoder self-attention layers,
recomputes the tree rows whose ancestors are not exactly the block rows before
them (a chain's rows and a tree's leading spine are already exact) with softmax
attention over

    [committed prefix K/V ; the tree block's own K/V], both read from the paged cache

with the additive mask ``[zeros(F, nc) | -inf where not visible]``, and stashes
the tree K/V for the commit. The layer's own attention features carry over:

* a sliding window ``w`` (per layer, e.g. gpt-oss and Gemma alternate windowed
  and global layers): a node at depth ``d`` sits at position ``p = nc + d`` and
  sees committed position ``j`` and its ancestor at depth ``a`` only while
  ``p - j < w`` and ``d - a < w``, the rule the stock kernel applies to the
  accepted path's rows; committed keys outside every row's window are not read;
* attention sinks (gpt-oss): one learned logit per query head joins the softmax
  denominator, with no value;
* logit softcap: ``softcap * tanh(s / softcap)`` on the scaled scores, before
  the mask. Everything else (prefill, plain decode, the drafter's
non-causal pass, non-tree rows of a verify batch) is the stock kernel's output,
bit for bit.

Why recompute: the kernel takes only causal / sliding window / alibi / softcap /
sinks, no mask, and returns no log-sum-exp, so its prefix part cannot be merged
with a separately computed tree part.

Reading the prefix: the CPU cache ``[num_blocks, Hkv, block_size, 2 * D]`` is
viewed as ``[num_blocks, Hkv, 2 * block_size, D]`` and split into K (first half)
and V (second half); inside each (block, head) the ``block_size * D`` entries are
ISA-packed (for ``vec``/``vec16``: K transposed ``[D, block_size]``, V plain
``[block_size, D]``). The packing is not assumed: :func:`packed_layout` derives
it once per (isa, dtype, block_size, head_dim) by writing coded values through
``ops.cpu_attn_reshape_and_cache`` into a scratch block, and self-tests it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.vllm_adapter import attn_context

__all__ = [
    "DDTreeCPUAttentionBackend",
    "DDTreeCPUAttentionImpl",
    "DDTreeCPUAttentionMetadataBuilder",
    "PackedLayoutError",
    "packed_layout",
    "plan_for",
    "register_tree_attention_backend",
    "unpack_blocks",
]

BACKEND_PATH = f"{__name__}.DDTreeCPUAttentionBackend"


# --------------------------------------------------------------------------------
# The ISA-packed cache layout, derived by probing the official write op.
# --------------------------------------------------------------------------------


class PackedLayoutError(RuntimeError):
    """The probe could not derive (or verify) the packed KV-cache layout."""


_DIGIT_BITS = 4  # base-16 digits: codes 1..16 are exact in fp16, bf16 and fp32
_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_LAYOUTS_LOCK = threading.Lock()


def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, Hkv, bs, 2D] -> key_cache, value_cache views [nb, Hkv, bs, D] (as vLLM)."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    kv = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    return key_cache, value_cache


def _write(key, value, kv_cache, slots, isa, kv_cache_dtype="auto"):
    key_cache, value_cache = _split_cache(kv_cache)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_cache_dtype
    )


def _probe(isa: str, dtype: torch.dtype, block_size: int, head_dim: int):
    """Where each (token t, dim d) of K and of V lands inside one (block, head).

    Writes, one base-16 digit at a time, ``digit(t * D + d) + 1`` as both key and
    value of token ``t`` (slot ``t`` of a one-block, one-head scratch cache filled
    with -1), and reads the digits back from every packed position.
    """
    n = block_size * head_dim
    num_digits = max(1, math.ceil(math.log2(n) / _DIGIT_BITS)) if n > 1 else 1
    code = torch.arange(n, dtype=torch.int64)
    decoded = torch.zeros(2, n, dtype=torch.int64)  # packed position -> t * D + d
    scratch = torch.empty(1, 1, block_size, 2 * head_dim, dtype=dtype)
    slots = torch.arange(block_size, dtype=torch.int64)
    for i in range(num_digits):
        digit = (code >> (_DIGIT_BITS * i)) & ((1 << _DIGIT_BITS) - 1)
        rows = (digit + 1).to(dtype).view(block_size, 1, head_dim).contiguous()
        scratch.fill_(-1)
        _write(rows, rows.clone(), scratch, slots, isa)
        raw = scratch.view(2, n).to(torch.float32)  # [K region ; V region]
        got = raw.round().to(torch.int64) - 1
        if not torch.equal(got.to(torch.float32) + 1, raw) or bool(
            ((got < 0) | (got >= 1 << _DIGIT_BITS)).any()
        ):
            raise PackedLayoutError(
                f"cpu_attn_reshape_and_cache(isa={isa!r}, dtype={dtype}, "
                f"block_size={block_size}, head_dim={head_dim}) does not store "
                "each entry as a plain copy (unwritten or transformed entries)"
            )
        decoded += got << (_DIGIT_BITS * i)
    index = []
    for part, name in ((decoded[0], "K"), (decoded[1], "V")):
        if not torch.equal(part.sort().values, code):
            raise PackedLayoutError(
                f"the packed {name} layout for isa={isa!r}, dtype={dtype}, "
                f"block_size={block_size}, head_dim={head_dim} is not a "
                "permutation of one block's entries"
            )
        unpack = torch.empty(n, dtype=torch.int64)
        unpack[part] = torch.arange(n, dtype=torch.int64)  # plain index -> packed pos
        index.append(unpack)
    return index[0], index[1]


def _self_test(isa, dtype, block_size, head_dim, k_index, v_index) -> None:
    """unpack(pack(x)) == x over several blocks and heads, random slots."""
    g = torch.Generator().manual_seed(1234)
    num_blocks, num_kv_heads = 3, 2
    num_tokens = num_blocks * block_size
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_tokens, generator=g)
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    _write(key, value, cache, slots, isa)
    k_all, v_all = _unpack(cache, torch.arange(num_blocks), k_index, v_index)
    if not (torch.equal(k_all[slots], key) and torch.equal(v_all[slots], value)):
        raise PackedLayoutError(
            f"probed KV-cache layout failed its self-test (isa={isa!r}, dtype={dtype}, "
            f"block_size={block_size}, head_dim={head_dim}): the packing is not a "
            "per-block, per-head permutation"
        )


def packed_layout(
    isa: str, dtype: torch.dtype, block_size: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack indices ``(k_index, v_index)``, each ``[block_size * head_dim]`` int64.

    For one (block, head), with ``packed_k`` the ``block_size * D`` entries of its K
    region (the first half of ``kv_cache.view(nb, Hkv, 2 * bs * D)[b, h]``),
    ``plain_k[t * D + d] = packed_k[k_index[t * D + d]]``; the same for V (second
    half). Cached per (isa, dtype, block_size, head_dim); probed and self-tested on
    first use; raises :class:`PackedLayoutError` if the probe fails.
    """
    key = (isa, dtype, int(block_size), int(head_dim))
    layout = _LAYOUTS.get(key)
    if layout is None:
        with _LAYOUTS_LOCK:
            layout = _LAYOUTS.get(key)
            if layout is None:
                try:
                    layout = _probe(isa, dtype, int(block_size), int(head_dim))
                except PackedLayoutError:
                    raise
                except Exception as e:  # the op refused the configuration
                    raise PackedLayoutError(
                        f"probing the CPU KV-cache layout failed for isa={isa!r}, "
                        f"dtype={dtype}, block_size={block_size}, "
                        f"head_dim={head_dim}: {e}"
                    ) from e
                _self_test(isa, dtype, int(block_size), int(head_dim), *layout)
                _LAYOUTS[key] = layout
    return layout


def _unpack(kv_cache, block_ids, k_index, v_index):
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    n = block_size * head_dim
    blocks = kv_cache.index_select(0, block_ids).view(-1, num_kv_heads, 2, n)
    k = blocks[:, :, 0].index_select(-1, k_index)
    v = blocks[:, :, 1].index_select(-1, v_index)

    def tokens_major(x):  # [nb, Hkv, bs * D] -> [nb * bs, Hkv, D]
        x = x.view(-1, num_kv_heads, block_size, head_dim).transpose(1, 2)
        return x.reshape(-1, num_kv_heads, head_dim)

    return tokens_major(k), tokens_major(v)


def unpack_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, isa: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks ``block_ids``, ``[len(block_ids) * bs, Hkv, D]`` each,
    token-major (token ``i`` = block ``i // bs``, offset ``i % bs``)."""
    _, _, block_size, two_d = kv_cache.shape
    k_index, v_index = packed_layout(isa, kv_cache.dtype, block_size, two_d // 2)
    block_ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
    return _unpack(kv_cache, block_ids, k_index, v_index)


# --------------------------------------------------------------------------------
# Backend and impl.
# --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TreeEntry:
    """One tree request's rows that the stock kernel cannot give."""

    # [F] int64 batch rows to recompute.
    rows: torch.Tensor
    # nc: committed positions 0 .. nc - 1 before the tree block.
    prefix_len: int
    # T: tree-block rows (cache positions nc .. nc + T - 1).
    num_rows: int
    # Block ids of cache positions 0 .. nc + T - 1.
    block_ids: torch.Tensor
    # [F, T] bool: the recomputed rows' ancestor-or-self columns.
    visibility: torch.Tensor
    # [F] and [T] int64 depths (sequence position - nc) of the recomputed rows
    # and of every tree-block row: a node's RoPE position is nc + its depth.
    row_depths: torch.Tensor
    key_depths: torch.Tensor


class _ForwardPlan:
    """Per (tree batch, metadata): batch rows, block ids and masks of the tree
    requests, shared by every layer of one forward (layers may differ in their
    sliding window; the masks and gathers are made once per window)."""

    def __init__(self, batch, metadata: CPUAttentionMetadata, block_size: int):
        qsl = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        num_reqs = len(qsl) - 1
        num_actual = int(metadata.num_actual_tokens)
        self.metadata = metadata  # keeps id(metadata) unique while cached
        self.block_size = block_size
        # A row that sees exactly the block rows before it (the chain's rows, and
        # a tree's leading spine) sits at its linear position, so the stock
        # causal kernel (window, sinks and softcap included) already gave its
        # exact output; only the other rows are recomputed.
        self.entries: list[_TreeEntry] = []
        self._windowed: dict[tuple, tuple[int, torch.Tensor]] = {}
        self._gather: dict[tuple, torch.Tensor] = {}
        self._expanded: dict[tuple, torch.Tensor] = {}
        rows = []
        for req in batch.requests:
            r, t, nc = req.req_index, req.num_rows, req.prefix_len
            if r >= num_reqs:
                raise ValueError(
                    f"tree request {r} is outside the batch of {num_reqs} requests"
                )
            q0 = qsl[r] + req.row_offset
            q_len = qsl[r + 1] - qsl[r]
            if req.row_offset + t > q_len or q0 + t > num_actual:
                raise ValueError(
                    f"tree block of request {r} (offset {req.row_offset}, {t} rows) "
                    f"exceeds its {q_len} query rows"
                )
            linear_root = seq_lens[r] - q_len + req.row_offset
            if nc != linear_root:
                raise ValueError(
                    f"tree request {r}: prefix_len {nc} but its tree block starts at "
                    f"cache position {linear_root} (seq_len {seq_lens[r]}, query "
                    f"rows {q_len}, offset {req.row_offset})"
                )
            visibility = req.visibility.to("cpu")
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            fix = torch.nonzero((visibility != causal).any(dim=1)).flatten()
            if fix.numel():
                depths = visibility.sum(dim=1) - 1  # ancestors of each node
                ids = metadata.block_table[r, : -(-(nc + t) // block_size)]
                self.entries.append(
                    _TreeEntry(
                        rows=q0 + fix,
                        prefix_len=nc,
                        num_rows=t,
                        block_ids=ids.to(torch.int64).clone(),
                        visibility=visibility[fix],
                        row_depths=depths[fix],
                        key_depths=depths,
                    )
                )
            rows.append(torch.arange(q0, q0 + t, dtype=torch.int64))
        self.rows = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)

    def windowed(self, k: int, window: int) -> tuple[int, torch.Tensor]:
        """Entry ``k`` under a layer's sliding window (``<= 0``: none).

        Returns ``(first, bias)``: the first cache position any recomputed row
        may see, and the additive mask ``[F, nc + T - first]`` over positions
        ``first .. nc + T - 1`` (0 = attend, -inf = not). A row at depth ``d``
        sits at position ``p = nc + d`` and sees committed positions ``j`` and
        ancestors at ``nc + a`` with ``p - j < window``, as the stock kernel
        lets the accepted path's rows see them.
        """
        key = (k, window)
        out = self._windowed.get(key)
        if out is None:
            e = self.entries[k]
            nc = e.prefix_len
            visible = torch.cat(
                [torch.ones(e.rows.numel(), nc, dtype=torch.bool), e.visibility], 1
            )
            first = 0
            if window > 0:
                # Committed keys older than the shallowest row's window are
                # seen by no row: never gathered (their blocks may be freed).
                first = max(0, nc + int(e.row_depths.min()) - window + 1)
                key_pos = torch.cat([torch.arange(nc), nc + e.key_depths])[first:]
                row_pos = nc + e.row_depths
                visible = visible[:, first:] & (
                    row_pos.view(-1, 1) - key_pos.view(1, -1) < window
                )
            bias = torch.zeros(visible.shape, dtype=torch.float32)
            bias.masked_fill_(~visible, float("-inf"))
            out = (first, bias)
            self._windowed[key] = out
        return out

    def expanded_bias(
        self, bias: torch.Tensor, num_kv_heads: int, group: int
    ) -> torch.Tensor:
        """An entry's mask [F, n] as [Hkv, group * F, n] (query rows head-major,
        as the grouped queries), made once per forward."""
        key = (id(bias), num_kv_heads, group)
        out = self._expanded.get(key)
        if out is None:
            rows, cols = bias.shape
            out = (
                bias.expand(num_kv_heads, group, rows, cols)
                .reshape(num_kv_heads, group * rows, cols)
                .contiguous()
            )
            self._expanded[key] = out
        return out

    def slots(self, k: int, first: int) -> torch.Tensor:
        """[n] int64 cache slots (block id * block_size + offset) of entry
        ``k``'s cache positions ``first .. nc + T - 1``."""
        e = self.entries[k]
        pos = torch.arange(first, e.prefix_len + e.num_rows)
        block = e.block_ids[pos // self.block_size]
        return block * self.block_size + pos % self.block_size

    def gather_index(
        self, k: int, first: int, kv_cache: torch.Tensor, isa: str
    ) -> torch.Tensor:
        """Flat offsets into ``kv_cache`` of the K and V of entry ``k``'s cache
        positions ``first .. nc + T - 1`` (committed keys, then the tree block,
        which the layer's KV write has already stored), head-major: [2, Hkv, n,
        D]. Every layer has the same cache shape and layout, so one forward
        computes them once per window."""
        num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
        key = (k, first, tuple(kv_cache.shape), kv_cache.dtype, isa)
        out = self._gather.get(key)
        if out is None:
            e = self.entries[k]
            head_dim = two_d // 2
            k_index, v_index = packed_layout(isa, kv_cache.dtype, block_size, head_dim)
            region = block_size * head_dim
            heads = torch.arange(num_kv_heads).view(-1, 1, 1)
            pos = torch.arange(first, e.prefix_len + e.num_rows)
            plain = (pos % block_size).view(-1, 1) * head_dim + torch.arange(head_dim)
            base = (
                (e.block_ids[pos // block_size].view(1, -1, 1) * num_kv_heads + heads)
                * 2
                * region
            )
            out = torch.stack([base + k_index[plain], base + region + v_index[plain]])
            self._gather[key] = out
        return out


def plan_for(batch, metadata, block_size) -> _ForwardPlan:
    """The forward's plan of ``batch`` under one attention group's ``metadata``
    (anything with ``query_start_loc``, ``seq_lens``, ``block_table`` and
    ``num_actual_tokens`` for the whole batch), made by its first layer."""
    key = (id(metadata), block_size)
    plan = batch._plans.get(key)
    if plan is None or plan.metadata is not metadata:
        plan = _ForwardPlan(batch, metadata, block_size)
        batch._plans[key] = plan
    return plan


class DDTreeCPUAttentionImpl(
    attn_context.TreeAttentionImplMixin, CPUAttentionBackendImpl
):
    """CPU_ATTN impl: with a tree in its metadata, tree rows attend ancestor-only."""

    BACKEND_NAME = "CPU"

    def tree_refusals(self) -> dict[str, bool]:
        # Sliding windows, sinks and softcap are honoured (_tree_forward).
        return {
            "alibi": self.alibi_slopes is not None,
            f"kv cache dtype {self.kv_cache_dtype!r}": self.is_fp8_kv_cache,
            "KV-cache sharing across layers": self.kv_sharing_target_layer_name
            is not None,
        }

    def _check_tree_call(self, query, key, value, output_scale) -> None:
        super()._check_tree_call(query, key, value, output_scale)
        if key is None or value is None:  # only KV-sharing layers, refused at load
            raise AssertionError(
                "DDTree tree attention on CPU: a layer without its own key/value "
                "passed the start-up check"
            )

    def _tree_forward(
        self, layer, query, key, value, kv_cache, metadata, output, batch
    ) -> None:
        plan = plan_for(batch, metadata, kv_cache.shape[2])
        window = self.sliding_window if self.sliding_window not in (None, -1) else 0
        self._attend_tree_rows(plan, layer.isa, query, kv_cache, output, window)
        if batch.stash_kv and plan.rows.numel():
            name = getattr(layer, "layer_name", None) or f"layer@{id(layer)}"
            batch.stash[name] = attn_context.LayerKVStash(
                key=key.index_select(0, plan.rows),
                value=value.index_select(0, plan.rows),
                slot_mapping=metadata.slot_mapping.index_select(0, plan.rows).to(
                    torch.int64
                ),
                batch_rows=plan.rows,
                kv_cache=kv_cache,
                isa=layer.isa,
                k_scale=float(getattr(layer, "_k_scale_float", 1.0)),
                v_scale=float(getattr(layer, "_v_scale_float", 1.0)),
                kv_cache_dtype=self.kv_cache_dtype,
            )

    def _attend_tree_rows(self, plan, isa, query, kv_cache, output, window) -> None:
        """Writes the ancestor-only attention of ``plan``'s recomputed rows
        into ``output`` (the other rows keep the stock kernel's): plain torch,
        a handful of operators per tree request and layer."""
        num_heads, head_dim = self.num_heads, self.head_size
        num_kv_heads = self.num_kv_heads
        group = num_heads // num_kv_heads
        softcap = float(self.logits_soft_cap or 0.0)
        # [Hkv, group, 1]: per query head, the sink logit (gpt-oss) that joins
        # the softmax denominator with no value, in float32 as the kernel runs it.
        sinks = (
            None
            if self.sinks is None
            else self.sinks.float().view(num_kv_heads, group, 1)
        )
        q_all = query.view(query.shape[0], num_heads, head_dim)
        out_all = output.view(output.shape[0], num_heads, -1)
        flat_cache = kv_cache.reshape(-1)  # a view: per-layer caches are contiguous
        for k, entry in enumerate(plan.entries):
            first, bias = plan.windowed(k, window)
            index = plan.gather_index(k, first, kv_cache, isa)
            # [2, Hkv, n, D]: K and V of the visible committed positions and the
            # tree block in one gather from the paged, ISA-packed cache.
            kv = flat_cache.index_select(0, index.view(-1)).view(index.shape).float()
            # Plain softmax attention, GQA by grouping query heads per KV head
            # (about 2x faster than torch SDPA with a mask at these sizes on
            # CPU); the mask expanded to [Hkv, group * F, n] once per forward
            # (shared by the layers with this window).
            rows = entry.rows.numel()
            q = q_all.index_select(0, entry.rows).transpose(0, 1)  # [H, F, D]
            q = q.reshape(num_kv_heads, group * rows, head_dim).float()
            mask = plan.expanded_bias(bias, num_kv_heads, group)
            if softcap:
                # softcap * tanh(s / softcap) on the scaled scores, then the mask.
                scores = torch.bmm(q, kv[0].transpose(1, 2)).mul_(self.scale / softcap)
                scores = scores.tanh_().mul_(softcap).add_(mask)
            else:
                scores = torch.baddbmm(mask, q, kv[0].transpose(1, 2), alpha=self.scale)
            if sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:
                sink = sinks.expand(num_kv_heads, group, rows).reshape(
                    -1, group * rows, 1
                )
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
                probs = probs[..., :-1]
            o = torch.bmm(probs, kv[1]).view(num_heads, rows, head_dim)
            out_all.index_copy_(0, entry.rows, o.transpose(0, 1).to(out_all.dtype))


class DDTreeCPUAttentionMetadataBuilder(
    attn_context.TreeAttentionMetadataBuilderMixin, CPUAttentionMetadataBuilder
):
    """CPU_ATTN's builder; a verify step's metadata carries its trees."""


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` (same name, metadata and KV write), DDTree-aware builder and
    impl."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_builder_cls() -> type[DDTreeCPUAttentionMetadataBuilder]:
        return DDTreeCPUAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[DDTreeCPUAttentionImpl]:
        return DDTreeCPUAttentionImpl


def register_tree_attention_backend() -> None:
    """Makes ``AttentionBackendEnum.CPU_ATTN`` resolve to the DDTree backend.

    Idempotent; see :func:`attn_context.override_attention_backend`.
    """
    attn_context.override_attention_backend("CPU_ATTN", BACKEND_PATH)
