# SPDX-License-Identifier: Apache-2.0
"""The CUDA tree verification sources (csrc/) and their Python wrapper.

* compile check: ``csrc/tree_verify_compile_check.cu`` (the header and every
  template instantiation) with plain nvcc, and the torch binding
  (``csrc/tree_verify.cu``, ``csrc/bindings.cpp``: libtorch's stable ABI, as
  vLLM's own kernels) against the installed torch's headers, when nvcc is on
  PATH;
* host emulation: the kernel header compiled with g++ against a tiny CUDA shim
  (threads, barriers, warp shuffles) and run on CPU against the torch reference,
  so the kernel logic is tested on machines without a GPU;
* loader: ``cuda_ext.load()`` degrades to ``None`` and ``tree_verify_cuda`` raises
  a clear error without the extension;
* GPU parity (needs CUDA and the built extension): the extension against
  :func:`vllm_ddtree.verify.verify_tree_torch`, output for output.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_ddtree.ops import available_backends, cuda_ext, kernel_inputs, resolve_backend
from vllm_ddtree.sampling import TreeSamplingParams
from vllm_ddtree.tree import DraftTree, build_ddtree, tree_from_parents
from vllm_ddtree.verify import METHOD_IDS, verify_tree, verify_tree_torch

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "csrc"
METHODS = ("sample_walk", "rejection")
TOP_COIN = 1.0 - 2.0**-24  # the largest float32 below 1


# --------------------------------------------------------------------------- cases


def random_case(
    seed: int,
    num_reqs: int = 4,
    depth: int = 5,
    vocab: int = 64,
    budget: int = 20,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0, 1.5, 0.3, 1e-6),
) -> tuple[DraftTree, torch.Tensor, TreeSamplingParams, tuple[torch.Tensor, torch.Tensor]]:
    """A built DDTree and target logits correlated with the drafter (deep walks)."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(num_reqs, depth, vocab, generator=g) * 3
    tree = build_ddtree(draft, budget, torch.randint(0, vocab, (num_reqs,), generator=g))
    rows = tree.num_rows
    # Row i predicts the token after node i: draft position depth(i).
    pos = tree.depths.clamp(max=depth - 1)
    logits = draft[torch.arange(num_reqs).unsqueeze(1), pos] * 1.5
    logits = logits + torch.randn(num_reqs, rows, vocab, generator=g) * 0.5
    temps = torch.tensor([temperatures[(i + seed) % len(temperatures)] for i in range(num_reqs)])
    coins = (torch.rand(num_reqs, rows, generator=g), torch.rand(num_reqs, generator=g))
    device = torch.device(device)
    return (
        tree.to(device),
        logits.to(dtype=dtype, device=device),
        TreeSamplingParams(temperature=temps.to(device)),
        (coins[0].to(device), coins[1].to(device)),
    )


def coin_sets(coins):
    node, final = coins
    yield "random", coins
    yield "zero", (torch.zeros_like(node), torch.zeros_like(final))
    yield "top", (torch.full_like(node, TOP_COIN), torch.full_like(final, TOP_COIN))


def kill_children(tree: DraftTree, logits: torch.Tensor, seed: int) -> torch.Tensor:
    """Sets -inf on the target logits of random children tokens (zero-mass drafts)."""
    g = torch.Generator().manual_seed(seed)
    out = logits.clone()
    parents, tokens = tree.parents.cpu(), tree.tokens.cpu()
    for b in range(tree.num_reqs):
        for i in range(tree.num_rows):
            for k in (parents[b] == i).nonzero().flatten().tolist():
                if torch.rand(1, generator=g).item() < 0.6:
                    out[b, i, tokens[b, k]] = float("-inf")
    return out


