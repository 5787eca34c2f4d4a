// LoRA deltas on a slice of a step's rows (`engine.lora`): shrink to the adapter's rank, then expand
// each part of a fused linear (q, k, v; gate, up) into its own output columns.

#include "common.h"

namespace {

// s[r] = x . a[r] for NR ranks (rows of a, each K long): one vector accumulator per rank, so each
// load of x feeds NR FMAs; the vector's lanes are summed in order, then the tail of K
template <int64_t NR>
void dot_ranks(float* s, const float* x, const float* a, int64_t K) {
  constexpr int64_t W = Vec::size();
  Vec acc[NR];
  for (auto& v : acc) v = Vec(0.f);
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    const Vec xv = Vec::loadu(x + k);
    for (int64_t r = 0; r < NR; ++r) acc[r] = at::vec::fmadd(xv, Vec::loadu(a + r * K + k), acc[r]);
  }
  for (int64_t r = 0; r < NR; ++r) {
    alignas(64) float lanes[W];
    acc[r].store(lanes);
    float sum = 0.f;
    for (int64_t i = 0; i < W; ++i) sum += lanes[i];
    for (int64_t j = k; j < K; ++j) sum += x[j] * a[r * K + j];
    s[r] = sum;
  }
}

// o[c] += sum over r of s[r] * e[r][c] for NV vectors of columns, e's rows `stride` apart: the
// columns stay in registers across the ranks
template <int64_t NV>
void expand_columns(float* o, const float* s, const float* e, int64_t ranks, int64_t stride) {
  constexpr int64_t W = Vec::size();
  Vec acc[NV];
  for (int64_t j = 0; j < NV; ++j) acc[j] = Vec::loadu(o + j * W);
  for (int64_t r = 0; r < ranks; ++r) {
    const Vec sv(s[r]);
    for (int64_t j = 0; j < NV; ++j) acc[j] = at::vec::fmadd(sv, Vec::loadu(e + r * stride + j * W), acc[j]);
  }
  for (int64_t j = 0; j < NV; ++j) acc[j].store(o + j * W);
}

constexpr int64_t RANK_GROUP = 4, CHUNK_VECTORS = 8;

// out[start:end] += the delta of one adapted linear on x[start:end]: s = x @ shrink.T, then for each
// part (rank start, rank end, first column, end column) of `parts`, out[:, columns] += s[:, ranks] @ its
// expand, the parts' expands stored one after another in `expand`, each [ranks, columns] row-major.
// The threads share out groups of ranks, then chunks of columns, so each weight is read once a call;
// a row's result does not depend on the other rows.
void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& shrink, const at::Tensor& expand,
              const at::Tensor& parts, int64_t start, int64_t end) {
  check_float(out, "lora_add out");
  check_float(x, "lora_add x");
  check_float(shrink, "lora_add shrink");
  check_float(expand, "lora_add expand");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous() &&
              shrink.is_contiguous() && expand.is_contiguous() && x.size(0) == out.size(0));
  TORCH_CHECK(0 <= start && start <= end && end <= out.size(0), "adapter rows outside the step");
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.is_contiguous() && parts.dim() == 2 && parts.size(1) == 4,
              "parts: int64 [num_parts, 4]");
  const int64_t M = end - start, K = x.size(1), N = out.size(1), R = shrink.size(0), P = parts.size(0);
  TORCH_CHECK(shrink.dim() == 2 && shrink.size(1) == K, "the shrink does not fit the linear's inputs");
  const int64_t* pp = parts.data_ptr<int64_t>();
  std::vector<int64_t> offsets(P + 1, 0), first_chunk(P + 1, 0);
  constexpr int64_t W = Vec::size(), CW = CHUNK_VECTORS * Vec::size();
  for (int64_t p = 0; p < P; ++p) {
    const int64_t r0 = pp[4 * p], r1 = pp[4 * p + 1], c0 = pp[4 * p + 2], c1 = pp[4 * p + 3];
    TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= R && 0 <= c0 && c0 <= c1 && c1 <= N, "a part outside the linear");
    offsets[p + 1] = offsets[p] + (r1 - r0) * (c1 - c0);
    first_chunk[p + 1] = first_chunk[p] + (c1 - c0 + CW - 1) / CW;
  }
  TORCH_CHECK(expand.numel() == offsets[P], "the expand does not hold its parts");
  if (M == 0 || R == 0) return;
  const float *xp = x.data_ptr<float>() + start * K, *ap = shrink.data_ptr<float>(), *ep = expand.data_ptr<float>();
  float* op = out.data_ptr<float>() + start * N;
  at::Tensor shrunk = at::empty({M, R}, out.options());  // [rows, rank]
  float* sp = shrunk.data_ptr<float>();
  const int64_t groups = (R + RANK_GROUP - 1) / RANK_GROUP;
  at::parallel_for(0, groups, grain(M * RANK_GROUP * K), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r = g * RANK_GROUP, nr = std::min(RANK_GROUP, R - r);
      for (int64_t m = 0; m < M; ++m) {
        float* s = sp + m * R + r;
        const float *xm = xp + m * K, *a = ap + r * K;
        switch (nr) {
          case 4: dot_ranks<4>(s, xm, a, K); break;
          case 3: dot_ranks<3>(s, xm, a, K); break;
          case 2: dot_ranks<2>(s, xm, a, K); break;
          default: dot_ranks<1>(s, xm, a, K);
        }
      }
    }
  });
  at::parallel_for(0, first_chunk[P], grain(M * R * CW), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = std::upper_bound(first_chunk.begin(), first_chunk.end(), i) - first_chunk.begin() - 1;
      const int64_t r0 = pp[4 * p], ranks = pp[4 * p + 1] - r0, c0 = pp[4 * p + 2], width = pp[4 * p + 3] - c0;
      const int64_t col = (i - first_chunk[p]) * CW, cols = std::min(CW, width - col);
      const float* e = ep + offsets[p] + col;
      for (int64_t m = 0; m < M; ++m) {
        float* o = op + m * N + c0 + col;
        const float* s = sp + m * R + r0;
        int64_t j = 0;
        if (cols == CW) {
          expand_columns<CHUNK_VECTORS>(o, s, e, ranks, width);
          j = CW;
        }
        for (; j + W <= cols; j += W) expand_columns<1>(o + j, s, e + j, ranks, width);
        for (; j < cols; ++j) {
          float sum = o[j];
          for (int64_t r = 0; r < ranks; ++r) sum = std::fma(s[r], e[r * width + j], sum);
          o[j] = sum;
        }
      }
    }
  });
}

}  // namespace
