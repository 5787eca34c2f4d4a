// Linears over a GGUF file's own quantized blocks (`engine.block_panels`), the way llama.cpp keeps
// them: the panels of panel_gemm.h (16 output features each), cut along K into blocks, each 16
// scales, 16 mins (float32, one per feature) and the codes; w = code * scale + min.
//   Q4: 32 k per block of 384 bytes, codes[k][8] bytes: feature i in the low nibble, i + 8 in the high
//   Q8: 16 k per block of 384 bytes, codes[k][16] int8
//   Q8S: 32 k per block of 576 bytes, no mins (Q8_0: w = code * scale), codes[k][16] int8
// One to four rows read each block's codes in registers and sum x_k * code_k, then take the block's
// scale and min once (block_tile: one FMA a weight and row, not three). More rows de-quantize a
// group of panels into a thread's float panels that panel_group then runs (the decoding shared by
// every tile). Never in memory as a whole: the weights stay near the file's size, a quarter to a half
// of float32's bytes per token. Every format's code * scale is exact in float32 (module docstring of
// engine.block_panels), so a weight is the float the `gguf` package de-quantizes to: from five rows
// each output equals the de-quantized model's bit for bit (the float tiles' FMAs in their order);
// one to four rows sum the same products in another order, equal to float32's rounding.
#pragma once

#include "common.h"
#include "panel_gemm.h"

namespace {

constexpr int64_t BLOCK_BYTES = 384;  // Q4's and Q8's
constexpr int64_t Q8S_BYTES = 576;

#if defined(CPU_CAPABILITY_AVX2)
// w = code * scale + min as one FMA: code * scale is exact, so this rounds as the multiply, then add
inline __m256 scaled(__m256 codes, const uint8_t* block, int64_t half) {
  const float* scale = reinterpret_cast<const float*>(block) + 8 * half;
  return _mm256_fmadd_ps(codes, _mm256_loadu_ps(scale), _mm256_loadu_ps(scale + 16));
}
#endif

struct Q4 {
  static constexpr int64_t K = 32, BYTES = BLOCK_BYTES;
  static constexpr bool MINS = true;
#if defined(CPU_CAPABILITY_AVX2)
  // the 16 codes of row k of the block as floats in two vectors (features 0-7, 8-15): each byte
  // widened to a 32-bit lane, then its low and high nibbles
  static inline void codes(const uint8_t* block, int64_t k, __m256& c0, __m256& c1) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 128 + k * 8)));
    c0 = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(0x0F)));
    c1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
  }
  static inline void weights(const uint8_t* block, int64_t k, __m256& w0, __m256& w1) {
    codes(block, k, w0, w1);
    w0 = scaled(w0, block, 0);
    w1 = scaled(w1, block, 1);
  }
#else
  static float weight(const uint8_t* block, int64_t k, int64_t j) {
    const float* scale = reinterpret_cast<const float*>(block);
    const uint8_t c = block[128 + k * 8 + j % 8];
    return static_cast<float>(j < 8 ? c & 0x0F : c >> 4) * scale[j] + scale[16 + j];
  }
#endif
};

// 8-bit codes[k][16] after the block's scales, and its mins where it has them: Q8 (16 k, mins) and
// Q8S (Q8_0: 32 k, no mins, w = code * scale)
template <int64_t KB, int64_t BYTES_, bool MINS_>
struct Int8Blocks {
  static constexpr int64_t K = KB, BYTES = BYTES_, CODES = MINS_ ? 128 : 64;
  static constexpr bool MINS = MINS_;
#if defined(CPU_CAPABILITY_AVX2)
  static inline void codes(const uint8_t* block, int64_t k, __m256& c0, __m256& c1) {
    const uint8_t* row = block + CODES + k * 16;
    c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row))));
    c1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8))));
  }
  static inline void weights(const uint8_t* block, int64_t k, __m256& w0, __m256& w1) {
    codes(block, k, w0, w1);
    if constexpr (MINS) {
      w0 = scaled(w0, block, 0);
      w1 = scaled(w1, block, 1);
    } else {
      const float* scale = reinterpret_cast<const float*>(block);
      w0 = _mm256_mul_ps(w0, _mm256_loadu_ps(scale));
      w1 = _mm256_mul_ps(w1, _mm256_loadu_ps(scale + 8));
    }
  }
#else
  static float weight(const uint8_t* block, int64_t k, int64_t j) {
    const float* scale = reinterpret_cast<const float*>(block);
    const float w = static_cast<float>(reinterpret_cast<const int8_t*>(block + CODES)[k * 16 + j]) * scale[j];
    return MINS ? w + scale[16 + j] : w;
  }
#endif
};
using Q8 = Int8Blocks<16, BLOCK_BYTES, true>;
using Q8S = Int8Blocks<32, Q8S_BYTES, false>;