def star_case(seed: int, device="cpu"):
    """60 children at the root (a long exclusion list), then a short chain."""
    g = torch.Generator().manual_seed(seed)
    vocab = 128
    parents, tokens = [], []
    for _ in range(3):
        kids = torch.randperm(vocab, generator=g)[:60].tolist()
        parents.append([-1] + [0] * 60 + [1, 1, 61])
        tokens.append([5] + kids + [3, 4, 9])
    tree = tree_from_parents(parents, tokens, max_depth=3)
    logits = torch.randn(3, tree.num_rows, vocab, generator=g) * 3
    for b in range(3):
        logits[b, 0, torch.tensor(tokens[b][1:61])] += 4.0
    params = TreeSamplingParams(temperature=torch.tensor([0.0, 1.0, 0.6]))
    coins = (torch.rand(3, tree.num_rows, generator=g), torch.rand(3, generator=g))
    device = torch.device(device)
    return (tree.to(device), logits.to(device), TreeSamplingParams(params.temperature.to(device)),
            (coins[0].to(device), coins[1].to(device)))


def boundary_case(coin: float, device="cpu"):
    """e in {0, 1} on 4 live tokens: coins k/4 land exactly on CDF steps."""
    vocab = 16
    tree = tree_from_parents([[-1, 0, 1, 0]], [[0, 4, 5, 11]], max_depth=2)
    logits = torch.full((1, 4, vocab), float("-inf"))
    logits[:, :, [1, 4, 5, 11]] = 0.0
    params = TreeSamplingParams(temperature=torch.tensor([1.0]))
    coins = (torch.full((1, 4), coin), torch.tensor([coin]))
    device = torch.device(device)
    return (tree.to(device), logits.to(device), TreeSamplingParams(params.temperature.to(device)),
            (coins[0].to(device), coins[1].to(device)))


def assert_same(out, ref, what: str) -> None:
    accepted, committed, num_accepted = out
    if not (
        torch.equal(accepted.cpu(), ref.accepted_indices.cpu())
        and torch.equal(committed.cpu(), ref.committed_tokens.cpu())
        and torch.equal(num_accepted.cpu(), ref.num_accepted.cpu())
    ):
        raise AssertionError(
            f"{what}: kernel != torch reference\n"
            f"accepted  kernel {accepted.tolist()}\n"
            f"          ref    {ref.accepted_indices.tolist()}\n"
            f"committed kernel {committed.tolist()}\n"
            f"          ref    {ref.committed_tokens.tolist()}"
        )


# ----------------------------------------------------------------- compile check


def _nvcc_release(nvcc: str) -> tuple[int, int]:
    proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    match = re.search(r"release (\d+)\.(\d+)", proc.stdout)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


