// SPDX-License-Identifier: Apache-2.0
//
// Compile check for csrc/tree_verify.cuh with plain nvcc (no torch): explicitly
// instantiates every kernel and launcher combination the binding can reach.
//   nvcc -c -std=c++17 -arch=sm_90 -o /tmp/tree_verify_check.o csrc/tree_verify_compile_check.cu
// Used by tests/test_cuda_sources.py; not part of the extension build.

#include "tree_verify.cuh"

namespace ddtree {

#define DDTREE_INSTANTIATE_KERNEL(DTYPE, VEC, GREEDY_ONLY)                             \
  template __global__ void TreeVerifyKernel<kTreeVerifyBlockThreads, VEC, GREEDY_ONLY, \
                                            DTYPE>(const TreeVerifyParams<DTYPE>);     \
  template cudaError_t LaunchTreeVerifyKernel<kTreeVerifyBlockThreads, VEC, GREEDY_ONLY, DTYPE>( \
      const TreeVerifyParams<DTYPE>&, cudaStream_t);

#define DDTREE_INSTANTIATE_DTYPE(DTYPE)                                               \
  DDTREE_INSTANTIATE_KERNEL(DTYPE, 16 / sizeof(DTYPE), false)                         \
  DDTREE_INSTANTIATE_KERNEL(DTYPE, 16 / sizeof(DTYPE), true)                          \
  DDTREE_INSTANTIATE_KERNEL(DTYPE, 1, false)                                          \
  DDTREE_INSTANTIATE_KERNEL(DTYPE, 1, true)                                           \
  template cudaError_t TreeVerify<DTYPE>(const TreeVerifyParams<DTYPE>&, bool, cudaStream_t); \
  template cudaError_t TreeVerifyGreedy<DTYPE>(const TreeVerifyParams<DTYPE>&, cudaStream_t);

DDTREE_INSTANTIATE_DTYPE(float)
DDTREE_INSTANTIATE_DTYPE(__half)
DDTREE_INSTANTIATE_DTYPE(__nv_bfloat16)

#undef DDTREE_INSTANTIATE_DTYPE
#undef DDTREE_INSTANTIATE_KERNEL

}  // namespace ddtree
