// A whole decoder layer as one op, made of the other files' kernels.

#include "common.h"
#include "panel_gemm.h"
#include "block_gemm.h"

namespace {

// The step's LoRA deltas on one of the layer's linears (0 qkv, 1 o, 2 gate_up, 3 down): for each
// (linear, start, end, entry) of `slices`, lora_add over rows [start, end) with weights[3 entry ...]
// (shrink, expand, parts), as `engine.lora.LoraStep.add` calls it on the per-op path.
void add_lora(at::Tensor& out, const at::Tensor& x, int64_t linear, at::TensorList weights,
              at::IntArrayRef slices) {
  for (size_t i = 0; i + 3 < slices.size(); i += 4) {
    if (slices[i] != linear) continue;
    const int64_t entry = slices[i + 3];
    TORCH_CHECK(0 <= entry && 3 * entry + 2 < static_cast<int64_t>(weights.size()), "no such adapter weights");
    lora_add(out, x, weights[3 * entry], weights[3 * entry + 1], weights[3 * entry + 2], slices[i + 1],
             slices[i + 2]);
  }
}

bool adapts(int64_t linear, at::IntArrayRef slices) {
  for (size_t i = 0; i + 3 < slices.size(); i += 4)
    if (slices[i] == linear) return true;
  return false;
}

// The attention half of a layer on normed rows h [T, hidden]: q/k/v (and their adapters' deltas), q/k
// norms, rotary, the step's keys and values to their cache slots, paged attention, o (and its adapters').
// prefill_bounds: (start, end, start_pos) per prefill chunk, each read through its own table.
at::Tensor attention_block(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& qkv_panels, const c10::optional<at::Tensor>& qkv_bias,
                           const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                           const at::Tensor& o_panels, const c10::optional<at::Tensor>& o_bias, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_decodes,
                           const c10::optional<at::Tensor>& decode_block_tables,
                           const c10::optional<at::Tensor>& decode_context_lens, at::IntArrayRef prefill_bounds,
                           at::TensorList prefill_tables, int64_t num_heads, double eps, int64_t block_size,
                           double scale, int64_t sliding_window, at::TensorList lora_weights,
                           at::IntArrayRef lora_slices) {
  TORCH_CHECK(lora_slices.size() % 4 == 0, "four ints per adapter slice");
  check_float(k_cache, "k_cache");
  check_float(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes());
  const int64_t T = x.size(0), KVH = k_cache.size(1), D = k_cache.size(2), H = num_heads;
  const int64_t q_size = H * D, kv_size = KVH * D, num_slots = k_cache.size(0);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T);
  TORCH_CHECK(prefill_bounds.size() == 3 * prefill_tables.size(), "three bounds per prefill chunk");
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= T);
  at::Tensor qkv = at::empty({T, q_size + 2 * kv_size}, x.options());
  panel_linear(qkv, x, qkv_panels, qkv_bias);
  add_lora(qkv, x, 0, lora_weights, lora_slices);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, H, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, KVH, D});
  if (q_norm.has_value() && q_norm->defined()) norm_heads(q, *q_norm, static_cast<float>(eps));
  if (k_norm.has_value() && k_norm->defined()) norm_heads(k, *k_norm, static_cast<float>(eps));
  rotary_embedding(q, k, cos, sin);
  // each token's key and value to its slot (index_copy_ by slot_mapping on the torch path)
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* rows = qkv.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t stride = qkv.size(1);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot outside the cache");
    std::copy_n(rows + t * stride + q_size, kv_size, kc + slots[t] * kv_size);
    std::copy_n(rows + t * stride + q_size + kv_size, kv_size, vc + slots[t] * kv_size);
  }
  at::Tensor attn = at::empty({T, H, D}, x.options());
  if (num_decodes > 0) {
    TORCH_CHECK(decode_block_tables.has_value() && decode_context_lens.has_value(), "decodes need their tables");
    paged_decode_attention(attn.narrow(0, 0, num_decodes), q.narrow(0, 0, num_decodes).contiguous(), k_cache,
                           v_cache, *decode_block_tables, *decode_context_lens, block_size, scale, sliding_window);
  }
  for (size_t c = 0; c < prefill_tables.size(); ++c) {
    const int64_t start = prefill_bounds[3 * c], end = prefill_bounds[3 * c + 1];
    TORCH_CHECK(num_decodes <= start && start <= end && end <= T, "prefill chunk outside the step");
    paged_prefill_attention(attn.slice(0, start, end), q.slice(0, start, end), k_cache, v_cache, prefill_tables[c],
                            prefill_bounds[3 * c + 2], block_size, scale, sliding_window);
  }
  at::Tensor o = at::empty({T, x.size(1)}, x.options());
  panel_linear(o, attn.view({T, q_size}), o_panels, o_bias);
  add_lora(o, attn.view({T, q_size}), 1, lora_weights, lora_slices);
  return o;
}

