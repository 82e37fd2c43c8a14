// SPDX-License-Identifier: Apache-2.0
//
// Torch binding of the DDTree tree verification kernel (csrc/tree_verify.cuh),
// registered as torch.ops.vllm_ddtree.tree_verify in csrc/bindings.cpp.
//
// R = number of requests, N + 1 = tree rows (root + node capacity), V = vocab,
// W = max_depth + 1.
//
// accepted_indices: [R, W] int64     // mutable; path node ids, root first, -1 padded
// committed_tokens: [R, W] int64     // mutable; accepted drafts + one bonus, -1 padded
// num_accepted:     [R] int64        // mutable; accepted drafts (root, bonus excluded)
// logits:           [R, N + 1, V] float32 / float16 / bfloat16; last dim contiguous
// tokens:           [R, N + 1] int64; node tokens (row 0 = root)
// next_token:       [R, N + 1] int64; LCRS first child, -1 if none
// next_sibling:     [R, N + 1] int64; LCRS next sibling (draft-rank order), -1 if none
// temperature:      [R] float32, or None: every request is greedy (greedy-only kernel)
// node_coins:       [R, N + 1] float32 in [0, 1); required with temperature
// final_coins:      [R] float32 in [0, 1); required with temperature
// max_depth:        L >= 0, the deepest node of the trees
// method:           0 = sample_walk, 1 = rejection
// threshold_single, threshold_acc: in (0, 1]; 1.0 is exact
//
// Every output entry is written (padding included). The launch is asynchronous
// on the current stream; nothing here synchronizes with the device.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "tree_verify.cuh"

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), "Expected '" #x "' to be a CUDA tensor")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), "Expected '" #x "' to be contiguous")
#define CHECK_INPUT(x) \
  CHECK_CUDA(x);       \
  CHECK_CONTIGUOUS(x)
