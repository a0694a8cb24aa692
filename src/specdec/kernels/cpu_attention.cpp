// Paged attention for x86 CPUs (AVX2 + FMA) in float32 with a fixed reduction order.
//
// Why: PyTorch's CPU scaled_dot_product_attention picks different kernels for one query row
// without a mask and for several rows with one, and in float32 their roundings differ enough to
// flip a bf16 near-tie between a verify pass and plain decoding; the torch reference therefore
// attends in float64, which is slow. Here every output (query row, head) is computed on its own
// by one thread with a reduction order that depends only on head_dim and on the row's visible
// slots, never on how many rows or sequences share the call or on the thread count: a row
// inside a k+1-row verify pass is bitwise equal to the same row decoded alone.
//
// Per (row, head), with KV head h / (Hq / Hkv) and the row's visible slots j < kv_len:
//   1. s_j = sm_scale * dot(q, k_j): eight-lane FMA chains over d in a layout fixed by D (bf16
//      pages are read sixteen at a time as even and odd elements, with q permuted to match).
//   2. m = max_j s_j (exact in any order).
//   3. p_j = exp(s_j - m) over the row's visible slots only, in blocks of eight by the slot's
//      rank among them; the padding up to a multiple of eight gives an exact 0. The sum
//      l = sum_j p_j keeps one lane per rank mod 8, so a decode row (kv_len = its slot + 1), the
//      same row in a verify pass (later slots hidden) and a tree node (its ancestors sit after
//      siblings, in other slots than once its path is committed) add the same numbers in the
//      same order. (Lanes by absolute slot broke that for trees.)
//   4. out_d = (sum_j p_j v_j,d) / l: one sequential FMA chain per d over visible j ascending.
// Up to three query heads sharing a KV head run together, so each K and V block is loaded and
// converted once for all of them; each head's arithmetic is exactly what it would be alone.
#include "cpu_aten.h"  // not torch/extension.h nor torch/types.h (see there); bindings: cpu_decoder.cpp
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kBlock = 16;  // elements loaded at once: two vectors
constexpr int64_t kMaxHeads = 3;  // query heads attended together (their registers must fit)
// exp(x) for x below this is under FLT_MIN: written as an exact 0 (as it is for -inf).
constexpr float kExpFloor = -87.0f;

// K and V elements as float32, for each page dtype: sixteen (as two vectors, in the order
// `lane` gives), eight (in order) or one. Queries and accumulators are kept in the same order
// inside each block of sixteen (see arrange), so no load needs a shuffle.
template <typename T>
struct Load;

template <>
struct Load<float> {
  // Vector v, lane i of a block holds element 8 v + i.
  static int64_t lane(int v, int i) { return 8 * v + i; }
  static void sixteen(const float* p, __m256& a, __m256& b) {
    a = _mm256_loadu_ps(p);
    b = _mm256_loadu_ps(p + kLanes);
  }
  static __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
  static float one(const float* p) { return *p; }
};

template <>
struct Load<at::BFloat16> {
  // Sixteen bf16 fill eight 32-bit lanes, lane i holding element 2 i in its low half and
  // 2 i + 1 in its high half. A bf16 is the top half of a float32, so a shift yields the even
  // elements and a mask the odd ones: vector v, lane i holds element 2 i + v.
  static int64_t lane(int v, int i) { return 2 * i + v; }
  static void sixteen(const at::BFloat16* p, __m256& a, __m256& b) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));  // 0xFFFF0000
  }
  static __m256 eight(const at::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static float one(const at::BFloat16* p) { return static_cast<float>(*p); }
};

