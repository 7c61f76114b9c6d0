// Where the model's weights live: NUMA expert slices and locked dense weights (model.h).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "model/dense_part.h"
#include "model/model.h"
#include "ops/matmul.h"
#include "ops/moe.h"
#include "platform/mapped_file.h"

namespace m3 {
namespace {

// The matrices every token reads (model/dense_part.h), optionally without the MoE shared experts
// and the lm_head.
std::vector<simd::WeightRef*> DenseMatrices(ModelWeights& w, bool shared_experts, bool lm_head) {
  std::vector<simd::WeightRef*> out;
  ForEachDenseMatrix(w, shared_experts, lm_head, [&](const char*, simd::WeightRef& m) { out.push_back(&m); });
  return out;
}

size_t Align64(size_t n) { return (n + 63) / 64 * 64; }

}  // namespace

Status Model::PlaceOnNodes(const Topology& topology, int nodes, int threads) {
  M3_RETURN_IF_ERROR(SplitExperts(topology, nodes));
  // Dense matrices: one copy, each node's pages holding the row tiles its pinned threads compute
  // (MatMul's static split: thread t takes tiles [T t / n, T (t + 1) / n)), so every thread reads
  // node-local weights whatever the page cache held before. Small and hot, and each byte is still
  // stored once.
  // (The shared experts are in the expert slices; a tied lm_head is the embedding: left mapped.)
  std::vector<simd::WeightRef*> dense =
      DenseMatrices(weights_, /*shared_experts=*/false, /*lm_head=*/!config_.tie_word_embeddings);
  size_t total = 0;
  for (const simd::WeightRef* w : dense) {
    const simd::StoredSpan all = simd::RowTileSpan(*w, 0, MatMulRowTiles(*w));
    total += Align64(all.data_bytes) + Align64(all.scale_bytes);
  }
  M3_ASSIGN_OR_RETURN(NodeBuffer buffer, NodeBuffer::Allocate(topology, topology.nodes[0].id, std::max<size_t>(total, 64)));
  auto* base = static_cast<uint8_t*>(buffer.data());
  size_t offset = 0;
  auto place = [&](const uint8_t* src, size_t bytes, const simd::WeightRef& w, bool scales) -> StatusOr<uint8_t*> {
    uint8_t* dst = base + offset;
    const size_t tiles = MatMulRowTiles(w);
    for (int n = 0; n < nodes; ++n) {
      // Tiles of the threads pinned to node n, as ParallelFor splits them (when tiles >= threads).
      const auto [t_first, t_last] = NodeThreads(n, threads, nodes);
      const size_t tile0 = tiles * static_cast<size_t>(t_first) / static_cast<size_t>(threads);
      const size_t tile1 = tiles * static_cast<size_t>(t_last) / static_cast<size_t>(threads);
      const simd::StoredSpan before = simd::RowTileSpan(w, 0, tile0), span = simd::RowTileSpan(w, tile0, tile1);
      M3_RETURN_IF_ERROR(buffer.BindRange(topology, offset + (scales ? before.scale_bytes : before.data_bytes),
                                          scales ? span.scale_bytes : span.data_bytes,
                                          topology.nodes[static_cast<size_t>(n)].id));
    }
    std::memcpy(dst, src, bytes);  // the first touch: pages fault in on the bound nodes
    offset += Align64(bytes);
    return dst;
  };
  for (simd::WeightRef* w : dense) {
    const simd::StoredSpan all = simd::RowTileSpan(*w, 0, MatMulRowTiles(*w));
    M3_ASSIGN_OR_RETURN(uint8_t* data, place(all.data, all.data_bytes, *w, false));
    const uint8_t* scales = nullptr;
    if (all.scale_bytes) {
      M3_ASSIGN_OR_RETURN(uint8_t* s, place(all.scales, all.scale_bytes, *w, true));
      scales = s;
    }
    if (pack_) {  // the mapped original is no longer read
      const uint8_t* file = pack_->file().data();
      pack_->file().DontNeed(static_cast<size_t>(all.data - file), all.data_bytes);
    }
    w->data = data;
    w->scales = scales;
  }
  dense_memory_ = std::make_shared<NodeBuffer>(std::move(buffer));
  return Status::Ok();
}

StatusOr<std::string> Model::Place(NumaMode mode, int threads, bool dense, int simulated_nodes) {
  std::string placement = std::string("numa ") + NumaModeName(mode);
  if (mode == NumaMode::kOff) return placement;
  M3_ASSIGN_OR_RETURN(const Topology topology, DetectTopology(simulated_nodes));
  // A node without a thread would leave its slices uncomputed: at most one node per thread.
  const int nodes = std::min(static_cast<int>(topology.nodes.size()), threads);
  if (mode == NumaMode::kSplit && nodes > 1)
    M3_RETURN_IF_ERROR(dense ? PlaceOnNodes(topology, nodes, threads) : SplitExperts(topology, nodes));
  M3_RETURN_IF_ERROR(PinThreads(topology, mode, threads, nodes));
  return placement + " over " + std::to_string(nodes) + " of " + topology.Describe();
}

Status Model::SplitExperts(const Topology& topology, int nodes) {
  auto split_layer = [&](LayerWeights& L) -> Status {
    if (!L.is_moe) return Status::Ok();
    M3_ASSIGN_OR_RETURN(L.moe.split,
                        BuildMoeSplit(topology, nodes, L.moe.experts, L.moe.has_shared ? &L.moe.shared : nullptr));
    // The mapped copies are now read only by the fallback path (fewer threads than nodes).
    for (const std::vector<MemoryRange>& ranges : L.moe.expert_memory)
      for (const MemoryRange& r : ranges)
        if (pack_ && r.data)
          pack_->file().DontNeed(static_cast<size_t>(static_cast<const uint8_t*>(r.data) - pack_->file().data()),
                                 r.bytes);
    return Status::Ok();
  };
  for (LayerWeights& L : weights_.layers) M3_RETURN_IF_ERROR(split_layer(L));
  for (MtpWeights& m : weights_.mtp) M3_RETURN_IF_ERROR(split_layer(m.layer));
  return Status::Ok();
}

const MoeWeights* Model::MoeOfLayer(int layer) const {
  if (layer < 0) return nullptr;
  const size_t l = static_cast<size_t>(layer);
  const LayerWeights* L = l < weights_.layers.size() ? &weights_.layers[l]
                          : l - weights_.layers.size() < weights_.mtp.size() ? &weights_.mtp[l - weights_.layers.size()].layer
                                                                              : nullptr;
  return L && L->is_moe ? &L->moe : nullptr;
}

StatusOr<uint64_t> Model::LockDenseWeights() {
  uint64_t bytes = 0;
  for (const simd::WeightRef* m : DenseMatrices(weights_, /*shared_experts=*/true, /*lm_head=*/true)) {
    const simd::StoredSpan all = simd::RowTileSpan(*m, 0, MatMulRowTiles(*m));
    M3_RETURN_IF_ERROR(LockInMemory(all.data, all.data_bytes));
    M3_RETURN_IF_ERROR(LockInMemory(all.scales, all.scale_bytes));
    bytes += all.data_bytes + all.scale_bytes;
  }
  return bytes;
}

}  // namespace m3