# c++20 is what torch's BuildExtension uses for the extension itself.
@pytest.mark.parametrize("std", ["c++17", "c++20"])
def test_header_compiles_with_nvcc(tmp_path, std):
    """nvcc -c -std=... -arch=sm_90 csrc/tree_verify_compile_check.cu (a few seconds)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    if std == "c++20" and _nvcc_release(nvcc) < (12, 0):
        pytest.skip("nvcc < 12.0 has no -std=c++20")
    out = tmp_path / "tree_verify_compile_check.o"
    cmd = [nvcc, "-c", f"-std={std}", "-arch=sm_90", "-o", str(out),
           str(CSRC / "tree_verify_compile_check.cu")]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed after {elapsed:.0f}s:\n{proc.stderr}{proc.stdout}")
    assert out.stat().st_size > 0


@pytest.mark.parametrize("source", ["tree_verify.cu", "bindings.cpp"])
def test_binding_compiles_against_the_stable_abi(tmp_path, source):
    """The host side against the installed torch's headers (nvcc -c; ~20 s): the
    same file vLLM builds in-tree, so the stable-ABI calls are checked here."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()] + [
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{CSRC}",
    ]
    out = tmp_path / "binding.o"
    cmd = [nvcc, "-c", "-std=c++17", "-arch=sm_90", "-DUSE_CUDA", "-x", "cu",
           *includes, "-o", str(out), str(CSRC / source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}{proc.stdout}"
    assert out.stat().st_size > 0


def test_header_is_torch_free():
    header = (CSRC / "tree_verify.cuh").read_text()
    assert "#pragma once" in header
    includes = [line for line in header.splitlines() if line.startswith("#include")]
    assert includes and not any("torch" in line or "ATen" in line or "c10" in line
                                for line in includes), includes
    check = (CSRC / "tree_verify_compile_check.cu").read_text()
    for dtype in ("float", "__half", "__nv_bfloat16"):
        assert f"DDTREE_INSTANTIATE_DTYPE({dtype})" in check


# ---------------------------------------------------------------- host emulation

# Just enough CUDA for tree_verify.cuh on the host: a block is BLOCK_THREADS
# std::threads, __syncthreads a std::barrier, warp shuffles go through a per-warp
# exchange buffer. `__shared__` becomes function-static (blocks run one by one).
_SHIM = r"""
#pragma once
#include <barrier>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
using std::isnan;
struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 { unsigned x, y, z, w; };
typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) {
  *v = 227 * 1024;
  return cudaSuccess;
}
template <typename F> cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) {
  return cudaSuccess;
}
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
inline float __half2float(__half h) {
  uint32_t s = (h.x >> 15) & 1, e = (h.x >> 10) & 31, m = h.x & 1023;
  float v;
  if (e == 0) v = std::ldexp((float)m, -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp((float)(m | 1024), (int)e - 25);
  return s ? -v : v;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.x << 16; float f; std::memcpy(&f, &u, 4); return f;
}
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
struct EmuWarp { std::barrier<> bar{32}; uint64_t slot[32]; };
extern std::barrier<>* emu_block_bar;
extern EmuWarp* emu_warps;
extern std::vector<char> emu_dyn_smem;
inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
template <typename T> inline T emu_exchange(T v, unsigned src) {
  EmuWarp& w = emu_warps[threadIdx.x / 32];
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  w.slot[threadIdx.x % 32] = bits;
  w.bar.arrive_and_wait();
  uint64_t got = w.slot[src % 32];
  w.bar.arrive_and_wait();
  T out; std::memcpy(&out, &got, sizeof(T)); return out;
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src) {
  return emu_exchange(v, (unsigned)src); }
template <typename T> inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  unsigned lane = threadIdx.x % 32; return emu_exchange(v, lane >= d ? lane - d : lane); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, unsigned d) {
  return emu_exchange(v, (threadIdx.x % 32) ^ d); }
inline unsigned __ballot_sync(unsigned, int pred) {
  EmuWarp& w = emu_warps[threadIdx.x / 32];
  w.slot[threadIdx.x % 32] = pred ? 1 : 0;
  w.bar.arrive_and_wait();
  unsigned r = 0; for (int i = 0; i < 32; ++i) if (w.slot[i]) r |= 1u << i;
  w.bar.arrive_and_wait();
  return r;
}
inline int __ffs(int x) { return __builtin_ffs(x); }
template <typename P>
cudaError_t cudaLaunchKernel(void (*k)(P), dim3 grid, dim3 block, void** args, size_t smem,
                             cudaStream_t) {
  using PT = std::remove_cv_t<P>;
  PT params = *reinterpret_cast<PT*>(args[0]);
  emu_dyn_smem.assign(smem + 16, 0x7f);  // garbage, as on a GPU
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    std::barrier<> bar(block.x);
    std::unique_ptr<EmuWarp[]> warps(new EmuWarp[block.x / 32]);
    emu_block_bar = &bar; emu_warps = warps.get();
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block.x; ++t)
      threads.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {bx, 0, 0}; k(params); });
    for (auto& t : threads) t.join();
  }
  return cudaSuccess;
}
"""

_DRIVER = r"""
#include "shim.h"
thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
std::barrier<>* emu_block_bar;
EmuWarp* emu_warps;
std::vector<char> emu_dyn_smem;
#include "tree_verify_emu.cuh"
using namespace ddtree;
template <typename D, uint32_t BT>
int run(int greedy_only, void* acc, void* com, void* num, const void* logits, const void* ri,
        long sr, long srow,
        const void* tok, const void* nt, const void* ns, const void* temp, const void* nc,
        const void* fc, int R, int rows, int V, int maxd, int method, double ts, double ta) {
  TreeVerifyParams<D> p{};
  p.accepted_indices = (int64_t*)acc; p.committed_tokens = (int64_t*)com;
  p.num_accepted = (int64_t*)num; p.logits = (const D*)logits;
  p.row_index = (const int64_t*)ri;
  p.logits_stride_req = sr; p.logits_stride_row = srow;
  p.tokens = (const int64_t*)tok; p.next_token = (const int64_t*)nt;
  p.next_sibling = (const int64_t*)ns; p.temperature = (const float*)temp;
  p.node_coins = (const float*)nc; p.final_coins = (const float*)fc;
  p.num_reqs = R; p.num_rows = rows; p.vocab_size = V; p.max_depth = maxd; p.method = method;
  p.threshold_single = ts; p.threshold_acc = ta;
  if (BT == kTreeVerifyBlockThreads) return (int)TreeVerify<D>(p, greedy_only != 0, nullptr);
  constexpr uint32_t kVec = 16 / sizeof(D);
  const bool vec = V % kVec == 0 && sr % kVec == 0 && srow % kVec == 0 &&
                   ((uintptr_t)logits) % 16 == 0;
  if (greedy_only)
    return vec ? (int)LaunchTreeVerifyKernel<BT, kVec, true, D>(p, nullptr)
               : (int)LaunchTreeVerifyKernel<BT, 1, true, D>(p, nullptr);
  return vec ? (int)LaunchTreeVerifyKernel<BT, kVec, false, D>(p, nullptr)
             : (int)LaunchTreeVerifyKernel<BT, 1, false, D>(p, nullptr);
}
extern "C" int emu_tree_verify(int dtype, int block, int greedy_only, void* acc, void* com,
    void* num, const void* logits, const void* ri, long sr, long srow, const void* tok, const void* nt,
    const void* ns, const void* temp, const void* nc, const void* fc, int R, int rows, int V,
    int maxd, int method, double ts, double ta) {
#define ARGS greedy_only, acc, com, num, logits, ri, sr, srow, tok, nt, ns, temp, nc, fc, R, rows, V, \
             maxd, method, ts, ta
  if (block == 1024) {
    if (dtype == 0) return run<float, 1024>(ARGS);
    if (dtype == 1) return run<__half, 1024>(ARGS);
    return run<__nv_bfloat16, 1024>(ARGS);
  }
  if (dtype == 0) return run<float, 64>(ARGS);
  if (dtype == 1) return run<__half, 64>(ARGS);
  return run<__nv_bfloat16, 64>(ARGS);
}
"""

_PROBE = r"""
#include <barrier>
#include <thread>
#include <vector>
int main() {
  std::barrier<> bar(1024);
  std::vector<std::thread> threads;
  for (int i = 0; i < 1024; ++i) threads.emplace_back([&] { bar.arrive_and_wait(); });
  for (auto& t : threads) t.join();
}
"""

_DYN_SMEM_DECL = "extern __shared__ int32_t tree_smem[];"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """ctypes handle of the kernel header compiled for the host, or skip."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on PATH")
    build = tmp_path_factory.mktemp("tree_verify_emu")
    # The emulator runs a block as 1024 threads: check the compiler and the thread
    # limit in a subprocess first (a failed std::thread would abort pytest).
    probe = build / "probe.cpp"
    probe.write_text(_PROBE)
    if subprocess.run([cxx, "-std=c++20", "-pthread", "-o", str(build / "probe"), str(probe)],
                      capture_output=True).returncode != 0:
        pytest.skip(f"{cxx} lacks C++20 <barrier>")
    if subprocess.run([str(build / "probe")], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("cannot start 1024 threads here")
    header = (CSRC / "tree_verify.cuh").read_text()
    # The one CUDA construct a macro cannot map: dynamic shared memory.
    assert header.count(_DYN_SMEM_DECL) == 1, "update the emulator with the header"
    header = header.replace(
        _DYN_SMEM_DECL,
        "int32_t* tree_smem = reinterpret_cast<int32_t*>(emu_dyn_smem.data());",
    )
    (build / "tree_verify_emu.cuh").write_text(header)
    (build / "shim.h").write_text(_SHIM)
    (build / "driver.cpp").write_text(_DRIVER)
    stubs = build / "stub_include"
    stubs.mkdir()
    for name in ("cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h"):
        (stubs / name).write_text("#pragma once\n")
    lib = build / "libtree_verify_emu.so"
    cmd = [cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-Wall",
           "-Wno-unknown-pragmas", "-Wno-unused", "-Werror=return-type", f"-I{stubs}",
           f"-I{build}", "-o", str(lib), str(build / "driver.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"host build of tree_verify.cuh failed:\n{proc.stderr}"
    handle = ctypes.CDLL(str(lib))
    handle.emu_tree_verify.restype = ctypes.c_int
    handle.emu_tree_verify.argtypes = (
        [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2
        + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 5 + [ctypes.c_double] * 2
    )
    return handle


_EMU_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def run_emulated(lib, tree, logits, temperature, coins, method, ts=1.0, ta=1.0, block=64,
                 greedy_only=False, row_index=None):
    if row_index is None:
        num_reqs, rows, vocab = logits.shape
        strides, ri = (logits.stride(0), logits.stride(1)), None
    else:  # [M, V] logits read through row_index [R, N + 1]
        (num_reqs, rows), vocab = row_index.shape, logits.shape[1]
        ri = row_index.contiguous()
        strides = (0, logits.stride(0))
    width = tree.max_depth + 1
    accepted = torch.full((num_reqs, width), -7, dtype=torch.int64)  # kernel must overwrite
    committed = torch.full((num_reqs, width), -7, dtype=torch.int64)
    num_accepted = torch.full((num_reqs,), -7, dtype=torch.int64)
    keep = [t.contiguous() for t in (tree.tokens, tree.retrieve_next_token,
                                     tree.retrieve_next_sibling)]
    temp = temperature.float().contiguous()
    node, final = coins[0].float().contiguous(), coins[1].float().contiguous()
    rc = lib.emu_tree_verify(
        _EMU_DTYPES[logits.dtype], block, int(greedy_only), accepted.data_ptr(),
        committed.data_ptr(), num_accepted.data_ptr(), logits.data_ptr(),
        None if ri is None else ri.data_ptr(), *strides, keep[0].data_ptr(), keep[1].data_ptr(), keep[2].data_ptr(),
        temp.data_ptr(), node.data_ptr(), final.data_ptr(), num_reqs, rows, vocab,
        tree.max_depth, METHOD_IDS[method], ts, ta)
    assert rc == 0, f"launcher returned cudaError {rc}"
    return accepted, committed, num_accepted


def emu_check(lib, tree, logits, params, coins, method, ts=1.0, ta=1.0, what="", **kw):
    ref = verify_tree_torch(tree, logits, params, method, coins, ts, ta)
    out = run_emulated(lib, tree, logits, params.temperature, coins, method, ts, ta, **kw)
    assert_same(out, ref, f"{what} method={method}")
    return ref


def test_emulated_random_trees(emulator):
    accepted = []
    for seed in range(9):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[seed % 3]
        vocab = (64, 100, 37, 256, 2056, 1)[seed % 6]  # 37, 1: scalar loads
        tree, logits, params, coins = random_case(seed, vocab=vocab, dtype=dtype)
        for method in METHODS:
            for name, c in coin_sets(coins):
                ref = emu_check(emulator, tree, logits, params, c, method,
                                what=f"seed={seed} {dtype} V={vocab} coins={name}")
                accepted += ref.num_accepted.tolist()
    assert max(accepted) >= 4  # the walks do go deep


def test_emulated_block_of_1024_threads(emulator):
    for seed, (vocab, dtype) in enumerate([(4160, torch.float32), (300, torch.bfloat16)]):
        tree, logits, params, coins = random_case(100 + seed, num_reqs=2, vocab=vocab, dtype=dtype)
        for method in METHODS:
            emu_check(emulator, tree, logits, params, coins, method, what=f"1024 seed={seed}",
                      block=1024)


def test_emulated_exact_cdf_boundaries(emulator):
    for method in METHODS:
        for coin in (0.0, 0.25, 0.5, 0.75, TOP_COIN):
            tree, logits, params, coins = boundary_case(coin)
            emu_check(emulator, tree, logits, params, coins, method, what=f"coin={coin}")


def test_emulated_zero_mass_children(emulator):
    for seed in range(4):
        tree, logits, params, coins = random_case(200 + seed, vocab=50)
        logits = kill_children(tree, logits, seed)
        for method in METHODS:
            for name, c in coin_sets(coins):
                emu_check(emulator, tree, logits, params, c, method,
                          what=f"zero-mass seed={seed} coins={name}")


def test_emulated_thresholds_greedy_only_and_star(emulator):
    tree, logits, params, coins = random_case(300, vocab=64)
    for ts, ta in ((0.3, 1.0), (1.0, 0.5), (0.05, 0.2)):
        emu_check(emulator, tree, logits, params, coins, "rejection", ts, ta,
                  what=f"thresholds {ts} {ta}")
    greedy = TreeSamplingParams.greedy(tree.num_reqs)
    for method in METHODS:
        emu_check(emulator, tree, logits, greedy, coins, method, what="greedy-only",
                  greedy_only=True)
    for seed in range(2):
        tree, logits, params, coins = star_case(seed)
        for method in METHODS:
            for c in (coins, (torch.full_like(coins[0], 0.999), coins[1])):
                emu_check(emulator, tree, logits, params, c, method, what=f"star seed={seed}")


def test_emulated_strided_and_processed_logits(emulator):
    tree, logits, params, coins = random_case(500, vocab=64)
    big = torch.randn(logits.shape[0], logits.shape[1], 67)
    big[..., :64] = logits
    view = big[..., :64]  # row stride 67: scalar loads
    for method in METHODS:
        emu_check(emulator, tree, view, params, coins, method, what="strided")
    topk = TreeSamplingParams(temperature=params.temperature, top_k=torch.tensor([3, 0, 5, 10]),
                              top_p=torch.tensor([0.9, 0.5, 1.0, 0.8]))
    processed, row_index, temperature = kernel_inputs(logits, None, topk)
    assert row_index is None
    for method in METHODS:
        ref = verify_tree_torch(tree, logits, topk, method, coins)
        out = run_emulated(emulator, tree, processed, temperature, coins, method)
        assert_same(out, ref, f"top-k/top-p method={method}")


def test_emulated_rows_read_in_place_through_row_index(emulator):
    """[M, V] logits (tree rows shuffled among unrelated rows, strided) read
    through row_index give the reference's result on the gathered rows."""
    tree, logits, params, coins = random_case(501, vocab=64)
    num_reqs, rows, vocab = logits.shape
    gen = torch.Generator().manual_seed(7)
    total = num_reqs * rows + 5
    perm = torch.randperm(total, generator=gen)[: num_reqs * rows]
    storage = torch.randn(total, vocab + 3, generator=gen)
    flat = storage[:, :vocab]  # row stride vocab + 3
    flat[perm] = logits.reshape(-1, vocab)
    row_index = perm.view(num_reqs, rows)
    for method in METHODS:
        ref = verify_tree_torch(tree, logits, params, method, coins)
        out = run_emulated(emulator, tree, flat, params.temperature, coins, method,
                           row_index=row_index)
        assert_same(out, ref, f"row_index method={method}")
        out = run_emulated(emulator, tree, flat, params.temperature, coins, method,
                           row_index=row_index, greedy_only=True)
        greedy = TreeSamplingParams.greedy(num_reqs)
        assert_same(out, verify_tree_torch(tree, logits, greedy, method, coins),
                    f"row_index greedy-only method={method}")


def test_emulated_empty_tree(emulator):
    tree = build_ddtree(torch.randn(2, 3, 10), 0)
    logits = torch.randn(2, 1, 10)
    params = TreeSamplingParams(temperature=torch.tensor([0.0, 1.0]))
    coins = (torch.rand(2, 1), torch.rand(2))
    for method in METHODS:
        emu_check(emulator, tree, logits, params, coins, method, what="empty tree")


# ------------------------------------------------------------------------ loader


def test_load_returns_none_without_extension(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_ddtree._C", None)  # import raises ImportError
    cuda_ext.load_extension.cache_clear()  # forget the cached load outcome
    try:
        assert cuda_ext.load() is None
        assert "vllm_ddtree._C" in cuda_ext.load_error()
        tree, logits, params, coins = random_case(0, num_reqs=1)
        with pytest.raises(RuntimeError, match=r"vllm_ddtree\._C.*not available"):
            cuda_ext.tree_verify_cuda(
                logits, tree.tokens, tree.retrieve_next_token, tree.retrieve_next_sibling,
                params.temperature, coins[0], coins[1], tree.max_depth, 1, 1.0, 1.0)
    finally:
        monkeypatch.undo()
        cuda_ext.load_extension.cache_clear()


def test_load_here_never_raises():
    op = cuda_ext.load()
    if importlib.util.find_spec("vllm_ddtree._C") is None:
        assert op is None and cuda_ext.load_error()
    assert "cuda" not in available_backends(torch.device("cpu"))
    with pytest.raises(ValueError, match="not available"):
        resolve_backend("cuda", torch.device("cpu"))


# -------------------------------------------------------------------- GPU parity

requires_cuda_ext = pytest.mark.skipif(
    not (torch.cuda.is_available() and cuda_ext.load() is not None),
    reason="needs a CUDA device and the built vllm_ddtree._C extension",
)


def run_cuda(tree, logits, temperature, coins, method, ts=1.0, ta=1.0):
    return cuda_ext.tree_verify_cuda(
        logits, tree.tokens, tree.retrieve_next_token, tree.retrieve_next_sibling, temperature,
        coins[0], coins[1], tree.max_depth, METHOD_IDS[method], ts, ta)


def cuda_check(tree, logits, params, coins, method, ts=1.0, ta=1.0, what="", greedy_only=False):
    ref = verify_tree_torch(tree, logits, params, method, coins, ts, ta)
    temperature = None if greedy_only else params.temperature
    out = run_cuda(tree, logits, temperature, coins, method, ts, ta)
    assert_same(out, ref, f"{what} method={method}")
    return ref


@requires_cuda_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 4099, 32000, 151936])
def test_cuda_matches_reference(dtype, vocab):
    accepted = []
    for seed in range(3):
        tree, logits, params, coins = random_case(
            seed, num_reqs=8, depth=6, vocab=vocab, budget=48, dtype=dtype, device="cuda")
        for method in METHODS:
            for name, c in coin_sets(coins):
                ref = cuda_check(tree, logits, params, c, method,
                                 what=f"seed={seed} V={vocab} {dtype} coins={name}")
                accepted += ref.num_accepted.tolist()
    assert max(accepted) >= 3


