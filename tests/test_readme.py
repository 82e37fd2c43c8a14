# SPDX-License-Identifier: Apache-2.0
"""The README's examples, extracted from it so the two cannot drift: the Python
example runs on CPU (hub model names swapped for the tiny pair), and every
command's speculative config holds only keys ddtree accepts, GPU commands with
the opt-in."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from vllm_ddtree import tiny_models
from vllm_ddtree.vllm_adapter.checks import UNVALIDATED_GPU_ENV
from vllm_ddtree.vllm_adapter.config import DDTREE_KEYS

README = Path(__file__).resolve().parent.parent / "README.md"
HUB_TARGET = "Qwen/Qwen3-8B"
HUB_DRAFTER = "z-lab/Qwen3-8B-DFlash-b16"
# What a speculative config of the README may hold besides the ddtree_* keys.
VLLM_KEYS = {"method", "model", "num_speculative_tokens"}


def code_blocks(language: str) -> list[str]:
    text = README.read_text()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands() -> list[str]:
    """The README's shell commands (continuation lines joined, comments out)."""
    out = []
    for block in code_blocks("bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [line.strip() for line in joined.splitlines()
                if line.strip() and not line.strip().startswith("#")]
    return out


def test_every_ddtree_key_the_readme_names_exists():
    named = set(re.findall(r"`(ddtree_[a-z_]+)`", README.read_text()))
    assert named, "the README names no ddtree_* key"
    assert named <= set(DDTREE_KEYS), named - set(DDTREE_KEYS)


def test_server_commands_hold_accepted_keys_and_the_gpu_opt_in():
    """(tests/test_server.py starts the CPU command's server.)"""
    served = [c for c in commands() if "--speculative-config" in c]
    cpu_commands = []
    for command in served:
        words = shlex.split(command)
        spec = json.loads(words[words.index("--speculative-config") + 1])
        assert spec["method"] == "ddtree", command
        assert set(spec) <= VLLM_KEYS | set(DDTREE_KEYS), command
        assert spec["model"] == HUB_DRAFTER and isinstance(
            spec["num_speculative_tokens"], int)
        cpu = f"{UNVALIDATED_GPU_ENV}=1" not in words
        cpu_commands.append(cpu)
    # One command as a CPU user runs it, one with the GPU opt-in.
    assert True in cpu_commands and False in cpu_commands


def test_python_example_runs_on_cpu(tmp_path, monkeypatch, vllm_patched):
    vllm = pytest.importorskip("vllm")
    (example,) = [b for b in code_blocks("python") if "speculative_config" in b]
    assert HUB_TARGET in example and HUB_DRAFTER in example
    target = tiny_models.make_target(tmp_path / "target", kind="oracle", seed=1)
    drafter = tiny_models.make_dflash_drafter(
        tmp_path / "drafter", target, kind="oracle", block_size=5, seed=2)
    example = example.replace(HUB_TARGET, str(target))
    example = example.replace(HUB_DRAFTER, str(drafter))
    engines = []
    real_llm = vllm.LLM

    def tiny_llm(*args, **kwargs):
        # The tiny pair's sizes; everything the README passes is kept.
        kwargs = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                  **kwargs}
        engines.append(real_llm(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(vllm, "LLM", tiny_llm)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example, str(README), "exec"), {})
    (llm,) = engines
    spec = llm.llm_engine.vllm_config.speculative_config
    assert spec.ddtree is not None  # the README's engine runs ddtree
    assert printed.getvalue().strip(), "the example printed nothing"
    del llm, engines[:]
