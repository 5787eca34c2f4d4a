"""CPU float32 kernels in C++: decode and prefill attention over the paged KV cache, RMSNorm (with the
residual add fused), rotary embedding in place, the MLP's SiLU-and-multiply in one pass, and
linear layers over weights laid out in panels (`engine.packed_linear`); and a whole decoder layer
as one op made of those, so a step makes one call per layer from Python, not ~20.

Why: the torch path copies every decoding sequence's blocks into a padded tensor per layer
and runs SDPA with one query per sequence, a shape its CPU kernels handle poorly (measured
here at W = 32 x ~200 tokens of context: ~5 ms per layer for gather plus SDPA, one thread);
the decode kernel reads each sequence's keys and values once, in place, through its block
table. RMSNorm and rotary are five to nine torch ops each, every one a pass over memory
with a fresh tensor (14% of a 2048-token prefill, one thread); here each is one pass. The
norm and rotary follow the reference formulas operation by operation (no FMA contraction),
so they round as the torch path does up to the order of the norm's sum.

Compiled with the C++ compiler by torch's extension builder on first use (~40 s of CPU
here), in a background thread while the torch path serves, into TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions); later starts load that library directly. Without a
compiler, or if the build fails, the torch path stays in use (logged once).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

_SOURCE = r"""
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
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": a float32 CPU tensor is needed");
}

using Vec = at::vec::Vectorized<float>;

// sum(a[i] * b[i]): two vector accumulators, one horizontal add at the end
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t W = Vec::size();
  Vec acc0(0.f), acc1(0.f);
  int64_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + d + W), Vec::loadu(b + d + W), acc1);
  }
  for (; d + W <= n; d += W) acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc0 + acc1);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// Blocks sit anywhere in the cache, so the hardware prefetchers lose the stream at each block's
// end: the passes over a context prefetch the rows two blocks ahead of the ones they read (32 x
// 200-token contexts x 30 layers, read from memory on the AVX2 host: 38 -> 31 ms).
constexpr int64_t PREFETCH_BLOCKS = 2;

// Where sequence b's cached position pos lives: its row of kv_heads * head_dim floats. The passes
// ask once per run of positions; a power-of-two block size (16, the default) finds the block with
// a shift, where a 64-bit division costs tens of cycles.
struct Rows {
  const int64_t* table;
  int64_t block_size, row;
  int shift = -1;  // log2(block_size) when it is a power of two
  Rows(const int64_t* table, int64_t block_size, int64_t row) : table(table), block_size(block_size), row(row) {
    if ((block_size & (block_size - 1)) == 0) shift = __builtin_ctzll(block_size);
  }
  int64_t block(int64_t pos) const { return shift >= 0 ? pos >> shift : pos / block_size; }
  const float* at(const float* cache, int64_t pos) const {
    const int64_t b = block(pos);
    return cache + (table[b] * block_size + pos - b * block_size) * row;
  }
  int64_t block_end(int64_t pos, int64_t len) const { return std::min(len, (block(pos) + 1) * block_size); }
};

// f(pos, count, first key row, ahead) for the runs of up to R positions, none across a block's end,
// of the positions [first, len); ahead: the run's rows PREFETCH_BLOCKS blocks later, for f to prefetch
struct Ahead {
  const char* rows = nullptr;
  int64_t bytes = 0;
  // part h of H: the run's prefetches spread over the heads' work. Issued all at once before it
  // (96 prefetches per run of 8 positions), they stalled the loop: 27% of the key pass's samples
  // sat there, with the keys in L2 as well as in memory (32 x 200 positions read from memory, 30
  // layers, AVX2: 31-43 -> 24-30 ms; 8 x 900: 32-35 -> 26-30 ms)
  void prefetch(int64_t h, int64_t H) const {
    const int64_t share = (bytes / 64 + H - 1) / H * 64;
    for (int64_t b = h * share; b < std::min(bytes, (h + 1) * share); b += 64) __builtin_prefetch(rows + b);
  }
};

