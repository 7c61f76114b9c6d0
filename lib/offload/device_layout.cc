#include "offload/device_layout.h"

#include <cstring>
#include <vector>

namespace m3 {

using simd::WeightFormat;

const char* DeviceFormatName(DeviceFormat f) {
  switch (f) {
    case DeviceFormat::kF32:
      return "f32";
    case DeviceFormat::kBF16:
      return "bf16";
    case DeviceFormat::kF16:
      return "f16";
    case DeviceFormat::kFp8:
      return "fp8";
    case DeviceFormat::kQ8:
      return "q8";
    case DeviceFormat::kQ4:
      return "q4";
  }
  return "?";
}

DeviceLayout DeviceLayoutFor(const simd::WeightRef& w) {
  DeviceLayout l;
  switch (w.format) {
    case WeightFormat::kF32:
    case WeightFormat::kQ3:  // routed experts' formats: decoded exactly (sub-4-bit codes have no device kernel)
    case WeightFormat::kQ2:
      l.format = DeviceFormat::kF32;
      break;
    case WeightFormat::kBF16:
    case WeightFormat::kBF16Tiled:
      l.format = DeviceFormat::kBF16;
      break;
    case WeightFormat::kF16:
      l.format = DeviceFormat::kF16;
      break;
    case WeightFormat::kE4M3Mx32:
      l.format = DeviceFormat::kFp8;
      break;
    case WeightFormat::kQ8:
      l.format = DeviceFormat::kQ8;
      break;
    case WeightFormat::kQ4:
      l.format = DeviceFormat::kQ4;
      break;
  }
  l.rows = w.rows;
  l.cols = w.cols;
  l.padded_cols = (w.cols + kDeviceGroup - 1) / kDeviceGroup * kDeviceGroup;
  switch (l.format) {
    case DeviceFormat::kF32:
      l.row_bytes = l.padded_cols * 4;
      break;
    case DeviceFormat::kBF16:
    case DeviceFormat::kF16:
      l.row_bytes = l.padded_cols * 2;
      break;
    case DeviceFormat::kFp8:
    case DeviceFormat::kQ8:
      l.row_bytes = l.padded_cols;
      break;
    case DeviceFormat::kQ4:
      l.row_bytes = l.padded_cols / 2;
      break;
  }
  l.code_bytes = static_cast<uint64_t>(l.rows) * l.row_bytes;
  l.scale_bytes = static_cast<uint64_t>(l.rows) * l.scale_cols() * sizeof(float);
  return l;
}

bool IsDeviceVerbatim(const simd::WeightRef& w) {
  return (w.format == WeightFormat::kF32 || w.format == WeightFormat::kBF16 || w.format == WeightFormat::kF16) &&
         w.cols % kDeviceGroup == 0;
}

void ConvertRows(const simd::WeightRef& w, const DeviceLayout& l, size_t r0, size_t r1, uint8_t* codes, float* scales) {
  const size_t groups = l.scale_cols();
  std::vector<float> row;
  for (size_t r = r0; r < r1; ++r) {
    uint8_t* out = codes + (r - r0) * l.row_bytes;
    float* sc = scales ? scales + (r - r0) * groups : nullptr;
    std::memset(out, 0, l.row_bytes);
    switch (w.format) {
      case WeightFormat::kF32:
      case WeightFormat::kBF16:
      case WeightFormat::kF16:
        std::memcpy(out, w.row_bytes(r), w.cols * simd::ElementBytes(w.format));
        break;
      case WeightFormat::kQ3:
      case WeightFormat::kQ2:
        row.resize(w.cols);
        simd::DecodeTiledRow(w, r, row.data());
        std::memcpy(out, row.data(), w.cols * sizeof(float));
        break;
      case WeightFormat::kBF16Tiled:
        for (size_t c = 0; c < w.cols; ++c) {
          const uint16_t h = simd::F32ToBf16(simd::TiledWeightAt(w, r, c));  // exact: a bf16 value
          std::memcpy(out + 2 * c, &h, 2);
        }
        break;
      case WeightFormat::kE4M3Mx32:
        std::memcpy(out, w.row_bytes(r), w.cols);
        for (size_t g = 0; g < groups; ++g) sc[g] = simd::E8M0ToF32(w.scales[r * w.scale_cols() + g]);
        break;
      case WeightFormat::kQ8:
      case WeightFormat::kQ4: {
        // The tile's code bytes as they are; the scale of input c is that of its group.
        const size_t tile = r / simd::kTileRows, tr = r % simd::kTileRows;
        const uint8_t* t = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes();
        for (size_t g = 0; g < groups; ++g) {
          const size_t wg = g * kDeviceGroup / w.group;
          if (w.format == WeightFormat::kQ8) {
            float row_scale;
            std::memcpy(&row_scale, w.q8_row_scales(tile) + tr * 4, 4);
            const int shift = std::min<int>(w.q8_shifts(tile)[wg * simd::kTileRows + tr], simd::kQ8MaxShift);
            sc[g] = std::ldexp(row_scale, -shift);
          } else {
            uint16_t bits;
            std::memcpy(&bits, w.tile_scales(tile) + wg * simd::kTileRows + tr, 2);
            sc[g] = simd::F16ToF32(bits);
          }
        }
        const size_t G = w.group;
        for (size_t c = 0; c < w.cols; ++c) {
          const size_t g = c / G, in = c % G;
          if (w.format == WeightFormat::kQ8) {
            out[c] = t[g * G * simd::kTileRows + (in / 4) * 64 + tr * 4 + in % 4];
          } else {
            const size_t quad = in / 4, half = G / 8;
            const uint8_t byte = t[g * G * simd::kTileRows / 2 + (quad % half) * 64 + tr * 4 + in % 4];
            const uint8_t code = quad < half ? (byte & 0xF) : (byte >> 4);
            out[c / 2] |= static_cast<uint8_t>(c % 2 ? code << 4 : code);
          }
        }
        // Padding decodes to 0: q8 code 128, q4 code 8.
        for (size_t c = w.cols; c < l.padded_cols; ++c) {
          if (w.format == WeightFormat::kQ8)
            out[c] = simd::kQ8Zero;
          else
            out[c / 2] |= static_cast<uint8_t>(c % 2 ? simd::kQ4Zero << 4 : simd::kQ4Zero);
        }
        break;
      }
    }
    if (sc)  // groups wholly past cols (none but the padding) get a finite scale
      for (size_t g = 0; g < groups; ++g)
        if (g * kDeviceGroup >= w.cols) sc[g] = 0.0f;
  }
}

float DeviceWeightAt(const DeviceLayout& l, const uint8_t* codes, const float* scales, size_t r, size_t c) {
  const uint8_t* row = codes + r * l.row_bytes;
  const float scale = l.quantized() ? scales[r * l.scale_cols() + c / kDeviceGroup] : 1.0f;
  switch (l.format) {
    case DeviceFormat::kF32: {
      float f;
      std::memcpy(&f, row + 4 * c, 4);
      return f;
    }
    case DeviceFormat::kBF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * c, 2);
      return simd::Bf16ToF32(h);
    }
    case DeviceFormat::kF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * c, 2);
      return simd::F16ToF32(h);
    }
    case DeviceFormat::kFp8:
      return simd::E4M3ToF32(row[c]) * scale;
    case DeviceFormat::kQ8:
      return static_cast<float>(static_cast<int>(row[c]) - simd::kQ8Zero) * scale;
    case DeviceFormat::kQ4: {
      const int code = c % 2 ? row[c / 2] >> 4 : row[c / 2] & 0xF;
      return static_cast<float>(code - simd::kQ4Zero) * scale;
    }
  }
  return 0.0f;
}

}  // namespace m3
