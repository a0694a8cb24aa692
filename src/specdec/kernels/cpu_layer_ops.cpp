// The small per-layer operations of a bf16 decoder on CPUs, one call each from Python.
//
// Why: a decode step of a 0.5B model runs ~55 PyTorch ops per layer besides the matrix
// products, each costing 5-20 us of dispatch for a few KiB of data: 14-16 ms of a 79 ms int8
// draft forward (docs/performance.md). These functions do the same arithmetic in one pass:
//
// - add_rms_norm: h + delta rounded to bf16 (as a bf16 add rounds), then RMSNorm in float32
//   (sum of squares accumulated in double and rounded once: the correctly rounded mean, which
//   PyTorch's float32 reduction matches to an ulp), rounded to bf16, times the bf16 weight.
// - rope_qk: rotate-half RoPE of q and k taken from the fused qkv projection, each product and
//   the sum rounded to bf16 exactly as the three bf16 tensor ops round (bitwise equal).
// - silu_mul: PyTorch's silu and multiply called from C++ (bitwise the same result).
// - add_rms_norm_f32w: add_rms_norm for norms that multiply in float32 by a float32 weight and
//   round once (Gemma's ``x / rms * (1 + w)``, OLMo 2's ``w * x / rms``): the normed row is not
//   rounded to bf16 before the weight.
// - gelu_tanh_mul: PyTorch's tanh-approximated gelu and multiply (Gemma's MLP), as silu_mul.
//
// Every row is computed on its own, so results do not depend on how many rows share a call.
#include "cpu_aten.h"  // not torch/extension.h nor torch/types.h (see there); bindings: cpu_decoder.cpp

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as c10::BFloat16 does (NaN kept a quiet NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

const uint16_t* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
uint16_t* bf16_ptr_mut(at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

void check_bf16(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

namespace {

// add_rms_norm's arithmetic; Weight: uint16_t (bf16: the normed row rounded to bf16, then times
// the weight) or float (float32: the normed row times the weight in float32, rounded once).
template <typename Weight>
std::vector<at::Tensor> add_rms_norm_impl(at::Tensor h, c10::optional<at::Tensor> delta,
                                             const Weight* wp, int64_t weight_size, double eps) {
  check_bf16(h, "h", 2);
  const int64_t T = h.size(0), H = h.size(1);
  TORCH_CHECK(weight_size == H, "weight must be [hidden]");
  at::Tensor summed = h;
  if (delta.has_value()) {
    check_bf16(*delta, "delta", 2);
    TORCH_CHECK(delta->sizes() == h.sizes(), "delta must have h's shape");
    summed = at::empty_like(h);
  }
  auto normed = at::empty_like(h);
  const uint16_t* hp = bf16_ptr(h);
  const uint16_t* dp = delta.has_value() ? bf16_ptr(*delta) : nullptr;
  uint16_t* sp = bf16_ptr_mut(summed);
  uint16_t* np = bf16_ptr_mut(normed);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(H);
    for (int64_t t = t0; t < t1; ++t) {
      double ss = 0.0;
      for (int64_t i = 0; i < H; ++i) {
        float x = bf16_to_float(hp[t * H + i]);
        if (dp != nullptr) {
          const uint16_t s = float_to_bf16(x + bf16_to_float(dp[t * H + i]));
          sp[t * H + i] = s;
          x = bf16_to_float(s);
        }
        row[i] = x;
        ss += static_cast<double>(x) * x;
      }
      const float mean = static_cast<float>(ss / static_cast<double>(H));
      const float r = 1.0f / std::sqrt(mean + feps);
      for (int64_t i = 0; i < H; ++i) {
        if constexpr (std::is_same_v<Weight, float>) {
          np[t * H + i] = float_to_bf16((row[i] * r) * wp[i]);  // as x.float() * rsqrt(...) * w
        } else {
          np[t * H + i] = float_to_bf16(bf16_to_float(wp[i]) * round_bf16(row[i] * r));
        }
      }
    }
  });
  return {summed, normed};
}

}  // namespace

// h: [T, H] bf16; delta: [T, H] bf16 or None; weight: [H] bf16.
// Returns (h + delta, rms_norm(h + delta) * weight), both [T, H] bf16.
std::vector<at::Tensor> add_rms_norm(at::Tensor h, c10::optional<at::Tensor> delta,
                                        at::Tensor weight, double eps) {
  check_bf16(weight, "weight", 1);
  return add_rms_norm_impl(h, delta, bf16_ptr(weight), weight.size(0), eps);
}

// h: [T, H] bf16; delta: [T, H] bf16 or None; weight: [H] float32.
// Returns (h + delta, bf16((x / rms(x)) * weight) with x = h + delta), both [T, H] bf16.
std::vector<at::Tensor> add_rms_norm_f32w(at::Tensor h, c10::optional<at::Tensor> delta,
                                             at::Tensor weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous(),
              "weight must be a contiguous 1-D float32 tensor");
  return add_rms_norm_impl(h, delta, weight.data_ptr<float>(), weight.size(0), eps);
}