// a block's weights as float panel rows: out[k][16] for its F::K k
template <class F>
void decode(float* out, const uint8_t* block) {
#if defined(CPU_CAPABILITY_AVX2)
  for (int64_t k = 0; k < F::K; ++k) {
    __m256 w0, w1;
    F::weights(block, k, w0, w1);
    _mm256_storeu_ps(out + k * 16, w0);
    _mm256_storeu_ps(out + k * 16 + 8, w1);
  }
#else
  for (int64_t k = 0; k < F::K; ++k)
    for (int64_t j = 0; j < 16; ++j) out[k * 16 + j] = F::weight(block, k, j);
#endif
}

// rows [0, MR) of y against panel p (MR <= SMALL_ROWS). AVX2: factored per block, sum_k x_k w_k =
// scale * sum_k x_k code_k + min * sum_k x_k, so a weight costs its code's conversion and one FMA a
// row, not the two FMAs of de-quantizing it first; `xsums` [MR][K / F::K] holds each block's sum of
// x. Else the FMAs of tile<MR, 1> over each block de-quantized into a buffer in L1.
template <class F, int64_t MR>
void block_tile(float* y, const float* x, const float* xsums, const uint8_t* panel, const float* bias, int64_t K,
                int64_t N, int64_t p) {
  const int64_t n0 = p * 16, count = std::min<int64_t>(16, N - n0), nb = K / F::K;
#if defined(CPU_CAPABILITY_AVX2)
  __m256 acc[MR][2];
  for (auto& r : acc) r[0] = r[1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = panel + b * F::BYTES;
    const float* xb = x + b * F::K;
    // U interleaved sums per vector: one row's FMAs would otherwise wait on each other's latency
    constexpr int64_t U = MR == 1 ? 4 : 2;
    __m256 dot[MR][2 * U];
#pragma GCC unroll 2
    for (int64_t m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int64_t i = 0; i < 2 * U; ++i) dot[m][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < F::K; k += U) {
#pragma GCC unroll 4
      for (int64_t u = 0; u < U; ++u) {
        __m256 c0, c1;
        F::codes(block, k + u, c0, c1);
#pragma GCC unroll 2
        for (int64_t m = 0; m < MR; ++m) {
          const __m256 xv = _mm256_broadcast_ss(xb + m * K + k + u);
          dot[m][2 * u] = _mm256_fmadd_ps(xv, c0, dot[m][2 * u]);
          dot[m][2 * u + 1] = _mm256_fmadd_ps(xv, c1, dot[m][2 * u + 1]);
        }
      }
    }
    const float* scale = reinterpret_cast<const float*>(block);
#pragma GCC unroll 2
    for (int64_t m = 0; m < MR; ++m) {
      const __m256 xs = _mm256_broadcast_ss(xsums + m * nb + b);
#pragma GCC unroll 2
      for (int64_t h = 0; h < 2; ++h) {
        __m256 sum = dot[m][h];
#pragma GCC unroll 4
        for (int64_t u = 1; u < U; ++u) sum = _mm256_add_ps(sum, dot[m][2 * u + h]);
        acc[m][h] = _mm256_fmadd_ps(sum, _mm256_loadu_ps(scale + 8 * h), acc[m][h]);
        if constexpr (F::MINS) acc[m][h] = _mm256_fmadd_ps(xs, _mm256_loadu_ps(scale + 16 + 8 * h), acc[m][h]);
      }
    }
  }
  // as tile's: through a buffer, and a whole panel copied by vectors (a store into y per row here, or
  // store_panel's loop for every panel, kept the accumulators in memory: 3.4x slower at one row, GCC 12)
  alignas(32) float rows[MR][16];
  for (int64_t m = 0; m < MR; ++m) {
    _mm256_store_ps(rows[m], acc[m][0]);
    _mm256_store_ps(rows[m] + 8, acc[m][1]);
  }
  if (count == 16 && !bias) {
    for (int64_t m = 0; m < MR; ++m) {
      _mm256_storeu_ps(y + m * N + n0, _mm256_load_ps(rows[m]));
      _mm256_storeu_ps(y + m * N + n0 + 8, _mm256_load_ps(rows[m] + 8));
    }
    return;
  }
  for (int64_t m = 0; m < MR; ++m) store_panel(y + m * N + n0, rows[m], bias, n0, count);
#else
  (void)xsums;
  alignas(64) float row[16];
  constexpr int64_t W = Vec::size(), NV = 16 / W;
  alignas(64) float w[F::K * 16];
  Vec acc[MR][NV];
  for (auto& r : acc)
    for (auto& a : r) a = Vec(0.f);
  for (int64_t b = 0; b < nb; ++b) {
    decode<F>(w, panel + b * F::BYTES);
    const float* xb = x + b * F::K;
    for (int64_t k = 0; k < F::K; ++k)
      for (int64_t v = 0; v < NV; ++v) {
        const Vec wv = Vec::loadu(w + k * 16 + v * W);
        for (int64_t m = 0; m < MR; ++m) acc[m][v] = at::vec::fmadd(Vec(xb[m * K + k]), wv, acc[m][v]);
      }
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t v = 0; v < NV; ++v) acc[m][v].store(row + v * W);
    store_panel(y + m * N + n0, row, bias, n0, count);
  }
