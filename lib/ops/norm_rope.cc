#include "ops/norm_rope.h"

#include <cmath>

#include "simd/kernels.h"

namespace m3 {

void RmsNormRows(const float* x, size_t ld_x, size_t n_rows, size_t dim, const float* scale, float eps,
                 float* y, size_t ld_y) {
  simd::RmsNormRows(x, ld_x, n_rows, dim, scale, eps, y, ld_y);
}

Rope::Rope(int rotary_dim, double theta) : rotary_dim_(rotary_dim) {
  const int half = rotary_dim / 2;
  inv_freq_.resize(half);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    inv_freq_[i] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
}

void Rope::CosSin(int64_t pos, float* cs) const {
  for (int i = 0; i < rotary_dim_ / 2; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq_[i];
    cs[2 * i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    cs[2 * i + 1] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

void Rope::Apply(float* x, size_t n_heads, size_t head_stride, int64_t pos) const {
  const int half = rotary_dim_ / 2;
  if (half == 0) return;
  float cs[1024];  // rotary_dim <= head_dim; heads wider than 1024 are refused at load
  CosSin(pos, cs);
  for (size_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_stride;
    for (int i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * cs[2 * i] - x2 * cs[2 * i + 1];
      v[i + half] = x2 * cs[2 * i] + x1 * cs[2 * i + 1];
    }
  }
}

}  // namespace m3
