// SPDX-License-Identifier: Apache-2.0
//
// DDTree tree verification: which draft path the target accepts.
//
// Device code and host launchers only (no torch), so this header compiles with
// plain nvcc; tree_verify.cu holds the torch binding.
//
// One thread block per request. A request's walk starts at the root (node 0) and,
// at each visited node `cur`, uses row `cur` of the target logits (the target's
// next-token logits after root..cur):
//
//  * greedy request (temperature < 1e-5): token = argmax of the raw row (first
//    index of the maximum); descend to the first child carrying it, else it is the
//    bonus token;
//  * method 0, sample-walk: token = inverse-CDF sample of the row with the node's
//    own coin; descend to the first child carrying it, else it is the bonus;
//  * method 1, target-only rejection (SpecInfer with one-hot drafts): the node's
//    coin is compared with the running CDF of its children's target mass in LCRS
//    (= draft-rank) order; the first child with e > 0 and
//    (coin * total * threshold_acc < acc || e >= threshold_single * total) is
//    accepted. If none is, the bonus is drawn with the request's final coin from
//    the row with every child token of the stop node removed (from the full row
//    if that leaves no mass). The removed tokens are kept as a sorted list in
//    shared memory: no [R, N, V] draft_probs scratch.
//
// Canonical arithmetic (ddtree's verify.py): z = x / T in float32 (IEEE
// division; greedy rows are not divided), m = max z, e = expf(z - m) in float32,
// sums and prefix sums in double. An inverse-CDF draw with coin u picks the first
// token with e > 0 whose inclusive prefix sum is > u * total (strict: a zero-mass
// token is never emitted), falling back to the last token with e > 0 when
// rounding leaves none.
//
// Prefix-sum order. Warp w of the block owns one contiguous segment of the
// vocabulary and scans it in chunks of 32 * VEC tokens (lane l holds VEC
// consecutive tokens). Within a segment the inclusive prefix of token k is
// (carry + lanes_before) + local_k, and the carry of the next chunk is the prefix
// of the chunk's last token, so a segment's total is bit-identical to the prefix
// of its last token. The row total is the sequential sum of the segment totals.
// The pass that computes the totals and the pass that searches the crossing run
// the same code, so the search is consistent with the total; only the one
// segment that holds the crossing is rescanned (by its warp, with early exit).
//
// Memory: row offsets are int64 (R * (N + 1) * V may exceed 2^32). Shared memory
// holds the request's tree (tokens and LCRS links as int32) and, for the
// rejection method, a children list and the sorted excluded tokens: 24 bytes per
// tree row (12 for the greedy-only kernel).
//
// Input hygiene: tokens outside [0, V) never match and carry no mass; links
// outside (0, rows) end a chain; sibling chains are cut after `rows` hops, so a
// malformed tree cannot hang or read out of bounds.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__USE_FAST_MATH__)
#error "tree_verify.cuh needs IEEE division and accurate expf: do not build it with --use_fast_math"
#endif

namespace ddtree {

// Method ids, as in ddtree's verify.METHOD_IDS.
enum TreeVerifyMethod : int32_t {
  kSampleWalk = 0,
  kRejection = 1,
};

// vLLM's _SAMPLING_EPS: requests with a lower temperature are greedy.
constexpr float kGreedyTemperature = 1e-5f;

// Threads per block of every launch.
constexpr uint32_t kTreeVerifyBlockThreads = 1024;

// Everything a launch needs. R = num_reqs, N + 1 = num_rows, V = vocab_size,
// W = max_depth + 1. Pointers are device pointers.
template <typename DType>
struct TreeVerifyParams {
  // Outputs. Every entry is written (padding included).
  int64_t* accepted_indices;  // [R, W] local node ids of the path, root first, -1 padded
  int64_t* committed_tokens;  // [R, W] accepted draft tokens, then the bonus, -1 padded
  int64_t* num_accepted;      // [R] accepted drafts (root and bonus excluded)

