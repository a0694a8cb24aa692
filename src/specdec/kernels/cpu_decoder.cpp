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
//   qkv   = linear(qkv_proj, x);  q, k = rope_qk(qkv)     v = qkv[:, q_size + kv_size:]
//   write k, v at slot_mapping in layer l's pages;       attn = paged_attention(q, pages)
//   h, x  = add_rms_norm(h, linear(o_proj, attn), post_attention_norm)
//   delta = linear(down_proj, silu_mul(linear(gate_up_proj, x)))
//
// and after the last layer h + delta. linear() is the packed bf16, int8 or 4-bit kernel with the
// mode its Python wrapper would pass (models/cpu_decoder.py builds the arguments).
//
// This file also holds the extension's bindings (at the end): it declares every other source's
// entry points anyway.
#include <torch/extension.h>  // the bindings are here (the other sources include torch/types.h)

#include <cstdint>
#include <cstring>
#include <vector>

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
// cpu_linear.cpp
torch::Tensor packed_linear_layer(torch::Tensor x, torch::Tensor packed, int64_t N,
                                  c10::optional<torch::Tensor> bias, bool out_bf16, int64_t bf16_dot);
torch::Tensor packed_bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t N);
bool packed_has_bf16_dot();
int64_t read_stream(torch::Tensor t);
// cpu_quantized.cpp
torch::Tensor q4_linear_layer(torch::Tensor x, torch::Tensor packed, int64_t N,
                              c10::optional<torch::Tensor> bias, bool out_bf16, int64_t use_vnni);
torch::Tensor int8_linear_layer(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                                int64_t N, c10::optional<torch::Tensor> bias, bool out_bf16,
                                int64_t use_vnni);
bool quantized_has_vnni();

namespace {

constexpr int64_t kLinearsPerLayer = 4;  // qkv_proj, o_proj, gate_up_proj, down_proj
enum LinearKind : int64_t { kPackedBf16 = 0, kInt8 = 1, kQ4 = 2 };

// One linear layer's kernel arguments (see models/cpu_decoder.py, kernel_args()).
struct Linear {
  int64_t kind;
  torch::Tensor packed;
  c10::optional<torch::Tensor> scale;  // int8 only
  int64_t out_features;
  c10::optional<torch::Tensor> bias;
  int64_t mode;  // bf16_dot for packed bf16, use_vnni for int8 / q4

  torch::Tensor operator()(const torch::Tensor& x) const {  // [T, in] bf16 -> [T, out] bf16
    switch (kind) {
      case kPackedBf16: return packed_linear_layer(x, packed, out_features, bias, true, mode);
      case kInt8: return int8_linear_layer(x, packed, *scale, out_features, bias, true, mode);
      default: return q4_linear_layer(x, packed, out_features, bias, true, mode);
    }
  }
};

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

std::vector<Linear> read_linears(const std::vector<int64_t>& kinds,
                                 const std::vector<torch::Tensor>& packed,
                                 const std::vector<c10::optional<torch::Tensor>>& scales,
                                 const std::vector<int64_t>& out_features,
                                 const std::vector<c10::optional<torch::Tensor>>& biases,
                                 const std::vector<int64_t>& modes) {
  const size_t n = kinds.size();
  TORCH_CHECK_VALUE(packed.size() == n && scales.size() == n && out_features.size() == n &&
                        biases.size() == n && modes.size() == n,
                    "decoder_layers: the linear argument lists must have one entry per linear");
  std::vector<Linear> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(kinds[i] >= kPackedBf16 && kinds[i] <= kQ4, "decoder_layers: kinds[", i,
                      "] = ", kinds[i], " must be 0 (packed bf16), 1 (int8) or 2 (q4)");
    TORCH_CHECK_VALUE(kinds[i] != kInt8 || scales[i].has_value(), "decoder_layers: int8 linear ",
                      i, " needs its scale");
    out.push_back({kinds[i], packed[i], scales[i], out_features[i], biases[i], modes[i]});
  }
  return out;
}

}  // namespace

