# SPDX-License-Identifier: Apache-2.0
"""The trainable DFlash drafter computes what vLLM's in-tree DFlash drafter computes.

If training and serving disagreed (aux-layer offset, RoPE, norms, mask embedding,
what the block attends to), a trained drafter would be accepted far less in vLLM
than in training, silently. Here a random drafter made by
:class:`vllm_ddtree.drafter.model.DFlashDrafter` is exported, served by vLLM, and
its first draft logits (after the prompt's prefill) are compared with the torch
model's on the target's Hugging Face hidden states.
"""

import numpy as np
import pytest
import torch

from vllm_ddtree import tiny_models
from vllm_ddtree.drafter import train
from vllm_ddtree.drafter.data import FeatureIndex
from vllm_ddtree.drafter.model import DFlashDrafter, DrafterShape

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 6
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33]


def random_drafter(target_dir: str, seed: int) -> DFlashDrafter:
    config = transformers.AutoConfig.from_pretrained(target_dir)
    shape = DrafterShape.from_target(config, num_layers=2, target_layer_ids=[0, 2],
                                     mask_token_id=tiny_models.MASK_TOKEN_ID,
                                     block_size=BLOCK_SIZE)
    torch.manual_seed(seed)
    model = DFlashDrafter(shape)
    with torch.no_grad():  # norms and the mask embedding away from their defaults
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_vllm_serves_the_trained_model_exactly(tmp_path, vllm_patched, monkeypatch, arch):
    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

    target_dir = tiny_models.make_target(tmp_path / "target", arch=arch, kind="random",
                                         seed=11)
    model = random_drafter(target_dir, seed=12)
    model.export(tmp_path / "drafter", dtype=torch.float32)

    captured = []
    orig = DDTreeProposer._sample_draft_tokens

    def record(self, hidden_states, sampling_metadata):
        out = orig(self, hidden_states, sampling_metadata)
        captured.append(self._draft_logits.detach().clone())
        return out

    monkeypatch.setattr(DDTreeProposer, "_sample_draft_tokens", record)
    llm = vllm.LLM(model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                   speculative_config={"method": "ddtree", "model": str(tmp_path / "drafter"),
                                       "num_speculative_tokens": 8,
                                       "ddtree_budget": "fixed"})
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       vllm.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    del llm
    bonus = out[0].outputs[0].token_ids[0]
    served = captured[0].view(BLOCK_SIZE - 1, -1)  # first proposal: after the prefill

    # The same draft in torch: HF hidden states of the prompt as the context.
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        hs = hf.model(input_ids=torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in model.shape.target_layer_ids], dim=-1)
        n = len(PROMPT)
        batch = {
            "features": feats,
            "context_positions": torch.arange(n).unsqueeze(0),
            "bonus": torch.tensor([[bonus]]),
            "query_positions": torch.arange(n, n + BLOCK_SIZE).unsqueeze(0),
            "mask": torch.ones(1, BLOCK_SIZE, n + BLOCK_SIZE, dtype=torch.bool),
        }
        ours = train.drafter_logits(model, hf.model.embed_tokens.weight, hf.lm_head.weight, batch)[0, 0]
    assert served.shape == ours.shape
    err = (served - ours).abs().max().item()
    assert err < 2e-3 * ours.abs().max().item(), err
    # Non-vacuous: the context matters (a different prompt changes the draft).
    with torch.no_grad():
        batch["features"] = torch.roll(feats, 1, dims=1)
        shifted = train.drafter_logits(model, hf.model.embed_tokens.weight, hf.lm_head.weight, batch)[0, 0]
    assert (shifted - ours).abs().max().item() > 50 * err


def test_export_load_round_trip(tmp_path):
    target_dir = tiny_models.make_target(tmp_path / "target", arch="llama", seed=3)
    model = random_drafter(target_dir, seed=4)
    model.export(tmp_path / "d", dtype=torch.float32)
    again = DFlashDrafter.load(tmp_path / "d")
    assert again.shape == model.shape
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_make_batch_masks_and_labels():
    """Blocks see the context before their anchor and their own block only."""
    index = FeatureIndex([0], 2, offsets=[0, 10], lengths=[10, 7], prompt_lengths=[4, 3],
                         ids=[0, 1])
    feats = np.zeros((17, 2), dtype=np.int16)
    tokens = np.arange(100, 117, dtype=np.int32)
    rng = np.random.default_rng(0)
    batch = train.make_batch(index, feats, tokens, [0, 1], 2, 4, rng, torch.device("cpu"))
    mask, labels, qpos = batch["mask"], batch["labels"], batch["query_positions"]
    max_len = 10
    for s, (off, n, plen) in enumerate([(0, 10, 4), (10, 7, 3)]):
        for a in range(2):
            p = int(qpos[s, a * 4])
            assert plen <= p <= n - 2
            assert batch["bonus"][s, a] == tokens[off + p]
            rows = mask[s, a * 4:(a + 1) * 4]
            assert rows[:, :p].all() and not rows[:, p:max_len].any()
            own = rows[:, max_len:]
            assert own[:, a * 4:(a + 1) * 4].all() and own.sum() == 16
            want = [int(tokens[off + p + j]) if p + j < n else -100 for j in range(1, 4)]
            assert labels[s, a].tolist() == want
