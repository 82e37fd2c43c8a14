# SPDX-License-Identifier: Apache-2.0
"""A failing engine test does not make the next one fail.

vLLM's in-process engine tears down the process's distributed state when it is
finalized; an engine alive when its test fails used to be finalized inside a
later engine's start-up ("pipeline model parallel group is not initialized").
``conftest.py`` shuts down every engine made during a failing test and every
engine alive at the end of its module. Checked in a pytest of its own (this
suite's ``conftest.py``, a tiny pair): an engine whose ddtree drafter raises
inside a step, then two more engines. Without the shut-downs the second test
fails (seen).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

SESSION = """
import gc

import pytest

from vllm_ddtree import tiny_models

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, vllm_patched):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_models.make_target(root / "target")
    drafter = tiny_models.make_dflash_drafter(
        root / "drafter", target, block_size=4, num_layers=1
    )
    return target, drafter


def test_an_engine_fails_inside_a_step(pair, scripted_drafter):
    def script(*args):
        raise KeyError("a drafter script that fails inside a step")

    scripted_drafter(script)
    spec = {"method": "ddtree", "model": pair[1], "num_speculative_tokens": 4}
    llm = vllm.LLM(
        model=pair[0], dtype="float32", enforce_eager=True, speculative_config=spec
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], vllm.SamplingParams(max_tokens=4), use_tqdm=False)


def test_the_next_engines_serve(pair):
    for _ in range(2):
        llm = vllm.LLM(model=pair[0], dtype="float32", enforce_eager=True)
        out = llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}], vllm.SamplingParams(max_tokens=4), use_tqdm=False
        )
        assert len(out[0].outputs[0].token_ids) == 4
        del llm
        gc.collect()
"""


def test_a_failing_engine_does_not_break_the_next_test(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_session.py").write_text(SESSION)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = run.stdout[-3000:]
    assert "FAILED test_session.py::test_an_engine_fails_inside_a_step" in tail, tail
    assert "PASSED test_session.py::test_the_next_engines_serve" in tail, tail