// h: [T, H] bf16 (the embeddings); norms: 2 L bf16 [H] (input, post-attention per layer);
// the six linear lists: 4 L entries (qkv, o, gate_up, down per layer); cos, sin: [T, D] bf16;
// cache: [L, 2, pages, page_size, Hkv, D] bf16 (the model's KV pool); slot_mapping: [T] int64;
// row_seq .. sm_scale: as paged_attention; wanted: layer indices in 0..L whose input (L: the
// last layer's output) is returned, in the given order. Returns len(wanted) [T, H] bf16 tensors.
std::vector<torch::Tensor> decoder_layers(
    torch::Tensor h, const std::vector<torch::Tensor>& norms, double eps,
    const std::vector<int64_t>& kinds, const std::vector<torch::Tensor>& packed,
    const std::vector<c10::optional<torch::Tensor>>& scales,
    const std::vector<int64_t>& out_features,
    const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<int64_t>& modes,
    torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, torch::Tensor cache, torch::Tensor slot_mapping, torch::Tensor row_seq,
    torch::Tensor row_index, torch::Tensor kv_gather, torch::Tensor kv_lens,
    c10::optional<torch::Tensor> mask, double sm_scale, const std::vector<int64_t>& wanted) {
  const int64_t L = static_cast<int64_t>(norms.size()) / 2, T = h.size(0);
  const int64_t D = head_dim, q_size = num_heads * D, kv_size = num_kv_heads * D;
  const std::vector<Linear> linears = read_linears(kinds, packed, scales, out_features, biases, modes);
  TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == 2 * L &&
                        static_cast<int64_t>(linears.size()) == kLinearsPerLayer * L,
                    "decoder_layers: 2 norms and 4 linears per layer expected");
  TORCH_CHECK_VALUE(h.dim() == 2 && h.scalar_type() == torch::kBFloat16 && h.is_contiguous(),
                    "decoder_layers: h must be contiguous bf16 [T, H]");
  TORCH_CHECK_VALUE(cache.scalar_type() == torch::kBFloat16 && cache.is_contiguous() &&
                        cache.dim() == 6 && cache.size(0) == L && cache.size(1) == 2 &&
                        cache.size(4) == num_kv_heads && cache.size(5) == D,
                    "decoder_layers: cache must be contiguous bf16 [L, 2, pages, page_size, Hkv, D]");
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                        slot_mapping.size(0) == T,
                    "decoder_layers: slot_mapping must be int64 [T]");
  for (int64_t i : wanted)
    TORCH_CHECK_VALUE(i >= 0 && i <= L, "decoder_layers: wanted layer ", i, " outside 0..", L);
  const torch::Tensor slots = slot_mapping.contiguous();
  const int64_t num_slots = cache.size(2) * cache.size(3);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(sp[t] >= 0 && sp[t] < num_slots, "decoder_layers: slot_mapping[", t,
                      "] = ", sp[t], " is outside the pool of ", num_slots, " slots");

  std::vector<bool> keep(L + 1, false);
  for (int64_t i : wanted) keep[i] = true;
  std::vector<torch::Tensor> inputs(L + 1);  // the residual stream entering the kept layers
  c10::optional<torch::Tensor> delta;        // still to be added to h (see _fused_layer_states)
  for (int64_t l = 0; l < L; ++l) {
    auto hx = add_rms_norm(h, delta, norms[2 * l], eps);
    h = hx[0];
    if (keep[l]) inputs[l] = h;
    const Linear* lin = linears.data() + kLinearsPerLayer * l;
    const torch::Tensor qkv = lin[0](hx[1]);  // [T, (Hq + 2 Hkv) D]
    TORCH_CHECK_VALUE(qkv.size(1) == q_size + 2 * kv_size, "decoder_layers: qkv_proj of layer ",
                      l, " gives ", qkv.size(1), " features, the heads need ", q_size + 2 * kv_size);
    const auto qk = rope_qk(qkv, cos, sin, num_heads, num_kv_heads, D);
    torch::Tensor k_slots = cache[l][0].view({num_slots, num_kv_heads, D});
    torch::Tensor v_slots = cache[l][1].view({num_slots, num_kv_heads, D});
    const uint16_t* v = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>()) + q_size + kv_size;
    write_kv(qk[1], v, qkv.size(1), sp, T, k_slots, v_slots);
    const torch::Tensor attn = paged_attention(qk[0], k_slots, v_slots, row_seq, row_index,
                                               kv_gather, kv_lens, mask, sm_scale);
    hx = add_rms_norm(h, lin[1](attn.view({T, q_size})), norms[2 * l + 1], eps);
    h = hx[0];
    delta = lin[3](silu_mul(lin[2](hx[1])));
  }
  inputs[L] = delta.has_value() ? h + *delta : h;
  std::vector<torch::Tensor> out;
  out.reserve(wanted.size());
  for (int64_t i : wanted) out.push_back(inputs[i]);
  return out;
}

// One extension for all five sources (kernels/cpu_linear.py builds it); its functions by source.
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
  m.def("quantized_has_vnni", &quantized_has_vnni, "whether the int8 / q4 kernels can use AVX512-VNNI");
  // this file
  m.def("decoder_layers", &decoder_layers, "every decoder layer of a bf16 model in one call");
}
