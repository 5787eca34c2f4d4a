// Decode attention over the paged KV cache: one query token per sequence, each sequence's keys and
// values read once, in place, through its block table (paged_decode_attention, at the end).

#include "attention.h"

namespace {

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

}  // namespace
