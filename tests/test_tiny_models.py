# SPDX-License-Identifier: Apache-2.0
"""Tiny checkpoints (vllm_ddtree.tiny_models): files, transformers, vLLM + DFlash.

The vLLM tests build each engine once (module-scoped cache), run everything
they need on it, then drop it, so at most one ``LLM`` lives at a time.
"""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from vllm_ddtree import tiny_models as tm

PROMPTS = [
    "The quick brown fox",
    "def f(x):\n    return",
    "aaaa",
    "Once upon a time, in a land far away,",
]
MAX_TOKENS = 32
K = 4  # num_speculative_tokens
NOISY_ORACLE = 8.0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "qwen3-random": tm.make_pair(root, "random", "qwen3"),
        "qwen3-oracle": tm.make_pair(root, "oracle", "qwen3"),
        "qwen3-noisy": tm.make_pair(
            root, "oracle", "qwen3", name="qwen3-noisy", target_oracle_noise=NOISY_ORACLE
        ),
        "llama-oracle": tm.make_pair(root, "oracle", "llama"),
        "llama-random": tm.make_pair(root, "random", "llama"),
    }


# --------------------------------------------------------------------------- #
# Files, tokenizer, transformers
# --------------------------------------------------------------------------- #


def test_tokenizer_round_trip(ckpts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts["qwen3-random"][0])
    assert len(tok) == tm.DEFAULT_VOCAB_SIZE
    assert tok.eos_token_id == tm.EOS_TOKEN_ID
    assert tok.convert_tokens_to_ids(tm.MASK_TOKEN) == tm.MASK_TOKEN_ID
    text = "Hello, wörld! 你好\n\tdef f(x): return x ** 2  # ok"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, no BOS
    assert tok.decode(ids) == text
    assert tok(tm.EOS_TOKEN + tm.MASK_TOKEN)["input_ids"] == [tm.EOS_TOKEN_ID, tm.MASK_TOKEN_ID]
    assert tok.decode([tm.EOS_TOKEN_ID, 72], skip_special_tokens=True) == "H"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "user: hi\nassistant: "


