// SPDX-License-Identifier: Apache-2.0
//
// DDTree tree attention on CPU (torch.ops.vllm_ddtree.tree_attention_cpu).
//
// A verify step's tree rows (DDTree, https://arxiv.org/abs/2604.12989) attend to
// the committed prefix and to their own ancestors in the tree block only. vLLM's
// CPU_ATTN kernel takes no mask, so the plugin's CPU backend
// (vllm_ddtree/vllm_adapter/cpu_attention.py) lets it compute every row causally
// and then recomputes the rows whose ancestors are not the block rows before
// them. Its torch path (the reference) spends a dozen small operators and a gather
// of the whole visible prefix per layer and tree request; this op does the same
// arithmetic in one call per layer, reading K and V straight from the paged,
// ISA-packed cache:
//
//   for each (tree request, KV head, chunk of <= 16 rows), in parallel:
//     scores[r, j] = q_r . k_j * scale    (softcap: c * tanh(s / c))
//     masked by the ancestor visibility and the layer's sliding window,
//     softmax with the head's sink logit (if any) in the denominator,
//     out[r] = sum_j p[r, j] v_j          (float32 accumulation)
//
// r runs over the request's recomputed rows times the query heads of the KV head
// (GQA), j over cache positions first .. nc + T - 1 (committed prefix, then the
// tree block; positions no row's window reaches are not read).
//
// The packed layout is not assumed: k_index / v_index map a block's plain entry
// (t * D + d) to its packed position inside the (block, head) region, as probed
// from vLLM's own cache write (cpu_attention.packed_layout). Float32 blocks of the
// "vec" layout (K transposed [D, bs], V [bs, D]) are read in place; any other
// block is converted to float32 in a small buffer first, so the inner loops
// (q . K over a block's keys, p . V over the head dimension) are contiguous and
// vectorise. Hot functions are cloned per ISA (AVX-512, AVX2, baseline) and picked
// at load time, so the build runs on any x86-64 CPU.

// Comparisons and float -> int conversions in the exp loop vectorise only
// without trapping math (results are unchanged: it concerns FP exception flags).
#pragma GCC optimize("no-trapping-math")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DDTREE_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DDTREE_ISA_CLONES
#endif

// exp(x) for x <= 0 (scores minus their maximum), vectorisable: Cody-Waite range
// reduction and a degree-6 polynomial (Cephes' expf), ~1 ulp; x is clamped at -87
// so that the result stays a normal float (masked keys are zeroed by the caller).
DDTREE_ISA_CLONES
void exp_nonpositive(float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] < -87.0f ? -87.0f : x[i];
    // k = round(v / ln 2) (v <= 0: truncating v / ln 2 - 0.5 rounds to nearest).
    const int32_t k = static_cast<int32_t>(v * 1.44269504088896341f - 0.5f);
    const float kf = static_cast<float>(k);
    float r = v - kf * 0.693359375f;
    r = r + kf * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    x[i] = p * __builtin_bit_cast(float, (k + 127) << 23);  // p * 2^k
  }
}

constexpr int64_t kRows = 4;    // query rows per register tile
constexpr int64_t kLanes = 16;  // floats per vector
constexpr int64_t kKeyTile = 2 * kLanes;  // keys per score tile: 4 x 2 accumulators
constexpr int64_t kDimTile = 4 * kLanes;  // head dims per output tile: 4 x 4
constexpr int64_t kMaxTaskRows = 16;      // tree rows per task, at most

