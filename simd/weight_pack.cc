#include "simd/weight_pack.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace m3::simd {
namespace {

int RoundToInt(float v) { return static_cast<int>(std::nearbyint(v)); }

// Squared error of quantizing x with scale d (rounded to fp16 first); writes the codes.
double TryScale(const float* x, size_t n, float d, int lo, int hi, int8_t* q, uint16_t* bits) {
  *bits = F32ToF16(d);
  const float d16 = F16ToF32(*bits);
  double err = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = d16 == 0.0f ? 0 : std::clamp(RoundToInt(x[i] / d16), lo, hi);
    q[i] = static_cast<int8_t>(v);
    const double e = static_cast<double>(x[i]) - static_cast<double>(v) * d16;
    err += e * e;
  }
  return err;
}

// Signed value of largest magnitude (the first one on ties, as llama.cpp does).
float SignedMax(const float* x, size_t n) {
  float amax = 0, m = 0;
  for (size_t i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), m = x[i];
  return m;
}

// Q4_0's own codes and scale for one group of 32.
void Q4_0Group(const float* x, size_t n, int8_t* q, uint16_t* bits) {
  const float d = SignedMax(x, n) / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const int c = std::min(15, static_cast<int>(x[i] * id + 8.5f));
    q[i] = static_cast<int8_t>(std::max(c, 0) - 8);
  }
  *bits = F32ToF16(d);
}

double GroupError(const float* x, size_t n, const int8_t* q, uint16_t bits) {
  const double d = F16ToF32(bits);
  double err = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = x[i] - q[i] * d;
    err += e * e;
  }
  return err;
}

// Largest shift e in [0, kQ8MaxShift] with amax * 2^e <= limit (0 when amax is 0). The
// exponent difference is that e or one more; Q8RowScale calls this 32 times per group.
// (Q8ActivationShift is the float twin for activations, on the exponent bits, without libm.)
int Q8Shift(double amax, double limit) {
  if (amax == 0.0) return 0;
  int e = std::ilogb(limit) - std::ilogb(amax);
  if (std::ldexp(amax, e) > limit) --e;
  return std::clamp(e, 0, kQ8MaxShift);
}

// The q8 row scale s: among 32 candidates spread over one octave above amax / 127, the one that
// minimises the rounding error the row's groups would get, sum over groups of (s 2^-e_g)^2
// (each group's step squared; the mean squared error of rounding is step^2 / 12).
float Q8RowScale(const std::vector<double>& group_amax) {
  double rowmax = 0;
  for (double a : group_amax) rowmax = std::max(rowmax, a);
  if (rowmax == 0.0) return 0.0f;
  float best = 0;
  double best_cost = std::numeric_limits<double>::infinity();
  for (int k = 0; k < 32; ++k) {
    const float s = static_cast<float>(rowmax / 127.0 * std::exp2(k / 32.0));
    if (!std::isfinite(s) || static_cast<double>(s) * 127.0 < rowmax) continue;
    double cost = 0;
    for (double a : group_amax)
      if (a > 0) cost += std::ldexp(1.0, -2 * Q8Shift(a, 127.0 * s));
    cost *= static_cast<double>(s) * s;
    if (cost < best_cost) best_cost = cost, best = s;
  }
  return best;
}

