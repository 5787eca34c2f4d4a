// Prefill attention over the paged KV cache: a chunk of one sequence's tokens at a time.

#include "attention.h"
#include "panel_gemm.h"

namespace {

// Prefill attention over the paged cache: out[i, h] = softmax(q[i, h] . K * scale) @ V for the
// chunk's tokens i (positions start + i), each over the keys it sees (positions up to its own,
// within the sliding window if any), read through the chunk's block table. SDPA with a mask (a
// chunk after a cached prefix) ran at about half the speed of its own QK matmul here; this is two
// GEMMs on panel_gemm.h's register tiles (1.4-1.8x faster than SDPA per layer on the AVX2 host, see
// bench/README). The keys are packed once per call into panels of 16 (the key as the output
// feature, K = head_dim), the values into panels of 16 columns (K = keys); the query rows of a KV
// head's group are folded (token i, head in group) so that a tile of rows shares every key it
// loads (GQA). Per tile of rows: scores for the keys its rows see (panels over [first, last]),
// an exact softmax over each row's own range, then the weighted sum of values.
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table, int64_t start,
                             int64_t block_size, double scale, int64_t sliding_window) {
  check_float(out, "paged_prefill_attention out");
  check_float(q, "paged_prefill_attention q");
  check_float(k_cache, "paged_prefill_attention k_cache");
  check_float(v_cache, "paged_prefill_attention v_cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous());
  TORCH_CHECK(block_table.scalar_type() == at::kLong && start >= 0);
  const int64_t C = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), G = H / KVH;
  TORCH_CHECK(H == G * KVH && k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes());
  const int64_t len = start + C;  // keys [0, len) of the sequence exist in the cache
  TORCH_CHECK(block_table.numel() * block_size >= len, "context longer than its block table");
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0) / block_size;
  for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block outside the cache");
  if (C == 0) return;
  // keys before `base` are outside every row's window; keys are numbered from it
  const int64_t base = sliding_window > 0 ? std::max<int64_t>(0, start - sliding_window + 1) : 0;
  const int64_t n = len - base, P = (n + 15) / 16, DP = (D + 15) / 16, rows_per_head = C * G;
  // kp[g][p][d][16]: key 16 p + j's d-th value at [d][j]; vp[g][dp][key][16]: column 16 dp + j at [key][j]
  at::Tensor kpack = at::empty({KVH, P, D, 16}, q.options()), vpack = at::empty({KVH, DP, P * 16, 16}, q.options());
  float* kp = kpack.data_ptr<float>();
  float* vp = vpack.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const Rows rows{table, block_size, KVH * D};
  const std::vector<float> zeros(D, 0.f);
  at::parallel_for(0, KVH * P, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t g = item / P, p = item % P;
      const float* kr[16];  // padding keys read a row of zeros: their values times 0 must not be NaN
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = p * 16 + j;
        kr[j] = key < n ? rows.at(kc, base + key) + g * D : zeros.data();
        const float* vr = key < n ? rows.at(vc, base + key) + g * D : zeros.data();
        for (int64_t dp = 0; dp < DP; ++dp) {
          float* vdst = vp + ((g * DP + dp) * P * 16 + key) * 16;
          const int64_t c0 = dp * 16, c1 = std::min(D, c0 + 16);
          int64_t c = c0;
          for (; c + Vec::size() <= c1; c += Vec::size()) Vec::loadu(vr + c).store(vdst + c - c0);
          for (; c < c0 + 16; ++c) vdst[c - c0] = c < c1 ? vr[c] : 0.f;
        }
      }
      float* kdst = kp + (g * P + p) * D * 16;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = 0; j < 16; ++j) kdst[d * 16 + j] = kr[j][d];
    }
  });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);
  // work items: (head, row tile), the last (costliest) tiles first, taken dynamically by the threads
  const int64_t tiles = (rows_per_head + TILE_ROWS - 1) / TILE_ROWS, count = KVH * tiles;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    std::vector<float> x(TILE_ROWS * D), o(TILE_ROWS * DP * 16), sums(TILE_ROWS), s;
    for (int64_t item; (item = next.fetch_add(1)) < count;) {
      const int64_t g = item % KVH, t = tiles - 1 - item / KVH;
      const int64_t r0 = t * TILE_ROWS, R = std::min(TILE_ROWS, rows_per_head - r0);
      // row m is token (r0 + m) / G, head g * G + (r0 + m) % G; it sees keys [lo(m), hi(m)) (from base)
      const auto hi = [&](int64_t m) { return start + (r0 + m) / G + 1 - base; };
      const auto lo = [&](int64_t m) {
        return sliding_window > 0 ? std::max<int64_t>(0, hi(m) - sliding_window) : int64_t{0};
      };
      const int64_t p0 = lo(0) / 16, p1 = (hi(R - 1) + 15) / 16, cols = (p1 - p0) * 16;
      for (int64_t m = 0; m < R; ++m) {
        const int64_t r = r0 + m;
        std::copy_n(qp + (r / G) * qs0 + (g * G + r % G) * qs1, D, x.data() + m * D);
      }
      s.resize(R * cols);
      const float* kg = kp + g * P * D * 16;
      for (int64_t p = p0; p < p1; p += 3) {
        const float* w = kg + p * D * 16;
        switch (std::min<int64_t>(3, p1 - p)) {
          case 1: tile_rows<1>(R, s.data(), x.data(), w, nullptr, D, cols, p - p0, nullptr, 0); break;
          case 2: tile_rows<2>(R, s.data(), x.data(), w, nullptr, D, cols, p - p0, nullptr, 0); break;
          default: tile_rows<3>(R, s.data(), x.data(), w, nullptr, D, cols, p - p0, nullptr, 0); break;
        }
      }
      for (int64_t m = 0; m < R; ++m) {  // softmax numerators over the row's keys, zeros elsewhere
        float* row = s.data() + m * cols;
        const int64_t a = lo(m) - p0 * 16, b = hi(m) - p0 * 16;
        std::fill(row, row + a, 0.f);
        std::fill(row + b, row + cols, 0.f);
        sums[m] = softmax_numerators(row + a, b - a, fscale);
      }
      const float* vg = vp + g * DP * P * 16 * 16 + p0 * 16 * 16;
      for (int64_t dp = 0; dp < DP; ++dp)
        tile_rows<1>(R, o.data(), s.data(), vg + dp * P * 16 * 16, nullptr, cols, D, dp, nullptr, 0);
      for (int64_t m = 0; m < R; ++m) {
        const int64_t r = r0 + m;
        float* dst = op + (r / G) * os0 + (g * G + r % G) * os1;
        const float inv = 1.f / sums[m];
        for (int64_t d = 0; d < D; ++d) dst[d] = o[m * D + d] * inv;
      }
    }
  });
}

}  // namespace
