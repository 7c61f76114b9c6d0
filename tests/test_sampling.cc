// Sampling: greedy, filters, penalties, determinism per seed, and the distribution it draws from.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "ops/sampling.h"
#include "ops/vocab.h"
#include "test_util.h"

namespace m3 {
namespace {

TEST_CASE("greedy takes the argmax, ties to the lower id, NaN never wins", "[sampling]") {
  Sampler s(SamplingParams{.temperature = 0});
  CHECK(s.Sample(std::vector<float>{0.1f, 3.0f, 3.0f, -1.0f}, {}) == 1);
  CHECK(s.Sample(std::vector<float>{NAN, 0.0f, -1.0f}, {}) == 1);
}

TEST_CASE("penalties push seen tokens down", "[sampling]") {
  Sampler rep(SamplingParams{.temperature = 0, .repetition_penalty = 2.0f});
  CHECK(rep.Sample(std::vector<float>{2.0f, 1.5f}, std::vector<int32_t>{0}) == 1);   // 2/2 = 1 < 1.5
  CHECK(rep.Sample(std::vector<float>{-1.0f, -1.5f}, std::vector<int32_t>{0}) == 1);  // -1*2 = -2 < -1.5
  Sampler pres(SamplingParams{.temperature = 0, .presence_penalty = 1.0f});
  CHECK(pres.Sample(std::vector<float>{2.0f, 1.5f}, std::vector<int32_t>{0, 0, 7}) == 1);  // out-of-range 7 ignored
}

// The penalties as a plain loop (the reference): repetition and presence once per distinct id of
// the whole history, frequency once per occurrence after the prompt (OpenAI's and vLLM's counts).
std::vector<float> PenalizedByReference(std::vector<float> logits, const std::vector<int32_t>& history,
                                        size_t prompt_tokens, const SamplingParams& p) {
  std::vector<bool> seen(logits.size(), false);
  std::vector<int> output_count(logits.size(), 0);
  for (size_t i = 0; i < history.size(); ++i) {
    const int32_t id = history[i];
    if (id < 0 || static_cast<size_t>(id) >= logits.size()) continue;
    if (!seen[id]) {
      seen[id] = true;
      float& x = logits[id];
      x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
      x -= p.presence_penalty;
    }
    if (i >= prompt_tokens) ++output_count[id];
  }
  for (size_t id = 0; id < logits.size(); ++id)
    logits[id] -= p.frequency_penalty * static_cast<float>(output_count[id]);
  return logits;
}

TEST_CASE("frequency_penalty counts the output's occurrences, not the prompt's, as the reference", "[sampling]") {
  // The prompt's tokens are not counted: id 0 fills the prompt, id 1 is generated once.
  Sampler freq(SamplingParams{.temperature = 0, .frequency_penalty = 1.0f});
  const std::vector<int32_t> history = {0, 0, 0, 1};
  CHECK(freq.Sample(std::vector<float>{2.0f, 2.5f}, history, -1, /*prompt_tokens=*/3) == 0);  // 2.5 - 1 < 2
  CHECK(freq.Sample(std::vector<float>{2.0f, 2.5f}, history, -1, /*prompt_tokens=*/0) == 1);  // 2 - 3 < 2.5 - 1
  // Negative: repeats are favoured.
  Sampler favour(SamplingParams{.temperature = 0, .frequency_penalty = -0.5f});
  CHECK(favour.Sample(std::vector<float>{2.0f, 1.8f}, history, -1, 3) == 1);

  // Greedy picks the argmax of the reference's logits, over random logits, histories and
  // penalties (all four together), ids outside the vocabulary and a prompt past the history included.
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t vocab = 2 + rng() % 30;
    std::vector<float> logits(vocab);
    for (float& x : logits) x = uniform(rng);
    std::vector<int32_t> hist(rng() % 40);
    for (int32_t& id : hist) id = static_cast<int32_t>(rng() % (vocab + 2)) - (trial % 7 == 0 ? 1 : 0);
    const size_t prompt_tokens = rng() % (hist.size() + 3);
    SamplingParams p{.temperature = 0, .frequency_penalty = uniform(rng)};
    if (trial % 2) p.presence_penalty = uniform(rng);
    if (trial % 3 == 0) p.repetition_penalty = 1.0f + std::abs(uniform(rng));
    REQUIRE(ValidateSamplingParams(p).ok());
    const std::vector<float> want = PenalizedByReference(logits, hist, prompt_tokens, p);
    const auto best = std::max_element(want.begin(), want.end());  // the first of equals
    Sampler s(p);
    INFO("trial " << trial);
    CHECK(s.Sample(logits, hist, -1, prompt_tokens) == static_cast<int32_t>(best - want.begin()));
  }