@requires_cuda_ext
def test_cuda_edge_cases():
    for method in METHODS:
        for coin in (0.0, 0.25, 0.5, 0.75, TOP_COIN):
            tree, logits, params, coins = boundary_case(coin, device="cuda")
            cuda_check(tree, logits, params, coins, method, what=f"boundary coin={coin}")
    for seed in range(4):
        tree, logits, params, coins = random_case(200 + seed, num_reqs=6, vocab=512,
                                                  dtype=torch.bfloat16, device="cuda")
        logits = kill_children(tree, logits, seed)
        for method in METHODS:
            for name, c in coin_sets(coins):
                cuda_check(tree, logits, params, c, method, what=f"zero-mass coins={name}")
    tree, logits, params, coins = random_case(300, num_reqs=6, vocab=2048, device="cuda")
    for ts, ta in ((0.3, 1.0), (1.0, 0.5), (0.05, 0.2)):
        cuda_check(tree, logits, params, coins, "rejection", ts, ta, what=f"thr {ts} {ta}")
    greedy = TreeSamplingParams.greedy(tree.num_reqs, "cuda")
    for method in METHODS:
        cuda_check(tree, logits, greedy, coins, method, what="greedy-only", greedy_only=True)
        cuda_check(tree, logits, greedy, coins, method, what="all-greedy temperatures")
    for seed in range(3):
        tree, logits, params, coins = star_case(seed, device="cuda")
        for method in METHODS:
            for c in (coins, (torch.full_like(coins[0], 0.999), coins[1])):
                cuda_check(tree, logits, params, c, method, what=f"star seed={seed}")
    tree = build_ddtree(torch.randn(2, 3, 10, device="cuda"), 0)  # empty trees
    coins = (torch.rand(2, 1, device="cuda"), torch.rand(2, device="cuda"))
    params = TreeSamplingParams(temperature=torch.tensor([0.0, 1.0], device="cuda"))
    for method in METHODS:
        cuda_check(tree, torch.randn(2, 1, 10, device="cuda"), params, coins, method, what="empty")


