#include "ops/moe_numa.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "ops/matmul.h"
#include "platform/parallel.h"

namespace m3 {

StatusOr<NumaMode> ParseNumaMode(const std::string& name) {
  if (name == "off") return NumaMode::kOff;
  if (name == "distribute") return NumaMode::kDistribute;
  if (name == "split") return NumaMode::kSplit;
  return InvalidArgument("--numa: unknown mode '", name, "' (off, distribute or split)");
}

const char* NumaModeName(NumaMode mode) {
  return mode == NumaMode::kOff ? "off" : mode == NumaMode::kDistribute ? "distribute" : "split";
}

namespace {

size_t RoundUp64(size_t n) { return (n + 63) / 64 * 64; }

// Rows [tile0 * 16, min(rows, tile1 * 16)) of w as a weight of its own.
simd::WeightRef SliceShape(const simd::WeightRef& w, size_t tile0, size_t tile1) {
  simd::WeightRef s = w;
  s.rows = std::min(w.rows, tile1 * kMatMulRowTile) - std::min(w.rows, tile0 * kMatMulRowTile);
  return s;
}

size_t SliceBytes(const simd::WeightRef& w, size_t tile0, size_t tile1) {
  if (tile0 >= tile1) return 0;
  const simd::StoredSpan r = simd::RowTileSpan(w, tile0, tile1);
  return RoundUp64(r.data_bytes) + RoundUp64(r.scale_bytes);
}

// Copies rows of tiles [tile0, tile1) of w to dst; returns the slice as a weight there.
simd::WeightRef CopySlice(const simd::WeightRef& w, size_t tile0, size_t tile1, uint8_t*& dst) {
  simd::WeightRef s = RowTileView(w, tile0, tile1);
  if (tile0 >= tile1) return s;
  const simd::StoredSpan r = simd::RowTileSpan(w, tile0, tile1);
  std::memcpy(dst, r.data, r.data_bytes);
  s.data = dst;
  dst += RoundUp64(r.data_bytes);
  if (r.scale_bytes) {
    std::memcpy(dst, r.scales, r.scale_bytes);
    s.scales = dst;
    dst += RoundUp64(r.scale_bytes);
  } else {
    s.scales = nullptr;
  }
  return s;
}

}  // namespace

simd::WeightRef RowTileView(const simd::WeightRef& w, size_t tile0, size_t tile1) {
  simd::WeightRef s = SliceShape(w, tile0, tile1);
  if (tile0 >= tile1) {
    s.data = nullptr;
    s.scales = nullptr;
    return s;
  }
  const simd::StoredSpan r = simd::RowTileSpan(w, tile0, tile1);
  s.data = r.data;
  s.scales = r.scale_bytes ? r.scales : nullptr;
  return s;
}

StatusOr<std::shared_ptr<const MoeSplit>> BuildMoeSplit(const Topology& topology, int nodes,
                                                        const std::vector<MlpWeights>& experts,
                                                        const MlpWeights* shared) {
  if (nodes < 1 || static_cast<size_t>(nodes) > topology.nodes.size())
    return InvalidArgument("MoE split over ", nodes, " nodes: the topology has ", topology.nodes.size());
  auto split = std::make_shared<MoeSplit>();
  split->nodes = nodes;
  split->slices.assign(static_cast<size_t>(nodes), {});
  split->memory = std::make_shared<std::vector<NodeBuffer>>();
  std::vector<const MlpWeights*> all;
  for (const MlpWeights& e : experts) all.push_back(&e);
  if (shared) all.push_back(shared);
  for (int n = 0; n < nodes; ++n) {
    // One buffer per node holding its slices of every expert, in expert order.
    size_t bytes = 0;
    for (const MlpWeights* e : all) {
      const auto [g0, g1] = NodeTiles(MatMulRowTiles(e->gate), n, nodes);
      const auto [d0, d1] = NodeTiles(MatMulRowTiles(e->down), n, nodes);
      bytes += SliceBytes(e->gate, g0, g1) + SliceBytes(e->up, g0, g1) + SliceBytes(e->down, d0, d1);
    }
    M3_ASSIGN_OR_RETURN(NodeBuffer buf, NodeBuffer::Allocate(topology, topology.nodes[static_cast<size_t>(n)].id,
                                                             std::max<size_t>(bytes, 64)));
    auto* dst = static_cast<uint8_t*>(buf.data());
    for (const MlpWeights* e : all) {
      const auto [g0, g1] = NodeTiles(MatMulRowTiles(e->gate), n, nodes);
      const auto [d0, d1] = NodeTiles(MatMulRowTiles(e->down), n, nodes);
      ExpertSlice s;
      s.gate_up_tile0 = g0;
      s.down_tile0 = d0;
      s.local.gate = CopySlice(e->gate, g0, g1, dst);
      s.local.up = CopySlice(e->up, g0, g1, dst);
      s.local.down = CopySlice(e->down, d0, d1, dst);
      split->slices[static_cast<size_t>(n)].push_back(s);
    }
    split->memory->push_back(std::move(buf));
  }
  return std::shared_ptr<const MoeSplit>(std::move(split));
}

Status PinThreads(const Topology& topology, NumaMode mode, int threads, int nodes) {
  if (mode == NumaMode::kOff) return Status::Ok();
  std::vector<int> round_robin;  // distribute: node 0's first CPU, node 1's first, ..., then the seconds
  for (size_t i = 0;; ++i) {
    bool any = false;
    for (const NumaNode& node : topology.nodes)
      if (i < node.cpus.size()) round_robin.push_back(node.cpus[i]), any = true;
    if (!any) break;
  }
  std::vector<Status> results(static_cast<size_t>(threads));
  ParallelRegion(ThreadConfig{threads}, [&](int tid, int nt, auto) {
    if (mode == NumaMode::kSplit) {
      const NumaNode& node = topology.nodes[static_cast<size_t>(NodeOfThread(tid, nt, nodes))];
      results[static_cast<size_t>(tid)] = PinCurrentThread(node.cpus);
    } else {
      results[static_cast<size_t>(tid)] =
          PinCurrentThread({round_robin[static_cast<size_t>(tid) % round_robin.size()]});
    }
  });
  for (const Status& s : results) M3_RETURN_IF_ERROR(s);
  return Status::Ok();
}

}  // namespace m3
