// NUMA platform layer: cpulist parsing, topology detection (real, /sys, simulated), thread
// pinning, node-bound buffers and page placement. Fast and timing-free; placement is checked on
// every node only where the machine has several.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "platform/numa.h"
#include "test_util.h"

namespace m3 {
namespace {

std::vector<int> Range(int first, int last) {
  std::vector<int> v;
  for (int i = first; i <= last; ++i) v.push_back(i);
  return v;
}

std::vector<int> AllCpus(const Topology& t) {
  std::vector<int> all;
  for (const NumaNode& n : t.nodes) all.insert(all.end(), n.cpus.begin(), n.cpus.end());
  std::sort(all.begin(), all.end());
  return all;
}

TEST_CASE("ParseCpuList accepts the kernel's cpulist forms", "[numa]") {
  struct Case {
    const char* text;
    std::vector<int> ids;
  };
  const std::vector<Case> cases = {
      {"", {}},
      {"\n", {}},
      {"0", {0}},
      {"0\n", {0}},
      {"0-3,8-11,16", {0, 1, 2, 3, 8, 9, 10, 11, 16}},
      {"0-3,8-11,16\n", {0, 1, 2, 3, 8, 9, 10, 11, 16}},
      {"  2-3 \t\n", {2, 3}},
      {"4-4", {4}},
      {"5,1,3,1", {1, 3, 5}},           // unsorted with a duplicate
      {"0-3,2-5", {0, 1, 2, 3, 4, 5}},  // overlapping ranges
      {"0-7:2", {0, 2, 4, 6}},          // stride shorthand
      {"0-9:3", {0, 3, 6, 9}},
      {"1-8:2", {1, 3, 5, 7}},
      {"0-1023:2/256", {0, 1, 256, 257, 512, 513, 768, 769}},  // kernel docs' example
      {"0-7:4/4", {0, 1, 2, 3, 4, 5, 6, 7}},
      {"0-7:0/4", {}},
      {"0007", {7}},
      {"65535", {65535}},
      {"0,65535", {0, 65535}},
  };
  for (const Case& c : cases) {
    INFO("cpulist '" << c.text << "'");
    auto ids = ParseCpuList(c.text);
    REQUIRE(ids.ok());
    CHECK(*ids == c.ids);
  }
}

TEST_CASE("ParseCpuList rejects malformed text with a message quoting it", "[numa]") {
  // clang-format off
  const char* bad[] = {"3-1", "a", "1,,2", "-1", "1-", ",1", "1,", "1-2-3", "1 ,2", "1, 2", "1:2",
                       "0-7:", "0-7:0", "0-7:3/2", "0-7:1/0", "0-3:2/", "1-2/3", "0x1", "+1", "1a",
                       "65536", "0-65536", "99999999999999999999", "4294967296", "1\n2", "all"};
  // clang-format on
  for (const char* text : bad) {
    INFO("cpulist '" << text << "'");
    auto ids = ParseCpuList(text);
    REQUIRE_FALSE(ids.ok());
    CHECK(ids.status().code() == StatusCode::kInvalidArgument);
    CHECK(ids.status().message().find("'" + std::string(text) + "'") != std::string::npos);
  }
}

TEST_CASE("FormatCpuList writes compact ranges that parse back", "[numa]") {
  CHECK(FormatCpuList({}) == "");
  CHECK(FormatCpuList({0}) == "0");
  CHECK(FormatCpuList({0, 1}) == "0-1");
  CHECK(FormatCpuList({0, 1, 2, 3, 8, 9, 10, 11, 16}) == "0-3,8-11,16");
  CHECK(FormatCpuList({9, 3, 1, 2, 2}) == "1-3,9");
  CHECK(FormatCpuList({0, 2, 4, 6, 9}) == "0,2,4,6,9");
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<int> ids;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) ids.push_back(static_cast<int>(rng() % 64));
    std::vector<int> want = ids;
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    const std::string text = FormatCpuList(ids);
    INFO("formatted '" << text << "'");
    auto back = ParseCpuList(text);
    REQUIRE(back.ok());
    CHECK(*back == want);
  }
}

