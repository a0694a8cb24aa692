// Linear layers over int8 and 4-bit weights for x86 CPUs with AVX2 (+ AVX512-VNNI when
// present): out[m, n] = sum_k x[m, k] * w[n, k].
//
// Why: decoding streams every weight once per step, so 4-bit weights (0.625 bytes each with
// their scales) read 3.2x fewer bytes than bf16 and int8 ones 2x fewer. Converting them to
// float32 would make the loop compute-bound on AVX2, so the activations are quantized too, per
// row and group of 32 inputs (int8, scale amax / 127, rounded half to even), and the inner loop
// is an exact integer dot product of 4-byte groups (maddubs + madd on AVX2, vpdpbusd with
// AVX512-VNNI: the same integers). Per group and row, the float32 part is a fixed-order chain
// over the groups, so a row's result is bitwise the same whatever the number of rows in the
// call or the instruction set used.
//
// ---- q4: w[n, k] = d[n, g] * q[n, k] + c[n, g], q in 0..15, float16 d and c per output
// feature and group g of 32 inputs. Unsigned nibbles times signed bytes (maddubs: pairs of
// products to int16; the 8 vectors of a group are added in int16, at most 16 products of
// 15 x 127 = 30480, no overflow; madd then sums pairs to int32). Per group and row:
//   acc = fma(float(dot), d * dx, acc);  acc = fma(c, sum(x over the group), acc)
//
// Layout ([P = ceil(N / 8)][G = ceil(K / 32)][160 bytes], one 160-byte block per panel of 8
// output features and group): 8 vectors of 16 bytes, then d[8] and c[8] as float16. Vector j
// covers inputs 32g + 4j .. 32g + 4j + 3; its byte i (0..15) holds, for feature f = i / 4 and
// t = i % 4, q[f][32g + 4j + t] in the low nibble and q[f + 4][...] in the high nibble. A
// 128-bit broadcast, a variable shift (0 for the low lane, 4 for the high lane) and a mask give
// the 32 bytes [feature 0..7][t 0..3], which is what maddubs / vpdpbusd pair with 4 activation
// bytes broadcast to every feature. The VNNI kernels skip the shift: they mask the high nibbles
// in place (16 q, 0..240: vpdpbusd's int32 sums cannot saturate), so features 4..7 get 16 x
// their dot, exactly, and their d is taken / 16 (a power of two: exact). Then
// fma(16 dot, fl(d dx) / 16, acc) is bitwise fma(dot, fl(d dx), acc) as long as fl(d dx) / 16 is
// a normal float32; quantize_row makes xq all zero where it might not be (amax < 2^-90), so both
// sides are then exactly acc. A shift per weight vector was 8 of the ~71 port-0 operations per
// pair of panels and group in a 7-row verify pass.
//
// ---- int8: w[n, k] = s[n] * q[n, k], q in -127..127, one float32 scale per output feature.
// Layout [P][G][256 bytes]: 8 vectors of 32 bytes, vector j holding q[f][32g + 4j + t] at byte
// 4f + t (the unpacked q4 order). maddubs needs an unsigned operand: |q| times x with q's
// sign (each pair at most 2 x 127 x 127 = 32258, no saturation), madd to int32 per vector.
// Per group and row: acc = fma(float(dot), dx, acc); the result is acc * s[n].
#include "cpu_aten.h"  // not torch/extension.h nor torch/types.h (see there); bindings: cpu_decoder.cpp
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kFeatures = 8;
constexpr int64_t kBlock = 160;        // q4 bytes per panel and group
constexpr int64_t kBlockI8 = 256;      // int8 bytes per panel and group
// Rows per pass over a panel (registers: 2 per row, plus weights and temporaries): AVX2 has 16
// ymm registers, AVX-512VL (which VNNI comes with) 32, so a whole verify pass of up to 8 rows
// unpacks each weight once.
constexpr int kMaxRowsAvx2 = 4;
constexpr int kMaxRowsVnni = 8;
constexpr int64_t kPrefetchBytes = 4096;
// Up to this many rows, the per-row work around the dot products (quantizing activations,
// rounding results) runs on the calling thread: a parallel region costs more than it saves.
constexpr int64_t kSerialRows = 16;
// Activation groups whose largest |x| is below this quantize to zero (2^-90; see quantize_row).
constexpr float kTinyAmax = 0x1p-90f;

inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) { return static_cast<float>(v); }  // exact

