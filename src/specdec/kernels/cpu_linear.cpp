// Linear layer with packed bf16 weights for x86 CPUs that have AVX2 + FMA but no native bf16
// matrix instructions (no AVX512-BF16/AMX): out[m, n] = sum_k x[m, k] * w[n, k].
//
// Why: on such CPUs PyTorch's bf16 GEMM runs at a fraction of the FMA peak and costs about M
// times a GEMV, so verifying k+1 drafted rows costs k+1 decode steps. Here the weights are
// packed once at load time into panels of 16 output features, k-major ([N/16, K, 16]), so the
// inner loop is an outer product: one 32-byte load of 16 weights, two unpack instructions to
// float32, then one broadcast and two FMAs per activation row. A panel is streamed once per
// group of up to 6 rows, so M = 1..6 rows cost about as much as one (memory-bound), and large
// M runs near the FMA peak.
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

namespace {

constexpr int64_t kPanel = 16;

inline void load_panel_row(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

// MR activation rows times NP panels (16 features each); MR * 2 * NP accumulators.
template <int MR, int NP>
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

// All panels in [p0, p1) for one group of MR rows; small MR takes two panels at a time so
// enough independent FMA chains are in flight.
template <int MR>
void panels_for_rows(const float* x, int64_t K, const uint16_t* panels, float* out, int64_t ldo,
                     int64_t p0, int64_t p1, int64_t N) {
  int64_t p = p0;
  if constexpr (MR <= 2) {
    for (; p + 2 <= p1; p += 2) micro<MR, 2>(x, K, panels, out, ldo, p, N);
  }
  for (; p < p1; ++p) micro<MR, 1>(x, K, panels, out, ldo, p, N);
}

void rows_dispatch(int64_t mr, const float* x, int64_t K, const uint16_t* panels, float* out,
                   int64_t ldo, int64_t p0, int64_t p1, int64_t N) {
  switch (mr) {
    case 1: panels_for_rows<1>(x, K, panels, out, ldo, p0, p1, N); break;
    case 2: panels_for_rows<2>(x, K, panels, out, ldo, p0, p1, N); break;
    case 3: panels_for_rows<3>(x, K, panels, out, ldo, p0, p1, N); break;
    case 4: panels_for_rows<4>(x, K, panels, out, ldo, p0, p1, N); break;
    case 5: panels_for_rows<5>(x, K, panels, out, ldo, p0, p1, N); break;
    default: panels_for_rows<6>(x, K, panels, out, ldo, p0, p1, N); break;
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
  // Each thread owns a range of panels; every group of 6 rows sweeps that range while its
  // panels are still in cache.
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const int64_t mr = std::min<int64_t>(6, M - m0);
      rows_dispatch(mr, xp + m0 * K, K, wp, op + m0 * N, N, p0, p1, N);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_bf16_linear", &packed_bf16_linear,
        "float32 activations x packed bf16 weights (AVX2/FMA)");
}
