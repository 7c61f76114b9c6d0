// How much each non-default cache storage type changes the model on every golden case, against
// the exact f32 caches: KL divergence and top-1 agreement of all logit rows (prompt and decode
// steps, teacher-forced on the golden tokens), and the sparse layers' block selections (identical
// sets and mean Jaccard overlap over the selections that involved a choice, i.e. more visible
// blocks than top-k; their count beside them).
//
//   bench_cache_quality [--json] GOLDEN_CASE_DIR...
//
// bench/cache_quality.sh runs it on every case; tests/test_cache_types.cc holds the bounds.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache_quality.h"

namespace {

// JSON has no NaN: a figure over zero selections is null.
nlohmann::json OrNull(double x) { return std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x); }

std::string Fixed(double x) {
  if (std::isnan(x)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", x);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::vector<std::string> cases;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) json = true;
    else cases.push_back(argv[i]);
  }
  if (cases.empty()) {
    std::fprintf(stderr, "usage: bench_cache_quality [--json] GOLDEN_CASE_DIR...\n");
    return 2;
  }
  const auto settings = m3::NonDefaultCacheSettings();
  if (!json)
    std::printf("%-38s %-11s %5s %10s %10s %7s %9s %9s %8s %8s\n", "case", "setting", "rows", "KL mean", "KL max",
                "top1", "sel agree", "sel Jacc", "choices", "all sel");
  int failures = 0;
  for (const auto& dir : cases) {
    auto golden = m3::ReadGoldenCase(dir);
    auto engine = golden.ok() ? m3::Engine::Open(dir, m3::EngineOptions{2})
                              : m3::StatusOr<std::unique_ptr<m3::Engine>>(golden.status());
    auto results = engine.ok() ? m3::MeasureCacheQuality(**engine, *golden, settings)
                               : m3::StatusOr<std::vector<m3::CacheQuality>>(engine.status());
    if (!results.ok()) {
      std::fprintf(stderr, "%s: %s\n", dir.c_str(), results.status().ToString().c_str());
      ++failures;
      continue;
    }
    for (const m3::CacheQuality& q : *results) {
      const m3::SelectionAgreement& s = q.selection;
      if (json) {
        nlohmann::json row = {{"case", golden->name},
                              {"setting", q.setting},
                              {"rows", q.logits.rows},
                              {"kl_mean", q.logits.kl_mean},
                              {"kl_max", q.logits.kl_max},
                              {"top1", q.logits.top1},
                              {"selection_agreement", OrNull(s.choice_agreement())},
                              {"selection_jaccard", OrNull(s.choice_jaccard())},
                              {"choice_selections", s.choice_selections},
                              {"selections", s.selections},
                              {"selection_agreement_all", OrNull(double(s.identical) / double(s.selections))},
                              {"selection_jaccard_all", OrNull(s.jaccard_sum / double(s.selections))}};
        std::printf("%s\n", row.dump().c_str());
      } else {
        std::printf("%-38s %-11s %5zu %10.2e %10.2e %7.4f %9s %9s %8zu %8zu\n", golden->name.c_str(),
                    q.setting.c_str(), q.logits.rows, q.logits.kl_mean, q.logits.kl_max, q.logits.top1,
                    Fixed(s.choice_agreement()).c_str(), Fixed(s.choice_jaccard()).c_str(), s.choice_selections,
                    s.selections);
      }
    }
    std::fflush(stdout);
  }
  return failures ? 1 : 0;
}