#endif
}

// Rows de-quantized in registers: up to four, two at a time (each pair decodes the panel again).
// In one tile of 3-6 rows GCC 12 kept block_tile's accumulators in memory (a store after every
// FMA, 2-3x slower; the float tile's same loop does not). SmolLM2's Q4_1 file, decode steps A/B
// in one process (bench/kernels_ab.py): 3 and 4 sequences 1.26-1.27x faster as pairs than through
// a buffer of float panels; 5 and 6 0.79-0.86x as pairs, so those take the buffer.
constexpr int64_t SMALL_ROWS = 4;

// y[0:M] = x[0:M] @ W.T (+ bias) for W as blocks [P][K / F::K][BLOCK_BYTES]
template <class F>
void block_gemm(float* y, const float* x, const uint8_t* blocks, const float* bias, int64_t M, int64_t K,
                int64_t N) {
  const int64_t P = (N + 15) / 16, panel_bytes = K / F::K * F::BYTES;
  if (M <= SMALL_ROWS) {  // each panel decoded per pair of rows, block by block, beside its FMAs
    const int64_t nb = K / F::K;
    std::vector<float> xsums(M * nb);  // each row's sum over each block's k
    for (int64_t i = 0; i < M * nb; ++i) xsums[i] = std::accumulate(x + i * F::K, x + (i + 1) * F::K, 0.f);
    at::parallel_for(0, P, 1, [&](int64_t first, int64_t last) {
      for (int64_t p = first; p < last; ++p)
        for (int64_t m = 0; m < M; m += 2)
          (M - m == 1 ? block_tile<F, 1> : block_tile<F, 2>)(y + m * N, x + m * K, xsums.data() + m * nb,
                                                             blocks + p * panel_bytes, bias, K, N, p);
    });
    return;
  }
  const int64_t groups = (P + GROUP_PANELS - 1) / GROUP_PANELS;
  for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
    const int64_t rows = std::min(CHUNK_ROWS, M - m0);
    at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
      std::vector<float> panels(GROUP_PANELS * K * 16);  // the group de-quantized: [np][K][16]
      for (int64_t g = first; g < last; ++g) {
        const int64_t p = g * GROUP_PANELS, np = std::min(GROUP_PANELS, P - p);
        for (int64_t j = 0; j < np; ++j)
          for (int64_t b = 0; b < K / F::K; ++b)
            decode<F>(panels.data() + (j * K + b * F::K) * 16, blocks + (p + j) * panel_bytes + b * F::BYTES);
        panel_group(rows, y + m0 * N, x + m0 * K, panels.data(), bias, K, N, p, np, nullptr, 0);
      }
    });
  }
}

// a weight's block format from its panels: uint8 Q4; int8 Q8, or Q8S by its block's bytes
bool is_q8s(const at::Tensor& weight) { return weight.scalar_type() == at::kChar && weight.size(2) == Q8S_BYTES; }

// K of a weight's panels: float [P, K, 16] or blocks [P, K / block k, block bytes]
int64_t panel_inputs(const at::Tensor& weight) {
  const int64_t per_row = weight.scalar_type() == at::kByte ? Q4::K
                          : weight.scalar_type() == at::kChar ? (is_q8s(weight) ? Q8S::K : Q8::K) : 1;
  return weight.size(1) * per_row;
}

// y = x @ W.T (+ bias), W float panels or blocks: its dtype says which (float32, uint8 Q4, int8 Q8)
void weight_gemm(float* y, const float* x, const at::Tensor& weight, const float* bias, int64_t M, int64_t K,
                 int64_t N) {
  switch (weight.scalar_type()) {
    case at::kFloat: return panel_gemm(y, x, weight.data_ptr<float>(), bias, M, K, N);
    case at::kByte: return block_gemm<Q4>(y, x, static_cast<const uint8_t*>(weight.data_ptr()), bias, M, K, N);
    case at::kChar:
      return (is_q8s(weight) ? block_gemm<Q8S> : block_gemm<Q8>)(y, x, static_cast<const uint8_t*>(weight.data_ptr()),
                                                                 bias, M, K, N);
    default: TORCH_CHECK(false, "weights must be float32 panels, uint8 Q4 or int8 Q8/Q8S blocks");
  }
}

}  // namespace
