# SPDX-License-Identifier: Apache-2.0
"""The compiled CPU tree builder (csrc/cpu/tree_build.cpp, ``vllm_ddtree._C_cpu``),
:func:`vllm_ddtree.ops.cpu_ext.build_ddtree_cpu`. Plugin only.

Every builder test of test_tree_build.py runs here again on it (the ``build``
fixture below: reference heap, brute force, checks); these add what only it
needs: that it is built wherever it can be, equality with the torch builder at
sizes past the reference's reach and on raw top-k inputs, its refusals, and that
the plugin's proposer uses it.
"""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_tree_build import (  # noqa: F401  (collected again, with `build` below)
    assert_same_tree,
    random_logits,
    test_bad_input,
    test_max_children_limits_ranks_per_depth,
    test_max_children_rejects_bad_values,
    test_node_set_is_top_budget_by_brute_force,
    test_per_request_budgets,
    test_position_offsets_are_depths,
    test_random_sweep_vectorized_equals_reference,
    test_tree_invariants,
    test_vectorized_equals_reference,
)

from vllm_ddtree.ops import cpu_ext
from vllm_ddtree.tree import build_ddtree, draft_top_k

CPP_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cpu" / "tree_build.cpp"


def require_cpp() -> None:
    if not cpu_ext.available():
        pytest.skip(
            f"the compiled CPU tree builder is not available: {cpu_ext.load_error()}"
        )


@pytest.fixture
def build():
    """test_tree_build.py's tests run on the compiled builder."""
    require_cpp()
    return cpu_ext.build_ddtree_cpu


def test_cpp_builder_is_built_where_a_compiler_exists():
    """A broken C++ build must not pass CI silently as 'skipped'."""
    if not CPP_SOURCE.exists():
        pytest.skip(f"this tree does not ship {CPP_SOURCE.name}")
    if os.environ.get("VLLM_DDTREE_NO_CPP") == "1":
        pytest.skip("VLLM_DDTREE_NO_CPP=1: the extension was not built on purpose")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: setup.py cannot build the CPU extension")
    assert cpu_ext.available(), cpu_ext.load_error()
    logits = random_logits(0, 1, 2, 3, "random")
    assert cpu_ext.build_ddtree_cpu(logits, 2).num_nodes.item() == 2


def test_cpp_equals_torch_on_large_random_trees():
    """Sizes past the reference's reach: B up to 512, L = 15, V = 1000, 32-bit
    words of the packed mask crossed many times."""
    require_cpp()
    for seed, (num_reqs, budget, kind) in enumerate(
        [(3, 512, "random"), (4, 257, "ties"), (2, 300, "certain"), (5, 33, "random")]
    ):
        logits = random_logits(300 + seed, num_reqs, 15, 1000, kind) * 0.5
        roots = torch.arange(num_reqs) + 7
        budgets = torch.randint(0, budget + 1, (num_reqs,))
        for b in (budget, budgets):
            kwargs = {"max_budget": budget} if isinstance(b, torch.Tensor) else {}
            assert_same_tree(
                cpu_ext.build_ddtree_cpu(logits, b, roots, **kwargs),
                build_ddtree(logits, b, roots, **kwargs),
            )


