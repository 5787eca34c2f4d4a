// RMSNorm (with the residual add fused; per head for Qwen3's q_norm and k_norm) and rotary
// embedding in place: one pass over memory each, in the reference's order of operations (no FMA
// contraction), so they round as the torch path does up to the order of the norm's sum.

#include "common.h"

namespace {

// out = weight * (x * rsqrt(mean(x^2) + eps)), the reference's order of operations
inline void norm_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  check_float(x, "rms_norm");
  check_float(weight, "rms_norm weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1));
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat);
  const int64_t n = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(op + t * n, xp + t * n, wp, n, static_cast<float>(eps));
  });
}

// residual = residual + x; x = rms_norm(residual), both in place
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == at::kFloat);
  const int64_t n = x.size(1);
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = rp + t * n;
      const float* xr = xp + t * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) r[i] = r[i] + xr[i];
      norm_row(xp + t * n, r, wp, n, static_cast<float>(eps));
    }
  });
}

// x = x * cos + rotate_half(x) * sin per head, in place; x: [T, heads, D], heads contiguous
void rotate_heads(at::Tensor& x, const float* cp, const float* sp) {
  check_float(x, "rotary_embedding");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2));
  const int64_t heads = x.size(1), D = x.size(2), half = D / 2, row = x.stride(0);
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * row + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] + (-b) * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(cos, "rotary cos");
  check_float(sin, "rotary sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && q.size(0) == k.size(0) && q.size(2) == k.size(2));
  TORCH_CHECK(cos.numel() == q.size(0) * q.size(2) && sin.numel() == cos.numel() && q.size(2) % 2 == 0);
  rotate_heads(q, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotate_heads(k, cos.data_ptr<float>(), sin.data_ptr<float>());
}

// rms_norm of each head's row of x: [T, heads, D], in place (Qwen3's q_norm and k_norm)
void norm_heads(at::Tensor& x, const at::Tensor& weight, float eps) {
  check_float(weight, "head norm weight");
  const int64_t heads = x.size(1), D = x.size(2), row = x.stride(0);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == D && x.stride(2) == 1 && x.stride(1) == D);
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) norm_row(xp + t * row + h * D, xp + t * row + h * D, wp, D, eps);
  });
}

}  // namespace
