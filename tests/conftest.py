# SPDX-License-Identifier: Apache-2.0
"""Test-session set-up shared by every test module.

Without a GPU, Triton kernels run only in the interpreter, and TRITON_INTERPRET
must be set before anything (vLLM included) imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
