// How much a non-default cache storage type (simd::CacheType: bf16, int8 with per-vector scales)
// changes the model, against the exact f32 caches: logits (KL divergence, top-1 agreement) and the
// sparse layers' block selections (identical sets, Jaccard overlap), over a golden case's tokens.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "ops/kv_cache.h"
#include "quality.h"
#include "runtime/engine.h"

namespace m3 {

struct CacheSetting {
  std::string name;  // e.g. "kv int8"
  CacheOptions cache;
};
// KV bf16, KV int8, index keys bf16, index keys int8: each alone, the other cache at f32.
std::vector<CacheSetting> NonDefaultCacheSettings();

// Block selections of one run against the reference run, per (sparse layer, position, index
// head). A selection "involves a choice" when more blocks are visible than top-k (pos / B + 1 >
// topk_blocks); otherwise every visible block is selected and the sets agree trivially.
struct SelectionAgreement {
  size_t selections = 0;   // all compared
  size_t identical = 0;    // same block set
  double jaccard_sum = 0;  // sum of |A n B| / |A u B|
  size_t choice_selections = 0;
  size_t choice_identical = 0;
  double choice_jaccard_sum = 0;
  // Fractions over choice-bearing selections (NaN when there are none).
  double choice_agreement() const;
  double choice_jaccard() const;
};

struct CacheQuality {
  std::string setting;
  LogitAgreement logits;
  SelectionAgreement selection;
};

// Runs the case's token sequence (the prompt in one prefill with all rows, then each decode step
// fed the golden greedy id: teacher forcing, so every run sees the same tokens) with f32 caches
// and with each setting, and compares each setting's run with the f32 one.
StatusOr<std::vector<CacheQuality>> MeasureCacheQuality(const Engine& engine, const GoldenCase& golden,
                                                        std::span<const CacheSetting> settings);

}  // namespace m3
