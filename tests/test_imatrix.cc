// Importance matrices (model/imatrix.h): what the collector records on a golden model (every
// matrix's rows, the routed experts' from the routing, layer 0's inputs recomputed by hand),
// the file's round trip and its refusals, and packs that weigh their error by it.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "format/pack_file.h"
#include "format/safetensors.h"
#include "model/imatrix.h"
#include "model/packer.h"
#include "ops/norm_rope.h"
#include "runtime/engine.h"
#include "simd/kernels.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

// The collector, counting the routing it is shown as well.
struct CountingCollector : m3::ImportanceCollector {
  using ImportanceCollector::ImportanceCollector;
  std::map<std::pair<int, int>, uint64_t> picks;  // (layer, expert) -> rows routed
  void OnRouting(int layer, int64_t, size_t n, int top_k, const int32_t* ids) override {
    for (size_t i = 0; i < n * static_cast<size_t>(top_k); ++i) ++picks[{layer, ids[i]}];
  }
};

std::vector<int32_t> Prompt(size_t n, int vocab) {
  std::vector<int32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % static_cast<size_t>(vocab));
  return ids;
}

// Runs `n` tokens of golden case `name` with a collector and saves its file to `path`.
void Collect(const std::string& name, size_t n, const fs::path& path, CountingCollector** keep = nullptr) {
  auto engine = m3::Engine::Open(m3::test::GoldenDir(name), m3::EngineOptions{2});
  INFO(engine.status().ToString());
  REQUIRE(engine.ok());
  static std::unique_ptr<CountingCollector> last;
  last = std::make_unique<CountingCollector>((*engine)->model());
  m3::Session session(**engine);
  std::vector<float> logits;
  const auto ids = Prompt(n, (*engine)->model().config().vocab_size);
  REQUIRE(session.Eval(ids, m3::LogitsMode::kAllRows, &logits, last.get()).ok());
  REQUIRE(last->Save(path.string(), {{"model", name}}).ok());
  if (keep) *keep = last.get();
}

TEST_CASE("the importance collector sees every matrix's rows, routed experts those routed to them", "[imatrix]") {
  m3::test::TempDir tmp;
  const fs::path path = tmp.path() / "imatrix.safetensors";
  const std::string name = "s1_fp32_basic";
  const size_t n = 40;
  CountingCollector* col = nullptr;
  Collect(name, n, path, &col);
  auto file = m3::SafetensorsFile::Open(path.string());
  REQUIRE(file.ok());
  REQUIRE((*file)->metadata().at("format") == m3::kImatrixFormat);
  const auto rows = nlohmann::json::parse((*file)->metadata().at("rows"));
  std::map<std::string, std::vector<float>> mean_sq;
  for (const m3::TensorInfo& t : (*file)->tensors()) {
    REQUIRE(t.dtype == m3::DType::kF32);
    std::vector<float> v(static_cast<size_t>(t.numel()));
    std::memcpy(v.data(), t.data, t.nbytes);
    for (float x : v) REQUIRE((std::isfinite(x) && x >= 0));
    mean_sq[t.name] = std::move(v);
  }

  auto model = m3::Model::Load(m3::test::GoldenDir(name));
  REQUIRE(model.ok());
  const m3::ModelConfig& cfg = (*model)->config();
  const size_t H = static_cast<size_t>(cfg.hidden_size);
  uint64_t routed_rows = 0;
  for (int l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    INFO("layer " << l);
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"})
      CHECK(rows.at(p + "self_attn." + proj + ".weight") == n);
    // q, k and v read the same rows
    CHECK(mean_sq.at(p + "self_attn.q_proj.weight") == mean_sq.at(p + "self_attn.k_proj.weight"));
    CHECK(mean_sq.at(p + "self_attn.q_proj.weight") == mean_sq.at(p + "self_attn.v_proj.weight"));
    if (!(*model)->weights().layers[static_cast<size_t>(l)].is_moe) continue;
    for (int e = 0; e < cfg.num_experts; ++e) {
      const std::string ex = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      const auto it = col->picks.find({l, e});
      const uint64_t picked = it == col->picks.end() ? 0 : it->second;
      if (picked == 0) {
        CHECK_FALSE(rows.contains(ex + "w1.weight"));
        continue;
      }
      for (const char* w : {"w1", "w2", "w3"}) CHECK(rows.at(ex + w + ".weight") == picked);
      routed_rows += picked;
    }
  }
  const int moe_layers = static_cast<int>(std::count(cfg.moe_layer.begin(), cfg.moe_layer.end(), true));
  CHECK(routed_rows == n * static_cast<uint64_t>(cfg.experts_per_token * moe_layers));
  CHECK(rows.at("lm_head.weight") == n);

  // Layer 0's projections read RMSNorm(embedding rows): their mean squares, by hand.
  const m3::ModelWeights& w = (*model)->weights();
  const auto ids = Prompt(n, cfg.vocab_size);
  std::vector<double> want(H, 0.0);
  std::vector<float> row(H), normed(H);
  for (int32_t id : ids) {
    m3::simd::DecodeRows(w.embed, static_cast<size_t>(id), 1, row.data());
    m3::RmsNormRows(row.data(), H, 1, H, w.layers[0].input_norm.data(), cfg.rms_norm_eps, normed.data(), H);
    for (size_t c = 0; c < H; ++c) want[c] += static_cast<double>(normed[c]) * normed[c] / static_cast<double>(n);
  }
  const std::vector<float>& got = mean_sq.at("model.layers.0.self_attn.q_proj.weight");
  for (size_t c = 0; c < H; ++c) REQUIRE(got[c] == Approx(want[c]).epsilon(1e-5));
}