// 16 floats as one value: GCC lowers its arithmetic to the clone's ISA (one
// AVX-512 register, two AVX2 registers, four SSE registers).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// scores[R4, 0:nkeys] (rows of stride ns) = q[R4, D] @ K^T for one cache block's
// keys, K transposed as kt[D, kt_stride] (vLLM's "vec" layout of a K block, or a
// block converted to float32). Register tiles of 4 rows x 32 keys: eight
// independent accumulators (enough to cover the FMA latency), each lane summed
// over D in order. Lanes past nkeys (up to the next multiple of 32) are computed
// from whatever kt holds there and must never be read back: kt must be readable
// up to that multiple.
DDTREE_ISA_CLONES
void qk_scores(const float* __restrict q, int64_t R4, int64_t D,
               const float* __restrict kt, int64_t kt_stride, int64_t nkeys,
               float* __restrict scores, int64_t ns) {
  for (int64_t i0 = 0; i0 < R4; i0 += kRows) {
    const float *q0 = q + i0 * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
    float* s = scores + i0 * ns;
    for (int64_t j0 = 0; j0 < nkeys; j0 += kKeyTile) {
      Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
      const float* k = kt + j0;
      for (int64_t d = 0; d < D; ++d, k += kt_stride) {
        const Lanes ka = load_lanes(k), kb = load_lanes(k + kLanes);
        a0 += q0[d] * ka;
        b0 += q0[d] * kb;
        a1 += q1[d] * ka;
        b1 += q1[d] * kb;
        a2 += q2[d] * ka;
        b2 += q2[d] * kb;
        a3 += q3[d] * ka;
        b3 += q3[d] * kb;
      }
      store_lanes(s + j0, a0);
      store_lanes(s + j0 + kLanes, b0);
      store_lanes(s + ns + j0, a1);
      store_lanes(s + ns + j0 + kLanes, b1);
      store_lanes(s + 2 * ns + j0, a2);
      store_lanes(s + 2 * ns + j0 + kLanes, b2);
      store_lanes(s + 3 * ns + j0, a3);
      store_lanes(s + 3 * ns + j0 + kLanes, b3);
    }
  }
}

// out[R4, Dp] += p[R4, 0:nkeys] @ v[nkeys, Dp] for one cache block's values
// (p rows of stride ns, v rows of stride v_stride, Dp a multiple of kDimTile):
// tiles of 4 rows x 64 head dims (sixteen accumulators), each summed over the
// keys in order, block after block.
DDTREE_ISA_CLONES
void pv_accumulate(const float* __restrict p, int64_t R4, int64_t ns,
                   const float* __restrict v, int64_t v_stride, int64_t nkeys,
                   int64_t Dp, float* __restrict out) {
  for (int64_t i0 = 0; i0 < R4; i0 += kRows) {
    const float *p0 = p + i0 * ns, *p1 = p0 + ns, *p2 = p1 + ns, *p3 = p2 + ns;
    for (int64_t d0 = 0; d0 < Dp; d0 += kDimTile) {
      Lanes acc[kRows][4];
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t c = 0; c < 4; ++c)
          acc[r][c] = load_lanes(out + (i0 + r) * Dp + d0 + c * kLanes);
      const float* vj = v + d0;
      for (int64_t j = 0; j < nkeys; ++j, vj += v_stride) {
        const Lanes v0 = load_lanes(vj), v1 = load_lanes(vj + kLanes),
                    v2 = load_lanes(vj + 2 * kLanes), v3 = load_lanes(vj + 3 * kLanes);
        const float w[kRows] = {p0[j], p1[j], p2[j], p3[j]};
        for (int64_t r = 0; r < kRows; ++r) {
          acc[r][0] += w[r] * v0;
          acc[r][1] += w[r] * v1;
          acc[r][2] += w[r] * v2;
          acc[r][3] += w[r] * v3;
        }
      }
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t c = 0; c < 4; ++c)
          store_lanes(out + (i0 + r) * Dp + d0 + c * kLanes, acc[r][c]);
    }
  }
}

// max over j < n of s[j] where keep[j] != 0 (-inf if none), in 16 lanes.
DDTREE_ISA_CLONES
float masked_max(const float* __restrict s, const float* __restrict keep, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const Lanes hidden = Lanes{} + ninf;
  Lanes acc = hidden;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes x = load_lanes(s + j), k = load_lanes(keep + j);
    const Lanes seen = k != 0.0f ? x : hidden;
    acc = acc > seen ? acc : seen;
  }
  float m = ninf;
  for (int64_t i = 0; i < kLanes; ++i) m = std::max(m, acc[i]);
  for (; j < n; ++j)
    if (keep[j] != 0.0f) m = std::max(m, s[j]);
  return m;
}

