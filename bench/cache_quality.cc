#include "cache_quality.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>

namespace m3 {
namespace {

struct Run {
  std::vector<float> logits;  // [tokens, vocab]
  SelectionRecorder selections;
};

Status RunCase(const Engine& engine, const GoldenCase& golden, const CacheOptions& cache, Run* run) {
  if (golden.greedy.size() < static_cast<size_t>(golden.decode_steps))
    return InvalidArgument(golden.name, ": fewer greedy_ids than decode steps");
  SessionOptions options;
  options.cache = cache;
  Session session(engine, options);
  M3_RETURN_IF_ERROR(session.Eval(golden.prompt, LogitsMode::kAllRows, &run->logits, &run->selections));
  std::vector<float> step;
  for (int i = 0; i < golden.decode_steps; ++i) {
    M3_RETURN_IF_ERROR(session.Eval({&golden.greedy[i], 1}, LogitsMode::kLastRow, &step, &run->selections));
    run->logits.insert(run->logits.end(), step.begin(), step.end());
  }
  return Status::Ok();
}

double Jaccard(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> both;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
  const size_t uni = a.size() + b.size() - both.size();
  return uni ? static_cast<double>(both.size()) / static_cast<double>(uni) : 1.0;
}

Status CompareSelections(const SelectionRecorder& ref, const SelectionRecorder& got, const SparseParams& sparse,
                         SelectionAgreement* out) {
  if (ref.layers.size() != got.layers.size())
    return Status(StatusCode::kInternal, "block selections recorded for different layers");
  for (const auto& [layer, ref_rows] : ref.layers) {
    const auto it = got.layers.find(layer);
    if (it == got.layers.end() || it->second.size() != ref_rows.size())
      return Status(StatusCode::kInternal, Str("block selections of layer ", layer, " differ in length"));
    for (size_t pos = 0; pos < ref_rows.size(); ++pos) {
      const bool choice = static_cast<int64_t>(pos) / sparse.block_size + 1 > sparse.topk_blocks;
      for (size_t h = 0; h < ref_rows[pos].size(); ++h) {
        const auto &a = ref_rows[pos][h], &b = it->second[pos].at(h);
        const bool same = a == b;  // both ascending: equal vectors are equal sets
        const double jaccard = Jaccard(a, b);
        ++out->selections, out->identical += same, out->jaccard_sum += jaccard;
        if (choice) ++out->choice_selections, out->choice_identical += same, out->choice_jaccard_sum += jaccard;
      }
    }
  }
  return Status::Ok();
}

}  // namespace

std::vector<CacheSetting> NonDefaultCacheSettings() {
  std::vector<CacheSetting> out;
  for (CacheType t : {CacheType::kBF16, CacheType::kInt8}) {
    CacheOptions kv;
    kv.kv = t;
    out.push_back({std::string("kv ") + simd::CacheTypeName(t), kv});
  }
  for (CacheType t : {CacheType::kBF16, CacheType::kInt8}) {
    CacheOptions ik;
    ik.index_keys = t;
    out.push_back({std::string("index ") + simd::CacheTypeName(t), ik});
  }
  return out;
}

double SelectionAgreement::choice_agreement() const {
  return choice_selections ? static_cast<double>(choice_identical) / static_cast<double>(choice_selections)
                           : std::numeric_limits<double>::quiet_NaN();
}

double SelectionAgreement::choice_jaccard() const {
  return choice_selections ? choice_jaccard_sum / static_cast<double>(choice_selections)
                           : std::numeric_limits<double>::quiet_NaN();
}

StatusOr<std::vector<CacheQuality>> MeasureCacheQuality(const Engine& engine, const GoldenCase& golden,
                                                        std::span<const CacheSetting> settings) {
  const ModelConfig& cfg = engine.model().config();
  Run reference;
  M3_RETURN_IF_ERROR(RunCase(engine, golden, CacheOptions{}, &reference));
  std::vector<CacheQuality> out;
  for (const CacheSetting& setting : settings) {
    Run run;
    M3_RETURN_IF_ERROR(RunCase(engine, golden, setting.cache, &run));
    CacheQuality q;
    q.setting = setting.name;
    q.logits = CompareLogits(reference.logits, run.logits, cfg.vocab_size);
    M3_RETURN_IF_ERROR(CompareSelections(reference.selections, run.selections, cfg.sparse, &q.selection));
    out.push_back(std::move(q));
  }
  return out;
}

}  // namespace m3
