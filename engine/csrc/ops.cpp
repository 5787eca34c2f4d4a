// The library's torch ops: their schemas under the namespace galley_cpu (torch.ops.galley_cpu) and
// their CPU implementations, declared in common.h.

#include "common.h"

TORCH_LIBRARY(galley_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, int block_size, float scale, int sliding_window) -> ()");
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int start, int block_size, float scale, int sliding_window) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  m.def("silu_mlp(Tensor(a!) out, Tensor x, Tensor gate_up, Tensor? gate_up_bias, Tensor down, "
        "Tensor? down_bias) -> ()");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor shrink, Tensor expand, Tensor parts, int start, int end) -> ()");
  m.def("moe_mlp(Tensor(a!) out, Tensor x, Tensor router, Tensor[] experts, int top_k, bool normalize) -> ()");
  m.def("decoder_layer(Tensor(a!) x, Tensor(b!) residual, Tensor cos, Tensor sin, Tensor input_norm, "
        "Tensor qkv_panels, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, Tensor o_panels, Tensor? o_bias, "
        "Tensor post_norm, Tensor? gate_up, Tensor? gate_up_bias, Tensor? down, Tensor? down_bias, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, int num_decodes, Tensor? decode_block_tables, "
        "Tensor? decode_context_lens, int[] prefill_bounds, Tensor[] prefill_tables, int num_heads, float eps, "
        "int block_size, float scale, int sliding_window, Tensor[] lora_weights, int[] lora_slices, Tensor? router, "
        "Tensor[] experts, int experts_per_token, bool normalize_experts) -> ()");
  m.def("gemma_layer(Tensor(a!) x, Tensor cos, Tensor sin, Tensor input_norm, Tensor qkv_panels, Tensor? qkv_bias, "
        "Tensor q_norm, Tensor k_norm, Tensor o_panels, Tensor? o_bias, Tensor post_attention_norm, "
        "Tensor pre_feedforward_norm, Tensor gate_up, Tensor? gate_up_bias, Tensor down, Tensor? down_bias, "
        "Tensor post_feedforward_norm, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_decodes, "
        "Tensor? decode_block_tables, Tensor? decode_context_lens, int[] prefill_bounds, Tensor[] prefill_tables, "
        "int num_heads, float eps, int block_size, float scale, int sliding_window, Tensor[] lora_weights, "
        "int[] lora_slices) -> ()");
}

TORCH_LIBRARY_IMPL(galley_cpu, CPU, m) {
  m.impl("paged_decode_attention", paged_decode_attention);
  m.impl("paged_prefill_attention", paged_prefill_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary_embedding", rotary_embedding);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("panel_linear", panel_linear);
  m.impl("silu_mlp", silu_mlp);
  m.impl("lora_add", lora_add);
  m.impl("moe_mlp", moe_mlp);
  m.impl("decoder_layer", decoder_layer);
  m.impl("gemma_layer", gemma_layer);
}
