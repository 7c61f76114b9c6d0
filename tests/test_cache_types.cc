// Cache storage types (KV and index keys in bf16 / int8) against the exact f32 caches on the
// golden cases (bench/cache_quality.h; bench/cache_quality.sh prints the full table): bounds per
// setting on the KL divergence and top-1 agreement of every logit row and on the block-selection
// agreement over the selections that involve a choice.
//
// The bounds are the worst figure measured over the cases, with margin. They are not vacuous:
// with a cache that stores zeros (int8 codes or bf16 values forced to 0) KL reaches nats and the
// selections fall to the lowest blocks, and every setting fails (checked by breaking the codecs).
#include <cmath>
#include <string>

#include "bench/cache_quality.h"
#include "test_util.h"

namespace m3 {
namespace {

struct Bound {
  double max_kl_mean;    // nats, per case
  double max_kl;         // any row
  double min_top1;       // per case
  double min_selection;  // identical block sets, choice-bearing selections of a case
};

// Worst measured over s1-s4, s6 (kl mean / kl max / top-1 / selection), see docs/NUMERICS.md:
//   kv bf16     4.0e-4 / 0.061 / 0.986 / 0.998
//   kv int8     2.5e-2 / 0.86  / 0.930 / 0.972
//   index bf16  2.1e-4 / 0.044 / 1.000 / 0.9986
//   index int8  1.9e-2 / 0.93  / 0.957 / 0.981
Bound BoundFor(const CacheOptions& c) {
  if (c.kv == CacheType::kBF16) return {2e-3, 0.3, 0.97, 0.99};
  if (c.kv == CacheType::kInt8) return {0.06, 2.0, 0.88, 0.94};
  if (c.index_keys == CacheType::kBF16) return {2e-3, 0.3, 0.97, 0.99};
  return {0.05, 2.0, 0.90, 0.95};  // index keys int8
}

TEST_CASE("cache storage types stay close to the f32 caches on the golden cases", "[golden][cache]") {
  const auto settings = NonDefaultCacheSettings();
  REQUIRE(settings.size() == 4);
  std::vector<double> kl_sum(settings.size(), 0.0);
  size_t choices = 0;
  for (const char* name : test::kGoldenCases) {
    // s5 (2300 tokens, 64 heads) takes ~5 s per run on 2 cores; bench/cache_quality.sh covers it.
    if (std::string(name) == "s5_realprop_mxfp8_vl") continue;
    INFO(name);
    auto golden = ReadGoldenCase(test::GoldenDir(name));
    REQUIRE(golden.ok());
    auto engine = Engine::Open(golden->dir, EngineOptions{2});
    REQUIRE(engine.ok());
    auto results = MeasureCacheQuality(**engine, *golden, settings);
    INFO(results.status().ToString());
    REQUIRE(results.ok());
    REQUIRE(results->size() == settings.size());
    for (size_t i = 0; i < settings.size(); ++i) {
      const CacheQuality& q = (*results)[i];
      const Bound b = BoundFor(settings[i].cache);
      INFO(q.setting << ": KL mean " << q.logits.kl_mean << ", KL max " << q.logits.kl_max << ", top-1 "
                     << q.logits.top1 << ", selection " << q.selection.choice_agreement() << " of "
                     << q.selection.choice_selections);
      CHECK(q.logits.rows == golden->prompt.size() + golden->decode_steps);
      CHECK(q.logits.kl_mean <= b.max_kl_mean);
      CHECK(q.logits.kl_max <= b.max_kl);
      CHECK(q.logits.top1 >= b.min_top1);
      if (q.selection.choice_selections > 0) CHECK(q.selection.choice_agreement() >= b.min_selection);
      // Without a choice every visible block is selected, whatever the keys hold.
      CHECK(q.selection.identical - q.selection.choice_identical ==
            q.selection.selections - q.selection.choice_selections);
      kl_sum[i] += q.logits.kl_mean;
      if (i == 0) choices += q.selection.choice_selections;
    }
  }
  CHECK(choices > 0);  // the selection bound was exercised
  // Each setting took effect (an option ignored on the way to the cache would pass every bound).
  for (size_t i = 0; i < settings.size(); ++i) {
    INFO(settings[i].name);
    CHECK(kl_sum[i] > 0);
  }
}

}  // namespace
}  // namespace m3
