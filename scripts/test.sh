#!/usr/bin/env bash
# Installs everything (first run) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q tests "$@"
