// Linear layer with packed bf16 weights for x86 CPUs that have AVX2 + FMA but no native bf16
// matrix instructions (no AVX512-BF16/AMX): out[m, n] = sum_k x[m, k] * w[n, k].
//
// Why: on such CPUs PyTorch's bf16 GEMM runs at a fraction of the FMA peak and costs about M
// times a GEMV, so verifying k+1 drafted rows costs k+1 decode steps. Here the weights are
// packed once at load time into panels of 16 output features, k-major ([N/16, K, 16]), so the
// inner loop is an outer product: one 32-byte load of 16 weights, two unpack instructions to
// float32, then one broadcast and two FMAs per activation row. A panel is streamed once per
// group of up to 6 rows, so M = 1..6 rows cost about as much as one (memory-bound), and large
// M runs near the FMA peak. Panels are the outer loop: a panel read from memory for the first
// group of rows is still in cache for the next groups, so M > 6 does not re-read the weights.
//
// Packing order inside a panel: [n0..3, n8..11, n4..7, n12..15]. With that order
// _mm256_unpacklo_epi16(0, raw) yields features 0..7 and _mm256_unpackhi_epi16(0, raw)
// features 8..15 as float32 (a bf16 is the top half of a float32).
//
// Determinism: every output element is a sequential float32 FMA chain over k = 0..K-1, whatever
// M is or how rows are grouped, so a row inside a k+1-row verify pass is bitwise equal to the
// same row computed alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;
// Software prefetch distance in panel rows (32 bytes each): 8 KiB ahead. Without it the
// hardware prefetcher falls behind as soon as the loop has compute to do (3+ rows), and a 6-row
// pass cost 1.85x a 1-row pass instead of 1.3x (weights larger than the L3, one thread).
constexpr int64_t kPrefetchRows = 256;

inline void load_panel_row(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

// MR activation rows times NP panels (16 features each); MR * 2 * NP accumulators.
template <int MR, int NP, bool PREFETCH>
void micro(const float* x, int64_t K, const uint16_t* panels, float* out, int64_t ldo,
           int64_t panel0, int64_t N) {
  __m256 acc[MR][2 * NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int t = 0; t < 2 * NP; ++t) acc[m][t] = _mm256_setzero_ps();
  const uint16_t* w[NP];
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) w[j] = panels + (panel0 + j) * K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    if (PREFETCH && (k & 1) == 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    }
    __m256 wv[2 * NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) load_panel_row(w[j] + k * kPanel, wv[2 * j], wv[2 * j + 1]);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 8
      for (int t = 0; t < 2 * NP; ++t) acc[m][t] = _mm256_fmadd_ps(xb, wv[t], acc[m][t]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const int64_t n = (panel0 + j) * kPanel;
      float* dst = out + m * ldo + n;
      if (n + kPanel <= N) {
        _mm256_storeu_ps(dst, acc[m][2 * j]);
        _mm256_storeu_ps(dst + 8, acc[m][2 * j + 1]);
      } else {
        alignas(32) float tmp[kPanel];
        _mm256_store_ps(tmp, acc[m][2 * j]);
        _mm256_store_ps(tmp + 8, acc[m][2 * j + 1]);
        std::memcpy(dst, tmp, sizeof(float) * (N - n));
      }
    }
  }
}

template <int MR, int NP>
void group(bool first, const float* x, int64_t K, const uint16_t* panels, float* out,
           int64_t ldo, int64_t p, int64_t N) {
  if (first) micro<MR, NP, true>(x, K, panels, out, ldo, p, N);
  else micro<MR, NP, false>(x, K, panels, out, ldo, p, N);
}

// NP panels starting at p for all M rows, 6 rows at a time: the first group streams the
// panels from memory (prefetching ahead), the others find them in cache. NP = 2 is for M <= 2
// (two panels keep enough independent FMA chains in flight); more rows take one panel.
template <int NP>
void panels_all_rows(const float* x, int64_t M, int64_t K, const uint16_t* panels, float* out,
                     int64_t ldo, int64_t p, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += 6) {
    const bool first = m0 == 0;
    const float* xm = x + m0 * K;
    float* om = out + m0 * ldo;
    switch (std::min<int64_t>(6, M - m0)) {
      case 1: group<1, NP>(first, xm, K, panels, om, ldo, p, N); break;
      case 2: group<2, NP>(first, xm, K, panels, om, ldo, p, N); break;
      case 3: group<3, 1>(first, xm, K, panels, om, ldo, p, N); break;
      case 4: group<4, 1>(first, xm, K, panels, om, ldo, p, N); break;
      case 5: group<5, 1>(first, xm, K, panels, om, ldo, p, N); break;
      default: group<6, 1>(first, xm, K, panels, om, ldo, p, N); break;
    }
  }
}

}  // namespace

