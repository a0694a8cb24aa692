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
//
// ---- AVX512-BF16 path (Zen 4, Sapphire Rapids and later), for bf16 activations. The same
// packed bytes: two panel rows k, k + 1 (64 bytes) become one vector of (w[f][k], w[f][k+1])
// pairs by one vpermw, and vdpbf16ps adds both products to feature f's float32 lane: 32
// multiply-adds per instruction against 2 per FMA path instruction after unpacking, so a 6-row
// pass stays near the cost of the memory traffic and a 1-row pass issues few enough
// instructions for the loads to run ahead. bf16 x bf16 products are exact in float32, so the
// path differs from the FMA one only in the order of the additions (and flushes denormals): per
// output, two chains over alternate k pairs ((0,1), (4,5), ... and (2,3), (6,7), ...), added at
// the end. That order does not depend on M either, so rows stay bitwise batch invariant within
// the path. Which path a call takes depends only on the CPU and the activations' dtype.
#include "cpu_aten.h"  // not torch/extension.h nor torch/types.h (see there); bindings: cpu_decoder.cpp
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


// ---------------------------------------------------------------- AVX512-BF16 (vdpbf16ps)
#define SPECDEC_BF16DOT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512bf16")))

constexpr int kMaxRowsDot = 8;  // 2 accumulators per row of the 32 zmm registers

// vpermw indices: word 2f of the result is feature f of panel row k (word order^-1[f] of the
// first 32 bytes; the packing order is its own inverse), word 2f + 1 the same feature of row
// k + 1 (16 words further). Loaded inside the target("avx512...") functions: a vector passed by
// value from code compiled without AVX-512 (the parallel_for lambda) uses another ABI.
alignas(64) constexpr uint16_t kPairIndex[2 * kPanel] = {
    0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27,
    4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31};

// (x[k], x[k + 1]) as one 32-bit word broadcast to every lane; x[k + 1] = 0 past the end.
SPECDEC_BF16DOT inline __m512bh broadcast_pair(const uint16_t* x, int64_t k, int64_t K) {
  uint32_t v = x[k];
  if (k + 1 < K) v |= static_cast<uint32_t>(x[k + 1]) << 16;
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(v));
}

// Rows 0 .. MR - 1 of x (bf16, [MR, K]) times NP panels; two accumulator chains per row and
// panel over alternate k pairs (see the header: the order is the same for every MR and NP).
template <int MR, int NP, bool PREFETCH>
SPECDEC_BF16DOT void micro_dot(const uint16_t* x, int64_t K, const uint16_t* panel0, float* out,
                               int64_t ldo, int64_t N, int64_t n0) {
  const __m512i idx = _mm512_load_si512(kPairIndex);
  __m512 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[m][j][0] = acc[m][j][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        const uint16_t* row = panel0 + j * K * kPanel + (k + 2 * c) * kPanel;
        if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * kPanel), _MM_HINT_T0);
        const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(row));
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          uint32_t v;
          std::memcpy(&v, x + m * K + k + 2 * c, sizeof(v));
          acc[m][j][c] = _mm512_dpbf16_ps(acc[m][j][c], w, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(v)));
        }
      }
    }
  }
  // The last one to three rows: a pair, then a single row whose partner is zero (a masked
  // load: the bytes after the panel may not exist), on the chain the pair order gives them.
  for (int c = 0; k < K; k += 2, ++c) {
    const __mmask32 keep = k + 1 < K ? 0xFFFFFFFFu : 0x0000FFFFu;
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(
          idx, _mm512_maskz_loadu_epi16(keep, panel0 + j * K * kPanel + k * kPanel));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) acc[m][j][c] = _mm512_dpbf16_ps(acc[m][j][c], w, broadcast_pair(x + m * K, k, K));
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const int64_t n = n0 + j * kPanel;
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(kPanel, N - n)) - 1u);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(out + m * ldo + n, valid, _mm512_add_ps(acc[m][j][0], acc[m][j][1]));
  }
}

template <int MR, int NP>
SPECDEC_BF16DOT void group_dot(bool first, const uint16_t* x, int64_t K, const uint16_t* panel0,
                               float* out, int64_t ldo, int64_t N, int64_t n0) {
  if (first) micro_dot<MR, NP, true>(x, K, panel0, out, ldo, N, n0);
  else micro_dot<MR, NP, false>(x, K, panel0, out, ldo, N, n0);
}

// NP panels starting at p for all M rows, kMaxRowsDot at a time (the first block streams them
// from memory). NP = 2 is for M <= kPairRowsDot: a pass of few rows over one panel at a time
// leaves the memory system idle between loads on some CPUs (Sapphire Rapids: 1 row 15-20%
// slower than the FMA path); two panels are two streams in flight. Verify passes of 3-5 rows
// gain as well (0.5B's linears, one thread: 3-4 rows 9-12% faster, 5 rows 6%, 6 rows no
// change, so 6+ rows keep one panel and its fewer registers). Same additions per output
// whatever NP is.
constexpr int64_t kPairRowsDot = 5;

