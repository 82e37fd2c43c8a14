// SPDX-License-Identifier: Apache-2.0
//
// DDTree tree construction on CPU (torch.ops.vllm_ddtree.build_tree_cpu).
//
// DDTree (https://arxiv.org/abs/2604.12989) keeps the B prefixes with the highest
// factorized draft score sum_i log q_i(u_i). On a GPU the batched depth-wise top-B
// of vllm_ddtree.tree.build_ddtree is the right shape; on a CPU that build is
// dominated by per-operator overhead (about 15 depths x a dozen small ops), so this
// file builds each request's tree with the paper's best-first heap, compiled, and
// derives every other DraftTree field (LCRS links, visibility, packed visibility)
// in the same pass. The result is the tree of vllm_ddtree.tree, field for field.
//
// Total order (vllm_ddtree/tree.py, ties included): nodes are ranked by
//   (-score, depth, position of the parent within its depth, draft rank)
// with score(child) = fl32(score(parent) + log_prob[depth - 1][rank]). A popped node
// pushes its next sibling (rank + 1, same parent) and its first child (rank 0), so
// the heap pops exactly this order; node index = pop order. A -inf (or NaN) score
// ends the tree: the vectorized builder marks such nodes invalid too.
//
// Requests are built one after another on the calling thread: one request takes
// microseconds, less than a parallel region's start-up.

#include "../python_module.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

struct Candidate {
  float score;
  int32_t depth;       // 1-based
  int32_t parent_pos;  // the parent's position within its own depth
  int32_t rank;        // draft rank at this depth
  int32_t parent;      // local index of the parent
  float parent_score;
};

// Heap comparator: true when `a` comes after `b` in the total order, so that
// std::push_heap / std::pop_heap keep the first node of the order on top.
struct ComesAfter {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.score != b.score) return a.score < b.score;
    if (a.depth != b.depth) return a.depth > b.depth;
    if (a.parent_pos != b.parent_pos) return a.parent_pos > b.parent_pos;
    // Never reached between two heap entries (a parent has at most one child in
    // the heap at a time: the next sibling enters when its elder leaves); kept so
    // that the comparator spells out the whole order.
    return a.rank > b.rank;
  }
};

using TreeTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

}  // namespace

