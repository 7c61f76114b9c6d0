// Scoring (runtime/perplexity.h): the window plan, the rows handed to each scored token against
// the golden prefill logits, the log-softmax/KL math, the base log-probability file, a token's
// log-probability with the most likely tokens, and a generation that scores its prompt.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "base/progress.h"
#include "format/npy.h"
#include "ops/sampling.h"
#include "runtime/generate.h"
#include "runtime/perplexity.h"
#include "test_util.h"

namespace m3 {
namespace {

TEST_CASE("score windows cover every token once with the promised context", "[perplexity]") {
  for (size_t n = 2; n <= 40; ++n)
    for (size_t context = 2; context <= 12; ++context)
      for (size_t stride = 1; stride <= context; ++stride) {
        INFO("n " << n << " context " << context << " stride " << stride);
        auto windows = PlanScoreWindows(n, context, stride);
        REQUIRE(windows.ok());
        std::vector<int> times(n, 0);
        std::set<size_t> window_starts;
        for (size_t w = 0; w < windows->size(); ++w) {
          const ScoreWindow& win = (*windows)[w];
          REQUIRE(win.begin < win.first_target);
          REQUIRE(win.first_target <= win.end);
          REQUIRE(win.end - win.begin <= context);
          REQUIRE(win.begin == w * stride);
          if (w > 0) window_starts.insert(win.begin);
          for (size_t t = win.first_target; t < win.end; ++t) {
            ++times[t];
            REQUIRE(t - win.begin >= std::min(t, context - stride));  // tokens before it in its window
          }
        }
        CHECK(windows->back().end == n);
        CHECK(times[0] == 0);
        for (size_t t = 1; t < n; ++t) {
          INFO("token " << t);
          // Only stride == context leaves tokens out: the first of each later window.
          CHECK(times[t] == (stride == context && window_starts.count(t) ? 0 : 1));
        }
      }
}

TEST_CASE("score windows refuse impossible plans with a message", "[perplexity]") {
  CHECK_THAT(PlanScoreWindows(10, 1, 1).status().message(), Catch::Contains("at least 2 tokens"));
  CHECK_THAT(PlanScoreWindows(10, 8, 0).status().message(), Catch::Contains("stride must be 1 to the context"));
  CHECK_THAT(PlanScoreWindows(10, 8, 9).status().message(), Catch::Contains("stride must be 1 to the context"));
  CHECK_THAT(PlanScoreWindows(1, 8, 4).status().message(), Catch::Contains("at least 2 tokens, got 1"));
  CHECK_THAT(PlanScoreWindows(0, 8, 4).status().message(), Catch::Contains("got 0"));
}

// A golden case opened for scoring: its prompt, greedy ids, prefill logits and engine.
struct GoldenPrefill {
  std::vector<int32_t> ids, greedy;
  double rel = 0;
  NpyArray rows;
  std::unique_ptr<Engine> engine;
  size_t vocab = 0;

