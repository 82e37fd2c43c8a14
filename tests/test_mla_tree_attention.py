# SPDX-License-Identifier: Apache-2.0
"""Latent-space (MLA) tree attention: torch reference and Triton kernel.

The reference is checked against a float64 oracle that decompresses the latent
rows (k = [kv_c W_UK ; k_pe], v = kv_c W_UV: MLA's MHA form, with random
W_UK / W_UV) and attends over the prefix and each node's ancestors; the kernel
against the reference. Without CUDA the kernel runs under TRITON_INTERPRET=1
(tests/conftest.py). Cache slots no request may read hold NaN.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

import torch  # noqa: E402

from vllm_ddtree.ops.mla_tree_attention import mla_tree_attention_triton  # noqa: E402
from vllm_ddtree.references import mla_tree_attention_reference  # noqa: E402
from vllm_ddtree.tree import build_ddtree, pack_visibility  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = torch.device("cuda" if not INTERPRET and torch.cuda.is_available() else "cpu")
NOPE, V_DIM = 16, 16


def make_case(prefix_lens, budgets, *, lora=64, rope=16, heads=4, block_size=16,
              dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(budgets), 4, 6, generator=g) * 2
    tree = build_ddtree(logits, torch.tensor(budgets), max_budget=max(budgets))
    tree_lens = (tree.num_nodes + 1).tolist()
    seq_lens = [p + t for p, t in zip(prefix_lens, tree_lens, strict=True)]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    ids = torch.randperm(num_blocks, generator=g)
    poison = int(ids[-1])
    block_table = torch.full((len(seq_lens), max(needed) + 1), poison)
    at = 0
    for r, n in enumerate(needed):
        block_table[r, :n] = ids[at : at + n]
        at += n
    cache = torch.randn(num_blocks, block_size, lora + rope, generator=g)
    cache[poison] = float("nan")
    for r, s in enumerate(seq_lens):
        if s % block_size:
            cache[block_table[r, s // block_size], s % block_size :] = float("nan")
    qsl = [0]
    for t in tree_lens:
        qsl.append(qsl[-1] + t)
    n = qsl[-1] + 1  # a padding token: its output must be 0
    w_uk = torch.randn(lora, heads, NOPE, generator=g) / 4
    w_uv = torch.randn(lora, heads, V_DIM, generator=g) / 4
    q_nope = torch.randn(n, heads, NOPE, generator=g)
    q_pe = torch.randn(n, heads, rope, generator=g)
    q_lat = torch.einsum("thp,lhp->thl", q_nope, w_uk)
    i32 = torch.int32

    def dev(x, dt=None):
        return x.to(device=DEVICE, dtype=dt or x.dtype)

    args = (
        dev(q_lat, dtype), dev(q_pe, dtype), dev(cache, dtype), dev(block_table, i32),
        torch.tensor(prefix_lens, dtype=i32, device=DEVICE),
        torch.tensor(tree_lens, dtype=i32, device=DEVICE),
        torch.tensor(qsl, dtype=i32, device=DEVICE), dev(tree.visibility_packed),
        (NOPE + rope) ** -0.5,
    )
    oracle = dict(q_nope=q_nope, w_uk=w_uk, w_uv=w_uv, tree=tree, cache=cache,
                  block_table=block_table, prefix_lens=prefix_lens,
                  tree_lens=tree_lens, qsl=qsl, q_pe=q_pe, lora=lora)
    return args, oracle


def mha_oracle(o, visibility=None) -> torch.Tensor:
    """float64, per row and head, over decompressed latent rows; returns the
    attention output after W_UV, [num_tokens, heads, V]."""
    vis_all = o["tree"].visibility if visibility is None else visibility
    heads = o["w_uk"].shape[1]
    bs = o["cache"].shape[1]
    out = torch.zeros(o["q_nope"].shape[0], heads, V_DIM, dtype=torch.float64)
    for r, (p, t, q0) in enumerate(zip(o["prefix_lens"], o["tree_lens"], o["qsl"],
                                       strict=False)):
        for i in range(t):
            keys = list(range(p)) + [p + j for j in range(t) if vis_all[r, i, j]]
            rows = o["cache"][o["block_table"][r, [s // bs for s in keys]],
                              [s % bs for s in keys]].double()
            kv_c, k_pe = rows[:, : o["lora"]], rows[:, o["lora"] :]
            for h in range(heads):
                k = torch.cat([kv_c @ o["w_uk"][:, h].double(), k_pe], 1)
                v = kv_c @ o["w_uv"][:, h].double()
                q = torch.cat([o["q_nope"][q0 + i, h], o["q_pe"][q0 + i, h]]).double()
                w = torch.softmax(k @ q * (NOPE + k_pe.shape[1]) ** -0.5, 0)
                out[q0 + i, h] = w @ v
    return out


def to_v(o_lat: torch.Tensor, o) -> torch.Tensor:
    """Latent outputs -> after W_UV (what the layer's v_up projection does)."""
    return torch.einsum("thl,lhv->thv", o_lat.cpu().double(), o["w_uv"].double())


@pytest.mark.parametrize(
    "lora,rope,heads,block_size,dtype,tiles",
    [
        (64, 16, 4, 16, torch.float32, None),
        (64, 16, 3, 5, torch.float32, dict(block_q=2, block_h=2, block_n=4)),
        (512, 64, 2, 16, torch.float32, None),  # DeepSeek's latent sizes
        (64, 16, 4, 16, torch.bfloat16, None),
    ],
    ids=["l64-h4", "l64-h3-bs5-small-tiles", "l512-r64", "bf16"],
)
def test_matches_the_mha_oracle(lora, rope, heads, block_size, dtype, tiles):
    if tiles is not None and not INTERPRET:
        pytest.skip("tiles below 16 need the interpreter")
    args, o = make_case([37, 0, 20], [9, 3, 0], lora=lora, rope=rope, heads=heads,
                        block_size=block_size, dtype=dtype, seed=lora + heads)
    expected = mha_oracle(o)
    ref = mla_tree_attention_reference(*args)
    out = mla_tree_attention_triton(*args, **(tiles or {}))
    atol = 1e-4 if dtype == torch.float32 else 6e-2
    rows = list(range(o["qsl"][-1]))
    torch.testing.assert_close(to_v(ref, o)[rows], expected[rows], atol=atol, rtol=atol)
    torch.testing.assert_close(to_v(out, o)[rows], expected[rows], atol=atol, rtol=atol)
    assert not bool(out[-1].any()) and not bool(ref[-1].any())  # padding row


def test_a_causal_mask_would_be_caught():
    args, o = make_case([9], [7], seed=3)
    t = o["tree_lens"][0]
    causal = torch.ones(1, t, t, dtype=torch.bool).tril()
    assert not torch.equal(o["tree"].visibility[:, :t, :t], causal)
    wrong = list(args)
    wrong[7] = pack_visibility(causal).to(DEVICE)
    expected = mha_oracle(o)
    for fn in (mla_tree_attention_reference, mla_tree_attention_triton):
        good = to_v(fn(*args), o)
        bad = to_v(fn(*wrong), o)
        torch.testing.assert_close(good[:t], expected[:t], atol=1e-4, rtol=1e-4)
        assert (bad[:t] - expected[:t]).abs().max() > 1e-2


def test_bad_inputs_raise():
    args, _ = make_case([5], [3], seed=4)
    bad = list(args)
    bad[2] = args[2][..., :-1]  # a row without its last rope entry
    for fn in (mla_tree_attention_reference, mla_tree_attention_triton):
        with pytest.raises(ValueError, match="latent_cache"):
            fn(*bad)
