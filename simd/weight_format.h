// Weight storage formats the kernels read in place, and exact scalar decoders for their elements.
// Every format decodes exactly to fp32 (bf16, f16 and e4m3 values are representable in fp32).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace m3::simd {

enum class WeightFormat : uint8_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  // MXFP8: FP8 E4M3 (OCP "fn": bias 7, no inf, 0x7F/0xFF = NaN) with one E8M0 exponent per 32
  // consecutive inputs of a row: W[o, i] = e4m3(q[o, i]) * 2^(scale[o, i / 32] - 127).
  kE4M3Mx32 = 3,
};

inline constexpr size_t kMxGroup = 32;

const char* WeightFormatName(WeightFormat f);

// Bytes per stored element of the value tensor.
inline constexpr size_t ElementBytes(WeightFormat f) {
  return f == WeightFormat::kF32 ? 4 : (f == WeightFormat::kE4M3Mx32 ? 1 : 2);
}

// A row-major [rows, cols] weight matrix in its stored format (not owned; usually mapped).
struct WeightRef {
  WeightFormat format = WeightFormat::kF32;
  const void* data = nullptr;     // [rows, cols] elements
  const uint8_t* scales = nullptr;  // kE4M3Mx32 only: [rows, ceil(cols/32)] E8M0 codes
  size_t rows = 0;
  size_t cols = 0;

  size_t scale_cols() const { return (cols + kMxGroup - 1) / kMxGroup; }
  const uint8_t* row_bytes(size_t r) const {
    return static_cast<const uint8_t*>(data) + r * cols * ElementBytes(format);
  }
};

inline float BitsToF32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float Bf16ToF32(uint16_t h) { return BitsToF32(static_cast<uint32_t>(h) << 16); }

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToF32(sign | 0x7F800000u | (man << 13));  // inf / nan
  return BitsToF32(sign | ((exp + 112u) << 23) | (man << 13));
}

inline float E4M3ToF32(uint8_t b) {
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t exp = (b >> 3) & 0xF;
  const uint32_t man = b & 0x7;
  float v = exp == 0 ? std::ldexp(static_cast<float>(man), -9)
                     : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, static_cast<int>(exp) - 7);
  return (b & 0x80) ? -v : v;
}

inline float E8M0ToF32(uint8_t code) {
  if (code == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

// Exact value of element (r, c).
inline float WeightAt(const WeightRef& w, size_t r, size_t c) {
  const uint8_t* row = w.row_bytes(r);
  switch (w.format) {
    case WeightFormat::kF32: {
      float f;
      std::memcpy(&f, row + 4 * c, 4);
      return f;
    }
    case WeightFormat::kBF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * c, 2);
      return Bf16ToF32(h);
    }
    case WeightFormat::kF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * c, 2);
      return F16ToF32(h);
    }
    case WeightFormat::kE4M3Mx32:
      return E4M3ToF32(row[c]) * E8M0ToF32(w.scales[r * w.scale_cols() + c / kMxGroup]);
  }
  return 0.0f;
}

}  // namespace m3::simd