template <>
struct Load<at::Half> {
  // The build flags do not enable F16C, so halves convert in software (exactly).
  static int64_t lane(int v, int i) { return 8 * v + i; }
  static void sixteen(const at::Half* p, __m256& a, __m256& b) {
    a = eight(p);
    b = eight(p + kLanes);
  }
  static __m256 eight(const at::Half* p) {
    alignas(32) float tmp[kLanes];
    for (int i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
    return _mm256_load_ps(tmp);
  }
  static float one(const at::Half* p) { return static_cast<float>(*p); }
};

// dst[b + 8 v + i] = src[b + lane(v, i)] for every whole block b of sixteen (UNDO: the
// inverse); elements past the last whole block keep their places.
template <typename T, bool UNDO = false>
void arrange(const float* src, float* dst, int64_t D) {
  int64_t b = 0;
  for (; b + kBlock <= D; b += kBlock)
    for (int v = 0; v < 2; ++v)
      for (int i = 0; i < kLanes; ++i) {
        const int64_t packed = b + 8 * v + i, natural = b + Load<T>::lane(v, i);
        if (UNDO) dst[natural] = src[packed];
        else dst[packed] = src[natural];
      }
  for (; b < D; ++b) dst[b] = src[b];
}

// Lanes 0..7 added in a fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float hsum(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

// s[i] = dot(q_i, k) for Q arranged queries q_i = q + i * D (heads sharing a KV head: each K
// block is loaded once for all of them). Per query: four accumulators over blocks of 32, then
// one block of 16, one of 8 and a scalar tail as D leaves them; the grouping depends on D only,
// and a query's arithmetic does not depend on Q.
template <typename T, int Q>
void dots(const float* q, const T* k, int64_t D, float* s) {
  __m256 a[Q][4], x, y;
#pragma GCC unroll 4
  for (int i = 0; i < Q; ++i)
    for (int c = 0; c < 4; ++c) a[i][c] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 2 * kBlock <= D; d += 2 * kBlock) {
    Load<T>::sixteen(k + d, x, y);
#pragma GCC unroll 4
    for (int i = 0; i < Q; ++i) {
      a[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d), x, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d + 8), y, a[i][1]);
    }
    Load<T>::sixteen(k + d + kBlock, x, y);
#pragma GCC unroll 4
    for (int i = 0; i < Q; ++i) {
      a[i][2] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d + 16), x, a[i][2]);
      a[i][3] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d + 24), y, a[i][3]);
    }
  }
  if (d + kBlock <= D) {
    Load<T>::sixteen(k + d, x, y);
    for (int i = 0; i < Q; ++i) {
      a[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d), x, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d + 8), y, a[i][1]);
    }
    d += kBlock;
  }
  if (d + kLanes <= D) {
    x = Load<T>::eight(k + d);
    for (int i = 0; i < Q; ++i)
      a[i][2] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + d), x, a[i][2]);
    d += kLanes;
  }
  for (int i = 0; i < Q; ++i)
    s[i] = hsum(_mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]), _mm256_add_ps(a[i][2], a[i][3])));
  for (; d < D; ++d) {
    const float kd = Load<T>::one(k + d);
    for (int i = 0; i < Q; ++i) s[i] = std::fma(q[i * D + d], kd, s[i]);
  }
}

// exp(x) for eight lanes (Cephes expf: range reduction by ln 2, degree-5 polynomial, about
// 1 ulp); lanes below kExpFloor (and -inf) give exactly 0. Pure lane-wise arithmetic, so a
// slot's value does not depend on its neighbours.
inline __m256 exp8(__m256 x) {
  const __m256 hidden = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(kExpFloor), x);  // this operand order lets NaN through
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(hidden, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

// p_i[j] <- exp(p_i[j] - m) over [0, padded) in blocks of eight slots; returns their sum with
// one lane per j mod 8 (see the top of the file for why that order is batch-invariant).
inline float softmax_weights(float* p, int64_t padded, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += kLanes) {
    const __m256 pj = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, pj);
    sum = _mm256_add_ps(sum, pj);
  }
  return hsum(sum);
}

// What Q heads of one query row read: their queries, the pages, their sequence's slots, and
// where their weights and sums go.
template <typename T>
struct Heads {
  const float* q;         // [Q, D] float32, each arranged for T (see arrange)
  const T* k;             // the KV head's row in slot 0: slot s starts at k + s * slot_stride
  const T* v;
  int64_t slot_stride;    // Hkv * D
  const int64_t* gather;  // [kv_len] flat pool slots
  int64_t kv_len;
  const bool* visible;    // [kv_len], or nullptr when every slot < kv_len is visible
  float sm_scale;
  int64_t D;
  float* p;               // [Q, padded] scratch: scores, then softmax weights
  int64_t padded;         // kv_len rounded up to a multiple of 8
  float* acc;             // [Q, D] scratch: the weighted sums, arranged
  int64_t* ranked;        // [kv_len] scratch: the pool slots of the visible slots, in order
};