  // Sampling draws from the softmax of the reference's logits.
  const std::vector<float> logits = {0.0f, 0.5f, 1.0f, 0.2f};
  const std::vector<int32_t> hist = {2, 3, 2, 2, 1};  // prompt {2, 3}; output {2, 2, 1}
  const SamplingParams p{.presence_penalty = 0.1f, .frequency_penalty = 0.4f, .seed = 9};
  const std::vector<float> want = PenalizedByReference(logits, hist, 2, p);
  double total = 0;
  for (float x : want) total += std::exp(x);
  Sampler s(p);
  std::map<int32_t, int> count;
  constexpr int kDraws = 40000;
  for (int i = 0; i < kDraws; ++i) ++count[s.Sample(logits, hist, -1, 2)];
  for (int32_t id = 0; id < 4; ++id) {
    INFO("id " << id);
    CHECK(count[id] / double(kDraws) == Approx(std::exp(want[id]) / total).margin(0.01));
  }
}

TEST_CASE("top-k, top-p and min-p restrict the candidates", "[sampling]") {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  for (uint64_t seed = 0; seed < 200; ++seed) {
    Sampler k1(SamplingParams{.top_k = 1, .seed = seed});
    CHECK(k1.Sample(logits, {}) == 0);
    Sampler k2(SamplingParams{.top_k = 2, .seed = seed});
    CHECK(k2.Sample(logits, {}) <= 1);
    Sampler p(SamplingParams{.top_p = 0.75f, .seed = seed});  // 0.5 + 0.3 >= 0.75
    CHECK(p.Sample(logits, {}) <= 1);
    Sampler m(SamplingParams{.min_p = 0.25f, .seed = seed});  // keeps p >= 0.125
    CHECK(m.Sample(logits, {}) <= 2);
  }
}

// The tokens top-p / min-p keep (no top-k) in descending order, by a full sort: the reference for
// the sampler, which sorts only as many candidates as it needs.
std::vector<int32_t> KeptByFullSort(const std::vector<float>& logits, float top_p, float min_p) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  const double max = logits[order[0]];
  double total = 0;
  for (float x : logits) total += std::exp(x - max);
  std::vector<int32_t> kept;
  double cum = 0;
  for (int32_t id : order) {
    const double w = std::exp(logits[id] - max);
    if (w < min_p) break;
    kept.push_back(id);
    if ((cum += w / total) >= top_p) break;
  }
  return kept;
}

TEST_CASE("top-p and min-p over a large flat vocabulary keep what a full sort keeps", "[sampling]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(2000);
  for (float& x : logits) x = normal(rng);
  for (const auto& [top_p, min_p] : {std::pair{0.5f, 0.0f}, std::pair{0.98f, 0.0f}, std::pair{1.0f, 0.02f},
                                     std::pair{0.9f, 0.05f}}) {
    INFO("top_p " << top_p << ", min_p " << min_p);
    const std::vector<int32_t> kept = KeptByFullSort(logits, top_p, min_p);
    REQUIRE(kept.size() > 300);  // past the sampler's first sort (256 candidates)
    std::map<int32_t, size_t> rank;
    for (size_t i = 0; i < kept.size(); ++i) rank[kept[i]] = i;
    Sampler s(SamplingParams{.top_p = top_p, .min_p = min_p, .seed = 3});
    size_t outside = 0, deepest = 0;
    for (int i = 0; i < 3000; ++i) {
      const auto it = rank.find(s.Sample(logits, {}));
      if (it == rank.end()) ++outside;
      else deepest = std::max(deepest, it->second);
    }
    CHECK(outside == 0);
    CHECK(deepest > 256);          // it reached candidates past its first sort
    CHECK(deepest + 1 >= kept.size() * 3 / 4);  // and the far end of what it keeps
  }
}