@requires_cuda_ext
def test_cuda_through_dispatcher_with_filters():
    tree, logits, _, coins = random_case(7, num_reqs=6, vocab=4096, dtype=torch.bfloat16,
                                         device="cuda")
    params = TreeSamplingParams.from_lists(
        [0.0, 0.8, 1.0, 1.2, 0.5, 0.0], top_k=[0, 20, -1, 50, 5, 3],
        top_p=[1.0, 0.9, 0.7, 1.0, 0.95, 1.0], min_p=[0.0, 0.0, 0.05, 0.0, 0.1, 0.0],
        device="cuda")
    for method in METHODS:
        want = verify_tree(tree, logits, params, method=method, coins=coins, backend="torch")
        got = verify_tree(tree, logits, params, method=method, coins=coins, backend="cuda")
        assert_same((got.accepted_indices, got.committed_tokens, got.num_accepted), want,
                    f"dispatcher method={method}")


@requires_cuda_ext
def test_cuda_strided_and_64bit_offsets():
    tree, logits, params, coins = random_case(11, num_reqs=4, vocab=1000, device="cuda")
    big = torch.randn(logits.shape[0], logits.shape[1], 1003, device="cuda")
    big[..., :1000] = logits
    for method in METHODS:
        cuda_check(tree, big[..., :1000], params, coins, method, what="strided rows")
    free, _ = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip("the 64-bit offset case needs 16 GiB of free device memory")
    # Rows 2**30 elements apart: request 1, node 2 starts 5 * 2**30 > 2**32 elements in.
    vocab, stride = 4096, 2**30
    storage = torch.empty(2, 3, stride, dtype=torch.bfloat16, device="cuda")
    view = storage[:, :, :vocab]
    view.normal_()
    chain = tree_from_parents([[-1, 0, 1]] * 2, [[0, 17, 42], [0, 99, 7]], max_depth=2).to("cuda")
    view[0, 0, 17] = view[0, 1, 42] = view[1, 0, 99] = view[1, 1, 7] = 30.0
    params = TreeSamplingParams(temperature=torch.tensor([0.0, 1.0], device="cuda"))
    coins = (torch.rand(2, 3, device="cuda"), torch.rand(2, device="cuda"))
    for method in METHODS:
        ref = cuda_check(chain, view, params, coins, method, what="64-bit offsets")
        assert ref.num_accepted.tolist() == [2, 2]
    del storage, view


