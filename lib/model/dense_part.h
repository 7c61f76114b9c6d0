// The dense part of a model: every weight a decode token reads in full, that is all but the routed
// experts and the embedding table (of which a token reads one row). It is what `--mlock-dense` locks,
// what NUMA placement copies to node 0, and what an accelerator holding "the dense layers" would hold
// (issue 34: attention and indexer projections, routers, shared experts, dense MLPs, MTP projections,
// the LM head, and the norms).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/kv_cache.h"
#include "model/weights.h"

namespace m3 {

// Calls fn(group, matrix) for every dense matrix that is bound, in layer order. Groups: "attention",
// "indexer", "router", "dense MLP", "shared experts" (when shared_experts), "MTP projection" and
// "lm_head" (when lm_head; the embedding itself when tied).
void ForEachDenseMatrix(ModelWeights& w, bool shared_experts, bool lm_head,
                        const std::function<void(const char* group, simd::WeightRef& m)>& fn);

struct DensePartGroup {
  std::string name;
  int64_t params = 0;
  uint64_t bytes = 0;  // as stored (packed codes and scales, or the checkpoint's type)
};

struct DensePart {
  std::vector<DensePartGroup> groups;  // the matrices by group, then "norms and vectors" (fp32)
  int64_t params() const;
  uint64_t bytes() const;
};

DensePart MeasureDensePart(const ModelConfig& config, const ModelWeights& w);

// What the dense part and the caches of a context take on an accelerator that holds them (issue
// 34: the routed experts stay in host memory): the weights as stored, the K/V and index-key caches.
struct GpuFootprint {
  uint64_t weight_bytes = 0;
  uint64_t cache_bytes = 0;  // for `context` tokens, whole pages as the caches allocate them
  size_t context = 0;
  CacheOptions cache;
  uint64_t total() const { return weight_bytes + cache_bytes; }
};
GpuFootprint EstimateGpuFootprint(const ModelConfig& config, const DensePart& dense, const CacheOptions& cache,
                                  size_t context);
// Ok when the footprint fits in `free_bytes` of the GPU named `gpu`; otherwise OutOfMemory with
// what the dense part and its caches need, what the GPU has and what to change.
Status CheckGpuFits(const GpuFootprint& footprint, const std::string& gpu, uint64_t free_bytes);
// The longest context (up to the model's maximum) whose caches fit beside the dense part in
// `free_bytes`; 0 when not even the weights fit.
size_t LongestGpuContext(const ModelConfig& config, const DensePart& dense, const CacheOptions& cache,
                         uint64_t free_bytes);

}  // namespace m3