// One sub-block's float scale and min for codes 0..L: W = s * c - m with m >= 0 (the sub-block's
// offset is never above zero, so a format's min is unsigned). Starts from the range [min(x, 0),
// max(x)] and a few shrunken ones, refining each by least squares on its codes; keeps the best.
void FitSubBlock(const float* x, size_t n, int levels, float* s_out, float* m_out) {
  float lo = 0, hi = 0;
  for (size_t i = 0; i < n; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  *s_out = 0, *m_out = 0;
  if (hi <= lo) return;
  double best_err = std::numeric_limits<double>::infinity();
  const double L = levels;
  for (int step = 0; step < 8; ++step) {
    double s = (hi - lo) / L * (1.0 - 0.04 * step), m = -lo;
    for (int iter = 0; iter < 2; ++iter) {
      // codes for (s, m), then least squares for s and m on them (m >= 0)
      double sc = 0, scc = 0, sx = 0, scx = 0;
      for (size_t i = 0; i < n; ++i) {
        const double c = std::clamp(std::nearbyint((x[i] + m) / s), 0.0, L);
        sc += c, scc += c * c, sx += x[i], scx += c * x[i];
      }
      const double det = n * scc - sc * sc;
      if (det <= 0) break;
      double ns = (n * scx - sc * sx) / det, nm = -(sx - ns * sc) / n;
      if (nm < 0) nm = 0, ns = scc > 0 ? scx / scc : 0;
      if (!(ns > 0)) break;
      s = ns, m = nm;
    }
    double err = 0;
    for (size_t i = 0; i < n; ++i) {
      const double c = std::clamp(std::nearbyint((x[i] + m) / s), 0.0, L);
      err += (s * c - m - x[i]) * (s * c - m - x[i]);
    }
    if (err < best_err) best_err = err, *s_out = static_cast<float>(s), *m_out = static_cast<float>(m);
  }
}

}  // namespace

double QuantizeSuperBlock(const float* x, size_t valid, int bits, uint8_t* codes, uint16_t* d_bits,
                          uint16_t* dmin_bits, uint8_t* sub) {
  const int levels = (1 << bits) - 1;
  float s[kSubGroups], m[kSubGroups], smax = 0, mmax = 0;
  for (size_t j = 0; j < kSubGroups; ++j) {
    const size_t n = std::min(kSubGroup, valid - std::min(valid, j * kSubGroup));
    FitSubBlock(x + j * kSubGroup, n, levels, &s[j], &m[j]);
    smax = std::max(smax, s[j]), mmax = std::max(mmax, m[j]);
  }
  // The 4-bit scales and mins: the best of a few super-scales near max / 15 (fp16-rounded).
  double best_err = std::numeric_limits<double>::infinity();
  uint8_t cand_codes[kSuperGroup], cand_sub[kSubGroups];
  for (int k = 0; k < 6; ++k) {
    const uint16_t db = F32ToF16(smax / (15.0f - 0.5f * k)), mb = F32ToF16(mmax / 15.0f);
    const float d = F16ToF32(db), dmin = F16ToF32(mb);
    if (!std::isfinite(d) || !std::isfinite(dmin)) continue;
    double err = 0;
    for (size_t j = 0; j < kSubGroups; ++j) {
      const int sc = d > 0 ? std::clamp(RoundToInt(s[j] / d), 0, 15) : 0;
      const int mn = dmin > 0 ? std::clamp(RoundToInt(m[j] / dmin), 0, 15) : 0;
      cand_sub[j] = static_cast<uint8_t>(sc | mn << 4);
      const float scale = d * static_cast<float>(sc), min = dmin * static_cast<float>(mn);
      for (size_t i = j * kSubGroup; i < (j + 1) * kSubGroup; ++i) {
        const int c = scale > 0 ? std::clamp(RoundToInt((x[i] + min) / scale), 0, levels) : 0;
        cand_codes[i] = static_cast<uint8_t>(c);
        const double e = static_cast<double>(scale * static_cast<float>(c) - min) - x[i];
        if (i < valid) err += e * e;
      }
    }
    if (err < best_err) {
      best_err = err;
      std::memcpy(codes, cand_codes, kSuperGroup);
      std::memcpy(sub, cand_sub, kSubGroups);
      *d_bits = db, *dmin_bits = mb;
    }
    if (smax == 0) break;
  }
  if (!std::isfinite(best_err)) *d_bits = *dmin_bits = 0x7C00u;  // every candidate's scale overflowed fp16
  return best_err;
}

