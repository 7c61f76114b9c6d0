// The dense part of a model: every weight a decode token reads in full, that is all but the routed
// experts and the embedding table (of which a token reads one row). It is what `--mlock-dense` locks,
// what NUMA placement copies to node 0, and what an accelerator holding "the dense layers" would hold
// (issue 34: attention and indexer projections, routers, shared experts, dense MLPs, MTP projections,
// the LM head, and the norms).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "ops/kv_cache.h"
#include "model/weights.h"

namespace m3 {

// Calls fn(group, matrix) for every dense matrix that is bound, in layer order. Groups: "attention",
// "indexer", "router", "dense MLP", "shared experts" (when shared_experts), "MTP projection" and
// "lm_head" (when lm_head; the embedding itself when tied). `Weights` is ModelWeights (placement
// rebinds the matrices) or const ModelWeights (measuring).
template <class Weights, class Fn>
void ForEachDenseMatrix(Weights& w, bool shared_experts, bool lm_head, Fn&& fn) {
  auto add = [&](const char* group, auto& m) {
    if (m.data) fn(group, m);
  };
  auto layer = [&](auto& L) {
    for (auto* m : {&L.attn.q, &L.attn.k, &L.attn.v, &L.attn.o}) add("attention", *m);
    for (auto* m : {&L.attn.index_q, &L.attn.index_k}) add("indexer", *m);
    if (L.is_moe) add("router", L.moe.router);
    auto* mlp = L.is_moe ? (shared_experts && L.moe.has_shared ? &L.moe.shared : nullptr) : &L.mlp;
    const char* group = L.is_moe ? "shared experts" : "dense MLP";
    if (mlp) add(group, mlp->gate), add(group, mlp->up), add(group, mlp->down);
  };
  for (auto& L : w.layers) layer(L);
  for (auto& m : w.mtp) {
    add("MTP projection", m.eh_proj);
    layer(m.layer);
  }
  if (lm_head) add("lm_head", w.lm_head);
}

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
