#include "ops/vocab.h"

#include <algorithm>
#include <cmath>

#include <xsimd/xsimd.hpp>

namespace m3 {
namespace {
using Batch = xsimd::batch<float>;
constexpr size_t kLanes = Batch::size;
}  // namespace

size_t ArgMax(const float* x, size_t n) {
  // The max by vectors (NaN lanes never replace a value: max(a, NaN) keeps a only with the NaN
  // second, hence the select), then the first index holding it.
  const Batch neg_inf(-INFINITY);
  Batch best = neg_inf;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch v = Batch::load_unaligned(x + i);
    best = xsimd::select(v > best, v, best);
  }
  alignas(64) float lanes[kLanes];
  best.store_aligned(lanes);
  float m = *std::max_element(lanes, lanes + kLanes);
  for (; i < n; ++i)
    if (x[i] > m) m = x[i];
  if (!(m > -INFINITY)) {  // every value NaN or -inf: the first -inf, else 0
    for (size_t j = 0; j < n; ++j)
      if (x[j] == -INFINITY) return j;
    return 0;
  }
  return static_cast<size_t>(std::find(x, x + n, m) - x);
}

void ReplaceNaN(float* x, size_t n) {
  const Batch neg_inf(-INFINITY);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch v = Batch::load_unaligned(x + i);
    xsimd::select(xsimd::isnan(v), neg_inf, v).store_unaligned(x + i);
  }
  for (; i < n; ++i)
    if (std::isnan(x[i])) x[i] = -INFINITY;
}

double SoftmaxWeights(const float* x, size_t n, float max, float temperature, float* w) {
  const Batch shift(max), inv_t(1.0f / temperature);
  double total = 0;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Batch e = xsimd::exp((Batch::load_unaligned(x + i) - shift) * inv_t);
    e.store_unaligned(w + i);
    total += static_cast<double>(xsimd::hadd(e));
  }
  for (; i < n; ++i) total += w[i] = std::exp((x[i] - max) * (1.0f / temperature));
  return total;
}

double LogSumExp(const float* x, size_t n) {
  if (n == 0) return -INFINITY;
  const float m = x[ArgMax(x, n)];
  if (std::isnan(m) || std::any_of(x, x + n, [](float v) { return std::isnan(v); })) return NAN;
  if (!std::isfinite(m)) return NAN;  // all -inf, or an inf: no distribution
  const Batch shift(m);
  double z = 0;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) z += static_cast<double>(xsimd::hadd(xsimd::exp(Batch::load_unaligned(x + i) - shift)));
  for (; i < n; ++i) z += std::exp(static_cast<double>(x[i]) - m);
  return m + std::log(z);
}

namespace vocab_ref {

size_t ArgMax(const float* x, size_t n) {
  size_t best = 0;
  bool found = false;
  for (size_t i = 0; i < n; ++i)
    if (!std::isnan(x[i]) && (!found || x[i] > x[best])) best = i, found = true;
  return best;
}

void ReplaceNaN(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) x[i] = -INFINITY;
}

double SoftmaxWeights(const float* x, size_t n, float max, float temperature, float* w) {
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += w[i] = static_cast<float>(std::exp((static_cast<double>(x[i]) - max) / temperature));
  return total;
}

double LogSumExp(const float* x, size_t n) {
  if (n == 0) return -INFINITY;
  double m = -INFINITY;
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return NAN;
    m = std::max(m, static_cast<double>(x[i]));
  }
  if (!std::isfinite(m)) return NAN;
  double z = 0;
  for (size_t i = 0; i < n; ++i) z += std::exp(static_cast<double>(x[i]) - m);
  return m + std::log(z);
}

}  // namespace vocab_ref
}  // namespace m3