  // Inputs.
  const DType* logits;        // [R, N + 1, V], or [M, V] with row_index; vocab contiguous
  int64_t logits_stride_req;  // elements between requests (unused with row_index)
  int64_t logits_stride_row;  // elements between rows
  // [R, N + 1] contiguous, or nullptr: tree row i of request b is logits row
  // row_index[b * (N + 1) + i], read in place (no [R, N + 1, V] gather).
  const int64_t* row_index;
  const int64_t* tokens;        // [R, N + 1] contiguous; node tokens (row 0 = root, unused)
  const int64_t* next_token;    // [R, N + 1] contiguous; first child, -1 if none
  const int64_t* next_sibling;  // [R, N + 1] contiguous; next sibling, -1 if none
  const float* temperature;     // [R]; < 1e-5 = greedy. Unused by the greedy-only kernel
  const float* node_coins;      // [R, N + 1] uniforms in [0, 1). Unused if greedy-only
  const float* final_coins;     // [R] uniforms in [0, 1) for the residual draw

  int32_t num_reqs;
  int32_t num_rows;
  int32_t vocab_size;
  int32_t max_depth;  // L: deepest node; W = L + 1
  int32_t method;     // TreeVerifyMethod
  double threshold_single;  // in (0, 1]; 1 = exact
  double threshold_acc;     // in (0, 1]; 1 = exact
};

namespace detail {

constexpr unsigned kFullMask = 0xffffffffu;

template <uint32_t NUM_WARPS>
struct TreeVerifyShared {
  double warp_sum[NUM_WARPS];  // per-segment totals of the last BlockSum
  float warp_val[NUM_WARPS];
  int32_t warp_idx[NUM_WARPS];
  double total;      // broadcast: row total
  double seg_carry;  // broadcast: prefix before the segment holding the crossing
  float max_val;     // broadcast: row maximum of z
  int32_t index;     // broadcast: argmax / last valid index
  int32_t seg;       // broadcast: segment holding the crossing, -1 if none
  int32_t pick;      // broadcast: sampled token, -1 if none found
  int32_t next;      // broadcast: accepted child, -1 if none
  int32_t count;     // broadcast: number of children of the current node
};

// Dynamic shared memory: int32 arrays of num_rows entries each.
//   greedy-only: tokens, first child, next sibling
//   otherwise:   + children list, child masses (float), sorted excluded tokens
template <bool GREEDY_ONLY>
__host__ __device__ constexpr size_t TreeVerifySmemWords() {
  return GREEDY_ONLY ? 3 : 6;
}

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

// VEC consecutive elements as float; one 16-byte load when VEC elements fill it
// (the launcher only picks VEC > 1 when every row start is 16-byte aligned).
template <uint32_t VEC, typename DType>
__device__ __forceinline__ void LoadVec(const DType* ptr, float (&out)[VEC]) {
  if constexpr (VEC > 1 && VEC * sizeof(DType) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(ptr);
    const DType* vals = reinterpret_cast<const DType*>(&raw);
#pragma unroll
    for (uint32_t k = 0; k < VEC; ++k) out[k] = ToFloat(vals[k]);
  } else {
#pragma unroll
    for (uint32_t k = 0; k < VEC; ++k) out[k] = ToFloat(ptr[k]);
  }
}

// torch.argmax order: NaN is the largest value; ties go to the lower index.
__device__ __forceinline__ bool ArgmaxBetter(float a, int32_t ia, float b, int32_t ib) {
  const bool a_nan = isnan(a);
  const bool b_nan = isnan(b);
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  return a > b || (a == b && ia < ib);
}

__device__ __forceinline__ double WarpInclusiveSum(double v, uint32_t lane) {
#pragma unroll
  for (uint32_t d = 1; d < 32; d <<= 1) {
    const double o = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v = o + v;
  }
  return v;
}

__device__ __forceinline__ int32_t WarpMaxInt(int32_t v) {
#pragma unroll
  for (uint32_t d = 16; d > 0; d >>= 1) {
    const int32_t o = __shfl_xor_sync(kFullMask, v, d);
    v = o > v ? o : v;
  }
  return v;
}

// First position in sorted a[0, n) whose value is >= key.
__device__ __forceinline__ int32_t LowerBound(const int32_t* a, int32_t n, int32_t key) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    if (a[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// [start, end) of the vocabulary owned by `warp`: contiguous segments, each a
// multiple of the chunk size (32 * VEC), the last ones possibly short or empty.
template <uint32_t NUM_WARPS, uint32_t VEC>
__device__ __forceinline__ void Segment(int32_t vocab, uint32_t warp, int64_t& start,
                                        int64_t& end) {
  constexpr int64_t kChunk = 32 * VEC;
  constexpr int64_t kStride = kChunk * NUM_WARPS;
  const int64_t seg_len = (static_cast<int64_t>(vocab) + kStride - 1) / kStride * kChunk;
  start = seg_len * warp;
  end = start + seg_len;
  if (start > vocab) start = vocab;
  if (end > vocab) end = vocab;
}

// e = expf(x / T - m) for the VEC tokens at `off` (0 past `end` and for the
// excluded tokens: sorted excl[0, num_excl)).
template <uint32_t VEC, typename DType>
__device__ __forceinline__ void LoadExp(const DType* row, int64_t off, int64_t end,
                                        float temperature, float row_max,
                                        const int32_t* excl, int32_t num_excl,
                                        float (&e)[VEC]) {
  if (off < end) {
    float x[VEC];
    LoadVec<VEC>(row + off, x);
#pragma unroll
    for (uint32_t k = 0; k < VEC; ++k) e[k] = expf(x[k] / temperature - row_max);
    if (num_excl > 0) {
      const int32_t first = static_cast<int32_t>(off);
      int32_t j = LowerBound(excl, num_excl, first);
#pragma unroll
      for (uint32_t k = 0; k < VEC; ++k) {
        const int32_t idx = first + static_cast<int32_t>(k);
        while (j < num_excl && excl[j] < idx) ++j;
        if (j < num_excl && excl[j] == idx) e[k] = 0.f;
      }
    }
  } else {
#pragma unroll
    for (uint32_t k = 0; k < VEC; ++k) e[k] = 0.f;
  }
}

// Argmax of the raw row (first index of the maximum). All threads call it.
template <uint32_t BLOCK_THREADS, uint32_t VEC, typename DType>
__device__ __forceinline__ int32_t BlockArgmax(const DType* row, int32_t vocab,
                                               TreeVerifyShared<BLOCK_THREADS / 32>& sh) {
  constexpr uint32_t kWarps = BLOCK_THREADS / 32;
  constexpr int64_t kChunk = 32 * VEC;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t start, end;
  Segment<kWarps, VEC>(vocab, warp, start, end);
  float best = -INFINITY;
  int32_t best_idx = INT_MAX;
  for (int64_t off = start + lane * VEC; off < end; off += kChunk) {
    float x[VEC];
    LoadVec<VEC>(row + off, x);
#pragma unroll
    for (uint32_t k = 0; k < VEC; ++k) {
      const int32_t idx = static_cast<int32_t>(off) + static_cast<int32_t>(k);
      if (ArgmaxBetter(x[k], idx, best, best_idx)) {
        best = x[k];
        best_idx = idx;
      }
    }
  }
#pragma unroll
  for (uint32_t d = 16; d > 0; d >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, best, d);
    const int32_t oi = __shfl_xor_sync(kFullMask, best_idx, d);
    if (ArgmaxBetter(ov, oi, best, best_idx)) {
      best = ov;
      best_idx = oi;
    }
  }
  if (lane == 0) {
    sh.warp_val[warp] = best;
    sh.warp_idx[warp] = best_idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = sh.warp_val[0];
    int32_t bi = sh.warp_idx[0];
    for (uint32_t w = 1; w < kWarps; ++w) {
      if (ArgmaxBetter(sh.warp_val[w], sh.warp_idx[w], b, bi)) {
        b = sh.warp_val[w];
        bi = sh.warp_idx[w];
      }
    }
    sh.index = bi;
  }
  __syncthreads();
  return sh.index;
}

// max over the row of z = x / T. All threads call it.
template <uint32_t BLOCK_THREADS, uint32_t VEC, typename DType>
__device__ __forceinline__ float BlockMax(const DType* row, int32_t vocab, float temperature,
                                          TreeVerifyShared<BLOCK_THREADS / 32>& sh) {
  constexpr uint32_t kWarps = BLOCK_THREADS / 32;
  constexpr int64_t kChunk = 32 * VEC;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t start, end;
  Segment<kWarps, VEC>(vocab, warp, start, end);
  float best = -INFINITY;
  for (int64_t off = start + lane * VEC; off < end; off += kChunk) {
    float x[VEC];
    LoadVec<VEC>(row + off, x);
#pragma unroll
    for (uint32_t k = 0; k < VEC; ++k) best = fmaxf(best, x[k] / temperature);
  }
#pragma unroll
  for (uint32_t d = 16; d > 0; d >>= 1) best = fmaxf(best, __shfl_xor_sync(kFullMask, best, d));
  if (lane == 0) sh.warp_val[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = sh.warp_val[0];
    for (uint32_t w = 1; w < kWarps; ++w) b = fmaxf(b, sh.warp_val[w]);
    sh.max_val = b;
  }
  __syncthreads();
  return sh.max_val;
}

// One chunk of a segment scan: the lane's inclusive prefixes are
// base + local_k with base = carry + (sum of the lanes before it); returns the
// carry of the next chunk (the prefix of the chunk's last token, from lane 31).
// BlockSum and BlockSample both go through here, so they agree bit for bit.
template <uint32_t VEC>
__device__ __forceinline__ double ChunkBase(const float (&e)[VEC], double carry, uint32_t lane,
                                            double& lane_sum) {
  double s = 0.0;
#pragma unroll
  for (uint32_t k = 0; k < VEC; ++k) s += static_cast<double>(e[k]);
  lane_sum = s;
  const double incl = WarpInclusiveSum(s, lane);
  const double before = __shfl_up_sync(kFullMask, incl, 1);
  return carry + (lane == 0 ? 0.0 : before);
}

// Row total of e (excluded tokens removed) and the last index with e > 0 (-1 if
// none). Leaves the segment totals in sh.warp_sum for BlockSample. All threads
// call it.
template <uint32_t BLOCK_THREADS, uint32_t VEC, typename DType>
__device__ __forceinline__ void BlockSum(const DType* row, int32_t vocab, float temperature,
                                         float row_max, const int32_t* excl, int32_t num_excl,
                                         TreeVerifyShared<BLOCK_THREADS / 32>& sh,
                                         double& total, int32_t& last_valid) {
  constexpr uint32_t kWarps = BLOCK_THREADS / 32;
  constexpr int64_t kChunk = 32 * VEC;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t start, end;
  Segment<kWarps, VEC>(vocab, warp, start, end);
  // Only lane 31 needs the carry (the prefix of the chunk's last token, which it
  // holds): the other lanes' values are never used, so no broadcast per chunk.
  double carry = 0.0;
  int32_t last = -1;
  for (int64_t chunk = start; chunk < end; chunk += kChunk) {  // warp-uniform trip count
    const int64_t off = chunk + lane * VEC;
    float e[VEC];
    LoadExp<VEC>(row, off, end, temperature, row_max, excl, num_excl, e);
#pragma unroll
    for (uint32_t k = 0; k < VEC; ++k) {
      if (e[k] > 0.f) last = static_cast<int32_t>(off) + static_cast<int32_t>(k);
    }
    double lane_sum;
    const double base = ChunkBase<VEC>(e, carry, lane, lane_sum);
    carry = base + lane_sum;
  }
  last = WarpMaxInt(last);
  if (lane == 31) sh.warp_sum[warp] = carry;
  if (lane == 0) sh.warp_idx[warp] = last;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    int32_t l = -1;
    for (uint32_t w = 0; w < kWarps; ++w) {
      t += sh.warp_sum[w];
      l = sh.warp_idx[w] > l ? sh.warp_idx[w] : l;
    }
    sh.total = t;
    sh.index = l;
  }
  __syncthreads();
  total = sh.total;
  last_valid = sh.index;
}

// Inverse-CDF draw with coin u over the same e as the BlockSum call just before
// (same temperature, row_max and exclusions; its segment totals and last valid
// indices are still in sh.warp_sum / sh.warp_idx): the first token with e > 0
// and prefix > u * total, else last_valid (else V - 1). All threads call it.
template <uint32_t BLOCK_THREADS, uint32_t VEC, typename DType>
__device__ __forceinline__ int32_t BlockSample(const DType* row, int32_t vocab,
                                               float temperature, float row_max,
                                               const int32_t* excl, int32_t num_excl,
                                               double total, int32_t last_valid, float coin,
                                               TreeVerifyShared<BLOCK_THREADS / 32>& sh) {
  constexpr uint32_t kWarps = BLOCK_THREADS / 32;
  constexpr int64_t kChunk = 32 * VEC;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double target = static_cast<double>(coin) * total;
  if (threadIdx.x == 0) {
    // Segment w holds the crossing if the prefix of its last token (= the
    // running sum of segment totals, exactly) is the first one > target.
    double carry = 0.0;
    int32_t seg = -1;
    double seg_carry = 0.0;
    for (uint32_t w = 0; w < kWarps; ++w) {
      const double next = carry + sh.warp_sum[w];
      if (next > target) {
        seg = static_cast<int32_t>(w);
        seg_carry = carry;
        break;
      }
      carry = next;
    }
    sh.seg = seg;
    sh.seg_carry = seg_carry;
    sh.pick = -1;
  }
  __syncthreads();
  if (static_cast<int32_t>(warp) == sh.seg) {
    const double seg_carry = sh.seg_carry;
    int64_t start, end;
    Segment<kWarps, VEC>(vocab, warp, start, end);
    double carry = 0.0;
    int32_t found = -1;
    for (int64_t chunk = start; chunk < end; chunk += kChunk) {  // warp-uniform
      const int64_t off = chunk + lane * VEC;
      float e[VEC];
      LoadExp<VEC>(row, off, end, temperature, row_max, excl, num_excl, e);
      double lane_sum;
      const double base = ChunkBase<VEC>(e, carry, lane, lane_sum);
      int32_t cand = -1;
      double local = 0.0;
#pragma unroll
      for (uint32_t k = 0; k < VEC; ++k) {
        local += static_cast<double>(e[k]);
        if (cand < 0 && e[k] > 0.f && seg_carry + (base + local) > target) {
          cand = static_cast<int32_t>(off) + static_cast<int32_t>(k);
        }
      }
      const unsigned hit = __ballot_sync(kFullMask, cand >= 0);
      if (hit != 0u) {
        found = __shfl_sync(kFullMask, cand, __ffs(static_cast<int>(hit)) - 1);
        break;
      }
      carry = __shfl_sync(kFullMask, base + lane_sum, 31);
    }
    // The segment's total says the crossing is here; if rounding inside the
    // segment left none, its last token with e > 0 (kept by BlockSum) is it.
    if (lane == 0) sh.pick = found >= 0 ? found : sh.warp_idx[warp];
  }
  __syncthreads();
  const int32_t pick = sh.pick;
  if (pick >= 0) return pick;
  return last_valid >= 0 ? last_valid : vocab - 1;
}

}  // namespace detail

// The verification kernel: one block per request, BLOCK_THREADS threads, VEC
// logits per vector load. GREEDY_ONLY treats every request as greedy (the
// temperature and coins are not read) and needs half the shared memory.
template <uint32_t BLOCK_THREADS, uint32_t VEC, bool GREEDY_ONLY, typename DType>
__global__ void __launch_bounds__(BLOCK_THREADS)
    TreeVerifyKernel(const TreeVerifyParams<DType> params) {
  static_assert(BLOCK_THREADS % 32 == 0 && BLOCK_THREADS >= 32 && BLOCK_THREADS <= 1024,
                "BLOCK_THREADS must be a multiple of 32 in [32, 1024]");
  static_assert(VEC >= 1 && (VEC & (VEC - 1)) == 0 && VEC * sizeof(DType) <= 16,
                "VEC must be a power of two of at most 16 bytes of logits");
  using detail::TreeVerifyShared;
  constexpr uint32_t kWarps = BLOCK_THREADS / 32;
  __shared__ TreeVerifyShared<kWarps> sh;
  extern __shared__ int32_t tree_smem[];

  const int32_t rows = params.num_rows;
  const int32_t vocab = params.vocab_size;
  const int32_t max_depth = params.max_depth;
  const int64_t width = static_cast<int64_t>(max_depth) + 1;
  const int64_t b = blockIdx.x;
  const uint32_t tid = threadIdx.x;

  int32_t* s_tok = tree_smem;           // node token, -1 if outside [0, V)
  int32_t* s_first = s_tok + rows;      // first child, -1 if none
  int32_t* s_sib = s_first + rows;      // next sibling, -1 if none
  int32_t* s_children = s_sib + rows;   // children of the current node, LCRS order
  float* s_child_e = reinterpret_cast<float*>(s_children + rows);  // their e values
  int32_t* s_excl = s_children + 2 * static_cast<int64_t>(rows);  // sorted excluded tokens

  // The request's tree into shared memory, sanitized.
  {
    const int64_t base = b * rows;
    for (int32_t i = tid; i < rows; i += BLOCK_THREADS) {
      const int64_t t = params.tokens[base + i];
      s_tok[i] = (t >= 0 && t < vocab) ? static_cast<int32_t>(t) : -1;
      const int64_t c = params.next_token[base + i];
      s_first[i] = (c > 0 && c < rows) ? static_cast<int32_t>(c) : -1;
      const int64_t s = params.next_sibling[base + i];
      s_sib[i] = (s > 0 && s < rows) ? static_cast<int32_t>(s) : -1;
    }
  }
  __syncthreads();

  bool greedy = true;
  float temperature = 1.f;
  if constexpr (!GREEDY_ONLY) {
    temperature = params.temperature[b];
    greedy = temperature < kGreedyTemperature;
    if (greedy) temperature = 1.f;
  }
  const bool rejection = !greedy && params.method == kRejection;

  int64_t* accepted = params.accepted_indices + b * width;
  int64_t* committed = params.committed_tokens + b * width;
  const DType* req_logits =
      params.row_index != nullptr ? params.logits : params.logits + b * params.logits_stride_req;

  int32_t cur = 0;
  int32_t depth = 0;
  int32_t token = -1;    // greedy / sample-walk token at `cur`
  float row_max = 0.f;   // sampled rows: max z at `cur`
  double total = 0.0;    // sampled rows: sum of e at `cur`
  int32_t last_valid = -1;
  int32_t num_children = 0;  // rejection: children of `cur` in s_children
  const DType* row = req_logits;

  for (;;) {
    const int64_t logits_row =
        params.row_index != nullptr ? params.row_index[b * rows + cur] : static_cast<int64_t>(cur);
    row = req_logits + logits_row * params.logits_stride_row;
    const bool can_descend = depth < max_depth;
    int32_t next = -1;
    if (greedy) {
      token = detail::BlockArgmax<BLOCK_THREADS, VEC>(row, vocab, sh);
    } else if constexpr (!GREEDY_ONLY) {
      row_max = detail::BlockMax<BLOCK_THREADS, VEC>(row, vocab, temperature, sh);
      detail::BlockSum<BLOCK_THREADS, VEC>(row, vocab, temperature, row_max, nullptr, 0, sh,
                                           total, last_valid);
      if (!rejection) {
        token = detail::BlockSample<BLOCK_THREADS, VEC>(
            row, vocab, temperature, row_max, nullptr, 0, total, last_valid,
            params.node_coins[b * rows + cur], sh);
      }
    }

    if (!rejection) {
      // The child carrying `token` (first in LCRS order), if any.
      if (tid == 0) {
        int32_t found = -1;
        if (can_descend && token >= 0) {
          int32_t hops = 0;
          for (int32_t c = s_first[cur]; c >= 0 && hops < rows; c = s_sib[c], ++hops) {
            if (s_tok[c] == token) {
              found = c;
              break;
            }
          }
        }
        sh.next = found;
      }
      __syncthreads();
      next = sh.next;
    } else if constexpr (!GREEDY_ONLY) {
      // Children of `cur` in LCRS order (also the exclusion set if we stop here).
      if (tid == 0) {
        int32_t n = 0;
        for (int32_t c = s_first[cur]; c >= 0 && n < rows; c = s_sib[c]) s_children[n++] = c;
        sh.count = n;
      }
      __syncthreads();
      num_children = sh.count;
      if (can_descend && num_children > 0) {
        // Children's e in parallel (one scattered load each), then the running
        // CDF in order by one thread.
        for (int32_t i = tid; i < num_children; i += BLOCK_THREADS) {
          const int32_t t = s_tok[s_children[i]];
          s_child_e[i] = t >= 0 ? expf(detail::ToFloat(row[t]) / temperature - row_max) : 0.f;
        }
        __syncthreads();
        if (tid == 0) {
          const double coin = static_cast<double>(params.node_coins[b * rows + cur]);
          const double acc_bound = coin * total * params.threshold_acc;
          const double single_bound = params.threshold_single * total;
          double acc = 0.0;
          int32_t found = -1;
          for (int32_t i = 0; i < num_children; ++i) {
            const float e_c = s_child_e[i];
            acc += static_cast<double>(e_c);
            if (e_c > 0.f && (acc_bound < acc || static_cast<double>(e_c) >= single_bound)) {
              found = s_children[i];
              break;
            }
          }
          sh.next = found;
        }
        __syncthreads();
        next = sh.next;
      }
    }

    if (next < 0) break;
    ++depth;
    if (tid == 0) {
      accepted[depth] = next;
      committed[depth - 1] = params.tokens[b * rows + next];
    }
    cur = next;
  }

  // The bonus / correction token at the stop node `cur`.
  int32_t bonus = token;
  if constexpr (!GREEDY_ONLY) {
    if (rejection) {
      const float coin = params.final_coins[b];
      if (num_children == 0) {
        bonus = detail::BlockSample<BLOCK_THREADS, VEC>(row, vocab, temperature, row_max,
                                                        nullptr, 0, total, last_valid, coin, sh);
      } else {
        // Every child token of the stop node is removed: rank sort into s_excl
        // for binary search (invalid tokens, -1, sort first and match nothing).
        for (int32_t i = tid; i < num_children; i += BLOCK_THREADS) {
          const int32_t v = s_tok[s_children[i]];
          int32_t rank = 0;
          for (int32_t j = 0; j < num_children; ++j) {
            const int32_t u = s_tok[s_children[j]];
            rank += (u < v || (u == v && j < i)) ? 1 : 0;
          }
          s_excl[rank] = v;
        }
        __syncthreads();
        double res_total;
        int32_t res_last;
        detail::BlockSum<BLOCK_THREADS, VEC>(row, vocab, temperature, row_max, s_excl,
                                             num_children, sh, res_total, res_last);
        if (res_total > 0.0) {
          bonus = detail::BlockSample<BLOCK_THREADS, VEC>(row, vocab, temperature, row_max,
                                                          s_excl, num_children, res_total,
                                                          res_last, coin, sh);
        } else {
          // All the mass sat on the children (float rounding only): full row.
          detail::BlockSum<BLOCK_THREADS, VEC>(row, vocab, temperature, row_max, nullptr, 0,
                                               sh, total, last_valid);
          bonus = detail::BlockSample<BLOCK_THREADS, VEC>(row, vocab, temperature, row_max,
                                                          nullptr, 0, total, last_valid, coin,
                                                          sh);
        }
      }
    }
  }

  if (tid == 0) {
    accepted[0] = 0;
    committed[depth] = bonus;
    for (int64_t j = depth + 1; j < width; ++j) {
      accepted[j] = -1;
      committed[j] = -1;
    }
    params.num_accepted[b] = depth;
  }
}

// Dynamic shared memory of one launch.
template <bool GREEDY_ONLY>
inline size_t TreeVerifySmemBytes(int32_t num_rows) {
  return detail::TreeVerifySmemWords<GREEDY_ONLY>() * sizeof(int32_t) *
         static_cast<size_t>(num_rows > 0 ? num_rows : 0);
}

// Launches one instantiation; raises the dynamic shared memory limit when the
// tree needs more than the default 48 KiB.
template <uint32_t BLOCK_THREADS, uint32_t VEC, bool GREEDY_ONLY, typename DType>
cudaError_t LaunchTreeVerifyKernel(const TreeVerifyParams<DType>& params, cudaStream_t stream) {
  void (*kernel)(const TreeVerifyParams<DType>) =
      TreeVerifyKernel<BLOCK_THREADS, VEC, GREEDY_ONLY, DType>;
  const size_t smem = TreeVerifySmemBytes<GREEDY_ONLY>(params.num_rows);
  constexpr size_t kStaticSmem = sizeof(detail::TreeVerifyShared<BLOCK_THREADS / 32>);
  if (smem + kStaticSmem > 48 * 1024) {
    int device = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status != cudaSuccess) return status;
    int max_smem = 0;
    status = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (status != cudaSuccess) return status;
    if (smem + kStaticSmem > static_cast<size_t>(max_smem)) return cudaErrorInvalidValue;
    status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem));
    if (status != cudaSuccess) return status;
  }
  TreeVerifyParams<DType> args = params;
  void* kernel_args[] = {&args};
  return cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(params.num_reqs)),
                          dim3(BLOCK_THREADS), kernel_args, smem, stream);
}

