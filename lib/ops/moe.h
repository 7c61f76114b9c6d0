// The MoE block (docs/MODEL.md §3.8): an fp32 sigmoid router whose correction bias is used only to
// choose, top-k routed SwiGLU-OAI experts, a shared expert and a routed scaling factor.
//
//   s = sigmoid(x.Wr^T); chosen = top-k of s + bias (ties -> lower id)
//   w_k = s[chosen_k] / sum_k s[chosen_k] * routed_scaling
//   y = Shared(x) + sum_k w_k Expert_k(x)
//
// MoeForward routes every token, then runs the whole block in ONE parallel region, in phases
// separated by barriers (never one per expert): (A) gather and quantize each expert's tokens,
// (B) gate and up row tiles of every chosen expert and the shared one, (C) SwiGLU and quantize,
// (D) down row tiles, (E) combine in slot order. Decode and prefill take the same path: for one
// token every expert is a GEMV, for a prompt each expert's weights are read once for all of its
// tokens (a GEMM). Each phase's work is split into contiguous shares of equal cost (tiles times
// tokens), so skewed routing is spread over every thread. Each output element is computed by one
// thread in a fixed order: results are identical for any thread count and batch composition.
// With a NUMA split (w.split), phases B and D give each node's threads that node's row slices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops/mlp.h"
#include "ops/moe_numa.h"
#include "ops/context.h"
#include "platform/parallel.h"
#include "simd/weight_format.h"

namespace m3 {

// Bytes of one routed expert in memory (a packed file keeps gate, up and down in one range).
struct MemoryRange {
  const void* data = nullptr;
  size_t bytes = 0;
};

struct MoeWeights {
  simd::WeightRef router;                  // [E, H], fp32 in the release
  std::vector<float> router_bias;          // [E] e_score_correction_bias (zeros when unused)
  std::vector<MlpWeights> experts;         // E routed experts
  std::vector<MemoryRange> expert_memory;  // [E] for prefetching chosen experts; empty: none known
  bool has_shared = false;
  MlpWeights shared;
  std::shared_ptr<const MoeSplit> split;   // --numa split: node-local row slices (ops/moe_numa.h)
};

struct MoeParams {
  int top_k = 1;
  float routed_scaling = 1.0f;
  bool use_bias = true;
  SwigluParams act;
};

// Router decision for one token: ids[k] and weights[k] (scaled), from fp32 router logits [E].
// A NaN logit or bias gives the chosen ids as if it were -inf and every weight NaN.
void RouteToken(const float* logits, const std::vector<float>& bias, const MoeParams& p, int32_t* ids,
                float* weights);

// out[n, H] = MoE block of x[n, H]. Optional `routed_ids` [n, top_k] receives the chosen experts.
// The chosen experts' memory is advised as needed soon (madvise) right after routing, so a model
// streamed from disk reads them in parallel rather than fault by fault.
void MoeForward(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                float* out, int32_t* routed_ids = nullptr);

// The routed experts alone, for routes chosen elsewhere (ids and weights [n, top_k], as
// RouteToken gives): out[n, H] = sum_k w_k Expert_k(x), in the same phases and order as
// MoeForward. The offloaded forward pass (lib/offload) runs the router and the shared expert on
// the GPU and this on the CPU.
void MoeRoutedForward(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                      const int32_t* ids, const float* weights, float* out);

}  // namespace m3