TEST_CASE("the same seed gives the same tokens, and frequencies follow the distribution", "[sampling]") {
  const std::vector<float> logits = {std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  Sampler a(SamplingParams{.seed = 42}), b(SamplingParams{.seed = 42}), c(SamplingParams{.seed = 43});
  std::vector<int32_t> sa, sb, sc;
  std::map<int32_t, int> count;
  for (int i = 0; i < 20000; ++i) {
    sa.push_back(a.Sample(logits, {}));
    sb.push_back(b.Sample(logits, {}));
    sc.push_back(c.Sample(logits, {}));
    ++count[sa.back()];
  }
  CHECK(sa == sb);
  CHECK(sa != sc);
  CHECK(count[0] / 20000.0 == Approx(0.6).margin(0.02));
  CHECK(count[1] / 20000.0 == Approx(0.3).margin(0.02));
  CHECK(count[2] / 20000.0 == Approx(0.1).margin(0.02));
  // Temperature 0.25 raises probabilities to the 4th power: 0.6^4 / (0.6^4 + 0.3^4 + 0.1^4) = 0.940.
  Sampler cold(SamplingParams{.temperature = 0.25f, .seed = 1});
  int top = 0;
  for (int i = 0; i < 20000; ++i) top += cold.Sample(logits, {}) == 0;
  CHECK(top / 20000.0 == Approx(0.1296 / 0.1378).margin(0.01));
}

TEST_CASE("a draft token keeps the distribution: taken with its probability, else drawn from the rest", "[sampling]") {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  // Unfiltered (walks the vocabulary), top-k (a kept prefix) and top-p 0.9 (drops id 3).
  for (const SamplingParams base : {SamplingParams{}, SamplingParams{.top_k = 3}, SamplingParams{.top_p = 0.9f}}) {
    const bool filtered = base.top_k > 0 || base.top_p < 1.0f;
    const double kept = filtered ? 0.95 : 1.0;
    for (const int32_t draft : {0, 1, 3}) {
      SamplingParams sp = base;
      sp.seed = 7 + static_cast<uint64_t>(draft);
      Sampler s(sp);
      std::map<int32_t, int> count;
      constexpr int kDraws = 40000;
      for (int i = 0; i < kDraws; ++i) ++count[s.Sample(logits, {}, draft)];
      const double expect[4] = {0.5 / kept, 0.3 / kept, 0.15 / kept, filtered ? 0.0 : 0.05};
      for (int32_t id = 0; id < 4; ++id) {
        INFO("top_k " << base.top_k << " top_p " << base.top_p << " draft " << draft << " id " << id);
        CHECK(count[id] / double(kDraws) == Approx(expect[id]).margin(0.01));
      }
    }
  }
  // A draft that filtering drops (or out of range) changes nothing: the same draws as without one.
  Sampler with(SamplingParams{.top_k = 2, .seed = 3}), without(SamplingParams{.top_k = 2, .seed = 3});
  for (int i = 0; i < 200; ++i) CHECK(with.Sample(logits, {}, i % 2 ? 3 : 99) == without.Sample(logits, {}));
  // Greedy ignores it.
  Sampler greedy(SamplingParams{.temperature = 0});
  CHECK(greedy.Sample(logits, {}, 2) == 0);
  // The only candidate is always taken.
  Sampler one(SamplingParams{.top_k = 1, .seed = 5});
  for (int i = 0; i < 50; ++i) CHECK(one.Sample(logits, {}, 0) == 0);
}

TEST_CASE("invalid sampling options are refused by name", "[sampling]") {
  CHECK(ValidateSamplingParams(SamplingParams{}).ok());
  CHECK_THAT(ValidateSamplingParams(SamplingParams{.temperature = -1}).message(), Catch::Contains("temperature"));
  CHECK_THAT(ValidateSamplingParams(SamplingParams{.top_p = 0}).message(), Catch::Contains("top_p"));
  CHECK_THAT(ValidateSamplingParams(SamplingParams{.min_p = 2}).message(), Catch::Contains("min_p"));
  CHECK_THAT(ValidateSamplingParams(SamplingParams{.top_k = -3}).message(), Catch::Contains("top_k"));
  CHECK_THAT(ValidateSamplingParams(SamplingParams{.repetition_penalty = 0}).message(), Catch::Contains("repetition_penalty"));
  CHECK_THAT(ValidateSamplingParams(SamplingParams{.frequency_penalty = 2.5f}).message(),
             Catch::Contains("frequency_penalty"));
  CHECK_THAT(ValidateSamplingParams(SamplingParams{.frequency_penalty = NAN}).message(),
             Catch::Contains("frequency_penalty"));
  CHECK(ValidateSamplingParams(SamplingParams{.frequency_penalty = -2.0f}).ok());
}

}  // namespace
}  // namespace m3

