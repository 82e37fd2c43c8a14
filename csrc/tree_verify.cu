// SPDX-License-Identifier: Apache-2.0
//
// Host side of the DDTree tree verification kernel (tree_verify.cuh): argument
// checks and the launch, written against libtorch's stable ABI (as vLLM's own
// kernels are). Two registrations use it: vLLM's as
// torch.ops._C.ddtree_tree_verify (csrc/torch_bindings.cpp), and a standalone
// extension's as tree_verify in its own namespace (its bindings.cpp).
//
// R = number of requests, N + 1 = tree rows (root + node capacity), V = vocab,
// W = max_depth + 1.
//
// accepted_indices: [R, W] int64     // mutable; path node ids, root first, -1 padded
// committed_tokens: [R, W] int64     // mutable; accepted drafts + one bonus, -1 padded
// num_accepted:     [R] int64        // mutable; accepted drafts (root, bonus excluded)
// logits:           [R, N + 1, V] float32 / float16 / bfloat16, or [M, V] with
//                   row_index (read in place); vocab dimension contiguous
// tokens:           [R, N + 1] int64; node tokens (row 0 = root)
// next_token:       [R, N + 1] int64; LCRS first child, -1 if none
// next_sibling:     [R, N + 1] int64; LCRS next sibling (draft-rank order), -1 if none
// temperature:      [R] float32, or None: every request is greedy (greedy-only kernel)
// node_coins:       [R, N + 1] float32 in [0, 1); required with temperature
// final_coins:      [R] float32 in [0, 1); required with temperature
// max_depth:        L >= 0, the deepest node of the trees
// method:           0 = sample_walk, 1 = rejection
// threshold_single, threshold_acc: in (0, 1]; 1.0 is exact
// row_index:        [R, N + 1] int64 or None: tree row i of request b is
//                   logits[row_index[b, i]] (entries in [0, M), not checked here)
//
// Every output entry is written (padding included). The launch is asynchronous
// on the current stream; nothing here synchronizes with the device.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#include "tree_verify.cuh"

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

std::string ShapeString(const Tensor& x) {
  std::ostringstream out;
  out << "[";
  for (int64_t d = 0; d < x.dim(); ++d) out << (d ? ", " : "") << x.size(d);
  out << "]";
  return out.str();
}

void CheckCudaContiguous(const Tensor& x, const char* name) {
  STD_TORCH_CHECK(x.is_cuda(), "Expected '", name, "' to be a CUDA tensor");
  STD_TORCH_CHECK(x.is_contiguous(), "Expected '", name, "' to be contiguous");
}

void CheckTensor(const Tensor& x, const char* name, ScalarType dtype, const char* dtype_name,
                 std::initializer_list<int64_t> shape, const Tensor& logits) {
  CheckCudaContiguous(x, name);
  STD_TORCH_CHECK(x.scalar_type() == dtype, "Expected '", name, "' to be of type ", dtype_name);
  bool same_shape = x.dim() == static_cast<int64_t>(shape.size());
  int64_t d = 0;
  for (int64_t size : shape) same_shape = same_shape && x.size(d++) == size;
  STD_TORCH_CHECK(same_shape, "Expected '", name, "' to have ", shape.size(),
                  " dims matching logits, got shape ", ShapeString(x));
  STD_TORCH_CHECK(x.get_device_index() == logits.get_device_index(), "Expected '", name,
                  "' to be on the same device as 'logits'");
}

cudaStream_t CurrentStream(int32_t device_index) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "tree_verify: cannot get the current CUDA stream");
  return reinterpret_cast<cudaStream_t>(stream);
}

