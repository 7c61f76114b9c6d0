// Weight storage formats the kernels read in place, and exact scalar decoders for their elements.
// Every format decodes exactly to fp32 (bf16, f16 and e4m3 values are representable in fp32).
// With cache_format.h this is the "layout" part of the simd layer: plain descriptions that the file
// format, the operators and the model share, with no kernel behind them.
#pragma once

#include <cmath>
#include <algorithm>
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
  // Packed tile formats written by `m3 pack` (docs/PACKED_FORMAT.md). Rows are stored in tiles of
  // 16 (kTileRows), inputs padded with zeros to a multiple of `group`.
  // q8 scales, per row tile: 16 fp32 row scales s, then u8 shifts e [group][16]:
  //   W = (c - 128) * s[row] * 2^-min(e[row, group], kQ8MaxShift)   (u8 code c in 1..255; the
  //   packer writes e <= kQ8MaxShift, and every reader clamps, so no byte gives garbage)
  // Power-of-two group scales keep the kernels' per-group epilogue free of multiplies.
  kQ8 = 4,
  // q4 scales: fp16, one per (row, group), laid out [row_tile][group][16].
  kQ4 = 5,         // 4-bit code c in 0..15: W = (c - 8) * scale
  kBF16Tiled = 6,  // bf16 values, 16 rows x 2 inputs per 64 bytes; no scales (group pads only)
  // Super-block formats for routed experts (groups of kSuperGroup = 256 inputs, sub-blocks of
  // kSubGroup = 32): a b-bit code c in 0..2^b-1, per (row, sub-block) a 4-bit scale sc and a 4-bit
  // min mn, per (row, super-block) fp16 d and dmin:
  //   W = d * sc * c - dmin * mn
  // Scales per row tile: fp16 d [groups][16], fp16 dmin [groups][16], u8 sc | mn << 4
  // [groups][8][16]. The kernels sum c * a in int16 within a sub-block and scale by sc in the
  // same madd that widens to int32, so small groups cost no float work.
  kQ3 = 7,  // 3-bit codes (3.375 bits per weight)
  kQ2 = 8,  // 2-bit codes (2.375 bits per weight)
};

inline constexpr size_t kMxGroup = 32;
inline constexpr size_t kTileRows = 16;
inline constexpr int kQ8Zero = 128;
inline constexpr int kQ4Zero = 8;
// Largest q8 group shift (weights and activations alike): 2^-(e_w + e_a) >= 2^-126 stays a normal
// float, so scaling an exact int32 group sum by it is exact.
inline constexpr int kQ8MaxShift = 63;
inline constexpr size_t kSuperGroup = 256;  // q3 / q2: inputs per fp16 d and dmin (the format's group)
inline constexpr size_t kSubGroup = 32;     // q3 / q2: inputs per 4-bit scale and min
inline constexpr size_t kSubGroups = kSuperGroup / kSubGroup;

// The super-block formats (q3, q2) and their code widths.
inline constexpr bool IsSuperBlock(WeightFormat f) { return f == WeightFormat::kQ3 || f == WeightFormat::kQ2; }
inline constexpr int SuperBlockBits(WeightFormat f) { return f == WeightFormat::kQ3 ? 3 : 2; }

// Weights whose matmuls take int8-quantized activations.
inline constexpr bool IsQuantized(WeightFormat f) {
  return f == WeightFormat::kQ8 || f == WeightFormat::kQ4 || IsSuperBlock(f);
}

inline constexpr bool IsTiled(WeightFormat f) { return IsQuantized(f) || f == WeightFormat::kBF16Tiled; }

inline const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return "f32";
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kF16: return "f16";
    case WeightFormat::kE4M3Mx32: return "mxfp8";
    case WeightFormat::kQ8: return "q8";
    case WeightFormat::kQ4: return "q4";
    case WeightFormat::kBF16Tiled: return "bf16t";
    case WeightFormat::kQ3: return "q3";
    case WeightFormat::kQ2: return "q2";
  }
  return "?";
}

// Bytes per stored element of the value tensor (row-major formats only).
inline constexpr size_t ElementBytes(WeightFormat f) {
  return f == WeightFormat::kF32 ? 4 : (f == WeightFormat::kE4M3Mx32 ? 1 : 2);
}