// Args (all CPU, contiguous):
//   log_probs    [R, L, K] float32  per-depth draft log-probs, descending per row
//   token_ids    [R, L, K] int64    the matching token ids
//   budgets      [R] int64          node budget per request (clamped to [0, capacity])
//   root_tokens  [R] int64          row 0 of each tree
//   capacity     N: node rows per request (root excluded)
// Returns the DraftTree fields, each padded to N + 1 rows per request:
//   tokens, parents, depths [R, N+1] int64; scores [R, N+1] float32; num_nodes [R]
//   int64; retrieve_index, retrieve_next_token, retrieve_next_sibling [R, N+1] int64;
//   visibility [R, N+1, N+1] bool; visibility_packed [R, N+1, ceil((N+1)/32)] int32.
TreeTensors build_tree_cpu(const at::Tensor& log_probs, const at::Tensor& token_ids,
                           const at::Tensor& budgets, const at::Tensor& root_tokens,
                           int64_t capacity) {
  TORCH_CHECK(log_probs.device().is_cpu() && token_ids.device().is_cpu() &&
                  budgets.device().is_cpu() && root_tokens.device().is_cpu(),
              "build_tree_cpu: every tensor must be on the CPU");
  TORCH_CHECK(log_probs.dim() == 3 && log_probs.scalar_type() == at::kFloat &&
                  log_probs.is_contiguous(),
              "build_tree_cpu: log_probs must be a contiguous [R, L, K] float32 tensor");
  TORCH_CHECK(token_ids.sizes() == log_probs.sizes() && token_ids.scalar_type() == at::kLong &&
                  token_ids.is_contiguous(),
              "build_tree_cpu: token_ids must be a contiguous int64 tensor shaped like "
              "log_probs");
  const int64_t num_reqs = log_probs.size(0);
  const int64_t depth_limit = log_probs.size(1);
  const int64_t k = log_probs.size(2);
  TORCH_CHECK(budgets.dim() == 1 && budgets.size(0) == num_reqs &&
                  budgets.scalar_type() == at::kLong && budgets.is_contiguous(),
              "build_tree_cpu: budgets must be a contiguous [R] int64 tensor");
  TORCH_CHECK(root_tokens.dim() == 1 && root_tokens.size(0) == num_reqs &&
                  root_tokens.scalar_type() == at::kLong && root_tokens.is_contiguous(),
              "build_tree_cpu: root_tokens must be a contiguous [R] int64 tensor");
  TORCH_CHECK(depth_limit >= 1 && k >= 1, "build_tree_cpu: needs L >= 1 and K >= 1");
  TORCH_CHECK(capacity >= 0 && capacity < (int64_t{1} << 30),
              "build_tree_cpu: capacity out of range");

  const int64_t rows = capacity + 1;
  const int64_t words = (rows + 31) / 32;
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor tokens = at::empty({num_reqs, rows}, long_opts);
  at::Tensor parents = at::empty({num_reqs, rows}, long_opts);
  at::Tensor depths = at::empty({num_reqs, rows}, long_opts);
  at::Tensor scores = at::empty({num_reqs, rows}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor num_nodes = at::empty({num_reqs}, long_opts);
  at::Tensor retrieve_index = at::empty({num_reqs, rows}, long_opts);
  at::Tensor first_child = at::empty({num_reqs, rows}, long_opts);
  at::Tensor next_sibling = at::empty({num_reqs, rows}, long_opts);
  at::Tensor visibility = at::zeros({num_reqs, rows, rows}, at::TensorOptions().dtype(at::kBool));
  at::Tensor packed = at::zeros({num_reqs, rows, words}, at::TensorOptions().dtype(at::kInt));

  const float* lp_all = log_probs.data_ptr<float>();
  const int64_t* ids_all = token_ids.data_ptr<int64_t>();
  const int64_t* budget_of = budgets.data_ptr<int64_t>();
  const int64_t* root_of = root_tokens.data_ptr<int64_t>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  std::vector<Candidate> heap;
  heap.reserve(static_cast<size_t>(capacity) + 2);
  std::vector<int32_t> count_at_depth(depth_limit + 1);
  std::vector<int64_t> last_child(rows);

  for (int64_t b = 0; b < num_reqs; ++b) {
    const float* lp = lp_all + b * depth_limit * k;  // [L, K]
    const int64_t* ids = ids_all + b * depth_limit * k;
    int64_t* tok = tokens.data_ptr<int64_t>() + b * rows;
    int64_t* par = parents.data_ptr<int64_t>() + b * rows;
    int64_t* dep = depths.data_ptr<int64_t>() + b * rows;
    float* sco = scores.data_ptr<float>() + b * rows;
    int64_t* ret = retrieve_index.data_ptr<int64_t>() + b * rows;
    int64_t* first = first_child.data_ptr<int64_t>() + b * rows;
    int64_t* next = next_sibling.data_ptr<int64_t>() + b * rows;
    bool* vis = visibility.data_ptr<bool>() + b * rows * rows;
    int32_t* bits = packed.data_ptr<int32_t>() + b * rows * words;

    // Padding defaults; the root and the nodes overwrite their rows below.
    std::fill(tok, tok + rows, 0);
    std::fill(par, par + rows, -1);
    std::fill(dep, dep + rows, 0);
    std::fill(sco, sco + rows, kNegInf);
    std::fill(first, first + rows, -1);
    std::fill(next, next + rows, -1);
    std::fill(last_child.begin(), last_child.end(), -1);
    std::fill(count_at_depth.begin(), count_at_depth.end(), 0);
    for (int64_t i = 0; i < rows; ++i) ret[i] = b * rows + i;
    tok[0] = root_of[b];
    sco[0] = 0.0f;
    vis[0] = true;
    bits[0] = 1;

    const int64_t budget = std::clamp<int64_t>(budget_of[b], 0, capacity);
    int64_t n = 0;  // nodes so far (root excluded)
    heap.clear();
    if (budget > 0) heap.push_back({0.0f + lp[0], 1, 0, 0, 0, 0.0f});
    while (!heap.empty() && n < budget) {
      std::pop_heap(heap.begin(), heap.end(), ComesAfter{});
      const Candidate c = heap.back();
      heap.pop_back();
      if (!(c.score > kNegInf)) break;  // -inf or NaN: everything after is too
      const int64_t node = ++n;
      const int32_t pos = count_at_depth[c.depth]++;
      tok[node] = ids[(c.depth - 1) * k + c.rank];
      par[node] = c.parent;
      dep[node] = c.depth;
      sco[node] = c.score;
      // LCRS: children pop in rank order, so the first popped is the first child.
      if (last_child[c.parent] < 0) {
        first[c.parent] = node;
      } else {
        next[last_child[c.parent]] = node;
      }
      last_child[c.parent] = node;
      // Visibility: the parent's row (ancestors, all < node) plus the node itself.
      std::memcpy(vis + node * rows, vis + c.parent * rows, static_cast<size_t>(node));
      std::memcpy(bits + node * words, bits + c.parent * words,
                  static_cast<size_t>(words) * sizeof(int32_t));
      vis[node * rows + node] = true;
      bits[node * words + node / 32] |= static_cast<int32_t>(uint32_t{1} << (node % 32));
      if (c.rank + 1 < k) {  // next sibling
        const float s = c.parent_score + lp[(c.depth - 1) * k + c.rank + 1];
        heap.push_back({s, c.depth, c.parent_pos, c.rank + 1, c.parent, c.parent_score});
        std::push_heap(heap.begin(), heap.end(), ComesAfter{});
      }
      if (c.depth < depth_limit) {  // first child
        const float s = c.score + lp[c.depth * k];
        heap.push_back({s, c.depth + 1, pos, 0, static_cast<int32_t>(node), c.score});
        std::push_heap(heap.begin(), heap.end(), ComesAfter{});
      }
    }
    num_nodes.data_ptr<int64_t>()[b] = n;
    // Padding rows see only themselves.
    for (int64_t i = n + 1; i < rows; ++i) {
      vis[i * rows + i] = true;
      bits[i * words + i / 32] |= static_cast<int32_t>(uint32_t{1} << (i % 32));
    }
  }
  return {tokens, parents, depths, scores, num_nodes, retrieve_index,
          first_child, next_sibling, visibility, packed};
}

TORCH_LIBRARY_FRAGMENT(vllm_ddtree, m) {
  m.def(
      "build_tree_cpu(Tensor log_probs, Tensor token_ids, Tensor budgets, "
      "Tensor root_tokens, int capacity) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vllm_ddtree, CPU, m) { m.impl("build_tree_cpu", &build_tree_cpu); }

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C_cpu
#endif
DDTREE_PYTHON_MODULE("vllm_ddtree CPU kernels; the operators live in torch.ops.vllm_ddtree.")
