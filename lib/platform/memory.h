// How much memory this process can still get: the kernel's estimate (MemAvailable of /proc/meminfo),
// bounded by the memory limit of every cgroup level it runs under (v2 memory.max, v1
// memory.limit_in_bytes) less what that level already uses. File pages the kernel would evict
// first (inactive_file of memory.stat) count as available, as MemAvailable counts them: mapped
// weights that were read once must not make a cgroup look full.
//
// The parsing is pure (texts in, bytes out) so that tests feed it sample files; the reader only
// finds and reads the files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace m3 {

// The MemAvailable line of /proc/meminfo ("MemAvailable:  22199644 kB"), in bytes; nullopt when
// missing (kernels before 3.14) or malformed.
std::optional<uint64_t> ParseMemAvailable(std::string_view meminfo);

// The memory files of one cgroup level as read ("" for a missing file).
struct CgroupMemoryFiles {
  std::string limit;  // v2 memory.max ("max" or bytes), v1 memory.limit_in_bytes
  std::string usage;  // v2 memory.current, v1 memory.usage_in_bytes
  std::string stat;   // memory.stat: "total_inactive_file N" (v1, hierarchical) or "inactive_file N"
};

// What one level leaves: limit - usage + inactive file pages (0 when usage is past the limit);
// nullopt when it sets no limit ("max", v1's "unlimited" of about 2^63, or no file) or the limit
// or usage is malformed.
std::optional<uint64_t> CgroupHeadroom(const CgroupMemoryFiles& level);

// The least of MemAvailable and every limited level's headroom; nullopt when none is known.
std::optional<uint64_t> AvailableMemoryFrom(std::string_view meminfo, const std::vector<CgroupMemoryFiles>& levels);

// The directories of this process's memory cgroups, innermost first, from the text of
// /proc/self/cgroup: for the v2 line "0::/a/b", root/a/b, root/a, root; for a v1 line whose
// controllers include "memory" ("4:memory:/a/b"), root/memory/a/b, ..., root/memory. Parents are
// listed because a level's limit binds everything below it, and because inside a container the
// path may name the host's hierarchy while the container sees its own cgroup at the mount root.
std::vector<std::string> CgroupMemoryDirs(std::string_view proc_self_cgroup, const std::string& cgroup_root);

// AvailableMemoryFrom the files of this machine: proc_root/meminfo, proc_root/self/cgroup and the
// cgroup levels under cgroup_root that exist. nullopt when nothing can be read (not Linux).
std::optional<uint64_t> AvailableMemoryBytes(const std::string& proc_root = "/proc",
                                             const std::string& cgroup_root = "/sys/fs/cgroup");

}  // namespace m3