TEST_CASE("importance matrix files are checked: format, values, names and widths", "[imatrix]") {
  m3::test::TempDir tmp;
  const fs::path good = tmp.path() / "good.safetensors";
  Collect("s1_fp32_basic", 16, good);
  auto m = m3::ImportanceMatrix::Load(good.string());
  REQUIRE(m.ok());
  CHECK(m->size() > 0);
  CHECK(m->metadata().at("model") == "s1_fp32_basic");
  const float* q = m->Find("model.layers.0.self_attn.q_proj.weight");
  REQUIRE(q != nullptr);
  CHECK(m->Find("model.layers.0.self_attn.no_such.weight") == nullptr);

  std::map<std::string, size_t> matrices = {{"model.layers.0.self_attn.q_proj.weight", 64}};
  auto check = m->CheckAgainst(matrices);
  REQUIRE_FALSE(check.ok());  // the file has more matrices than this "model"
  CHECK_THAT(check.message(), Contains("is not a matrix of this model"));

  auto write = [&](const std::string& file, const std::vector<float>& v, std::vector<int64_t> shape,
                   std::map<std::string, std::string> meta) {
    const m3::F32Tensor t{"model.layers.0.self_attn.q_proj.weight", std::move(shape), v.data()};
    REQUIRE(m3::WriteSafetensors((tmp.path() / file).string(), {&t, 1}, meta).ok());
    return m3::ImportanceMatrix::Load((tmp.path() / file).string());
  };
  const std::map<std::string, std::string> tag = {{"format", m3::kImatrixFormat}};
  std::vector<float> v(64, 1.0f);
  auto untagged = write("untagged.safetensors", v, {64}, {});
  REQUIRE_FALSE(untagged.ok());
  CHECK_THAT(untagged.status().message(), Contains("not an importance matrix"));
  v[3] = -1.0f;
  auto negative = write("negative.safetensors", v, {64}, tag);
  REQUIRE_FALSE(negative.ok());
  CHECK_THAT(negative.status().message(), Contains("not a finite mean square"));
  v[3] = NAN;
  CHECK_FALSE(write("nan.safetensors", v, {64}, tag).ok());
  v[3] = 1.0f;
  auto two_d = write("2d.safetensors", v, {8, 8}, tag);
  REQUIRE_FALSE(two_d.ok());
  CHECK_THAT(two_d.status().message(), Contains("one dimension"));
  auto narrow = write("narrow.safetensors", std::vector<float>(32, 1.0f), {32}, tag);
  REQUIRE(narrow.ok());
  auto width = narrow->CheckAgainst(matrices);
  REQUIRE_FALSE(width.ok());
  CHECK_THAT(width.message(), Contains("has 32 inputs in the importance matrix but 64 in the model"));
  // The weights the quantizers get: the mean squares plus 1% of their mean.
  auto ones = write("ones.safetensors", std::vector<float>(64, 2.0f), {64}, tag);
  REQUIRE(ones.ok());
  CHECK(ones->Find("model.layers.0.self_attn.q_proj.weight")[5] == Approx(2.02f));
}