// 8 inputs as float32 (bf16 widened exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Lane 0 + 4, 1 + 5, 2 + 6, 3 + 7, then (0 + 2, 1 + 3), then 0 + 1: one fixed order.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {  // exact in any order
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// One row: x [K] float32 or bf16 (read as its exact float32 value) -> xq [G * 32] int8, dx [G]
// (activation scales), xs [G] (sums of x), xqs [G] (128 x the sums of xq: what the int8 kernel's
// unsigned weights add to a dot). Per group of 32 (the last one zero-padded): amax = max |x|,
// xq = round(x * (127 / amax)) half to even, dx = amax / 127, xs summed in one fixed order:
// (x[0:8] + x[8:16]) + (x[16:24] + x[24:32]) lane-wise, then hsum8. A row's values depend on
// that row alone, never on the call. Vectorised: a scalar loop here (a sequential float sum,
// a rounding call per input) cost ~7 us per 1536-input row, as much as the dot products of a
// small layer.
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t G, int8_t* xq, float* dx, float* xs, int32_t* xqs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * kGroup, n = std::min<int64_t>(kGroup, K - k0);
    __m256 v[4];
    if (n == kGroup) {
      for (int i = 0; i < 4; ++i) v[i] = load8(x + k0 + 8 * i);
    } else {
      alignas(32) float padded[kGroup] = {};
      for (int64_t t = 0; t < n; ++t) padded[t] = as_float(x[k0 + t]);
      for (int i = 0; i < 4; ++i) v[i] = _mm256_load_ps(padded + 8 * i);
    }
    const __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float amax = hmax8(amax8);
    // Groups this small quantize to zero (the VNNI kernels' exact / 16 needs fl(d dx) >= 2^-122,
    // i.e. dx >= 2^-98 for the smallest float16 d, 2^-24; see the top of the file).
    const float inv = amax >= kTinyAmax ? 127.f / amax : 0.f;
    dx[g] = amax / 127.f;
    xs[g] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));  // half to even
    // packs interleave 128-bit lanes: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] q0[4:8] ..
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + k0), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    const __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
    const __m128i q2 = _mm_add_epi32(q4, _mm_unpackhi_epi64(q4, q4));
    xqs[g] = 128 * _mm_cvtsi128_si32(_mm_add_epi32(q2, _mm_shuffle_epi32(q2, 1)));
  }
}

struct Rows {
  const int8_t* xq;  // [M, G * 32]
  const float* dx;   // [M, G]
  const float* xs;   // [M, G]
  const int32_t* xqs;  // [M, G]
  int64_t G;
};

inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i shifted = _mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

// The VNNI kernels' unpacking: the same bytes without the shift, high nibbles masked in place
// (features 4..7 hold 16 q; see the top of the file).
inline __m256i unpack_nibbles_x16(const uint8_t* p) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const int lo4 = 0x0F0F0F0F, hi4 = static_cast<int>(0xF0F0F0F0u);  // 128-bit lanes: low, high
  return _mm256_and_si256(raw, _mm256_setr_epi32(lo4, lo4, lo4, lo4, hi4, hi4, hi4, hi4));
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

inline void store_features(float* dst, __m256 v, int64_t n_valid) {
  if (n_valid == kFeatures) {
    _mm256_storeu_ps(dst, v);
  } else {
    alignas(32) float tmp[kFeatures];
    _mm256_store_ps(tmp, v);
    std::memcpy(dst, tmp, sizeof(float) * n_valid);
  }
}

// Where the pass reads `ahead` once it has left the weight it reads now ([.., end)): the same
// offset into the weight that comes next (next; = end for a single weight, i.e. no redirect).
// A grouped pass (a MoE layer's experts: separate tensors read one after the other) keeps
// streaming across their boundaries instead of prefetching past each one's end and starting
// the next cold. Qwen3-30B-A3B's 8 active experts, q4, in the huge-page arena, one thread (AMD
// EPYC Zen 3): gate_ups 746 us as one grouped pass against 766 us as 8 calls, downs 383 against
// 422 (one contiguous weight of the gate_ups' bytes: ~850-950 us, as noisy).
struct Stream {
  const uint8_t* end;
  const uint8_t* next;
};
__attribute__((always_inline)) inline const uint8_t* redirect(const uint8_t* ahead, const Stream& s) {
  return ahead < s.end ? ahead : s.next + (ahead - s.end);
}

// Software prefetch of one block's cache lines, kPrefetchBytes ahead of it.
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* blk, int64_t bytes, const Stream& s) {
  const char* ahead = reinterpret_cast<const char*>(redirect(blk + kPrefetchBytes, s));
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(ahead + offset, _MM_HINT_T0);
}

// Software prefetch for a pass over two adjacent panels (a, then b = a + stride in memory),
// kPrefetchBytes ahead *in the order the pass reads*: group g + D of both panels, or, past the
// last group, the same groups of the next pair (a + 2 stride). Prefetching a + kPrefetchBytes
// instead would fetch b's blocks that are already on their way and miss the start of the next
// pair's second panel: with K = 1536 (7.7 KB per q4 panel) that made a one-row pass 1.7x slower.
__attribute__((always_inline)) inline void prefetch_pair(const uint8_t* a, const uint8_t* b, int64_t g,
                                                         int64_t G, int64_t block, const Stream& s) {
  const int64_t ahead = g + kPrefetchBytes / block;
  const int64_t next = ahead < G ? 0 : 2 * (b - a);  // bytes to the next pair
  const int64_t offset = next + (ahead < G ? ahead : ahead - G) * block;
  const uint8_t* pa = redirect(a + offset, s);
  const uint8_t* pb = redirect(b + offset, s);
  for (int64_t line = 0; line < block; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(pa + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pb + line), _MM_HINT_T0);
  }
}

// ---- The micro-kernels: MR rows (m0 .. m0 + MR - 1) times one panel, or two adjacent panels.
// One loop nest (micro_rows) serves the six kernels, q4 and int8 each on AVX2, on VNNI and on
// VNNI panel pairs. A kernel is a struct of static steps: from its ISA base (Avx2, Vnni256,
// Vnni512) the compiled entry and the rows per pass; from its format base (Q4Floats, I8Floats,
// over a width: Lanes<8> or Lanes<16>) the block bytes, the float part of a group and the stores;
// its own are the weight vectors and the integer dot step. Lane for lane, each kernel runs the
// same integer and float operations in the same order as the others of its format: bitwise
// equal results.