template <typename DType>
cudaError_t LaunchTreeVerify(Tensor& accepted_indices, Tensor& committed_tokens,
                             Tensor& num_accepted, const Tensor& logits,
                             const int64_t* row_index, int64_t num_reqs, int64_t num_rows,
                             const Tensor& tokens, const Tensor& next_token,
                             const Tensor& next_sibling, const float* temperature,
                             const float* node_coins, const float* final_coins,
                             int64_t max_depth, int64_t method, double threshold_single,
                             double threshold_acc, cudaStream_t stream) {
  ddtree::TreeVerifyParams<DType> params;
  params.accepted_indices = accepted_indices.mutable_data_ptr<int64_t>();
  params.committed_tokens = committed_tokens.mutable_data_ptr<int64_t>();
  params.num_accepted = num_accepted.mutable_data_ptr<int64_t>();
  params.logits = reinterpret_cast<const DType*>(logits.const_data_ptr());
  params.row_index = row_index;
  // [M, V] rows through row_index, else [R, N + 1, V].
  params.logits_stride_req = row_index != nullptr ? 0 : logits.stride(0);
  params.logits_stride_row = logits.stride(logits.dim() - 2);
  params.tokens = tokens.const_data_ptr<int64_t>();
  params.next_token = next_token.const_data_ptr<int64_t>();
  params.next_sibling = next_sibling.const_data_ptr<int64_t>();
  params.temperature = temperature;
  params.node_coins = node_coins;
  params.final_coins = final_coins;
  params.num_reqs = static_cast<int32_t>(num_reqs);
  params.num_rows = static_cast<int32_t>(num_rows);
  params.vocab_size = static_cast<int32_t>(logits.size(logits.dim() - 1));
  params.max_depth = static_cast<int32_t>(max_depth);
  params.method = static_cast<int32_t>(method);
  params.threshold_single = threshold_single;
  params.threshold_acc = threshold_acc;
  return ddtree::TreeVerify<DType>(params, /*greedy_only=*/temperature == nullptr, stream);
}

}  // namespace

