// The tiled weight formats and their quantizers: layout round trips, fp16 rounding, the q8
// shifts, and the q4 quality guarantee against llama.cpp's Q4_0.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "test_util.h"
#include "simd/weight_pack.h"

namespace m3::simd {
namespace {

struct Packed {
  WeightRef w;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
};

Packed Pack(WeightFormat f, size_t rows, size_t cols, const std::vector<float>& src,
            const std::vector<float>* importance = nullptr) {
  Packed p;
  p.w = TiledShape(f, rows, cols);
  p.codes.resize(TiledCodeBytes(p.w));
  p.scales.resize(std::max<size_t>(1, TiledScaleBytes(p.w)));
  std::vector<float> padded(p.w.row_tiles() * kTileRows * cols, 0.0f);
  std::copy(src.begin(), src.end(), padded.begin());
  REQUIRE(PackRowTiles(p.w, padded.data(), 0, p.w.row_tiles(), p.codes.data(), p.scales.data(),
                       importance ? importance->data() : nullptr));
  p.w.data = p.codes.data();
  p.w.scales = p.scales.data();
  return p;
}

TEST_CASE("F32ToF16 rounds to nearest even and round-trips every fp16 value") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;  // NaN payloads
    const float f = F16ToF32(static_cast<uint16_t>(h));
    REQUIRE(F32ToF16(f) == h);
  }
  CHECK(F32ToF16(1.0f + 0x1p-11f) == F32ToF16(1.0f));                 // tie to even (down)
  CHECK(F32ToF16(1.0f + 3 * 0x1p-11f) == F32ToF16(1.0f + 0x1p-9f));   // tie to even (up)
  CHECK(F32ToF16(65520.0f) == 0x7C00);
  CHECK(F32ToF16(65519.0f) == 0x7BFF);
  CHECK(F32ToF16(0x1p-25f) == 0);            // tie to even at the bottom
  CHECK(F32ToF16(0x1p-25f * 1.5f) == 1);
  CHECK(std::isnan(F16ToF32(F32ToF16(NAN))));
  CHECK(F32ToBf16(1.0f) == 0x3F80);
  CHECK(F32ToBf16(BitsToF32(0x3F808000u)) == 0x3F80);  // tie to even
  CHECK(F32ToBf16(BitsToF32(0x3F818000u)) == 0x3F82);
}

TEST_CASE("Tiled formats decode to the quantized values, with zero padding, for odd shapes") {
  for (WeightFormat f :
       {WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kQ3, WeightFormat::kQ2, WeightFormat::kBF16Tiled}) {
    for (auto [rows, cols] : {std::pair<size_t, size_t>{1, 1}, {5, 33}, {16, 128}, {17, 200}, {40, 96}, {33, 257}}) {
      INFO(WeightFormatName(f) << " " << rows << "x" << cols);
      const auto src = test::RandomVec(rows * cols, 7 + static_cast<uint32_t>(rows * cols), 0.5f);
      const Packed p = Pack(f, rows, cols, src);
      double err = 0, ref = 0;
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; ++c) {
          const float v = WeightAt(p.w, r, c), x = src[r * cols + c];
          if (f == WeightFormat::kBF16Tiled) REQUIRE(v == Bf16ToF32(F32ToBf16(x)));
          err += (v - x) * (v - x);
          ref += x * x;
        }
      const double rel = std::sqrt(err / ref);
      const double bound = f == WeightFormat::kQ2   ? 0.4
                           : f == WeightFormat::kQ3 ? 0.2
                           : f == WeightFormat::kQ4 ? 0.12
                           : f == WeightFormat::kQ8 ? 0.01
                                                    : 0.004;
      CHECK(rel < bound);
      // DecodeTiledRow gives WeightAt's values.
      std::vector<float> row(cols);
      for (size_t r = 0; r < rows; ++r) {
        DecodeTiledRow(p.w, r, row.data());
        for (size_t c = 0; c < cols; ++c) REQUIRE(row[c] == WeightAt(p.w, r, c));
      }
      // Padding rows and inputs decode to zero.
      for (size_t r = rows; r < p.w.row_tiles() * kTileRows; ++r)
        for (size_t c = 0; c < p.w.padded_cols(); ++c) REQUIRE(TiledWeightAt(p.w, r, c) == 0.0f);
      // Padding inputs: zero, but for q3/q2 within a sub-block that has real inputs: its code
      // nearest zero (activations are zero there, so matmuls see nothing of it).
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = cols; c < p.w.padded_cols(); ++c) {
          if (IsSuperBlock(f) && c / kSubGroup == (cols - 1) / kSubGroup) continue;
          REQUIRE(TiledWeightAt(p.w, r, c) == 0.0f);
        }
    }
  }
}