// A row-major [rows, cols] weight matrix in its stored format (not owned; usually mapped).
struct WeightRef {
  WeightFormat format = WeightFormat::kF32;
  const void* data = nullptr;     // [rows, cols] elements
  const uint8_t* scales = nullptr;  // kE4M3Mx32: [rows, ceil(cols/32)] E8M0 codes;
                                    // kQ8/kQ4/kQ3/kQ2: tile_scale_bytes() per row tile (see WeightFormat)
  size_t rows = 0;
  size_t cols = 0;
  size_t group = 0;  // tiled formats: inputs per scale (multiple of 32); cols pad to a multiple

  size_t scale_cols() const { return (cols + kMxGroup - 1) / kMxGroup; }
  const uint8_t* row_bytes(size_t r) const {  // row-major formats only
    return static_cast<const uint8_t*>(data) + r * cols * ElementBytes(format);
  }
  // Tiled formats.
  size_t row_tiles() const { return (rows + kTileRows - 1) / kTileRows; }
  size_t padded_cols() const { return (cols + group - 1) / group * group; }
  size_t groups() const { return padded_cols() / group; }
  // Bytes of codes (or bf16 values) in one row tile; tile t starts at data + t * tile_bytes().
  size_t tile_bytes() const {
    const size_t p = padded_cols();
    if (IsSuperBlock(format)) return kTileRows * p / 8 * SuperBlockBits(format);
    return format == WeightFormat::kQ4 ? kTileRows * p / 2 : format == WeightFormat::kQ8 ? kTileRows * p : kTileRows * p * 2;
  }
  // Scale bytes of one row tile: q8 16 fp32 row scales + groups x 16 u8 shifts, q4 groups x 16
  // fp16, q3/q2 groups x 16 x (two fp16 + 8 u8), bf16 none.
  size_t tile_scale_bytes() const {
    if (IsSuperBlock(format)) return groups() * kTileRows * (4 + kSubGroups);
    return format == WeightFormat::kQ8 ? kTileRows * 4 + groups() * kTileRows
           : format == WeightFormat::kQ4 ? groups() * kTileRows * 2 : 0;
  }
  // q3/q2, per row tile: fp16 d [groups][16], fp16 dmin [groups][16], u8 sc | mn << 4 [groups][8][16].
  const uint16_t* sb_d(size_t tile) const { return reinterpret_cast<const uint16_t*>(scales + tile * tile_scale_bytes()); }
  const uint16_t* sb_dmin(size_t tile) const { return sb_d(tile) + groups() * kTileRows; }
  const uint8_t* sb_sub(size_t tile) const { return scales + tile * tile_scale_bytes() + groups() * kTileRows * 4; }
  const uint16_t* tile_scales(size_t tile) const {  // q4: fp16 [groups][16]
    return reinterpret_cast<const uint16_t*>(scales + tile * tile_scale_bytes());
  }
  const uint8_t* q8_row_scales(size_t tile) const {  // q8: fp32 [16] (not necessarily 4-aligned)
    return scales + tile * tile_scale_bytes();
  }
  const uint8_t* q8_shifts(size_t tile) const {  // q8: u8 [groups][16]
    return scales + tile * tile_scale_bytes() + kTileRows * 4;
  }
};

// Total bytes of a tiled matrix's codes and of its scales (0 for kBF16Tiled).
inline size_t TiledCodeBytes(const WeightRef& w) { return w.row_tiles() * w.tile_bytes(); }
inline size_t TiledScaleBytes(const WeightRef& w) { return w.row_tiles() * w.tile_scale_bytes(); }

// The stored bytes of row tiles [t0, t1) (16 rows each; the last may be partial) of a weight in
// any format: where its elements and its scales start, and how many bytes each (scales: 0 and
// null for formats without them).
struct StoredSpan {
  const uint8_t* data = nullptr;
  size_t data_bytes = 0;
  const uint8_t* scales = nullptr;
  size_t scale_bytes = 0;
};
inline StoredSpan RowTileSpan(const WeightRef& w, size_t t0, size_t t1);

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

// fp32 -> fp16 bits, round to nearest even; overflow gives inf, NaN stays NaN.
inline uint16_t F32ToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00u;             // NaN
  if (abs >= 0x477FF000u) return sign | 0x7C00u;            // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                  // fp16 subnormal or zero
    const float a = BitsToF32(abs);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24f));  // exact scaling, RNE
  }
  const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);  // RNE on the 13 dropped bits
  return sign | static_cast<uint16_t>((rounded >> 13) - (112u << 10));
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
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

