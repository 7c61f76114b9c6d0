// m3's q3 and q2 quantizer on a matrix from a file (float32, row-major, COLS a multiple of 256),
// plain and weighted by an importance vector: the relative error sum imp (w - q)^2 / sum imp w^2 of
// each, as `m3 bench --quant` computes it. For comparing a prototype quantizer on the same numbers
// (bench/research/codebook_q2.py writes such files).
// Usage: bench_quantize_file MATRIX.bin IMPORTANCE.bin COLS
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "platform/mapped_file.h"
#include "simd/weight_format.h"
#include "simd/weight_pack.h"

namespace {

// The file's float32 values; false (with the reason on stderr) when it cannot be mapped or its
// size is not whole floats.
bool ReadFloats(const char* path, std::vector<float>& out) {
  auto file = m3::MappedFile::Open(path);
  if (!file.ok()) {
    std::fprintf(stderr, "%s\n", file.status().ToString().c_str());
    return false;
  }
  const size_t bytes = (*file)->size();
  if (bytes == 0 || bytes % sizeof(float) != 0) {
    std::fprintf(stderr, "%s: %zu bytes, not a whole number of float32 values\n", path, bytes);
    return false;
  }
  out.resize(bytes / sizeof(float));
  std::memcpy(out.data(), (*file)->data(), bytes);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using m3::simd::kSuperGroup;
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MATRIX.bin IMPORTANCE.bin COLS\n", argv[0]);
    return 2;
  }
  const long cols_arg = std::strtol(argv[3], nullptr, 10);
  std::vector<float> x, imp;
  if (!ReadFloats(argv[1], x) || !ReadFloats(argv[2], imp)) return 1;
  const size_t cols = cols_arg > 0 ? static_cast<size_t>(cols_arg) : 0;
  if (cols == 0 || cols % kSuperGroup != 0 || x.size() % cols != 0 || imp.size() != cols) {
    std::fprintf(stderr, "%s: COLS must be a positive multiple of %zu dividing the matrix, the importance that long\n",
                 argv[0], kSuperGroup);
    return 1;
  }
  const size_t rows = x.size() / cols;
  for (int bits = 3; bits >= 2; --bits)
    for (int weighted = 0; weighted < 2; ++weighted) {
      double err = 0, total = 0;
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; c += kSuperGroup) {
          const float* xs = &x[r * cols + c];
          const float* w = weighted ? &imp[c] : nullptr;
          uint8_t codes[kSuperGroup], sub[m3::simd::kSubGroups];
          uint16_t d, dmin;
          err += m3::simd::QuantizeSuperBlock(xs, w, kSuperGroup, bits, codes, &d, &dmin, sub);
          for (size_t i = 0; i < kSuperGroup; ++i) total += (w ? w[i] : 1.0) * xs[i] * xs[i];
        }
      std::printf("m3 q%d (%s): %zu x %zu, relative error %.4e\n", bits, weighted ? "importance" : "none", rows, cols,
                  err / total);
    }
  return 0;
}