TEST_CASE("q8 codes are the rounded values of x / (s 2^-e): one row scale, a shift per group") {
  // Row 0: groups of amax 64, 20, 1, 0 and 64 * 2^-70 (beyond the largest shift).
  const size_t cols = 5 * 128;
  std::vector<float> src(cols);
  const float amax[5] = {64.0f, 20.0f, 1.0f, 0.0f, std::ldexp(64.0f, -70)};
  for (size_t c = 0; c < cols; ++c)
    src[c] = amax[c / 128] * (static_cast<float>(c % 128) - 64.0f) / 64.0f;
  const Packed p = Pack(WeightFormat::kQ8, 1, cols, src);
  float s;
  std::memcpy(&s, p.w.q8_row_scales(0), 4);
  CHECK(s >= 64.0f / 127.0f);
  CHECK(s < 2 * 64.0f / 127.0f);
  const uint8_t* shifts = p.w.q8_shifts(0);
  for (size_t g = 0; g < 5; ++g) {
    const int e = shifts[g * kTileRows];
    INFO("group " << g << " shift " << e);
    CHECK(e <= kQ8MaxShift);
    if (g == 3) CHECK(e == 0);
    if (g == 4) CHECK(e == kQ8MaxShift);
    // The largest shift that keeps the group's codes within 127.
    if (amax[g] > 0 && e < kQ8MaxShift) {
      CHECK(std::ldexp(static_cast<double>(amax[g]), e) <= 127.0 * s);
      CHECK(std::ldexp(static_cast<double>(amax[g]), e + 1) > 127.0 * s);
    }
    const float d = std::ldexp(s, -e);
    for (size_t c = g * 128; c < (g + 1) * 128; ++c) {
      const int code = std::clamp<int>(static_cast<int>(std::nearbyint(src[c] / d)), -127, 127);
      REQUIRE(WeightAt(p.w, 0, c) == static_cast<float>(code) * d);
    }
  }
  // A stored shift beyond the cap (a damaged or foreign file) reads as the cap, never garbage.
  Packed damaged = p;
  damaged.w.data = damaged.codes.data();
  damaged.w.scales = damaged.scales.data();
  uint8_t* shift0 = damaged.scales.data() + kTileRows * 4;  // group 0, row 0
  const float capped = std::ldexp(s, -kQ8MaxShift);
  for (int stored : {kQ8MaxShift + 1, 200, 255}) {
    *shift0 = static_cast<uint8_t>(stored);
    const int code = static_cast<int>(damaged.codes[0]) - kQ8Zero;  // row 0, input 0
    CHECK(code != 0);
    CHECK(WeightAt(damaged.w, 0, 0) == static_cast<float>(code) * capped);
  }
}

TEST_CASE("q8 reconstruction error stays within 1.5x of fp16 per-group scales on Gaussian rows") {
  // Power-of-two group scales cost at most 1 bit per group; the row-scale search keeps the mean
  // well below that. Baseline: d = amax_g / 127 per group of 128 (the previous q8 format).
  const size_t rows = 64, cols = 3072;
  const auto src = test::RandomVec(rows * cols, 11, 1.0f);
  const Packed p = Pack(WeightFormat::kQ8, rows, cols, src);
  double err = 0, err_base = 0;
  for (size_t r = 0; r < rows; ++r)
    for (size_t g = 0; g < cols / 128; ++g) {
      float amax = 0;
      for (size_t c = g * 128; c < (g + 1) * 128; ++c) amax = std::max(amax, std::fabs(src[r * cols + c]));
      const double d = F16ToF32(F32ToF16(amax / 127.0f));
      for (size_t c = g * 128; c < (g + 1) * 128; ++c) {
        const double x = src[r * cols + c], b = std::clamp(std::nearbyint(x / d), -127.0, 127.0) * d;
        err_base += (x - b) * (x - b);
        err += (x - WeightAt(p.w, r, c)) * (x - WeightAt(p.w, r, c));
      }
    }
  INFO("rms ratio " << std::sqrt(err / err_base));
  CHECK(std::sqrt(err / err_base) < 1.5);
}

