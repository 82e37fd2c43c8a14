// SPDX-License-Identifier: Apache-2.0
//
// Registers the vllm_ddtree._C operators with the torch dispatcher:
//   torch.ops.vllm_ddtree.tree_verify (CUDA; Meta for tracing)
// Importing the Python module vllm_ddtree._C loads this library and runs the
// registrations; the module itself is empty.
//
// This file holds the one TORCH_LIBRARY block of the namespace: later operators
// of the extension are declared here too (or with TORCH_LIBRARY_FRAGMENT).

#include "python_module.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

// csrc/tree_verify.cu
void tree_verify(at::Tensor& accepted_indices, at::Tensor& committed_tokens,
                 at::Tensor& num_accepted, const at::Tensor& logits, const at::Tensor& tokens,
                 const at::Tensor& next_token, const at::Tensor& next_sibling,
                 const std::optional<at::Tensor>& temperature,
                 const std::optional<at::Tensor>& node_coins,
                 const std::optional<at::Tensor>& final_coins, int64_t max_depth,
                 int64_t method, double threshold_single, double threshold_acc);
void tree_verify_meta(at::Tensor& accepted_indices, at::Tensor& committed_tokens,
                      at::Tensor& num_accepted, const at::Tensor& logits,
                      const at::Tensor& tokens, const at::Tensor& next_token,
                      const at::Tensor& next_sibling, const std::optional<at::Tensor>& temperature,
                      const std::optional<at::Tensor>& node_coins,
                      const std::optional<at::Tensor>& final_coins, int64_t max_depth,
                      int64_t method, double threshold_single, double threshold_acc);

TORCH_LIBRARY(vllm_ddtree, m) {
  // Tree verification (vllm_ddtree.verify contract). Outputs are written in place;
  // temperature = None runs the greedy-only kernel (coins may be None then).
  m.def(
      "tree_verify(Tensor(a!) accepted_indices, Tensor(b!) committed_tokens, "
      "Tensor(c!) num_accepted, Tensor logits, Tensor tokens, Tensor next_token, "
      "Tensor next_sibling, Tensor? temperature, Tensor? node_coins, Tensor? final_coins, "
      "int max_depth, int method, float threshold_single, float threshold_acc) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_ddtree, CUDA, m) { m.impl("tree_verify", &tree_verify); }

TORCH_LIBRARY_IMPL(vllm_ddtree, Meta, m) { m.impl("tree_verify", &tree_verify_meta); }

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
DDTREE_PYTHON_MODULE("vllm_ddtree CUDA kernels; the operators live in torch.ops.vllm_ddtree.")
