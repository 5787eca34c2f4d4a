// The panel GEMM: y = x @ W.T (+ bias) over weights laid out in panels of 16 output features.
// linear.cpp's ops run on it, and prefill_attention.cpp's two GEMMs on its register tiles.
#pragma once

#include "common.h"

namespace {

// y[m] = x[m] @ W.T (+ bias) for the M rows of x, W stored as panels of 16 output features:
// panels[p][k][j] = W[16 p + j][k], zero past the last feature (`engine.packed_linear`).
// A register tile of up to 8 rows by 3 panels keeps 24 vector accumulators over the whole of K,
// so each broadcast of x feeds three FMAs and each panel load eight. The threads share out groups
// of 3 panels (one contiguous run); a group is read from memory once and then from L2 by each
// further 8-row tile, and those tiles prefetch the thread's next group between them, so that its
// first tile does not wait on memory (a lone tile prefetches the next group's first panel). With two
// tiles (9-12 rows on AVX2; 7-8 rows take the packed pass below) the second prefetches the whole next
// group; when it took one panel, the next group's first tile waited on memory for the other two
// (measured with 8 rows as two tiles, SmolLM2-135M's layers, AVX2 host: 27-33 -> 23-28 ms, where 1-6
// rows, one tile, take ~17).
inline void store_panel(float* out, const float* row, const float* bias, int64_t n0, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = bias ? row[i] + bias[n0 + i] : row[i];
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t TILE_ROWS = 8;
#else
// AVX2 has 16 vector registers: 6 rows x 2 vectors of a panel make 12 accumulators (BLIS's 6x16
// Haswell kernel); 8 rows would be 16 and spill. The portable code takes the same 6 rows when its
// vectors hold 8 floats, else 8.
constexpr int64_t TILE_ROWS = Vec::size() == 8 ? 6 : 8;
#endif
constexpr int64_t GROUP_PANELS = 3, CHUNK_ROWS = 128;

#if defined(CPU_CAPABILITY_AVX512)
template <int64_t MR, int64_t NP>
void tile(float* y, const float* x, const float* w, const float* bias, int64_t K, int64_t N, int64_t p,
          const float* prefetch, int64_t prefetch_panels) {
  __m512 acc[NP][MR];
  for (auto& panel : acc)
    for (auto& a : panel) a = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < prefetch_panels; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * K * 16 + k * 16), _MM_HINT_T1);
    __m512 wv[NP];
    for (int64_t j = 0; j < NP; ++j) wv[j] = _mm512_loadu_ps(w + j * K * 16 + k * 16);
    for (int64_t m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int64_t j = 0; j < NP; ++j) acc[j][m] = _mm512_fmadd_ps(xv, wv[j], acc[j][m]);
    }
  }
  alignas(64) float row[16];
  for (int64_t j = 0; j < NP; ++j) {
    const int64_t n0 = (p + j) * 16, count = std::min<int64_t>(16, N - n0);
    for (int64_t m = 0; m < MR; ++m) {
      if (count == 16 && !bias) {
        _mm512_storeu_ps(y + m * N + n0, acc[j][m]);
        continue;
      }
      _mm512_store_ps(row, acc[j][m]);
      store_panel(y + m * N + n0, row, bias, n0, count);
    }
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// one panel at a time, its 16 lanes as two vectors; the rows of x are read again for each panel,
// from L1; panel j of those to prefetch is prefetched while panel j is computed
template <int64_t MR, int64_t NP>
void tile(float* y, const float* x, const float* w, const float* bias, int64_t K, int64_t N, int64_t p,
          const float* prefetch, int64_t prefetch_panels) {
  for (int64_t j = 0; j < NP; ++j, w += K * 16) {
    __m256 acc[MR][2];
    for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
    const float* ahead = j < prefetch_panels ? prefetch + j * K * 16 : nullptr;
    for (int64_t k = 0; k < K; ++k) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * 16), _MM_HINT_T1);
      const __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
      for (int64_t m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
      }
    }
    // through a buffer: with a store per row into y here, GCC 12 kept the accumulators in memory
    // in the loop above (a store after every FMA)
    const int64_t n0 = (p + j) * 16, count = std::min<int64_t>(16, N - n0);
    alignas(32) float rows[MR][16];
    for (int64_t m = 0; m < MR; ++m) {
      _mm256_store_ps(rows[m], acc[m][0]);
      _mm256_store_ps(rows[m] + 8, acc[m][1]);
    }
    if (count == 16 && !bias) {  // copied by vectors: as a loop (store_panel) GCC emits `rep movs`, slow for 64 bytes
      for (int64_t m = 0; m < MR; ++m) {
        _mm256_storeu_ps(y + m * N + n0, _mm256_load_ps(rows[m]));
        _mm256_storeu_ps(y + m * N + n0 + 8, _mm256_load_ps(rows[m] + 8));
      }
      continue;
    }
    for (int64_t m = 0; m < MR; ++m) store_panel(y + m * N + n0, rows[m], bias, n0, count);
  }
}
#else
template <int64_t MR, int64_t NP>
void tile(float* y, const float* x, const float* w, const float* bias, int64_t K, int64_t N, int64_t p,
          const float*, int64_t) {
  constexpr int64_t W = Vec::size(), NV = 16 / W;
  for (int64_t j = 0; j < NP; ++j, w += K * 16) {
    Vec acc[MR][NV];
    for (auto& row : acc)
      for (auto& a : row) a = Vec(0.f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t v = 0; v < NV; ++v) {
        const Vec wv = Vec::loadu(w + k * 16 + v * W);
        for (int64_t m = 0; m < MR; ++m) acc[m][v] = at::vec::fmadd(Vec(x[m * K + k]), wv, acc[m][v]);
      }
    const int64_t n0 = (p + j) * 16, count = std::min<int64_t>(16, N - n0);
    float row[16];
    for (int64_t m = 0; m < MR; ++m) {
      for (int64_t v = 0; v < NV; ++v) acc[m][v].store(row + v * W);
      store_panel(y + m * N + n0, row, bias, n0, count);
    }
  }
}
#endif

