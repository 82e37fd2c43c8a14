#!/usr/bin/env bash
# Installs everything (first run) and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # ddtree's GPU path has never run on a GPU: it starts only when opted in.
    echo "demo: a GPU is present; ddtree's GPU path is experimental (never run on a GPU):" \
        "running with VLLM_DDTREE_UNVALIDATED_GPU=1" >&2
    export VLLM_DDTREE_UNVALIDATED_GPU="${VLLM_DDTREE_UNVALIDATED_GPU:-1}"
fi
exec .venv/bin/python -m vllm_ddtree.demo "$@"
