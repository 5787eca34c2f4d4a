// The linear layers over panels (`engine.packed_linear`: float32, or a GGUF file's blocks) and the
// MLP: panel_linear, SiLU-and-multiply, and silu_mlp, the whole MLP a chunk of rows at a time.

#include "common.h"
#include "panel_gemm.h"
#include "block_gemm.h"

namespace {

// panels for N outputs over K inputs: float32 [P, K, 16], or blocks [P, K / 32 (Q4, Q8S) or K / 16 (Q8),
// 384 or 576 (Q8S)];
// the bias, if any, as a pointer
const float* check_panels(const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t K, int64_t N) {
  TORCH_CHECK(panels.device().is_cpu() && panels.is_contiguous() && panels.dim() == 3 &&
              panels.size(0) == (N + 15) / 16, "panels of the wrong shape");
  if (panels.scalar_type() == at::kFloat) {
    TORCH_CHECK(panels.size(1) == K && panels.size(2) == 16, "float panels of the wrong shape");
  } else {
    TORCH_CHECK(panels.scalar_type() == at::kByte || panels.scalar_type() == at::kChar, "panels: float32, or blocks");
    const bool q8s = is_q8s(panels);
    const int64_t block_k = panels.scalar_type() == at::kByte ? Q4::K : q8s ? Q8S::K : Q8::K;
    TORCH_CHECK(K % block_k == 0 && panels.size(1) == K / block_k && panels.size(2) == (q8s ? Q8S_BYTES : BLOCK_BYTES),
                "blocks of the wrong shape");
  }
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_float(*bias, "bias");
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "bias of the wrong size");
  return bias->data_ptr<float>();
}

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels,
                  const c10::optional<at::Tensor>& bias) {
  check_float(out, "panel_linear out");
  check_float(x, "panel_linear x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.size(0) == x.size(0));
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const float* bp = check_panels(panels, bias, K, N);
  if (M > 0) weight_gemm(out.data_ptr<float>(), x.data_ptr<float>(), panels, bp, M, K, N);
}

// out = silu(gate) * up for rows [gate | up] of the fused gate-up projection. silu rounds as
// torch's kernel does: x / (1 + exp(-x)), vectorised over runs of two vectors, std::exp for a
// row's tail
// o[t] = silu(g[t]) * u[t] for rows t of [g | u], each I wide
void silu_mul_rows(float* op, const float* xp, int64_t rows, int64_t I) {
  constexpr int64_t W = Vec::size();
  const int64_t vector_end = I - I % (2 * W);
  at::parallel_for(0, rows, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i < vector_end; i += W) {
        const Vec x = Vec::loadu(g + i);
        (x / (Vec(1.f) + x.neg().exp()) * Vec::loadu(u + i)).store(o + i);
      }
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_float(out, "silu_and_mul out");
  check_float(gate_up, "silu_and_mul gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && out.is_contiguous() && gate_up.size(1) % 2 == 0);
  const int64_t I = gate_up.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == gate_up.size(0) && out.size(1) == I);
  silu_mul_rows(out.data_ptr<float>(), gate_up.data_ptr<float>(), gate_up.size(0), I);
}

// out = down(silu(gate) * up), gate and up the two halves of x @ gate_up.T: the MLP a chunk of
// rows at a time, so its [rows, 2 I] and [rows, I] intermediates stay in cache from one step to
// the next (a 2048-token prefill wrote them out and read them back: 9% of its time, in silu_and_mul)
void silu_mlp(at::Tensor out, const at::Tensor& x, const at::Tensor& gate_up,
              const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
              const c10::optional<at::Tensor>& down_bias) {
  check_float(out, "silu_mlp out");
  check_float(x, "silu_mlp x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.size(0) == x.size(0));
  const int64_t M = x.size(0), H = x.size(1), N = out.size(1), I = panel_inputs(down);
  const float* gub = check_panels(gate_up, gate_up_bias, H, 2 * I);
  const float* db = check_panels(down, down_bias, I, N);
  if (M == 0) return;
  const int64_t chunk = std::min(M, CHUNK_ROWS);
  // uninitialised scratch: a std::vector would zero ~2 MB per call, once per layer per step
  at::Tensor gu = at::empty({chunk, 2 * I}, x.options()), act = at::empty({chunk, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    weight_gemm(gu.data_ptr<float>(), xp + m0 * H, gate_up, gub, rows, H, 2 * I);
    silu_mul_rows(act.data_ptr<float>(), gu.data_ptr<float>(), rows, I);
    weight_gemm(op + m0 * N, act.data_ptr<float>(), down, db, rows, I, N);
  }
}

}  // namespace
