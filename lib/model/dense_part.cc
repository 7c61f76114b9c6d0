#include "model/dense_part.h"

#include "ops/matmul.h"

namespace m3 {

void ForEachDenseMatrix(ModelWeights& w, bool shared_experts, bool lm_head,
                        const std::function<void(const char* group, simd::WeightRef& m)>& fn) {
  auto add = [&](const char* group, simd::WeightRef& m) {
    if (m.data) fn(group, m);
  };
  auto layer = [&](LayerWeights& L) {
    for (simd::WeightRef* m : {&L.attn.q, &L.attn.k, &L.attn.v, &L.attn.o}) add("attention", *m);
    for (simd::WeightRef* m : {&L.attn.index_q, &L.attn.index_k}) add("indexer", *m);
    if (L.is_moe) add("router", L.moe.router);
    MlpWeights* mlp = L.is_moe ? (shared_experts && L.moe.has_shared ? &L.moe.shared : nullptr) : &L.mlp;
    const char* group = L.is_moe ? "shared experts" : "dense MLP";
    if (mlp) add(group, mlp->gate), add(group, mlp->up), add(group, mlp->down);
  };
  for (LayerWeights& L : w.layers) layer(L);
  for (MtpWeights& m : w.mtp) {
    add("MTP projection", m.eh_proj);
    layer(m.layer);
  }
  if (lm_head) add("lm_head", w.lm_head);
}

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
  // The visitor takes the weights as mutable (placement rebinds them); nothing here writes.
  ModelWeights& w = const_cast<ModelWeights&>(weights);
  ForEachDenseMatrix(w, /*shared_experts=*/true, /*lm_head=*/true, [&](const char* name, simd::WeightRef& m) {
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
    for (const auto* v : {&L.input_norm, &L.post_norm, &L.attn.q_norm, &L.attn.k_norm, &L.attn.index_q_norm,
                          &L.attn.index_k_norm})
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

}  // namespace m3
