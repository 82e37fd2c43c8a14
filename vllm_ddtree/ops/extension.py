# SPDX-License-Identifier: Apache-2.0
"""Loading an optional compiled library: import it, check that it registered
its operator."""

from __future__ import annotations

import functools
import importlib

import torch

__all__ = ["load_extension"]


@functools.cache
def load_extension(
    module: str, operator: str, namespace: str
) -> tuple[object | None, str | None]:
    """Imports ``module`` and checks that it registered ``operator``.

    Returns ``(torch.ops.<namespace>, None)`` on success and ``(None, why)``
    otherwise; never raises. The outcome is cached (``load_extension.cache_clear()``
    forgets it).
    """
    try:
        importlib.import_module(module)
        ops = getattr(torch.ops, namespace)
        getattr(ops, operator)  # raises if the library did not register it
    except Exception as exc:  # ImportError, OSError (ABI mismatch), AttributeError
        return None, f"{type(exc).__name__}: {exc}"
    return ops, None
