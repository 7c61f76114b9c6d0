// Scalar references: the definition of every kernel, written for clarity, not speed.
#include <algorithm>
#include <cmath>
#include <limits>

#include "simd/kernels.h"

namespace m3::simd {

namespace ref {

void DecodeRows(const WeightRef& w, size_t row0, size_t n_rows, float* out) {
  for (size_t r = 0; r < n_rows; ++r)
    for (size_t c = 0; c < w.cols; ++c) out[r * w.cols + c] = WeightAt(w, row0 + r, c);
}

void MatMulF32(const float* a, size_t lda, size_t n_rows, const float* x, size_t ldx,
               size_t n_tok, size_t k, float* y, size_t ldy) {
  for (size_t t = 0; t < n_tok; ++t)
    for (size_t r = 0; r < n_rows; ++r) y[t * ldy + r] = Dot(a + r * lda, x + t * ldx, k);
}

void MatMulAccumulate(const float* p, size_t ldp, size_t n_rows, const float* v, size_t ldv, size_t n_keys,
                      size_t d, float* out, size_t ldo) {
  for (size_t h = 0; h < n_rows; ++h)
    for (size_t c = 0; c < d; ++c) {
      double s = out[h * ldo + c];
      for (size_t u = 0; u < n_keys; ++u) s += static_cast<double>(p[h * ldp + u]) * v[u * ldv + c];
      out[h * ldo + c] = static_cast<float>(s);
    }
}

float Dot(const float* a, const float* b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return static_cast<float>(s);
}

void Axpy(float alpha, const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void Scale(float* y, float s, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] *= s;
}

float SumSquares(const float* x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return static_cast<float>(s);
}

void MulScaled(const float* x, const float* w, float s, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = x[i] * s * w[i];
}

void RmsNormRows(const float* x, size_t ld_x, size_t n_rows, size_t dim, const float* scale, float eps, float* out,
                 size_t ld_out) {
  for (size_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * ld_x;
    const float ms = SumSquares(xr, dim) / static_cast<float>(dim);
    MulScaled(xr, scale, 1.0f / std::sqrt(ms + eps), out + r * ld_out, dim);
  }
}

float MaxValue(const float* x, size_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

float ExpShiftSum(float* x, size_t n, float shift) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    s += x[i];
  }
  return static_cast<float>(s);
}

void SwigluOai(float* g, const float* u, size_t n, float alpha, float limit, float beta) {
  for (size_t i = 0; i < n; ++i) {
    const float gc = std::min(g[i], limit);  // gate: upper clamp only (docs/MODEL.md §3.7)
    const float uc = std::clamp(u[i], -limit, limit);
    const float sig = 1.0f / (1.0f + std::exp(-alpha * gc));
    g[i] = std::isfinite(g[i]) && std::isfinite(u[i]) ? gc * sig * (uc + beta) : NAN;
  }
}

size_t FindNonFinite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return n;
}

}  // namespace ref
}  // namespace m3::simd