  explicit GoldenPrefill(const std::string& name) {
    const std::string dir = test::GoldenDir(name);
    const auto spec = test::ReadPythonJson(dir + "/case.json");
    ids = spec["prompt_ids"].get<std::vector<int32_t>>();
    greedy = spec["greedy_ids"].get<std::vector<int32_t>>();
    rel = spec["tolerance"]["logits"]["rel"].get<double>();
    auto golden = ReadNpy(dir + "/prefill_logits.npy");
    REQUIRE(golden.ok());
    rows = std::move(golden).value();
    auto opened = Engine::Open(dir, {});
    REQUIRE(opened.ok());
    engine = std::move(opened).value();
    vocab = engine->model().config().vocab_size;
  }
  // Prefill chunks that split the scored rows at odd places.
  SessionOptions Chunked() const {
    SessionOptions options;
    options.prefill_chunk = ids.size() > 1000 ? 700 : 5;
    return options;
  }
  // How far `row` is from the golden row that predicts token `index`, in units of the tolerance.
  double Error(size_t index, std::span<const float> row) const {
    const float* want = &rows.data[(index - 1) * vocab];
    double err = 0, mag = 0;
    for (size_t j = 0; j < vocab; ++j) {
      err = std::max(err, std::fabs(double(row[j]) - want[j]));
      mag = std::max(mag, std::fabs(double(want[j])));
    }
    return err / (rel * (1 + mag));
  }
};

TEST_CASE("each scored token gets the row that predicts it (golden prefill logits)", "[perplexity][golden]") {
  for (const char* name : {"s1_fp32_basic", "s5_realprop_mxfp8_vl"}) {
    const GoldenPrefill c(name);
    Session session(*c.engine, c.Chunked());
    const ScoreWindow whole{0, c.ids.size(), 1};
    size_t next = 1;
    double worst = 0;
    REQUIRE(ScoreTokens(session, c.ids, {&whole, 1}, [&](size_t index, std::span<const float> row) {
              REQUIRE(index == next++);
              REQUIRE(row.size() == c.vocab);
              worst = std::max(worst, c.Error(index, row));
              return true;
            }).ok());
    INFO(name);
    CHECK(next == c.ids.size());
    CHECK(worst <= 1.0);
  }
}

TEST_CASE("scoring windows restart the context, stops when asked and refuses bad windows", "[perplexity][golden]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  const auto ids = test::ReadPythonJson(dir + "/case.json")["prompt_ids"].get<std::vector<int32_t>>();
  auto engine = Engine::Open(dir, {});
  REQUIRE(engine.ok());
  const size_t vocab = (*engine)->model().config().vocab_size;
  Session session(**engine);
  // A second window scoring tokens 20..29 from position 0 of tokens [10, 30) sees what a fresh
  // prefill of those 20 tokens sees.
  const std::vector<ScoreWindow> windows = {{0, 10, 1}, {10, 30, 20}};
  std::vector<float> fresh;
  Session direct(**engine);
  REQUIRE(direct.Eval(std::span(ids).subspan(10, 20), LogitsMode::kAllRows, &fresh).ok());
  size_t calls = 0, window_ends = 0;
  REQUIRE(ScoreTokens(
              session, ids, windows,
              [&](size_t index, std::span<const float> row) {
                ++calls;
                if (index >= 20) {
                  const float* want = &fresh[(index - 1 - 10) * vocab];
                  for (size_t j = 0; j < vocab; ++j) REQUIRE(std::fabs(row[j] - want[j]) <= 1e-4f * (1 + std::fabs(want[j])));
                }
                return true;
              },
              [&](size_t) { return ++window_ends < 5; })
              .ok());
  CHECK(calls == 9 + 10);
  CHECK(window_ends == 2);
  CHECK(session.position() == 19);  // tokens 10..28 from position 0: the last token is only a target

  calls = 0;
  REQUIRE(ScoreTokens(session, ids, windows, [&](size_t, std::span<const float>) { return ++calls < 3; }).ok());
  CHECK(calls == 3);
  const ScoreWindow past_end{50, ids.size() + 1, 51};
  CHECK_THAT(ScoreTokens(session, ids, {&past_end, 1}, [](size_t, std::span<const float>) { return true; }).message(),
             Catch::Contains("does not fit"));
  std::vector<int32_t> bad_target(ids.begin(), ids.begin() + 10);
  bad_target.back() = static_cast<int32_t>(vocab);  // a target only: the model never sees it
  const ScoreWindow all{0, 10, 1};
  CHECK_THAT(ScoreTokens(session, bad_target, {&all, 1}, [](size_t, std::span<const float>) { return true; }).message(),
             Catch::Contains("at index 9 is outside the vocabulary"));
  const ScoreWindow no_context{5, 10, 5};
  CHECK_FALSE(ScoreTokens(session, ids, {&no_context, 1}, [](size_t, std::span<const float>) { return true; }).ok());
}

TEST_CASE("log-softmax, KL divergence and the mean's standard error", "[perplexity]") {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, -3.0f};
  std::vector<float> lp;
  LogSoftmax(logits, &lp);
  double total = 0;
  for (float x : lp) total += std::exp(double(x));
  CHECK(total == Approx(1.0).epsilon(1e-6));
  CHECK(lp[1] - lp[0] == Approx(1.0).epsilon(1e-6));
  CHECK(LogSumExp(logits) == Approx(std::log(std::exp(1.0) + std::exp(2.0) + std::exp(0.5) + std::exp(-3.0))));
  CHECK(KlDivergence(lp, lp) == 0.0);
  // Two outcomes: KL(p || q) = p log(p/q) + (1-p) log((1-p)/(1-q)).
  const std::vector<float> p = {std::log(0.25f), std::log(0.75f)}, q = {std::log(0.5f), std::log(0.5f)};
  CHECK(KlDivergence(p, q) == Approx(0.25 * std::log(0.5) + 0.75 * std::log(1.5)).epsilon(1e-6));
  CHECK(KlDivergence(q, p) == Approx(0.5 * std::log(2.0) + 0.5 * std::log(0.5 / 0.75)).epsilon(1e-6));

