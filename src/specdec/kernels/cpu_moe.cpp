// A sparse mixture-of-experts MLP (Qwen3-MoE) in one call from Python (CPU decoding).
//
// Why: models/qwen3_moe.py's SparseMoeBlock makes ~45 calls a layer for one decode row (the
// router, softmax, top-k, sort, then per active expert two linears, silu_mul, a multiply and an
// add), each paying Python and pybind dispatch with the interpreter's working set evicted by the
// experts' weights. Here the same ATen ops and the same linear kernels run in the same order on
// the same tensors, so the result is bitwise SparseMoeBlock.forward's (and so transformers'
// eager Qwen3MoeSparseMoeBlock's):
//
//   logits = router(x);  probs = softmax(logits, float32);  w, e = topk(probs, k)
//   w = w / sum(w) if norm_topk_prob;  w = w.to(logits.dtype)
//   one row:   out = 0;  for each of its experts in ascending order:  out += expert(x) * w
//   many rows: out = 0;  for each expert with rows, ascending:  rows r (ascending token order),
//              out.index_add_(r, expert(x[r]) * w[r])
//   expert(x) = down(silu_mul(gate_up(x)))
#include "cpu_aten.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_linear_call.h"
#include "cpu_moe.h"

// cpu_layer_ops.cpp
at::Tensor silu_mul(at::Tensor gate_up);

namespace {

using specdec::LinearCall;

at::Tensor expert(const LinearCall* e, const at::Tensor& x) {  // e: gate_up, down
  return e[1](silu_mul(e[0](x)));
}

// out += y * w in bf16, bit for bit ATen's out.add_(y * w) with w a 0-dim bf16 tensor: the
// product rounded to bf16, then the sum, each computed in float32 and rounded to nearest even
// (c10::BFloat16's conversion, the one ATen's bf16 kernels use); one pass instead of two ops.
void add_scaled(at::Tensor& out, const at::Tensor& y, at::BFloat16 w) {  // [1, H] bf16 each
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const at::BFloat16* v = y.data_ptr<at::BFloat16>();
  const float wf = static_cast<float>(w);
  for (int64_t i = 0, n = out.numel(); i < n; ++i) {
    const at::BFloat16 product(static_cast<float>(v[i]) * wf);
    o[i] = at::BFloat16(static_cast<float>(o[i]) + static_cast<float>(product));
  }
}

// silu_mul of each row of gate_up [k, 2 I], each row bitwise silu_mul of that row alone: one
// call holds that while ATen runs it on one thread (its loops go row by row, the same
// vectorised steps for each row), which it does below its grain size; past it a parallel
// split could cut a row where a one-row call does not, so then row by row.
at::Tensor silu_rows(const at::Tensor& gate_up) {
  if (gate_up.numel() / 2 < at::internal::GRAIN_SIZE) return silu_mul(gate_up);
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < gate_up.size(0); ++r) rows.push_back(silu_mul(gate_up.narrow(0, r, 1)));
  return at::cat(rows);
}

// v rounded to bfloat16 (nearest even; NaN: the quiet NaN 0x7FC0), kept as float32: the
// bits c10::BFloat16(float) gives, shifted into place.
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_ps(r);
}

// out = sum over i of y[i] * w[i], in order from zero, each product and each partial sum
// rounded to bf16: add_scaled once per i (bit for bit), in one pass over out instead of k
// (y [k, H] bf16 contiguous, out [1, H] bf16), 8 values at a time instead of k scalar loops
// converting each value through c10::BFloat16.
void weighted_sum(at::Tensor& out, const at::Tensor& y, const std::vector<at::BFloat16>& w) {
  const int64_t H = out.numel(), k = static_cast<int64_t>(w.size());
  const uint16_t* yp = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto widen = [](const uint16_t* p) {  // 8 bf16 -> float32 (exact)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  };
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) {
    __m256 acc = widen(o + h);
    for (int64_t i = 0; i < k; ++i) {
      const __m256 product = round_bf16(_mm256_mul_ps(widen(yp + i * H + h), _mm256_set1_ps(static_cast<float>(w[i]))));
      acc = round_bf16(_mm256_add_ps(acc, product));
    }
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(acc), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + h),
                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
  }
  for (; h < H; ++h) {
    at::BFloat16 acc = out.data_ptr<at::BFloat16>()[h];
    for (int64_t i = 0; i < k; ++i) {
      const at::BFloat16 product(static_cast<float>(y.data_ptr<at::BFloat16>()[i * H + h]) * static_cast<float>(w[i]));
      acc = at::BFloat16(static_cast<float>(acc) + static_cast<float>(product));
    }
    out.data_ptr<at::BFloat16>()[h] = acc;
  }
}

