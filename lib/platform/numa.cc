#include "platform/numa.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <utility>

#ifdef M3_HAVE_NUMA
#include <numa.h>
#include <numaif.h>
#endif

namespace m3 {
namespace {

// Linux builds with at most 8192 CPUs (x86 MAXSMP); the margin keeps the parse bitmap at 64 KiB
// while bounding what a hostile cpulist can make us allocate.
constexpr int kMaxCpuId = 65535;

constexpr std::string_view kSpace = " \t\n\r\f\v";

std::string_view Trim(std::string_view s) {
  const size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(kSpace);
  return s.substr(b, e - b + 1);
}

// Parses the decimal number at the front of `s` (digits only, at most kMaxCpuId) and advances.
bool TakeNumber(std::string_view& s, int& out) {
  size_t i = 0;
  long long v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    v = v * 10 + (s[i] - '0');
    if (v > kMaxCpuId) return false;
    ++i;
  }
  if (i == 0) return false;
  out = static_cast<int>(v);
  s.remove_prefix(i);
  return true;
}

// Sets the ids of one cpulist item ("N", "A-B", "A-B:U/G", "A-B:S") in `bits`.
bool ParseItem(std::string_view item, std::vector<bool>& bits) {
  int first = 0;
  if (!TakeNumber(item, first)) return false;
  int last = first;
  int used = 1;
  int group = 1;
  if (!item.empty()) {
    if (item.front() != '-') return false;
    item.remove_prefix(1);
    if (!TakeNumber(item, last) || last < first) return false;
    if (!item.empty()) {
      if (item.front() != ':') return false;
      item.remove_prefix(1);
      if (!TakeNumber(item, used)) return false;
      if (item.empty()) {  // "A-B:S": every S-th id
        group = used;
        used = 1;
      } else {
        if (item.front() != '/') return false;
        item.remove_prefix(1);
        if (!TakeNumber(item, group) || !item.empty()) return false;
      }
      // The kernel rejects an empty group and more used ids than the group holds.
      if (group == 0 || used > group) return false;
    }
  }
  for (int id = first; id <= last; ++id) {
    if ((id - first) % group < used) bits[static_cast<size_t>(id)] = true;
  }
  return true;
}

// Frees a CPU_ALLOC'd set.
struct CpuSetDeleter {
  void operator()(cpu_set_t* set) const { CPU_FREE(set); }
};
using CpuSetPtr = std::unique_ptr<cpu_set_t, CpuSetDeleter>;

std::vector<int> Intersect(const std::vector<int>& sorted_a, const std::vector<int>& sorted_b) {
  std::vector<int> out;
  std::set_intersection(sorted_a.begin(), sorted_a.end(), sorted_b.begin(), sorted_b.end(),
                        std::back_inserter(out));
  return out;
}

std::vector<int> SortedUnique(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

Status InternalError(const std::string& message) { return Status(StatusCode::kInternal, message); }

#ifdef M3_HAVE_NUMA
// Nodes from libnuma, each restricted to `allowed`; empty when libnuma reports nothing usable.
Topology TopologyFromLibnuma(const std::vector<int>& allowed) {
  Topology topology;
  if (numa_available() < 0) return topology;
  const int max_node = numa_max_node();
  struct bitmask* mask = numa_allocate_cpumask();
  if (!mask) return topology;
  for (int node = 0; node <= max_node; ++node) {
    // Node ids can have holes; libnuma warns on stderr only for nodes it believes exist.
    if (!numa_bitmask_isbitset(numa_nodes_ptr, static_cast<unsigned>(node))) continue;
    if (numa_node_to_cpus(node, mask) != 0) continue;
    NumaNode n{.id = node, .cpus = {}};
    for (int cpu : allowed) {
      if (static_cast<unsigned long>(cpu) < mask->size &&
          numa_bitmask_isbitset(mask, static_cast<unsigned>(cpu))) {
        n.cpus.push_back(cpu);
      }
    }
    if (!n.cpus.empty()) topology.nodes.push_back(std::move(n));
  }
  numa_bitmask_free(mask);
  topology.libnuma = !topology.nodes.empty();
  return topology;
}
#endif

}  // namespace

StatusOr<std::vector<int>> ParseCpuList(std::string_view text) {
  const std::string_view trimmed = Trim(text);
  std::vector<int> ids;
  if (trimmed.empty()) return ids;
  std::vector<bool> bits(kMaxCpuId + 1, false);
  std::string_view rest = trimmed;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    if (!ParseItem(item, bits)) {
      return InvalidArgument("malformed cpulist '", trimmed, "' at '", item,
                             "' (expected N, A-B, A-B:U/G or A-B:S with ids up to ", kMaxCpuId, ")");
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  for (int id = 0; id <= kMaxCpuId; ++id) {
    if (bits[static_cast<size_t>(id)]) ids.push_back(id);
  }
  return ids;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  const std::vector<int> ids = SortedUnique(cpus);
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(ids[i]);
    if (j > i) out += '-' + std::to_string(ids[j]);
    i = j + 1;
  }
  return out;
}

int Topology::num_cpus() const {
  int n = 0;
  for (const NumaNode& node : nodes) n += static_cast<int>(node.cpus.size());
  return n;
}

std::string Topology::Describe() const {
  std::ostringstream os;
  os << nodes.size() << (nodes.size() == 1 ? " node" : " nodes") << (simulated ? " (simulated)" : "") << ":";
  for (size_t i = 0; i < nodes.size(); ++i) {
    os << (i ? " | " : " ") << "node" << nodes[i].id << " cpus " << FormatCpuList(nodes[i].cpus);
  }
  return os.str();
}

const NumaNode* Topology::FindNode(int id) const {
  for (const NumaNode& node : nodes) {
    if (node.id == id) return &node;
  }
  return nullptr;
}

StatusOr<std::vector<int>> AllowedCpus() {
  // The kernel's mask may be wider than glibc's 1024-bit cpu_set_t: grow until it fits.
  for (int n = 1024; n <= kMaxCpuId + 1; n *= 2) {
    CpuSetPtr set(CPU_ALLOC(n));
    if (!set) return Status(StatusCode::kOutOfMemory, "AllowedCpus: CPU_ALLOC failed");
    const size_t size = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(size, set.get());
    if (sched_getaffinity(0, size, set.get()) == 0) {
      std::vector<int> cpus;
      for (int cpu = 0; cpu < n; ++cpu) {
        if (CPU_ISSET_S(cpu, size, set.get())) cpus.push_back(cpu);
      }
      return cpus;
    }
    if (errno != EINVAL) return InternalError(Str("sched_getaffinity failed: ", std::strerror(errno)));
  }
  return InternalError(Str("sched_getaffinity: mask wider than ", kMaxCpuId + 1, " CPUs"));
}

Topology SimulatedTopology(const std::vector<int>& cpus, int nodes) {
  const std::vector<int> ids = SortedUnique(cpus);
  Topology topology;
  topology.simulated = true;
  const int n = std::clamp(nodes, 1, std::max<int>(1, static_cast<int>(ids.size())));
  const size_t base = ids.size() / static_cast<size_t>(n);
  const size_t extra = ids.size() % static_cast<size_t>(n);
  size_t begin = 0;
  for (int i = 0; i < n; ++i) {
    const size_t count = base + (static_cast<size_t>(i) < extra ? 1 : 0);
    topology.nodes.push_back(
        NumaNode{.id = i, .cpus = std::vector<int>(ids.begin() + begin, ids.begin() + begin + count)});
    begin += count;
  }
  return topology;
}

StatusOr<Topology> TopologyFromSysfs(const std::string& node_dir, const std::vector<int>& allowed) {
  namespace fs = std::filesystem;
  const std::vector<int> allowed_sorted = SortedUnique(allowed);
  std::error_code ec;
  fs::directory_iterator it(node_dir, ec);
  if (ec) return NotFound(node_dir, ": cannot list: ", ec.message());
  Topology topology;
  bool any_node = false;
  for (const fs::directory_entry& entry : it) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= 4 || name.compare(0, 4, "node") != 0) continue;
    int id = -1;
    const char* first = name.data() + 4;
    const char* last = name.data() + name.size();
    const auto [ptr, err] = std::from_chars(first, last, id);
    if (err != std::errc() || ptr != last || id < 0) continue;  // not "node<N>"
    any_node = true;
    const fs::path file = entry.path() / "cpulist";
    std::ifstream in(file);
    if (!in) return IoError(file.string(), ": cannot open");
    std::stringstream ss;
    ss << in.rdbuf();
    auto cpus = ParseCpuList(ss.str());
    if (!cpus.ok()) return Corrupt(file.string(), ": ", cpus.status().message());
    NumaNode node{.id = id, .cpus = Intersect(*cpus, allowed_sorted)};
    if (!node.cpus.empty()) topology.nodes.push_back(std::move(node));
  }
  if (!any_node) return NotFound(node_dir, ": no node<N> directory");
  std::sort(topology.nodes.begin(), topology.nodes.end(),
            [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  return topology;
}

Topology DetectHardwareTopology() {
  std::vector<int> allowed;
  if (auto cpus = AllowedCpus(); cpus.ok()) allowed = std::move(cpus).value();
  if (allowed.empty()) {
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    for (long cpu = 0; cpu < std::max(1L, online); ++cpu) allowed.push_back(static_cast<int>(cpu));
  }
#ifdef M3_HAVE_NUMA
  if (Topology t = TopologyFromLibnuma(allowed); !t.nodes.empty()) return t;
#endif
  if (auto t = TopologyFromSysfs("/sys/devices/system/node", allowed); t.ok() && !t->nodes.empty()) {
    return std::move(t).value();
  }
  Topology one;
  one.nodes.push_back(NumaNode{.id = 0, .cpus = std::move(allowed)});
  return one;
}

StatusOr<Topology> DetectTopology(int simulated_nodes) {
  if (simulated_nodes < 1) return DetectHardwareTopology();
  M3_ASSIGN_OR_RETURN(std::vector<int> cpus, AllowedCpus());
  return SimulatedTopology(cpus, simulated_nodes);
}

StatusOr<int> ParseSimulatedNodes(std::string_view text) {
  if (text.empty()) return 0;
  int nodes = 0;
  const auto [ptr, err] = std::from_chars(text.data(), text.data() + text.size(), nodes);
  if (err != std::errc() || ptr != text.data() + text.size() || nodes < 1)
    return InvalidArgument("'", text, "': expected a whole number of nodes >= 1");
  return nodes;
}

Status PinCurrentThread(const std::vector<int>& cpus) {
  if (cpus.empty()) return InvalidArgument("PinCurrentThread: empty cpu list");
  const auto [lo, hi] = std::minmax_element(cpus.begin(), cpus.end());
  if (*lo < 0 || *hi > kMaxCpuId) {
    return InvalidArgument("PinCurrentThread: cpu id out of range in ", FormatCpuList(cpus));
  }
  const int n = *hi + 1;
  CpuSetPtr set(CPU_ALLOC(n));
  if (!set) return Status(StatusCode::kOutOfMemory, "PinCurrentThread: CPU_ALLOC failed");
  const size_t size = CPU_ALLOC_SIZE(n);
  CPU_ZERO_S(size, set.get());
  for (int cpu : cpus) CPU_SET_S(cpu, size, set.get());
  const int rc = pthread_setaffinity_np(pthread_self(), size, set.get());
  if (rc == EINVAL) {
    return InvalidArgument("cannot pin thread to cpus ", FormatCpuList(cpus),
                           ": none is available to this process");
  }
  if (rc != 0) {
    return InternalError(Str("cannot pin thread to cpus ", FormatCpuList(cpus), ": ", std::strerror(rc)));
  }
  return Status::Ok();
}

namespace {
#ifdef M3_HAVE_NUMA
constexpr bool kHaveLibnuma = true;
#else
constexpr bool kHaveLibnuma = false;
#endif

// MPOL_BIND of the whole pages [p, p + bytes) to `node` (a no-op without libnuma).
Status BindPages(void* p, size_t bytes, int node) {
#ifdef M3_HAVE_NUMA
  constexpr size_t kBits = sizeof(unsigned long) * CHAR_BIT;
  std::vector<unsigned long> mask(static_cast<size_t>(node) / kBits + 1, 0);
  mask[static_cast<size_t>(node) / kBits] |= 1UL << (static_cast<size_t>(node) % kBits);
  // maxnode counts one past the mask's bits (the kernel decrements it).
  if (mbind(p, bytes, MPOL_BIND, mask.data(), mask.size() * kBits + 1, 0) != 0)
    return InternalError(Str("NodeBuffer: mbind of ", bytes, " bytes to node ", node, " failed: ", std::strerror(errno)));
#else
  (void)p, (void)bytes, (void)node;
#endif
  return Status::Ok();
}
}  // namespace

StatusOr<NodeBuffer> NodeBuffer::Allocate(const Topology& topology, int node, size_t bytes) {
  if (!topology.FindNode(node)) {
    return InvalidArgument("NodeBuffer: node ", node, " is not in the topology (", topology.Describe(), ")");
  }
  NodeBuffer buffer;
  buffer.node_ = node;
  if (bytes == 0) return buffer;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (bytes > SIZE_MAX - page) return InvalidArgument("NodeBuffer: ", bytes, " bytes is too large");
  const size_t mapped = (bytes + page - 1) / page * page;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status(StatusCode::kOutOfMemory,
                  Str("NodeBuffer: mmap of ", bytes, " bytes failed: ", std::strerror(errno)));
  }
  buffer.data_ = p;
  buffer.size_ = bytes;
  buffer.mapped_size_ = mapped;
  if (topology.binds_memory()) {
    // Bound before the first touch, so every page is faulted in on `node`.
    M3_RETURN_IF_ERROR(BindPages(p, mapped, node));
    buffer.bound_ = kHaveLibnuma;
  }
  return buffer;
}

