#include "ops/mlp.h"

#include "base/aligned_buffer.h"
#include "simd/kernels.h"
#include "ops/matmul.h"

namespace m3 {

void SwigluOai(float* g, const float* u, size_t n, const SwigluParams& p) {
  simd::SwigluOai(g, u, n, p.alpha, p.limit, p.beta);
}

void MlpForward(const OpContext& tc, const MlpWeights& w, const SwigluParams& act, const float* x, size_t n,
                float* out) {
  const size_t inter = w.gate.rows, hidden = w.gate.cols;
  AlignedBuffer<float> g(n * inter), u(n * inter);
  const MatMulTarget gate_up[] = {{&w.gate, g.data(), inter}, {&w.up, u.data(), inter}};
  MatMulSameInput(tc, gate_up, x, hidden, n);
  SwigluOai(g.data(), u.data(), n * inter, act);
  MatMul(tc, w.down, g.data(), inter, n, out, hidden);
}

}  // namespace m3