// Whether any of Q heads gives slot j a non-zero weight (p: [Q, padded]).
template <int Q>
inline bool weighed(const float* p, int64_t padded, int64_t j) {
  bool any = false;
  for (int i = 0; i < Q; ++i) any |= p[i * padded + j] != 0.0f;
  return any;
}

// acc_i[d0 .. d0 + 16 NB) = sum over slots j ascending of p_i[j] * v_j (arranged), for Q
// heads: each V block is loaded once for all of them. One FMA chain per element, so blocking
// over d changes nothing. Slots every head weighs 0 (hidden, or underflowed) are skipped; a 0
// weight beside non-zero ones adds 0 * v_j, an exact no-op (a sum that starts at +0 never
// becomes -0), so a head's sums are what they would be alone.
template <typename T, int Q, int NB>
void weighted_blocks(const Heads<T>& h, int64_t d0) {
  __m256 a[Q][2 * NB];
#pragma GCC unroll 4
  for (int i = 0; i < Q; ++i)
    for (int c = 0; c < 2 * NB; ++c) a[i][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < h.kv_len; ++j) {
    if (!weighed<Q>(h.p, h.padded, j)) continue;
    const T* vj = h.v + h.gather[j] * h.slot_stride + d0;
#pragma GCC unroll 4
    for (int c = 0; c < NB; ++c) {
      __m256 x, y;
      Load<T>::sixteen(vj + c * kBlock, x, y);
#pragma GCC unroll 4
      for (int i = 0; i < Q; ++i) {
        const __m256 pj = _mm256_set1_ps(h.p[i * h.padded + j]);
        a[i][2 * c] = _mm256_fmadd_ps(pj, x, a[i][2 * c]);
        a[i][2 * c + 1] = _mm256_fmadd_ps(pj, y, a[i][2 * c + 1]);
      }
    }
  }
  for (int i = 0; i < Q; ++i)
    for (int c = 0; c < 2 * NB; ++c) _mm256_storeu_ps(h.acc + i * h.D + d0 + c * kLanes, a[i][c]);
}

// The same for what D leaves after the last whole block: eight elements (in order), then one
// at a time.
template <typename T, int Q>
void weighted_tail(const Heads<T>& h, int64_t d) {
  if (d + kLanes <= h.D) {
    __m256 a[Q];
    for (int i = 0; i < Q; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < h.kv_len; ++j) {
      if (!weighed<Q>(h.p, h.padded, j)) continue;
      const __m256 x = Load<T>::eight(h.v + h.gather[j] * h.slot_stride + d);
      for (int i = 0; i < Q; ++i)
        a[i] = _mm256_fmadd_ps(_mm256_set1_ps(h.p[i * h.padded + j]), x, a[i]);
    }
    for (int i = 0; i < Q; ++i) _mm256_storeu_ps(h.acc + i * h.D + d, a[i]);
    d += kLanes;
  }
  for (; d < h.D; ++d)
    for (int i = 0; i < Q; ++i) {
      float a = 0.0f;
      for (int64_t j = 0; j < h.kv_len; ++j)
        if (weighed<Q>(h.p, h.padded, j))
          a = std::fma(h.p[i * h.padded + j], Load<T>::one(h.v + h.gather[j] * h.slot_stride + d),
                       a);
      h.acc[i * h.D + d] = a;
    }
}