// s[j] *= keep[j] for j < n; returns their sum (16 partial sums, then a tree).
DDTREE_ISA_CLONES
float masked_sum(float* __restrict s, const float* __restrict keep, int64_t n) {
  Lanes acc = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes x = load_lanes(s + j) * load_lanes(keep + j);
    store_lanes(s + j, x);
    acc += x;
  }
  float sum = 0.0f;
  for (; j < n; ++j) {
    s[j] *= keep[j];
    sum += s[j];
  }
  for (int64_t i = 0; i < kLanes; ++i) sum += acc[i];
  return sum;
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

struct Plan {
  const int64_t* rows;         // [F] batch rows, grouped by request
  const int64_t* row_start;    // [E + 1] each request's first row in `rows`
  const int64_t* prefix_len;   // [E] nc
  const int64_t* block_rows;   // [E] T
  const int64_t* block_ids;    // [E, max_blocks]
  int64_t max_blocks;
  const bool* visibility;      // [F, max_T] tree-block columns each row sees
  int64_t max_t;
  const int64_t* row_depths;   // [F]
  const int64_t* key_depths;   // [E, max_t]
};

struct Layer {
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  float scale, softcap;
  int64_t window;              // <= 0: none
  const float* sinks;          // [H] or null
  const int64_t* k_index;      // [block_size * head_dim]
  const int64_t* v_index;
  // The layout of vLLM's "vec" kernels (checked by the caller on the probed
  // indices): K transposed [D, block_size], V plain [block_size, D].
  bool plain_layout;
};

