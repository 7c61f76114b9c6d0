// NUMA topology and node-local memory: which CPUs belong to which memory node, pinning threads to
// a node's CPUs, and buffers whose pages live on one node. The "split" MoE mode gives each node a
// slice of every expert in a NodeBuffer bound to it; mapped weights are never copied per node.
//
// A simulated topology (the m3 program's M3_FAKE_NUMA=N) splits this process's CPUs into N logical
// nodes so the split dispatch path runs, and is tested, on a one-node machine; its memory is not
// bound. Nothing here is global or read from the environment: the Engine owns its Topology.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace m3 {

// Parses the Linux cpulist syntax of /sys/devices/system/node/node*/cpulist and cpuset files:
// comma-separated "N" or "A-B" items, plus the kernel's "A-B:U/G" form (in each group of G ids
// starting at A, the first U) and "A-B:S" as shorthand for every S-th id (":1/S"). Surrounding
// whitespace (the trailing newline of a sysfs file) is allowed; "" is the empty list. Returns sorted
// unique ids; malformed text or an id past the largest Linux CPU id is InvalidArgument.
StatusOr<std::vector<int>> ParseCpuList(std::string_view text);

// The inverse of ParseCpuList in the kernel's compact form: {0,1,2,3,8,16} -> "0-3,8,16".
// The ids need not be sorted or unique.
std::string FormatCpuList(const std::vector<int>& cpus);

struct NumaNode {
  int id = 0;             // the kernel's node id (real), or 0..N-1 (simulated)
  std::vector<int> cpus;  // sorted, non-empty; only CPUs this process may run on
};

struct Topology {
  std::vector<NumaNode> nodes;  // ascending id; never empty once detected
  bool simulated = false;       // SimulatedTopology: logical nodes, memory not bound
  bool libnuma = false;         // nodes came from libnuma (else from /sys or the one-node default)

  int num_cpus() const;
  // One line for logs and `m3 inspect`: "2 nodes: node0 cpus 0-3,8-11 | node1 cpus 4-7".
  std::string Describe() const;
  // The node with this id, or nullptr.
  const NumaNode* FindNode(int id) const;
  // Whether NodeBuffer binds memory for this topology (real and more than one node).
  bool binds_memory() const { return !simulated && nodes.size() > 1; }
};

// The CPUs the calling thread may run on (sched_getaffinity), sorted. Call before pinning.
StatusOr<std::vector<int>> AllowedCpus();

// `cpus` (duplicates dropped) split into `nodes` contiguous logical nodes as evenly as possible,
// the first nodes taking one more CPU when it does not divide; `nodes` is clamped to
// [1, number of CPUs]. simulated = true.
Topology SimulatedTopology(const std::vector<int>& cpus, int nodes);

// Reads `node_dir`/node<N>/cpulist for every node directory (normally /sys/devices/system/node),
// keeping only CPUs in `allowed` and nodes left with at least one. Errors name the file at fault;
// NotFound when the folder has no node directory.
StatusOr<Topology> TopologyFromSysfs(const std::string& node_dir, const std::vector<int>& allowed);

// The machine's topology restricted to the calling thread's allowed CPUs: libnuma when built with
// it and numa_available(), else /sys, else one node holding every allowed CPU. Never fails.
Topology DetectHardwareTopology();

// What the engine uses: SimulatedTopology(allowed CPUs, simulated_nodes) when simulated_nodes >= 1
// (EngineOptions::simulated_numa_nodes), else DetectHardwareTopology().
StatusOr<Topology> DetectTopology(int simulated_nodes = 0);

// The number of simulated nodes a text asks for (the m3 program's M3_FAKE_NUMA): "" is 0 (the
// machine's topology), else a whole number >= 1; anything else is InvalidArgument quoting it.
StatusOr<int> ParseSimulatedNodes(std::string_view text);

// Pins the calling thread to `cpus`. The kernel ignores CPUs this process may not use; the call
// fails (InvalidArgument) when none is usable, when `cpus` is empty or an id is out of range.
Status PinCurrentThread(const std::vector<int>& cpus);

// Anonymous page-aligned memory for one node: bound to that node (mbind, MPOL_BIND) before first
// touch when topology.binds_memory() and m3 was built with libnuma; plain memory otherwise
// (bound() says which). Zero-filled. Move-only. For split-mode expert slices and small replicated
// tensors, never for mapped weights.
class NodeBuffer {
 public:
  static StatusOr<NodeBuffer> Allocate(const Topology& topology, int node, size_t bytes);

  NodeBuffer() = default;
  ~NodeBuffer();
  NodeBuffer(NodeBuffer&& other) noexcept;
  NodeBuffer& operator=(NodeBuffer&& other) noexcept;
  NodeBuffer(const NodeBuffer&) = delete;
  NodeBuffer& operator=(const NodeBuffer&) = delete;

  // Binds [offset, offset + bytes) (rounded out to whole pages) to `node` instead; call it before
  // the range is first touched. A no-op where the buffer is not bound (one node, simulated).
  Status BindRange(const Topology& topology, size_t offset, size_t bytes, int node);

  void* data() { return data_; }
  const void* data() const { return data_; }
  size_t size() const { return size_; }
  int node() const { return node_; }
  bool bound() const { return bound_; }

 private:
  void Release();

  void* data_ = nullptr;
  size_t size_ = 0;         // bytes requested
  size_t mapped_size_ = 0;  // size_ rounded up to whole pages
  int node_ = -1;
  bool bound_ = false;
};

// The node of each page overlapping [p, p + bytes) (move_pages without moving). An entry is the
// node id, or a negative errno for that page (-ENOENT: not yet touched). Unsupported when m3 was
// built without libnuma or the kernel refuses the query.
StatusOr<std::vector<int>> PageNodes(const void* p, size_t bytes);

}  // namespace m3