// Steps that use AVX-512 carry their kernel's target and are not always_inline: micro_rows is
// compiled for the default target (AVX2), so they inline only once micro_rows is inlined into
// its ISA's run (Vnni256, Vnni512), whose flatten inlines everything below it.
#define VNNI256_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define VNNI512_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define SPECDEC_INLINE __attribute__((always_inline)) inline
#define SPECDEC_VNNI256 __attribute__((target(VNNI256_TARGET))) inline
#define SPECDEC_VNNI512 __attribute__((target(VNNI512_TARGET))) inline

// Float steps, overloaded on the vector width (8 lanes: one panel; 16: a pair, lanes 0..7 from
// panel A, 8..15 from panel B), so that each format's float part below is written once. They
// write through references instead of returning: a __m512 returned into code compiled for AVX2
// (micro_rows) would change the ABI.
SPECDEC_INLINE void set_zero(__m256& v) { v = _mm256_setzero_ps(); }
SPECDEC_VNNI512 void set_zero(__m512& v) { v = _mm512_setzero_ps(); }
SPECDEC_INLINE void load_floats(__m256& v, const float* p) { v = _mm256_loadu_ps(p); }
SPECDEC_VNNI512 void load_floats(__m512& v, const float* p) { v = _mm512_loadu_ps(p); }
SPECDEC_INLINE void mul(__m256& v, const __m256& a, const __m256& b) { v = _mm256_mul_ps(a, b); }
SPECDEC_VNNI512 void mul(__m512& v, const __m512& a, const __m512& b) { v = _mm512_mul_ps(a, b); }
SPECDEC_INLINE void mul(__m256& v, const __m256& a, float x) { v = _mm256_mul_ps(a, _mm256_set1_ps(x)); }
SPECDEC_VNNI512 void mul(__m512& v, const __m512& a, float x) { v = _mm512_mul_ps(a, _mm512_set1_ps(x)); }
SPECDEC_INLINE void set1(__m256& v, float x) { v = _mm256_set1_ps(x); }
SPECDEC_VNNI512 void set1(__m512& v, float x) { v = _mm512_set1_ps(x); }
// acc = fma(a, x, acc)
SPECDEC_INLINE void fma(__m256& acc, const __m256& a, float x) {
  acc = _mm256_fmadd_ps(a, _mm256_set1_ps(x), acc);
}
SPECDEC_VNNI512 void fma(__m512& acc, const __m512& a, float x) {
  acc = _mm512_fmadd_ps(a, _mm512_set1_ps(x), acc);
}
// acc = fma(float(dot), m, acc)
SPECDEC_INLINE void fma_dot(__m256& acc, const __m256i& dot, const __m256& m) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), m, acc);
}
SPECDEC_VNNI512 void fma_dot(__m512& acc, const __m512i& dot, const __m512& m) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), m, acc);
}
// The first n_valid lanes to dst.
SPECDEC_INLINE void store(float* dst, const __m256& v, int64_t n_valid) { store_features(dst, v, n_valid); }
SPECDEC_VNNI512 void store(float* dst, const __m512& v, int64_t n_valid) {
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << n_valid) - 1u), v);
}
// 8 float16 at a (8 lanes), or 8 at a and 8 at b (16 lanes), as float32.
SPECDEC_INLINE void load_halves(__m256& v, const uint8_t* a, const uint8_t*) {
  v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
}
SPECDEC_VNNI512 void load_halves(__m512& v, const uint8_t* a, const uint8_t* b) {
  v = _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
// Features 4..7 of each panel / 16 (their dots come as 16 x the dot: unpack_nibbles_x16).
SPECDEC_INLINE void div16_high(__m256& d) {
  d = _mm256_mul_ps(d, _mm256_setr_ps(1, 1, 1, 1, 0.0625f, 0.0625f, 0.0625f, 0.0625f));
}
SPECDEC_VNNI512 void div16_high(__m512& d) {
  d = _mm512_mul_ps(d, _mm512_setr_ps(1, 1, 1, 1, 0.0625f, 0.0625f, 0.0625f, 0.0625f,
                                      1, 1, 1, 1, 0.0625f, 0.0625f, 0.0625f, 0.0625f));
}

// What micro_rows needs besides the row block: the panel (pair: a, then b) and, for int8, its
// features' scales (a pair's 16 are adjacent).
struct Panels {
  const uint8_t* a;
  const uint8_t* b;    // pair kernels only
  const float* scale;  // int8 only
  const Rows* rows;
  int64_t M;
  float* out;
  int64_t ldo;
  int64_t n_valid;     // features to store (a pair: both panels')
  Stream stream;       // the prefetches' redirect past the weight's end
};

template <class K, int MR, bool PREFETCH>
SPECDEC_INLINE void micro_rows(const Panels& p, int64_t m0) {
  // Locals, not reads through p: the stores (memcpy) could alias p, which would reload them.
  const Rows& r = *p.rows;
  const uint8_t* const panel_a = p.a;
  const uint8_t* const panel_b = p.b;
  const float* const scale_p = p.scale;
  float* const out = p.out;
  const int64_t ldo = p.ldo, n_valid = p.n_valid;
  const Stream stream = p.stream;
  typename K::Acc acc[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) set_zero(acc[m]);
  const int64_t Kp = r.G * kGroup;
  for (int64_t g = 0; g < r.G; ++g) {
    const uint8_t* a = panel_a + g * K::kBytes;
    const uint8_t* b = K::kPair ? panel_b + g * K::kBytes : nullptr;
    if (PREFETCH) {
      if constexpr (K::kPair) prefetch_pair(panel_a, panel_b, g, r.G, K::kBytes, stream);
      else prefetch_block(a, K::kBytes, stream);
    }
    typename K::Int isum[MR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) K::start(isum[m], r, (m0 + m) * r.G + g);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      typename K::Weights w;
      K::load(w, a, b, j);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) K::dot(isum[m], w, r.xq + (m0 + m) * Kp + g * kGroup + 4 * j, j == 0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) K::finish(isum[m]);
    typename K::Group s;
    K::load_group(s, a, b);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) K::add(acc[m], isum[m], s, r, (m0 + m) * r.G + g);
  }
  typename K::Acc scale;
  K::load_scale(scale, scale_p);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) K::store_row(out + (m0 + m) * ldo, acc[m], scale, n_valid);
}

