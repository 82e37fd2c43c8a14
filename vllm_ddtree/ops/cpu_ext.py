# SPDX-License-Identifier: Apache-2.0
"""The CPU extension ``vllm_ddtree._C_cpu`` (sources in ``csrc/cpu/``): loader.

``setup.py`` builds it wherever torch and a C++ compiler are present. :func:`load`
never raises; it returns ``None`` when the extension is missing or cannot be loaded,
and :func:`vllm_ddtree.tree.build_ddtree` then uses its torch builder.

Operators (``torch.ops.vllm_ddtree``):

* ``build_tree_cpu``: the DDTree of every request, field for field the
  :class:`vllm_ddtree.tree.DraftTree` of :func:`vllm_ddtree.tree.build_ddtree`
  (best-first heap per request, compiled; see ``csrc/cpu/tree_build.cpp``).
"""

from __future__ import annotations

from vllm_ddtree.ops.extension import load_extension

__all__ = ["load", "load_error"]

EXTENSION = "vllm_ddtree._C_cpu"
NAMESPACE = "vllm_ddtree"


def load():
    """The ``torch.ops.vllm_ddtree`` namespace if the extension loads, else ``None``."""
    return load_extension(EXTENSION, "build_tree_cpu", NAMESPACE)[0]


def load_error() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it loaded)."""
    return load_extension(EXTENSION, "build_tree_cpu", NAMESPACE)[1]
