// RMSNorm (Gemma or plain scale) and partial NeoX RoPE, in fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace m3 {

// For each of n_rows rows of `dim` values (row stride ld): y = x / sqrt(mean(x^2) + eps) * scale,
// where scale is the prepared multiplier ((1 + w) for Gemma norms). In place when y == x.
void RmsNormRows(const float* x, size_t ld_x, size_t n_rows, size_t dim, const float* scale, float eps,
                 float* y, size_t ld_y);

// Rotary embedding on the first `rotary_dim` channels of each head, pairs (i, i + rotary_dim/2)
// (NeoX rotate-half). inv_freq = theta^(-2i/R) and angle = pos * inv_freq are fp32, like the
// reference GPU code; cos/sin of that angle are evaluated accurately.
class Rope {
 public:
  Rope(int rotary_dim, double theta);
  // x: n_heads vectors of head_dim values at stride head_stride, all at position `pos`.
  void Apply(float* x, size_t n_heads, size_t head_stride, int64_t pos) const;
  // The rotation at `pos`: cs[i] = {cos, sin} of pair i < rotary_dim / 2, as Apply uses them.
  void CosSin(int64_t pos, float* cs) const;
  int rotary_dim() const { return rotary_dim_; }

 private:
  int rotary_dim_;
  std::vector<float> inv_freq_;
};

}  // namespace m3