// The compiled entries of micro_rows, one per instruction set (a target attribute cannot be a
// template argument), with the rows per pass their registers hold.
struct Avx2 {
  static constexpr int kMaxRows = kMaxRowsAvx2;
  template <class K, int MR, bool PREFETCH>
  static void run(const Panels& p, int64_t m0) { micro_rows<K, MR, PREFETCH>(p, m0); }
};

struct Vnni256 {
  static constexpr int kMaxRows = kMaxRowsVnni;
  template <class K, int MR, bool PREFETCH>
  __attribute__((target(VNNI256_TARGET), flatten)) static void run(const Panels& p, int64_t m0) {
    micro_rows<K, MR, PREFETCH>(p, m0);
  }
};

// Two panels at once with 512-bit vectors (VNNI CPUs): features 0..7 from panel A, 8..15 from
// panel B, so each activation broadcast and each vpdpbusd serves 16 features, halving the
// per-row instructions of a verify pass.
struct Vnni512 {
  static constexpr int kMaxRows = kMaxRowsVnni;
  template <class K, int MR, bool PREFETCH>
  __attribute__((target(VNNI512_TARGET), flatten)) static void run(const Panels& p, int64_t m0) {
    micro_rows<K, MR, PREFETCH>(p, m0);
  }
};

template <int kLanes>
struct VectorTypes;  // float32 and int32 vectors of kLanes lanes
template <>
struct VectorTypes<8> { using Acc = __m256; using Int = __m256i; };
template <>
struct VectorTypes<16> { using Acc = __m512; using Int = __m512i; };

// A width: the float accumulators (Acc) and integer dots (Int) of a row, and the integer dot's
// default start and finish (none: a kernel's dot assigns it at j = 0).
template <int kLanes>
struct Lanes : VectorTypes<kLanes> {
  using typename VectorTypes<kLanes>::Int;
  static constexpr bool kPair = kLanes == 16;
  SPECDEC_INLINE static void start(Int&, const Rows&, int64_t) {}
  SPECDEC_INLINE static void finish(Int&) {}
};

// The float part of a q4 group per row, from its exact int32 dot: acc = fma(dot, d * dx, acc);
// acc = fma(c, xs, acc). X16: features 4..7 bring 16 x their dot, so their d is taken / 16.
template <class L, bool X16>
struct Q4Floats : L {
  using typename L::Acc, typename L::Int;
  static constexpr int64_t kBytes = kBlock;
  struct Group { Acc d, c; };
  SPECDEC_INLINE static void load_group(Group& s, const uint8_t* a, const uint8_t* b) {
    load_halves(s.d, a + 128, b + 128);
    if (X16) div16_high(s.d);
    load_halves(s.c, a + 144, b + 144);
  }
  SPECDEC_INLINE static void add(Acc& acc, const Int& dot, const Group& s, const Rows& r, int64_t row) {
    Acc m;
    mul(m, s.d, r.dx[row]);
    fma_dot(acc, dot, m);
    fma(acc, s.c, r.xs[row]);
  }
  SPECDEC_INLINE static void load_scale(Acc&, const float*) {}
  SPECDEC_INLINE static void store_row(float* dst, const Acc& acc, const Acc&, int64_t n_valid) {
    store(dst, acc, n_valid);
  }
};

// int8: acc = fma(dot, dx, acc) per group; the result is acc * s[n].
template <class L>
struct I8Floats : L {
  using typename L::Acc, typename L::Int;
  static constexpr int64_t kBytes = kBlockI8;
  struct Group {};
  SPECDEC_INLINE static void load_group(Group&, const uint8_t*, const uint8_t*) {}
  SPECDEC_INLINE static void add(Acc& acc, const Int& dot, const Group&, const Rows& r, int64_t row) {
    Acc m;
    set1(m, r.dx[row]);
    fma_dot(acc, dot, m);
  }
  SPECDEC_INLINE static void load_scale(Acc& s, const float* scale) { load_floats(s, scale); }
  SPECDEC_INLINE static void store_row(float* dst, const Acc& acc, const Acc& s, int64_t n_valid) {
    Acc v;
    mul(v, acc, s);
    store(dst, v, n_valid);
  }
};

// The kernels: weight vector j of a group's block(s) (load), and the integer dot of a group for
// one row, 4 activation bytes at a time (first: j == 0, a constant once the loop is unrolled).
// q4 on AVX2: maddubs sums 8 vectors in int16 (see the top of the file), finish adds pairs.
struct Q4Avx2 : Avx2, Q4Floats<Lanes<8>, false> {
  using Weights = __m256i;
  SPECDEC_INLINE static void load(Weights& w, const uint8_t* a, const uint8_t*, int j) {
    w = unpack_nibbles(a + 16 * j);
  }
  SPECDEC_INLINE static void dot(Int& isum, const Weights& w, const int8_t* x, bool first) {
    const __m256i p = _mm256_maddubs_epi16(w, broadcast4(x));
    isum = first ? p : _mm256_add_epi16(isum, p);
  }
  SPECDEC_INLINE static void finish(Int& isum) { isum = _mm256_madd_epi16(isum, _mm256_set1_epi16(1)); }
};