// q3/q2 codes: a super-block's row tile is 16 chunks, chunk k covering quads 4k..4k+3 (inputs
// 16k..16k+15). Its 64 bytes hold 16 rows x 4 inputs (byte row * 4 + input % 4), 2 low bits of
// quad 4k+f in bits 2f..2f+1. q3 follows each chunk with 32 bytes of high bits: byte b, bit f is
// the high bit of field f of chunk byte b, bit 4 + f that of chunk byte b + 32.
inline int SuperBlockCode(WeightFormat f, const uint8_t* super_block, size_t tr, size_t in) {
  const size_t chunk = in / 16, field = (in / 4) % 4, byte = tr * 4 + in % 4;
  const size_t chunk_bytes = f == WeightFormat::kQ3 ? 96 : 64;
  const uint8_t* ch = super_block + chunk * chunk_bytes;
  int code = (ch[byte] >> (2 * field)) & 3;
  if (f == WeightFormat::kQ3) code |= ((ch[64 + byte % 32] >> (field + 4 * (byte / 32))) & 1) << 2;
  return code;
}

// Element (tile row tr, input in) of super-block g of row tile `tile`: d * sc * c - dmin * mn.
inline float SuperBlockWeightAt(const WeightRef& w, size_t tile, size_t tr, size_t g, size_t in) {
  const uint8_t* sb = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes() +
                      g * kTileRows * kSuperGroup / 8 * SuperBlockBits(w.format);
  uint16_t d, dmin;
  std::memcpy(&d, w.sb_d(tile) + g * kTileRows + tr, 2);
  std::memcpy(&dmin, w.sb_dmin(tile) + g * kTileRows + tr, 2);
  const uint8_t sub = w.sb_sub(tile)[(g * kSubGroups + in / kSubGroup) * kTileRows + tr];
  const float scale = F16ToF32(d) * static_cast<float>(sub & 0xF);
  const float min = F16ToF32(dmin) * static_cast<float>(sub >> 4);
  return scale * static_cast<float>(SuperBlockCode(w.format, sb, tr, in)) - min;
}

// Exact value of element (r, c) of a tiled matrix (see the layout in docs/PACKED_FORMAT.md).
inline float TiledWeightAt(const WeightRef& w, size_t r, size_t c) {
  const size_t tile = r / kTileRows, tr = r % kTileRows;
  const uint8_t* t = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes();
  if (w.format == WeightFormat::kBF16Tiled) {
    uint16_t h;
    std::memcpy(&h, t + ((c / 2) * kTileRows * 2 + tr * 2 + c % 2) * 2, 2);
    return Bf16ToF32(h);
  }
  const size_t g = c / w.group, in = c % w.group;  // input within the group
  if (IsSuperBlock(w.format)) return SuperBlockWeightAt(w, tile, tr, g, in);
  if (w.format == WeightFormat::kQ8) {
    const uint8_t code = t[g * w.group * kTileRows + (in / 4) * 64 + tr * 4 + in % 4];
    float row_scale;
    std::memcpy(&row_scale, w.q8_row_scales(tile) + tr * 4, 4);
    const int shift = std::min<int>(w.q8_shifts(tile)[g * kTileRows + tr], kQ8MaxShift);
    return static_cast<float>(static_cast<int>(code) - kQ8Zero) * std::ldexp(row_scale, -shift);
  }
  uint16_t scale_bits;
  std::memcpy(&scale_bits, w.tile_scales(tile) + g * kTileRows + tr, 2);
  const float scale = F16ToF32(scale_bits);
  // kQ4: 64-byte chunk v of a group holds quad v in low nibbles and quad v + group/8 in high ones.
  const size_t quad = in / 4, half = w.group / 8;
  const uint8_t byte = t[g * w.group * kTileRows / 2 + (quad % half) * 64 + tr * 4 + in % 4];
  const int code = quad < half ? (byte & 0xF) : (byte >> 4);
  return static_cast<float>(code - kQ4Zero) * scale;
}

