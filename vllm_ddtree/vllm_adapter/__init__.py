# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.32 adapter: turns the version-independent core into ``"method": "ddtree"``.

Everything that touches vLLM internals lives in this package; the tree, the
verification and the commit math (``vllm_ddtree.tree``, ``.verify``, ``.commit``)
do not import vLLM. docs/plugin.md describes what the plugin changes in vLLM.
"""
