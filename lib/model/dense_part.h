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

}  // namespace m3