// Scratch buffers of one thread, reused across its tasks.
struct Scratch {
  std::vector<float> q, k_block, v_block, scores, keep, inv_sum, out;
};

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// One KV head of the rows row_begin .. row_end - 1 of tree request e (a chunk of
// its recomputed rows): three passes over the request's cache blocks (scores,
// softmax, values).
template <typename scalar_t, typename cache_t>
void attend_rows(const Plan& plan, const Layer& L, int64_t e, int64_t h,
                 int64_t row_begin, int64_t row_end, const scalar_t* query,
                 int64_t q_row_stride, const cache_t* cache, scalar_t* out,
                 int64_t out_row_stride, Scratch& buf) {
  const int64_t D = L.head_dim, bs = L.block_size;
  const int64_t group = L.num_heads / L.num_kv_heads;
  const int64_t f0 = plan.row_start[e] + row_begin, num_rows = row_end - row_begin;
  const int64_t nc = plan.prefix_len[e], T = plan.block_rows[e];
  const int64_t R = num_rows * group;  // query vectors of this KV head
  if (R == 0) return;
  const int64_t* depth = plan.row_depths + f0;
  const int64_t* key_depth = plan.key_depths + e * plan.max_t;
  int64_t first = 0;
  if (L.window > 0) {
    // Committed keys older than the shallowest row's window are seen by no row
    // (from a whole key tile on: the keys before a row's window are masked).
    int64_t shallowest = *std::min_element(depth, depth + num_rows);
    first = std::max<int64_t>(0, nc + shallowest - L.window + 1) / kKeyTile * kKeyTile;
  }
  const int64_t n = nc + T - first;
  // Rows and head dims padded to whole register tiles; a score row holds a
  // last tile's overhang.
  const int64_t R4 = round_up(R, kRows), ns = round_up(n, kKeyTile) + kKeyTile;
  const int64_t Dp = round_up(D, kDimTile);
  const float score_scale = L.softcap > 0 ? L.scale / L.softcap : L.scale;

  // q[r = row * group + g] = query[row, h * group + g] * scale
  buf.q.assign(R4 * D, 0.0f);
  for (int64_t f = 0; f < num_rows; ++f) {
    const scalar_t* src = query + plan.rows[f0 + f] * q_row_stride + h * group * D;
    for (int64_t i = 0; i < group * D; ++i)
      buf.q[f * group * D + i] = to_float(src[i]) * score_scale;
  }

  // A float32 cache in the "vec" layout (K block [D, bs], V block [bs, D]) is
  // read in place when whole tiles stay inside a block; any other block is
  // converted to float32 first (k_index / v_index: plain entry t * D + d ->
  // packed position): K as [D, bs_pad], V as [bs, Dp].
  constexpr bool kFloatCache = std::is_same<cache_t, float>::value;
  const bool in_place =
      kFloatCache && L.plain_layout && bs % kKeyTile == 0 && D % kDimTile == 0;
  const int64_t bs_pad = round_up(bs, kKeyTile);
  if (!in_place) {
    buf.k_block.resize(D * bs_pad);
    buf.v_block.resize(bs * Dp);
  }
  const int64_t region = bs * D;  // one (block, head) half: K or V
  const int64_t* ids = plan.block_ids + e * plan.max_blocks;
  auto for_each_block = [&](auto&& visit) {  // visit(k_packed, t0, len, j0)
    for (int64_t p0 = first; p0 < nc + T;) {
      const int64_t t0 = p0 % bs, len = std::min(bs - t0, nc + T - p0);
      visit(cache + ((ids[p0 / bs] * L.num_kv_heads + h) * 2) * region, t0, len,
            p0 - first);
      p0 += len;
    }
  };

  // Pass 1: scores [R4, ns], block by block (blocks in order: a block's tile
  // overhang is overwritten by the next block's keys).
  buf.scores.resize(R4 * ns);
  for_each_block([&](const cache_t* k_packed, int64_t t0, int64_t len, int64_t j0) {
    const float* kt;
    int64_t kt_stride;
    if (in_place) {
      kt = reinterpret_cast<const float*>(k_packed) + t0;
      kt_stride = bs;
    } else {
      float* dst = buf.k_block.data();
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = 0; t < len; ++t)
          dst[d * bs_pad + t] =
              to_float(L.plain_layout ? k_packed[d * bs + t0 + t]
                                      : k_packed[L.k_index[(t0 + t) * D + d]]);
      kt = dst;
      kt_stride = bs_pad;
    }
    qk_scores(buf.q.data(), R4, D, kt, kt_stride, len, buf.scores.data() + j0, ns);
  });

  // Pass 2: visibility, softcap, softmax (the head's sink in the denominator).
  buf.keep.resize(n);
  buf.inv_sum.assign(R4, 0.0f);
  float* keep = buf.keep.data();
  for (int64_t f = 0; f < num_rows; ++f) {
    const int64_t row_depth = depth[f];
    const bool* visible = plan.visibility + (f0 + f) * plan.max_t;
    // A committed key at position pos sits at depth pos - nc < 0: the row's
    // window reaches back to position nc + row_depth - window + 1.
    const int64_t lo =
        L.window > 0 ? std::max(first, nc + row_depth - L.window + 1) : first;
    for (int64_t j = 0; j < nc - first; ++j) keep[j] = first + j >= lo ? 1.0f : 0.0f;
    for (int64_t i = std::max<int64_t>(0, first - nc); i < T; ++i) {
      bool seen = visible[i];
      if (L.window > 0 && row_depth - key_depth[i] >= L.window) seen = false;
      keep[nc + i - first] = seen ? 1.0f : 0.0f;
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = f * group + g;
      float* s = buf.scores.data() + r * ns;
      if (L.softcap > 0)
        for (int64_t j = 0; j < n; ++j) s[j] = L.softcap * std::tanh(s[j]);
      float m = masked_max(s, keep, n);
      const float sink = L.sinks ? L.sinks[h * group + g] : 0.0f;
      if (L.sinks) m = std::max(m, sink);
      if (m == -std::numeric_limits<float>::infinity()) m = 0.0f;  // nothing seen
      // Hidden keys may score above m: exp of a clamped -87, then zeroed.
      for (int64_t j = 0; j < n; ++j) s[j] = keep[j] != 0.0f ? s[j] - m : -87.0f;
      exp_nonpositive(s, n);
      float sum = masked_sum(s, keep, n);
      if (L.sinks) {
        float x = sink - m;
        exp_nonpositive(&x, 1);
        sum += x;
      }
      buf.inv_sum[r] = sum > 0 ? 1.0f / sum : 0.0f;
    }
  }

  // Pass 3: out [R4, Dp] = p @ V, block by block (padding rows' and dims'
  // results are never read back).
  buf.out.assign(R4 * Dp, 0.0f);
  for_each_block([&](const cache_t* k_packed, int64_t t0, int64_t len, int64_t j0) {
    const cache_t* v_packed = k_packed + region;
    const float* v;
    int64_t v_stride;
    if (in_place) {
      v = reinterpret_cast<const float*>(v_packed) + t0 * D;
      v_stride = D;
    } else {
      float* dst = buf.v_block.data();
      for (int64_t t = 0; t < len; ++t)
        for (int64_t d = 0; d < D; ++d)
          dst[t * Dp + d] = to_float(L.plain_layout ? v_packed[(t0 + t) * D + d]
                                                    : v_packed[L.v_index[(t0 + t) * D + d]]);
      v = dst;
      v_stride = Dp;
    }
    pv_accumulate(buf.scores.data() + j0, R4, ns, v, v_stride, len, Dp, buf.out.data());
  });
  for (int64_t f = 0; f < num_rows; ++f) {
    scalar_t* dst = out + plan.rows[f0 + f] * out_row_stride + h * group * D;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = f * group + g;
      for (int64_t d = 0; d < D; ++d)
        dst[g * D + d] = static_cast<scalar_t>(buf.out[r * Dp + d] * buf.inv_sum[r]);
    }
  }
}