def test_cpp_equals_torch_on_raw_top_k_inputs():
    """What the proposer may pass with validate=False: a wider, non-contiguous
    top-k slice, int32 ids, -inf log-probs (masked vocabulary), budgets outside
    [0, max_budget]."""
    require_cpp()
    logits = random_logits(9, 4, 6, 50, "random")
    lp, ids = draft_top_k(logits, 40)
    lp[1, 2, 3:] = float("-inf")  # request 1: 3 tokens possible at depth 3
    lp[2, 0, 1:] = float("-inf")  # request 2: a chain at depth 1
    lp[3, 4, :] = float("-inf")  # request 3: nothing below depth 4
    top_k = (lp, ids.to(torch.int32))
    budgets = torch.tensor([-3, 80, 25, 500])
    trees = [
        builder(
            logits,
            budgets,
            torch.tensor([1, 2, 3, 4]),
            max_budget=30,
            top_k=top_k,
            max_children=k,
            validate=False,
        )
        for k in (None, 2)
        for builder in (cpu_ext.build_ddtree_cpu, build_ddtree)
    ]
    assert_same_tree(trees[0], trees[1])
    assert_same_tree(trees[2], trees[3])
    assert trees[0].num_nodes[0] == 0 and trees[0].num_nodes[3] == 30
    assert int(trees[0].depths[3].max()) == 4  # -inf ends request 3 at depth 4
    assert not torch.isinf(trees[0].scores[1:, 1:][trees[0].parents[1:, 1:] >= 0]).any()


def test_cpp_builder_refuses_what_it_cannot_run():
    meta = torch.zeros(1, 2, 3, device="meta")
    with pytest.raises(ValueError, match="build_ddtree_cpu needs CPU tensors"):
        cpu_ext.build_ddtree_cpu(meta, 2, validate=False)
    require_cpp()
    op = cpu_ext.load().build_tree_cpu
    lp, ids = draft_top_k(random_logits(0, 2, 3, 4, "random"), 4)
    budgets, roots = torch.tensor([2, 2]), torch.tensor([0, 0])
    with pytest.raises(RuntimeError, match="log_probs must be a contiguous"):
        op(lp.double(), ids, budgets, roots, 2)
    with pytest.raises(RuntimeError, match="token_ids must be a contiguous int64"):
        op(lp, ids.int(), budgets, roots, 2)
    with pytest.raises(RuntimeError, match="budgets must be"):
        op(lp, ids, budgets[:1], roots, 2)


def test_cpp_stops_where_the_finite_nodes_run_out():
    """A budget above the number of finite-score nodes: -inf nodes never enter."""
    require_cpp()
    logits = random_logits(9, 2, 3, 4, "random")
    lp, ids = draft_top_k(logits, 4)
    lp[0, 1, 2:] = float("-inf")  # 4 + 4 * 2 + 8 * 4 = 44 finite nodes
    lp[1, 0, 1:] = float("-inf")  # one finite root child ...
    lp[1, 1, :] = float("-inf")  # ... and nothing below it: 1 finite node
    trees = [
        builder(logits, 60, top_k=(lp, ids), validate=False)
        for builder in (cpu_ext.build_ddtree_cpu, build_ddtree)
    ]
    assert_same_tree(*trees)
    assert trees[0].num_nodes.tolist() == [44, 1]


def test_plugin_proposer_builds_cpu_trees_with_the_compiled_heap(monkeypatch):
    """The plugin's proposer (plugin_runner.enable_ddtree creates it) builds CPU
    trees with build_ddtree_cpu, the same trees as the series' proposer."""
    require_cpp()
    from vllm_ddtree.vllm_adapter import proposer
    from vllm_ddtree.vllm_adapter.plugin_proposer import PluginDDTreeProposer

    drafter = object.__new__(PluginDDTreeProposer)  # no engine: only the build
    drafter.ddtree = SimpleNamespace(budget=12, max_children=3)
    logits, roots = random_logits(5, 3, 4, 20, "random"), torch.tensor([4, 5, 6])
    want = proposer.DDTreeProposer._build_tree(drafter, logits, roots)
    assert_same_tree(want, build_ddtree(logits, 12, roots, max_children=3))
    compiled, calls = cpu_ext.build_ddtree_cpu, []
    monkeypatch.setattr(
        cpu_ext,
        "build_ddtree_cpu",
        lambda *a, **kw: calls.append(a) or compiled(*a, **kw),
    )
    assert_same_tree(drafter._build_tree(logits, roots), want)
    assert len(calls) == 1 and calls[0][0] is logits
