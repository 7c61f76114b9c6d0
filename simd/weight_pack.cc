#include "simd/weight_pack.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace m3::simd {
namespace {

int RoundToInt(float v) { return static_cast<int>(std::nearbyint(v)); }

// Weighted squared error of quantizing x with scale d (rounded to fp16 first); writes the codes.
double TryScale(const float* x, const float* w, size_t n, float d, int lo, int hi, int8_t* q, uint16_t* bits) {
  *bits = F32ToF16(d);
  const float d16 = F16ToF32(*bits);
  double err = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = d16 == 0.0f ? 0 : std::clamp(RoundToInt(x[i] / d16), lo, hi);
    q[i] = static_cast<int8_t>(v);
    const double e = static_cast<double>(x[i]) - static_cast<double>(v) * d16;
    err += (w ? w[i] : 1.0f) * e * e;
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

double GroupError(const float* x, const float* w, size_t n, const int8_t* q, uint16_t bits) {
  const double d = F16ToF32(bits);
  double err = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = x[i] - q[i] * d;
    err += (w ? w[i] : 1.0f) * e * e;
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

// Round half to even for |v| < 2^22 (the default rounding mode), without a libm call, so the
// fixed-length loops below vectorize.
inline float RoundHalfEven(float v) { return (v + 0x1.8p23f) - 0x1.8p23f; }
inline float Sum8(const float* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// Code of x for scale s (as 1 / s) and min m: clamp(round((x + m) / s), 0, L).
inline float SubBlockCode(float x, float inv_s, float m, float levels) {
  return std::min(std::max(RoundHalfEven((x + m) * inv_s), 0.0f), levels);
}

// Weighted squared error of one sub-block of kSubGroup values with scale s and min m; writes the
// codes when `codes` is given. Loops of fixed length with 8 partial sums (they vectorize).
float SubBlockError(const float* x, const float* w, float s, float m, float levels, uint8_t* codes) {
  const float inv = s > 0 ? 1.0f / s : 0.0f;
  float acc[8] = {}, q[kSubGroup];
  for (size_t i = 0; i < kSubGroup; i += 8)
    for (size_t j = 0; j < 8; ++j) {
      q[i + j] = SubBlockCode(x[i + j], inv, m, levels);
      const float r = s * q[i + j] - m - x[i + j];
      acc[j] += w[i + j] * r * r;
    }
  if (codes)
    for (size_t i = 0; i < kSubGroup; ++i) codes[i] = static_cast<uint8_t>(q[i]);
  return Sum8(acc);
}

// One sub-block's float scale and min for codes 0..L minimising sum w (s c - m - x)^2, with
// m >= 0 (the sub-block's offset is never above zero, so a format's min is unsigned). Starts from
// the range [min(x, 0), max(x)] and steps of 0.7-1.25 times it (clipping the extremes, or
// leaving levels above them: either can fit the rest better), refining each by weighted least
// squares on its codes; keeps the best.
void FitSubBlock(const float* x, const float* w, int levels, float* s_out, float* m_out) {
  float lo = 0, hi = 0;
  for (size_t i = 0; i < kSubGroup; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  *s_out = 0, *m_out = 0;
  if (hi <= lo) return;
  float best_err = std::numeric_limits<float>::infinity();
  const float L = static_cast<float>(levels);
  for (int step = 0; step < 12; ++step) {  // steps of 0.7 to 1.25 times the range's
    double s = (hi - lo) / L * (0.7 + 0.05 * step), m = -lo;
    for (int iter = 0; iter < 3; ++iter) {
      const float inv = static_cast<float>(1.0 / s), mf = static_cast<float>(m);
      float a_w[8] = {}, a_c[8] = {}, a_cc[8] = {}, a_x[8] = {}, a_cx[8] = {};
      for (size_t i = 0; i < kSubGroup; i += 8)
        for (size_t j = 0; j < 8; ++j) {
          const float xv = x[i + j], wv = w[i + j], c = SubBlockCode(xv, inv, mf, L);
          a_w[j] += wv, a_c[j] += wv * c, a_cc[j] += wv * c * c, a_x[j] += wv * xv, a_cx[j] += wv * c * xv;
        }
      const double sw = Sum8(a_w), sc = Sum8(a_c), scc = Sum8(a_cc), sx = Sum8(a_x), scx = Sum8(a_cx);
      const double det = sw * scc - sc * sc;
      if (!(det > 0)) break;
      double ns = (sw * scx - sc * sx) / det, nm = -(sx - ns * sc) / sw;
      if (nm < 0) nm = 0, ns = scc > 0 ? scx / scc : 0;
      if (!(ns > 0)) break;
      s = ns, m = nm;
    }
    const float err = SubBlockError(x, w, static_cast<float>(s), static_cast<float>(m), L, nullptr);
    if (err < best_err) best_err = err, *s_out = static_cast<float>(s), *m_out = static_cast<float>(m);
  }
}

// A super-block's choice: fp16 d and dmin, 4-bit scales and mins, codes, and its error.
struct SuperBlockChoice {
  double err = std::numeric_limits<double>::infinity();
  uint16_t d = 0, dmin = 0;
  uint8_t sub[kSubGroups] = {};
  uint8_t codes[kSuperGroup] = {};
};

// For fixed fp16 d and dmin: each sub-block's 4-bit scale and min among those within `radius` of
// its float fit (s / d, m / dmin), with the codes they give; the weighted error of the whole.
SuperBlockChoice ChooseSubScales(const float* x, const float* w, float levels, uint16_t d_bits, uint16_t dmin_bits,
                                 const float* s, const float* m, int radius) {
  SuperBlockChoice c;
  c.d = d_bits, c.dmin = dmin_bits;
  const float d = F16ToF32(d_bits), dmin = F16ToF32(dmin_bits);
  if (!std::isfinite(d) || !std::isfinite(dmin)) return c;
  c.err = 0;
  for (size_t j = 0; j < kSubGroups; ++j) {
    const float* xj = x + j * kSubGroup;
    const float* wj = w + j * kSubGroup;
    const int sc0 = d > 0 ? std::clamp(RoundToInt(s[j] / d), 0, 15) : 0;
    const int mn0 = dmin > 0 ? std::clamp(RoundToInt(m[j] / dmin), 0, 15) : 0;
    float best = std::numeric_limits<float>::infinity();
    for (int sc = std::max(0, sc0 - radius); sc <= std::min(15, sc0 + radius); ++sc)
      for (int mn = std::max(0, mn0 - radius); mn <= std::min(15, mn0 + radius); ++mn) {
        uint8_t codes[kSubGroup];
        const float e = SubBlockError(xj, wj, d * static_cast<float>(sc), dmin * static_cast<float>(mn), levels, codes);
        if (e < best) {
          best = e;
          c.sub[j] = static_cast<uint8_t>(sc | mn << 4);
          std::memcpy(c.codes + j * kSubGroup, codes, kSubGroup);
        }
      }
    c.err += best;
  }
  return c;
}

}  // namespace

double QuantizeSuperBlock(const float* x_in, const float* importance, size_t valid, int bits, uint8_t* codes,
                          uint16_t* d_bits, uint16_t* dmin_bits, uint8_t* sub) {
  const float levels = static_cast<float>((1 << bits) - 1);
  // Padding (past `valid`) is zero with weight zero: fitted by nothing, coded nearest zero.
  float x[kSuperGroup], w[kSuperGroup];
  for (size_t i = 0; i < kSuperGroup; ++i) {
    x[i] = i < valid ? x_in[i] : 0.0f;
    w[i] = i >= valid ? 0.0f : importance ? importance[i] : 1.0f;
  }
  float s[kSubGroups], m[kSubGroups], smax = 0, mmax = 0;
  for (size_t j = 0; j < kSubGroups; ++j) {
    FitSubBlock(x + j * kSubGroup, w + j * kSubGroup, static_cast<int>(levels), &s[j], &m[j]);
    smax = std::max(smax, s[j]), mmax = std::max(mmax, m[j]);
  }
  // The best of a few super-scales near max / 15 (fp16-rounded), the sub-scales rounded ...
  SuperBlockChoice best;
  for (int k = 0; k < 6 && (k == 0 || smax > 0); ++k) {
    SuperBlockChoice c = ChooseSubScales(x, w, levels, F32ToF16(smax / (15.0f - 0.5f * k)), F32ToF16(mmax / 15.0f), s, m, 0);
    if (c.err < best.err) best = c;
  }
  // ... then refined: d and dmin by weighted least squares on the chosen integers and codes
  // (x ~ d sc c - dmin mn), and each sub-block's scale and min re-chosen among the neighbours
  // of its fit, while the error falls.
  for (int iter = 0; iter < 4 && std::isfinite(best.err); ++iter) {
    double aa = 0, ab = 0, bb = 0, ax = 0, bx = 0;
    for (size_t i = 0; i < kSuperGroup; ++i) {
      const double a = (best.sub[i / kSubGroup] & 15) * best.codes[i], b = -(best.sub[i / kSubGroup] >> 4);
      aa += w[i] * a * a, ab += w[i] * a * b, bb += w[i] * b * b, ax += w[i] * a * x[i], bx += w[i] * b * x[i];
    }
    const double det = aa * bb - ab * ab;
    double d = F16ToF32(best.d), dmin = F16ToF32(best.dmin);
    if (det > 0) d = (ax * bb - bx * ab) / det, dmin = (aa * bx - ab * ax) / det;
    if (!(d > 0) || !(dmin >= 0)) break;
    const SuperBlockChoice c = ChooseSubScales(x, w, levels, F32ToF16(static_cast<float>(d)),
                                               F32ToF16(static_cast<float>(dmin)), s, m, 1);
    if (!(c.err < best.err)) break;
    best = c;
  }
  if (!std::isfinite(best.err)) {  // every candidate's scale overflowed fp16
    *d_bits = *dmin_bits = 0x7C00u;
    return best.err;
  }
  std::memcpy(codes, best.codes, kSuperGroup);
  std::memcpy(sub, best.sub, kSubGroups);
  *d_bits = best.d, *dmin_bits = best.dmin;
  return best.err;
}

// Weighted squared error of codes round_half_even(clamp(x / d16, lo, hi)) for a candidate fp16
// scale, in float with 8 partial sums so the loop vectorizes (the search runs over every packed
// weight). `w` holds n weights (all ones without an importance vector).
float CandidateError(const float* x, const float* w, size_t n, float d16, float lo, float hi) {
  const float inv = 1.0f / d16;
  float acc[8] = {};
  for (size_t i = 0; i < n; i += 8)
    for (size_t j = 0; j < 8; ++j) {
      const float v = RoundHalfEven(std::min(std::max(x[i + j] * inv, lo), hi));  // |v| <= 8
      const float e = x[i + j] - v * d16;
      acc[j] += w[i + j] * e * e;
    }
  return Sum8(acc);
}

double QuantizeQ4Group(const float* x, const float* importance, size_t n, int8_t* q, uint16_t* scale_bits) {
  Q4_0Group(x, n, q, scale_bits);
  const double err_q4_0 = GroupError(x, importance, n, q, *scale_bits);
  const float m = SignedMax(x, n);
  if (m == 0.0f || n % 8 != 0 || n > 256) return err_q4_0;
  // Candidates map the extreme value onto -8 .. -6.65 or +7.5 .. +6.15 (fp16-rounded) or onto
  // each code, then the best is refined once by least squares (d = sum(x q) / sum(q^2) for its codes).
  float ones[256];
  const float* w = importance;
  if (!w) std::fill(ones, ones + n, 1.0f), w = ones;
  float best_d = 0, best_err = std::numeric_limits<float>::infinity();
  auto consider = [&](float d) {
    const float d16 = F16ToF32(F32ToF16(d));
    if (!std::isfinite(d16) || d16 == 0.0f) return;
    const float e = CandidateError(x, w, n, d16, -8.0f, 7.0f);
    if (e < best_err) best_err = e, best_d = d16;
  };
  for (int s = 0; s < 10; ++s) {
    consider(m / -(8.0f - 0.15f * s));
    consider(m / (7.5f - 0.15f * s));
  }
  // Values already on a q4 grid (a converted Q4_0, whose extreme is d times some code k) get
  // their own scale back exactly: m / k for every code.
  for (int k = -7; k <= 7; ++k)
    if (k != 0) consider(m / static_cast<float>(k));
  if (best_d == 0) return err_q4_0;
  double sxq = 0, sqq = 0;
  for (size_t i = 0; i < n; ++i) {
    const double c = std::clamp(std::nearbyint(x[i] / best_d), -8.0f, 7.0f);
    sxq += w[i] * x[i] * c, sqq += w[i] * c * c;
  }
  if (sqq > 0) consider(static_cast<float>(sxq / sqq));
  // Final choice in double against Q4_0 itself, so the error is never above Q4_0's.
  int8_t cand[256];
  uint16_t cand_bits;
  const double err = TryScale(x, importance, n, best_d, -8, 7, cand, &cand_bits);
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
                  uint8_t* scales, const float* importance) {
  const size_t cols = shape.cols, group = shape.group, groups = shape.groups();
  std::memset(codes, 0, n_tiles * shape.tile_bytes());
  std::vector<float> x(group), w(importance ? group : 0);
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
          if (importance) w[i] = c < cols ? importance[c] : 0.0f;
        }
        const float* group_importance = importance ? w.data() : nullptr;
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
          QuantizeSuperBlock(x.data(), group_importance, valid, SuperBlockBits(shape.format), c, &d, &dmin, sub);
          if ((d & 0x7C00u) == 0x7C00u || (dmin & 0x7C00u) == 0x7C00u) return false;  // fp16 overflow
          PlaceSuperBlockCodes(shape.format, c, tr, tile + g * shape.tile_bytes() / groups);
          std::memcpy(tile_scales + (g * kTileRows + tr) * 2, &d, 2);
          std::memcpy(tile_scales + (groups + g) * kTileRows * 2 + tr * 2, &dmin, 2);
          for (size_t j = 0; j < kSubGroups; ++j)
            tile_scales[groups * kTileRows * 4 + (g * kSubGroups + j) * kTileRows + tr] = sub[j];
          continue;
        }
        uint16_t bits = 0;
        QuantizeQ4Group(x.data(), group_importance, group, q.data(), &bits);
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
