# SPDX-License-Identifier: Apache-2.0
"""The tree-attention batch of a verify forward, in its attention metadata.

The runner's :class:`~vllm_ddtree.vllm_adapter.runner.DDTreeVerifier`
describes each verify step's trees as a :class:`TreeAttentionBatch`; after the
step's attention metadata is built, the target's tree-aware builders
(:class:`TreeAttentionMetadataBuilderMixin`) give their metadata the batch as
``metadata.tree`` (:func:`metadata_with_tree`). Only the target's verify
forward gets it: dummy runs and the drafter's pass build metadata without one.

While a layer's metadata carries a tree, ``DDTreeCPUAttentionImpl.forward``
(``cpu_attention.py``) gives the tree rows of every listed request ancestor-only
attention, and stashes each layer's tree-block K/V in the batch so that
:meth:`TreeAttentionBatch.commit_kv` can later move the accepted path to
contiguous cache slots (from ``_sample``, after the forward).

Row spaces
----------
* **batch rows**: the forward's query rows, in ``attn_metadata.query_start_loc``
  order (request ``r`` owns rows ``query_start_loc[r] .. query_start_loc[r+1]-1``).
* **tree rows**: the tree blocks of the listed requests concatenated in list order
  (= batch order). Request ``k`` of the list owns the ``T_k`` tree rows after
  those of requests ``0 .. k-1``: node ``i`` of its tree is tree row
  ``T_0 + .. + T_{k-1} + i``. When every request of the batch verifies a tree
  occupying its whole query, both spaces coincide.

Shapes (per listed request, ``T = T_r``, ``nc = nc_r``)
------------------------------------------------------
* ``visibility``: ``[T, T]`` bool, ``visibility[i, j]``: node ``j`` is node ``i``
  or one of its ancestors (``DraftTree.visibility[r, :T, :T]``).
* Its tree block occupies batch rows ``query_start_loc[r] + row_offset + i``,
  ``i < T``, at linear cache positions ``nc + i`` (slots already allocated by
  vLLM); its root is at position ``nc``; positions ``0 .. nc-1`` (the committed
  prefix, plus any earlier rows of the same request in this forward) are read
  from the paged cache.

Per-layer stash (:class:`LayerKVStash`), ``M`` = total tree rows of the batch:
``key`` ``[M, Hkv, D]`` and ``value`` ``[M, Hkv, Dv]`` (post-RoPE, cloned),
``slot_mapping`` ``[M]`` int64, ``batch_rows`` ``[M]`` int64, plus the layer's
``kv_cache`` (``[num_blocks, Hkv, block_size, 2 * D]``, ISA-packed), ``isa``,
``k_scale``, ``v_scale`` and ``kv_cache_dtype``: exactly what
``ops.cpu_attn_reshape_and_cache`` needs to re-write entries.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType

__all__ = [
    "LayerKVStash",
    "TreeAttentionBatch",
    "TreeAttentionImplMixin",
    "TreeAwareImpl",
    "TreeRequest",
    "TreeAttentionMetadataBuilderMixin",
    "check_model_tree_attention",
    "metadata_with_tree",
    "override_attention_backend",
    "refuse_unsupported",
]


@dataclass(frozen=True)
class TreeRequest:
    """One request of the batch that verifies a tree."""

    # Index of the request in the batch (row of query_start_loc / block_table).
    req_index: int
    # First row of the tree block inside the request's query rows (usually
    # query_len - T: the tree block ends the request's rows).
    row_offset: int
    # T_r: tree-block rows (root + real nodes).
    num_rows: int
    # nc_r: committed prefix length = the root's (linear) position.
    prefix_len: int
    # [T_r, T_r] bool ancestor-or-self mask (row i may attend to column j).
    visibility: torch.Tensor

    def __post_init__(self) -> None:
        if self.req_index < 0 or self.row_offset < 0 or self.prefix_len < 0:
            raise ValueError(f"negative index in {self!r}")
        if self.num_rows < 1:
            raise ValueError(f"a tree block has at least its root, got {self.num_rows}")
        vis = self.visibility
        if vis.dtype != torch.bool or tuple(vis.shape) != (self.num_rows,) * 2:
            raise ValueError(
                f"visibility must be a [{self.num_rows}, {self.num_rows}] bool "
                f"tensor, got {vis.dtype} {tuple(vis.shape)}"
            )


@dataclass
class LayerKVStash:
    """One attention layer's tree-block K/V, kept for :func:`commit_kv`."""

    # [M, Hkv, D] post-RoPE keys of the batch's tree rows (tree-row order).
    key: torch.Tensor
    # [M, Hkv, Dv] values of the same rows.
    value: torch.Tensor
    # [M] int64 cache slots the forward wrote these rows to (linear positions).
    slot_mapping: torch.Tensor
    # [M] int64 batch rows of these tree rows.
    batch_rows: torch.Tensor
    # The layer's paged cache, [num_blocks, Hkv, block_size, 2 * D] (a reference).
    kv_cache: torch.Tensor
    isa: str
    k_scale: float
    v_scale: float
    kv_cache_dtype: str

    def write(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Re-writes the K/V of stash rows ``src`` at the slots of rows ``dst``."""
        from vllm import _custom_ops as ops

        num_blocks, num_kv_heads, block_size, _ = self.kv_cache.shape
        cache = self.kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1)
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            self.key.index_select(0, src).contiguous(),
            self.value.index_select(0, src).contiguous(),
            key_cache,
            value_cache,
            self.slot_mapping.index_select(0, dst).contiguous(),
            self.isa,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            kv_cache_dtype=self.kv_cache_dtype,
        )


@dataclass
class TreeAttentionBatch:
    """The tree requests of one verify forward, and the K/V stash it fills."""

    requests: tuple[TreeRequest, ...]
    # Stash each layer's tree K/V during the forward (needed by commit_kv).
    stash_kv: bool = True
    # layer name -> stash, filled by the attention impl during the forward.
    # Another backend may stash its own type: a class with a ``commit_all(batch,
    # moves, row_space)`` classmethod then performs the whole commit.
    stash: dict[str, object] = field(default_factory=dict)
    # layer name -> recurrent-state stash of a hybrid target's GDN layers
    # (``gdn_state.RecurrentStateStash``), committed from the accepted paths.
    recurrent_stash: dict[str, object] = field(default_factory=dict)
    # The engine's largest tree (B + 1 rows), or None: GPU kernels take their
    # tiles from it, so every step runs one compiled variant (a step's own
    # largest tree would compile new ones mid-serving).
    max_tree_rows: int | None = None
    # Per-metadata plans cached by the attention impl (one forward, many layers).
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.requests = tuple(self.requests)
        idx = [r.req_index for r in self.requests]
        if any(b <= a for a, b in zip(idx, idx[1:], strict=False)):
            raise ValueError(
                f"tree requests must be listed in increasing batch order, got {idx}"
            )

    @classmethod
    def from_tree(
        cls,
        tree,
        tree_rows: Sequence[int],
        req_indices: Sequence[int],
        row_offsets: Sequence[int],
        num_rows: Sequence[int],
        prefix_lens: Sequence[int],
        stash_kv: bool = True,
        visibility_buffer: torch.Tensor | None = None,
        max_tree_rows: int | None = None,
    ) -> TreeAttentionBatch:
        """Builds the batch from a :class:`vllm_ddtree.tree.DraftTree`.

        ``tree_rows[k]`` is the row of ``tree`` (request axis) describing listed
        request ``k``; its visibility is ``tree.visibility[tree_rows[k], :T, :T]``
        with ``T = num_rows[k]`` (a prefix-closed truncation of the tree).
        ``visibility_buffer``: a preallocated host ``[max_reqs, R, R]`` bool
        buffer (R >= every T) the masks are copied into (request ``k`` at
        ``[k, :T, :T]``); without it each mask is a new tensor.
        """
        vis = tree.visibility.to("cpu")
        reqs = []
        for k, (tr, ri, off, t, nc) in enumerate(
            zip(tree_rows, req_indices, row_offsets, num_rows, prefix_lens, strict=True)
        ):
            t = int(t)
            mask = vis[int(tr), :t, :t]
            if visibility_buffer is not None:
                mask = visibility_buffer[k, :t, :t].copy_(mask)
            else:
                mask = mask.contiguous()
            reqs.append(
                TreeRequest(
                    req_index=int(ri),
                    row_offset=int(off),
                    num_rows=t,
                    prefix_len=int(nc),
                    visibility=mask,
                )
            )
        return cls(tuple(reqs), stash_kv=stash_kv, max_tree_rows=max_tree_rows)

    @property
    def num_tree_rows(self) -> int:
        """M: total tree rows (sum of T_r)."""
        return sum(r.num_rows for r in self.requests)

    def commit_kv(
        self, moves: tuple[torch.Tensor, torch.Tensor], row_space: str = "tree"
    ) -> int:
        """Re-writes K/V of rows ``src`` at the cache slots of rows ``dst``.

        Args:
            moves: ``(src_rows, dst_rows)``, equal-length int tensors (or lists),
                e.g. the ``src_rows`` and ``dst_rows`` of
                ``vllm_ddtree.commit.plan_commit(...)``. Self-moves
                (src == dst) are skipped. Moves must be race-free as a
                gather-then-scatter: every source is read from the stash (the
                K/V the forward computed), never from the cache.
            row_space: ``"tree"`` (default): indices into the concatenated tree
                rows (see the module doc); ``"batch"``: the forward's query rows.

        Applies to every stashed layer through ``ops.cpu_attn_reshape_and_cache``,
        so it never depends on the ISA-packed layout. Returns the number of rows
        moved per layer. (A stash type with a ``commit_all`` classmethod commits
        for itself.)
        """
        if row_space not in ("tree", "batch"):
            raise ValueError(f"row_space must be 'tree' or 'batch', got {row_space!r}")
        commit_all = getattr(
            type(next(iter(self.stash.values()), None)), "commit_all", None
        )
        if commit_all is not None:
            return commit_all(self, moves, row_space)
        # The CPU attention's stashes: moves on the host.
        src, dst = moves
        src = torch.as_tensor(src, dtype=torch.int64).reshape(-1).cpu()  # CPU only
        dst = torch.as_tensor(dst, dtype=torch.int64).reshape(-1).cpu()  # CPU only
        if src.shape != dst.shape:
            raise ValueError(
                "src_rows and dst_rows differ in length: "
                f"{src.numel()} vs {dst.numel()}"
            )
        keep = src != dst
        src, dst = src[keep], dst[keep]
        if src.numel() == 0:
            return 0
        if not self.stash:
            raise RuntimeError(
                "commit_kv: no K/V was stashed (did the target forward run with "
                "this tree-attention batch active and stash_kv=True?)"
            )
        if row_space == "batch":
            src, dst = self._batch_to_tree_rows(src), self._batch_to_tree_rows(dst)
        m = self.num_tree_rows
        if (
            int(src.min()) < 0
            or int(dst.min()) < 0
            or max(int(src.max()), int(dst.max())) >= m
        ):
            raise IndexError(f"commit_kv: a row is outside the {m} tree rows")
        for layer_stash in self.stash.values():
            layer_stash.write(src, dst)
        return int(src.numel())

    def _batch_to_tree_rows(self, rows: torch.Tensor) -> torch.Tensor:
        batch_rows = next(iter(self.stash.values())).batch_rows
        size = int(batch_rows.max()) + 1  # CPU only
        lookup = torch.full((size,), -1, dtype=torch.int64)
        lookup[batch_rows] = torch.arange(batch_rows.numel())
        if int(rows.min()) < 0 or int(rows.max()) >= lookup.numel():
            raise IndexError("commit_kv: a batch row is not a tree row")
        out = lookup[rows]
        if bool((out < 0).any()):
            raise IndexError("commit_kv: a batch row is not a tree row")
        return out

    def commit_recurrent(
        self, paths: torch.Tensor, num_committed: torch.Tensor
    ) -> None:
        """Commits the recurrent states of the stashed GDN layers.

        Args:
            paths: [R, L] batch rows of every request's accepted nodes at
                depths 1 .. L (``CommitPlan.src_rows`` viewed per request).
            num_committed: [R] path lengths.
        """
        if self.recurrent_stash:
            paths, num_committed = paths.cpu(), num_committed.cpu()
        for layer_stash in self.recurrent_stash.values():
            layer_stash.commit(paths, num_committed)

    def release(self) -> None:
        """Drops the stash and cached plans (the cache references included)."""
        self.stash.clear()
        self.recurrent_stash.clear()
        self._plans.clear()


def refuse_unsupported(backend: str, features: dict[str, bool]) -> None:
    """Raises ValueError naming every feature that is present.

    Args:
        backend: the attention backend, for the message.
        features: description -> whether the layer uses it.
    """
    refused = [name for name, present in features.items() if present]
    if refused:
        raise ValueError(
            f"DDTree tree attention on {backend} does not support "
            + ", ".join(refused)
            + " (the tree-verify forward needs plain causal decoder attention); "
            "serve this target without ddtree"
        )


def check_model_tree_attention(model) -> None:
    """Start-up check of a loaded target: every decoder self-attention layer has a
    tree-aware impl and none of the features it refuses.

    Runs in the worker when the model is loaded, so an unsupported layer fails
    the engine start instead of the first verify step.

    Raises:
        ValueError: naming the layer and what it uses.
    """
    from vllm.v1.attention.backend import AttentionImplBase

    not_causal = (
        AttentionType.ENCODER,
        AttentionType.ENCODER_ONLY,
        AttentionType.ENCODER_DECODER,
    )
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if not isinstance(impl, AttentionImplBase):
            continue
        if getattr(impl, "attn_type", None) in not_causal:
            continue  # attends to the prompt / encoder only: no tree rows
        if not isinstance(impl, TreeAwareImpl):
            kind = type(impl).__name__
            raise ValueError(
                f"ddtree: target layer {name} runs {kind}, which has "
                "no ancestor-only tree attention (the verify pass would attend "
                "causally across branches); ddtree needs a plain decoder attention "
                "layer on its tree backend"
            )
        try:
            refuse_unsupported(impl.BACKEND_NAME, impl.tree_refusals())
        except ValueError as e:
            raise ValueError(f"ddtree: target layer {name}: {e}") from None


def override_attention_backend(name: str, path: str) -> None:
    """Makes ``AttentionBackendEnum[name]`` resolve to the class at ``path``.

    Idempotent. Runs in the worker when a ddtree runner is built, before the
    model's attention layers are created. Outside trees the DDTree backends are
    the stock ones, so engines built later in the process (ddtree or not) may
    share them; engines built earlier keep the class they resolved.
    """
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    member = AttentionBackendEnum[name]
    if member.get_path() != path:
        register_backend(member, path)
        # The selector caches resolved classes per configuration.
        selector._cached_get_attn_backend.cache_clear()


class TreeAwareImpl:
    """An attention impl whose tree rows attend ancestor-only under a tree batch
    (put it before the stock impl).

    What the tree path cannot honour is refused at engine start, never inside a
    forward: ``tree_refusals()`` (description -> present) lists the layer's
    features, and :func:`check_model_tree_attention` raises for any of them when
    the model is loaded.
    """

    BACKEND_NAME = "?"

    def tree_refusals(self) -> dict[str, bool]:
        raise NotImplementedError


class TreeAttentionImplMixin(TreeAwareImpl):
    """``forward`` of a tree-aware attention impl (put it before the stock impl).

    Runs the stock impl's ``forward`` for the whole batch, then, only under an
    active tree batch and only for decoder self-attention,
    ``_tree_forward(layer, query, key, value, kv_cache, attn_metadata, output,
    batch)`` on the tree rows.

    What the tree path cannot honour is refused at engine start, never inside a
    forward: ``tree_refusals()`` (description -> present) lists the layer's
    features, and :func:`check_model_tree_attention` raises for any of them when
    the model is loaded. ``_check_tree_call(query, key, value, output_scale)``
    only asserts, per forward, that nothing the load-time check vouched for
    changed (it cannot fire for a configuration that started).
    """

    def _check_tree_call(self, query, key, value, output_scale) -> None:
        if output_scale is not None:
            raise AssertionError(
                "DDTree tree attention: a layer passed the start-up check but its "
                "forward fuses output quantization"
            )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = getattr(attn_metadata, "tree", None)
        tree_active = (
            batch is not None
            and attn_metadata is not None
            and bool(batch.requests)
            and self.attn_type == AttentionType.DECODER
        )
        if tree_active:
            self._check_tree_call(query, key, value, output_scale)
        result = super().forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale,
            output_block_scale,
        )
        if tree_active:
            self._tree_forward(
                layer, query, key, value, kv_cache, attn_metadata, output, batch
            )
        return result


def metadata_with_tree(metadata, batch: TreeAttentionBatch):
    """A copy of a backend's attention metadata that carries ``batch`` as
    ``tree``: the metadata of a verify forward. (The stock metadata classes are
    plain dataclasses; the copy is shallow, so every tensor is shared.)"""
    metadata = copy.copy(metadata)
    metadata.tree = batch
    return metadata


class TreeAttentionMetadataBuilderMixin:
    """The metadata builder of a tree-aware backend (put it before the stock
    builder): :meth:`with_tree` gives a verify step's metadata its trees.

    The runner calls it once per step, after the step's metadata is built, for
    the target's attention groups only; a metadata without ``tree`` (every other
    build: dummy runs, the drafter's pass, steps without drafts) attends as the
    stock backend does.

    CUDA graphs: none of these layers. A verify forward's tree rows read plans
    built on the host from that step's trees, into metadata replaced after the
    build; a captured graph would replay one step's trees for every later step.
    vLLM then captures no full graphs with these builders (piecewise graphs
    still run around the attention ops).
    """

    _cudagraph_support = AttentionCGSupport.NEVER

    def with_tree(self, metadata, batch: TreeAttentionBatch):
        """``metadata`` for a forward over ``batch``'s trees."""
        return metadata_with_tree(metadata, batch)