template <int64_t R, typename F>
void for_each_run(const Rows& rows, const float* cache, int64_t first, int64_t len, F&& f) {
  for (int64_t pos = first; pos < len;) {
    const int64_t stop = rows.block_end(pos, len);
    for (int64_t count; pos < stop; pos += count) {
      count = std::min<int64_t>(R, stop - pos);
      const int64_t later = pos + PREFETCH_BLOCKS * rows.block_size;
      Ahead ahead;
      if (later < len) ahead = {reinterpret_cast<const char*>(rows.at(cache, later)), count * rows.row * 4};
      f(pos, count, rows.at(cache, pos), ahead);
    }
  }
}

// scores[h * n + pos - first] = q[h] . k_pos * scale, one dot product at a time
void key_scores_any(float* scores, int64_t n, const float* q, const float* k_cache, const Rows& rows, int64_t first,
                    int64_t len, int64_t H, int64_t G, int64_t D, float scale) {
  for (int64_t pos = first; pos < len;) {
    const int64_t stop = rows.block_end(pos, len);
    const float* kr = rows.at(k_cache, pos);
    for (; pos < stop; ++pos, kr += rows.row)
      for (int64_t h = 0; h < H; ++h) scores[h * n + pos - first] = dot(q + h * D, kr + (h / G) * D, D) * scale;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// r[i] = the sum of the 16 lanes of v[(i % 4) * 4 + i / 4]: 15 shuffle-and-add steps reduce 16
// vectors at once, where a horizontal sum per dot product would be a serial chain each
inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))));
}

// key_scores_any for head_dim = NV * 16: runs of up to 16 positions of one block per head
template <int64_t NV>
void key_scores16(float* scores, int64_t n, const float* q, const float* k_cache, const Rows& rows, int64_t first,
                  int64_t len, int64_t H, int64_t G, float scale) {
  constexpr int64_t D = NV * 16;
  const __m512 vscale = _mm512_set1_ps(scale);
  for_each_run<16>(rows, k_cache, first, len, [&](int64_t pos, int64_t count, const float* kr, const Ahead& ahead) {
    for (int64_t h = 0; h < H; ++h) {
      ahead.prefetch(h, H);
      const float* qh = q + h * D;
      const float* k = kr + (h / G) * D;
      __m512 part[16];
      if (count == 16) {  // a full run, unrolled without the bound: part[] stays in registers
        for (int64_t t = 0; t < 16; ++t) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t j = 0; j < NV; ++j)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), _mm512_loadu_ps(k + t * rows.row + 16 * j), acc);
          part[(t % 4) * 4 + t / 4] = acc;
        }
      } else {
        for (int64_t t = 0; t < 16; ++t) {
          __m512 acc = _mm512_setzero_ps();
          if (t < count)
            for (int64_t j = 0; j < NV; ++j)
              acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), _mm512_loadu_ps(k + t * rows.row + 16 * j), acc);
          part[(t % 4) * 4 + t / 4] = acc;
        }
      }
      _mm512_mask_storeu_ps(scores + h * n + pos - first, static_cast<__mmask16>((1u << count) - 1),
                            _mm512_mul_ps(reduce16(part), vscale));
    }
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// the 8 lanes' sums of v[0..7], in order: 6 horizontal adds and one cross-lane add for 8 dot products
inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// key_scores_any for head_dim = NV * 8: runs of up to 8 positions of one block per head
template <int64_t NV>
void key_scores8(float* scores, int64_t n, const float* q, const float* k_cache, const Rows& rows, int64_t first,
                 int64_t len, int64_t H, int64_t G, float scale) {
  constexpr int64_t D = NV * 8;
  const __m256 vscale = _mm256_set1_ps(scale);
  for_each_run<8>(rows, k_cache, first, len, [&](int64_t pos, int64_t count, const float* kr, const Ahead& ahead) {
    for (int64_t h = 0; h < H; ++h) {
      ahead.prefetch(h, H);
      const float* qh = q + h * D;
      const float* k = kr + (h / G) * D;
      __m256 part[8];  // with one vector of q at a time: 8 sums, q and a key vector fit in 16 registers
      for (auto& acc : part) acc = _mm256_setzero_ps();
      if (count == 8) {
        for (int64_t j = 0; j < NV; ++j) {
          const __m256 qv = _mm256_loadu_ps(qh + 8 * j);
          for (int64_t t = 0; t < 8; ++t)
            part[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * rows.row + 8 * j), part[t]);
        }
      } else {
        for (int64_t j = 0; j < NV; ++j) {
          const __m256 qv = _mm256_loadu_ps(qh + 8 * j);
          for (int64_t t = 0; t < count; ++t)
            part[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * rows.row + 8 * j), part[t]);
        }
      }
      const __m256 sums = _mm256_mul_ps(reduce8(part), vscale);
      if (count == 8) {
        _mm256_storeu_ps(scores + h * n + pos - first, sums);
      } else {
        alignas(32) float tail[8];
        _mm256_store_ps(tail, sums);
        std::copy(tail, tail + count, scores + h * n + pos - first);
      }
    }
  });
}
#endif

