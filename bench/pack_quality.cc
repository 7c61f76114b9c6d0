#include "pack_quality.h"

#include <algorithm>
#include <cmath>

#include "ops/convert.h"
#include "model/weights.h"
#include "quality.h"
#include "runtime/engine.h"
#include "simd/weight_pack.h"

namespace m3 {
namespace {

std::vector<std::pair<std::string, const simd::WeightRef*>> Matrices(const Model& m, ModelWeights* copy) {
  *copy = m.weights();
  std::vector<std::pair<std::string, const simd::WeightRef*>> out;
  ForEachTensor(m.config(), m.stats().mtp_depths, copy, [&](TensorSlot& s) {
    if (s.matrix) out.emplace_back(s.name, s.matrix);
  });
  return out;
}

// Importance-weighted sums of the squared errors and values of q4 and of q3/q2 tensors.
struct WeightedSums {
  double q4_err = 0, q4_ref = 0, sub4_err = 0, sub4_ref = 0;
};

void AddWeightErrors(const simd::WeightRef& src, const simd::WeightRef& packed, const float* importance,
                     PackQuality* q, double* ref_q4, double* ref_q8, double* ref_sub4, WeightedSums* w) {
  const size_t cols = src.cols, padded = (cols + 31) / 32 * 32;
  std::vector<float> a(padded, 0.0f), b(cols), q40(padded);
  for (size_t r = 0; r < src.rows; ++r) {
    DecodeWeightRows(src, r, 1, a.data());
    DecodeWeightRows(packed, r, 1, b.data());
    double err = 0, ref = 0;
    double werr = 0, wref = 0;
    for (size_t c = 0; c < cols; ++c) {
      const double e = (a[c] - b[c]) * static_cast<double>(a[c] - b[c]), v = a[c] * static_cast<double>(a[c]);
      err += e, ref += v;
      if (importance) werr += importance[c] * e, wref += importance[c] * v;
    }
    if (packed.format == simd::WeightFormat::kQ4) w->q4_err += werr, w->q4_ref += wref;
    if (simd::IsSuperBlock(packed.format)) w->sub4_err += werr, w->sub4_ref += wref;
    if (packed.format == simd::WeightFormat::kQ4) {
      simd::ReconstructQ4_0(a.data(), padded, q40.data());
      double err40 = 0;
      for (size_t c = 0; c < cols; ++c) err40 += (a[c] - q40[c]) * static_cast<double>(a[c] - q40[c]);
      q->q4_rel_mse += err;
      q->q4_0_rel_mse += err40;
      *ref_q4 += ref;
      q->q4_weights += cols;
    } else if (packed.format == simd::WeightFormat::kQ8) {
      q->q8_rel_mse += err;
      *ref_q8 += ref;
    } else if (simd::IsSuperBlock(packed.format)) {
      q->sub4_rel_mse += err;
      *ref_sub4 += ref;
      q->sub4_weights += cols;
    }
  }
}

}  // namespace

StatusOr<PackQuality> MeasurePackQuality(const std::string& source_dir, const std::string& packed_dir,
                                         const std::vector<int32_t>& prompt, int decode_steps, int threads,
                                         const ImportanceMatrix* importance) {
  M3_ASSIGN_OR_RETURN(auto source, Engine::Open(source_dir, EngineOptions{threads}));
  M3_ASSIGN_OR_RETURN(auto packed, Engine::Open(packed_dir, EngineOptions{threads}));
  const ModelConfig& cfg = source->model().config();
  if (packed->model().config().vocab_size != cfg.vocab_size || packed->model().config().num_layers != cfg.num_layers)
    return InvalidArgument(packed_dir, " is not a packing of ", source_dir, " (config differs)");

  PackQuality q;
  ModelWeights wa, wb;
  const auto ma = Matrices(source->model(), &wa), mb = Matrices(packed->model(), &wb);
  if (ma.size() != mb.size()) return InvalidArgument(packed_dir, ": tensor lists differ from ", source_dir);
  double ref_q4 = 0, ref_q8 = 0, ref_sub4 = 0;
  WeightedSums weighted;
  for (size_t i = 0; i < ma.size(); ++i) {
    if (ma[i].first != mb[i].first) return InvalidArgument(packed_dir, ": tensor lists differ from ", source_dir);
    AddWeightErrors(*ma[i].second, *mb[i].second, importance ? importance->Find(ma[i].first) : nullptr, &q, &ref_q4,
                    &ref_q8, &ref_sub4, &weighted);
  }
  if (weighted.q4_ref > 0) q.q4_wrel_mse = weighted.q4_err / weighted.q4_ref;
  if (weighted.sub4_ref > 0) q.sub4_wrel_mse = weighted.sub4_err / weighted.sub4_ref;
  if (ref_q4 > 0) q.q4_rel_mse /= ref_q4, q.q4_0_rel_mse /= ref_q4;
  if (ref_q8 > 0) q.q8_rel_mse /= ref_q8;
  if (ref_sub4 > 0) q.sub4_rel_mse /= ref_sub4;

  const size_t vocab = cfg.vocab_size;
  Session sa(*source), sb(*packed);
  std::vector<float> la, lb;
  M3_RETURN_IF_ERROR(sa.Eval(prompt, LogitsMode::kAllRows, &la));
  M3_RETURN_IF_ERROR(sb.Eval(prompt, LogitsMode::kAllRows, &lb));
  std::vector<float> step_a, step_b;
  int32_t next = static_cast<int32_t>(Argmax(&la[(prompt.size() - 1) * vocab], vocab));
  for (int i = 0; i < decode_steps; ++i) {
    M3_RETURN_IF_ERROR(sa.Eval({&next, 1}, LogitsMode::kLastRow, &step_a));
    M3_RETURN_IF_ERROR(sb.Eval({&next, 1}, LogitsMode::kLastRow, &step_b));
    la.insert(la.end(), step_a.begin(), step_a.end());
    lb.insert(lb.end(), step_b.begin(), step_b.end());
    next = static_cast<int32_t>(Argmax(step_a.data(), vocab));
  }
  const LogitAgreement agreement = CompareLogits(la, lb, vocab);
  q.rows = agreement.rows;
  q.kl_mean = agreement.kl_mean;
  q.kl_max = agreement.kl_max;
  q.top1 = agreement.top1;
  return q;
}

Status CollectCalibrationImportance(const std::string& model_dir, const std::string& path, size_t chunks,
                                    size_t context, int threads) {
  M3_ASSIGN_OR_RETURN(auto engine, Engine::Open(model_dir, EngineOptions{threads}));
  ImportanceCollector collector(engine->model());
  Session session(*engine);
  const uint64_t vocab = static_cast<uint64_t>(engine->model().config().vocab_size);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  std::vector<int32_t> ids(context);
  for (size_t c = 0; c < chunks; ++c) {
    for (int32_t& id : ids) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      id = static_cast<int32_t>((state >> 33) % vocab);
    }
    M3_RETURN_IF_ERROR(session.Rewind(0));
    M3_RETURN_IF_ERROR(session.Eval(ids, LogitsMode::kNone, nullptr, &collector));
  }
  return collector.Save(path, {{"model", model_dir}, {"text", "pseudo-random ids"},
                               {"tokens", std::to_string(chunks * context)}, {"chunks", std::to_string(chunks)}});
}

}  // namespace m3