#define CHECK_DIM(d, x) \
  TORCH_CHECK((x).dim() == (d), "Expected '" #x "' to be a ", (d), "D tensor, got ", (x).dim(), "D")
#define CHECK_DTYPE(x, t)                                                              \
  TORCH_CHECK((x).scalar_type() == (t), "Expected '" #x "' to be of type ", (t), ", got ", \
              (x).scalar_type())
#define CHECK_SHAPE(x, ...)                                                           \
  TORCH_CHECK((x).sizes() == at::IntArrayRef({__VA_ARGS__}), "Expected '" #x "' to have shape ", \
              at::IntArrayRef({__VA_ARGS__}), ", got ", (x).sizes())
#define CHECK_SAME_DEVICE(x, y)                                                          \
  TORCH_CHECK((x).device() == (y).device(), "Expected '" #x "' (", (x).device(),        \
              ") to be on the same device as '" #y "' (", (y).device(), ")")

namespace {

template <typename DType>
cudaError_t LaunchTreeVerify(at::Tensor& accepted_indices, at::Tensor& committed_tokens,
                             at::Tensor& num_accepted, const at::Tensor& logits,
                             const at::Tensor& tokens, const at::Tensor& next_token,
                             const at::Tensor& next_sibling, const float* temperature,
                             const float* node_coins, const float* final_coins,
                             int64_t max_depth, int64_t method, double threshold_single,
                             double threshold_acc, cudaStream_t stream) {
  ddtree::TreeVerifyParams<DType> params;
  params.accepted_indices = accepted_indices.data_ptr<int64_t>();
  params.committed_tokens = committed_tokens.data_ptr<int64_t>();
  params.num_accepted = num_accepted.data_ptr<int64_t>();
  params.logits = reinterpret_cast<const DType*>(logits.data_ptr());
  params.logits_stride_req = logits.stride(0);
  params.logits_stride_row = logits.stride(1);
  params.tokens = tokens.data_ptr<int64_t>();
  params.next_token = next_token.data_ptr<int64_t>();
  params.next_sibling = next_sibling.data_ptr<int64_t>();
  params.temperature = temperature;
  params.node_coins = node_coins;
  params.final_coins = final_coins;
  params.num_reqs = static_cast<int32_t>(logits.size(0));
  params.num_rows = static_cast<int32_t>(logits.size(1));
  params.vocab_size = static_cast<int32_t>(logits.size(2));
  params.max_depth = static_cast<int32_t>(max_depth);
  params.method = static_cast<int32_t>(method);
  params.threshold_single = threshold_single;
  params.threshold_acc = threshold_acc;
  return ddtree::TreeVerify<DType>(params, /*greedy_only=*/temperature == nullptr, stream);
}

}  // namespace

void tree_verify(at::Tensor& accepted_indices, at::Tensor& committed_tokens,
                 at::Tensor& num_accepted, const at::Tensor& logits, const at::Tensor& tokens,
                 const at::Tensor& next_token, const at::Tensor& next_sibling,
                 const std::optional<at::Tensor>& temperature,
                 const std::optional<at::Tensor>& node_coins,
                 const std::optional<at::Tensor>& final_coins, int64_t max_depth,
                 int64_t method, double threshold_single, double threshold_acc) {
  // logits: [R, N + 1, V], any float type the kernel reads; rows may be strided.
  CHECK_CUDA(logits);
  CHECK_DIM(3, logits);
  const at::ScalarType dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "Expected 'logits' to be of type float32, float16 or bfloat16, got ", dtype);
  const int64_t num_reqs = logits.size(0);
  const int64_t num_rows = logits.size(1);
  const int64_t vocab = logits.size(2);
  TORCH_CHECK(num_rows >= 1, "'logits' needs at least one tree row (the root), got shape ",
              logits.sizes());
  TORCH_CHECK(vocab >= 1, "'logits' needs vocab_size >= 1, got shape ", logits.sizes());
  TORCH_CHECK(logits.stride(2) == 1 || vocab == 1,
              "Expected 'logits' to be contiguous in its last (vocab) dimension, got strides ",
              logits.strides());
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(num_reqs <= kInt32Max && num_rows <= kInt32Max && vocab <= kInt32Max,
              "tree_verify supports at most 2^31 - 1 requests, tree rows and vocab entries, got ",
              logits.sizes());
  TORCH_CHECK(max_depth >= 0 && max_depth < kInt32Max, "max_depth must be >= 0, got ",
              max_depth);
  TORCH_CHECK(method == ddtree::kSampleWalk || method == ddtree::kRejection,
              "method must be 0 (sample_walk) or 1 (rejection), got ", method);
  TORCH_CHECK(threshold_single > 0.0 && threshold_single <= 1.0,
              "threshold_single must be in (0, 1], got ", threshold_single);
  TORCH_CHECK(threshold_acc > 0.0 && threshold_acc <= 1.0,
              "threshold_acc must be in (0, 1], got ", threshold_acc);

  // The tree: [R, N + 1] int64 each.
  CHECK_INPUT(tokens);
  CHECK_INPUT(next_token);
  CHECK_INPUT(next_sibling);
  CHECK_DTYPE(tokens, at::kLong);
  CHECK_DTYPE(next_token, at::kLong);
  CHECK_DTYPE(next_sibling, at::kLong);
  CHECK_SHAPE(tokens, num_reqs, num_rows);
  CHECK_SHAPE(next_token, num_reqs, num_rows);
  CHECK_SHAPE(next_sibling, num_reqs, num_rows);
  CHECK_SAME_DEVICE(tokens, logits);
  CHECK_SAME_DEVICE(next_token, logits);
  CHECK_SAME_DEVICE(next_sibling, logits);

  // Outputs (mutable): [R, W] int64 twice and [R] int64.
  const int64_t width = max_depth + 1;
  CHECK_INPUT(accepted_indices);
  CHECK_INPUT(committed_tokens);
  CHECK_INPUT(num_accepted);
  CHECK_DTYPE(accepted_indices, at::kLong);
  CHECK_DTYPE(committed_tokens, at::kLong);
  CHECK_DTYPE(num_accepted, at::kLong);
  CHECK_SHAPE(accepted_indices, num_reqs, width);
  CHECK_SHAPE(committed_tokens, num_reqs, width);
  CHECK_SHAPE(num_accepted, num_reqs);
  CHECK_SAME_DEVICE(accepted_indices, logits);
  CHECK_SAME_DEVICE(committed_tokens, logits);
  CHECK_SAME_DEVICE(num_accepted, logits);

  // Sampling inputs: all three, or none (every request greedy).
  const float* temperature_ptr = nullptr;
  const float* node_coins_ptr = nullptr;
  const float* final_coins_ptr = nullptr;
  if (temperature.has_value()) {
    const at::Tensor& temp = *temperature;
    TORCH_CHECK(node_coins.has_value() && final_coins.has_value(),
                "'node_coins' and 'final_coins' are required when 'temperature' is given");
    const at::Tensor& coins = *node_coins;
    const at::Tensor& final_c = *final_coins;
    CHECK_INPUT(temp);
    CHECK_INPUT(coins);
    CHECK_INPUT(final_c);
    CHECK_DTYPE(temp, at::kFloat);
    CHECK_DTYPE(coins, at::kFloat);
    CHECK_DTYPE(final_c, at::kFloat);
    CHECK_SHAPE(temp, num_reqs);
    CHECK_SHAPE(coins, num_reqs, num_rows);
    CHECK_SHAPE(final_c, num_reqs);
    CHECK_SAME_DEVICE(temp, logits);
    CHECK_SAME_DEVICE(coins, logits);
    CHECK_SAME_DEVICE(final_c, logits);
    temperature_ptr = temp.data_ptr<float>();
    node_coins_ptr = coins.data_ptr<float>();
    final_coins_ptr = final_c.data_ptr<float>();
  }

  if (num_reqs == 0) return;
  const c10::cuda::OptionalCUDAGuard device_guard(logits.device());
  const bool greedy_only = temperature_ptr == nullptr;
  const int64_t max_rows = greedy_only ? ddtree::TreeVerifyMaxRows<true>()
                                       : ddtree::TreeVerifyMaxRows<false>();
  TORCH_CHECK(max_rows < 0 || num_rows <= max_rows, "tree_verify: ", num_rows,
              " tree rows per request do not fit in shared memory (at most ", max_rows,
              " on this device)");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  cudaError_t status = cudaSuccess;
  switch (dtype) {
    case at::kFloat:
      status = LaunchTreeVerify<float>(accepted_indices, committed_tokens, num_accepted, logits,
                                       tokens, next_token, next_sibling, temperature_ptr,
                                       node_coins_ptr, final_coins_ptr, max_depth, method,
                                       threshold_single, threshold_acc, stream);
      break;
    case at::kHalf:
      status = LaunchTreeVerify<__half>(accepted_indices, committed_tokens, num_accepted, logits,
                                        tokens, next_token, next_sibling, temperature_ptr,
                                        node_coins_ptr, final_coins_ptr, max_depth, method,
                                        threshold_single, threshold_acc, stream);
      break;
    default:  // at::kBFloat16, checked above
      status = LaunchTreeVerify<__nv_bfloat16>(
          accepted_indices, committed_tokens, num_accepted, logits, tokens, next_token,
          next_sibling, temperature_ptr, node_coins_ptr, final_coins_ptr, max_depth, method,
          threshold_single, threshold_acc, stream);
      break;
  }
  TORCH_CHECK(status == cudaSuccess, "tree_verify: kernel launch failed: ",
              cudaGetErrorString(status));
}

// Meta / fake-tensor implementation for tracing (torch.compile): the op only
// writes its outputs in place, so there is nothing to compute. Sizes are not
// read (they may be symbolic); ranks are.
void tree_verify_meta(at::Tensor& accepted_indices, at::Tensor& committed_tokens,
                      at::Tensor& num_accepted, const at::Tensor& logits,
                      const at::Tensor& tokens, const at::Tensor& next_token,
                      const at::Tensor& next_sibling, const std::optional<at::Tensor>& temperature,
                      const std::optional<at::Tensor>& node_coins,
                      const std::optional<at::Tensor>& final_coins, int64_t max_depth,
                      int64_t method, double threshold_single, double threshold_acc) {
  CHECK_DIM(3, logits);
  CHECK_DIM(2, accepted_indices);
  CHECK_DIM(2, committed_tokens);
  CHECK_DIM(1, num_accepted);
  TORCH_CHECK(max_depth >= 0, "max_depth must be >= 0, got ", max_depth);
}
