# SPDX-License-Identifier: Apache-2.0
"""DDTree speculative decoding for vLLM: draft trees from DFlash block drafts.

Paper: https://arxiv.org/abs/2604.12989
"""

__version__ = "0.2.0"  # CHANGELOG.md; setup.py reads it

from vllm_ddtree.tree import (
    DraftTree,
    build_ddtree,
    draft_top_k,
    tree_from_parents,
)

__all__ = [
    "__version__",
    "DraftTree",
    "build_ddtree",
    "draft_top_k",
    "tree_from_parents",
    "register",
]


def register() -> None:
    """vLLM general-plugin entry point (``vllm.general_plugins``).

    Runs in every process vLLM starts (frontend, engine core, workers) and makes
    ``speculative_config={"method": "ddtree", ...}`` available.
    """
    import logging

    from vllm_ddtree.vllm_adapter.patches import install

    # This package's log lines go through vLLM's handlers and level (in-tree
    # its modules are under ``vllm.``): without a handler of its own, Python
    # would drop their INFO lines.
    logging.getLogger(__name__).parent = logging.getLogger("vllm")
    install()