TEST_CASE("Topology::Describe and num_cpus", "[numa]") {
  Topology t;
  t.nodes = {{.id = 0, .cpus = {0, 1, 2, 3, 8, 9, 10, 11}}, {.id = 1, .cpus = {4, 5, 6, 7}}};
  CHECK(t.num_cpus() == 12);
  CHECK(t.Describe() == "2 nodes: node0 cpus 0-3,8-11 | node1 cpus 4-7");
  CHECK(t.binds_memory());
  CHECK(t.FindNode(1) == &t.nodes[1]);
  CHECK(t.FindNode(2) == nullptr);
  t.simulated = true;
  CHECK_FALSE(t.binds_memory());
  CHECK(t.Describe() == "2 nodes (simulated): node0 cpus 0-3,8-11 | node1 cpus 4-7");
  Topology one;
  one.nodes = {{.id = 0, .cpus = {0, 1}}};
  CHECK(one.Describe() == "1 node: node0 cpus 0-1");
  CHECK_FALSE(one.binds_memory());
}

TEST_CASE("SimulatedTopology splits CPUs into contiguous, even logical nodes", "[numa]") {
  SECTION("2 nodes of 2 cpus") {
    const Topology t = SimulatedTopology({0, 1, 2, 3}, 2);
    CHECK(t.simulated);
    CHECK_FALSE(t.libnuma);
    REQUIRE(t.nodes.size() == 2);
    CHECK(t.nodes[0].id == 0);
    CHECK(t.nodes[0].cpus == std::vector<int>{0, 1});
    CHECK(t.nodes[1].id == 1);
    CHECK(t.nodes[1].cpus == std::vector<int>{2, 3});
  }
  SECTION("3 nodes over 8 cpus: 3, 3, 2") {
    const Topology t = SimulatedTopology(Range(0, 7), 3);
    REQUIRE(t.nodes.size() == 3);
    CHECK(t.nodes[0].cpus == std::vector<int>{0, 1, 2});
    CHECK(t.nodes[1].cpus == std::vector<int>{3, 4, 5});
    CHECK(t.nodes[2].cpus == std::vector<int>{6, 7});
    CHECK(t.num_cpus() == 8);
  }
  SECTION("more nodes than cpus clamps to one cpu per node") {
    const Topology t = SimulatedTopology({0, 1}, 5);
    REQUIRE(t.nodes.size() == 2);
    CHECK(t.nodes[0].cpus == std::vector<int>{0});
    CHECK(t.nodes[1].cpus == std::vector<int>{1});
  }
  SECTION("non-contiguous ids, unsorted with duplicates") {
    const Topology t = SimulatedTopology({9, 0, 4, 2, 6, 4}, 2);
    REQUIRE(t.nodes.size() == 2);
    CHECK(t.nodes[0].cpus == std::vector<int>{0, 2, 4});
    CHECK(t.nodes[1].cpus == std::vector<int>{6, 9});
    CHECK(t.Describe() == "2 nodes (simulated): node0 cpus 0,2,4 | node1 cpus 6,9");
  }
  SECTION("fewer than one node means one") {
    CHECK(SimulatedTopology({0, 1, 2}, 0).nodes.size() == 1);
    CHECK(SimulatedTopology({0, 1, 2}, -3).nodes.size() == 1);
    CHECK(SimulatedTopology({0, 1, 2}, 1).nodes[0].cpus == std::vector<int>{0, 1, 2});
  }
}

TEST_CASE("TopologyFromSysfs reads node<N>/cpulist and keeps allowed CPUs", "[numa]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("m3_test_numa_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "node0");
  fs::create_directories(dir / "node1");  // memory-only: no CPUs
  fs::create_directories(dir / "node2");  // ids need not be contiguous
  fs::create_directories(dir / "power");
  test::WriteBytes(dir / "node0" / "cpulist", "0-3\n");
  test::WriteBytes(dir / "node1" / "cpulist", "\n");
  test::WriteBytes(dir / "node2" / "cpulist", "8-11,16\n");
  test::WriteBytes(dir / "possible", "0-2\n");

  auto t = TopologyFromSysfs(dir.string(), {40, 16, 8, 1, 0});
  REQUIRE(t.ok());
  CHECK_FALSE(t->simulated);
  CHECK_FALSE(t->libnuma);
  REQUIRE(t->nodes.size() == 2);
  CHECK(t->nodes[0].id == 0);
  CHECK(t->nodes[0].cpus == std::vector<int>{0, 1});
  CHECK(t->nodes[1].id == 2);
  CHECK(t->nodes[1].cpus == std::vector<int>{8, 16});

  auto none = TopologyFromSysfs(dir.string(), {100});
  REQUIRE(none.ok());
  CHECK(none->nodes.empty());

  test::WriteBytes(dir / "node2" / "cpulist", "8-x\n");
  auto bad = TopologyFromSysfs(dir.string(), {0});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kCorrupt);
  CHECK(bad.status().message().find((dir / "node2" / "cpulist").string()) != std::string::npos);

  fs::remove_all(dir);
  fs::create_directories(dir);
  CHECK(TopologyFromSysfs(dir.string(), {0}).status().code() == StatusCode::kNotFound);
  fs::remove_all(dir);
  CHECK(TopologyFromSysfs(dir.string(), {0}).status().code() == StatusCode::kNotFound);
}