// Largest number of tree rows a launch supports on the current device (shared
// memory bound), or -1 if the device cannot be queried.
template <bool GREEDY_ONLY>
inline int64_t TreeVerifyMaxRows() {
  int device = 0;
  int max_smem = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return -1;
  }
  constexpr size_t kStaticSmem = sizeof(detail::TreeVerifyShared<kTreeVerifyBlockThreads / 32>);
  constexpr size_t kBytesPerRow = detail::TreeVerifySmemWords<GREEDY_ONLY>() * sizeof(int32_t);
  return (static_cast<int64_t>(max_smem) - static_cast<int64_t>(kStaticSmem)) /
         static_cast<int64_t>(kBytesPerRow);
}

// Host launcher: tree verification with per-request greedy / sampled rows.
// greedy_only: every request is greedy (temperature and coins are not read).
// Returns cudaErrorInvalidValue for inconsistent parameters or a tree too large
// for shared memory, else the launch status.
template <typename DType>
cudaError_t TreeVerify(const TreeVerifyParams<DType>& params, bool greedy_only,
                       cudaStream_t stream = nullptr) {
  if (params.num_reqs < 0 || params.num_rows < 1 || params.vocab_size < 1 ||
      params.max_depth < 0 || params.accepted_indices == nullptr ||
      params.committed_tokens == nullptr || params.num_accepted == nullptr ||
      params.logits == nullptr || params.tokens == nullptr || params.next_token == nullptr ||
      params.next_sibling == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (!greedy_only &&
      (params.temperature == nullptr || params.node_coins == nullptr ||
       params.final_coins == nullptr ||
       (params.method != kSampleWalk && params.method != kRejection) ||
       !(params.threshold_single > 0.0 && params.threshold_single <= 1.0) ||
       !(params.threshold_acc > 0.0 && params.threshold_acc <= 1.0))) {
    return cudaErrorInvalidValue;
  }
  if (params.num_reqs == 0) return cudaSuccess;

  // 16-byte vector loads when every row starts 16-byte aligned.
  constexpr uint32_t kVec = 16 / sizeof(DType);
  const bool vectorized =
      params.vocab_size % kVec == 0 && params.logits_stride_req % kVec == 0 &&
      params.logits_stride_row % kVec == 0 &&
      reinterpret_cast<uintptr_t>(params.logits) % 16 == 0;
  constexpr uint32_t kThreads = kTreeVerifyBlockThreads;
  if (greedy_only) {
    return vectorized ? LaunchTreeVerifyKernel<kThreads, kVec, true, DType>(params, stream)
                      : LaunchTreeVerifyKernel<kThreads, 1, true, DType>(params, stream);
  }
  return vectorized ? LaunchTreeVerifyKernel<kThreads, kVec, false, DType>(params, stream)
                    : LaunchTreeVerifyKernel<kThreads, 1, false, DType>(params, stream);
}

// Host launcher: greedy verification only (argmax walk, no temperature or coins).
template <typename DType>
cudaError_t TreeVerifyGreedy(const TreeVerifyParams<DType>& params,
                             cudaStream_t stream = nullptr) {
  return TreeVerify<DType>(params, /*greedy_only=*/true, stream);
}

}  // namespace ddtree
