// SwiGLU-OAI feed-forward (dense MLP, shared expert, routed experts) and the MoE block.
//
//   g = x.Wg^T, u = x.Wu^T                      Wg, Wu: [I, H]
//   a = min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + beta)
//   y = a.Wd^T                                  Wd: [H, I]
// MoE: s = sigmoid(x.Wr^T) (fp32 router), experts = top-k of s + bias (ties -> lower id),
// weights = s[chosen] / sum * routed_scaling; y = sum_k w_k Expert_k(x) + Shared(x).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "platform/parallel.h"
#include "weight_format.h"

namespace m3 {

struct MlpWeights {
  simd::WeightRef gate;  // [I, H]
  simd::WeightRef up;    // [I, H]
  simd::WeightRef down;  // [H, I]
};

struct SwigluParams {
  float alpha = 1.702f;
  float limit = 7.0f;
  float beta = 1.0f;
};

struct MoeWeights {
  simd::WeightRef router;             // [E, H], fp32 in the release
  std::vector<float> router_bias;     // [E] e_score_correction_bias (zeros when unused)
  std::vector<MlpWeights> experts;    // E routed experts
  bool has_shared = false;
  MlpWeights shared;
};

struct MoeParams {
  int top_k = 1;
  float routed_scaling = 1.0f;
  bool use_bias = true;
  SwigluParams act;
};

// out[n, H] = SwiGLU-OAI MLP of x[n, H].
void MlpForward(const ThreadConfig& tc, const MlpWeights& w, const SwigluParams& act, const float* x, size_t n,
                float* out);

// Router decision for one token: ids[k] and weights[k] (scaled), from fp32 router logits [E].
void RouteToken(const float* logits, const std::vector<float>& bias, const MoeParams& p, int32_t* ids,
                float* weights);

// out[n, H] = MoE block of x[n, H]. Optional `routed_ids` [n, top_k] receives the chosen experts.
void MoeForward(const ThreadConfig& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                float* out, int32_t* routed_ids = nullptr);

// In place: g[i] = swiglu_oai(g[i], u[i]) for i < n.
void SwigluOai(float* g, const float* u, size_t n, const SwigluParams& p);

}  // namespace m3