// Squared error of codes round_half_even(clamp(x / d16, lo, hi)) for a candidate fp16 scale, in
// float with 8 partial sums so the loop vectorizes (the search runs over every packed weight).
float CandidateError(const float* x, size_t n, float d16, float lo, float hi) {
  const float inv = 1.0f / d16;
  float acc[8] = {};
  for (size_t i = 0; i < n; i += 8)
    for (size_t j = 0; j < 8; ++j) {
      float v = std::min(std::max(x[i + j] * inv, lo), hi);
      v = (v + 0x1.8p23f) - 0x1.8p23f;  // round half to even (|v| <= 8)
      const float e = x[i + j] - v * d16;
      acc[j] += e * e;
    }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

double QuantizeQ4Group(const float* x, size_t n, int8_t* q, uint16_t* scale_bits) {
  Q4_0Group(x, n, q, scale_bits);
  const double err_q4_0 = GroupError(x, n, q, *scale_bits);
  const float m = SignedMax(x, n);
  if (m == 0.0f || n % 8 != 0) return err_q4_0;
  // Candidates map the extreme value onto -8 .. -6.65 or +7.5 .. +6.15 (fp16-rounded), then the
  // best is refined once by least squares (d = sum(x q) / sum(q^2) for its codes).
  float best_d = 0, best_err = std::numeric_limits<float>::infinity();
  auto consider = [&](float d) {
    const float d16 = F16ToF32(F32ToF16(d));
    if (!std::isfinite(d16) || d16 == 0.0f) return;
    const float e = CandidateError(x, n, d16, -8.0f, 7.0f);
    if (e < best_err) best_err = e, best_d = d16;
  };
  for (int s = 0; s < 10; ++s) {
    consider(m / -(8.0f - 0.15f * s));
    consider(m / (7.5f - 0.15f * s));
  }
  if (best_d == 0) return err_q4_0;
  double sxq = 0, sqq = 0;
  for (size_t i = 0; i < n; ++i) {
    const double c = std::clamp(std::nearbyint(x[i] / best_d), -8.0f, 7.0f);
    sxq += x[i] * c, sqq += c * c;
  }
  if (sqq > 0) consider(static_cast<float>(sxq / sqq));
  // Final choice in double against Q4_0 itself, so the error is never above Q4_0's.
  int8_t cand[256];
  uint16_t cand_bits;
  const double err = TryScale(x, n, best_d, -8, 7, cand, &cand_bits);
  if (err >= err_q4_0) return err_q4_0;
  std::memcpy(q, cand, n);
  *scale_bits = cand_bits;
  return err;
}

void ReconstructQ4_0(const float* x, size_t n, float* out) {
  int8_t q[32];
  uint16_t bits;
  for (size_t b = 0; b + 32 <= n; b += 32) {
    Q4_0Group(x + b, 32, q, &bits);
    const float d = F16ToF32(bits);
    for (size_t i = 0; i < 32; ++i) out[b + i] = q[i] * d;
  }
}

void PlaceSuperBlockCodes(WeightFormat f, const uint8_t* c, size_t tr, uint8_t* super_block) {
  const size_t chunk_bytes = f == WeightFormat::kQ3 ? 96 : 64;
  for (size_t in = 0; in < kSuperGroup; ++in) {
    const size_t chunk = in / 16, field = (in / 4) % 4, byte = tr * 4 + in % 4;
    uint8_t* ch = super_block + chunk * chunk_bytes;
    ch[byte] |= static_cast<uint8_t>((c[in] & 3) << (2 * field));
    if (f == WeightFormat::kQ3) ch[64 + byte % 32] |= static_cast<uint8_t>(((c[in] >> 2) & 1) << (field + 4 * (byte / 32)));
  }
}

bool PackRowTiles(const WeightRef& shape, const float* src, size_t tile0, size_t n_tiles, uint8_t* codes,
                  uint8_t* scales) {
  const size_t cols = shape.cols, group = shape.group, groups = shape.groups();
  std::memset(codes, 0, n_tiles * shape.tile_bytes());
  std::vector<float> x(group);
  std::vector<int8_t> q(group);
  std::vector<double> group_amax(groups);
  for (size_t t = 0; t < n_tiles; ++t) {
    uint8_t* tile = codes + t * shape.tile_bytes();
    uint8_t* tile_scales = scales ? scales + t * shape.tile_scale_bytes() : nullptr;
    for (size_t tr = 0; tr < kTileRows; ++tr) {
      const size_t r = (tile0 + t) * kTileRows + tr;
      const bool present = r < shape.rows;
      const float* row = src + (t * kTileRows + tr) * cols;
      float row_scale = 0;
      if (shape.format == WeightFormat::kQ8) {
        for (size_t g = 0; g < groups; ++g) {
          float amax = 0;
          for (size_t c = g * group; present && c < std::min(cols, (g + 1) * group); ++c) {
            if (!std::isfinite(row[c])) return false;
            amax = std::max(amax, std::fabs(row[c]));
          }
          group_amax[g] = amax;
        }
        row_scale = Q8RowScale(group_amax);
        std::memcpy(tile_scales + tr * 4, &row_scale, 4);
      }
      for (size_t g = 0; g < groups; ++g) {
        for (size_t i = 0; i < group; ++i) {
          const size_t c = g * group + i;
          x[i] = present && c < cols ? row[c] : 0.0f;
          if (!std::isfinite(x[i])) return false;
        }
        if (shape.format == WeightFormat::kBF16Tiled) {
          for (size_t i = 0; i < group; ++i) {
            const size_t c = g * group + i;
            const uint16_t b = F32ToBf16(x[i]);
            std::memcpy(tile + ((c / 2) * kTileRows * 2 + tr * 2 + c % 2) * 2, &b, 2);
          }
          continue;
        }
        if (shape.format == WeightFormat::kQ8) {
          const int shift = row_scale == 0.0f ? 0 : Q8Shift(group_amax[g], 127.0 * row_scale);
          const float d = std::ldexp(row_scale, -shift);
          for (size_t i = 0; i < group; ++i) {
            const int v = d == 0.0f ? 0 : std::clamp(RoundToInt(x[i] / d), -127, 127);
            tile[g * group * kTileRows + (i / 4) * 64 + tr * 4 + i % 4] = static_cast<uint8_t>(v + kQ8Zero);
          }
          tile_scales[kTileRows * 4 + g * kTileRows + tr] = static_cast<uint8_t>(shift);
          continue;
        }
        if (IsSuperBlock(shape.format)) {
          uint8_t c[kSuperGroup], sub[kSubGroups];
          uint16_t d = 0, dmin = 0;
          const size_t valid = present ? std::min(group, cols - std::min(cols, g * group)) : 0;
          QuantizeSuperBlock(x.data(), valid, SuperBlockBits(shape.format), c, &d, &dmin, sub);
          if ((d & 0x7C00u) == 0x7C00u || (dmin & 0x7C00u) == 0x7C00u) return false;  // fp16 overflow
          PlaceSuperBlockCodes(shape.format, c, tr, tile + g * shape.tile_bytes() / groups);
          std::memcpy(tile_scales + (g * kTileRows + tr) * 2, &d, 2);
          std::memcpy(tile_scales + (groups + g) * kTileRows * 2 + tr * 2, &dmin, 2);
          for (size_t j = 0; j < kSubGroups; ++j)
            tile_scales[groups * kTileRows * 4 + (g * kSubGroups + j) * kTileRows + tr] = sub[j];
          continue;
        }
        uint16_t bits = 0;
        QuantizeQ4Group(x.data(), group, q.data(), &bits);
        const size_t half = group / 8;
        for (size_t i = 0; i < group; ++i) {
          const size_t quad = i / 4;
          uint8_t& byte = tile[g * group * kTileRows / 2 + (quad % half) * 64 + tr * 4 + i % 4];
          const uint8_t code = static_cast<uint8_t>(q[i] + kQ4Zero);
          byte |= quad < half ? code : static_cast<uint8_t>(code << 4);
        }
        if ((bits & 0x7C00u) == 0x7C00u) return false;  // scale overflowed fp16
        std::memcpy(tile_scales + (g * kTileRows + tr) * 2, &bits, 2);
      }
    }
  }
  return true;
}

}  // namespace m3::simd
