#include "ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "ops/vocab.h"

namespace m3 {

Status ValidateSamplingParams(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) return InvalidArgument("temperature must be >= 0, got ", p.temperature);
  if (p.top_k < 0) return InvalidArgument("top_k must be >= 0, got ", p.top_k);
  if (!(p.top_p > 0 && p.top_p <= 1)) return InvalidArgument("top_p must be in (0, 1], got ", p.top_p);
  if (!(p.min_p >= 0 && p.min_p <= 1)) return InvalidArgument("min_p must be in [0, 1], got ", p.min_p);
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    return InvalidArgument("repetition_penalty must be > 0, got ", p.repetition_penalty);
  if (!std::isfinite(p.presence_penalty)) return InvalidArgument("presence_penalty must be finite");
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2))
    return InvalidArgument("frequency_penalty must be in [-2, 2], got ", p.frequency_penalty);
  return Status::Ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

namespace {

// The speculative-sampling split of one uniform u against a draft of probability p_draft: the
// draft when u < p_draft, else u rescaled to [0, 1) for a draw among the other tokens.
struct DraftSplit {
  bool take_draft;
  double u;
};
DraftSplit SplitForDraft(double u, double p_draft) {
  if (u < p_draft) return {true, u};
  return {false, p_draft > 0 ? std::min((u - p_draft) / (1.0 - p_draft), std::nextafter(1.0, 0.0)) : u};
}

}  // namespace

int32_t Sampler::Sample(std::span<const float> logits, std::span<const int32_t> history, int32_t draft,
                        size_t prompt_tokens) {
  const size_t vocab = logits.size();
  work_.assign(logits.begin(), logits.end());
  ReplaceNaN(work_.data(), vocab);
  if (params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f) {
    std::unordered_set<int32_t> seen;
    for (int32_t id : history)
      if (id >= 0 && static_cast<size_t>(id) < vocab && seen.insert(id).second) {
        float& x = work_[id];
        x = x > 0 ? x / params_.repetition_penalty : x * params_.repetition_penalty;
        x -= params_.presence_penalty;
      }
  }
  if (params_.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> count;  // of each id in the output
    for (const int32_t id : history.subspan(std::min(prompt_tokens, history.size())))
      if (id >= 0 && static_cast<size_t>(id) < vocab) ++count[id];
    for (const auto& [id, n] : count) work_[id] -= params_.frequency_penalty * static_cast<float>(n);
  }
  if (params_.temperature == 0.0f) return static_cast<int32_t>(ArgMax(work_.data(), vocab));

  // Relative probabilities exp((logit - max) / T); the max is the first largest logit (top-k
  // finds it as its first candidate, without a pass of its own).
  size_t top = 0;
  double max_logit = 0;
  auto weight = [&](int32_t id) { return std::exp((work_[id] - max_logit) / params_.temperature); };
  const double u = Uniform();
  if (draft >= 0 && static_cast<size_t>(draft) >= vocab) draft = -1;
  // Without top-k every token's weight is needed: computed once over the vocabulary (vectors).
  double total = 0;  // all tokens' weight
  if (params_.top_k == 0) {
    top = ArgMax(work_.data(), vocab);
    max_logit = work_[top];
    if (!std::isfinite(max_logit)) return static_cast<int32_t>(top);
    weights_.resize(vocab);
    total = SoftmaxWeights(work_.data(), vocab, work_[top], params_.temperature, weights_.data());
  }

  // No filter: the draw walks the vocabulary in id order, one pass and no sort.
  if (params_.top_k == 0 && params_.top_p >= 1.0f && params_.min_p <= 0.0f) {
    const double w_draft = draft >= 0 ? weights_[draft] : 0.0;
    const DraftSplit split = SplitForDraft(u, w_draft / total);
    if (split.take_draft) return draft;
    double r = split.u * (total - w_draft);
    for (size_t i = 0; i < vocab; ++i)
      if (static_cast<int32_t>(i) != draft && (r -= weights_[i]) < 0) return static_cast<int32_t>(i);
    return static_cast<int32_t>(top);  // rounding left r >= 0: the likeliest token
  }

  // Candidates in descending logit order (ties -> lower id). Top-k sorts k of them. Without it,
  // top-p / min-p keep a prefix that is usually short: sort a few, and more only while the
  // prefix might go on past them (a full sort of a 200K vocabulary took ~35 ms per token).
  auto by_logit = [&](int32_t a, int32_t b) { return work_[a] > work_[b] || (work_[a] == work_[b] && a < b); };
  const double floor = params_.min_p;  // min-p: weight >= min_p (the top token's weight is 1)
  std::vector<double> prob;
  size_t k = params_.top_k > 0 ? std::min<size_t>(params_.top_k, vocab) : std::min<size_t>(256, vocab);
  size_t keep = 0;
  for (;;) {
    order_.resize(vocab);
    std::iota(order_.begin(), order_.end(), 0);
    const auto kth = order_.begin() + static_cast<std::ptrdiff_t>(k);
    if (k <= 1024) {  // a heap of k: one comparison for most tokens
      std::partial_sort(order_.begin(), kth, order_.end(), by_logit);
    } else {  // selection, then a sort of the k alone
      std::nth_element(order_.begin(), kth - 1, order_.end(), by_logit);
      std::sort(order_.begin(), kth, by_logit);
    }
    order_.resize(k);
    if (params_.top_k > 0) {
      max_logit = work_[order_[0]];
      if (!std::isfinite(max_logit)) return order_[0];
    }
    prob.resize(k);
    for (size_t i = 0; i < k; ++i) prob[i] = params_.top_k > 0 ? weight(order_[i]) : weights_[order_[i]];
    const double sum = params_.top_k > 0 ? std::accumulate(prob.begin(), prob.end(), 0.0) : total;
    keep = k;
    bool decided = params_.top_k > 0 || k == vocab;
    if (params_.top_p < 1.0f) {
      double cum = 0;
      for (size_t i = 0; i < k; ++i) {
        cum += prob[i] / sum;
        if (cum >= params_.top_p) {
          keep = i + 1;
          decided = true;
          break;
        }
      }
    }
    if (params_.min_p > 0.0f) {
      size_t n = 1;
      while (n < keep && prob[n] >= floor) ++n;
      if (n < keep || prob[k - 1] < floor) decided = true;  // the cut falls inside the sorted ones
      keep = std::min(keep, n);
    }
    if (decided) break;
    k = std::min(vocab, k * 4);
  }
  double kept = 0, w_draft = 0;
  for (size_t i = 0; i < keep; ++i) {
    kept += prob[i];
    if (order_[i] == draft) w_draft = prob[i];
  }
  const DraftSplit split = SplitForDraft(u, w_draft / kept);
  if (split.take_draft) return draft;
  double r = split.u * (kept - w_draft);
  size_t last = keep - 1;
  for (size_t i = 0; i < keep; ++i) {
    if (order_[i] == draft) continue;
    last = i;
    r -= prob[i];
    if (r < 0) return order_[i];
  }
  return order_[last];  // rounding left r >= 0
}

}  // namespace m3