template <int NP>
SPECDEC_BF16DOT void panels_all_rows_dot(const uint16_t* x, int64_t M, int64_t K,
                                         const uint16_t* w, float* out, int64_t N, int64_t p) {
  const uint16_t* panel0 = w + p * K * kPanel;
  const int64_t n0 = p * kPanel;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsDot) {
    const bool first = m0 == 0;
    const uint16_t* xm = x + m0 * K;
    float* om = out + m0 * N;
    const int64_t rows = std::min<int64_t>(kMaxRowsDot, M - m0);
    if (NP == 2 || rows <= 2) {  // NP = 2 only for M <= kPairRowsDot
      switch (rows) {
        case 1: group_dot<1, NP>(first, xm, K, panel0, om, N, N, n0); break;
        case 2: group_dot<2, NP>(first, xm, K, panel0, om, N, N, n0); break;
        case 3: group_dot<3, NP>(first, xm, K, panel0, om, N, N, n0); break;
        case 4: group_dot<4, NP>(first, xm, K, panel0, om, N, N, n0); break;
        default: group_dot<5, NP>(first, xm, K, panel0, om, N, N, n0); break;
      }
      continue;
    }
    for (int j = 0; j < NP; ++j) {  // 6+ rows: one panel at a time (enough chains per panel)
      const uint16_t* pj = panel0 + j * K * kPanel;
      const int64_t nj = n0 + j * kPanel;
      switch (rows) {
        case 3: group_dot<3, 1>(first, xm, K, pj, om, N, N, nj); break;
        case 4: group_dot<4, 1>(first, xm, K, pj, om, N, N, nj); break;
        case 5: group_dot<5, 1>(first, xm, K, pj, om, N, N, nj); break;
        case 6: group_dot<6, 1>(first, xm, K, pj, om, N, N, nj); break;
        case 7: group_dot<7, 1>(first, xm, K, pj, om, N, N, nj); break;
        default: group_dot<8, 1>(first, xm, K, pj, om, N, N, nj); break;
      }
    }
  }
}

SPECDEC_BF16DOT void dot_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                                int64_t P, float* out, int64_t N) {
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
    if (M <= kPairRowsDot)
      for (; p + 2 <= p1; p += 2) panels_all_rows_dot<2>(x, M, K, w, out, N, p);
    for (; p < p1; ++p) panels_all_rows_dot<1>(x, M, K, w, out, N, p);
  });
}

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}

// What both paths need of the packed weight: [ceil(N / 16), K, 16] bf16 matching x's K.
void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel, "packed must be [panels, K, 16]");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "packed must be bfloat16");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  TORCH_CHECK(x.size(1) == packed.size(1), "x and the packed weight disagree on in_features");
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "out_features does not match the number of panels");
}

}  // namespace

// x: [M, K] float32; packed: [ceil(N/16), K, 16] bfloat16 (see the packing order above);
// returns [M, N] float32.
at::Tensor packed_bf16_linear(at::Tensor x, at::Tensor packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, in_features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  check_packed(x, packed, N);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  auto out = at::empty({M, N}, x.options());
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

// x: [M, K] bfloat16 through the AVX512-BF16 path (see the header); returns [M, N] float32.
at::Tensor packed_bf16_dot_linear(at::Tensor x, at::Tensor packed, int64_t N) {
  TORCH_CHECK(cpu_has_bf16_dot(), "this CPU has no AVX512-BF16 (bf16_dot=1 needs avx512_bf16, avx512bw, avx512vl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be 2-D bfloat16 [rows, in_features]");
  check_packed(x, packed, N);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  dot_linear(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
             reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), packed.size(0),
             out.data_ptr<float>(), N);
  return out;
}

// The whole layer in one call from Python (each Python-level op costs ~10-20 us, as much as
// reading a small weight): x in float32 or bfloat16 ([M, K]), the optional float32 bias added
// in float32, the result rounded to bfloat16 when asked, exactly as x.float() @ W.T + bias
// followed by .to(torch.bfloat16) rounds. bf16_dot: -1 takes the AVX512-BF16 path for bf16 x on
// CPUs that have it, 0 never, 1 always (bf16 x only).
at::Tensor packed_linear_layer(at::Tensor x, at::Tensor packed, int64_t N,
                                  c10::optional<at::Tensor> bias, bool out_bf16, int64_t bf16_dot) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, in_features]");
  TORCH_CHECK(bf16_dot >= -1 && bf16_dot <= 1, "bf16_dot must be -1, 0 or 1");
  TORCH_CHECK(bf16_dot != 1 || x.scalar_type() == at::kBFloat16, "bf16_dot=1 needs bfloat16 x");
  const bool dot = bf16_dot == 1 || (bf16_dot == -1 && x.scalar_type() == at::kBFloat16 && cpu_has_bf16_dot());
  auto out = dot ? packed_bf16_dot_linear(x, packed, N)
                 : packed_bf16_linear(x.scalar_type() == at::kFloat ? x : x.to(at::kFloat), packed, N);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N,
                "bias must be float32 [out_features]");
    out.add_(*bias);
  }
  return out_bf16 ? out.to(at::kBFloat16) : out;
}

bool packed_has_bf16_dot() { return cpu_has_bf16_dot(); }

// Reads every byte of a contiguous tensor with the kernel's access pattern (32-byte loads,
// the same prefetch distance) and returns a checksum: the read bandwidth a decode step can
// reach on this machine, against which benchmarks state the weight-read bound.
int64_t read_stream(at::Tensor t) {
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
