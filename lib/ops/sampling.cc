#include "ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_set>

namespace m3 {

Status ValidateSamplingParams(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) return InvalidArgument("temperature must be >= 0, got ", p.temperature);
  if (p.top_k < 0) return InvalidArgument("top_k must be >= 0, got ", p.top_k);
  if (!(p.top_p > 0 && p.top_p <= 1)) return InvalidArgument("top_p must be in (0, 1], got ", p.top_p);
  if (!(p.min_p >= 0 && p.min_p <= 1)) return InvalidArgument("min_p must be in [0, 1], got ", p.min_p);
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    return InvalidArgument("repetition_penalty must be > 0, got ", p.repetition_penalty);
  if (!std::isfinite(p.presence_penalty)) return InvalidArgument("presence_penalty must be finite");
  return Status::Ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::Sample(std::span<const float> logits, std::span<const int32_t> history) {
  const size_t vocab = logits.size();
  work_.assign(logits.begin(), logits.end());
  for (auto& x : work_)
    if (std::isnan(x)) x = -INFINITY;
  if (params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f) {
    std::unordered_set<int32_t> seen;
    for (int32_t id : history)
      if (id >= 0 && static_cast<size_t>(id) < vocab && seen.insert(id).second) {
        float& x = work_[id];
        x = x > 0 ? x / params_.repetition_penalty : x * params_.repetition_penalty;
        x -= params_.presence_penalty;
      }
  }
  if (params_.temperature == 0.0f)
    return static_cast<int32_t>(std::max_element(work_.begin(), work_.end()) - work_.begin());

  // Candidates in descending logit order (ties -> lower id); top-k limits how many are sorted.
  order_.resize(vocab);
  std::iota(order_.begin(), order_.end(), 0);
  const size_t k = params_.top_k > 0 ? std::min<size_t>(params_.top_k, vocab) : vocab;
  auto by_logit = [&](int32_t a, int32_t b) { return work_[a] > work_[b] || (work_[a] == work_[b] && a < b); };
  std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), by_logit);
  order_.resize(k);

  // Softmax over the candidates at the temperature, in double for stable sums.
  const double max_logit = work_[order_[0]];
  if (!std::isfinite(max_logit)) return order_[0];
  std::vector<double> prob(k);
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += prob[i] = std::exp((work_[order_[i]] - max_logit) / params_.temperature);
  size_t keep = k;
  if (params_.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < k; ++i) {
      cum += prob[i] / sum;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (params_.min_p > 0.0f) {
    const double floor = params_.min_p * prob[0];  // prob[0] is the largest
    size_t n = 1;
    while (n < keep && prob[n] >= floor) ++n;
    keep = n;
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += prob[i];
  double r = Uniform() * kept;
  for (size_t i = 0; i < keep; ++i) {
    r -= prob[i];
    if (r < 0) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace m3