void key_scores(float* scores, int64_t n, const float* q, const float* k_cache, const Rows& rows, int64_t first,
                int64_t len, int64_t H, int64_t G, int64_t D, float scale) {
#if defined(CPU_CAPABILITY_AVX512)
  switch (D % 16 == 0 ? D / 16 : 0) {
    case 1: return key_scores16<1>(scores, n, q, k_cache, rows, first, len, H, G, scale);
    case 2: return key_scores16<2>(scores, n, q, k_cache, rows, first, len, H, G, scale);
    case 4: return key_scores16<4>(scores, n, q, k_cache, rows, first, len, H, G, scale);
    case 8: return key_scores16<8>(scores, n, q, k_cache, rows, first, len, H, G, scale);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  switch (D % 8 == 0 ? D / 8 : 0) {
    case 2: return key_scores8<2>(scores, n, q, k_cache, rows, first, len, H, G, scale);
    case 4: return key_scores8<4>(scores, n, q, k_cache, rows, first, len, H, G, scale);
    case 8: return key_scores8<8>(scores, n, q, k_cache, rows, first, len, H, G, scale);
    case 16: return key_scores8<16>(scores, n, q, k_cache, rows, first, len, H, G, scale);
  }
#endif
  key_scores_any(scores, n, q, k_cache, rows, first, len, H, G, D, scale);
}

// The value pass's accumulators as the bare vector type, its loops unrolled: with an array of
// at::vec::Vectorized (a struct), or with the loops left rolled, GCC 12 kept them on the stack, a
// store after every FMA, and the value pass ran at half the key pass's speed (32 x 600 positions,
// 512 of them shared, 30 layers, AVX2: 36-53 -> 27-39 ms)
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
inline Reg reg_load(const float* p) { return _mm512_loadu_ps(p); }
inline Reg reg_broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Reg reg_fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline void reg_store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
inline Reg reg_zero() { return _mm512_setzero_ps(); }
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
inline Reg reg_load(const float* p) { return _mm256_loadu_ps(p); }
inline Reg reg_broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Reg reg_fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline void reg_store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
inline Reg reg_zero() { return _mm256_setzero_ps(); }
#else
using Reg = Vec;
inline Reg reg_load(const float* p) { return Vec::loadu(p); }
inline Reg reg_broadcast(const float* p) { return Vec(*p); }
inline Reg reg_fmadd(Reg a, Reg b, Reg c) { return at::vec::fmadd(a, b, c); }
inline void reg_store(float* p, Reg v) { v.store(p); }
inline Reg reg_zero() { return Vec(0.f); }
#endif

// out[h][0:NV * W] (+)= sum over the positions of p[h][pos] * v_pos[0:NV * W], for NH heads that
// read the same values: each value row (or its slice) is loaded once for all of them, and the
// NH * NV accumulators stay in registers across the whole context
template <int64_t NV, int64_t NH>
void weighted_sum(float* out, int64_t D, const float* p, int64_t n, const float* v_cache, const Rows& rows,
                  int64_t first, int64_t len, bool add) {
  constexpr int64_t W = Vec::size();
  Reg acc[NH][NV];
  #pragma GCC unroll 16
  for (int64_t h = 0; h < NH; ++h)
    #pragma GCC unroll 16
    for (int64_t j = 0; j < NV; ++j) acc[h][j] = add ? reg_load(out + h * D + j * W) : reg_zero();
  for (int64_t pos = first; pos < len;) {
    const int64_t stop = rows.block_end(pos, len);
    const float* v = rows.at(v_cache, pos);
    const int64_t later = pos + PREFETCH_BLOCKS * rows.block_size;  // (near the end: the row itself)
    const char* ahead = reinterpret_cast<const char*>(later < len ? rows.at(v_cache, later) : v);
    for (; pos < stop; ++pos, v += rows.row, ahead += rows.row * 4) {
      for (int64_t b = 0; b < NV * W * 4; b += 64) __builtin_prefetch(ahead + b);
      Reg vv[NV];
      #pragma GCC unroll 16
      for (int64_t j = 0; j < NV; ++j) vv[j] = reg_load(v + j * W);
      #pragma GCC unroll 16
      for (int64_t h = 0; h < NH; ++h) {
        const Reg pv = reg_broadcast(p + h * n + pos - first);
        #pragma GCC unroll 16
        for (int64_t j = 0; j < NV; ++j) acc[h][j] = reg_fmadd(pv, vv[j], acc[h][j]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int64_t h = 0; h < NH; ++h)
    #pragma GCC unroll 16
    for (int64_t j = 0; j < NV; ++j) reg_store(out + h * D + j * W, acc[h][j]);
}

// the G heads of one group, NV vectors each: a slice of up to 4 vectors of the columns at a time
// for runs of up to 4 heads, as many sums as stay in registers (16 of AVX-512's 32; 12 of AVX2's 16,
// the FMAs reading the row's slice from memory, beside the weights). AVX2 took slices of 2 vectors
// for 6 sums before: twice the passes over the values, measured level or up to 10% slower.
template <int64_t NV>
void weighted_sum_group(float* out, int64_t D, const float* p, int64_t n, const float* v_cache, const Rows& rows,
                        int64_t first, int64_t len, int64_t G, bool add) {
  constexpr int64_t W = Vec::size(), sums = W >= 16 ? 16 : 12, slice = std::min<int64_t>(NV, 4);
  constexpr int64_t most = std::max<int64_t>(1, std::min<int64_t>(4, sums / slice));
  for (int64_t c = 0; c < NV; c += slice) {
    const float* vc = v_cache + c * W;
    for (int64_t h = 0; h < G;) {
      const int64_t take = std::min(most, G - h);
      float* o = out + h * D + c * W;
      const float* ph = p + h * n;
      if (take >= 4) { if constexpr (most >= 4) weighted_sum<slice, 4>(o, D, ph, n, vc, rows, first, len, add); }
      else if (take == 3) { if constexpr (most >= 3) weighted_sum<slice, 3>(o, D, ph, n, vc, rows, first, len, add); }
      else if (take == 2) { if constexpr (most >= 2) weighted_sum<slice, 2>(o, D, ph, n, vc, rows, first, len, add); }
      else weighted_sum<slice, 1>(o, D, ph, n, vc, rows, first, len, add);
      h += take;
    }
  }
}

void weighted_sum_any(float* out, const float* p, const float* v_cache, const Rows& rows, int64_t first,
                      int64_t len, int64_t D, bool add) {
  if (!add) std::fill(out, out + D, 0.f);
  for (int64_t pos = first; pos < len; ++pos) {
    const float* v = rows.at(v_cache, pos);
    const float w = p[pos - first];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] += w * v[d];
  }
}

// out[h] = sum over the positions of p[h][pos] * v_pos, for the G heads reading kv head's values;
// add: out[h] += that sum
void weighted_sums(float* out, const float* p, int64_t n, const float* v_cache, const Rows& rows, int64_t first,
                   int64_t len, int64_t G, int64_t D, bool add) {
  switch (D % Vec::size() == 0 ? D / Vec::size() : 0) {
    case 1: return weighted_sum_group<1>(out, D, p, n, v_cache, rows, first, len, G, add);
    case 2: return weighted_sum_group<2>(out, D, p, n, v_cache, rows, first, len, G, add);
    case 4: return weighted_sum_group<4>(out, D, p, n, v_cache, rows, first, len, G, add);
    case 8: return weighted_sum_group<8>(out, D, p, n, v_cache, rows, first, len, G, add);
    case 16: return weighted_sum_group<16>(out, D, p, n, v_cache, rows, first, len, G, add);
  }
  for (int64_t h = 0; h < G; ++h) weighted_sum_any(out + h * D, p + h * n, v_cache, rows, first, len, D, add);
}

// x[i] = exp(x[i] * scale - max_j x[j] * scale) in place (scale > 0); returns their sum. Two passes
// over x; ATen's exp_u20, as its own flash attention uses (its u10 exp was 10% of the kernel's time)
float softmax_numerators(float* x, int64_t n, float scale) {
  constexpr int64_t W = Vec::size();
  const Vec vs(scale);
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= W) {
    Vec m = Vec::loadu(x);
    for (i = W; i + W <= n; i += W) m = at::vec::maximum(m, Vec::loadu(x + i));
    mx = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return at::vec::maximum(u, v); }, m);
  }
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  const Vec vm(mx * scale);
  Vec acc(0.f);
  for (i = 0; i + W <= n; i += W) {
    const Vec e = (Vec::loadu(x + i) * vs - vm).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, acc);
  for (; i < n; ++i) sum += x[i] = std::exp(x[i] * scale - mx * scale);
  return sum;
}

