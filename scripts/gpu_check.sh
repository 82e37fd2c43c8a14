#!/usr/bin/env bash
# One-shot GPU check (run on a bare GPU machine: torch + triton + nvcc present, no
# internet, no vLLM). Builds the CUDA extension, runs every kernel parity test on
# CUDA, times the kernels against the torch reference, and writes everything to
# ${OUT:-gpu_check_out}/. Finishes in a few minutes on an H200.
#   bash scripts/gpu_check.sh
# Not covered here: the vLLM end-to-end test (vllm==0.32.0 is not on the device
# image and its wheel is too large to carry); run tests/test_e2e_cpu.py where
# vllm==0.32.0 is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== build the CUDA extension"
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16 \
  "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"
"$PY" -c "from vllm_ddtree.ops import cuda_ext; print('extension loaded:', cuda_ext.load() is not None, cuda_ext.load_error())" 2>&1 | tee -a "$OUT/build.log"

echo "== kernel parity tests on CUDA"
"$PY" -m pytest -q -rs tests/test_cuda_sources.py tests/test_triton_verify.py \
  tests/test_tree_build.py tests/test_verify.py tests/test_commit.py \
  tests/test_tree_attention.py tests/test_mla_tree_attention.py tests/test_tree_gdn.py \
  tests/test_kv_commit.py \
  tests/test_gpu_attention.py tests/test_gpu_mla_attention.py \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25

echo "== kernel timings (first: what a first run compiles, from an empty Triton cache)"
TRITON_CACHE_DIR="$(mktemp -d)" "$PY" scripts/gpu_kernel_timing.py --out "$OUT/kernel_timing.json" 2>&1 | tee "$OUT/kernel_timing.log"