// q4 with vpdpbusd (exact int32 dot of 4 byte pairs; features 4..7 as 16 x their dot).
struct Q4Vnni : Vnni256, Q4Floats<Lanes<8>, true> {
  using Weights = __m256i;
  SPECDEC_INLINE static void load(Weights& w, const uint8_t* a, const uint8_t*, int j) {
    w = unpack_nibbles_x16(a + 16 * j);
  }
  SPECDEC_VNNI256 static void dot(Int& isum, const Weights& w, const int8_t* x, bool first) {
    isum = _mm256_dpbusd_epi32(first ? _mm256_setzero_si256() : isum, w, broadcast4(x));
  }
};

__attribute__((target(VNNI512_TARGET), always_inline))
inline __m512i unpack_nibbles_pair(const uint8_t* a, const uint8_t* b) {  // as unpack_nibbles_x16
  const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  const __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  // 128-bit lanes: a's low nibbles, a's high nibbles (in place), b's low, b's high.
  const int lo4 = 0x0F0F0F0F, hi4 = static_cast<int>(0xF0F0F0F0u);
  return _mm512_and_si512(raw, _mm512_setr_epi32(lo4, lo4, lo4, lo4, hi4, hi4, hi4, hi4,
                                                 lo4, lo4, lo4, lo4, hi4, hi4, hi4, hi4));
}

__attribute__((target(VNNI512_TARGET), always_inline))
inline __m512i dot_pair(const __m512i& isum, const __m512i& w, const int8_t* x) {  // x: 4 activation bytes
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm512_dpbusd_epi32(isum, w, _mm512_set1_epi32(v));
}

struct Q4Pair : Vnni512, Q4Floats<Lanes<16>, true> {
  using Weights = __m512i;
  SPECDEC_VNNI512 static void load(Weights& w, const uint8_t* a, const uint8_t* b, int j) {
    w = unpack_nibbles_pair(a + 16 * j, b + 16 * j);
  }
  SPECDEC_VNNI512 static void dot(Int& isum, const Weights& w, const int8_t* x, bool first) {
    isum = dot_pair(first ? _mm512_setzero_si512() : isum, w, x);
  }
};

// int8: maddubs needs an unsigned operand, so |q| (aw) times x with q's sign.
struct SignedWeights {
  __m256i w, aw;  // q and |q|
};

SPECDEC_INLINE void load_signed(SignedWeights& w, const uint8_t* blk, int j) {
  w.w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * j));
  w.aw = _mm256_sign_epi8(w.w, w.w);
}

struct I8Avx2 : Avx2, I8Floats<Lanes<8>> {
  using Weights = SignedWeights;
  SPECDEC_INLINE static void load(Weights& w, const uint8_t* a, const uint8_t*, int j) { load_signed(w, a, j); }
  SPECDEC_INLINE static void dot(Int& isum, const Weights& w, const int8_t* x, bool first) {
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w.aw, _mm256_sign_epi8(broadcast4(x), w.w)),
                                        _mm256_set1_epi16(1));
    isum = first ? p : _mm256_add_epi32(isum, p);
  }
};

struct I8Vnni : Vnni256, I8Floats<Lanes<8>> {
  using Weights = SignedWeights;
  SPECDEC_INLINE static void load(Weights& w, const uint8_t* a, const uint8_t*, int j) { load_signed(w, a, j); }
  SPECDEC_VNNI256 static void dot(Int& isum, const Weights& w, const int8_t* x, bool first) {
    const __m256i xv = _mm256_sign_epi8(broadcast4(x), w.w);
    isum = _mm256_dpbusd_epi32(first ? _mm256_setzero_si256() : isum, w.aw, xv);
  }
};

// int8 pairs: vpdpbusd wants unsigned weights, so q + 128 (q ^ 0x80) is dotted with the signed
// activations and 128 x the group's activation sum taken off again (start): the same exact int32
// dots as the sign trick above, without its per-row vpsignb (which has no 512-bit form).
struct I8Pair : Vnni512, I8Floats<Lanes<16>> {
  using Weights = __m512i;
  SPECDEC_VNNI512 static void start(Int& isum, const Rows& r, int64_t row) {
    isum = _mm512_set1_epi32(-r.xqs[row]);
  }
  SPECDEC_VNNI512 static void load(Weights& w, const uint8_t* a, const uint8_t* b, int j) {
    w = _mm512_xor_si512(
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * j))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * j)), 1),
        _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  SPECDEC_VNNI512 static void dot(Int& isum, const Weights& w, const int8_t* x, bool) {
    isum = dot_pair(isum, w, x);
  }
};