template <int64_t NP>
void tile_rows(int64_t rows, float* y, const float* x, const float* w, const float* bias, int64_t K, int64_t N,
               int64_t p, const float* prefetch, int64_t prefetch_panels) {
  switch (rows) {
    case 1: return tile<1, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
    case 2: return tile<2, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
    case 3: return tile<3, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
    case 4: return tile<4, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
    case 5: return tile<5, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
    case 6: return tile<6, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
    case 7: return tile<7, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
    default: return tile<TILE_ROWS, NP>(y, x, w, bias, K, N, p, prefetch, prefetch_panels);
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// A few rows on AVX2 (a decode batch of a handful of conversations): the rows packed k-major
// (xt[k][8], missing rows zero) and each panel taken as two halves of 8 features, one accumulator
// per feature holding all 8 rows, so each k is one load of x, eight broadcasts of weights and eight
// FMAs. As two tiles of the layout above (4 + 4 rows, eight accumulators each), 8 rows ran at 45
// GFLOP/s one thread with the weights in L3, this at 52; a whole decode step of 8 sequences took
// 3-8% less (in-process A/B, alternating step by step). Each half prefetches one of the thread's
// next two panels. Every output is the same sum in the same order as the tiles', so a row's result
// does not depend on the rows beside it.
constexpr int64_t PACKED_ROWS = 8, PACKED_MIN_ROWS = 7;

void tile_packed(float* y, int64_t M, const float* xt, const float* w, const float* bias, int64_t K, int64_t N,
                 int64_t n0, const float* prefetch) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * 16), _MM_HINT_T1);
    const __m256 xv = _mm256_loadu_ps(xt + k * PACKED_ROWS);
    const float* wk = w + k * 16;
    a0 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 0), a0);
    a1 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 1), a1);
    a2 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 2), a2);
    a3 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 3), a3);
    a4 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 4), a4);
    a5 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 5), a5);
    a6 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 6), a6);
    a7 = _mm256_fmadd_ps(xv, _mm256_broadcast_ss(wk + 7), a7);
  }
  alignas(32) float cols[8][PACKED_ROWS];  // cols[j][m]: row m's feature n0 + j
  _mm256_store_ps(cols[0], a0);
  _mm256_store_ps(cols[1], a1);
  _mm256_store_ps(cols[2], a2);
  _mm256_store_ps(cols[3], a3);
  _mm256_store_ps(cols[4], a4);
  _mm256_store_ps(cols[5], a5);
  _mm256_store_ps(cols[6], a6);
  _mm256_store_ps(cols[7], a7);
  const int64_t count = std::min<int64_t>(8, N - n0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < count; ++j) y[m * N + n0 + j] = bias ? cols[j][m] + bias[n0 + j] : cols[j][m];
}