// The outputs of Q heads of one row, [Q, D] float32 at out.
template <typename T, int Q>
void attend(const Heads<T>& all, float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Only the visible slots, in order: from here on a slot's index is its rank among them.
  Heads<T> h = all;
  if (all.visible != nullptr) {
    int64_t n = 0;
    for (int64_t j = 0; j < all.kv_len; ++j)
      if (all.visible[j]) all.ranked[n++] = all.gather[j];
    h.gather = all.ranked;
    h.kv_len = n;
    h.visible = nullptr;
  }
  float m[Q], s[Q];
  for (int i = 0; i < Q; ++i) m[i] = neg_inf;
  for (int64_t j = 0; j < h.kv_len; ++j) {
    dots<T, Q>(h.q, h.k + h.gather[j] * h.slot_stride, h.D, s);
    for (int i = 0; i < Q; ++i) {
      h.p[i * h.padded + j] = h.sm_scale * s[i];
      m[i] = std::max(m[i], h.p[i * h.padded + j]);
    }
  }
  float l[Q];
  for (int i = 0; i < Q; ++i) {
    std::fill(h.p + i * h.padded + h.kv_len, h.p + (i + 1) * h.padded, neg_inf);
    l[i] = softmax_weights(h.p + i * h.padded, h.padded, m[i]);  // >= 1: exp(0) at the maximum
  }

  constexpr int NB = Q == 1 ? 4 : Q == 2 ? 3 : 2;  // at most 12 accumulators
  int64_t d = 0;
  for (; d + NB * kBlock <= h.D; d += NB * kBlock) weighted_blocks<T, Q, NB>(h, d);
  for (; d + kBlock <= h.D; d += kBlock) weighted_blocks<T, Q, 1>(h, d);
  weighted_tail<T, Q>(h, d);
  for (int i = 0; i < Q; ++i) {
    for (d = 0; d < h.D; ++d) h.acc[i * h.D + d] /= l[i];
    arrange<T, true>(h.acc + i * h.D, out + i * h.D, h.D);
  }
}

// Shape and dtype errors raise TypeError/ValueError in Python, like the package's own checks.
void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "paged_attention: ", name, " must be on the CPU");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "paged_attention: ", name,
                   " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, "paged_attention: ", name, " must be ", dim, "-D, got ",
                    t.sizes());
}

bool is_attention_dtype(c10::ScalarType s) {
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

void check_tensors(const at::Tensor& q, const at::Tensor& k_slots,
                   const at::Tensor& v_slots) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k_slots.device().is_cpu() && v_slots.device().is_cpu(),
                    "paged_attention: q, k_slots and v_slots must be on the CPU");
  TORCH_CHECK_TYPE(is_attention_dtype(q.scalar_type()),
                   "paged_attention: q must be float32, bfloat16 or float16, got ",
                   q.scalar_type());
  TORCH_CHECK_TYPE(is_attention_dtype(k_slots.scalar_type()),
                   "paged_attention: k_slots must be float32, bfloat16 or float16, got ",
                   k_slots.scalar_type());
  TORCH_CHECK_TYPE(v_slots.scalar_type() == k_slots.scalar_type(),
                   "paged_attention: v_slots and k_slots must share a dtype, got ",
                   v_slots.scalar_type(), " and ", k_slots.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3, "paged_attention: q must be [T, Hq, D], got ", q.sizes());
  TORCH_CHECK_VALUE(k_slots.dim() == 3, "paged_attention: k_slots must be [S, Hkv, D], got ",
                    k_slots.sizes());
  TORCH_CHECK_VALUE(v_slots.sizes() == k_slots.sizes(), "paged_attention: v_slots ",
                    v_slots.sizes(), " must have the shape of k_slots ", k_slots.sizes());
  TORCH_CHECK_VALUE(k_slots.is_contiguous() && v_slots.is_contiguous(),
                    "paged_attention: k_slots and v_slots must be contiguous");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_slots.size(1);
  TORCH_CHECK_VALUE(D >= 1 && k_slots.size(2) == D, "paged_attention: the head_dim of q (", D,
                    ") and of k_slots (", k_slots.size(2), ") must agree and be positive");
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, "paged_attention: Hq (", Hq,
                    ") must be a multiple of Hkv (", Hkv, ")");
}