// Rows 0 .. M - 1 in blocks of at most `step`: f(std::integral_constant<int, MR>, m0, first)
// for each block, MR its row count as a compile-time constant (the micro-kernels' register
// arrays are sized by it); `first` marks the block that streams the panel from memory.
template <typename F>
inline void for_row_blocks(int64_t M, int64_t step, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += step) {
    const bool first = m0 == 0;
    switch (std::min<int64_t>(step, M - m0)) {
      case 1: f(std::integral_constant<int, 1>{}, m0, first); break;
      case 2: f(std::integral_constant<int, 2>{}, m0, first); break;
      case 3: f(std::integral_constant<int, 3>{}, m0, first); break;
      case 4: f(std::integral_constant<int, 4>{}, m0, first); break;
      case 5: f(std::integral_constant<int, 5>{}, m0, first); break;
      case 6: f(std::integral_constant<int, 6>{}, m0, first); break;
      case 7: f(std::integral_constant<int, 7>{}, m0, first); break;
      default: f(std::integral_constant<int, 8>{}, m0, first); break;
    }
  }
}

// All M rows times one panel (or pair), as many at a time as the registers hold: the first
// block streams the panel from memory, the others find it in cache.
template <class K>
void all_rows(const Panels& p) {
  for_row_blocks(p.M, K::kMaxRows, [&](auto mr, int64_t m0, bool first) {
    constexpr int MR = decltype(mr)::value;
    if constexpr (MR <= K::kMaxRows) {
      if (first) K::template run<K, MR, true>(p, m0);
      else K::template run<K, MR, false>(p, m0);
    }
  });
}

// The three kernels of a format (they agree on its block bytes, kBytes).
struct Q4 {
  using Avx2Kernel = Q4Avx2;
  using VnniKernel = Q4Vnni;
  using PairKernel = Q4Pair;
};

struct Int8 {
  using Avx2Kernel = I8Avx2;
  using VnniKernel = I8Vnni;
  using PairKernel = I8Pair;
};

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return has;
}

// The activations of a call, quantized row by row (see quantize_row), in one heap block (one
// allocation instead of four tensors: each ATen call costs a few microseconds, as much as a
// small layer's arithmetic at one row).
struct QuantizedRows {
  // dx, xs (float32 bits), xqs: 3 [M, G]; then xq [M, G * 32] int8. Not zeroed: quantize_row
  // writes every entry (a prefill's block is megabytes).
  std::unique_ptr<int32_t[]> block;
  Rows rows;
};

template <typename T>
QuantizedRows quantize_rows_of(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), n = M * G;
  QuantizedRows q{std::unique_ptr<int32_t[]>(new int32_t[3 * n + n * kGroup / 4]), {}};
  float* dx = reinterpret_cast<float*>(q.block.get());
  float* xs = dx + n;
  int32_t* xqs = q.block.get() + 2 * n;
  int8_t* xq = reinterpret_cast<int8_t*>(q.block.get() + 3 * n);
  const T* xp = x.data_ptr<T>();
  // Rows in parallel for prefills (each row depends on itself only: the same bits); a verify
  // pass's few rows stay on this thread.
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(xp + m * K, K, G, xq + m * G * kGroup, dx + m * G, xs + m * G, xqs + m * G);
  });
  q.rows = Rows{xq, dx, xs, xqs, G};
  return q;
}

QuantizedRows quantize_rows(const at::Tensor& x, int64_t G) {  // x: float32 or bf16
  return x.scalar_type() == at::kBFloat16 ? quantize_rows_of<at::BFloat16>(x, G)
                                             : quantize_rows_of<float>(x, G);
}

// Whether a VNNI pass takes two panels at a time (use_vnni 2: always, 1: never, -1: where it
// measured faster). Pairs halve the instructions per row but read two streams. On an AMD EPYC
// (Zen 4) runner, a one-row pass over short panels (K = 1536: 48 groups) streamed from memory
// was ~1.4x slower with pairs than one panel at a time; on long panels (K = 8960) or many rows
// pairs won (benchmarks/quant_kernels). On an Intel Xeon (Sapphire Rapids) runner pairs won
// everywhere: over the 1.5B model's 113 int8 / 4-bit weights one row took 0.70x / 0.84x the
// time of single panels on one thread, 0.89x / 0.88x on two (one stream per core leaves its
// memory bandwidth unused there, as in the bf16 kernel). Every choice gives the same bits, so
// this only moves time.
constexpr int64_t kPairMinGroups = 128;
constexpr int64_t kPairMinRows = 5;
bool cpu_is_intel() {
  static const bool is = __builtin_cpu_is("intel");
  return is;
}
bool pairs_pay(int64_t use_vnni, int64_t M, int64_t G) {
  if (use_vnni != -1) return use_vnni == 2;
  return cpu_is_intel() || G >= kPairMinGroups || M >= kPairMinRows;
}

// Shared argument checks; returns x contiguous (float32 or bf16, other dtypes as float32) and
// whether to use VNNI.
std::pair<at::Tensor, bool> check_call(at::Tensor x, const at::Tensor& packed,
                                          int64_t block, int64_t N, int64_t use_vnni) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == block, "packed must be [panels, groups, ", block, "]");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  const int64_t K = x.size(1), P = packed.size(0), G = packed.size(1);
  TORCH_CHECK(K > (G - 1) * kGroup && K <= G * kGroup, "x and the packed weight disagree on in_features");
  TORCH_CHECK(N > (P - 1) * kFeatures && N <= P * kFeatures,
              "out_features does not match the number of panels");
  TORCH_CHECK(use_vnni >= -1 && use_vnni <= 2, "use_vnni must be -1, 0, 1 or 2");
  TORCH_CHECK(use_vnni <= 0 || cpu_has_vnni(), "use_vnni=", use_vnni, " but this CPU has no AVX512-VNNI");
  const bool vnni = use_vnni >= 1 || (use_vnni == -1 && cpu_has_vnni());
  const bool direct = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  return {(direct ? x : x.to(at::kFloat)).contiguous(), vnni};
}

