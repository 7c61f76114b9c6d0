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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "base/status.h"
#include "ops/matmul.h"
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

// A MoE block whose experts are shared out over several processes (lib/cluster): process `index` of
// `count` holds row slice `index` (PartTiles) of every expert's gate, up and down, computes those
// rows alone, and the processes exchange what the others need: each its SwiGLU activation columns
// (so that every process can run its down rows over whole activation rows) and then its columns
// of the block's output. Nothing is summed across processes: every output element is computed by
// one process exactly as one process alone computes it, so the results are bit for bit those of
// one process whatever the number of processes or the network's timing.
struct MoePart {
  int index = 0;
  int count = 1;
};

// Row tiles [first, last) of a matrix with `rows` rows in slice `part.index` of `part.count`.
inline std::pair<size_t, size_t> PartTiles(size_t rows, const MoePart& part) {
  return NodeTiles((rows + kMatMulRowTile - 1) / kMatMulRowTile, part.index, part.count);
}

// Columns [first, last) of a row of `width` values that process `part.index` computes (and sends).
inline std::pair<size_t, size_t> PartColumns(size_t width, const MoePart& part) {
  const auto [t0, t1] = PartTiles(width, part);
  return {std::min(width, t0 * kMatMulRowTile), std::min(width, t1 * kMatMulRowTile)};
}

struct MoeWeights {
  simd::WeightRef router;                  // [E, H], fp32 in the release
  std::vector<float> router_bias;          // [E] e_score_correction_bias (zeros when unused)
  // E routed experts: whole, or with a part this process's row slices of gate, up and down (their
  // widths then come from down.cols, the intermediate size, and gate.cols, the hidden size).
  std::vector<MlpWeights> experts;
  // [E] the bytes of each expert this process reads, for prefetching chosen experts (one range for
  // a packed expert, its slices' ranges with a part); empty: none known.
  std::vector<std::vector<MemoryRange>> expert_memory;
  bool has_shared = false;
  MlpWeights shared;                       // whole, or this process's slice with a part
  std::shared_ptr<const MoeSplit> split;   // --numa split: node-local row slices (ops/moe_numa.h)
  MoePart part;                            // one process: {0, 1}
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

// The router alone: ids and weights [n, top_k] as MoeForward chooses them.
void MoeRoute(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, int32_t* ids,
              float* weights);

// How the processes of a part (MoePart) move values between them; lib/cluster implements it over MPI.
class MoeExchange {
 public:
  virtual ~MoeExchange() = default;
  // Every process gives its counts[its index] floats `own` and receives every process's, in
  // process order, into `all` (the sum of counts, its own included).
  virtual Status AllGather(const float* own, std::span<const size_t> counts, float* all) = 0;
  // The same, but only process 0 receives (`all` is not written elsewhere).
  virtual Status Gather(const float* own, std::span<const size_t> counts, float* all) = 0;
};

// Runs the MoE blocks of forward passes in place of MoeForward: lib/cluster's expert parallelism,
// where other processes compute slices of the experts. `layer` indexes the decoder layers, then
// the MTP layers after them (Model::MoeOfLayer).
class MoeRunner {
 public:
  virtual ~MoeRunner() = default;
  virtual Status Run(const OpContext& tc, int layer, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                     float* out, int32_t* routed_ids) const = 0;
};

// The block with only slice `part` of each expert (views of w's memory, nothing copied), and
// expert_memory narrowed to the slices' bytes. w must be whole.
MoeWeights MoePartOf(const MoeWeights& w, const MoePart& part);

// This process's part (w.part) of the block for routes chosen by one of them (MoeRoute) and given
// to all with x: ids and weights [n, top_k]. Process 0 gets the whole out[n, H], equal bit for bit
// to MoeForward's; the others' `out` holds only their columns. Fails when the exchange does.
Status MoePartForward(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                      const int32_t* ids, const float* weights, MoeExchange& exchange, float* out);

}  // namespace m3
