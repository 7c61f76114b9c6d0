// Byte counts for messages: "512 bytes", "1.5 KiB", "11.9 GiB".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace m3 {

inline std::string FormatBytes(uint64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace m3