// dst[i] = bf16(src[i] + bias[i]) (bias may be null), rounded to nearest even as ATen's
// float32 -> bfloat16 conversion rounds (NaN: a quiet NaN): the bits of out.add_(bias).to(bf16).
void add_round_bf16(const float* src, const float* bias, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
  const __m256i quiet_nan = _mm256_set1_epi32(0x7FC0);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(src + i);
    if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, half)), 16);
    r = _mm256_blendv_epi8(r, quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
  }
  for (; i < n; ++i) {
    const float v = bias != nullptr ? src[i] + bias[i] : src[i];
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    dst[i] = std::isnan(v) ? 0x7FC0 : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
}

// The float32 result plus the optional bias, in float32 or rounded to bfloat16 (one pass, no
// ATen calls but the output's allocation).
at::Tensor finish(at::Tensor out, const c10::optional<at::Tensor>& bias, bool out_bf16) {
  const int64_t M = out.size(0), N = out.size(1);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "bias must be contiguous float32 [out_features]");
  if (!out_bf16) return bias.has_value() ? out.add_(*bias) : out;
  auto rounded = at::empty({M, N}, out.options().dtype(at::kBFloat16));
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  uint16_t* dst = reinterpret_cast<uint16_t*>(rounded.data_ptr<at::BFloat16>());
  const float* src = out.data_ptr<float>();
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) add_round_bf16(src + m * N, bp, dst + m * N, N);
  });
  return rounded;
}

// One weight of format F as a pass reads it: its panels, int8 scales (else null), the rows it
// multiplies, where its results go, and where reading goes on after it (Stream).
struct Weight {
  const uint8_t* w;    // [P][G][bytes]
  const float* scale;  // int8: [P * 8]; q4: null
  const Rows* rows;
  int64_t M;
  float* out;          // [M, N], row stride ldo
  int64_t ldo;
  Stream stream;
};

// Panels p0 .. p1 - 1 of one weight (N outputs, P panels of G groups), two at a time where a
// VNNI pass gains by it.
template <class F>
void run_panels(const Weight& wt, int64_t p0, int64_t p1, int64_t G, int64_t N, bool vnni, bool use_pairs) {
  constexpr int64_t kBytes = F::Avx2Kernel::kBytes;
  const auto panels = [&](int64_t p, int64_t features) {  // panel p (and p + 1 for a pair)
    return Panels{wt.w + p * G * kBytes, wt.w + (p + 1) * G * kBytes,
                  wt.scale == nullptr ? nullptr : wt.scale + p * kFeatures, wt.rows, wt.M,
                  wt.out + p * kFeatures, wt.ldo, std::min<int64_t>(features, N - p * kFeatures), wt.stream};
  };
  int64_t p = p0;
  for (; vnni && use_pairs && p + 1 < p1; p += 2) all_rows<typename F::PairKernel>(panels(p, 2 * kFeatures));
  for (; p < p1; ++p) {
    if (vnni) all_rows<typename F::VnniKernel>(panels(p, kFeatures));
    else all_rows<typename F::Avx2Kernel>(panels(p, kFeatures));
  }
}

// x times a packed weight of format F (scale: int8's per-feature scales, else null): the
// activations quantized once, then the panels in parallel.
template <class F>
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, const float* scale,
                               int64_t N, const c10::optional<at::Tensor>& bias, bool out_bf16,
                               int64_t use_vnni) {
  constexpr int64_t kBytes = F::Avx2Kernel::kBytes;
  auto [xf, vnni] = check_call(x, packed, kBytes, N, use_vnni);
  const int64_t M = xf.size(0), P = packed.size(0), G = packed.size(1);
  const bool use_pairs = pairs_pay(use_vnni, M, G);
  const QuantizedRows q = quantize_rows(xf, G);
  auto out = at::empty({M, N}, xf.options().dtype(at::kFloat));
  const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
  const uint8_t* end = wp + P * G * kBytes;
  const Weight wt{wp, scale, &q.rows, M, out.data_ptr<float>(), N, Stream{end, end}};
  at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) { run_panels<F>(wt, p0, p1, G, N, vnni, use_pairs); });
  return finish(out, bias, out_bf16);
}

