// Gemma 3's decoder layer (`engine.models.gemma3.Gemma3Layer`) as one op, made of the other files' kernels.

#include "common.h"

namespace {

// x += y, row-major rows of the same shape (the per-op path's `x + y`: the same sums)
void add_rows(at::Tensor& x, const at::Tensor& y) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.numel(), 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) xp[i] += yp[i];
  });
}

// One Gemma 3 layer for a packed step, in place of x: h = norm(x); x += norm(attention(h)); h = norm(x);
// x += norm(down(gelu_tanh(gate) * up)), each norm's weight already (1 + w). The same kernels and ATen
// ops in the same order as the per-op path (GELU and its product by ATen itself), so the same result
// bit for bit, without ~15 Python-level calls a layer. Adapters as in decoder_layer.
void gemma_layer(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& input_norm,
                 const at::Tensor& qkv_panels, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& q_norm,
                 const at::Tensor& k_norm, const at::Tensor& o_panels, const c10::optional<at::Tensor>& o_bias,
                 const at::Tensor& post_attention_norm, const at::Tensor& pre_feedforward_norm,
                 const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                 const c10::optional<at::Tensor>& down_bias, const at::Tensor& post_feedforward_norm,
                 at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_decodes,
                 const c10::optional<at::Tensor>& decode_block_tables,
                 const c10::optional<at::Tensor>& decode_context_lens, at::IntArrayRef prefill_bounds,
                 at::TensorList prefill_tables, int64_t num_heads, double eps, int64_t block_size, double scale,
                 int64_t sliding_window, at::TensorList lora_weights, at::IntArrayRef lora_slices) {
  check_float(x, "gemma_layer x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous());
  const int64_t T = x.size(0);
  at::Tensor h = at::empty_like(x);
  rms_norm(h, x, input_norm, eps);
  at::Tensor o = attention_block(h, cos, sin, qkv_panels, qkv_bias, q_norm, k_norm, o_panels, o_bias, k_cache,
                                 v_cache, slot_mapping, num_decodes, decode_block_tables, decode_context_lens,
                                 prefill_bounds, prefill_tables, num_heads, eps, block_size, scale, sliding_window,
                                 lora_weights, lora_slices);
  rms_norm(h, o, post_attention_norm, eps);
  add_rows(x, h);
  rms_norm(h, x, pre_feedforward_norm, eps);
  const int64_t I = panel_inputs(down);
  at::Tensor gu = at::empty({T, 2 * I}, x.options());
  panel_linear(gu, h, gate_up, gate_up_bias);
  add_lora(gu, h, 2, lora_weights, lora_slices);
  at::Tensor act = at::gelu(gu.narrow(1, 0, I), "tanh") * gu.narrow(1, I, I);
  panel_linear(o, act, down, down_bias);
  add_lora(o, act, 3, lora_weights, lora_slices);
  rms_norm(h, o, post_feedforward_norm, eps);
  add_rows(x, h);
}

}  // namespace