TEST_CASE("q4 reconstruction error is never above llama.cpp Q4_0 on any group") {
  for (uint32_t seed = 0; seed < 400; ++seed) {
    auto x = test::RandomVec(32, seed, seed % 3 == 0 ? 0.02f : 1.0f);
    if (seed % 5 == 0) x[seed % 32] *= 12.0f;  // an outlier
    if (seed % 7 == 0)
      for (auto& v : x) v = std::fabs(v);  // one-signed group
    std::vector<float> q40(32);
    ReconstructQ4_0(x.data(), 32, q40.data());
    int8_t q[32];
    uint16_t bits;
    const double err = QuantizeQ4Group(x.data(), nullptr, 32, q, &bits);
    double err40 = 0, err_check = 0;
    for (size_t i = 0; i < 32; ++i) {
      err40 += (x[i] - q40[i]) * static_cast<double>(x[i] - q40[i]);
      const double v = q[i] * static_cast<double>(F16ToF32(bits));
      err_check += (x[i] - v) * (x[i] - v);
      REQUIRE(q[i] >= -8);
      REQUIRE(q[i] <= 7);
    }
    REQUIRE(err == Approx(err_check).epsilon(1e-9).margin(1e-30));
    REQUIRE(err <= err40 * (1 + 1e-12));
  }
}

TEST_CASE("q4 keeps groups that lie on a q4 grid exactly (a converted Q4_0)") {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 2000; ++trial) {
    const float d = F16ToF32(F32ToF16(std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f,
                                                 static_cast<int>(rng() % 20) - 14) * (rng() % 2 ? 1.0f : -1.0f)));
    const int top = 1 + static_cast<int>(rng() % 8);  // codes within -top..top-1 (Q4_0: 0..15 minus 8)
    std::vector<float> x(32);
    for (float& v : x) v = d * static_cast<float>(static_cast<int>(rng() % static_cast<uint32_t>(2 * top)) - top);
    int8_t q[32];
    uint16_t bits;
    INFO("trial " << trial << " d " << d << " top " << top);
    CHECK(QuantizeQ4Group(x.data(), nullptr, 32, q, &bits) == 0.0);
  }
}

TEST_CASE("q3/q2 reconstruction error is at most that of float per-32 min/max steps on Gaussian rows") {
  // The baseline keeps each sub-block's scale and min in fp32 (what 4-bit sub-scales must
  // approximate): step (max - min) / L from min(x, 0). The fitted scales win back more than the
  // 4-bit rounding loses.
  const size_t rows = 32, cols = 3072;
  const auto src = test::RandomVec(rows * cols, 12, 1.0f);
  for (WeightFormat f : {WeightFormat::kQ3, WeightFormat::kQ2}) {
    const Packed p = Pack(f, rows, cols, src);
    const double L = (1 << SuperBlockBits(f)) - 1;
    double err = 0, err_base = 0;
    for (size_t r = 0; r < rows; ++r)
      for (size_t j = 0; j < cols / kSubGroup; ++j) {
        const float* x = src.data() + r * cols + j * kSubGroup;
        double lo = 0, hi = 0;
        for (size_t i = 0; i < kSubGroup; ++i) lo = std::min<double>(lo, x[i]), hi = std::max<double>(hi, x[i]);
        const double step = (hi - lo) / L;
        for (size_t i = 0; i < kSubGroup; ++i) {
          const double b = step > 0 ? std::clamp(std::nearbyint((x[i] - lo) / step), 0.0, L) * step + lo : 0.0;
          const double v = WeightAt(p.w, r, j * kSubGroup + i);
          err_base += (x[i] - b) * (x[i] - b);
          err += (x[i] - v) * (x[i] - v);
        }
      }
    INFO(WeightFormatName(f) << " rms ratio " << std::sqrt(err / err_base));
    CHECK(std::sqrt(err / err_base) < 1.0);
  }
}

// sum over rows of imp[c] (x - q)^2 for a packed matrix.
double WeightedError(const Packed& p, const std::vector<float>& src, const std::vector<float>& imp) {
  double err = 0;
  for (size_t r = 0; r < p.w.rows; ++r)
    for (size_t c = 0; c < p.w.cols; ++c) {
      const double e = src[r * p.w.cols + c] - static_cast<double>(WeightAt(p.w, r, c));
      err += imp[c] * e * e;
    }
  return err;
}

