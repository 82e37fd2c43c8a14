# SPDX-License-Identifier: Apache-2.0
"""setup.py never fails the install: without a working C++ compiler the package
builds without its compiled extensions, and says so.

The check builds a wheel (the same ``build_ext`` run an editable install makes)
rather than installing: ``pip install`` would first uninstall the environment's
own editable vllm-ddtree, whatever ``--prefix`` says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_build_without_a_compiler(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "setup.py", src)
    shutil.copytree(REPO / "csrc", src / "csrc")
    shutil.copytree(
        REPO / "vllm_ddtree",
        src / "vllm_ddtree",
        ignore=shutil.ignore_patterns("*.so", "__pycache__", "drafter"),
    )
    env = dict(os.environ, CXX="/bin/false", CC="/bin/false", PIP_NO_INDEX="1")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation",
         "--no-deps", "-w", str(tmp_path / "wheels"), str(src)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "vllm-ddtree: compiled extensions skipped" in output, output[-4000:]
    wheels = list((tmp_path / "wheels").glob("vllm_ddtree-*.whl"))
    assert len(wheels) == 1, output[-4000:]
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
    assert "vllm_ddtree/tree.py" in names
    assert not [n for n in names if n.endswith(".so")], names
