// One linear layer of this package as a C++ caller holds it: the kernel arguments its Python
// module would pass (models/cpu_decoder.py, kernel_args()), called with a bf16 result. Shared by
// the sources that run several layers in one call (cpu_decoder.cpp, cpu_moe.cpp).
#pragma once

#include "cpu_aten.h"

#include <cstdint>
#include <vector>

// cpu_linear.cpp
at::Tensor packed_linear_layer(at::Tensor x, at::Tensor packed, int64_t N,
                                  c10::optional<at::Tensor> bias, bool out_bf16, int64_t bf16_dot);
// cpu_quantized.cpp
at::Tensor q4_linear_layer(at::Tensor x, at::Tensor packed, int64_t N,
                              c10::optional<at::Tensor> bias, bool out_bf16, int64_t use_vnni);
at::Tensor int8_linear_layer(at::Tensor x, at::Tensor packed, at::Tensor scale,
                                int64_t N, c10::optional<at::Tensor> bias, bool out_bf16,
                                int64_t use_vnni);
at::Tensor q4_grouped_linear(at::Tensor x, std::vector<at::Tensor> packed, int64_t N,
                                std::vector<c10::optional<at::Tensor>> biases, int64_t use_vnni);
at::Tensor int8_grouped_linear(at::Tensor x, std::vector<at::Tensor> packed,
                                  std::vector<at::Tensor> scales, int64_t N,
                                  std::vector<c10::optional<at::Tensor>> biases, int64_t use_vnni);

namespace specdec {

enum LinearKind : int64_t { kPackedBf16 = 0, kInt8 = 1, kQ4 = 2 };

struct LinearCall {
  int64_t kind;
  at::Tensor packed;
  c10::optional<at::Tensor> scale;  // int8 only
  int64_t out_features;
  c10::optional<at::Tensor> bias;
  int64_t mode;  // bf16_dot for packed bf16, use_vnni for int8 / q4

  at::Tensor operator()(const at::Tensor& x) const {  // [T, in] bf16 -> [T, out] bf16
    switch (kind) {
      case kPackedBf16: return packed_linear_layer(x, packed, out_features, bias, true, mode);
      case kInt8: return int8_linear_layer(x, packed, *scale, out_features, bias, true, mode);
      default: return q4_linear_layer(x, packed, out_features, bias, true, mode);
    }
  }
};

// Whether calls can run as one grouped pass (q4_grouped_linear / int8_grouped_linear): int8
// or q4, all of one kind, shape and mode.
inline bool groupable(const std::vector<const LinearCall*>& calls) {
  const LinearCall& a = *calls.front();
  if (a.kind == kPackedBf16) return false;
  for (const LinearCall* c : calls)
    if (c->kind != a.kind || c->mode != a.mode || c->out_features != a.out_features ||
        c->packed.sizes() != a.packed.sizes())
      return false;
  return true;
}

// The calls (groupable) in one pass: x [1, in] (every call reads it) or [E, in] (call e reads
// row e) -> [E, out] bf16, row e bitwise calls[e](its row).
inline at::Tensor grouped(const std::vector<const LinearCall*>& calls, const at::Tensor& x) {
  std::vector<at::Tensor> packed, scales;
  std::vector<c10::optional<at::Tensor>> biases;
  for (const LinearCall* c : calls) {
    packed.push_back(c->packed);
    biases.push_back(c->bias);
    if (c->kind == kInt8) scales.push_back(*c->scale);
  }
  const LinearCall& a = *calls.front();
  if (a.kind == kInt8) return int8_grouped_linear(x, packed, scales, a.out_features, biases, a.mode);
  return q4_grouped_linear(x, packed, a.out_features, biases, a.mode);
}

// The six parallel argument lists (kind, packed, scale, out_features, bias, mode) as one
// LinearCall each; `who` names the caller in errors.
inline std::vector<LinearCall> read_linears(const char* who, const std::vector<int64_t>& kinds,
                                            const std::vector<at::Tensor>& packed,
                                            const std::vector<c10::optional<at::Tensor>>& scales,
                                            const std::vector<int64_t>& out_features,
                                            const std::vector<c10::optional<at::Tensor>>& biases,
                                            const std::vector<int64_t>& modes) {
  const size_t n = kinds.size();
  TORCH_CHECK_VALUE(packed.size() == n && scales.size() == n && out_features.size() == n &&
                        biases.size() == n && modes.size() == n,
                    who, ": the linear argument lists must have one entry per linear");
  std::vector<LinearCall> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(kinds[i] >= kPackedBf16 && kinds[i] <= kQ4, who, ": kinds[", i, "] = ",
                      kinds[i], " must be 0 (packed bf16), 1 (int8) or 2 (q4)");
    TORCH_CHECK_VALUE(kinds[i] != kInt8 || scales[i].has_value(), who, ": int8 linear ", i,
                      " needs its scale");
    out.push_back({kinds[i], packed[i], scales[i], out_features[i], biases[i], modes[i]});
  }
  return out;
}

}  // namespace specdec
