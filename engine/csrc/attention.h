// What the decode and prefill attention kernels share: finding a cached position's row through a
// sequence's block table, and the softmax's numerators.
#pragma once

#include "common.h"

namespace {

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

}  // namespace