// Sum over the q4/q3/q2 matrices the file covers of imp[c] (w - q)^2.
double WeightedPackError(const fs::path& pack_dir, const std::string& src_dir, const m3::ImportanceMatrix& imp,
                         size_t* matrices) {
  auto pf = m3::PackFile::Open((pack_dir / m3::kPackFileName).string());
  REQUIRE(pf.ok());
  auto ck = m3::Checkpoint::Open(src_dir);
  REQUIRE(ck.ok());
  auto cfg = m3::ParseModelConfig((*ck)->config_json());
  REQUIRE(cfg.ok());
  m3::ModelWeights src;
  auto stats = m3::BindWeights(*cfg, **ck, &src);
  REQUIRE(stats.ok());
  double err = 0;
  *matrices = 0;
  m3::ForEachTensor(*cfg, stats->mtp_depths, &src, [&](m3::TensorSlot& s) {
    const m3::PackedTensor* t = (*pf)->Find(s.name);
    const float* w = imp.Find(s.name);
    if (!s.matrix || !t || !w || t->format == m3::simd::WeightFormat::kQ8 || t->format == m3::simd::WeightFormat::kF32)
      return;
    ++*matrices;
    const m3::simd::WeightRef packed = (*pf)->Weight(*t);
    std::vector<float> a(s.matrix->cols), b(s.matrix->cols);
    for (size_t r = 0; r < s.matrix->rows; ++r) {
      m3::simd::DecodeRows(*s.matrix, r, 1, a.data());
      m3::simd::DecodeRows(packed, r, 1, b.data());
      for (size_t c = 0; c < a.size(); ++c) err += w[c] * static_cast<double>(a[c] - b[c]) * (a[c] - b[c]);
    }
  });
  return err;
}

TEST_CASE("m3 pack --imatrix weighs the q4/q3/q2 matrices' error by it", "[imatrix][pack]") {
  m3::test::TempDir tmp;
  const std::string name = "s1_fp32_basic", src = m3::test::GoldenDir(name);
  const fs::path imatrix = tmp.path() / "imatrix.safetensors";
  Collect(name, 64, imatrix);
  auto imp = m3::ImportanceMatrix::Load(imatrix.string());
  REQUIRE(imp.ok());
  for (m3::PackType type : {m3::PackType::kQ4Mixed, m3::PackType::kQ2Mixed}) {
    DYNAMIC_SECTION(m3::PackTypeName(type)) {
      m3::PackOptions opt;
      opt.source_dir = src;
      opt.type = type;
      opt.threads = 2;
      opt.output_dir = (tmp.path() / "plain").string();
      opt.force = true;
      auto plain = m3::PackModel(opt);
      REQUIRE(plain.ok());
      CHECK(plain->weighted_matrices == 0);
      opt.output_dir = (tmp.path() / "weighted").string();
      opt.imatrix = imatrix.string();
      auto weighted = m3::PackModel(opt);
      INFO(weighted.status().ToString());
      REQUIRE(weighted.ok());
      size_t n_plain = 0, n_weighted = 0;
      const double e_plain = WeightedPackError(tmp.path() / "plain", src, *imp, &n_plain);
      const double e_weighted = WeightedPackError(tmp.path() / "weighted", src, *imp, &n_weighted);
      CHECK(weighted->weighted_matrices == n_weighted);
      CHECK(n_weighted > 0);
      INFO("weighted error ratio " << e_weighted / e_plain);
      // q4 has one scale per 32 to choose (a few % better); q3/q2 a scale and a min per 32 and
      // the super-block's (measured 0.75-0.85 here).
      CHECK(e_weighted < (type == m3::PackType::kQ4Mixed ? 0.995 : 0.95) * e_plain);
      // The pack runs and records where its importance came from.
      auto pf = m3::PackFile::Open((tmp.path() / "weighted" / m3::kPackFileName).string());
      REQUIRE(pf.ok());
      auto engine = m3::Engine::Open((tmp.path() / "weighted").string(), m3::EngineOptions{2});
      REQUIRE(engine.ok());
      m3::Session session(**engine);
      std::vector<float> logits;
      REQUIRE(session.Eval(Prompt(8, 512), m3::LogitsMode::kLastRow, &logits).ok());
      for (float x : logits) REQUIRE(std::isfinite(x));
    }
  }
  // An importance matrix of another model is refused before anything is written.
  m3::PackOptions opt;
  opt.source_dir = m3::test::GoldenDir("s2_bf16_sharded_init1");
  opt.output_dir = (tmp.path() / "other").string();
  opt.imatrix = imatrix.string();
  auto other = m3::PackModel(opt);
  REQUIRE_FALSE(other.ok());
  CHECK_FALSE(fs::exists(tmp.path() / "other" / m3::kPackFileName));
}

}  // namespace
