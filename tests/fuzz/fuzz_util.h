// Shared by the fuzz targets (tests/fuzz/README.md): the input as a file, for parsers that read
// files (safetensors, the packed file, npy), written once per run into a private folder.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace m3::fuzz {

inline std::string WriteInput(const char* name, const uint8_t* data, size_t size) {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("m3_fuzz_" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  const std::string path = (dir / name).string();
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                static_cast<std::streamsize>(size));
  return path;
}

// The input split at its first NUL byte (template text, then render data; or the same for other
// two-part inputs); no NUL: all of it is the first part.
inline std::pair<std::string_view, std::string_view> SplitAtNul(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  if (nul == std::string_view::npos) return {all, {}};
  return {all.substr(0, nul), all.substr(nul + 1)};
}

}  // namespace m3::fuzz
