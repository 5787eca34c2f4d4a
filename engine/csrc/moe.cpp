// A mixture of experts' MLP (`engine.models.moe.SparseMoe`) for a packed step, as one op.

#include "common.h"
#include "panel_gemm.h"
#include "block_gemm.h"

namespace {

// out = the routed experts' MLPs of x [T, H]: router logits by the router's panels; softmax in float32
// and top k by ATen's own ops (the per-op path's, so the same experts and weights), renormalised to
// sum to 1 if `normalize`; then each expert once on its tokens (gathered rows, silu_mlp, as the per-op
// path runs it), each token's weighted outputs added in expert order as transformers adds them.
// experts: gate_up then down panels of each expert, in expert order.
void moe_mlp(at::Tensor out, const at::Tensor& x, const at::Tensor& router, at::TensorList experts, int64_t top_k,
             bool normalize) {
  check_float(out, "moe_mlp out");
  check_float(x, "moe_mlp x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes());
  TORCH_CHECK(experts.size() % 2 == 0 && !experts.empty(), "gate_up and down panels per expert");
  const int64_t T = x.size(0), H = x.size(1), E = static_cast<int64_t>(experts.size()) / 2;
  TORCH_CHECK(0 < top_k && top_k <= E, "top k outside the experts");
  at::Tensor logits = at::empty({T, E}, x.options());
  panel_linear(logits, x, router, c10::nullopt);
  auto [weights, chosen] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
  if (normalize) weights.div_(weights.sum(-1, true));
  weights = weights.contiguous();
  chosen = chosen.contiguous();
  const float* wp = weights.data_ptr<float>();
  const int64_t* cp = chosen.data_ptr<int64_t>();
  // the (token, k) pairs by expert, tokens in order within one (a counting sort: stable)
  std::vector<int64_t> starts(E + 1, 0), pairs(T * top_k);
  for (int64_t i = 0; i < T * top_k; ++i) {
    TORCH_CHECK(0 <= cp[i] && cp[i] < E, "router chose no expert");
    ++starts[cp[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t i = 0; i < T * top_k; ++i) pairs[next[cp[i]]++] = i;
  out.zero_();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = starts[e + 1] - starts[e];
    if (count == 0) continue;
    at::Tensor rows = at::empty({count, H}, x.options()), y = at::empty({count, H}, x.options());
    float* rp = rows.data_ptr<float>();
    for (int64_t j = 0; j < count; ++j) std::copy_n(xp + pairs[starts[e] + j] / top_k * H, H, rp + j * H);
    silu_mlp(y, rows, experts[2 * e], c10::nullopt, experts[2 * e + 1], c10::nullopt);
    const float* yp = y.data_ptr<float>();
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pair = pairs[starts[e] + j];
      const float w = wp[pair];
      float* o = op + pair / top_k * H;
      const float* yr = yp + j * H;
      for (int64_t h = 0; h < H; ++h) o[h] += yr[h] * w;  // product, then sum: index_add_ of y * w
    }
  }
}

}  // namespace