void panel_gemm_packed(float* y, const float* x, const float* panels, const float* bias, int64_t M, int64_t K,
                       int64_t N) {
  const int64_t P = (N + 15) / 16;
  std::vector<float> xt(K * PACKED_ROWS, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * PACKED_ROWS + m] = x[m * K + k];
  at::parallel_for(0, P, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t half = 0; half < 2 && p * 16 + half * 8 < N; ++half) {
        const int64_t ahead = p + 1 + half;
        tile_packed(y, M, xt.data(), panels + p * K * 16 + half * 8, bias, K, N, p * 16 + half * 8,
                    ahead < last ? panels + ahead * K * 16 : nullptr);
      }
  });
}
#endif

// all M rows against panels [p, p + np), the first at w; next: the thread's next group of np_next
// panels, or null
void panel_group(int64_t M, float* y, const float* x, const float* w, const float* bias, int64_t K,
                 int64_t N, int64_t p, int64_t np, const float* next, int64_t np_next) {
  // the rows shared out evenly (32 as 5, 5, 5, 5, 6, 6 rather than 6 x 5 + 2): a tile of one or two
  // rows waits on its few FMA chains' latency for nearly as long as a full tile takes
  const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS, base = M / tiles, extra = M % tiles;
  for (int64_t t = 0, m0 = 0, rows; t < tiles; ++t, m0 += rows) {
    rows = base + (t >= tiles - extra);
    // the next group's panels [lo, hi) this tile prefetches: the tiles after the first share them out
    int64_t lo = 0, hi = tiles == 1 ? std::min<int64_t>(1, np_next) : 0;
    if (t > 0) lo = (t - 1) * np_next / (tiles - 1), hi = t * np_next / (tiles - 1);
    const float* prefetch = next && hi > lo ? next + lo * K * 16 : nullptr;
    const int64_t prefetch_panels = prefetch ? hi - lo : 0;
    float* yt = y + m0 * N;
    const float* xt = x + m0 * K;
    switch (np) {
      case 1: tile_rows<1>(rows, yt, xt, w, bias, K, N, p, prefetch, prefetch_panels); break;
      case 2: tile_rows<2>(rows, yt, xt, w, bias, K, N, p, prefetch, prefetch_panels); break;
      default: tile_rows<3>(rows, yt, xt, w, bias, K, N, p, prefetch, prefetch_panels); break;
    }
  }
}

// y[0:M] = x[0:M] @ W.T (+ bias), in chunks of CHUNK_ROWS rows, so a chunk of x stays in cache
// while every group of panels passes over it
void panel_gemm(float* y, const float* x, const float* panels, const float* bias, int64_t M, int64_t K,
                int64_t N) {
#if defined(CPU_CAPABILITY_AVX2)
  if (M >= PACKED_MIN_ROWS && M <= PACKED_ROWS) return panel_gemm_packed(y, x, panels, bias, M, K, N);
#endif
  const int64_t P = (N + 15) / 16, groups = (P + GROUP_PANELS - 1) / GROUP_PANELS;
  for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
    const int64_t rows = std::min(CHUNK_ROWS, M - m0);
    at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) {
        const int64_t p = g * GROUP_PANELS, np = std::min(GROUP_PANELS, P - p);
        const int64_t np_next = g + 1 < last ? std::min(GROUP_PANELS, P - p - np) : 0;
        panel_group(rows, y + m0 * N, x + m0 * K, panels + p * K * 16, bias, K, N, p, np,
                    np_next ? panels + (p + np) * K * 16 : nullptr, np_next);
      }
    });
  }
}

}  // namespace
