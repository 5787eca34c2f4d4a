// What every kernel file uses: the headers, the float32 check, ATen's vector type, the rows per
// thread of a row-wise pass, and the declarations of the functions one file calls in another.
//
// The kernels build as ONE translation unit: engine/cpu_kernels.py concatenates the .cpp files
// (its `_FILES`, in order), putting each local header's text in place of its first #include, and
// hands the result to torch's extension builder. Everything sits in the unnamed namespace of that
// one unit, as it did when the C++ was one string, so the compiler sees the whole library at once.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <numeric>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": a float32 CPU tensor is needed");
}

using Vec = at::vec::Vectorized<float>;

// rows of n floats per work item of a row-wise at::parallel_for: ~16K floats
int64_t grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)); }

// The library's ops (registered in ops.cpp) and norm_heads, each defined in the file named:
// declared here for the files that call them (decoder_layer.cpp, ops.cpp)
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale,
                            int64_t sliding_window);  // decode_attention.cpp
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table, int64_t start,
                             int64_t block_size, double scale, int64_t sliding_window);  // prefill_attention.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);  // norms_rotary.cpp
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);  // norms_rotary.cpp
void norm_heads(at::Tensor& x, const at::Tensor& weight, float eps);  // norms_rotary.cpp
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);  // norms_rotary.cpp
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up);  // linear.cpp
void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels,
                  const c10::optional<at::Tensor>& bias);  // linear.cpp
void silu_mlp(at::Tensor out, const at::Tensor& x, const at::Tensor& gate_up,
              const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
              const c10::optional<at::Tensor>& down_bias);  // linear.cpp
void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& shrink, const at::Tensor& expand,
              const at::Tensor& parts, int64_t start, int64_t end);  // lora.cpp
void moe_mlp(at::Tensor out, const at::Tensor& x, const at::Tensor& router, at::TensorList experts, int64_t top_k,
             bool normalize);  // moe.cpp
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
                   bool normalize_experts);  // decoder_layer.cpp

}  // namespace
