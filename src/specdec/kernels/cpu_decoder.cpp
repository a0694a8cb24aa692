// Every decoder layer of a bf16 Llama-family model in one call from Python (CPU decoding).
//
// Why: the Python loop over layers (models/llama.py, _fused_layer_states) pays for each of its
// ~10 calls per layer in Python and pybind dispatch, and the weight stream of the linears evicts
// the interpreter's working set between them, so each call runs cold: measured on an Intel Xeon
// runner (2 threads, Qwen2.5-1.5B at q4) 7.9 ms of a 68 ms step went to norms, RoPE, the KV
// write and attention (whose kernels take ~1.5 ms), and each quantized linear cost ~20 us more
// from Python than the kernel alone. Here the same functions run in the same order on the same
// tensors, so the result is bitwise the Python loop's:
//
//   h, x  = add_rms_norm(h, delta, input_norm)          (cpu_layer_ops.cpp)
//   qkv   = linear(qkv_proj, x)
//   qkv   = q and k heads each add_rms_norm'ed            (Qwen3's q/k norms, where present)
//   q, k  = rope_qk(qkv);  v = qkv[:, q_size + kv_size:]
//   write k, v at slot_mapping in layer l's pages;       attn = paged_attention(q, pages)
//   h, x  = add_rms_norm(h, linear(o_proj, attn), post_attention_norm)
//   delta = linear(down_proj, silu_mul(linear(gate_up_proj, x)))   or, for a sparse layer,
//   delta = SparseMoe::forward(x)                        (cpu_moe.cpp: router and experts)
//
// and after the last layer h + delta. linear() is the packed bf16, int8 or 4-bit kernel with the
// mode its Python wrapper would pass (models/cpu_decoder.py builds the arguments).
//
// This file also holds the extension's bindings (at the end): it declares every other source's
// entry points anyway.
// The bindings are here. Not torch/extension.h (torch/all.h: autograd, nn, optim...): these two
// headers are all the bindings need, and the file parses in ~33 s instead of ~40.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_linear_call.h"
#include "cpu_moe.h"

// cpu_layer_ops.cpp
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta,
                                        torch::Tensor weight, double eps);
std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                   int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> add_rms_norm_f32w(torch::Tensor h, c10::optional<torch::Tensor> delta,
                                             torch::Tensor weight, double eps);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
// cpu_attention.cpp
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_slots, torch::Tensor v_slots,
                              torch::Tensor row_seq, torch::Tensor row_index,
                              torch::Tensor kv_gather, torch::Tensor kv_lens,
                              c10::optional<torch::Tensor> mask, double sm_scale);
// cpu_linear.cpp (the linear layers themselves: cpu_linear_call.h)
torch::Tensor packed_bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t N);
bool packed_has_bf16_dot();
int64_t read_stream(torch::Tensor t);
// cpu_quantized.cpp
bool quantized_has_vnni();
// cpu_moe.cpp: SparseMoe (cpu_moe.h)

namespace {

using specdec::LinearCall;

// K and V of the new rows into layer pages at their slots, as index_copy_ writes them (the
// Python path's write_kv). k: [T, Hkv, D] contiguous; v: rows of qkv (stride `v_stride`).
void write_kv(const torch::Tensor& k, const uint16_t* v, int64_t v_stride, const int64_t* slots,
              int64_t T, torch::Tensor& k_slots, torch::Tensor& v_slots) {
  const int64_t row = k_slots.size(1) * k_slots.size(2);  // Hkv * D
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  uint16_t* kd = reinterpret_cast<uint16_t*>(k_slots.data_ptr<at::BFloat16>());
  uint16_t* vd = reinterpret_cast<uint16_t*>(v_slots.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kd + slots[t] * row, kp + t * row, row * sizeof(uint16_t));
    std::memcpy(vd + slots[t] * row, v + t * v_stride, row * sizeof(uint16_t));
  }
}

