// Available memory (lib/platform/memory.h): /proc/meminfo and cgroup v1/v2 texts parsed by the pure
// functions, the cgroup directories of /proc/self/cgroup, and the reader on a fake /proc and
// /sys/fs/cgroup tree.
#include <filesystem>
#include <string>
#include <vector>

#include "platform/memory.h"
#include "test_util.h"

namespace m3 {
namespace {

constexpr const char* kMeminfo =
    "MemTotal:       24684084 kB\n"
    "MemFree:         1200000 kB\n"
    "MemAvailable:   22199644 kB\n"
    "Buffers:          123456 kB\n";

TEST_CASE("MemAvailable is read from /proc/meminfo text", "[memory]") {
  CHECK(ParseMemAvailable(kMeminfo) == uint64_t{22199644} * 1024);
  CHECK(ParseMemAvailable("MemAvailable: 1 kB") == 1024u);
  CHECK_FALSE(ParseMemAvailable("MemTotal: 100 kB\nMemFree: 50 kB\n"));  // kernels before 3.14
  CHECK_FALSE(ParseMemAvailable("MemAvailable: lots kB\n"));
  CHECK_FALSE(ParseMemAvailable("MemAvailable: 100\n"));
  CHECK_FALSE(ParseMemAvailable("XMemAvailable: 100 kB\n"));
  CHECK_FALSE(ParseMemAvailable(""));
}

TEST_CASE("a cgroup level leaves its limit less the usage, inactive file pages counted free", "[memory]") {
  // v2: memory.max, memory.current, memory.stat "inactive_file".
  CHECK(CgroupHeadroom({"4294967296\n", "1073741824\n", "anon 900000000\ninactive_file 100000000\n"}) ==
        uint64_t{4294967296} - (1073741824 - 100000000));
  CHECK_FALSE(CgroupHeadroom({"max\n", "1073741824\n", ""}));
  // v1: memory.limit_in_bytes, memory.usage_in_bytes, the hierarchical total_inactive_file wins.
  CHECK(CgroupHeadroom({"2000000\n", "1500000\n", "inactive_file 1\ntotal_inactive_file 500000\n"}) == 1000000u);
  CHECK_FALSE(CgroupHeadroom({"9223372036854771712\n", "701321216\n", ""}));  // v1 "unlimited"
  CHECK(CgroupHeadroom({"1000", "1500", ""}) == 0u);                          // past the limit
  CHECK(CgroupHeadroom({"1000", "400", "inactive_file 900\n"}) == 1000u);     // usage all evictable
  CHECK_FALSE(CgroupHeadroom({"", "", ""}));
  CHECK_FALSE(CgroupHeadroom({"1000", "", ""}));
  CHECK_FALSE(CgroupHeadroom({"10 00", "1", ""}));
}

TEST_CASE("available memory is the least of MemAvailable and every limited level", "[memory]") {
  const uint64_t mem = uint64_t{22199644} * 1024;
  CHECK(AvailableMemoryFrom(kMeminfo, {}) == mem);
  CHECK(AvailableMemoryFrom(kMeminfo, {{"max", "5", ""}}) == mem);
  CHECK(AvailableMemoryFrom(kMeminfo, {{"4294967296", "1073741824", ""}, {"8589934592", "0", ""}}) ==
        uint64_t{3221225472});
  CHECK(AvailableMemoryFrom(kMeminfo, {{"8589934592", "0", ""}, {"4294967296", "1073741824", ""}}) ==
        uint64_t{3221225472});
  CHECK(AvailableMemoryFrom("", {{"4096", "1024", ""}}) == 3072u);  // no meminfo: the cgroup alone
  CHECK_FALSE(AvailableMemoryFrom("", {}));
}

TEST_CASE("memory cgroup directories come from /proc/self/cgroup, innermost first", "[memory]") {
  using V = std::vector<std::string>;
  // v2 only.
  CHECK(CgroupMemoryDirs("0::/user.slice/session-2.scope\n", "/sys/fs/cgroup") ==
        V{"/sys/fs/cgroup/user.slice/session-2.scope", "/sys/fs/cgroup/user.slice", "/sys/fs/cgroup"});
  CHECK(CgroupMemoryDirs("0::/\n", "/cg") == V{"/cg"});
  // Hybrid: the v1 memory controller (here with others on one line) and the v2 line.
  CHECK(CgroupMemoryDirs("9:name=systemd:/\n4:cpu,memory:/process_api/abc\n1:cpu:/x\n0::/\n", "/cg") ==
        V{"/cg/memory/process_api/abc", "/cg/memory/process_api", "/cg/memory", "/cg"});
  // Outside this cgroup namespace ("/.."): nothing to follow; malformed lines are skipped.
  CHECK(CgroupMemoryDirs("0::/../../other\n", "/cg").empty());
  CHECK(CgroupMemoryDirs("garbage\n4:memory\n", "/cg").empty());
  CHECK(CgroupMemoryDirs("", "/cg").empty());
}

TEST_CASE("the reader follows /proc/self/cgroup to the limited levels of a fake tree", "[memory]") {
  test::TempDir tmp;
  const auto proc = tmp.path() / "proc", cg = tmp.path() / "cgroup";
  std::filesystem::create_directories(proc / "self");
  test::WriteBytes(proc / "meminfo", kMeminfo);
  const uint64_t mem = uint64_t{22199644} * 1024;
  // v2: a limit on the parent binds the child, which sets none; the root has no files.
  test::WriteBytes(proc / "self" / "cgroup", "0::/jobs/one\n");
  std::filesystem::create_directories(cg / "jobs" / "one");
  test::WriteBytes(cg / "jobs" / "one" / "memory.max", "max\n");
  test::WriteBytes(cg / "jobs" / "one" / "memory.current", "100\n");
  test::WriteBytes(cg / "jobs" / "memory.max", "1048576\n");
  test::WriteBytes(cg / "jobs" / "memory.current", "524288\n");
  test::WriteBytes(cg / "jobs" / "memory.stat", "anon 400000\ninactive_file 24288\n");
  CHECK(AvailableMemoryBytes(proc.string(), cg.string()) == uint64_t{1048576 - 500000});
  // v1 seen from a container: the host path does not exist, the mount root is the container's.
  test::WriteBytes(proc / "self" / "cgroup", "4:memory:/docker/abc\n0::/\n");
  std::filesystem::create_directories(cg / "memory");
  test::WriteBytes(cg / "memory" / "memory.limit_in_bytes", "2097152\n");
  test::WriteBytes(cg / "memory" / "memory.usage_in_bytes", "1048576\n");
  CHECK(AvailableMemoryBytes(proc.string(), cg.string()) == uint64_t{1048576});
  // No cgroup files: MemAvailable alone; nothing at all: unknown.
  test::WriteBytes(proc / "self" / "cgroup", "0::/elsewhere\n");
  std::filesystem::remove_all(cg);
  CHECK(AvailableMemoryBytes(proc.string(), cg.string()) == mem);
  CHECK_FALSE(AvailableMemoryBytes((tmp.path() / "none").string(), cg.string()));
}

TEST_CASE("this machine's available memory is known and plausible", "[memory]") {
  const auto available = AvailableMemoryBytes();
  REQUIRE(available);  // Linux: /proc/meminfo at least
  CHECK(*available > (uint64_t{16} << 20));
  CHECK(*available < (uint64_t{1} << 50));
}

}  // namespace
}  // namespace m3
