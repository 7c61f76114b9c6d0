#include "model/dense_part.h"

#include <algorithm>

#include "base/bytes.h"
#include "ops/matmul.h"

namespace m3 {

int64_t DensePart::params() const {
  int64_t n = 0;
  for (const DensePartGroup& g : groups) n += g.params;
  return n;
}

uint64_t DensePart::bytes() const {
  uint64_t n = 0;
  for (const DensePartGroup& g : groups) n += g.bytes;
  return n;
}

DensePart MeasureDensePart(const ModelConfig& config, const ModelWeights& weights) {
  DensePart part;
  auto group = [&](const char* name) -> DensePartGroup& {
    for (DensePartGroup& g : part.groups)
      if (g.name == name) return g;
    part.groups.push_back({name, 0, 0});
    return part.groups.back();
  };
  ForEachDenseMatrix(weights, /*shared_experts=*/true, /*lm_head=*/true,
                     [&](const char* name, const simd::WeightRef& m) {
                       const simd::StoredSpan all = simd::RowTileSpan(m, 0, MatMulRowTiles(m));
                       DensePartGroup& g = group(name);
                       g.params += static_cast<int64_t>(m.rows) * static_cast<int64_t>(m.cols);
                       g.bytes += all.data_bytes + all.scale_bytes;
                     });
  // Every fp32 vector: norms, q/k norms, router biases.
  DensePartGroup& vectors = group("norms and vectors");
  auto add = [&](const std::vector<float>& v) {
    vectors.params += static_cast<int64_t>(v.size());
    vectors.bytes += v.size() * sizeof(float);
  };
  auto layer = [&](const LayerWeights& L) {
    for (const auto* v :
         {&L.input_norm, &L.post_norm, &L.attn.q_norm, &L.attn.k_norm, &L.attn.index_q_norm, &L.attn.index_k_norm})
      add(*v);
    if (L.is_moe && config.use_routing_bias) add(L.moe.router_bias);  // else zeros the checkpoint does not have
  };
  for (const LayerWeights& L : weights.layers) layer(L);
  for (const MtpWeights& m : weights.mtp) {
    for (const auto* v : {&m.enorm, &m.hnorm, &m.final_norm}) add(*v);
    layer(m.layer);
  }
  add(weights.final_norm);
  return part;
}

GpuFootprint EstimateGpuFootprint(const ModelConfig& config, const DensePart& dense, const CacheOptions& cache,
                                  size_t context) {
  GpuFootprint f;
  f.weight_bytes = dense.bytes();
  f.cache_bytes = KvCache(CacheShapeOf(config), cache).BytesFor(context);
  f.context = context;
  f.cache = cache;
  return f;
}

Status CheckGpuFits(const GpuFootprint& f, const std::string& gpu, uint64_t free_bytes) {
  if (f.total() <= free_bytes) return Status::Ok();
  const bool weights_fit = f.weight_bytes <= free_bytes;
  return Status(
      StatusCode::kOutOfMemory,
      Str("the dense part needs ", FormatBytes(f.weight_bytes), " and its caches ", FormatBytes(f.cache_bytes), " for ",
          f.context, " tokens (", CacheTypeName(f.cache.kv), " K/V, ", CacheTypeName(f.cache.index_keys),
          " index keys); ", gpu, " has ", FormatBytes(free_bytes), " free: ",
          weights_fit ? "use a shorter context or smaller cache types (--kv-cache, --index-cache)"
                      : "the weights alone do not fit; run without the GPU"));
}

size_t LongestGpuContext(const ModelConfig& config, const DensePart& dense, const CacheOptions& cache,
                         uint64_t free_bytes) {
  if (dense.bytes() > free_bytes) return 0;
  const KvCache caches(CacheShapeOf(config), cache);
  const uint64_t room = free_bytes - dense.bytes();
  // The caches grow by whole pages (BytesFor never shrinks with more tokens): the largest count that fits.
  size_t lo = 0, hi = static_cast<size_t>(std::max<int64_t>(0, config.max_position_embeddings));
  while (lo < hi) {
    const size_t mid = lo + (hi - lo + 1) / 2;
    if (caches.BytesFor(mid) <= room) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace m3
