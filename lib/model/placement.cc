// Where the model's weights live: NUMA expert slices and locked dense weights (model.h).
#include <vector>

#include "model/model.h"
#include "ops/moe.h"
#include "platform/mapped_file.h"

namespace m3 {
namespace {

// The bytes a weight reads: its elements (codes) and scales, as stored.
void AppendMemory(const simd::WeightRef& w, std::vector<MemoryRange>* out) {
  if (!w.data) return;
  if (simd::IsTiled(w.format)) {
    out->push_back({w.data, simd::TiledCodeBytes(w)});
    if (w.scales) out->push_back({w.scales, simd::TiledScaleBytes(w)});
    return;
  }
  out->push_back({w.data, w.rows * w.cols * simd::ElementBytes(w.format)});
  if (w.format == simd::WeightFormat::kE4M3Mx32 && w.scales) out->push_back({w.scales, w.rows * w.scale_cols()});
}

void AppendMlp(const MlpWeights& m, std::vector<MemoryRange>* out) {
  AppendMemory(m.gate, out);
  AppendMemory(m.up, out);
  AppendMemory(m.down, out);
}

void AppendLayer(const LayerWeights& L, std::vector<MemoryRange>* out) {
  for (const simd::WeightRef* w : {&L.attn.q, &L.attn.k, &L.attn.v, &L.attn.o, &L.attn.index_q, &L.attn.index_k})
    AppendMemory(*w, out);
  if (!L.is_moe) return AppendMlp(L.mlp, out);
  AppendMemory(L.moe.router, out);
  if (L.moe.has_shared) AppendMlp(L.moe.shared, out);
}

}  // namespace

Status Model::SplitExperts(const Topology& topology, int nodes) {
  auto split_layer = [&](LayerWeights& L) -> Status {
    if (!L.is_moe) return Status::Ok();
    M3_ASSIGN_OR_RETURN(L.moe.split,
                        BuildMoeSplit(topology, nodes, L.moe.experts, L.moe.has_shared ? &L.moe.shared : nullptr));
    // The mapped copies are now read only by the fallback path (fewer threads than nodes).
    for (const MemoryRange& r : L.moe.expert_memory)
      if (pack_ && r.data)
        pack_->file().DontNeed(static_cast<size_t>(static_cast<const uint8_t*>(r.data) - pack_->file().data()),
                               r.bytes);
    return Status::Ok();
  };
  for (LayerWeights& L : weights_.layers) M3_RETURN_IF_ERROR(split_layer(L));
  for (MtpWeights& m : weights_.mtp) M3_RETURN_IF_ERROR(split_layer(m.layer));
  return Status::Ok();
}

StatusOr<uint64_t> Model::LockDenseWeights() const {
  std::vector<MemoryRange> ranges;
  for (const LayerWeights& L : weights_.layers) AppendLayer(L, &ranges);
  for (const MtpWeights& m : weights_.mtp) {
    AppendMemory(m.eh_proj, &ranges);
    AppendLayer(m.layer, &ranges);
  }
  AppendMemory(weights_.lm_head, &ranges);  // the embedding too when tied (the same bytes)
  uint64_t bytes = 0;
  for (const MemoryRange& r : ranges) {
    M3_RETURN_IF_ERROR(LockInMemory(r.data, r.bytes));
    bytes += r.bytes;
  }
  return bytes;
}

}  // namespace m3
