# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests that run vLLM in child processes (server, multiprocess engine)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str | os.PathLike, lines: int = 60) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"<no log: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def child_env(**overrides: str) -> dict[str, str]:
    """The environment of a vLLM child process, as a user would start it.

    TRITON_INTERPRET (set by conftest for in-process kernel tests) and the
    in-process engine default are dropped; a 1 GiB KV cache keeps it small.
    """
    env = dict(os.environ)
    for key in ("TRITON_INTERPRET", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(key, None)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def run_child_script(code: str, args: dict, workdir: Path, name: str, env: dict[str, str],
                     timeout: float) -> dict:
    """Runs ``code`` (a script with a ``__main__`` guard) as ``python script in.json out.json``.

    The script reads its arguments from ``in.json`` and writes a JSON result to
    ``out.json``. Raises AssertionError with the log tail when it fails.
    """
    script = workdir / f"{name}.py"
    script.write_text(code)
    inp, out, log = (workdir / f"{name}.{s}" for s in ("in.json", "out.json", "log"))
    inp.write_text(json.dumps(args))
    with open(log, "wb") as f:
        try:
            proc = subprocess.run([sys.executable, str(script), str(inp), str(out)],
                                  stdout=f, stderr=subprocess.STDOUT, env=env,
                                  cwd=str(workdir), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} timed out after {timeout} s; log tail:\n{tail(log)}")
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"{name} failed (rc={proc.returncode}); log tail:\n{tail(log)}")
    return json.loads(out.read_text())