def _hf_greedy(model_dir: str, prompt: str, n: int) -> tuple[list[int], list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    bad = ("missing_keys", "unexpected_keys", "mismatched_keys")
    assert not any(info.get(k) for k in bad), info
    x = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(
        x, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=tm.EOS_TOKEN_ID
    )
    return x[0].tolist(), out[0, x.shape[1] :].tolist()


@pytest.mark.parametrize("name", ["qwen3-random", "llama-random"])
def test_random_target_transformers_varied(ckpts, name):
    for prompt in PROMPTS[:2]:
        _, gen = _hf_greedy(ckpts[name][0], prompt, 48)
        assert len(set(gen)) >= 12, gen
        assert max(gen) < tm.EOS_TOKEN_ID  # specials have zero lm_head rows


@pytest.mark.parametrize("name", ["qwen3-oracle", "llama-oracle"])
def test_oracle_target_transformers_repeats(ckpts, name):
    for prompt in PROMPTS:
        ids, gen = _hf_greedy(ckpts[name][0], prompt, 16)
        assert gen == [ids[-1]] * 16


def test_drafter_checkpoint_layout(ckpts):
    from safetensors import safe_open

    target, drafter = ckpts["qwen3-random"]
    tcfg = json.loads(Path(target, "config.json").read_text())
    cfg = json.loads(Path(drafter, "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["hidden_size"] == tcfg["hidden_size"]
    assert cfg["vocab_size"] == tcfg["vocab_size"]
    assert cfg["block_size"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": tm.MASK_TOKEN_ID,
                                    "target_layer_ids": [1, 2], "block_size": 8}
    assert not Path(drafter, "mask_embedding.pt").exists()  # the target's <|MASK|> row
    with safe_open(str(Path(drafter, "model.safetensors")), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in shapes)
    assert shapes["fc.weight"] == (128, 2 * 128)
    assert {"hidden_norm.weight", "norm.weight"} <= set(shapes)
    per_layer = {k.split(".", 2)[2] for k in shapes if k.startswith("layers.0.")}
    assert per_layer == {
        f"self_attn.{n}.weight"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    } | {f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")} | {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    assert len(shapes) == 3 + 2 * len(per_layer)


def _digest(d: str) -> str:
    return hashlib.sha256(Path(d, "model.safetensors").read_bytes()).hexdigest()


def test_deterministic(ckpts, tmp_path):
    again = tm.make_pair(tmp_path / "a", "random", "qwen3")
    assert [_digest(d) for d in again] == [_digest(d) for d in ckpts["qwen3-random"]]
    other = tm.make_target(tmp_path / "b", seed=1)
    assert _digest(other) != _digest(ckpts["qwen3-random"][0])


def test_build_target_layer_ids():
    assert tm.build_target_layer_ids(4, 2) == [1, 2]
    assert tm.build_target_layer_ids(4, 3) == [0, 2, 3]
    assert tm.build_target_layer_ids(4, 1) == [2]
    assert tm.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # as DFlash
    assert tm.build_target_layer_ids(6, 3) == [1, 2, 3]
    assert tm.build_target_layer_ids(2, 2) == [0, 1]
    with pytest.raises(ValueError):
        tm.build_target_layer_ids(2, 3)


def test_bad_arguments(ckpts, tmp_path):
    target = ckpts["qwen3-random"][0]
    with pytest.raises(ValueError, match="head_dim"):
        tm.make_target(tmp_path / "t", head_dim=16, hidden_size=32)
    with pytest.raises(ValueError, match="vocab_size"):
        tm.make_target(tmp_path / "t", vocab_size=200)
    for ids in ([2, 1], [1, 1], [4], []):
        with pytest.raises(ValueError, match="target_layer_ids"):
            tm.make_dflash_drafter(tmp_path / "d", target, target_layer_ids=ids)
    with pytest.raises(ValueError, match="mask_token_id"):
        tm.make_dflash_drafter(tmp_path / "d", target, mask_token_id=320)
    with pytest.raises(ValueError, match="oracle target"):
        tm.make_dflash_drafter(tmp_path / "d", target, kind="oracle")


# --------------------------------------------------------------------------- #
# vLLM
# --------------------------------------------------------------------------- #


@dataclass
class Run:
    prompt_ids: list[list[int]]
    tokens: list[list[int]]
    metrics: dict[str, float | list[float]] = field(default_factory=dict)
    chat_text: str = ""
    draft_block_size: int | None = None

    def metric(self, name: str):
        return self.metrics.get(f"vllm:spec_decode_{name}", 0)


def _metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):
            prev = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + b for a, b in zip(prev, m.values)]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


@pytest.fixture(scope="module")
def vllm_run(vllm_patched):
    """``run(target, drafter=None) -> Run``, one engine per configuration."""
    from vllm import LLM, SamplingParams

    cache: dict[tuple, Run] = {}

    def run(target: str, drafter: str | None = None) -> Run:
        key = (target, drafter)
        if key in cache:
            return cache[key]
        kw = dict(
            model=target,
            dtype="float32",
            enforce_eager=True,
            disable_log_stats=False,
            max_model_len=512,
            seed=0,
        )
        if drafter is not None:
            kw["speculative_config"] = {
                "method": "dflash",
                "model": drafter,
                "num_speculative_tokens": K,
            }
        llm = LLM(**kw)
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            outs = llm.generate(PROMPTS, sp, use_tqdm=False)
            res = Run(
                prompt_ids=[list(o.prompt_token_ids) for o in outs],
                tokens=[list(o.outputs[0].token_ids) for o in outs],
                metrics=_metrics(llm),
            )
            if drafter is None:
                chat = llm.chat(
                    [{"role": "user", "content": "hi"}],
                    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                    use_tqdm=False,
                )
                res.chat_text = chat[0].prompt
            else:
                hf = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config
                res.draft_block_size = getattr(hf, "block_size", None)
        finally:
            del llm
            gc.collect()
        cache[key] = res
        return res

    return run


def test_vllm_random_target_greedy(ckpts, vllm_run):
    target = ckpts["qwen3-random"][0]
    r = vllm_run(target)
    for toks in r.tokens:
        assert len(toks) == MAX_TOKENS
        assert len(set(toks)) >= 8, toks
    assert r.chat_text == "user: hi\nassistant: "
    # Same model, same greedy tokens in transformers: the weights mean the same.
    assert r.tokens[0] == _hf_greedy(target, PROMPTS[0], MAX_TOKENS)[1]


def test_vllm_oracle_target_repeats(ckpts, vllm_run):
    r = vllm_run(ckpts["qwen3-oracle"][0])
    for ids, toks in zip(r.prompt_ids, r.tokens):
        assert toks == [ids[-1]] * MAX_TOKENS


def test_vllm_dflash_random_pair_is_lossless(ckpts, vllm_run):
    target, drafter = ckpts["qwen3-random"]
    base, spec = vllm_run(target), vllm_run(target, drafter)
    assert spec.tokens == base.tokens
    assert spec.metric("num_drafts") > 0
    assert spec.metric("num_draft_tokens") == K * spec.metric("num_drafts")
    assert spec.draft_block_size == 8  # reaches vLLM's hf_config (vLLM itself ignores it)


def test_vllm_dflash_oracle_pair_accepts_everything(ckpts, vllm_run):
    target, drafter = ckpts["qwen3-oracle"]
    spec = vllm_run(target, drafter)
    assert spec.tokens == vllm_run(target).tokens
    drafted = spec.metric("num_draft_tokens")
    assert drafted > 0
    assert spec.metric("num_accepted_tokens") == drafted
    n = spec.metric("num_drafts")
    assert spec.metric("num_accepted_tokens_per_pos") == [n] * K
    # (1 + K) tokens per round after the prefill token.
    assert n == len(PROMPTS) * -(-(MAX_TOKENS - 1) // (K + 1))


def test_vllm_dflash_noisy_oracle_partial_acceptance_is_lossless(ckpts, vllm_run):
    target, drafter = ckpts["qwen3-noisy"]
    base, spec = vllm_run(target), vllm_run(target, drafter)
    assert spec.tokens == base.tokens
    rate = spec.metric("num_accepted_tokens") / spec.metric("num_draft_tokens")
    assert 0.3 < rate < 0.99, rate
    per_pos = spec.metric("num_accepted_tokens_per_pos")
    assert per_pos[0] > per_pos[-1], per_pos  # rejections at several depths


def test_vllm_dflash_llama_oracle(ckpts, vllm_run):
    target, drafter = ckpts["llama-oracle"]
    spec = vllm_run(target, drafter)
    for ids, toks in zip(spec.prompt_ids, spec.tokens):
        assert toks == [ids[-1]] * MAX_TOKENS
    assert spec.metric("num_draft_tokens") > 0
    assert spec.metric("num_accepted_tokens") == spec.metric("num_draft_tokens")