TEST_CASE("DetectTopology: real without simulated nodes, simulated with them", "[numa]") {
  auto allowed = AllowedCpus();
  REQUIRE(allowed.ok());
  REQUIRE_FALSE(allowed->empty());
  CHECK(std::is_sorted(allowed->begin(), allowed->end()));

  for (int none : {0, -1}) {
    auto t = DetectTopology(none);
    REQUIRE(t.ok());
    INFO(t->Describe());
    CHECK_FALSE(t->simulated);
    REQUIRE_FALSE(t->nodes.empty());
    CHECK(AllCpus(*t) == *allowed);
    for (const NumaNode& n : t->nodes) CHECK_FALSE(n.cpus.empty());
    const Topology hw = DetectHardwareTopology();
    CHECK(hw.Describe() == t->Describe());
  }
  {
    auto t = DetectTopology(2);
    REQUIRE(t.ok());
    INFO(t->Describe());
    CHECK(t->simulated);
    CHECK(t->nodes.size() == std::min<size_t>(2, allowed->size()));
    CHECK(AllCpus(*t) == *allowed);
    CHECK(t->Describe().find("(simulated)") != std::string::npos);
  }
  {
    auto t = DetectTopology(1000);  // clamped to the CPU count
    REQUIRE(t.ok());
    CHECK(t->nodes.size() == allowed->size());
    CHECK(AllCpus(*t) == *allowed);
  }
}

TEST_CASE("ParseSimulatedNodes: empty is none, a whole number >= 1 is that many, the rest an error quoting it",
          "[numa]") {
  CHECK(ParseSimulatedNodes("").value() == 0);
  CHECK(ParseSimulatedNodes("1").value() == 1);
  CHECK(ParseSimulatedNodes("2").value() == 2);
  CHECK(ParseSimulatedNodes("1000").value() == 1000);
  for (const char* value : {"abc", "0", "-1", "2x", " 2", "1.5", "99999999999999999999"}) {
    INFO("'" << value << "'");
    auto n = ParseSimulatedNodes(value);
    REQUIRE_FALSE(n.ok());
    CHECK(n.status().code() == StatusCode::kInvalidArgument);
    CHECK(n.status().message().find(std::string("'") + value + "'") != std::string::npos);
  }
}

TEST_CASE("PinCurrentThread pins to allowed CPUs and reports impossible ones", "[numa]") {
  auto before = AllowedCpus();
  REQUIRE(before.ok());
  const int cpu = before->back();

  REQUIRE(PinCurrentThread({cpu}).ok());
  auto pinned = AllowedCpus();
  REQUIRE(pinned.ok());
  CHECK(*pinned == std::vector<int>{cpu});

  const Status impossible = PinCurrentThread({65535});
  CHECK(impossible.code() == StatusCode::kInvalidArgument);
  CHECK(impossible.message().find("65535") != std::string::npos);
  CHECK(PinCurrentThread({}).code() == StatusCode::kInvalidArgument);
  CHECK(PinCurrentThread({-1}).code() == StatusCode::kInvalidArgument);
  CHECK(PinCurrentThread({0, 1 << 20}).code() == StatusCode::kInvalidArgument);
  auto still = AllowedCpus();  // a failed pin leaves the affinity alone
  REQUIRE(still.ok());
  CHECK(*still == std::vector<int>{cpu});

  // Restore, so later tests see every CPU again.
  REQUIRE(PinCurrentThread(*before).ok());
  auto after = AllowedCpus();
  REQUIRE(after.ok());
  CHECK(*after == *before);
}

