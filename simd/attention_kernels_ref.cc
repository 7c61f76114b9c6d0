// Scalar references of attention_kernels.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "simd/attention_kernels.h"
#include "simd/kernels.h"
#include "simd/weight_format.h"

namespace m3::simd {

namespace ref {

float IndexKeyValue(const IndexKeyPage& page, size_t d, size_t u) {
  const size_t i = (u / page.ld) * page.dim * page.ld + d * page.ld + u % page.ld;
  switch (page.type) {
    case CacheType::kF32: return static_cast<const float*>(page.data)[i];
    case CacheType::kBF16: return Bf16ToF32(static_cast<const uint16_t*>(page.data)[i]);
    case CacheType::kInt8: return static_cast<float>(static_cast<const int8_t*>(page.data)[i]);
  }
  return 0.0f;
}

void IndexScoreMax(const float* q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out) {
  for (size_t i = 0; i < n_q; ++i) {
    float mx = -std::numeric_limits<float>::infinity();
    for (size_t u = 0; u < page.n_keys; ++u) {
      float s = 0.0f;
      for (size_t d = 0; d < page.dim; ++d) s = std::fma(q[i * ldq + d], IndexKeyValue(page, d, u), s);
      if (page.type == CacheType::kInt8) s *= page.scales[u];
      mx = std::max(mx, s);  // a NaN score never wins (selection treats NaN as -inf)
    }
    out[i] = mx;
  }
}

void KeyScores(const float* q, size_t ldq, size_t n_q, const float* kt, size_t ldk, size_t n_keys, size_t dim,
               float* out, size_t ldo) {
  for (size_t i = 0; i < n_q; ++i)
    for (size_t u = 0; u < n_keys; ++u) {
      float s = 0.0f;
      for (size_t d = 0; d < dim; ++d) s = std::fma(q[i * ldq + d], kt[d * ldk + u], s);
      out[i * ldo + u] = s;
    }
}

void AttendBlock(const float* q, size_t ldq, size_t n_rows, const float* kt, size_t ldk, const size_t* n_keys,
                 const float* v, size_t ldv, size_t dim, float scale, float* p, size_t ldp, float* run_max,
                 float* run_sum, float* acc, size_t ld_acc) {
  for (size_t r = 0; r < n_rows; ++r) {
    const size_t nk = n_keys[r];
    if (nk == 0) continue;
    float* s = p + r * ldp;
    float* o = acc + r * ld_acc;
    ref::KeyScores(q + r * ldq, ldq, 1, kt, ldk, nk, dim, s, ldp);
    ref::Scale(s, scale, nk);
    const float m_new = std::max(run_max[r], ref::MaxValue(s, nk));
    const float correction = std::exp(run_max[r] - m_new);
    run_sum[r] = run_sum[r] * correction + ref::ExpShiftSum(s, nk, m_new);
    if (correction != 1.0f) ref::Scale(o, correction, dim);
    run_max[r] = m_new;
    ref::MatMulAccumulate(s, ldp, 1, v, ldv, nk, dim, o, ld_acc);
  }
}

void EncodeBf16(const float* x, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = F32ToBf16(x[i]);
}

void DecodeBf16(const uint16_t* x, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = Bf16ToF32(x[i]);
}

float EncodeInt8(const float* x, size_t n, int8_t* out) {
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {  // NaN scale: the row decodes to NaN, never to finite garbage
      std::fill(out, out + n, int8_t{0});
      return std::numeric_limits<float>::quiet_NaN();
    }
    amax = std::max(amax, std::fabs(x[i]));
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f));
  return amax / 127.0f;
}

void DecodeInt8(const int8_t* x, size_t n, float scale, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]) * scale;
}

}  // namespace ref
}  // namespace m3::simd