// One row: its experts in ascending order, accumulated from zero in the model's dtype.
at::Tensor one_row(const at::Tensor& x, const at::Tensor& weights,
                      const at::Tensor& experts, const std::vector<LinearCall>& lin) {
  const int64_t k = experts.size(1);
  const at::Tensor ids = experts.contiguous();
  const int64_t* ep = ids.data_ptr<int64_t>();  // the one host read
  std::vector<std::pair<int64_t, int64_t>> order;  // (expert, slot), distinct experts
  for (int64_t s = 0; s < k; ++s) order.emplace_back(ep[s], s);
  std::sort(order.begin(), order.end());
  at::Tensor out = at::zeros_like(x);
  const at::Tensor slot_weights = weights[0].contiguous();  // [k]
  const at::BFloat16* w = slot_weights.data_ptr<at::BFloat16>();
  std::vector<const LinearCall*> gate_up, down;
  for (const auto& [e, s] : order) {
    gate_up.push_back(&lin[1 + 2 * e]);
    down.push_back(&lin[2 + 2 * e]);
  }
  if (specdec::groupable(gate_up) && specdec::groupable(down)) {
    // The experts' linears as two passes (all gate_ups, then all downs): the same rows, each
    // bitwise its own call (cpu_quantized.cpp, grouped_linear), then summed in the same order.
    const at::Tensor y = specdec::grouped(down, silu_rows(specdec::grouped(gate_up, x)));  // [k, H]
    std::vector<at::BFloat16> ordered;
    for (const auto& [e, s] : order) ordered.push_back(w[s]);
    weighted_sum(out, y, ordered);
    return out;
  }
  for (const auto& [e, s] : order) add_scaled(out, expert(lin.data() + 1 + 2 * e, x), w[s]);
  return out;
}

// Many rows, batched by expert (SparseMoeBlock.forward's loop).
at::Tensor many_rows(const at::Tensor& x, const at::Tensor& weights,
                        const at::Tensor& experts, const std::vector<LinearCall>& lin,
                        int64_t num_experts) {
  const int64_t k = experts.size(1);
  const at::Tensor flat = experts.reshape({-1});  // [T k]: token t's slots at t k .. t k + k - 1
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  const at::Tensor tokens = at::floor_divide(order, k);
  const at::Tensor slot_weights = weights.reshape({-1}).index_select(0, order);
  const at::Tensor counts = at::bincount(flat, {}, num_experts).contiguous();  // host read
  const int64_t* cp = counts.data_ptr<int64_t>();
  at::Tensor out = at::zeros_like(x);
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = cp[e];
    if (count == 0) continue;
    const at::Tensor rows = tokens.slice(0, start, start + count);
    const at::Tensor scaled = expert(lin.data() + 1 + 2 * e, x.index_select(0, rows))
                                 .mul(slot_weights.slice(0, start, start + count).unsqueeze(1));
    out.index_add_(0, rows, scaled);
    start += count;
  }
  return out;
}

}  // namespace

// A layer's router and experts, read once from the six linear lists (1 + 2 E entries: the
// router, then gate_up and down of each expert): models/qwen3_moe.py keeps one per block while its
// modules hold the same tensors, so a forward converts no argument lists.
SparseMoe::SparseMoe(const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& packed,
                     const std::vector<c10::optional<at::Tensor>>& scales,
                     const std::vector<int64_t>& out_features,
                     const std::vector<c10::optional<at::Tensor>>& biases,
                     const std::vector<int64_t>& modes, int64_t top_k, bool norm_topk_prob)
    : linears(specdec::read_linears("SparseMoe", kinds, packed, scales, out_features, biases, modes)),
      num_experts((static_cast<int64_t>(linears.size()) - 1) / 2),
      top_k(top_k),
      norm_topk_prob(norm_topk_prob) {
  TORCH_CHECK_VALUE(linears.size() >= 3 && linears.size() % 2 == 1,
                    "SparseMoe: expected the router and two linears per expert, got ", linears.size());
  TORCH_CHECK_VALUE(linears[0].out_features == num_experts, "SparseMoe: the router gives ",
                    linears[0].out_features, " logits for ", num_experts, " experts");
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= num_experts, "SparseMoe: top_k = ", top_k,
                    " must be in 1..", num_experts);
}

// x: [T, H] bf16 contiguous -> [T, H] bf16.
at::Tensor SparseMoe::forward(const at::Tensor& x) const {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
                    "SparseMoe: x must be contiguous bf16 [T, H]");
  const at::Tensor logits = linears[0](x);  // [T, E] bf16
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [weights, experts] = at::topk(probs, top_k, -1);
  if (norm_topk_prob) weights = weights.div(weights.sum(-1, /*keepdim=*/true));
  weights = weights.to(logits.scalar_type());
  if (x.size(0) == 1) return one_row(x, weights, experts, linears);
  return many_rows(x, weights, experts, linears, num_experts);
}
