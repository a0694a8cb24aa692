// Paged attention for CPUs in float32 with a fixed reduction order (in progress: not called yet).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_slots, torch::Tensor v_slots,
                              torch::Tensor row_seq, torch::Tensor row_index,
                              torch::Tensor kv_gather, torch::Tensor kv_lens,
                              c10::optional<torch::Tensor> mask, double sm_scale) {
  TORCH_CHECK(false, "paged_attention: not implemented yet");
}