// Per-head RMSNorm of q and k on the fused projection, v as it was: each head a row of `norm`
// (add_rms_norm: Qwen3, models/llama.py _norm_qk; add_rms_norm_f32w: Gemma 3, models/gemma.py
// _fused_norm_qk; the same calls).
using NormFn = std::vector<torch::Tensor> (*)(torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor, double);
torch::Tensor norm_qk(const torch::Tensor& qkv, const torch::Tensor& q_norm, const torch::Tensor& k_norm,
                      double eps, int64_t q_size, int64_t kv_size, int64_t D, NormFn norm) {
  const int64_t T = qkv.size(0);
  const auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
  const auto q = norm(parts[0].reshape({-1, D}).contiguous(), c10::nullopt, q_norm, eps);
  const auto k = norm(parts[1].reshape({-1, D}).contiguous(), c10::nullopt, k_norm, eps);
  return torch::cat({q[1].view({T, -1}), k[1].view({T, -1}), parts[2]}, -1);
}

// The checks every stack makes of its shared inputs; returns slot_mapping's data (contiguous).
const int64_t* check_stack_inputs(const char* who, const torch::Tensor& h, const torch::Tensor& cache,
                                  const torch::Tensor& slot_mapping, int64_t L, int64_t num_kv_heads,
                                  int64_t D, const std::vector<int64_t>& wanted) {
  const int64_t T = h.size(0);
  TORCH_CHECK_VALUE(h.dim() == 2 && h.scalar_type() == torch::kBFloat16 && h.is_contiguous(),
                    who, ": h must be contiguous bf16 [T, H]");
  TORCH_CHECK_VALUE(cache.scalar_type() == torch::kBFloat16 && cache.is_contiguous() &&
                        cache.dim() == 6 && cache.size(0) == L && cache.size(1) == 2 &&
                        cache.size(4) == num_kv_heads && cache.size(5) == D,
                    who, ": cache must be contiguous bf16 [L, 2, pages, page_size, Hkv, D]");
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                        slot_mapping.size(0) == T,
                    who, ": slot_mapping must be int64 [T]");
  for (int64_t i : wanted)
    TORCH_CHECK_VALUE(i >= 0 && i <= L, who, ": wanted layer ", i, " outside 0..", L);
  const int64_t num_slots = cache.size(2) * cache.size(3);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(sp[t] >= 0 && sp[t] < num_slots, who, ": slot_mapping[", t, "] = ", sp[t],
                      " is outside the pool of ", num_slots, " slots");
  return sp;
}

}  // namespace