void check_metadata(int64_t T, const at::Tensor& row_seq, const at::Tensor& row_index,
                    const at::Tensor& kv_gather, const at::Tensor& kv_lens,
                    const c10::optional<at::Tensor>& mask) {
  check_index(row_seq, "row_seq", 1);
  check_index(row_index, "row_index", 1);
  check_index(kv_gather, "kv_gather", 2);
  check_index(kv_lens, "kv_lens", 1);
  TORCH_CHECK_VALUE(row_seq.size(0) == T && row_index.size(0) == T,
                    "paged_attention: row_seq and row_index must have one entry per query row (",
                    T, "), got ", row_seq.size(0), " and ", row_index.size(0));
  const int64_t B = kv_gather.size(0), max_kv = kv_gather.size(1);
  TORCH_CHECK_VALUE(kv_lens.size(0) == B,
                    "paged_attention: kv_lens must have one entry per sequence (", B, "), got ",
                    kv_lens.size(0));
  if (!mask.has_value()) return;
  TORCH_CHECK_VALUE(mask->device().is_cpu(), "paged_attention: mask must be on the CPU");
  TORCH_CHECK_TYPE(mask->scalar_type() == at::kBool, "paged_attention: mask must be bool, got ",
                   mask->scalar_type());
  TORCH_CHECK_VALUE(mask->dim() == 4 && mask->size(0) == B && mask->size(1) == 1 &&
                        mask->size(3) == max_kv,
                    "paged_attention: mask must be [B, 1, max_q, max_kv] = [", B, ", 1, max_q, ",
                    max_kv, "], got ", mask->sizes());
}

// Every index is checked before any work starts: an out-of-range slot would read outside the
// pool, and a row with no visible slot would divide 0 by 0. Index tensors are contiguous here.
void check_indices(int64_t S, const at::Tensor& row_seq, const at::Tensor& row_index,
                   const at::Tensor& kv_gather, const at::Tensor& kv_lens,
                   const c10::optional<at::Tensor>& mask) {
  const int64_t T = row_seq.size(0), B = kv_gather.size(0), max_kv = kv_gather.size(1);
  const int64_t max_q = mask.has_value() ? mask->size(2) : 0;
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t* gather = kv_gather.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 1 && lens[b] <= max_kv, "paged_attention: kv_lens[", b,
                      "] = ", lens[b], " must lie in [1, ", max_kv, "]");
    for (int64_t j = 0; j < lens[b]; ++j) {
      const int64_t slot = gather[b * max_kv + j];
      TORCH_CHECK_VALUE(slot >= 0 && slot < S, "paged_attention: kv_gather[", b, ", ", j,
                        "] = ", slot, " is outside the pool of ", S, " slots");
    }
  }
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* index = row_index.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = seq[t], r = index[t];
    TORCH_CHECK_VALUE(b >= 0 && b < B, "paged_attention: row_seq[", t, "] = ", b,
                      " must lie in [0, ", B, ")");
    TORCH_CHECK_VALUE(r >= 0, "paged_attention: row_index[", t, "] = ", r, " must be >= 0");
    if (!mask.has_value()) continue;
    TORCH_CHECK_VALUE(r < max_q, "paged_attention: row_index[", t, "] = ", r,
                      " must be below the mask's max_q (", max_q, ")");
    const bool* row = mask->data_ptr<bool>() + (b * max_q + r) * max_kv;
    TORCH_CHECK_VALUE(std::find(row, row + lens[b], true) != row + lens[b],
                      "paged_attention: query row ", t, " (sequence ", b, ", row ", r,
                      ") sees no KV slot");
  }
}