// The vocabulary loops (ops/vocab.h, xsimd) against their plain-loop twins over lengths that end in
// every tail, with NaN, infinities and ties.
TEST_CASE("vocabulary loops match their references", "[sampling][vocab]") {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (size_t n : {1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 1000, 200064}) {
    std::vector<float> x(n);
    for (float& v : x) v = normal(rng);
    INFO("n " << n);
    CHECK(m3::ArgMax(x.data(), n) == m3::vocab_ref::ArgMax(x.data(), n));
    CHECK(m3::LogSumExp(x.data(), n) == Approx(m3::vocab_ref::LogSumExp(x.data(), n)).epsilon(1e-6));
    const size_t top = m3::vocab_ref::ArgMax(x.data(), n);
    for (float t : {0.25f, 1.0f, 1.7f}) {
      std::vector<float> w(n), w_ref(n);
      const double total = m3::SoftmaxWeights(x.data(), n, x[top], t, w.data());
      const double total_ref = m3::vocab_ref::SoftmaxWeights(x.data(), n, x[top], t, w_ref.data());
      CHECK(total == Approx(total_ref).epsilon(1e-6));
      // Float arguments: the relative error grows with |x - max| / t (one rounding of the argument).
      size_t far = 0;
      for (size_t i = 0; i < n; ++i) {
        const double arg = std::fabs((static_cast<double>(x[i]) - x[top]) / t);
        far += std::fabs(w[i] - w_ref[i]) > w_ref[i] * (1e-6 + 2e-7 * arg) + 1e-37;
      }
      CHECK(far == 0);
      CHECK(w[top] == 1.0f);
    }
    // Ties go to the lower index; NaN never wins and becomes -inf; an inf or NaN has no log-sum-exp.
    x[n - 1] = x[top];
    CHECK(m3::ArgMax(x.data(), n) == top);
    x[n / 2] = NAN;
    const size_t want = m3::vocab_ref::ArgMax(x.data(), n);
    CHECK(m3::ArgMax(x.data(), n) == want);
    CHECK(std::isnan(m3::LogSumExp(x.data(), n)));
    std::vector<float> cleaned = x, cleaned_ref = x;
    m3::ReplaceNaN(cleaned.data(), n);
    m3::vocab_ref::ReplaceNaN(cleaned_ref.data(), n);
    CHECK(std::memcmp(cleaned.data(), cleaned_ref.data(), n * 4) == 0);
    CHECK(cleaned[n / 2] == -INFINITY);
    x[0] = INFINITY;
    CHECK(m3::ArgMax(x.data(), n) == 0);
  }
  const std::vector<float> all_nan(5, NAN), all_neg_inf(5, -INFINITY);
  CHECK(m3::ArgMax(all_nan.data(), 5) == m3::vocab_ref::ArgMax(all_nan.data(), 5));
  CHECK(m3::ArgMax(all_neg_inf.data(), 5) == 0);
  CHECK(std::isnan(m3::LogSumExp(all_neg_inf.data(), 5)));
  CHECK(m3::LogSumExp(nullptr, 0) == -INFINITY);
}