// A unit of decode work: one sequence, or several whose first `shared` positions sit in the same
// blocks (a common system prompt, the choices of n > 1). A tile reads those keys and values a
// chunk at a time for all its members while the chunk is in L1, where one sequence at a time
// would stream them once per member from L2 or memory.
struct Tile {
  std::vector<int64_t> seqs;
  int64_t shared;  // whole blocks' positions, before every member's newest block
};

constexpr int64_t SHARED_CHUNK = 16;  // positions of shared keys (or values) per pass over a tile's members
constexpr int64_t TILE_MEMBERS = 16;

// The sequences grouped by their first block, each group's common run of blocks found, and its
// members cut into tiles of even size: at least one per thread, at most TILE_MEMBERS members each
std::vector<Tile> decode_tiles(const int64_t* tables, const int64_t* lens, int64_t B, int64_t max_blocks,
                               int64_t block_size, bool shareable) {
  std::vector<int64_t> order(B);
  std::iota(order.begin(), order.end(), 0);
  const auto first_block = [&](int64_t b) { return tables[b * max_blocks]; };
  if (shareable)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return first_block(a) < first_block(b); });
  std::vector<Tile> tiles;
  for (int64_t i = 0, j; i < B; i = j) {
    for (j = i + 1; shareable && j < B && first_block(order[j]) == first_block(order[i]);) ++j;
    const int64_t* lead = tables + order[i] * max_blocks;
    int64_t common = j - i > 1 ? max_blocks : 0;
    for (int64_t k = i; k < j && common > 0; ++k) {
      const int64_t* table = tables + order[k] * max_blocks;
      common = std::min(common, (lens[order[k]] - 1) / block_size);
      int64_t c = 0;
      while (c < common && table[c] == lead[c]) ++c;
      common = c;
    }
    const int64_t m = j - i;
    const int64_t count = common == 0 ? m
        : std::max((m + TILE_MEMBERS - 1) / TILE_MEMBERS, std::min<int64_t>(at::get_num_threads(), m));
    for (int64_t t = 0; t < count; ++t) {
      Tile tile{{}, common * block_size};
      for (int64_t k = i + t * m / count; k < i + (t + 1) * m / count; ++k) tile.seqs.push_back(order[k]);
      tiles.push_back(std::move(tile));
    }
  }
  return tiles;
}