template <typename T>
void run_all(const at::Tensor& q32, const at::Tensor& k_slots, const at::Tensor& v_slots,
             const at::Tensor& row_seq, const at::Tensor& row_index,
             const at::Tensor& kv_gather, const at::Tensor& kv_lens,
             const c10::optional<at::Tensor>& mask, float sm_scale, at::Tensor& out) {
  const int64_t Hq = q32.size(1), D = q32.size(2), Hkv = k_slots.size(1);
  const int64_t group = Hq / Hkv, max_kv = kv_gather.size(1);
  const int64_t max_q = mask.has_value() ? mask->size(2) : 0;
  const float* qp = q32.data_ptr<float>();
  const T* kp = k_slots.data_ptr<T>();
  const T* vp = v_slots.data_ptr<T>();
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* index = row_index.data_ptr<int64_t>();
  const int64_t* gather = kv_gather.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t padded = (max_kv + kLanes - 1) / kLanes * kLanes;
  // The heads of a KV group go in chunks of up to kMaxHeads, sized as evenly as possible.
  const int64_t chunks = (group + kMaxHeads - 1) / kMaxHeads;

  // One task per (row, KV head, chunk of its query heads); each output is computed whole by
  // one thread, and the chunks depend on Hq and Hkv only, so neither the partition (the thread
  // count) nor the batch can change a result.
  at::parallel_for(0, q32.size(0) * Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(kMaxHeads * padded), acc(kMaxHeads * D), q(kMaxHeads * D);
    std::vector<int64_t> ranked(max_kv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (Hkv * chunks), g = task / chunks % Hkv, c = task % chunks;
      const int64_t Q = group / chunks + (c < group % chunks ? 1 : 0);
      const int64_t h0 = g * group + c * (group / chunks) + std::min(c, group % chunks);
      const int64_t b = seq[t], row = t * Hq + h0;
      for (int64_t i = 0; i < Q; ++i) arrange<T>(qp + (row + i) * D, q.data() + i * D, D);
      const Heads<T> heads{q.data(),
                           kp + g * D,
                           vp + g * D,
                           Hkv * D,
                           gather + b * max_kv,
                           lens[b],
                           mp == nullptr ? nullptr : mp + (b * max_q + index[t]) * max_kv,
                           sm_scale,
                           D,
                           p.data(),
                           (lens[b] + kLanes - 1) / kLanes * kLanes,
                           acc.data(),
                           ranked.data()};
      float* o = op + row * D;
      if (Q == 1) attend<T, 1>(heads, o);
      else if (Q == 2) attend<T, 2>(heads, o);
      else attend<T, 3>(heads, o);
    }
  });
}

}  // namespace

// q: [T, Hq, D]; k_slots, v_slots: [S, Hkv, D] (one layer's flat pool); row_seq, row_index: [T]
// int64 (each row's sequence b and its index among b's new rows); kv_gather: [B, max_kv] int64
// pool slot of each KV position; kv_lens: [B] int64; mask: [B, 1, max_q, max_kv] bool (True =
// visible) or None (every slot < kv_len visible). Returns [T, Hq, D] in q's dtype.
at::Tensor paged_attention(at::Tensor q, at::Tensor k_slots, at::Tensor v_slots,
                              at::Tensor row_seq, at::Tensor row_index,
                              at::Tensor kv_gather, at::Tensor kv_lens,
                              c10::optional<at::Tensor> mask, double sm_scale) {
  TORCH_CHECK_VALUE(std::isfinite(sm_scale), "paged_attention: sm_scale must be finite, got ",
                    sm_scale);
  check_tensors(q, k_slots, v_slots);
  check_metadata(q.size(0), row_seq, row_index, kv_gather, kv_lens, mask);
  const at::Tensor seq = row_seq.contiguous(), index = row_index.contiguous();
  const at::Tensor gather = kv_gather.contiguous(), lens = kv_lens.contiguous();
  c10::optional<at::Tensor> visible;
  if (mask.has_value()) visible = mask->contiguous();
  check_indices(k_slots.size(0), seq, index, gather, lens, visible);
  const at::Tensor q32 = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(q32.sizes(), q32.options());
  const float scale = static_cast<float>(sm_scale);
  switch (k_slots.scalar_type()) {
    case at::kBFloat16:
      run_all<at::BFloat16>(q32, k_slots, v_slots, seq, index, gather, lens, visible, scale, out);
      break;
    case at::kHalf:
      run_all<at::Half>(q32, k_slots, v_slots, seq, index, gather, lens, visible, scale, out);
      break;
    default:
      run_all<float>(q32, k_slots, v_slots, seq, index, gather, lens, visible, scale, out);
      break;
  }
  return out.to(q.scalar_type());
}