void check_int64(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == dims &&
                  t.is_contiguous(),
              "tree_attention_cpu: ", name, " must be a contiguous CPU int64 tensor of ",
              dims, " dims");
}

// Writes the attention of the plan's rows into `output` (other rows untouched).
void tree_attention_cpu(const at::Tensor& query,      // [N, H, D]
                        const at::Tensor& kv_cache,   // [nb, Hkv, bs, 2 * D]
                        const at::Tensor& k_index,    // [bs * D]
                        const at::Tensor& v_index,    // [bs * D]
                        at::Tensor output,            // [N, H, D]
                        const at::Tensor& rows,       // [F]
                        const at::Tensor& row_start,  // [E + 1]
                        const at::Tensor& prefix_len, // [E]
                        const at::Tensor& block_rows, // [E]
                        const at::Tensor& block_ids,  // [E, max_blocks]
                        const at::Tensor& visibility, // [F, max_t] bool
                        const at::Tensor& row_depths, // [F]
                        const at::Tensor& key_depths, // [E, max_t]
                        double scale, double softcap, int64_t window,
                        const std::optional<at::Tensor>& sinks,  // [H] float32
                        bool plain_layout) {
  TORCH_CHECK(query.dim() == 3 && output.dim() == 3 && kv_cache.dim() == 4,
              "tree_attention_cpu: query/output [N, H, D], kv_cache [nb, Hkv, bs, 2D]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  output.stride(2) == 1 && output.stride(1) == output.size(2),
              "tree_attention_cpu: query and output rows must be contiguous [H, D]");
  TORCH_CHECK(kv_cache.is_contiguous(), "tree_attention_cpu: kv_cache must be contiguous");
  TORCH_CHECK(query.scalar_type() == output.scalar_type(),
              "tree_attention_cpu: query and output dtypes differ");
  for (auto* t : {&rows, &row_start, &prefix_len, &block_rows, &row_depths, &k_index,
                  &v_index})
    check_int64(*t, "plan index", 1);
  check_int64(block_ids, "block_ids", 2);
  check_int64(key_depths, "key_depths", 2);
  TORCH_CHECK(visibility.scalar_type() == at::kBool && visibility.dim() == 2 &&
                  visibility.is_contiguous(),
              "tree_attention_cpu: visibility must be a contiguous bool [F, max_t]");
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t Hkv = kv_cache.size(1), bs = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == 2 * D && output.size(2) == D && H % Hkv == 0,
              "tree_attention_cpu: head sizes disagree");
  TORCH_CHECK(k_index.numel() == bs * D && v_index.numel() == bs * D,
              "tree_attention_cpu: k_index/v_index must hold block_size * head_dim");
  const int64_t E = prefix_len.numel();
  TORCH_CHECK(row_start.numel() == E + 1 && block_rows.numel() == E &&
                  block_ids.size(0) == E && key_depths.size(0) == E,
              "tree_attention_cpu: per-request plan tensors disagree in length");
  const int64_t F = rows.numel();
  TORCH_CHECK(visibility.size(0) == F && row_depths.numel() == F &&
                  visibility.size(1) == key_depths.size(1),
              "tree_attention_cpu: per-row plan tensors disagree");
  const int64_t* start = row_start.data_ptr<int64_t>();
  const int64_t* nc = prefix_len.data_ptr<int64_t>();
  const int64_t* T = block_rows.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[E] == F, "tree_attention_cpu: bad row_start");
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(start[e] <= start[e + 1] && T[e] <= visibility.size(1) && nc[e] >= 0 &&
                    (nc[e] + T[e] + bs - 1) / bs <= block_ids.size(1),
                "tree_attention_cpu: request ", e, " exceeds its plan");
  }
  for (int64_t f = 0; f < F; ++f)
    TORCH_CHECK(row[f] >= 0 && row[f] < query.size(0) && row[f] < output.size(0),
                "tree_attention_cpu: row ", row[f], " outside the batch");
  std::optional<at::Tensor> sinks_f32;
  if (sinks.has_value()) {
    sinks_f32 = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_f32->numel() == H, "tree_attention_cpu: sinks must hold one per head");
  }

  Plan plan{row,
            start,
            nc,
            T,
            block_ids.data_ptr<int64_t>(),
            block_ids.size(1),
            visibility.data_ptr<bool>(),
            visibility.size(1),
            row_depths.data_ptr<int64_t>(),
            key_depths.data_ptr<int64_t>()};
  Layer layer{H,
              Hkv,
              D,
              bs,
              static_cast<float>(scale),
              static_cast<float>(softcap),
              window,
              sinks_f32 ? sinks_f32->data_ptr<float>() : nullptr,
              k_index.data_ptr<int64_t>(),
              v_index.data_ptr<int64_t>(),
              plain_layout};

  // Tasks: (request, KV head, chunk of its rows). A batch of one request has
  // fewer KV heads than twice the threads on many models: its rows are split
  // so that the threads share the work (each chunk reads the keys again). A
  // chunk holds at most kMaxTaskRows rows: a task's scores take rows x group x
  // context floats of its thread's scratch.
  struct Task {
    int64_t request, kv_head, row_begin, row_end;
  };
  std::vector<Task> tasks;
  const int64_t wanted = 2 * at::get_num_threads();
  const int64_t chunks_per_head = std::max<int64_t>(1, (wanted + E * Hkv - 1) / (E * Hkv));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t num_rows = start[e + 1] - start[e];
    if (num_rows == 0) continue;
    const int64_t chunk =
        std::min(kMaxTaskRows, (num_rows + chunks_per_head - 1) / chunks_per_head);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t r = 0; r < num_rows; r += chunk)
        tasks.push_back({e, h, r, std::min(num_rows, r + chunk)});
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "tree_attention_cpu", [&] {
        using q_t = scalar_t;
        const q_t* q = query.data_ptr<q_t>();
        q_t* out = output.data_ptr<q_t>();
        const int64_t q_stride = query.stride(0), out_stride = output.stride(0);
        AT_DISPATCH_FLOATING_TYPES_AND2(
            at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "tree_attention_cpu_cache",
            [&] {
              const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
              // One task per (tree request, KV head); a task is ~n * D * R flops.
              at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1,
                               [&](int64_t begin, int64_t end) {
                                 thread_local Scratch buf;
                                 for (int64_t i = begin; i < end; ++i) {
                                   const Task& t = tasks[i];
                                   attend_rows<q_t, scalar_t>(
                                       plan, layer, t.request, t.kv_head, t.row_begin,
                                       t.row_end, q, q_stride, cache, out, out_stride, buf);
                                 }
                               });
            });
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_ddtree, m) {
  m.def(
      "tree_attention_cpu(Tensor query, Tensor kv_cache, Tensor k_index, Tensor v_index, "
      "Tensor(a!) output, Tensor rows, Tensor row_start, Tensor prefix_len, "
      "Tensor block_rows, Tensor block_ids, Tensor visibility, Tensor row_depths, "
      "Tensor key_depths, float scale, float softcap, int window, Tensor? sinks, "
      "bool plain_layout) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_ddtree, CPU, m) { m.impl("tree_attention_cpu", &tree_attention_cpu); }
