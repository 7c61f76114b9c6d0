// Scalar references for quant_kernels.h: the definition every SIMD path must reproduce.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "simd/quant_kernels.h"

namespace m3::simd::ref {

void QuantizeActivations(const float* x, size_t ldx, size_t n_tok, size_t cols, size_t group, int8_t* q,
                         float* scale, int32_t* sum, uint8_t* shift) {
  const size_t padded = (cols + group - 1) / group * group, groups = padded / group;
  for (size_t t = 0; t < n_tok; ++t) {
    const float* xt = x + t * ldx;
    const auto finite = [&](size_t begin, size_t end) {
      return std::all_of(xt + begin, xt + end, [](float v) { return std::isfinite(v); });
    };
    if (shift && !finite(0, cols)) {
      detail::SetNonFiniteQ8Token(t, padded, groups, q, scale, sum, shift);
      continue;
    }
    float amax_t = 0.0f;
    for (size_t c = 0; c < cols; ++c) amax_t = std::max(amax_t, std::fabs(xt[c]));
    if (shift) scale[t] = amax_t / 127.0f;
    for (size_t g = 0; g < groups; ++g) {
      const size_t begin = g * group, end = std::min(cols, begin + group);
      float amax = 0.0f;
      for (size_t c = begin; c < end; ++c) amax = std::max(amax, std::fabs(xt[c]));
      int8_t* qg = q + t * padded + begin;
      int32_t s = 0;
      const int e = shift ? Q8ActivationShift(amax, amax_t) : 0;
      if (shift) shift[t * groups + g] = static_cast<uint8_t>(e);
      if (!shift && !finite(begin, end)) {  // q4: this group's scale NaN
        std::fill(qg, qg + group, int8_t{0});
        scale[t * groups + g] = std::numeric_limits<float>::quiet_NaN();
      } else if (amax == 0.0f) {
        std::fill(qg, qg + group, int8_t{0});
        if (!shift) scale[t * groups + g] = 0.0f;
      } else {
        const float inv = shift ? MulPow2(127.0f / amax_t, e) : 127.0f / amax;
        for (size_t c = begin; c < begin + group; ++c) {
          float v = 0.0f;  // padding, and x == 0 (keeps 0 * inf for a subnormal amax out)
          if (c < end && xt[c] != 0.0f) v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xt[c] * inv)));
          qg[c - begin] = static_cast<int8_t>(v);
          s += static_cast<int32_t>(v);
        }
        if (!shift) scale[t * groups + g] = amax / 127.0f;
      }
      sum[t * groups + g] = s;
    }
  }
}

namespace {

void SuperBlockMatMul(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                      size_t ldy) {
  const size_t row_end = std::min(w.rows, tile_end * kTileRows), groups = w.groups();
  const size_t sb_bytes = kTileRows * kSuperGroup / 8 * SuperBlockBits(w.format);
  std::vector<int> codes(w.padded_cols());
  for (size_t r = tile_begin * kTileRows; r < row_end; ++r) {
    const size_t tile = r / kTileRows, tr = r % kTileRows;
    const uint8_t* t0 = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes();
    for (size_t g = 0; g < groups; ++g)
      for (size_t in = 0; in < kSuperGroup; ++in)
        codes[g * kSuperGroup + in] = SuperBlockCode(w.format, t0 + g * sb_bytes, tr, in);
    for (size_t t = 0; t < a.n_tok; ++t) {
      const int8_t* qt = a.q + t * a.padded_cols;
      float acc = 0.0f;
      for (size_t g = 0; g < groups; ++g) {
        int32_t i1 = 0, i2 = 0;
        for (size_t j = 0; j < kSubGroups; ++j) {
          const uint8_t sub = w.sb_sub(tile)[(g * kSubGroups + j) * kTileRows + tr];
          int32_t dot = 0, sum = 0;
          for (size_t i = g * kSuperGroup + j * kSubGroup; i < g * kSuperGroup + (j + 1) * kSubGroup; ++i)
            dot += codes[i] * qt[i], sum += qt[i];
          i1 += (sub & 0xF) * dot;
          i2 += (sub >> 4) * sum;
        }
        const float da = a.scale[t * groups + g];
        const float d = F16ToF32(w.sb_d(tile)[g * kTileRows + tr]), dmin = F16ToF32(w.sb_dmin(tile)[g * kTileRows + tr]);
        acc = std::fma(static_cast<float>(i1), d * da, acc);
        acc = std::fma(static_cast<float>(i2), -(dmin * da), acc);
      }
      y[t * ldy + r] = acc;
    }
  }
}

}  // namespace

void QuantMatMul(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                 size_t ldy, KernelScratch& /*scratch*/) {
  if (IsSuperBlock(w.format)) return SuperBlockMatMul(w, a, tile_begin, tile_end, y, ldy);
  const size_t row_end = std::min(w.rows, tile_end * kTileRows), groups = w.groups(), G = w.group;
  const int zero = w.format == WeightFormat::kQ8 ? kQ8Zero : kQ4Zero;
  const auto* data = static_cast<const uint8_t*>(w.data);
  std::vector<int> wc(groups * G);  // one row's codes minus the zero point, padding included
  for (size_t r = tile_begin * kTileRows; r < row_end; ++r) {
    const size_t tile = r / kTileRows, tr = r % kTileRows, half = G / 8;
    const uint8_t* t0 = data + tile * w.tile_bytes();
    for (size_t g = 0; g < groups; ++g)
      for (size_t i = 0; i < G; ++i) {
        int code;
        if (w.format == WeightFormat::kQ8) {
          code = t0[g * G * kTileRows + (i / 4) * 64 + tr * 4 + i % 4];
        } else {
          const size_t quad = i / 4;
          const uint8_t byte = t0[g * G * kTileRows / 2 + (quad % half) * 64 + tr * 4 + i % 4];
          code = quad < half ? (byte & 0xF) : (byte >> 4);
        }
        wc[g * G + i] = code - zero;
      }
    for (size_t t = 0; t < a.n_tok; ++t) {
      const int8_t* qt = a.q + t * a.padded_cols;
      float acc = 0.0f;
      for (size_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (size_t i = 0; i < G; ++i) dot += wc[g * G + i] * qt[g * G + i];
        if (w.format == WeightFormat::kQ8) {
          const int e = std::min<int>(w.q8_shifts(tile)[g * kTileRows + tr], kQ8MaxShift) + a.shift[t * groups + g];
          acc += std::ldexp(static_cast<float>(dot), -e);  // exact: a normal float times 2^-e
        } else {
          const float d = F16ToF32(w.tile_scales(tile)[g * kTileRows + tr]) * a.scale[t * groups + g];
          acc = std::fma(static_cast<float>(dot), d, acc);
        }
      }
      if (w.format == WeightFormat::kQ8) {
        float s_w;
        std::memcpy(&s_w, w.q8_row_scales(tile) + tr * 4, 4);
        acc *= s_w * a.scale[t];
      }
      y[t * ldy + r] = acc;
    }
  }
}

void Bf16TiledMatMul(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin, size_t tile_end,
                     float* y, size_t ldy, KernelScratch& /*scratch*/) {
  const size_t row_end = std::min(w.rows, tile_end * kTileRows);
  for (size_t r = tile_begin * kTileRows; r < row_end; ++r)
    for (size_t t = 0; t < n_tok; ++t) {
      double s = 0;
      for (size_t c = 0; c < w.cols; ++c) s += static_cast<double>(TiledWeightAt(w, r, c)) * x[t * ldx + c];
      y[t * ldy + r] = static_cast<float>(s);
    }
}

}  // namespace m3::simd::ref
