// Packs each golden checkpoint as q8, q4-mixed, q4, q3-mixed and q2-mixed and reports, per case and
// type, the weight reconstruction error (q4 against llama.cpp Q4_0 at the same 4.5 bits per weight;
// q3/q2 over their expert tensors) and the KL divergence / top-1 agreement of the packed model's
// logits against the unpacked fp32 engine.
//
//   bench_pack_quality [--json] [--check] [--imatrix] GOLDEN_CASE_DIR...
//
// --imatrix also packs q4-mixed, q3-mixed and q2-mixed with an importance matrix of each case
// (m3 imatrix's, from 4 x 128 pseudo-random ids that are not the golden prompt: random models
// have no text of their own) and reports for every type the importance-weighted relative error of
// its q4 (q4-mixed) or q3/q2 tensors beside the plain one.
//
// --check exits non-zero when a q4 error exceeds Q4_0's or a figure falls below the bars below
// (ctest runs it that way).
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/packer.h"
#include "pack_quality.h"
#include "quality.h"

namespace {

// Regression bars for --check, set from measurements with margin. The golden models are tiny,
// random and built with deliberately small routing/block/argmax margins, so small weight errors
// flip discrete decisions: q8 (0.6% rms weight error) measures KL 0.003-0.15 and top-1 0.75-0.97
// whether activations are int8 or fp32. A broken kernel gives KL of several nats.
struct Bar {
  double max_kl_mean;
  double min_top1;
};
Bar BarFor(m3::PackType t) {
  switch (t) {
    case m3::PackType::kQ8: return {0.25, 0.65};
    case m3::PackType::kQ4Mixed: return {0.3, 0.55};
    case m3::PackType::kQ4: return {1.2, 0.25};
    case m3::PackType::kQ3Mixed: return {0.5, 0.4};
    case m3::PackType::kQ2Mixed: return {1.0, 0.25};
  }
  return {0, 0};
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false, check = false, with_imatrix = false;
  std::vector<std::string> cases;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) json = true;
    else if (!std::strcmp(argv[i], "--check")) check = true;
    else if (!std::strcmp(argv[i], "--imatrix")) with_imatrix = true;
    else cases.push_back(argv[i]);
  }
  if (cases.empty()) {
    std::fprintf(stderr, "usage: bench_pack_quality [--json] [--check] [--imatrix] GOLDEN_CASE_DIR...\n");
    return 2;
  }
  const auto tmp = std::filesystem::temp_directory_path() / ("m3_pack_quality_" + std::to_string(getpid()));
  int failures = 0;
  if (!json)
    std::printf("%-40s %-12s %6s %10s %10s %6s %11s %11s %11s %11s%s\n", "case", "type", "rows", "KL mean", "KL max",
                "top1", "q8 relMSE", "q4 relMSE", "Q4_0 relMSE", "q3/q2 rMSE", with_imatrix ? "  weighted rMSE" : "");
  for (const auto& dir : cases) {
    const auto golden = m3::ReadGoldenCase(dir);
    if (!golden.ok()) {
      std::fprintf(stderr, "%s\n", golden.status().ToString().c_str());
      return 1;
    }
    const std::string& name = golden->name;
    std::optional<m3::ImportanceMatrix> importance;
    const std::string imatrix_path = (tmp / (name + "_imatrix.safetensors")).string();
    if (with_imatrix) {
      std::filesystem::create_directories(tmp);
      m3::Status s = m3::CollectCalibrationImportance(dir, imatrix_path, 4, 128, 2);
      auto loaded = s.ok() ? m3::ImportanceMatrix::Load(imatrix_path) : m3::StatusOr<m3::ImportanceMatrix>(s);
      if (!loaded.ok()) {
        std::fprintf(stderr, "%s: importance matrix: %s\n", name.c_str(), loaded.status().ToString().c_str());
        return 1;
      }
      importance = std::move(loaded).value();
    }
    std::vector<std::pair<m3::PackType, bool>> runs;  // (type, with the importance matrix)
    for (m3::PackType type : {m3::PackType::kQ8, m3::PackType::kQ4Mixed, m3::PackType::kQ4, m3::PackType::kQ3Mixed,
                              m3::PackType::kQ2Mixed})
      runs.emplace_back(type, false);
    if (with_imatrix)
      for (m3::PackType type : {m3::PackType::kQ4Mixed, m3::PackType::kQ3Mixed, m3::PackType::kQ2Mixed})
        runs.emplace_back(type, true);
    for (const auto& [type, weighted] : runs) {
      const std::string label = std::string(m3::PackTypeName(type)) + (weighted ? "+im" : "");
      m3::PackOptions opt;
      opt.source_dir = dir;
      opt.output_dir = (tmp / (name + "_" + label)).string();
      opt.type = type;
      opt.force = true;
      opt.threads = 2;
      if (weighted) opt.imatrix = imatrix_path;
      auto packed = m3::PackModel(opt);
      auto q = packed.ok() ? m3::MeasurePackQuality(dir, opt.output_dir, golden->prompt, golden->decode_steps, 2,
                                                    importance ? &*importance : nullptr)
                           : m3::StatusOr<m3::PackQuality>(packed.status());
      if (!q.ok()) {
        std::fprintf(stderr, "%s %s: %s\n", name.c_str(), label.c_str(), q.status().ToString().c_str());
        ++failures;
        continue;
      }
      const Bar bar = BarFor(type);
      const bool ok = q->kl_mean <= bar.max_kl_mean && q->top1 >= bar.min_top1 && q->q4_rel_mse <= q->q4_0_rel_mse;
      if (!ok) ++failures;
      if (json) {
        nlohmann::json row = {{"case", name}, {"type", m3::PackTypeName(type)}, {"imatrix", weighted}, {"rows", q->rows},
                              {"kl_mean", q->kl_mean}, {"kl_max", q->kl_max}, {"top1", q->top1},
                              {"q8_rel_mse", q->q8_rel_mse}, {"q4_rel_mse", q->q4_rel_mse},
                              {"q4_0_rel_mse", q->q4_0_rel_mse}, {"q4_weights", q->q4_weights},
                              {"sub4_rel_mse", q->sub4_rel_mse}, {"sub4_weights", q->sub4_weights},
                              {"q4_weighted_rel_mse", q->q4_wrel_mse}, {"sub4_weighted_rel_mse", q->sub4_wrel_mse},
                              {"bits_per_weight", packed->bits_per_weight()}, {"within_bars", ok}};
        std::printf("%s\n", row.dump().c_str());
      } else {
        char w[32] = "";
        if (importance) std::snprintf(w, sizeof w, "  %13.2e", q->sub4_weights ? q->sub4_wrel_mse : q->q4_wrel_mse);
        std::printf("%-40s %-12s %6zu %10.2e %10.2e %6.3f %11.2e %11.2e %11.2e %11.2e%s%s\n", name.c_str(),
                    label.c_str(), q->rows, q->kl_mean, q->kl_max, q->top1, q->q8_rel_mse, q->q4_rel_mse,
                    q->q4_0_rel_mse, q->sub4_rel_mse, w, ok ? "" : "  <-- outside the bars");
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
  return check && failures ? 1 : 0;
}