// h: [T, H] bf16 (the embeddings); norms: 2 L bf16 [H] (input, post-attention per layer);
// qk_norms: empty, or 2 L bf16 [D] (Qwen3's per-head q and k norms of each layer, eps qk_eps);
// the six linear lists: qkv and o of each layer, then gate_up and down where its MLP is dense;
// moes: L entries, a layer's SparseMoe (its MLP; cpu_moe.h) or None (a dense MLP); cos, sin:
// [T, D] bf16; cache: [L, 2, pages, page_size, Hkv, D] bf16 (the model's KV pool); slot_mapping:
// [T] int64; row_seq .. sm_scale: as paged_attention; wanted: layer indices in 0..L whose input
// (L: the last layer's output) is returned, in the given order. Returns len(wanted) [T, H] bf16.
std::vector<torch::Tensor> decoder_layers(
    torch::Tensor h, const std::vector<torch::Tensor>& norms, double eps,
    const std::vector<torch::Tensor>& qk_norms, double qk_eps,
    const std::vector<int64_t>& kinds, const std::vector<torch::Tensor>& packed,
    const std::vector<c10::optional<torch::Tensor>>& scales,
    const std::vector<int64_t>& out_features,
    const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<int64_t>& modes,
    const std::vector<const SparseMoe*>& moes,
    torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, torch::Tensor cache, torch::Tensor slot_mapping, torch::Tensor row_seq,
    torch::Tensor row_index, torch::Tensor kv_gather, torch::Tensor kv_lens,
    c10::optional<torch::Tensor> mask, double sm_scale, const std::vector<int64_t>& wanted) {
  const int64_t L = static_cast<int64_t>(norms.size()) / 2, T = h.size(0);
  const int64_t D = head_dim, q_size = num_heads * D, kv_size = num_kv_heads * D;
  const std::vector<LinearCall> linears = specdec::read_linears("decoder_layers", kinds, packed, scales, out_features, biases, modes);
  int64_t dense = 0;
  for (const SparseMoe* moe : moes) dense += moe == nullptr;
  TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == 2 * L &&
                        static_cast<int64_t>(moes.size()) == L &&
                        static_cast<int64_t>(linears.size()) == 2 * L + 2 * dense,
                    "decoder_layers: 2 norms, one moes entry and 2 linears per layer, 2 more "
                    "linears per dense MLP expected");
  TORCH_CHECK_VALUE(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * L,
                    "decoder_layers: qk_norms must be empty or 2 per layer");
  const torch::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = check_stack_inputs("decoder_layers", h, cache, slots, L, num_kv_heads, D, wanted);
  const int64_t num_slots = cache.size(2) * cache.size(3);

  std::vector<bool> keep(L + 1, false);
  for (int64_t i : wanted) keep[i] = true;
  std::vector<torch::Tensor> inputs(L + 1);  // the residual stream entering the kept layers
  c10::optional<torch::Tensor> delta;        // still to be added to h (see _fused_layer_states)
  const LinearCall* lin = linears.data();  // the next layer's first linear
  for (int64_t l = 0; l < L; ++l) {
    auto hx = add_rms_norm(h, delta, norms[2 * l], eps);
    h = hx[0];
    if (keep[l]) inputs[l] = h;
    torch::Tensor qkv = lin[0](hx[1]);  // [T, (Hq + 2 Hkv) D]
    TORCH_CHECK_VALUE(qkv.size(1) == q_size + 2 * kv_size, "decoder_layers: qkv_proj of layer ",
                      l, " gives ", qkv.size(1), " features, the heads need ", q_size + 2 * kv_size);
    if (!qk_norms.empty()) qkv = norm_qk(qkv, qk_norms[2 * l], qk_norms[2 * l + 1], qk_eps, q_size, kv_size, D, add_rms_norm);
    const auto qk = rope_qk(qkv, cos, sin, num_heads, num_kv_heads, D);
    torch::Tensor k_slots = cache[l][0].view({num_slots, num_kv_heads, D});
    torch::Tensor v_slots = cache[l][1].view({num_slots, num_kv_heads, D});
    const uint16_t* v = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>()) + q_size + kv_size;
    write_kv(qk[1], v, qkv.size(1), sp, T, k_slots, v_slots);
    const torch::Tensor attn = paged_attention(qk[0], k_slots, v_slots, row_seq, row_index,
                                               kv_gather, kv_lens, mask, sm_scale);
    hx = add_rms_norm(h, lin[1](attn.view({T, q_size})), norms[2 * l + 1], eps);
    h = hx[0];
    if (moes[l] != nullptr) {
      delta = moes[l]->forward(hx[1]);
      lin += 2;
    } else {
      delta = lin[3](silu_mul(lin[2](hx[1])));
      lin += 4;
    }
  }
  inputs[L] = delta.has_value() ? h + *delta : h;
  std::vector<torch::Tensor> out;
  out.reserve(wanted.size());
  for (int64_t i : wanted) out.push_back(inputs[i]);
  return out;
}

