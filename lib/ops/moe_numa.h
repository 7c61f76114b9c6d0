// NUMA placement of the MoE block (`--numa`).
//
//   off         threads float; weights stay where the mapping's pages are.
//   distribute  threads pinned round robin over the nodes' CPUs; weights as they are.
//   split       node n keeps one slice of the row tiles of every routed and shared expert's gate,
//               up and down in memory local to it, and the threads pinned to node n compute
//               exactly those rows. Each byte of expert weights lives on one node: never a copy
//               of every expert per node. Between gate/up and down the nodes exchange the SwiGLU
//               activation (intermediate-size floats per token) through the block's barrier, so
//               down is split by output rows too and nothing is summed across nodes: every output
//               element is computed as with `off`, and results are identical bit for bit (a
//               simulated topology, M3_FAKE_NUMA=N, runs this same path on one socket).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "ops/mlp.h"
#include "platform/numa.h"

namespace m3 {

enum class NumaMode { kOff, kDistribute, kSplit };

StatusOr<NumaMode> ParseNumaMode(const std::string& name);  // "off" | "distribute" | "split"
const char* NumaModeName(NumaMode mode);

// Node of thread `thread` of `threads` when `nodes` nodes share them in contiguous blocks.
inline int NodeOfThread(int thread, int threads, int nodes) {
  return static_cast<int>(static_cast<long>(thread) * nodes / threads);
}

// Threads [first, last) of node `node`: the inverse of NodeOfThread.
inline std::pair<int, int> NodeThreads(int node, int threads, int nodes) {
  return {(node * threads + nodes - 1) / nodes, ((node + 1) * threads + nodes - 1) / nodes};
}

// Row tiles [first, last) of a matrix with `tiles` row tiles that node n of `nodes` owns.
inline std::pair<size_t, size_t> NodeTiles(size_t tiles, int node, int nodes) {
  return {tiles * static_cast<size_t>(node) / static_cast<size_t>(nodes),
          tiles * static_cast<size_t>(node + 1) / static_cast<size_t>(nodes)};
}

// Rows of tiles [tile0, tile1) of w as a weight of its own, in place (no copy; null data when empty).
simd::WeightRef RowTileView(const simd::WeightRef& w, size_t tile0, size_t tile1);

// One expert's rows on one node: local copies of gate/up rows and down rows, and where they
// start in the whole matrices (in row tiles).
struct ExpertSlice {
  MlpWeights local;        // gate/up: rows of gate_up_tiles; down: rows of down_tiles
  size_t gate_up_tile0 = 0;
  size_t down_tile0 = 0;
};

// A layer's experts split over nodes: slices[node][expert], the shared expert at index E.
struct MoeSplit {
  int nodes = 0;
  std::vector<std::vector<ExpertSlice>> slices;
  std::shared_ptr<std::vector<NodeBuffer>> memory;  // owns the node-local copies
};

// Copies each node's row slices of every routed expert (and the shared one) into memory bound to
// that node. `nodes` <= topology.nodes.size().
StatusOr<std::shared_ptr<const MoeSplit>> BuildMoeSplit(const Topology& topology, int nodes,
                                                        const std::vector<MlpWeights>& experts,
                                                        const MlpWeights* shared);

// Pins the threads of `threads`-wide parallel regions: split, thread t to the CPUs of its node
// (NodeOfThread over the first `nodes` nodes); distribute, to one CPU each, round robin over
// the nodes. OpenMP keeps its threads between regions, so this holds for later regions.
Status PinThreads(const Topology& topology, NumaMode mode, int threads, int nodes);

}  // namespace m3