TEST_CASE("NodeBuffer allocates zeroed page-aligned memory and moves", "[numa]") {
  const Topology sim = SimulatedTopology({0, 1, 2, 3}, 2);
  auto a = NodeBuffer::Allocate(sim, 1, 10000);
  REQUIRE(a.ok());
  NodeBuffer buf = std::move(a).value();
  REQUIRE(buf.data() != nullptr);
  CHECK(buf.size() == 10000);
  CHECK(buf.node() == 1);
  CHECK_FALSE(buf.bound());  // simulated nodes share memory
  CHECK(reinterpret_cast<uintptr_t>(buf.data()) % static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)) == 0);
  auto* bytes = static_cast<unsigned char*>(buf.data());
  CHECK(std::all_of(bytes, bytes + buf.size(), [](unsigned char b) { return b == 0; }));
  std::memset(bytes, 0xAB, buf.size());

  NodeBuffer moved(std::move(buf));
  CHECK(buf.data() == nullptr);  // NOLINT(bugprone-use-after-move): checking the moved-from state
  CHECK(buf.size() == 0);
  CHECK(moved.data() == bytes);
  CHECK(moved.size() == 10000);
  CHECK(moved.node() == 1);
  CHECK(static_cast<unsigned char*>(moved.data())[9999] == 0xAB);

  auto b = NodeBuffer::Allocate(sim, 0, 4096);
  REQUIRE(b.ok());
  NodeBuffer other = std::move(b).value();
  other = std::move(moved);  // releases other's old mapping
  CHECK(other.data() == bytes);
  CHECK(other.node() == 1);
  CHECK(moved.data() == nullptr);  // NOLINT(bugprone-use-after-move)

  auto empty = NodeBuffer::Allocate(sim, 0, 0);
  REQUIRE(empty.ok());
  CHECK(empty->data() == nullptr);
  CHECK(empty->size() == 0);

  auto missing = NodeBuffer::Allocate(sim, 2, 64);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kInvalidArgument);
  CHECK(missing.status().message().find("node 2") != std::string::npos);
}

TEST_CASE("PageNodes reports where node-bound pages live", "[numa]") {
  CHECK(PageNodes(nullptr, 0).ok());
  CHECK(PageNodes(nullptr, 16).status().code() == StatusCode::kInvalidArgument);

  const Topology hw = DetectHardwareTopology();
  INFO(hw.Describe());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = 8 * page + 100;  // a partial last page
  if (hw.nodes.size() >= 2) {
    for (const NumaNode& node : hw.nodes) {
      auto a = NodeBuffer::Allocate(hw, node.id, bytes);
      REQUIRE(a.ok());
      NodeBuffer buf = std::move(a).value();
      std::memset(buf.data(), 1, buf.size());
      auto where = PageNodes(buf.data(), buf.size());
      if (!where.ok()) {
        // Built without libnuma: nothing is bound, and placement cannot be read.
        CHECK(where.status().code() == StatusCode::kUnsupported);
        CHECK_FALSE(buf.bound());
        continue;
      }
      CHECK(buf.bound());
      REQUIRE(where->size() == 9);
      for (int n : *where) CHECK(n == node.id);
    }
    return;
  }
  auto a = NodeBuffer::Allocate(hw, hw.nodes[0].id, bytes);
  REQUIRE(a.ok());
  NodeBuffer buf = std::move(a).value();
  CHECK_FALSE(buf.bound());  // one node: nothing to bind to
  std::memset(buf.data(), 1, buf.size());
  auto where = PageNodes(buf.data(), buf.size());
  if (where.ok()) {
    REQUIRE(where->size() == 9);
    for (int n : *where) CHECK(n == hw.nodes[0].id);
  } else {
    CHECK(where.status().code() == StatusCode::kUnsupported);
    CHECK_FALSE(hw.libnuma);  // with libnuma working, move_pages must answer
  }
  // Catch2 v2 has no SKIP: say so instead.
  WARN("single NUMA node: page placement not checkable here");
}

}  // namespace
}  // namespace m3

namespace m3 {
namespace {

TEST_CASE("NodeBuffer::BindRange checks its range and, on real nodes, moves those pages", "[numa]") {
  const Topology topo = DetectHardwareTopology();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  auto buf = NodeBuffer::Allocate(topo, topo.nodes[0].id, 8 * page);
  REQUIRE(buf.ok());
  CHECK(!buf.value().BindRange(topo, 7 * page, 2 * page, topo.nodes[0].id).ok());  // past the end
  CHECK(!buf.value().BindRange(topo, 0, page, 12345).ok());                         // no such node
  const int last = topo.nodes.back().id;
  REQUIRE(buf.value().BindRange(topo, 4 * page, 4 * page, last).ok());
  std::memset(buf.value().data(), 1, 8 * page);  // first touch
  if (!topo.binds_memory()) {
    WARN("single NUMA node: BindRange placement not checkable here");
    return;
  }
  auto nodes = PageNodes(buf.value().data(), 8 * page);
  REQUIRE(nodes.ok());
  for (size_t i = 0; i < 8; ++i) CHECK(nodes.value()[i] == (i < 4 ? topo.nodes[0].id : last));
}

}  // namespace
}  // namespace m3