// out[b, h] = softmax(q[b, h] . K[b] * scale) @ V[b] over the visible keys of sequence b, whose
// slots are block_tables[b][pos / block_size] * block_size + pos % block_size. One work item per
// tile (above): a pass over its keys, then one over its values, block by block, each cached row
// read once for all the query heads that share it (GQA) and, in a tile's shared blocks, for all
// its members.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale,
                            int64_t sliding_window) {
  check_float(out, "paged_decode_attention out");
  check_float(q, "paged_decode_attention q");
  check_float(k_cache, "paged_decode_attention k_cache");
  check_float(v_cache, "paged_decode_attention v_cache");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1), num_slots = k_cache.size(0);
  TORCH_CHECK(H == G * KVH && k_cache.size(2) == D && context_lens.size(0) == B && block_tables.size(0) == B);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t num_blocks = num_slots / block_size;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "context longer than its block table");
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block outside the cache");
    }
  }
  // a sliding window hides a different start of the context from each member: no sharing
  const std::vector<Tile> tiles = decode_tiles(tables, lens, B, max_blocks, block_size, sliding_window <= 0);
  const auto first = [&](int64_t b) { return sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) : 0; };
  const auto rows = [&](int64_t b) { return Rows{tables + b * max_blocks, block_size, KVH * D}; };
  // The costliest tiles first, each thread taking the next one as it finishes: a static split of
  // contexts of different lengths (a chat's turns) left one thread waiting on the other
  const int64_t count = tiles.size();
  std::vector<int64_t> cost(count, 0), order(count);
  for (int64_t t = 0; t < count; ++t)
    for (int64_t b : tiles[t].seqs) cost[t] += lens[b] - first(b);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, sums;  // sums[i * H + h]: member i's head h's softmax numerators, summed
    std::vector<int64_t> offsets;
    for (int64_t i; (i = next.fetch_add(1)) < count;) {
      const std::vector<int64_t>& seqs = tiles[order[i]].seqs;
      const int64_t shared = tiles[order[i]].shared, members = seqs.size();
      offsets.assign(1, 0);  // member i's scores: [H][n] at offsets[i], n = lens[b] - first(b)
      for (int64_t b : seqs) offsets.push_back(offsets.back() + H * (lens[b] - first(b)));
      scores.resize(offsets.back());
      sums.resize(members * H);
      for (int64_t pos = 0; pos < shared; pos += SHARED_CHUNK) {  // shared keys: first == 0 here
        const int64_t stop = std::min(shared, pos + SHARED_CHUNK);
        for (int64_t i = 0; i < members; ++i) {
          const int64_t b = seqs[i];
          key_scores(scores.data() + offsets[i] + pos, lens[b], qp + b * H * D, kp, rows(b), pos, stop, H, G, D,
                     fscale);
        }
      }
      for (int64_t i = 0; i < members; ++i) {  // each member's own keys, softmax, own values
        const int64_t b = seqs[i], len = lens[b], start = first(b) + shared, n = len - first(b);
        float* s = scores.data() + offsets[i];
        key_scores(s + shared, n, qp + b * H * D, kp, rows(b), start, len, H, G, D, fscale);
        for (int64_t h = 0; h < H; ++h) sums[i * H + h] = softmax_numerators(s + h * n, n, 1.f);  // already scaled
        for (int64_t g = 0; g < KVH; ++g)
          weighted_sums(op + b * H * D + g * G * D, s + g * G * n + shared, n, vp + g * D, rows(b), start, len, G, D,
                        false);
      }
      for (int64_t pos = 0; pos < shared; pos += SHARED_CHUNK) {  // shared values, added
        const int64_t stop = std::min(shared, pos + SHARED_CHUNK);
        for (int64_t i = 0; i < members; ++i) {
          const int64_t b = seqs[i], n = lens[b];
          for (int64_t g = 0; g < KVH; ++g)
            weighted_sums(op + b * H * D + g * G * D, scores.data() + offsets[i] + g * G * n + pos, n, vp + g * D,
                          rows(b), pos, stop, G, D, true);
        }
      }
      for (int64_t i = 0; i < members; ++i) {  // divided by the softmax sums
        float* o = op + seqs[i] * H * D;
        for (int64_t h = 0; h < H; ++h) {
          const float inv = 1.f / sums[i * H + h];
          for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inv;
        }
      }
    }
  });
}

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

