// SPDX-License-Identifier: Apache-2.0
//
// Registers the vllm_ddtree._C operators with the torch dispatcher through
// libtorch's stable ABI (as vLLM's _C_stable_libtorch does):
//   torch.ops.vllm_ddtree.tree_verify (CUDA; its fake implementation for tracing
//   is registered in Python, vllm_ddtree/ops/cuda_ext.py)
// Importing the Python module vllm_ddtree._C loads this library and runs the
// registrations; the module itself is empty.
//
// This file holds the one STABLE_TORCH_LIBRARY block of the namespace: later
// operators of the extension are declared here too.

#include "python_module.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>

// csrc/tree_verify.cu
void ddtree_tree_verify(torch::stable::Tensor& accepted_indices,
                        torch::stable::Tensor& committed_tokens,
                        torch::stable::Tensor& num_accepted, const torch::stable::Tensor& logits,
                        const torch::stable::Tensor& tokens,
                        const torch::stable::Tensor& next_token,
                        const torch::stable::Tensor& next_sibling,
                        const std::optional<torch::stable::Tensor>& temperature,
                        const std::optional<torch::stable::Tensor>& node_coins,
                        const std::optional<torch::stable::Tensor>& final_coins,
                        int64_t max_depth, int64_t method, double threshold_single,
                        double threshold_acc,
                        const std::optional<torch::stable::Tensor>& row_index);

STABLE_TORCH_LIBRARY(vllm_ddtree, m) {
  // Tree verification (vllm_ddtree.verify contract). Outputs are written in place;
  // temperature = None runs the greedy-only kernel (coins may be None then);
  // row_index [R, N + 1] reads tree rows of a [M, V] logits tensor in place.
  m.def(
      "tree_verify(Tensor(a!) accepted_indices, Tensor(b!) committed_tokens, "
      "Tensor(c!) num_accepted, Tensor logits, Tensor tokens, Tensor next_token, "
      "Tensor next_sibling, Tensor? temperature, Tensor? node_coins, Tensor? final_coins, "
      "int max_depth, int method, float threshold_single, float threshold_acc, "
      "Tensor? row_index=None) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(vllm_ddtree, CUDA, m) {
  m.impl("tree_verify", TORCH_BOX(&ddtree_tree_verify));
}

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
DDTREE_PYTHON_MODULE("vllm_ddtree CUDA kernels; the operators live in torch.ops.vllm_ddtree.")