// gate_up: [T, 2 I] bf16. Returns gelu_tanh(gate) * up, [T, I] bf16 (PyTorch's own ops).
at::Tensor gelu_tanh_mul(at::Tensor gate_up) {
  check_bf16(gate_up, "gate_up", 2);
  const int64_t I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "gate_up width must be even");
  return at::gelu(gate_up.narrow(1, 0, I), "tanh").mul_(gate_up.narrow(1, I, I));
}

// qkv: [T, (Hq + 2 Hkv) * D] bf16 (q, k, v side by side); cos, sin: [T, D] bf16.
// Returns (q [T, Hq, D], k [T, Hkv, D]) rotated, bf16.
std::vector<at::Tensor> rope_qk(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                                   int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_bf16(qkv, "qkv", 2);
  check_bf16(cos, "cos", 2);
  check_bf16(sin, "sin", 2);
  const int64_t T = qkv.size(0), D = head_dim, half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * D, "qkv width must be (Hq + 2 Hkv) * D");
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(), "cos/sin must be [T, head_dim]");
  auto q = at::empty({T, num_q_heads, D}, qkv.options());
  auto k = at::empty({T, num_kv_heads, D}, qkv.options());
  const uint16_t* src = bf16_ptr(qkv);
  const uint16_t* cp = bf16_ptr(cos);
  const uint16_t* snp = bf16_ptr(sin);
  uint16_t* qp = bf16_ptr_mut(q);
  uint16_t* kp = bf16_ptr_mut(k);
  const int64_t width = qkv.size(1), heads = num_q_heads + num_kv_heads;
  at::parallel_for(0, T * heads, 64, [&](int64_t b, int64_t e) {
    for (int64_t job = b; job < e; ++job) {
      const int64_t t = job / heads, hd = job % heads;
      const uint16_t* x = src + t * width + hd * D;  // k heads follow the q heads in qkv
      uint16_t* out = hd < num_q_heads ? qp + (t * num_q_heads + hd) * D
                                       : kp + (t * num_kv_heads + hd - num_q_heads) * D;
      for (int64_t i = 0; i < D; ++i) {
        const float xi = bf16_to_float(x[i]);
        const float rot = i < half ? -bf16_to_float(x[i + half]) : bf16_to_float(x[i - half]);
        const float a = round_bf16(xi * bf16_to_float(cp[t * D + i]));
        const float c = round_bf16(rot * bf16_to_float(snp[t * D + i]));
        out[i] = float_to_bf16(a + c);
      }
    }
  });
  return {q, k};
}

// gate_up: [T, 2 I] bf16 (gate, up side by side). Returns silu(gate) * up, [T, I] bf16:
// PyTorch's own vectorised silu and multiply, called from C++ (bitwise the Python ops' result,
// without their Python dispatch).
at::Tensor silu_mul(at::Tensor gate_up) {
  check_bf16(gate_up, "gate_up", 2);
  const int64_t I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "gate_up width must be even");
  return at::silu(gate_up.narrow(1, 0, I)).mul_(gate_up.narrow(1, I, I));
}