TEST_CASE("An importance vector lowers the weighted error of q4, q3 and q2, and ones change nothing") {
  // Inputs of very different importance (log-normal, a decade or two apart, as activations' mean
  // squares are), columns not a multiple of the group (padding has no importance).
  const size_t rows = 20, cols = 3 * 256 + 40;
  const auto src = test::RandomVec(rows * cols, 31, 1.0f);
  const auto u = test::RandomVec(cols, 32, 1.0f);
  std::vector<float> imp(cols), ones(cols, 1.0f);
  for (size_t c = 0; c < cols; ++c) imp[c] = std::pow(10.0f, u[c]);
  imp[5] = 0.0f;  // an input never seen
  for (WeightFormat f : {WeightFormat::kQ4, WeightFormat::kQ3, WeightFormat::kQ2}) {
    INFO(WeightFormatName(f));
    const Packed plain = Pack(f, rows, cols, src), weighted = Pack(f, rows, cols, src, &imp);
    const Packed unit = Pack(f, rows, cols, src, &ones);
    CHECK(unit.codes == plain.codes);
    CHECK(unit.scales == plain.scales);
    const double e_plain = WeightedError(plain, src, imp), e_weighted = WeightedError(weighted, src, imp);
    INFO("weighted error ratio " << e_weighted / e_plain);
    CHECK(e_weighted < 0.8 * e_plain);
    // and the plain error, which the importance does not aim at, gets worse
    CHECK(WeightedError(weighted, src, ones) > WeightedError(plain, src, ones));
  }
}

TEST_CASE("QuantizeSuperBlock returns the weighted error of what it chose") {
  for (uint32_t seed = 0; seed < 50; ++seed) {
    const auto x = test::RandomVec(kSuperGroup, 100 + seed, seed % 4 == 0 ? 1e-3f : 1.0f);
    const auto u = test::RandomVec(kSuperGroup, 200 + seed, 1.0f);
    std::vector<float> imp(kSuperGroup);
    for (size_t i = 0; i < kSuperGroup; ++i) imp[i] = std::pow(10.0f, u[i]);
    const size_t valid = seed % 3 == 0 ? 200 : kSuperGroup;
    for (int bits : {2, 3}) {
      uint8_t codes[kSuperGroup], sub[kSubGroups];
      uint16_t d = 0, dmin = 0;
      const double err = QuantizeSuperBlock(x.data(), seed % 2 ? imp.data() : nullptr, valid, bits, codes, &d, &dmin, sub);
      double check = 0;
      for (size_t i = 0; i < valid; ++i) {
        REQUIRE(codes[i] < (1u << bits));
        const double v = static_cast<double>(F16ToF32(d) * static_cast<float>(sub[i / kSubGroup] & 15) * codes[i] -
                                             F16ToF32(dmin) * static_cast<float>(sub[i / kSubGroup] >> 4));
        check += (seed % 2 ? imp[i] : 1.0) * (x[i] - v) * (x[i] - v);
      }
      REQUIRE(err == Approx(check).epsilon(1e-4).margin(1e-12));
    }
  }
}

TEST_CASE("Packing refuses non-finite values") {
  for (WeightFormat f :
       {WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kQ3, WeightFormat::kQ2, WeightFormat::kBF16Tiled}) {
    WeightRef w = TiledShape(f, 3, 40);
    std::vector<float> src(16 * 40, 1.0f);
    src[77] = NAN;
    std::vector<uint8_t> codes(TiledCodeBytes(w));
    std::vector<uint8_t> scales(TiledScaleBytes(w) + 1);
    CHECK_FALSE(PackRowTiles(w, src.data(), 0, 1, codes.data(), scales.data()));
  }
  // q4, q3 and q2 scales are fp16: values beyond its range are refused; q8's fp32 row scales take them.
  std::vector<float> big(16 * 256, 0.0f);
  big[3] = 1e9f;
  for (WeightFormat f : {WeightFormat::kQ4, WeightFormat::kQ8, WeightFormat::kQ3, WeightFormat::kQ2}) {
    INFO(WeightFormatName(f));
    WeightRef w = TiledShape(f, 1, 256);
    std::vector<uint8_t> codes(TiledCodeBytes(w));
    std::vector<uint8_t> scales(TiledScaleBytes(w));
    CHECK(PackRowTiles(w, big.data(), 0, 1, codes.data(), scales.data()) == (f == WeightFormat::kQ8));
  }
}

}  // namespace
}  // namespace m3::simd
