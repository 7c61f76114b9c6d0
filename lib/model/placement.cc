// Where the model's weights live: NUMA expert slices and locked dense weights (model.h).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "model/model.h"
#include "ops/matmul.h"
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

namespace {

// Bytes of row tiles [t0, t1) of w in its data, and in its scales (row-major formats: 16 rows).
std::pair<size_t, size_t> TileBytes(const simd::WeightRef& w, size_t t0, size_t t1) {
  const size_t rows0 = std::min(w.rows, t0 * simd::kTileRows), rows1 = std::min(w.rows, t1 * simd::kTileRows);
  if (simd::IsTiled(w.format)) {
    const size_t scale_tile = w.format == simd::WeightFormat::kBF16Tiled ? 0 : w.groups() * simd::kTileRows * 2;
    return {(t1 - t0) * w.tile_bytes(), (t1 - t0) * scale_tile};
  }
  const size_t scale_row = w.format == simd::WeightFormat::kE4M3Mx32 ? w.scale_cols() : 0;
  return {(rows1 - rows0) * w.cols * simd::ElementBytes(w.format), (rows1 - rows0) * scale_row};
}

size_t Align64(size_t n) { return (n + 63) / 64 * 64; }

// The dense matrices (all but routed experts and an untied embedding), each once.
std::vector<simd::WeightRef*> DenseMatrices(ModelWeights& w, bool tied) {
  std::vector<simd::WeightRef*> out;
  auto layer = [&](LayerWeights& L) {
    for (simd::WeightRef* m : {&L.attn.q, &L.attn.k, &L.attn.v, &L.attn.o, &L.attn.index_q, &L.attn.index_k})
      if (m->data) out.push_back(m);
    if (L.is_moe) {
      out.push_back(&L.moe.router);
    } else {
      out.push_back(&L.mlp.gate), out.push_back(&L.mlp.up), out.push_back(&L.mlp.down);
    }
  };
  for (LayerWeights& L : w.layers) layer(L);
  for (MtpWeights& m : w.mtp) {
    if (m.eh_proj.data) out.push_back(&m.eh_proj);
    layer(m.layer);
  }
  if (!tied) out.push_back(&w.lm_head);  // tied: the embedding, read one row per token: left mapped
  return out;
}

}  // namespace

Status Model::PlaceOnNodes(const Topology& topology, int nodes, int threads) {
  M3_RETURN_IF_ERROR(SplitExperts(topology, nodes));
  // Dense matrices: one copy, each node's pages holding the row tiles its pinned threads compute
  // (MatMul's static split: thread t takes tiles [T t / n, T (t + 1) / n)), so every thread reads
  // node-local weights whatever the page cache held before. Small and hot, and each byte is still
  // stored once.
  std::vector<simd::WeightRef*> dense = DenseMatrices(weights_, config_.tie_word_embeddings);
  size_t total = 0;
  for (const simd::WeightRef* w : dense) {
    const auto [data, scales] = TileBytes(*w, 0, MatMulRowTiles(*w));
    total += Align64(data) + Align64(scales);
  }
  M3_ASSIGN_OR_RETURN(NodeBuffer buffer, NodeBuffer::Allocate(topology, topology.nodes[0].id, std::max<size_t>(total, 64)));
  auto* base = static_cast<uint8_t*>(buffer.data());
  size_t offset = 0;
  auto place = [&](const uint8_t* src, size_t bytes, const simd::WeightRef& w, bool scales) -> StatusOr<uint8_t*> {
    uint8_t* dst = base + offset;
    const size_t tiles = MatMulRowTiles(w);
    for (int n = 0; n < nodes; ++n) {
      // Tiles of the threads pinned to node n (NodeOfThread's contiguous blocks).
      const size_t t_first = static_cast<size_t>((n * threads + nodes - 1) / nodes);
      const size_t t_last = static_cast<size_t>(((n + 1) * threads + nodes - 1) / nodes);
      const size_t tile0 = tiles * t_first / static_cast<size_t>(threads), tile1 = tiles * t_last / static_cast<size_t>(threads);
      const auto before = TileBytes(w, 0, tile0), span = TileBytes(w, tile0, tile1);
      M3_RETURN_IF_ERROR(buffer.BindRange(topology, offset + (scales ? before.second : before.first),
                                          scales ? span.second : span.first, topology.nodes[static_cast<size_t>(n)].id));
    }
    std::memcpy(dst, src, bytes);  // the first touch: pages fault in on the bound nodes
    offset += Align64(bytes);
    return dst;
  };
  for (simd::WeightRef* w : dense) {
    const auto [data_bytes, scale_bytes] = TileBytes(*w, 0, MatMulRowTiles(*w));
    M3_ASSIGN_OR_RETURN(uint8_t* data, place(static_cast<const uint8_t*>(w->data), data_bytes, *w, false));
    const uint8_t* scales = nullptr;
    if (w->scales && scale_bytes) {
      M3_ASSIGN_OR_RETURN(uint8_t* s, place(w->scales, scale_bytes, *w, true));
      scales = s;
    }
    if (pack_) {  // the mapped original is no longer read
      const uint8_t* file = pack_->file().data();
      pack_->file().DontNeed(static_cast<size_t>(static_cast<const uint8_t*>(w->data) - file), data_bytes);
    }
    w->data = data;
    w->scales = scales;
  }
  dense_memory_ = std::make_shared<NodeBuffer>(std::move(buffer));
  return Status::Ok();
}

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