int64_t grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)); }

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

// all M rows against panels [p, p + np); next: the thread's next group of np_next panels, or null
void panel_group(int64_t M, float* y, const float* x, const float* panels, const float* bias, int64_t K,
                 int64_t N, int64_t p, int64_t np, const float* next, int64_t np_next) {
  const float* w = panels + p * K * 16;
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
        panel_group(rows, y + m0 * N, x + m0 * K, panels, bias, K, N, p, np,
                    np_next ? panels + (p + np) * K * 16 : nullptr, np_next);
      }
    });
  }
}

// [K, N] panels for N outputs; the bias, if any, as a pointer
const float* check_panels(const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t K, int64_t N) {
  check_float(panels, "panels");
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == 3 && panels.size(1) == K && panels.size(2) == 16 &&
              panels.size(0) == (N + 15) / 16, "panels of the wrong shape");
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
  if (M > 0) panel_gemm(out.data_ptr<float>(), x.data_ptr<float>(), panels.data_ptr<float>(), bp, M, K, N);
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
  const int64_t M = x.size(0), H = x.size(1), N = out.size(1), I = down.size(1);
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
    panel_gemm(gu.data_ptr<float>(), xp + m0 * H, gate_up.data_ptr<float>(), gub, rows, H, 2 * I);
    silu_mul_rows(act.data_ptr<float>(), gu.data_ptr<float>(), rows, I);
    panel_gemm(op + m0 * N, act.data_ptr<float>(), down.data_ptr<float>(), db, rows, I, N);
  }
}

