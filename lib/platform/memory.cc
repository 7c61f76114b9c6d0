#include "platform/memory.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>

namespace m3 {
namespace {

std::string_view Trim(std::string_view s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string_view::npos) return {};
  return s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
}

std::optional<uint64_t> ParseU64(std::string_view s) {
  s = Trim(s);
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

// The value of the line "key value" in a memory.stat text.
std::optional<uint64_t> StatField(std::string_view stat, std::string_view key) {
  while (!stat.empty()) {
    const size_t eol = stat.find('\n');
    const std::string_view line = stat.substr(0, eol);
    stat = eol == std::string_view::npos ? std::string_view() : stat.substr(eol + 1);
    if (line.size() > key.size() && line.substr(0, key.size()) == key && line[key.size()] == ' ')
      return ParseU64(line.substr(key.size() + 1));
  }
  return std::nullopt;
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::optional<uint64_t> ParseMemAvailable(std::string_view meminfo) {
  constexpr std::string_view kKey = "MemAvailable:";
  const size_t at = meminfo.find(kKey);
  if (at == std::string_view::npos || (at > 0 && meminfo[at - 1] != '\n')) return std::nullopt;
  std::string_view rest = meminfo.substr(at + kKey.size());
  rest = Trim(rest.substr(0, rest.find('\n')));
  if (rest.size() < 3 || rest.substr(rest.size() - 3) != " kB") return std::nullopt;
  const auto kb = ParseU64(rest.substr(0, rest.size() - 3));
  if (!kb || *kb > (UINT64_MAX >> 10)) return std::nullopt;
  return *kb << 10;
}

std::optional<uint64_t> CgroupHeadroom(const CgroupMemoryFiles& level) {
  const std::string_view limit_text = Trim(level.limit);
  if (limit_text.empty() || limit_text == "max") return std::nullopt;
  const auto limit = ParseU64(limit_text);
  // v1 writes "unlimited" as the largest page count times the page size (2^63 - 4096 with 4 KiB
  // pages); no machine has 2^62 bytes.
  if (!limit || *limit >= (uint64_t{1} << 62)) return std::nullopt;
  const auto usage = ParseU64(level.usage);
  if (!usage) return std::nullopt;
  auto inactive = StatField(level.stat, "total_inactive_file");
  if (!inactive) inactive = StatField(level.stat, "inactive_file");
  const uint64_t used = *usage - std::min(*usage, inactive.value_or(0));
  return *limit > used ? *limit - used : 0;
}

std::optional<uint64_t> AvailableMemoryFrom(std::string_view meminfo, const std::vector<CgroupMemoryFiles>& levels) {
  std::optional<uint64_t> least = ParseMemAvailable(meminfo);
  for (const CgroupMemoryFiles& level : levels)
    if (const auto room = CgroupHeadroom(level)) least = least ? std::min(*least, *room) : *room;
  return least;
}

std::vector<std::string> CgroupMemoryDirs(std::string_view proc_self_cgroup, const std::string& cgroup_root) {
  std::vector<std::string> dirs;
  // mount + path, then each parent up to the mount itself; "." and ".." are not followed.
  auto add_with_parents = [&](const std::string& mount, std::string_view path) {
    std::vector<std::string_view> parts;
    for (std::string_view rest = path; !rest.empty();) {
      const size_t slash = rest.find('/');
      const std::string_view part = rest.substr(0, slash);
      if (part == "..") return;
      if (!part.empty() && part != ".") parts.push_back(part);
      rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
    }
    for (size_t n = parts.size() + 1; n-- > 0;) {
      std::string dir = mount;
      for (size_t i = 0; i < n; ++i) (dir += '/') += parts[i];
      if (std::find(dirs.begin(), dirs.end(), dir) == dirs.end()) dirs.push_back(std::move(dir));
    }
  };
  while (!proc_self_cgroup.empty()) {
    const size_t eol = proc_self_cgroup.find('\n');
    const std::string_view line = proc_self_cgroup.substr(0, eol);
    proc_self_cgroup = eol == std::string_view::npos ? std::string_view() : proc_self_cgroup.substr(eol + 1);
    // hierarchy-id:controller-list:path; the path may itself hold ':'.
    const size_t c1 = line.find(':');
    const size_t c2 = c1 == std::string_view::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, c1), controllers = line.substr(c1 + 1, c2 - c1 - 1);
    const std::string_view path = line.substr(c2 + 1);
    if (path.empty() || path[0] != '/') continue;
    if (id == "0" && controllers.empty()) {
      add_with_parents(cgroup_root, path);
      continue;
    }
    for (std::string_view rest = controllers; !rest.empty();) {
      const size_t comma = rest.find(',');
      if (rest.substr(0, comma) == "memory") {
        add_with_parents(cgroup_root + "/memory", path);
        break;
      }
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
  }
  return dirs;
}

std::optional<uint64_t> AvailableMemoryBytes(const std::string& proc_root, const std::string& cgroup_root) {
  std::vector<CgroupMemoryFiles> levels;
  for (const std::string& dir : CgroupMemoryDirs(ReadSmallFile(proc_root + "/self/cgroup"), cgroup_root)) {
    CgroupMemoryFiles level;
    level.limit = ReadSmallFile(dir + "/memory.max");  // v2
    if (!level.limit.empty()) {
      level.usage = ReadSmallFile(dir + "/memory.current");
    } else {
      level.limit = ReadSmallFile(dir + "/memory.limit_in_bytes");  // v1
      level.usage = ReadSmallFile(dir + "/memory.usage_in_bytes");
    }
    if (level.limit.empty()) continue;
    level.stat = ReadSmallFile(dir + "/memory.stat");
    levels.push_back(std::move(level));
  }
  return AvailableMemoryFrom(ReadSmallFile(proc_root + "/meminfo"), levels);
}

}  // namespace m3