// E weights of format F and one shape, each times one row: x [1, K] (every weight reads it: a
// MoE layer's gate_up) or [E, K] (weight e reads row e: its down); returns [E, N] bf16, row e
// bitwise what quantized_linear gives for weight e and its row. One pass over the weights in
// order, prefetching across their boundaries (Stream), the shared row quantized once, one
// output allocation instead of E.
template <class F>
at::Tensor grouped_linear(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                             const std::vector<const float*>& scales, int64_t N,
                             const std::vector<c10::optional<at::Tensor>>& biases, int64_t use_vnni) {
  constexpr int64_t kBytes = F::Avx2Kernel::kBytes;
  const int64_t E = static_cast<int64_t>(packed.size());
  TORCH_CHECK(E >= 1, "grouped linear: no weights");
  TORCH_CHECK(biases.size() == packed.size(), "grouped linear: one bias entry per weight");
  auto [xf, vnni] = check_call(x, packed[0], kBytes, N, use_vnni);
  const int64_t R = xf.size(0), P = packed[0].size(0), G = packed[0].size(1);
  TORCH_CHECK(R == 1 || R == E, "grouped linear: x must have 1 row or one row per weight, got ", R);
  for (const auto& w : packed)
    TORCH_CHECK(w.sizes() == packed[0].sizes() && w.scalar_type() == packed[0].scalar_type() && w.is_contiguous(),
                "grouped linear: every weight must be contiguous and of the first one's shape and dtype");
  for (const auto& b : biases)
    if (b.has_value())
      TORCH_CHECK(b->scalar_type() == at::kFloat && b->numel() == N && b->is_contiguous(),
                  "bias must be contiguous float32 [out_features]");
  const bool use_pairs = pairs_pay(use_vnni, 1, G);
  const QuantizedRows q = quantize_rows(xf, G);
  std::vector<Rows> rows(R);
  for (int64_t r = 0; r < R; ++r)
    rows[r] = Rows{q.rows.xq + r * G * kGroup, q.rows.dx + r * G, q.rows.xs + r * G, q.rows.xqs + r * G, G};
  auto out = at::empty({E, N}, xf.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  std::vector<Weight> weights(E);
  for (int64_t e = 0; e < E; ++e) {
    const uint8_t* w = static_cast<const uint8_t*>(packed[e].data_ptr());
    const uint8_t* next = e + 1 < E ? static_cast<const uint8_t*>(packed[e + 1].data_ptr()) : w + P * G * kBytes;
    weights[e] = Weight{w, scales[e], &rows[R == 1 ? 0 : e], 1, op + e * N, N, Stream{w + P * G * kBytes, next}};
  }
  // The E x P panels as one range, so that each thread streams a run of consecutive weights.
  at::parallel_for(0, E * P, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t e = i / P, p0 = i % P, p1 = std::min(P, p0 + (i1 - i));
      run_panels<F>(weights[e], p0, p1, G, N, vnni, use_pairs);
      i += p1 - p0;
    }
  });
  auto rounded = at::empty({E, N}, xf.options().dtype(at::kBFloat16));
  uint16_t* dst = reinterpret_cast<uint16_t*>(rounded.data_ptr<at::BFloat16>());
  for (int64_t e = 0; e < E; ++e)
    add_round_bf16(op + e * N, biases[e].has_value() ? biases[e]->data_ptr<float>() : nullptr, dst + e * N, N);
  return rounded;
}

}  // namespace

// x: [M, K] float32 or bfloat16; packed: [ceil(N/8), ceil(K/32), 160] uint8 (layout above);
// optional float32 bias [N]; returns [M, N] float32, or bfloat16 when out_bf16. use_vnni: -1
// picks by the CPU, 0 forces AVX2, 1 asks for VNNI on one panel at a time (256-bit), 2 for
// VNNI on panel pairs (512-bit; what -1 picks with VNNI); 1 and 2 are errors without VNNI.
at::Tensor q4_linear_layer(at::Tensor x, at::Tensor packed, int64_t N,
                              c10::optional<at::Tensor> bias, bool out_bf16, int64_t use_vnni) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, "packed must be uint8");
  return quantized_linear<Q4>(x, packed, nullptr, N, bias, out_bf16, use_vnni);
}

// x: [M, K] float32 or bfloat16; packed: [ceil(N/8), ceil(K/32), 256] int8 (layout above);
// scale: [ceil(N/8) * 8] float32; bias, out_bf16 and use_vnni as above.
at::Tensor int8_linear_layer(at::Tensor x, at::Tensor packed, at::Tensor scale,
                                int64_t N, c10::optional<at::Tensor> bias, bool out_bf16,
                                int64_t use_vnni) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "packed must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == packed.size(0) * kFeatures,
              "scale must be contiguous float32 [panels * 8]");
  return quantized_linear<Int8>(x, packed, scale.data_ptr<float>(), N, bias, out_bf16, use_vnni);
}

bool quantized_has_vnni() { return cpu_has_vnni(); }

// x: [1 or E, K] float32 or bfloat16; packed: E q4 weights of one shape; biases: E optional
// float32 [N]; returns [E, N] bfloat16, row e = q4_linear_layer(x[0 or e], packed[e], ...).
at::Tensor q4_grouped_linear(at::Tensor x, std::vector<at::Tensor> packed, int64_t N,
                                std::vector<c10::optional<at::Tensor>> biases, int64_t use_vnni) {
  for (const auto& w : packed) TORCH_CHECK(w.scalar_type() == at::kByte, "packed must be uint8");
  return grouped_linear<Q4>(x, packed, std::vector<const float*>(packed.size(), nullptr), N, biases, use_vnni);
}

// As q4_grouped_linear for int8 weights, with their scales ([panels * 8] float32 each).
at::Tensor int8_grouped_linear(at::Tensor x, std::vector<at::Tensor> packed,
                                  std::vector<at::Tensor> scales, int64_t N,
                                  std::vector<c10::optional<at::Tensor>> biases, int64_t use_vnni) {
  TORCH_CHECK(scales.size() == packed.size(), "int8_grouped_linear: one scale per weight");
  std::vector<const float*> sp;
  for (size_t e = 0; e < packed.size(); ++e) {
    TORCH_CHECK(packed[e].scalar_type() == at::kChar, "packed must be int8");
    TORCH_CHECK(scales[e].scalar_type() == at::kFloat && scales[e].is_contiguous() &&
                    scales[e].numel() == packed[e].size(0) * kFeatures,
                "scale must be contiguous float32 [panels * 8]");
    sp.push_back(scales[e].data_ptr<float>());
  }
  return grouped_linear<Int8>(x, packed, sp, N, biases, use_vnni);
}