// Row r of a tiled matrix into out[0, cols): the values TiledWeightAt gives, with each group's
// scale found once (a prompt's embedding lookups: ~10x fewer operations than element by element).
inline void DecodeTiledRow(const WeightRef& w, size_t r, float* out) {
  const size_t tile = r / kTileRows, tr = r % kTileRows;
  const uint8_t* t = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes();
  if (w.format == WeightFormat::kBF16Tiled) {
    for (size_t c = 0; c < w.cols; ++c) {
      uint16_t h;
      std::memcpy(&h, t + ((c / 2) * kTileRows * 2 + tr * 2 + c % 2) * 2, 2);
      out[c] = Bf16ToF32(h);
    }
    return;
  }
  const size_t G = w.group;
  for (size_t g = 0; g * G < w.cols; ++g) {
    const size_t n = std::min(G, w.cols - g * G);
    float* o = out + g * G;
    if (IsSuperBlock(w.format)) {
      for (size_t in = 0; in < n; ++in) o[in] = SuperBlockWeightAt(w, tile, tr, g, in);
      continue;
    }
    if (w.format == WeightFormat::kQ8) {
      float row_scale;
      std::memcpy(&row_scale, w.q8_row_scales(tile) + tr * 4, 4);
      const int shift = std::min<int>(w.q8_shifts(tile)[g * kTileRows + tr], kQ8MaxShift);
      const float scale = std::ldexp(row_scale, -shift);
      const uint8_t* codes = t + g * G * kTileRows + tr * 4;
      for (size_t in = 0; in < n; ++in)
        o[in] = static_cast<float>(static_cast<int>(codes[(in / 4) * 64 + in % 4]) - kQ8Zero) * scale;
      continue;
    }
    uint16_t scale_bits;
    std::memcpy(&scale_bits, w.tile_scales(tile) + g * kTileRows + tr, 2);
    const float scale = F16ToF32(scale_bits);
    const size_t half = G / 8;
    const uint8_t* codes = t + g * G * kTileRows / 2 + tr * 4;
    for (size_t in = 0; in < n; ++in) {
      const size_t quad = in / 4;
      const uint8_t byte = codes[(quad % half) * 64 + in % 4];
      o[in] = static_cast<float>((quad < half ? (byte & 0xF) : (byte >> 4)) - kQ4Zero) * scale;
    }
  }
}

// Exact value of element (r, c).
inline float WeightAt(const WeightRef& w, size_t r, size_t c) {
  if (IsTiled(w.format)) return TiledWeightAt(w, r, c);
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
    default:
      break;
  }
  return 0.0f;
}

inline StoredSpan RowTileSpan(const WeightRef& w, size_t t0, size_t t1) {
  const auto* d = static_cast<const uint8_t*>(w.data);
  if (IsTiled(w.format)) {
    const size_t scale_tile = w.tile_scale_bytes();
    return {d + t0 * w.tile_bytes(), (t1 - t0) * w.tile_bytes(), w.scales ? w.scales + t0 * scale_tile : nullptr,
            w.scales ? (t1 - t0) * scale_tile : 0};
  }
  const size_t r0 = std::min(w.rows, t0 * kTileRows), r1 = std::min(w.rows, t1 * kTileRows);
  const size_t row_bytes = w.cols * ElementBytes(w.format);
  const size_t scale_row = w.format == WeightFormat::kE4M3Mx32 && w.scales ? w.scale_cols() : 0;
  return {d + r0 * row_bytes, (r1 - r0) * row_bytes, scale_row ? w.scales + r0 * scale_row : nullptr,
          (r1 - r0) * scale_row};
}

// Default groups of the packed formats (m3 pack).
inline constexpr size_t kQ8Group = 128;
inline constexpr size_t kQ4Group = 32;
inline constexpr size_t kBf16TiledGroup = 32;  // padding unit only

// Geometry of a tiled matrix (data and scales left null). `group` 0 picks the format's default.
inline WeightRef TiledShape(WeightFormat format, size_t rows, size_t cols, size_t group = 0) {
  WeightRef w;
  w.format = format;
  w.rows = rows;
  w.cols = cols;
  w.group = group                  ? group
            : IsSuperBlock(format)  ? kSuperGroup
            : format == WeightFormat::kQ8 ? kQ8Group
            : format == WeightFormat::kQ4 ? kQ4Group
                                          : kBf16TiledGroup;
  return w;
}

}  // namespace m3::simd
