#include "format/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>

namespace m3 {

Status WriteNpyF32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? ", " : "");
    n *= shape[i];
  }
  dict += "), }";
  // Pad so that magic(6) + version(2) + len(2) + dict + '\n' is a multiple of 64.
  size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) return IoError(path, ": cannot create");
  const char magic[] = "\x93NUMPY\x01\x00";
  out.write(magic, 8);
  uint16_t hlen = static_cast<uint16_t>(dict.size());
  out.write(reinterpret_cast<const char*>(&hlen), 2);
  out.write(dict.data(), static_cast<std::streamsize>(dict.size()));
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n * sizeof(float)));
  if (!out) return IoError(path, ": write failed");
  return Status::Ok();
}

StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path, ": cannot open");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) return Corrupt(path, ": not an .npy file");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t hlen, hstart;
  if (major == 1) {
    uint16_t h;
    std::memcpy(&h, bytes.data() + 8, 2);
    hlen = h, hstart = 10;
  } else {
    if (bytes.size() < 12) return Corrupt(path, ": truncated header");
    uint32_t h;
    std::memcpy(&h, bytes.data() + 8, 4);
    hlen = h, hstart = 12;
  }
  if (hstart + hlen > bytes.size()) return Corrupt(path, ": truncated header");
  const std::string header = bytes.substr(hstart, hlen);
  const bool f4 = header.find("'<f4'") != std::string::npos;
  const bool f8 = header.find("'<f8'") != std::string::npos;
  if (!f4 && !f8) return Unsupported(path, ": only little-endian float32/float64 arrays are read");
  if (header.find("'fortran_order': True") != std::string::npos) return Unsupported(path, ": Fortran order");
  NpyArray arr;
  size_t p = header.find("'shape': (");
  if (p == std::string::npos) return Corrupt(path, ": no shape");
  p += 10;
  const size_t q = header.find(')', p);
  if (q == std::string::npos) return Corrupt(path, ": shape has no closing ')'");
  const std::string dims = header.substr(p, q - p);
  // Dimensions: non-negative decimal integers separated by commas (a trailing one for 1-D); their
  // product is bounded by the bytes the file holds, so it cannot overflow.
  const size_t esize = f4 ? 4 : 8;
  const size_t off = hstart + hlen;
  const uint64_t max_values = (bytes.size() - off) / esize;
  uint64_t n = 1;
  size_t i = 0;
  while (i < dims.size()) {
    while (i < dims.size() && (dims[i] == ' ' || dims[i] == ',')) ++i;
    if (i >= dims.size()) break;
    if (dims[i] < '0' || dims[i] > '9') return Corrupt(path, ": shape '", dims, "' is not a list of integers");
    uint64_t d = 0;
    for (; i < dims.size() && dims[i] >= '0' && dims[i] <= '9'; ++i) {
      d = d * 10 + static_cast<uint64_t>(dims[i] - '0');
      if (d > max_values) return Corrupt(path, ": shape '", dims, "' needs more data than the file holds");
    }
    if (i < dims.size() && dims[i] != ',' && dims[i] != ' ')
      return Corrupt(path, ": shape '", dims, "' is not a list of integers");
    arr.shape.push_back(static_cast<int64_t>(d));
    if (d != 0 && n > max_values / d) return Corrupt(path, ": shape '", dims, "' needs more data than the file holds");
    n *= d;
  }
  if (n > max_values) return Corrupt(path, ": truncated data");
  arr.data.resize(static_cast<size_t>(n));
  for (uint64_t k = 0; k < n; ++k) {
    if (f4) {
      std::memcpy(&arr.data[k], bytes.data() + off + 4 * k, 4);
    } else {
      double d;
      std::memcpy(&d, bytes.data() + off + 8 * k, 8);
      arr.data[k] = static_cast<float>(d);
    }
  }
  return arr;
}

}  // namespace m3