@requires_cuda_ext
def test_cuda_op_checks_and_repeatability():
    tree, logits, params, coins = random_case(3, num_reqs=3, vocab=256, device="cuda")
    first = run_cuda(tree, logits, params.temperature, coins, "rejection")
    again = run_cuda(tree, logits, params.temperature, coins, "rejection")
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    op = cuda_ext.load()
    num_reqs, rows, _ = logits.shape
    width = tree.max_depth + 1
    outs = [torch.empty(num_reqs, width, dtype=torch.int64, device="cuda"),
            torch.empty(num_reqs, width, dtype=torch.int64, device="cuda"),
            torch.empty(num_reqs, dtype=torch.int64, device="cuda")]
    with pytest.raises(RuntimeError, match="tokens"):
        op(*outs, logits, tree.tokens.int(), tree.retrieve_next_token,
                        tree.retrieve_next_sibling, params.temperature, *coins,
                        tree.max_depth, 1, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="node_coins"):
        op(*outs, logits, tree.tokens, tree.retrieve_next_token,
                        tree.retrieve_next_sibling, params.temperature, None, None,
                        tree.max_depth, 1, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="accepted_indices"):
        op(outs[0][:, :-1], *outs[1:], logits, tree.tokens,
                        tree.retrieve_next_token, tree.retrieve_next_sibling,
                        params.temperature, *coins, tree.max_depth, 1, 1.0, 1.0)
    empty = torch.empty(0, rows, 8, device="cuda")
    idx = torch.empty(0, rows, dtype=torch.int64, device="cuda")
    out = cuda_ext.tree_verify_cuda(empty, idx, idx, idx, None, None, None, 2, 0)
    assert [tuple(t.shape) for t in out] == [(0, 3), (0, 3), (0,)]