// Gemma 2 / Gemma 3 layers (models/gemma.py, fused_layer_states), the same calls in the same order:
//
//   h, x  = add_rms_norm_f32w(h, delta, input_norm)      (1 + w in float32: Gemma's RMSNorm)
//   qkv   = linear(qkv_proj, x);  Gemma 3: q and k heads each add_rms_norm_f32w'ed
//   q, k  = rope_qk(qkv, layer l's cos, sin);  write k, v;  attn = paged_attention(layer l's plan)
//   a     = add_rms_norm_f32w(linear(o_proj, attn), none, post_attention_norm).normed
//   h, x  = add_rms_norm_f32w(h, a, pre_feedforward_norm)
//   delta = add_rms_norm_f32w(linear(down, gelu_tanh_mul(linear(gate_up, x))), none, post_ff).normed
//
// factors: 4 L float32 [H] (1 + w of the input, post-attention, pre- and post-feedforward norms);
// qk_factors: empty or 2 L float32 [D]; linears: 4 per layer (qkv, o, gate_up, down); cos, sin and
// the attention arguments (row_seq .. sm_scales): one entry per layer, that layer's RoPE and plan
// (sliding and global layers differ). Gemma 2's capped scores are not the kernel's: the caller
// keeps those models on the Python loop.
std::vector<torch::Tensor> gemma_layers(
    torch::Tensor h, const std::vector<torch::Tensor>& factors,
    const std::vector<torch::Tensor>& qk_factors, double eps, double qk_eps,
    const std::vector<int64_t>& kinds, const std::vector<torch::Tensor>& packed,
    const std::vector<c10::optional<torch::Tensor>>& scales,
    const std::vector<int64_t>& out_features,
    const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<int64_t>& modes,
    const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, torch::Tensor cache,
    torch::Tensor slot_mapping, const std::vector<torch::Tensor>& row_seq,
    const std::vector<torch::Tensor>& row_index, const std::vector<torch::Tensor>& kv_gather,
    const std::vector<torch::Tensor>& kv_lens, const std::vector<c10::optional<torch::Tensor>>& masks,
    const std::vector<double>& sm_scales, const std::vector<int64_t>& wanted) {
  const int64_t L = static_cast<int64_t>(factors.size()) / 4, T = h.size(0);
  const int64_t D = head_dim, q_size = num_heads * D, kv_size = num_kv_heads * D;
  const std::vector<LinearCall> lin = specdec::read_linears("gemma_layers", kinds, packed, scales, out_features, biases, modes);
  const auto per_layer = [L](size_t n) { return static_cast<int64_t>(n) == L; };
  TORCH_CHECK_VALUE(static_cast<int64_t>(factors.size()) == 4 * L && static_cast<int64_t>(lin.size()) == 4 * L &&
                        per_layer(cos.size()) && per_layer(sin.size()) && per_layer(row_seq.size()) &&
                        per_layer(row_index.size()) && per_layer(kv_gather.size()) &&
                        per_layer(kv_lens.size()) && per_layer(masks.size()) && per_layer(sm_scales.size()),
                    "gemma_layers: 4 norms, 4 linears and one RoPE and attention plan per layer expected");
  TORCH_CHECK_VALUE(qk_factors.empty() || static_cast<int64_t>(qk_factors.size()) == 2 * L,
                    "gemma_layers: qk_factors must be empty or 2 per layer");
  const torch::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = check_stack_inputs("gemma_layers", h, cache, slots, L, num_kv_heads, D, wanted);
  const int64_t num_slots = cache.size(2) * cache.size(3);
  std::vector<bool> keep(L + 1, false);
  for (int64_t i : wanted) keep[i] = true;
  std::vector<torch::Tensor> inputs(L + 1);
  c10::optional<torch::Tensor> delta;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* f = factors.data() + 4 * l;
    const LinearCall* ln = lin.data() + 4 * l;
    auto hx = add_rms_norm_f32w(h, delta, f[0], eps);
    h = hx[0];
    if (keep[l]) inputs[l] = h;
    torch::Tensor qkv = ln[0](hx[1]);
    TORCH_CHECK_VALUE(qkv.size(1) == q_size + 2 * kv_size, "gemma_layers: qkv_proj of layer ", l,
                      " gives ", qkv.size(1), " features, the heads need ", q_size + 2 * kv_size);
    if (!qk_factors.empty())
      qkv = norm_qk(qkv, qk_factors[2 * l], qk_factors[2 * l + 1], qk_eps, q_size, kv_size, D, add_rms_norm_f32w);
    const auto qk = rope_qk(qkv, cos[l], sin[l], num_heads, num_kv_heads, D);
    torch::Tensor k_slots = cache[l][0].view({num_slots, num_kv_heads, D});
    torch::Tensor v_slots = cache[l][1].view({num_slots, num_kv_heads, D});
    const uint16_t* v = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>()) + q_size + kv_size;
    write_kv(qk[1], v, qkv.size(1), sp, T, k_slots, v_slots);
    const torch::Tensor attn = paged_attention(qk[0], k_slots, v_slots, row_seq[l], row_index[l],
                                               kv_gather[l], kv_lens[l], masks[l], sm_scales[l]);
    const torch::Tensor a = add_rms_norm_f32w(ln[1](attn.view({T, q_size})), c10::nullopt, f[1], eps)[1];
    hx = add_rms_norm_f32w(h, a, f[2], eps);
    h = hx[0];
    delta = add_rms_norm_f32w(ln[3](gelu_tanh_mul(ln[2](hx[1]))), c10::nullopt, f[3], eps)[1];
  }
  inputs[L] = delta.has_value() ? h + *delta : h;
  std::vector<torch::Tensor> out;
  out.reserve(wanted.size());
  for (int64_t i : wanted) out.push_back(inputs[i]);
  return out;
}

