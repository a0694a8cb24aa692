// A sparse mixture-of-experts MLP held by C++ (cpu_moe.cpp; bound in cpu_decoder.cpp).
#pragma once

#include "cpu_aten.h"

#include <cstdint>
#include <vector>

#include "cpu_linear_call.h"

struct SparseMoe {
  SparseMoe(const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& packed,
            const std::vector<c10::optional<at::Tensor>>& scales,
            const std::vector<int64_t>& out_features,
            const std::vector<c10::optional<at::Tensor>>& biases,
            const std::vector<int64_t>& modes, int64_t top_k, bool norm_topk_prob);
  at::Tensor forward(const at::Tensor& x) const;

  std::vector<specdec::LinearCall> linears;  // the router, then gate_up and down per expert
  int64_t num_experts, top_k;
  bool norm_topk_prob;
};