// Prefill attention over the paged cache: out[i, h] = softmax(q[i, h] . K * scale) @ V for the
// chunk's tokens i (positions start + i), each over the keys it sees (positions up to its own,
// within the sliding window if any), read through the chunk's block table. SDPA with a mask (a
// chunk after a cached prefix) ran at about half the speed of its own QK matmul here; this is two
// GEMMs on the panel tiles above (1.4-1.8x faster than SDPA per layer on the AVX2 host, see
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

// One decoder layer of `engine.models.llama` (pre-norm attention, then a SiLU MLP) for a packed
// step, as one op: the same kernels in the same order as the model's per-op path, so the same
// result bit for bit, without ~20 Python-level calls per layer in between (at one decoding
// sequence those took a fifth of the step). In place: residual += x, then x = the layer's output
// (the next layer's norm adds it). Keys and values of the step's tokens go to their cache slots.
// prefill_bounds: (start, end, start_pos) per prefill chunk, each read through its own table.
void decoder_layer(at::Tensor x, at::Tensor residual, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& input_norm, const at::Tensor& qkv_panels,
                   const c10::optional<at::Tensor>& qkv_bias,
                   const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                   const at::Tensor& o_panels, const c10::optional<at::Tensor>& o_bias, const at::Tensor& post_norm,
                   const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                   const c10::optional<at::Tensor>& down_bias, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping, int64_t num_decodes,
                   const c10::optional<at::Tensor>& decode_block_tables,
                   const c10::optional<at::Tensor>& decode_context_lens, at::IntArrayRef prefill_bounds,
                   at::TensorList prefill_tables, int64_t num_heads, double eps, int64_t block_size, double scale,
                   int64_t sliding_window) {
  check_float(k_cache, "decoder_layer k_cache");
  check_float(v_cache, "decoder_layer v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes());
  const int64_t T = x.size(0), KVH = k_cache.size(1), D = k_cache.size(2), H = num_heads;
  const int64_t q_size = H * D, kv_size = KVH * D, num_slots = k_cache.size(0);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T);
  TORCH_CHECK(prefill_bounds.size() == 3 * prefill_tables.size(), "three bounds per prefill chunk");
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= T);
  add_rms_norm(x, residual, input_norm, eps);
  at::Tensor qkv = at::empty({T, q_size + 2 * kv_size}, x.options());
  panel_linear(qkv, x, qkv_panels, qkv_bias);
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
  add_rms_norm(o, residual, post_norm, eps);
  silu_mlp(x, o, gate_up, gate_up_bias, down, down_bias);
}

}  // namespace

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
  m.def("decoder_layer(Tensor(a!) x, Tensor(b!) residual, Tensor cos, Tensor sin, Tensor input_norm, "
        "Tensor qkv_panels, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, Tensor o_panels, Tensor? o_bias, "
        "Tensor post_norm, Tensor gate_up, Tensor? gate_up_bias, Tensor down, Tensor? down_bias, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, int num_decodes, Tensor? decode_block_tables, "
        "Tensor? decode_context_lens, int[] prefill_bounds, Tensor[] prefill_tables, int num_heads, float eps, "
        "int block_size, float scale, int sliding_window) -> ()");
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
  m.impl("decoder_layer", decoder_layer);
}
"""

def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "".join(lines)


def _flags(cpu: str) -> list[str]:
    """-march=native ties the build to this CPU (its name carries the CPU's identity too); ATen's
    vectorised math (exp) is told the widest vector set the CPU has, as torch's own kernels are;
    no FMA contraction, so elementwise ops round as torch's separate multiplies and adds do.
    -fopenmp because at::parallel_for is a header-inline `omp parallel`: compiled without it, every
    kernel ran on one thread whatever torch.set_num_threads said (decode attention took 29% of a
    32-sequence step at two threads). The library's libgomp.so.1 resolves to the one torch loaded."""
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off"]
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():  # GCC; Apple's clang lacks it
        flags.append("-fopenmp")
    cpu_flags = set(cpu.split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags:
        flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif {"avx2", "fma"} <= cpu_flags:
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def _build_name(flags: list[str], cpu: str, source: str = _SOURCE) -> str:
    digest = hashlib.sha256((source + " ".join(flags) + cpu + torch.__version__).encode())
    return f"galley_cpu_kernels_{digest.hexdigest()[:12]}"


STALE_LOCK_S = 900.0  # a build lock this old was left by a killed process


def _load_or_build(flags: list[str], cpu: str, source: str = _SOURCE) -> None:
    """Load the cached library directly when it exists: torch's builder would take its file lock and
    run ninja on every start, and a process killed holding that lock (SIGKILL in the first seconds)
    would make every later start wait on it forever. Build only when it is missing. `source`: another
    build's (bench/kernels_ab.py), under its own op namespace."""
    from torch.utils.cpp_extension import get_default_build_root, load_inline

    name = _build_name(flags, cpu, source)
    directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    library = directory / f"{name}.so"
    if library.is_file():
        torch.ops.load_library(str(library))
        return
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    openmp = [flag for flag in flags if flag == "-fopenmp"]
    load_inline(name, cpp_sources=source, extra_cflags=flags, extra_ldflags=openmp, is_python_module=False,
                build_directory=str(directory))


class CpuKernels:
    """The build of the kernels, shared by every engine of the process (a library of torch ops
    can be loaded once per process). Invariant: `ops` is set only once the library is loaded;
    other threads see either None or the ready namespace `torch.ops.galley_cpu`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.ops = None
        self.failed = False

    def start(self) -> None:
        """Build or load the kernels in a background thread (once per process)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, name="galley-kernel-build", daemon=True)
                self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Start if needed and block until the build ends; True when the kernels are usable."""
        self.start()
        assert self._thread is not None
        self._thread.join(timeout_s)
        return self.ops is not None

    def _build(self) -> None:
        try:
            cpu = _cpu_identity()
            _load_or_build(_flags(cpu), cpu)
            self.ops = torch.ops.galley_cpu
            log.info("cpu kernels ready")
        except Exception as exc:  # no compiler, no headers: the torch path serves
            self.failed = True
            log.warning("cpu kernels unavailable; using the torch path", error=str(exc)[-500:])


CPU_KERNELS = CpuKernels()