// One extension for all six sources (kernels/cpu_linear.py builds it); its functions by source.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // cpu_layer_ops.cpp, cpu_attention.cpp: the steps of a layer
  m.def("add_rms_norm", &add_rms_norm, "bf16 residual add + RMSNorm");
  m.def("rope_qk", &rope_qk, "bf16 rotate-half RoPE of q and k from the fused qkv projection");
  m.def("silu_mul", &silu_mul, "bf16 silu(gate) * up");
  m.def("add_rms_norm_f32w", &add_rms_norm_f32w, "bf16 residual add + RMSNorm times a float32 weight, rounded once");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "bf16 gelu_tanh(gate) * up");
  m.def("paged_attention", &paged_attention, "float32 paged attention with a fixed reduction order");
  // cpu_linear.cpp: packed bf16 weights
  m.def("packed_linear_layer", &packed_linear_layer,
        "packed_bf16_linear (or its AVX512-BF16 path) + optional float32 bias and rounding to bfloat16");
  m.def("packed_bf16_linear", &packed_bf16_linear, "float32 activations x packed bf16 weights (AVX2/FMA)");
  m.def("packed_has_bf16_dot", &packed_has_bf16_dot, "whether packed_linear_layer can take its AVX512-BF16 path");
  m.def("read_stream", &read_stream, "read a tensor once (bandwidth probe); returns a checksum");
  // cpu_quantized.cpp: int8 and 4-bit weights, int8 activations per group
  m.def("q4_linear_layer", &q4_linear_layer, "activations x packed 4-bit weights");
  m.def("int8_linear_layer", &int8_linear_layer, "activations x packed int8 weights");
  m.def("q4_grouped_linear", &q4_grouped_linear, "one row x each of several 4-bit weights, in one pass");
  m.def("int8_grouped_linear", &int8_grouped_linear, "one row x each of several int8 weights, in one pass");
  m.def("quantized_has_vnni", &quantized_has_vnni, "whether the int8 / q4 kernels can use AVX512-VNNI");
  // cpu_moe.cpp
  pybind11::class_<SparseMoe>(m, "SparseMoe", "a sparse mixture-of-experts MLP (router + experts)")
      .def(pybind11::init<const std::vector<int64_t>&, const std::vector<torch::Tensor>&,
                          const std::vector<c10::optional<torch::Tensor>>&, const std::vector<int64_t>&,
                          const std::vector<c10::optional<torch::Tensor>>&, const std::vector<int64_t>&,
                          int64_t, bool>())
      .def("forward", &SparseMoe::forward, "[T, H] bf16 -> [T, H] bf16, in one call");
  // this file
  m.def("decoder_layers", &decoder_layers, "every decoder layer of a bf16 model in one call");
  m.def("gemma_layers", &gemma_layers, "every Gemma decoder layer of a bf16 model in one call");
}
