#include "ops/mlp.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/aligned_buffer.h"
#include "kernels.h"
#include "ops/matmul.h"

namespace m3 {

void SwigluOai(float* g, const float* u, size_t n, const SwigluParams& p) {
  for (size_t i = 0; i < n; ++i) {
    const float gc = std::min(g[i], p.limit);  // gate: upper clamp only (spec G10)
    const float uc = std::clamp(u[i], -p.limit, p.limit);
    const float sig = 1.0f / (1.0f + std::exp(-p.alpha * gc));
    g[i] = gc * sig * (uc + p.beta);
  }
}

void MlpForward(const ThreadConfig& tc, const MlpWeights& w, const SwigluParams& act, const float* x, size_t n,
                float* out) {
  const size_t inter = w.gate.rows, hidden = w.gate.cols;
  AlignedBuffer<float> g(n * inter), u(n * inter);
  MatMul(tc, w.gate, x, hidden, n, g.data(), inter);
  MatMul(tc, w.up, x, hidden, n, u.data(), inter);
  SwigluOai(g.data(), u.data(), n * inter, act);
  MatMul(tc, w.down, g.data(), inter, n, out, hidden);
}

void RouteToken(const float* logits, const std::vector<float>& bias, const MoeParams& p, int32_t* ids,
                float* weights) {
  const size_t e = bias.size();
  std::vector<float> score(e), choice(e);
  for (size_t i = 0; i < e; ++i) {
    score[i] = 1.0f / (1.0f + std::exp(-logits[i]));
    choice[i] = p.use_bias ? score[i] + bias[i] : score[i];
    if (std::isnan(choice[i])) choice[i] = -INFINITY;
  }
  std::vector<int32_t> order(e);
  std::iota(order.begin(), order.end(), 0);
  // Highest biased score first; ties go to the lower expert id (spec G22).
  std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), [&](int32_t a, int32_t b) {
    return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
  });
  float sum = 0;
  for (int k = 0; k < p.top_k; ++k) sum += score[order[k]];
  for (int k = 0; k < p.top_k; ++k) {
    ids[k] = order[k];
    weights[k] = score[order[k]] / sum * p.routed_scaling;  // unbiased sigmoid, renormalized
  }
}

void MoeForward(const ThreadConfig& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                float* out, int32_t* routed_ids) {
  const size_t hidden = w.router.cols;
  const size_t n_exp = w.router.rows;
  const size_t k = static_cast<size_t>(p.top_k);

  AlignedBuffer<float> logits(n * n_exp);
  MatMul(tc, w.router, x, hidden, n, logits.data(), n_exp);
  std::vector<int32_t> ids(n * k);
  std::vector<float> weights(n * k);
  for (size_t t = 0; t < n; ++t) RouteToken(logits.data() + t * n_exp, w.router_bias, p, &ids[t * k], &weights[t * k]);
  if (routed_ids) std::copy(ids.begin(), ids.end(), routed_ids);

  // Group (token, slot) pairs by expert so each expert's weights are read once for all its tokens.
  std::vector<std::vector<size_t>> assigned(n_exp);
  for (size_t i = 0; i < n * k; ++i) assigned[static_cast<size_t>(ids[i])].push_back(i);
  AlignedBuffer<float> slot_out(n * k * hidden);  // expert output per (token, slot)
  AlignedBuffer<float> xe, ye;
  for (size_t e = 0; e < n_exp; ++e) {
    const auto& rows = assigned[e];
    if (rows.empty()) continue;
    xe.EnsureSize(rows.size() * hidden);
    ye.EnsureSize(rows.size() * hidden);
    for (size_t r = 0; r < rows.size(); ++r)
      std::copy_n(x + (rows[r] / k) * hidden, hidden, xe.data() + r * hidden);
    MlpForward(tc, w.experts[e], p.act, xe.data(), rows.size(), ye.data());
    for (size_t r = 0; r < rows.size(); ++r)
      std::copy_n(ye.data() + r * hidden, hidden, slot_out.data() + rows[r] * hidden);
  }
  // Combine in slot order (a fixed order, so any thread count gives the same sums).
  if (w.has_shared) {
    MlpForward(tc, w.shared, p.act, x, n, out);
  } else {
    std::fill_n(out, n * hidden, 0.0f);
  }
  for (size_t t = 0; t < n; ++t) {
    for (size_t s = 0; s < k; ++s)
      simd::Axpy(weights[t * k + s], slot_out.data() + (t * k + s) * hidden, out + t * hidden, hidden);
  }
}

}  // namespace m3
