// SwiGLU-OAI feed-forward (dense MLP, and the shared and routed experts of the MoE, ops/moe.h).
//
//   g = x.Wg^T, u = x.Wu^T                      Wg, Wu: [I, H]
//   a = min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + beta)
//   y = a.Wd^T                                  Wd: [H, I]
#pragma once

#include <cstddef>

#include "ops/context.h"
#include "platform/parallel.h"
#include "simd/weight_format.h"

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

// out[n, H] = SwiGLU-OAI MLP of x[n, H].
void MlpForward(const OpContext& tc, const MlpWeights& w, const SwigluParams& act, const float* x, size_t n,
                float* out);

// In place: g[i] = swiglu_oai(g[i], u[i]) for i < n; NaN where g[i] or u[i] is NaN or infinite.
void SwigluOai(float* g, const float* u, size_t n, const SwigluParams& p);

}  // namespace m3