  MeanEstimate m;
  CHECK(m.mean() == 0);
  CHECK(m.standard_error() == 0);
  for (double x : {1.0, 2.0, 3.0, 4.0}) m.Add(x);
  CHECK(m.count() == 4);
  CHECK(m.mean() == Approx(2.5));
  CHECK(m.standard_error() == Approx(std::sqrt((1.25 * 4 / 3) / 4)));
}

LogProbFileInfo SmallInfo() {
  LogProbFileInfo info;
  info.vocab = 5;
  info.scored = 3;
  info.n_ids = 4;
  info.ids_hash = 0x1234;
  info.context = 4;
  info.stride = 2;
  return info;
}

std::string WriteSmallFile(const std::filesystem::path& path) {
  auto w = LogProbFileWriter::Create(path.string(), SmallInfo());
  REQUIRE(w.ok());
  for (int r = 0; r < 3; ++r) {
    std::vector<float> row = test::RandomVec(5, 10 + r);
    REQUIRE((*w)->Append(row).ok());
  }
  REQUIRE((*w)->Finish().ok());
  return test::ReadBytes(path);
}

TEST_CASE("log-probability files round-trip and refuse damage", "[perplexity]") {
  test::TempDir tmp;
  const auto path = tmp.path() / "base.m3lp";
  const std::string bytes = WriteSmallFile(path);
  CHECK(bytes.size() == 128 + 3 * 5 * 4);
  CHECK_FALSE(std::filesystem::exists(path.string() + ".tmp"));
  {
    auto r = LogProbFileReader::Open(path.string());
    REQUIRE(r.ok());
    CHECK(CheckSameScoring((*r)->info(), SmallInfo(), "f").ok());
    std::vector<float> row;
    for (int i = 0; i < 3; ++i) {
      REQUIRE((*r)->Next(&row).ok());
      CHECK(row == test::RandomVec(5, 10 + i));
    }
    CHECK((*r)->Next(&row).code() == StatusCode::kOutOfRange);
  }
  SECTION("a different scoring is named") {
    LogProbFileInfo other = SmallInfo();
    other.stride = 3;
    CHECK_THAT(CheckSameScoring(SmallInfo(), other, "f").message(), Catch::Contains("a stride of 2, this run has 3"));
    other = SmallInfo();
    other.ids_hash = 1;
    CHECK_THAT(CheckSameScoring(SmallInfo(), other, "f").message(), Catch::Contains("other tokens"));
    other = SmallInfo();
    other.vocab = 6;
    CHECK_THAT(CheckSameScoring(SmallInfo(), other, "f").message(), Catch::Contains("vocabulary of 5"));
  }
  SECTION("truncated") {
    test::WriteBytes(path, bytes.substr(0, bytes.size() - 1));
    CHECK_THAT(LogProbFileReader::Open(path.string()).status().message(), Catch::Contains("truncated or damaged"));
  }
  SECTION("not such a file") {
    std::string bad = bytes;
    bad[0] = 'X';
    test::WriteBytes(path, bad);
    CHECK_THAT(LogProbFileReader::Open(path.string()).status().message(), Catch::Contains("not a log-probability file"));
  }
  SECTION("a changed row is caught by the checksum at the end") {
    std::string bad = bytes;
    bad[128 + 17] ^= 1;
    test::WriteBytes(path, bad);
    auto r = LogProbFileReader::Open(path.string());
    REQUIRE(r.ok());
    std::vector<float> row;
    CHECK((*r)->Next(&row).ok());
    CHECK((*r)->Next(&row).ok());
    CHECK_THAT((*r)->Next(&row).message(), Catch::Contains("checksum mismatch"));
  }
  SECTION("a writer that does not finish leaves no file, and refuses wrong rows") {
    const auto other = tmp.path() / "partial.m3lp";
    {
      auto w = LogProbFileWriter::Create(other.string(), SmallInfo());
      REQUIRE(w.ok());
      CHECK((*w)->Append(std::vector<float>(4)).code() == StatusCode::kInvalidArgument);
      REQUIRE((*w)->Append(std::vector<float>(5)).ok());
      CHECK((*w)->Finish().code() == StatusCode::kInternal);  // 1 of 3 rows
    }
    CHECK_FALSE(std::filesystem::exists(other));
    CHECK_FALSE(std::filesystem::exists(other.string() + ".tmp"));
  }
}

TEST_CASE("the progress meter counts tokens or bytes", "[perplexity]") {
  ProgressMeter tokens("scoring ", 200, /*tty=*/false, ProgressMeter::Unit::kTokens);
  const std::string first = tokens.Update(0);
  CHECK_THAT(first, Catch::StartsWith("scoring [") && Catch::Contains("0 / 200 tokens") && Catch::Contains("tok/s"));
  CHECK(tokens.Update(10).empty());  // the same decile
  CHECK_THAT(tokens.Update(100), Catch::Contains(" 50.0%") && Catch::Contains("100 / 200 tokens"));
  const std::string last = tokens.Update(200);
  CHECK_THAT(last, Catch::Contains("200 / 200 tokens") && Catch::Contains("ETA 0s") && Catch::EndsWith("\n"));
  ProgressMeter bytes("", 3000000, /*tty=*/false);
  CHECK_THAT(bytes.Update(3000000), Catch::Contains("3.0 / 3.0 MB") && Catch::Contains("MB/s"));
}

TEST_CASE("ScoreToken: the token's log-softmax and the most likely tokens, ties to the lower id", "[perplexity]") {
  std::vector<float> logits = test::RandomVec(1000, 7, 3.0f);
  logits[10] = logits[500] = logits[900] = 20.0f;  // a three-way tie at the top
  std::vector<float> log_p;
  LogSoftmax(logits, &log_p);
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  for (const size_t top_n : {size_t{0}, size_t{1}, size_t{5}, size_t{20}, size_t{5000}}) {
    INFO("top " << top_n);
    for (const int32_t id : {0, 10, 500, 999}) {
      const TokenLogprob t = ScoreToken(logits, id, top_n);
      CHECK(t.id == id);
      CHECK(t.logprob == log_p[id]);
      REQUIRE(t.top.size() == std::min(top_n, logits.size()));
      for (size_t k = 0; k < t.top.size(); ++k) {
        CHECK(t.top[k].first == order[k]);
        CHECK(t.top[k].second == log_p[order[k]]);
      }
    }
  }
  CHECK(ScoreToken(logits, 3, 3).top[0].first == 10);  // the lowest id of the tie first
}

TEST_CASE("a scored prompt gets the row that predicts each token and still generates the golden ids",
          "[perplexity][golden]") {
  for (const char* name : {"s1_fp32_basic", "s5_realprop_mxfp8_vl"}) {
    INFO(name);
    const GoldenPrefill c(name);
    const std::vector<int32_t>& ids = c.ids;
    Session session(*c.engine, c.Chunked());
    // A cached prefix of the prompt is not reused: its rows were never kept.
    std::vector<float> unused;
    REQUIRE(session.Eval(std::span(ids).first(10), LogitsMode::kLastRow, &unused).ok());

    // Alone, and stepped in one batch beside a plain generation of another prompt.
    for (const bool batched : {false, true}) {
      INFO((batched ? "batched" : "alone"));
      Sampler sampler(SamplingParams{.temperature = 0});
      GenerateOptions go;
      go.max_tokens = static_cast<int>(c.greedy.size());
      std::vector<int32_t> generated;
      Generation g(session, go, sampler, [&](int32_t id) { return generated.push_back(id), true; });
      size_t next = 1;
      double worst = 0;
      g.ScorePrompt([&](size_t index, int32_t id, std::span<const float> row) {
        REQUIRE(index == next++);
        REQUIRE(id == ids[index]);
        REQUIRE(row.size() == c.vocab);
        worst = std::max(worst, c.Error(index, row));
      });
      REQUIRE(g.Begin(ids).ok());
      CHECK(g.stats().reused_tokens == 0);
      if (!batched) {
        while (!g.pending().empty()) REQUIRE(g.Step(g.pending().first(std::min<size_t>(g.pending().size(), 7))).ok());
        REQUIRE(g.Run().ok());
      } else {
        Session other_session(*c.engine, c.Chunked());
        Sampler other_sampler(SamplingParams{.temperature = 0});
        GenerateOptions other_go;
        other_go.max_tokens = 3;
        Generation other(other_session, other_go, other_sampler, [](int32_t) { return true; });
        REQUIRE(other.Begin(std::span(ids).subspan(3, 20)).ok());
        for (;;) {
          std::vector<Generation*> gens;
          std::vector<std::span<const int32_t>> steps;
          for (Generation* x : {&g, &other}) {
            std::span<const int32_t> step;
            if (!x->pending().empty())
              step = x->pending().first(std::min<size_t>(x->pending().size(), 6));
            else if (!x->Next(&step))
              continue;
            gens.push_back(x);
            steps.push_back(step);
          }
          if (gens.empty()) break;
          for (const Status& st : BatchStep(gens, steps)) REQUIRE(st.ok());
        }
      }
      CHECK(next == ids.size());
      CHECK(worst <= 1.0);
      CHECK(generated == c.greedy);
      REQUIRE(session.Rewind(10).ok());  // a cached prefix again for the next run
    }
  }
}

}  // namespace
}  // namespace m3
