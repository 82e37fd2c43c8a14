# SPDX-License-Identifier: Apache-2.0
"""apply_sampling_params == vLLM 0.32's own sampler steps, bit for bit."""

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.sampling import TreeSamplingParams, apply_sampling_params, draw_coins

vllm_sampler = pytest.importorskip("vllm.v1.sample.sampler")
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402


def vllm_process(logits, temperature, top_k, top_p, min_p):
    """vLLM's Sampler.sample steps 2-5 for a random (non-greedy) batch."""
    vocab = logits.shape[1]
    logits = vllm_sampler.Sampler.apply_temperature(logits, temperature, all_random=False)
    if min_p is not None:
        fake = SimpleNamespace(min_p_count=1, min_p=min_p.unsqueeze(1))
        logits = MinPLogitsProcessor.apply(fake, logits)
    k = None
    if top_k is not None:  # InputBatch stores vocab_size for "disabled"
        k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).to(torch.int32)
    return apply_top_k_top_p_pytorch(logits, k, top_p)


@pytest.mark.parametrize("use_k,use_p,use_min_p", [
    (False, False, False), (True, False, False), (False, True, False),
    (False, False, True), (True, True, True), (True, True, False),
])
@pytest.mark.parametrize("vocab", [2, 7, 300])
def test_matches_vllm(use_k, use_p, use_min_p, vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[::5] = torch.round(logits[::5])  # exact ties
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
    temperature[::7] = 0.0  # greedy rows in a mixed batch
    top_k = torch.randint(-1, vocab + 2, (rows,), generator=g) if use_k else None
    top_p = (torch.rand(rows, generator=g) * 0.99 + 0.01) if use_p else None
    if top_p is not None:
        top_p[::3] = 1.0
    min_p = (torch.rand(rows, generator=g) * 0.5) if use_min_p else None
    if min_p is not None:
        min_p[::4] = 0.0
    params = TreeSamplingParams(temperature, top_k, top_p, min_p)
    ours = apply_sampling_params(logits.clone(), params)
    theirs = vllm_process(logits.clone(), temperature, top_k, top_p, min_p)
    assert torch.equal(ours, theirs)
    assert torch.isfinite(ours).any(dim=1).all()  # at least one token survives


def test_from_lists_validation_names_argument():
    with pytest.raises(ValueError, match="temperature"):
        TreeSamplingParams.from_lists([-0.1])
    with pytest.raises(ValueError, match="temperature"):
        TreeSamplingParams.from_lists([float("nan")])
    with pytest.raises(ValueError, match="top_k"):
        TreeSamplingParams.from_lists([1.0], top_k=[-2])
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="top_p"):
            TreeSamplingParams.from_lists([1.0], top_p=[bad])
    for bad in (-0.1, 1.01):
        with pytest.raises(ValueError, match="min_p"):
            TreeSamplingParams.from_lists([1.0], min_p=[bad])
    with pytest.raises(ValueError, match="top_k has 2 entries"):
        TreeSamplingParams.from_lists([1.0], top_k=[1, 2])


def test_disabled_filters_are_dropped():
    p = TreeSamplingParams.from_lists([1.0, 0.0], top_k=[-1, 0], top_p=[1.0, 1.0], min_p=[0.0, 0.0])
    assert p.top_k is None and p.top_p is None and p.min_p is None
    p = TreeSamplingParams.from_lists([1.0, 0.0], top_k=[-1, 5])
    assert p.top_k.tolist() == [-1, 5]


def test_seeded_coins_reproduce_and_ignore_the_batch():
    a = TreeSamplingParams.from_lists([1.0, 1.0, 1.0], seeds=[None, 7, None])
    b = TreeSamplingParams.from_lists([1.0, 1.0], seeds=[7, 8])
    ca = draw_coins(3, 5, "cpu", a.generators)
    cb = draw_coins(2, 5, "cpu", b.generators)
    assert torch.equal(ca[0][1], cb[0][0]) and torch.equal(ca[1][1], cb[1][0])
    assert not torch.equal(cb[0][0], cb[0][1])
    for coins in (ca, cb):
        assert bool(((coins[0] >= 0) & (coins[0] < 1)).all())
