// How a weight matrix lies in device memory: row-major, each row padded with zeros to a multiple
// of 32 inputs, in one of six encodings. The file's row-major f32, bf16 and f16 matrices keep
// their bytes (copied straight from the mapping when no padding is needed); everything else is
// re-laid here, exactly: a packed tile matrix (m3 pack) or MXFP8 keeps its codes, with one fp32
// scale per 32 inputs of a row (q8: row scale * 2^-shift; q4: its fp16 scale; MXFP8: 2^(e - 127)),
// so a kernel decodes any element as code * scale in fp32, as the CPU's exact decoders do.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/weight_format.h"

namespace m3 {

enum class DeviceFormat : uint8_t {
  kF32,
  kBF16,
  kF16,
  kFp8,  // u8 E4M3 codes, fp32 scale per 32 inputs
  kQ8,   // u8 codes c, W = (c - 128) * scale
  kQ4,   // two 4-bit codes a byte (input 2i low nibble, 2i + 1 high), W = (c - 8) * scale
};

inline constexpr size_t kDeviceGroup = 32;  // inputs per scale, and the padding of every row

struct DeviceLayout {
  DeviceFormat format = DeviceFormat::kF32;
  size_t rows = 0, cols = 0;
  size_t padded_cols = 0;  // cols rounded up to kDeviceGroup
  size_t row_bytes = 0;    // bytes of codes per row (a multiple of 16)
  uint64_t code_bytes = 0, scale_bytes = 0;
  bool quantized() const {
    return format == DeviceFormat::kFp8 || format == DeviceFormat::kQ8 || format == DeviceFormat::kQ4;
  }
  size_t scale_cols() const { return quantized() ? padded_cols / kDeviceGroup : 0; }
  uint64_t bytes() const { return code_bytes + scale_bytes; }
};

const char* DeviceFormatName(DeviceFormat f);

DeviceLayout DeviceLayoutFor(const simd::WeightRef& w);

// Whether rows of `w` lie in the device layout exactly as in the file (no conversion).
bool IsDeviceVerbatim(const simd::WeightRef& w);

// Rows [r0, r1) of `w` in the device layout: codes [r1 - r0][row_bytes], scales [r1 - r0][scale_cols].
void ConvertRows(const simd::WeightRef& w, const DeviceLayout& layout, size_t r0, size_t r1, uint8_t* codes,
                 float* scales);

// Element (r, c) of a matrix in the device layout (codes and scales of the whole matrix), as the
// device kernels decode it; c < padded_cols (the padding decodes to 0).
float DeviceWeightAt(const DeviceLayout& layout, const uint8_t* codes, const float* scales, size_t r, size_t c);

}  // namespace m3