// One decoder layer of `engine.models.llama` (pre-norm attention, then a SiLU MLP) for a packed
// step, as one op: the same kernels in the same order as the model's per-op path, so the same
// result bit for bit, without ~20 Python-level calls per layer in between (at one decoding
// sequence those took a fifth of the step). In place: residual += x, then x = the layer's output
// (the next layer's norm adds it). Keys and values of the step's tokens go to their cache slots.
// prefill_bounds: (start, end, start_pos) per prefill chunk, each read through its own table.
// lora_weights, lora_slices: the step's adapters on this layer (add_lora); empty without any.
// The MLP is dense (gate_up, down) or, given a router, a mixture of experts (moe_mlp).
void decoder_layer(at::Tensor x, at::Tensor residual, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& input_norm, const at::Tensor& qkv_panels,
                   const c10::optional<at::Tensor>& qkv_bias,
                   const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                   const at::Tensor& o_panels, const c10::optional<at::Tensor>& o_bias, const at::Tensor& post_norm,
                   const c10::optional<at::Tensor>& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
                   const c10::optional<at::Tensor>& down, const c10::optional<at::Tensor>& down_bias,
                   at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping, int64_t num_decodes,
                   const c10::optional<at::Tensor>& decode_block_tables,
                   const c10::optional<at::Tensor>& decode_context_lens, at::IntArrayRef prefill_bounds,
                   at::TensorList prefill_tables, int64_t num_heads, double eps, int64_t block_size, double scale,
                   int64_t sliding_window, at::TensorList lora_weights, at::IntArrayRef lora_slices,
                   const c10::optional<at::Tensor>& router, at::TensorList experts, int64_t experts_per_token,
                   bool normalize_experts) {
  const bool sparse = router.has_value() && router->defined();
  TORCH_CHECK(sparse || (gate_up.has_value() && down.has_value()), "a dense MLP's weights, or a router and experts");
  TORCH_CHECK(!sparse || (!adapts(2, lora_slices) && !adapts(3, lora_slices)), "adapters on experts");
  const int64_t T = x.size(0);
  add_rms_norm(x, residual, input_norm, eps);
  at::Tensor o = attention_block(x, cos, sin, qkv_panels, qkv_bias, q_norm, k_norm, o_panels, o_bias, k_cache,
                                 v_cache, slot_mapping, num_decodes, decode_block_tables, decode_context_lens,
                                 prefill_bounds, prefill_tables, num_heads, eps, block_size, scale, sliding_window,
                                 lora_weights, lora_slices);
  add_rms_norm(o, residual, post_norm, eps);
  if (sparse) {
    moe_mlp(x, o, *router, experts, experts_per_token, normalize_experts);
    return;
  }
  if (!adapts(2, lora_slices) && !adapts(3, lora_slices)) {
    silu_mlp(x, o, *gate_up, gate_up_bias, *down, down_bias);
    return;
  }
  // an adapted MLP, step by step as MLP.forward runs it: its deltas land between the kernels
  const int64_t I = panel_inputs(*down);
  at::Tensor gu = at::empty({T, 2 * I}, x.options()), act = at::empty({T, I}, x.options());
  panel_linear(gu, o, *gate_up, gate_up_bias);
  add_lora(gu, o, 2, lora_weights, lora_slices);
  silu_and_mul(act, gu);
  panel_linear(x, act, *down, down_bias);
  add_lora(x, act, 3, lora_weights, lora_slices);
}

}  // namespace
