// Loops over a whole vocabulary row (M3: 200,064 logits) that run once per generated token:
// argmax, NaN cleanup, the softmax weights of sampling and the log-sum-exp of scoring. xsimd
// vectors of the width the build targets (SSE2 / NEON baseline, no -march), small helpers outside
// the Highway-dispatched kernels (docs/KERNELS.md). Each has a plain-loop twin in vocab_ref:: that
// the tests compare against.
#pragma once

#include <cstddef>

namespace m3 {

// Index of the largest value, the lowest index among equals; NaN never wins (all NaN: 0). n > 0.
size_t ArgMax(const float* x, size_t n);
// x[i] = -inf where x[i] is NaN (a NaN logit is never sampled).
void ReplaceNaN(float* x, size_t n);
// w[i] = exp((x[i] - max) / temperature) in float (w may be x); returns their sum, accumulated in
// double. The softmax weights of sampling, relative to the top token's (which gets 1).
double SoftmaxWeights(const float* x, size_t n, float max, float temperature, float* w);
// log(sum_i exp(x[i])) in double, shifted by the max so nothing overflows: -inf for n == 0, NaN
// when a value is NaN or +inf or all are -inf.
double LogSumExp(const float* x, size_t n);

namespace vocab_ref {
size_t ArgMax(const float* x, size_t n);
void ReplaceNaN(float* x, size_t n);
double SoftmaxWeights(const float* x, size_t n, float max, float temperature, float* w);
double LogSumExp(const float* x, size_t n);
}  // namespace vocab_ref

}  // namespace m3