void ddtree_tree_verify(Tensor& accepted_indices, Tensor& committed_tokens, Tensor& num_accepted,
                        const Tensor& logits, const Tensor& tokens, const Tensor& next_token,
                        const Tensor& next_sibling, const std::optional<Tensor>& temperature,
                        const std::optional<Tensor>& node_coins,
                        const std::optional<Tensor>& final_coins, int64_t max_depth,
                        int64_t method, double threshold_single, double threshold_acc,
                        const std::optional<Tensor>& row_index) {
  // logits: [R, N + 1, V], or [M, V] read through row_index [R, N + 1]; any float
  // type the kernel reads; rows may be strided.
  STD_TORCH_CHECK(logits.is_cuda(), "Expected 'logits' to be a CUDA tensor");
  const int64_t logits_dims = row_index.has_value() ? 2 : 3;
  STD_TORCH_CHECK(logits.dim() == logits_dims, "Expected 'logits' to be a ", logits_dims,
                  "D tensor", row_index.has_value() ? " (with row_index)" : "", ", got ",
                  logits.dim(), "D");
  if (row_index.has_value()) {
    CheckCudaContiguous(*row_index, "row_index");
    STD_TORCH_CHECK(row_index->scalar_type() == ScalarType::Long,
                    "Expected 'row_index' to be of type int64");
    STD_TORCH_CHECK(row_index->dim() == 2, "Expected 'row_index' to be [R, N + 1], got shape ",
                    ShapeString(*row_index));
    STD_TORCH_CHECK(row_index->get_device_index() == logits.get_device_index(),
                    "Expected 'row_index' to be on the same device as 'logits'");
  }
  const ScalarType dtype = logits.scalar_type();
  STD_TORCH_CHECK(
      dtype == ScalarType::Float || dtype == ScalarType::Half || dtype == ScalarType::BFloat16,
      "Expected 'logits' to be of type float32, float16 or bfloat16");
  const int64_t num_reqs = row_index.has_value() ? row_index->size(0) : logits.size(0);
  const int64_t num_rows = row_index.has_value() ? row_index->size(1) : logits.size(1);
  const int64_t vocab = logits.size(logits_dims - 1);
  STD_TORCH_CHECK(num_rows >= 1, "'logits' needs at least one tree row (the root), got shape ",
                  ShapeString(logits));
  STD_TORCH_CHECK(vocab >= 1, "'logits' needs vocab_size >= 1, got shape ", ShapeString(logits));
  STD_TORCH_CHECK(logits.stride(logits_dims - 1) == 1 || vocab == 1,
                  "Expected 'logits' to be contiguous in its last (vocab) dimension");
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  STD_TORCH_CHECK(num_reqs <= kInt32Max && num_rows <= kInt32Max && vocab <= kInt32Max,
                  "tree_verify supports at most 2^31 - 1 requests, tree rows and vocab "
                  "entries, got ",
                  ShapeString(logits));
  STD_TORCH_CHECK(max_depth >= 0 && max_depth < kInt32Max, "max_depth must be >= 0, got ",
                  max_depth);
  STD_TORCH_CHECK(method == ddtree::kSampleWalk || method == ddtree::kRejection,
                  "method must be 0 (sample_walk) or 1 (rejection), got ", method);
  STD_TORCH_CHECK(threshold_single > 0.0 && threshold_single <= 1.0,
                  "threshold_single must be in (0, 1], got ", threshold_single);
  STD_TORCH_CHECK(threshold_acc > 0.0 && threshold_acc <= 1.0,
                  "threshold_acc must be in (0, 1], got ", threshold_acc);

  // The tree: [R, N + 1] int64 each.
  CheckTensor(tokens, "tokens", ScalarType::Long, "int64", {num_reqs, num_rows}, logits);
  CheckTensor(next_token, "next_token", ScalarType::Long, "int64", {num_reqs, num_rows}, logits);
  CheckTensor(next_sibling, "next_sibling", ScalarType::Long, "int64", {num_reqs, num_rows},
              logits);

  // Outputs (mutable): [R, W] int64 twice and [R] int64.
  const int64_t width = max_depth + 1;
  CheckTensor(accepted_indices, "accepted_indices", ScalarType::Long, "int64", {num_reqs, width},
              logits);
  CheckTensor(committed_tokens, "committed_tokens", ScalarType::Long, "int64", {num_reqs, width},
              logits);
  CheckTensor(num_accepted, "num_accepted", ScalarType::Long, "int64", {num_reqs}, logits);

  // Sampling inputs: all three, or none (every request greedy).
  const float* temperature_ptr = nullptr;
  const float* node_coins_ptr = nullptr;
  const float* final_coins_ptr = nullptr;
  if (temperature.has_value()) {
    STD_TORCH_CHECK(node_coins.has_value() && final_coins.has_value(),
                    "'node_coins' and 'final_coins' are required when 'temperature' is given");
    CheckTensor(*temperature, "temperature", ScalarType::Float, "float32", {num_reqs}, logits);
    CheckTensor(*node_coins, "node_coins", ScalarType::Float, "float32", {num_reqs, num_rows},
                logits);
    CheckTensor(*final_coins, "final_coins", ScalarType::Float, "float32", {num_reqs}, logits);
    temperature_ptr = temperature->const_data_ptr<float>();
    node_coins_ptr = node_coins->const_data_ptr<float>();
    final_coins_ptr = final_coins->const_data_ptr<float>();
  }

  if (num_reqs == 0) return;
  const torch::stable::accelerator::DeviceGuard device_guard(logits.get_device_index());
  const bool greedy_only = temperature_ptr == nullptr;
  const int64_t max_rows = greedy_only ? ddtree::TreeVerifyMaxRows<true>()
                                       : ddtree::TreeVerifyMaxRows<false>();
  STD_TORCH_CHECK(max_rows < 0 || num_rows <= max_rows, "tree_verify: ", num_rows,
                  " tree rows per request do not fit in shared memory (at most ", max_rows,
                  " on this device)");
  const cudaStream_t stream = CurrentStream(logits.get_device_index());
  const int64_t* row_index_ptr =
      row_index.has_value() ? row_index->const_data_ptr<int64_t>() : nullptr;

  cudaError_t status = cudaSuccess;
  switch (dtype) {
    case ScalarType::Float:
      status = LaunchTreeVerify<float>(accepted_indices, committed_tokens, num_accepted, logits,
                                       row_index_ptr, num_reqs, num_rows, tokens, next_token,
                                       next_sibling, temperature_ptr,
                                       node_coins_ptr, final_coins_ptr, max_depth, method,
                                       threshold_single, threshold_acc, stream);
      break;
    case ScalarType::Half:
      status = LaunchTreeVerify<__half>(accepted_indices, committed_tokens, num_accepted, logits,
                                        row_index_ptr, num_reqs, num_rows, tokens, next_token,
                                        next_sibling, temperature_ptr,
                                        node_coins_ptr, final_coins_ptr, max_depth, method,
                                        threshold_single, threshold_acc, stream);
      break;
    default:  // ScalarType::BFloat16, checked above
      status = LaunchTreeVerify<__nv_bfloat16>(
          accepted_indices, committed_tokens, num_accepted, logits, row_index_ptr, num_reqs,
          num_rows, tokens, next_token, next_sibling, temperature_ptr, node_coins_ptr,
          final_coins_ptr, max_depth, method, threshold_single, threshold_acc, stream);
      break;
  }
  STD_TORCH_CHECK(status == cudaSuccess, "tree_verify: kernel launch failed: ",
                  cudaGetErrorString(status));
}