Status NodeBuffer::BindRange(const Topology& topology, size_t offset, size_t bytes, int node) {
  if (!topology.FindNode(node))
    return InvalidArgument("NodeBuffer: node ", node, " is not in the topology (", topology.Describe(), ")");
  if (offset > size_ || bytes > size_ - offset)
    return InvalidArgument("NodeBuffer: range [", offset, ", ", offset + bytes, ") is outside its ", size_, " bytes");
  if (!bound_ || bytes == 0) return Status::Ok();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t begin = offset / page * page, end = std::min(mapped_size_, (offset + bytes + page - 1) / page * page);
  return BindPages(static_cast<uint8_t*>(data_) + begin, end - begin, node);
}

NodeBuffer::~NodeBuffer() { Release(); }

NodeBuffer::NodeBuffer(NodeBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_size_(std::exchange(other.mapped_size_, 0)),
      node_(std::exchange(other.node_, -1)),
      bound_(std::exchange(other.bound_, false)) {}

NodeBuffer& NodeBuffer::operator=(NodeBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_size_ = std::exchange(other.mapped_size_, 0);
    node_ = std::exchange(other.node_, -1);
    bound_ = std::exchange(other.bound_, false);
  }
  return *this;
}

void NodeBuffer::Release() {
  if (data_) munmap(data_, mapped_size_);
  data_ = nullptr;
  size_ = 0;
  mapped_size_ = 0;
  node_ = -1;
  bound_ = false;
}

StatusOr<std::vector<int>> PageNodes(const void* p, size_t bytes) {
  if (bytes == 0) return std::vector<int>();
  if (!p) return InvalidArgument("PageNodes: null pointer for ", bytes, " bytes");
#ifdef M3_HAVE_NUMA
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  const size_t count = static_cast<size_t>((end - begin + page - 1) / page);
  std::vector<void*> pages(count);
  for (size_t i = 0; i < count; ++i) pages[i] = reinterpret_cast<void*>(begin + i * page);
  std::vector<int> status(count, -ENOENT);
  // With no target nodes, move_pages only reports where each page is.
  if (move_pages(0, count, pages.data(), nullptr, status.data(), 0) != 0) {
    const int err = errno;
    if (err == ENOSYS || err == EPERM) return Unsupported("PageNodes: move_pages: ", std::strerror(err));
    return InternalError(Str("PageNodes: move_pages failed: ", std::strerror(err)));
  }
  return status;
#else
  return Unsupported("PageNodes: m3 was built without libnuma");
#endif
}

}  // namespace m3
