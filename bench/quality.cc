#include "quality.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "runtime/perplexity.h"

namespace m3 {

double KlDivergence(const float* a, const float* b, size_t n) {
  // From logits, in double throughout (runtime/perplexity.h's KlDivergence takes log-probabilities).
  const double la = LogSumExp({a, n}), lb = LogSumExp({b, n});
  double kl = 0;
  for (size_t i = 0; i < n; ++i) {
    const double lpa = a[i] - la, lpb = b[i] - lb;
    kl += std::exp(lpa) * (lpa - lpb);
  }
  return std::max(0.0, kl);
}

size_t Argmax(const float* x, size_t n) { return static_cast<size_t>(std::max_element(x, x + n) - x); }

LogitAgreement CompareLogits(const std::vector<float>& reference, const std::vector<float>& other, size_t vocab) {
  LogitAgreement q;
  q.rows = std::min(reference.size(), other.size()) / vocab;
  if (q.rows == 0) return q;
  size_t agree = 0;
  for (size_t r = 0; r < q.rows; ++r) {
    const float *a = &reference[r * vocab], *b = &other[r * vocab];
    const double kl = KlDivergence(a, b, vocab);
    q.kl_mean += kl;
    q.kl_max = std::max(q.kl_max, kl);
    agree += Argmax(a, vocab) == Argmax(b, vocab);
  }
  q.kl_mean /= static_cast<double>(q.rows);
  q.top1 = static_cast<double>(agree) / static_cast<double>(q.rows);
  return q;
}

StatusOr<GoldenCase> ReadGoldenCase(const std::string& dir) {
  std::ifstream in(dir + "/case.json");
  if (!in) return NotFound(dir, "/case.json: cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  // case.json from Python may hold Infinity/NaN (e.g. an infinite decision margin).
  static const std::regex non_finite(R"(-?\bInfinity\b|\bNaN\b)");
  const auto j = nlohmann::json::parse(std::regex_replace(ss.str(), non_finite, "null"), nullptr, false);
  if (j.is_discarded() || !j.contains("prompt_ids")) return InvalidArgument(dir, "/case.json: no prompt_ids");
  GoldenCase c;
  c.dir = dir;
  std::string trimmed = dir;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  c.name = std::filesystem::path(trimmed).filename().string();
  c.prompt = j["prompt_ids"].get<std::vector<int32_t>>();
  c.decode_steps = j.value("decode_steps", 4);
  if (j.contains("greedy_ids")) c.greedy = j["greedy_ids"].get<std::vector<int32_t>>();
  if (c.prompt.empty()) return InvalidArgument(dir, "/case.json: empty prompt_ids");
  return c;
}

}  // namespace m3