// x: [M, K] float32; packed: [ceil(N/16), K, 16] bfloat16 (see the packing order above);
// returns [M, N] float32.
torch::Tensor packed_bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel, "packed must be [panels, K, 16]");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16, "packed must be bfloat16");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  TORCH_CHECK(x.size(1) == packed.size(1), "x and the packed weight disagree on in_features");
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "out_features does not match the number of panels");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  // Each thread owns a range of panels.
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
    if (M <= 2)  // two panels at a time keep enough independent FMA chains in flight
      for (; p + 2 <= p1; p += 2) panels_all_rows<2>(xp, M, K, wp, op, N, p, N);
    for (; p < p1; ++p) panels_all_rows<1>(xp, M, K, wp, op, N, p, N);
  });
  return out;
}

// The whole layer in one call from Python (each Python-level op costs ~10-20 us, as much as
// reading a small weight): x in float32 or bfloat16 ([M, K]), the optional float32 bias added
// in float32, the result rounded to bfloat16 when asked, exactly as x.float() @ W.T + bias
// followed by .to(torch.bfloat16) rounds.
torch::Tensor packed_linear_layer(torch::Tensor x, torch::Tensor packed, int64_t N,
                                  c10::optional<torch::Tensor> bias, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, in_features]");
  auto out = packed_bf16_linear(x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32),
                                packed, N);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
                "bias must be float32 [out_features]");
    out.add_(*bias);
  }
  return out_bf16 ? out.to(torch::kBFloat16) : out;
}

// Reads every byte of a contiguous tensor with the kernel's access pattern (32-byte loads,
// the same prefetch distance) and returns a checksum: the read bandwidth a decode step can
// reach on this machine, against which benchmarks state the weight-read bound.
int64_t read_stream(torch::Tensor t) {
  TORCH_CHECK(t.is_contiguous(), "t must be contiguous");
  const int64_t n = t.numel() * t.element_size() / 32;
  const auto* base = reinterpret_cast<const __m256i*>(t.data_ptr());
  std::vector<int64_t> sums(at::get_num_threads(), 0);
  at::parallel_for(0, n, 4096, [&](int64_t b0, int64_t b1) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    int64_t i = b0;
    for (; i + 2 <= b1; i += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(base + i + kPrefetchRows), _MM_HINT_T0);
      acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256(base + i));
      acc1 = _mm256_xor_si256(acc1, _mm256_loadu_si256(base + i + 1));
    }
    if (i < b1) acc0 = _mm256_xor_si256(acc0, _mm256_loadu_si256(base + i));
    alignas(32) int64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(acc0, acc1));
    sums[at::get_thread_num()] ^= lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  });
  int64_t out = 0;
  for (int64_t s : sums) out ^= s;
  return out;
}

// cpu_attention.cpp
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_slots, torch::Tensor v_slots,
                              torch::Tensor row_seq, torch::Tensor row_index,
                              torch::Tensor kv_gather, torch::Tensor kv_lens,
                              c10::optional<torch::Tensor> mask, double sm_scale);

// cpu_layer_ops.cpp
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta,
                                        torch::Tensor weight, double eps);
std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                   int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim);
torch::Tensor silu_mul(torch::Tensor gate_up);

// cpu_quantized.cpp
torch::Tensor q4_linear_layer(torch::Tensor x, torch::Tensor packed, int64_t N,
                              c10::optional<torch::Tensor> bias, bool out_bf16, int64_t use_vnni);
torch::Tensor int8_linear_layer(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                                int64_t N, c10::optional<torch::Tensor> bias, bool out_bf16,
                                int64_t use_vnni);
bool quantized_has_vnni();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "bf16 residual add + RMSNorm (see cpu_layer_ops.cpp)");
  m.def("rope_qk", &rope_qk, "bf16 rotate-half RoPE of q and k from the fused qkv projection");
  m.def("silu_mul", &silu_mul, "bf16 silu(gate) * up");
  m.def("paged_attention", &paged_attention,
        "float32 paged attention with a fixed reduction order (see cpu_attention.cpp)");
  m.def("packed_linear_layer", &packed_linear_layer,
        "packed_bf16_linear + optional float32 bias + optional rounding to bfloat16");
  m.def("q4_linear_layer", &q4_linear_layer,
        "activations x packed 4-bit weights, int8 activations per group (cpu_quantized.cpp)");
  m.def("int8_linear_layer", &int8_linear_layer,
        "activations x packed int8 weights, int8 activations per group (cpu_quantized.cpp)");
  m.def("quantized_has_vnni", &quantized_has_vnni,
        "whether the int8 / q4 kernels can use AVX512-VNNI here");
  m.def("read_stream", &read_stream, "read a tensor once (bandwidth probe); returns a checksum");
  m.def("packed_bf16_linear", &packed_bf16_linear,
        "float32 activations x packed bf16 weights (AVX2/FMA)");
}
