// Golden parity: every golden case (tests/data/golden, and ../shared/golden when it is there)
// within its tolerance (prefill logits, decode logits, greedy ids, selected blocks), run
// in-process through Session; 1 and 2 threads give bit-identical results; request validation.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "format/npy.h"
#include "offload/gpu.h"
#include "simd/kernels.h"
#include "format/safetensors.h"
#include "platform/parallel.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "runtime/scheduler.h"
#include "text/tokenizer.h"
#include "batch_check.h"
#include "test_util.h"

namespace m3 {
namespace {

struct RunResult {
  std::vector<float> prefill, decode;
  std::vector<int32_t> greedy;
  SelectionRecorder blocks;
};

int32_t Argmax(const float* x, size_t n) { return static_cast<int32_t>(std::max_element(x, x + n) - x); }

RunResult RunCase(const std::string& dir, const std::vector<int32_t>& prompt, int steps, const EngineOptions& options) {
  auto engine = Engine::Open(dir, options);
  INFO(engine.status().ToString());
  REQUIRE(engine.ok());
  const size_t vocab = (*engine)->model().config().vocab_size;
  Session session(**engine);
  RunResult r;
  REQUIRE(session.Eval(prompt, LogitsMode::kAllRows, &r.prefill, &r.blocks).ok());
  r.greedy.push_back(Argmax(&r.prefill[(prompt.size() - 1) * vocab], vocab));
  std::vector<float> step;
  for (int i = 0; i < steps; ++i) {
    REQUIRE(session.Eval({&r.greedy.back(), 1}, LogitsMode::kLastRow, &step, &r.blocks).ok());
    r.decode.insert(r.decode.end(), step.begin(), step.end());
    r.greedy.push_back(Argmax(step.data(), vocab));
  }
  return r;
}

// Worst per-row error relative to the rule's limit rel * (1 + max|golden row|); must be <= 1.
double WorstRowRatio(const std::vector<float>& got, const NpyArray& want, double rel) {
  const size_t vocab = want.shape[1];
  REQUIRE(got.size() == want.data.size());
  double worst = 0;
  for (size_t r = 0; r < static_cast<size_t>(want.shape[0]); ++r) {
    double err = 0, mag = 0;
    for (size_t j = 0; j < vocab; ++j) {
      err = std::max(err, std::fabs(double(got[r * vocab + j]) - want.data[r * vocab + j]));
      mag = std::max(mag, std::fabs(double(want.data[r * vocab + j])));
    }
    worst = std::max(worst, err / (rel * (1 + mag)));
  }
  return worst;
}

using test::GoldenCases;

// One golden case run with `options`: logits within the case's tolerance, identical greedy ids
// and block selections.
void CheckGoldenCase(const std::string& name, const std::string& dir, const EngineOptions& options) {
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  const int steps = cj["decode_steps"].get<int>();
  const double rel = cj["tolerance"]["logits"]["rel"].get<double>();
  RunResult r = RunCase(dir, prompt, steps, options);

  auto pre = ReadNpy(dir + "/prefill_logits.npy");
  auto dec = ReadNpy(dir + "/decode_logits.npy");
  REQUIRE(pre.ok());
  REQUIRE(dec.ok());
  const double pre_ratio = WorstRowRatio(r.prefill, *pre, rel);
  const double dec_ratio = WorstRowRatio(r.decode, *dec, rel);
  WARN(name << (options.gpu.empty() ? "" : " (--gpu dense on " + options.gpu_device + ")")
            << ": worst logit error / limit: prefill " << pre_ratio << ", decode " << dec_ratio);
  CHECK(pre_ratio <= 1.0);
  CHECK(dec_ratio <= 1.0);
  CHECK(r.greedy == cj["greedy_ids"].get<std::vector<int32_t>>());

  auto sel = ReadJsonFile(dir + "/selected_blocks.json");
  REQUIRE(sel.ok());
  const auto& layers = (*sel)["layers"];
  CHECK(layers.size() == r.blocks.layers.size());
  for (auto it = layers.begin(); it != layers.end(); ++it) {
    const int layer = std::stoi(it.key());
    REQUIRE(r.blocks.layers.count(layer));
    const auto want = it.value().get<std::vector<std::vector<std::vector<int32_t>>>>();
    const auto& got = r.blocks.layers[layer];
    REQUIRE(got.size() == want.size());
    size_t mismatches = 0;
    for (size_t p = 0; p < want.size(); ++p) mismatches += got[p] != want[p];
    INFO("layer " << layer);
    CHECK(mismatches == 0);
  }
}

TEST_CASE("every golden case matches within tolerance", "[golden]") {
  const auto cases = GoldenCases();
  REQUIRE(cases.size() >= 6);  // the repository's copy, and ../shared's cases when it is there
  for (const auto& [name, dir] : cases) {
    SECTION(name) { CheckGoldenCase(name, dir, EngineOptions{2}); }
  }
}

// The devices --gpu dense can run on here: the host reference device always, a CUDA GPU where
// the build has CUDA and the machine a GPU (else the reason it is skipped, said once).
std::vector<std::string> OffloadDevices() {
  // M3_TEST_OFFLOAD_DEVICES=cuda: the GPU alone (scripts/check-cuda.sh, where time is short).
  const char* only = std::getenv("M3_TEST_OFFLOAD_DEVICES");
  if (only && *only) return {only};
  std::vector<std::string> devices = {"host"};
  const StatusOr<GpuInfo> gpu = QueryGpu(0);
  if (gpu.ok())
    devices.push_back("cuda");
  else
    WARN("SKIPPED on the GPU: " << gpu.status().message());
  return devices;
}

EngineOptions OffloadOptions(const std::string& device) {
  EngineOptions o{2};
  o.gpu = "dense";
  o.gpu_device = device;
  return o;
}

TEST_CASE("with the dense part offloaded (--gpu dense) every golden case matches within tolerance",
          "[golden][offload]") {
  // The host reference device (~9 s a case on 2 cores) on one case of each source dtype (fp32,
  // bf16, MXFP8 with mixed layers, fp16): what the upload path converts differs by dtype, the
  // passes it runs do not; a real GPU runs every case.
  const std::set<std::string> host_cases = {"s1_fp32_basic", "s2_bf16_sharded_init1", "s3_mxfp8_mixed_layers_local2",
                                            "s6_fp16_mha_top1_sharded3"};
  for (const std::string& device : OffloadDevices())
    for (const auto& [name, dir] : GoldenCases()) {
      if (device == "host" && !host_cases.count(name)) continue;
      SECTION(device + " " + name) { CheckGoldenCase(name, dir, OffloadOptions(device)); }
    }
}

TEST_CASE("the repository's test data equals ../shared's, file for file, when it is there", "[golden]") {
  if (test::DataRoots().size() < 2) {
    WARN("no ../shared beside the clone: only the repository's copy is tested");
    return;
  }
  size_t compared = 0;
  for (const char* part : {"golden", "oracle", "tokenizer"}) {
    const std::filesystem::path root = std::filesystem::path(test::DataDir()) / part;
    for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
      if (!e.is_regular_file()) continue;
      const auto rel = std::filesystem::relative(e.path(), test::DataDir());
      const auto theirs = std::filesystem::path(test::SharedDir()) / rel;
      INFO(rel.string());
      if (!std::filesystem::exists(theirs)) continue;  // a file only the copy has
      CHECK(test::ReadBytes(e.path()) == test::ReadBytes(theirs));
      ++compared;
    }
  }
  CHECK(compared > 30);
}

TEST_CASE("1 and 2 threads give bit-identical logits", "[golden][threads]") {
  for (const char* name : {"s2_bf16_sharded_init1", "s3_mxfp8_mixed_layers_local2"}) {
    const std::string dir = test::GoldenDir(name);
    auto cj = test::ReadPythonJson(dir + "/case.json");
    const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
    RunResult one = RunCase(dir, prompt, 4, EngineOptions{1}), two = RunCase(dir, prompt, 4, EngineOptions{2});
    CHECK(one.prefill == two.prefill);
    CHECK(one.decode == two.decode);
    CHECK(one.greedy == two.greedy);
  }
}

TEST_CASE("simulated NUMA nodes (split, distribute) give logits identical to --numa off", "[golden][numa]") {
  // Two logical nodes on this machine's CPUs run the real split path: node-local expert slices,
  // threads pinned per node.
  const auto cases = GoldenCases();
  REQUIRE(cases.size() >= 6);
  for (const auto& [name, dir] : cases) {
    INFO(name);
    auto cj = test::ReadPythonJson(dir + "/case.json");
    const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
    const int steps = cj["decode_steps"].get<int>();
    const RunResult off = RunCase(dir, prompt, steps, EngineOptions{2});
    for (NumaMode mode : {NumaMode::kSplit, NumaMode::kDistribute}) {
      if (mode == NumaMode::kDistribute && name != "s1_fp32_basic") continue;  // only pins threads
      INFO(NumaModeName(mode));
      EngineOptions numa_options{2, mode};
      numa_options.simulated_numa_nodes = 2;
      const RunResult numa = RunCase(dir, prompt, steps, numa_options);
      CHECK(numa.prefill == off.prefill);
      CHECK(numa.decode == off.decode);
      CHECK(numa.greedy == off.greedy);
    }
  }
}

// Locked memory of this process (VmLck in /proc/self/status), in bytes.
uint64_t LockedBytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

TEST_CASE("mlock-dense locks the dense weights and changes no logit", "[golden]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  const uint64_t before = LockedBytes();
  EngineOptions locked{2};
  locked.mlock_dense = true;
  auto engine = Engine::Open(dir, locked);
  if (!engine.ok()) {  // an unprivileged run with a small RLIMIT_MEMLOCK: the error says how to fix it
    CHECK(engine.status().message().find("ulimit -l") != std::string::npos);
    return;
  }
  CHECK((*engine)->placement().find("locked") != std::string::npos);
  CHECK(LockedBytes() > before);
  const RunResult a = RunCase(dir, prompt, 2, locked), b = RunCase(dir, prompt, 2, EngineOptions{2});
  CHECK(a.prefill == b.prefill);
  CHECK(a.decode == b.decode);
}

TEST_CASE("an engine runs at most as many threads as the process has CPUs", "[golden][threads]") {
  // More would only wait on one another at every barrier (ResolveThreadCount).
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  const int cpus = DefaultThreadCount();
  for (const auto& [asked, runs] : {std::pair{0, cpus}, {cpus + 3, cpus}, {1000000, cpus}, {1, 1}}) {
    auto engine = Engine::Open(dir, EngineOptions{asked});
    REQUIRE(engine.ok());
    CHECK((*engine)->threads().threads == runs);
  }
}

TEST_CASE("chunked prefill equals one prefill", "[golden]") {
  const std::string dir = test::GoldenDir("s2_bf16_sharded_init1");
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  auto engine = Engine::Open(dir, EngineOptions{2});
  REQUIRE(engine.ok());
  const size_t vocab = (*engine)->model().config().vocab_size;
  SessionOptions one_pass, small;
  one_pass.prefill_chunk = 1 << 20;
  small.prefill_chunk = 7;
  Session whole(**engine, one_pass), chunked(**engine, one_pass), inner(**engine, small);
  SelectionRecorder whole_blocks, inner_blocks;
  std::vector<float> a, b, c, part;
  REQUIRE(whole.Eval(prompt, LogitsMode::kAllRows, &a, &whole_blocks).ok());
  // The caller's chunks of 37, one Eval each.
  for (size_t i = 0; i < prompt.size(); i += 37) {
    const size_t n = std::min<size_t>(37, prompt.size() - i);
    REQUIRE(chunked.Eval({prompt.data() + i, n}, LogitsMode::kAllRows, &part).ok());
    b.insert(b.end(), part.begin(), part.end());
  }
  // One Eval in the session's chunks of 7: the same logits, block selections and cache.
  REQUIRE(inner.Eval(prompt, LogitsMode::kAllRows, &c, &inner_blocks).ok());
  REQUIRE(a.size() == prompt.size() * vocab);
  REQUIRE(b.size() == a.size());
  REQUIRE(c.size() == a.size());
  double worst_b = 0, worst_c = 0;
  size_t argmax_differs = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst_b = std::max(worst_b, double(std::fabs(a[i] - b[i])));
    worst_c = std::max(worst_c, double(std::fabs(a[i] - c[i])));
  }
  for (size_t r = 0; r < prompt.size(); ++r) argmax_differs += Argmax(&a[r * vocab], vocab) != Argmax(&c[r * vocab], vocab);
  WARN("chunks of 37: worst |logit diff| " << worst_b << "; prefill_chunk 7: " << worst_c);
  CHECK(worst_b < 1e-5);  // measured: 0 (AVX3, 2-core Zen 4)
  CHECK(worst_c < 1e-5);
  CHECK(argmax_differs == 0);
  CHECK(inner_blocks.layers == whole_blocks.layers);
  CHECK(inner.tokens() == whole.tokens());
  // kLastRow: the last chunk's last row. Then greedy decode steps through both caches.
  Session last(**engine, small);
  std::vector<float> l, step_a, step_c;
  REQUIRE(last.Eval(prompt, LogitsMode::kLastRow, &l).ok());
  REQUIRE(l.size() == vocab);
  CHECK(std::equal(l.begin(), l.end(), c.end() - vocab));
  int32_t next_a = Argmax(&a[a.size() - vocab], vocab), next_c = Argmax(l.data(), vocab);
  for (int i = 0; i < 4; ++i) {
    REQUIRE(next_a == next_c);
    REQUIRE(whole.Eval({&next_a, 1}, LogitsMode::kLastRow, &step_a).ok());
    REQUIRE(last.Eval({&next_c, 1}, LogitsMode::kLastRow, &step_c).ok());
    double worst = 0;
    for (size_t j = 0; j < vocab; ++j) worst = std::max(worst, double(std::fabs(step_a[j] - step_c[j])));
    CHECK(worst < 1e-5);
    next_a = Argmax(step_a.data(), vocab);
    next_c = Argmax(step_c.data(), vocab);
  }
}

// Throws std::bad_alloc from the block selection of a query at or past `at` (a failed allocation
// in the middle of a chunked prefill).
struct FailAt : ForwardObserver {
  int64_t at;
  explicit FailAt(int64_t p) : at(p) {}
  void OnBlockSelection(int, int64_t pos0, const BlockSelection& sel) override {
    if (pos0 + static_cast<int64_t>(sel.counts.size() / sel.num_index_heads) > at) throw std::bad_alloc();
  }
};

TEST_CASE("an error in the middle of a chunked prefill leaves the session as it was", "[golden][errors]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  auto engine = Engine::Open(dir, EngineOptions{2});
  REQUIRE(engine.ok());
  SessionOptions o;
  o.prefill_chunk = 7;
  Session s(**engine, o), ref(**engine, o);
  const std::span<const int32_t> head(prompt.data(), 5), rest(prompt.data() + 5, 40);
  std::vector<float> got, want;
  REQUIRE(s.Eval(head, LogitsMode::kLastRow, &got).ok());
  FailAt fail(5 + 20);  // the third chunk of `rest`
  const Status st = s.Eval(rest, LogitsMode::kAllRows, &got, &fail);
  CHECK(st.code() == StatusCode::kOutOfMemory);
  CHECK(s.position() == 5);
  CHECK(s.tokens() == std::vector<int32_t>(head.begin(), head.end()));
  // The positions the failed call wrote are overwritten: the same result as without the failure.
  REQUIRE(s.Eval(rest, LogitsMode::kAllRows, &got).ok());
  REQUIRE(ref.Eval(head, LogitsMode::kLastRow, &want).ok());
  REQUIRE(ref.Eval(rest, LogitsMode::kAllRows, &want).ok());
  CHECK(got == want);
  CHECK(s.tokens() == ref.tokens());
}

// The kernels are chosen once, when the engine opens: by name for every implementation this CPU
// runs (each holds the golden logits), and an unknown name is refused with the names it could take.
TEST_CASE("an engine runs the kernels it was opened with", "[golden][kernels]") {
  const std::string dir = test::GoldenDir("s2_bf16_sharded_init1");
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  auto want = ReadNpy(dir + "/prefill_logits.npy");
  REQUIRE(want.ok());
  const size_t vocab = static_cast<size_t>(want->shape.back());
  for (const std::string& name : Kernels::Names()) {
    INFO("kernels " << name);
    EngineOptions o{2};
    o.kernels = name;
    auto engine = Engine::Open(dir, o);
    REQUIRE(engine.ok());
    CHECK_THAT((*engine)->simd_target(), Catch::StartsWith(name + ":"));
    Session s(**engine);
    std::vector<float> logits;
    REQUIRE(s.Eval(prompt, LogitsMode::kLastRow, &logits).ok());
    const float* last = want->data.data() + (prompt.size() - 1) * vocab;
    float worst = 0;
    for (size_t i = 0; i < vocab; ++i) worst = std::max(worst, std::fabs(logits[i] - last[i]));
    CHECK(worst < 1e-3f);
  }
  EngineOptions bad{1};
  bad.kernels = "no-such-kernels";
  auto engine = Engine::Open(dir, bad);
  REQUIRE(!engine.ok());
  CHECK(engine.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(engine.status().message(), Catch::StartsWith("unknown kernels 'no-such-kernels' (this CPU runs: auto, ref"));
}

TEST_CASE("a context whose caches do not fit in memory is refused with what to change", "[golden][errors]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  REQUIRE(prompt.size() == 64);
  auto engine = Engine::Open(dir, EngineOptions{1});
  REQUIRE(engine.ok());
  const size_t need = Session(**engine).cache().BytesFor(64);
  SessionOptions o;
  o.memory_budget_bytes = need - 1;
  Session s(**engine, o);
  std::vector<float> logits;
  Status st = s.Eval(prompt, LogitsMode::kLastRow, &logits);
  CHECK(st.code() == StatusCode::kOutOfMemory);
  CHECK_THAT(st.message(), Catch::StartsWith("a context of 64 tokens needs "));
  CHECK_THAT(st.message(), Catch::Contains("of KV cache (f32 K/V, f32 index keys); "));
  CHECK_THAT(st.message(), Catch::Contains("is the memory budget: use --kv-cache bf16 or int8 and --index-cache bf16 "
                                           "or int8, or a shorter context"));
  CHECK(s.position() == 0);
  CHECK(s.tokens().empty());
  // A shorter context fits; growing it past the budget is refused and changes nothing.
  REQUIRE(s.Eval({prompt.data(), 40}, LogitsMode::kLastRow, &logits).ok());
  const std::vector<float> at40 = logits;
  st = s.Eval({prompt.data() + 40, 24}, LogitsMode::kLastRow, &logits);
  CHECK(st.code() == StatusCode::kOutOfMemory);
  CHECK_THAT(st.message(), Catch::StartsWith("a context of 64 tokens needs "));
  CHECK(s.position() == 40);
  CHECK(s.tokens() == std::vector<int32_t>(prompt.begin(), prompt.begin() + 40));
  REQUIRE(s.Rewind(39).ok());
  REQUIRE(s.Eval({prompt.data() + 39, 1}, LogitsMode::kLastRow, &logits).ok());
  double worst = 0;
  for (size_t j = 0; j < logits.size(); ++j) worst = std::max(worst, double(std::fabs(logits[j] - at40[j])));
  CHECK(worst < 1e-4);
  // bf16 K/V fit in the same budget; the hint names what is left to shrink.
  o.cache.kv = CacheType::kBF16;
  Session small(**engine, o);
  CHECK(small.Eval(prompt, LogitsMode::kLastRow, &logits).ok());
  o.cache = {CacheType::kInt8, CacheType::kBF16};
  o.memory_budget_bytes = 1000;
  st = Session(**engine, o).Eval(prompt, LogitsMode::kLastRow, &logits);
  CHECK_THAT(st.message(), Catch::Contains("(int8 K/V, bf16 index keys); 1000 bytes is the memory budget: use "
                                           "--index-cache int8, or a shorter context"));
  o.cache = {CacheType::kInt8, CacheType::kInt8};
  st = Session(**engine, o).Eval(prompt, LogitsMode::kLastRow, &logits);
  CHECK_THAT(st.message(), Catch::EndsWith("is the memory budget: use a shorter context"));
  // Generate reports it as it is.
  SessionOptions budget;
  budget.memory_budget_bytes = need - 1;
  Session gen(**engine, budget);
  Sampler sampler(SamplingParams{});
  GenerateOptions four;
  four.max_tokens = 4;
  st = Generate(gen, prompt, four, sampler, [](int32_t) { return true; }, nullptr);
  CHECK(st.code() == StatusCode::kOutOfMemory);
  CHECK_THAT(st.message(), Catch::StartsWith("a context of 64 tokens needs "));
  CHECK(gen.position() == 0);
  // Without a budget: the memory this process can get, plus what the caches hold.
  Session detect(**engine);
  CHECK(detect.CheckContextFits(64).ok());
  st = detect.CheckContextFits(size_t{1} << 40);  // petabytes of cache
  CHECK(st.code() == StatusCode::kOutOfMemory);
  CHECK_THAT(st.message(), Catch::Contains(" is available: use --kv-cache bf16 or int8"));
}

// Per golden row (prefill rows, then decode rows with the golden greedy ids fed back): whether the
// argmax is the golden one. Also the free-running greedy ids, as in the golden case.
struct CacheTypeRun {
  size_t rows = 0, argmax_equal = 0;
  std::vector<int32_t> greedy;
};

CacheTypeRun RunWithCaches(const Engine& engine, const std::string& dir, const CacheOptions& caches) {
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  const auto golden_greedy = cj["greedy_ids"].get<std::vector<int32_t>>();
  auto pre = ReadNpy(dir + "/prefill_logits.npy");
  auto dec = ReadNpy(dir + "/decode_logits.npy");
  REQUIRE(pre.ok());
  REQUIRE(dec.ok());
  const size_t vocab = engine.model().config().vocab_size;
  SessionOptions o;
  o.cache = caches;
  CacheTypeRun r;
  auto score = [&](const float* got, const float* want) {
    r.argmax_equal += Argmax(got, vocab) == std::max_element(want, want + vocab) - want;
    ++r.rows;
  };
  Session forced(engine, o), free(engine, o);
  std::vector<float> logits, step;
  REQUIRE(forced.Eval(prompt, LogitsMode::kAllRows, &logits).ok());
  for (size_t t = 0; t < prompt.size(); ++t) score(&logits[t * vocab], &pre->data[t * vocab]);
  for (size_t i = 0; i + 1 < golden_greedy.size(); ++i) {
    REQUIRE(forced.Eval({&golden_greedy[i], 1}, LogitsMode::kLastRow, &step).ok());
    score(step.data(), &dec->data[i * vocab]);
  }
  REQUIRE(free.Eval(prompt, LogitsMode::kLastRow, &step).ok());
  r.greedy.push_back(Argmax(step.data(), vocab));
  while (r.greedy.size() < golden_greedy.size()) {
    REQUIRE(free.Eval({&r.greedy.back(), 1}, LogitsMode::kLastRow, &step).ok());
    r.greedy.push_back(Argmax(step.data(), vocab));
  }
  return r;
}

TEST_CASE("bf16 and int8 caches keep the golden argmax and greedy ids", "[golden][cache]") {
  // The tiny random models have near-ties (argmax margins down to 0.001) and MoE routing that
  // flips with small changes, so the logits' worst error says little; the argmax of every row
  // with the golden ids fed back does. Measured over the five small cases (634 rows; s5 takes
  // seconds): bf16 K/V 630 rows, bf16 index keys 634, both bf16 629; int8 K/V 608, int8 index
  // keys 617, both int8 603. Free-running greedy ids (9 per case) identical with bf16 K/V in all 5
  // cases (both bf16: 4); with int8 in 2-3 (one flip changes the rest of the sequence).
  struct Combo {
    CacheType kv, index_keys;
    double min_argmax;  // fraction of rows
  };
  const Combo combos[] = {{CacheType::kBF16, CacheType::kF32, 0.98},  {CacheType::kF32, CacheType::kBF16, 0.98},
                          {CacheType::kBF16, CacheType::kBF16, 0.98}, {CacheType::kInt8, CacheType::kF32, 0.90},
                          {CacheType::kF32, CacheType::kInt8, 0.90},  {CacheType::kInt8, CacheType::kInt8, 0.90}};
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<std::string> dirs;
  for (const char* name : test::kGoldenCases) {
    if (std::string(name).rfind("s5_", 0) == 0) continue;
    dirs.push_back(test::GoldenDir(name));
    auto engine = Engine::Open(dirs.back(), EngineOptions{2});
    REQUIRE(engine.ok());
    engines.push_back(std::move(engine).value());
  }
  for (const Combo& c : combos) {
    size_t rows = 0, argmax_equal = 0, greedy_identical = 0;
    for (size_t i = 0; i < dirs.size(); ++i) {
      const CacheTypeRun r = RunWithCaches(*engines[i], dirs[i], {c.kv, c.index_keys});
      rows += r.rows;
      argmax_equal += r.argmax_equal;
      greedy_identical +=
          r.greedy == test::ReadPythonJson(dirs[i] + "/case.json")["greedy_ids"].get<std::vector<int32_t>>();
    }
    INFO("kv " << CacheTypeName(c.kv) << ", index keys " << CacheTypeName(c.index_keys) << ": argmax of " << argmax_equal
               << " of " << rows << " rows, greedy ids identical in " << greedy_identical << " of " << dirs.size()
               << " cases");
    CHECK(argmax_equal >= c.min_argmax * rows);
    if (c.kv == CacheType::kBF16 && c.index_keys == CacheType::kF32) CHECK(greedy_identical + 1 >= dirs.size());
  }
}

using test::RelDiff;

// Other prompts to batch the golden one with: its first half, and its ids reversed.
std::vector<std::vector<int32_t>> CompanionPrompts(const std::vector<int32_t>& prompt) {
  return {std::vector<int32_t>(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(prompt.size() / 2 + 1)),
          std::vector<int32_t>(prompt.rbegin(), prompt.rend())};
}

// Three sequences decoded in one batch with `options`: the golden case's logits and greedy ids
// for the first, each sequence's own logits alone for all.
void CheckBatchedDecode(const std::string& name, const std::string& dir, const EngineOptions& options) {
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  const int steps = std::min(cj["decode_steps"].get<int>(), 6);
  const double rel = cj["tolerance"]["logits"]["rel"].get<double>();
  auto engine = Engine::Open(dir, options);
  REQUIRE(engine.ok());
  const size_t vocab = (*engine)->model().config().vocab_size;
  std::vector<std::vector<int32_t>> prompts = {prompt};
  for (auto& p : CompanionPrompts(prompt)) prompts.push_back(std::move(p));
  const size_t B = prompts.size();
  // Each sequence twice: one session decoded in the batch, one alone.
  std::vector<std::unique_ptr<Session>> batched, alone;
  std::vector<int32_t> next(B);
  std::vector<float> logits;
  for (size_t i = 0; i < B; ++i) {
    batched.push_back(std::make_unique<Session>(**engine));
    alone.push_back(std::make_unique<Session>(**engine));
    REQUIRE(batched[i]->Eval(prompts[i], LogitsMode::kLastRow, &logits).ok());
    REQUIRE(alone[i]->Eval(prompts[i], LogitsMode::kLastRow, &logits).ok());
    next[i] = Argmax(logits.data(), vocab);
  }
  std::vector<Session*> sessions;
  for (auto& s : batched) sessions.push_back(s.get());
  std::vector<float> golden_rows, step;
  std::vector<int32_t> greedy = {next[0]};
  double worst_vs_alone = 0;
  for (int k = 0; k < steps; ++k) {
    REQUIRE(Session::DecodeBatch(sessions, next, &logits).ok());
    REQUIRE(logits.size() == B * vocab);
    golden_rows.insert(golden_rows.end(), logits.begin(), logits.begin() + static_cast<std::ptrdiff_t>(vocab));
    for (size_t i = 0; i < B; ++i) {
      REQUIRE(alone[i]->Eval({&next[i], 1}, LogitsMode::kLastRow, &step).ok());
      worst_vs_alone = std::max(worst_vs_alone, RelDiff(&logits[i * vocab], step.data(), vocab));
      next[i] = Argmax(step.data(), vocab);  // both follow the sequence alone
    }
    greedy.push_back(next[0]);
  }
  for (size_t i = 0; i < B; ++i) CHECK(batched[i]->tokens() == alone[i]->tokens());
  auto dec = ReadNpy(dir + "/decode_logits.npy");
  REQUIRE(dec.ok());
  dec->shape[0] = steps;
  dec->data.resize(static_cast<size_t>(steps) * vocab);
  const double golden_ratio = WorstRowRatio(golden_rows, *dec, rel);
  WARN(name << ": batched decode, worst error / golden limit " << golden_ratio
            << "; worst |diff| / (1 + max|logit|) against each sequence alone " << worst_vs_alone);
  CHECK(golden_ratio <= 1.0);
  const auto want_greedy = cj["greedy_ids"].get<std::vector<int32_t>>();
  CHECK(greedy == std::vector<int32_t>(want_greedy.begin(), want_greedy.begin() + steps + 1));
  CHECK(worst_vs_alone < 1e-5);
}

TEST_CASE("batched decode of three sequences matches the golden case and each sequence alone", "[golden][batch]") {
  for (const auto& [name, dir] : GoldenCases()) {
    SECTION(name) { CheckBatchedDecode(name, dir, EngineOptions{2}); }
  }
}

TEST_CASE("batched decode with the dense part offloaded matches the golden case and each sequence alone",
          "[golden][batch][offload]") {
  for (const std::string& device : OffloadDevices())
    for (const auto& [name, dir] : GoldenCases()) {
      SECTION(device + " " + name) {
        // The host device is a scalar reference: its dense attention over a long prompt, run six
        // times here, would take minutes; the golden test above runs that case on it once.
        if (device == "host" && test::ReadPythonJson(dir + "/case.json")["prompt_ids"].size() > 512) {
          WARN("batched decode of " << name << " on the host device skipped: its prompt is long");
        } else {
          CheckBatchedDecode(name, dir, OffloadOptions(device));
        }
      }
    }
}

TEST_CASE("batched decode is bit-identical to decoding alone on every SIMD target", "[golden][batch]") {
  for (const char* name : {"s1_fp32_basic", "s2_bf16_sharded_init1", "s6_fp16_mha_top1_sharded3"}) {
    for (int64_t target : simd::RunnableTargets()) {
      DYNAMIC_SECTION(name << " " << simd::TargetName(target)) {
        simd::ForceTargetForTest(target);
        const std::string dir = test::GoldenDir(name);
        const auto prompt = test::ReadPythonJson(dir + "/case.json")["prompt_ids"].get<std::vector<int32_t>>();
        auto engine = Engine::Open(dir, EngineOptions{2});
        REQUIRE(engine.ok());
        std::vector<std::vector<int32_t>> prompts = {prompt};
        for (auto& p : CompanionPrompts(prompt)) prompts.push_back(std::move(p));
        CHECK(test::BatchedStepsDifferingFromAlone(**engine, prompts, 3) == 0);
        simd::ForceTargetForTest(0);
      }
    }
  }
}

TEST_CASE("a prompt's last layer computes only the rows that give logits, with the same bits", "[golden][offload]") {
  // Without an observer that sees rows, the last layer runs the other rows' keys and values only;
  // with one (SelectionRecorder), every row in full. Logits, caches and the steps after them are
  // the same to the bit, in one pass, in chunks (the earlier ones give no logits) and batched, on
  // the CPU and with the dense part offloaded to the host reference (one layer loop for both). A
  // GPU's matmuls round a row differently with another count of rows (H200, 2026-11-28): there
  // they agree to float rounding.
  struct SeesRows : ForwardObserver {};
  std::vector<std::pair<std::string, EngineOptions>> backends = {{"cpu", EngineOptions{2}}};
  for (const std::string& device : OffloadDevices()) backends.emplace_back(device, OffloadOptions(device));
  for (const auto& [backend, options] : backends) {
    for (const auto& [name, dir] : GoldenCases()) {
      // The host reference device is slow (minutes for every case): two cases hold every kind of
      // layer (dense and sparse attention, dense MLP and MoE) and its trim path is the CPU's.
      if (backend == "host" && name != "s1_fp32_basic" && name != "s3_mxfp8_mixed_layers_local2") continue;
      SECTION(backend + " " + name) {
        auto cj = test::ReadPythonJson(dir + "/case.json");
        const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
        auto engine = Engine::Open(dir, options);
        REQUIRE(engine.ok());
        const bool exact = backend != "cuda";
        auto same = [&](const std::vector<float>& x, const std::vector<float>& y) {
          if (exact) return x == y;
          if (x.size() != y.size()) return false;
          for (size_t i = 0; i < x.size(); ++i)
            if (!(std::fabs(x[i] - y[i]) <= 1e-3f * (1.0f + std::fabs(y[i])))) return false;
          return true;
        };
        const size_t vocab = (*engine)->model().config().vocab_size;
        SessionOptions chunks;
        chunks.prefill_chunk = 7;
        Session trimmed(**engine), full(**engine), trimmed_chunks(**engine, chunks);
        SeesRows sees;
        std::vector<float> a, b, c;
        REQUIRE(trimmed.Eval(prompt, LogitsMode::kLastRow, &a).ok());
        REQUIRE(full.Eval(prompt, LogitsMode::kLastRow, &b, &sees).ok());
        REQUIRE(trimmed_chunks.Eval(prompt, LogitsMode::kLastRow, &c).ok());
        CHECK(same(a, b));
        std::vector<float> full_chunks_logits;
        Session full_chunks(**engine, chunks);
        REQUIRE(full_chunks.Eval(prompt, LogitsMode::kLastRow, &full_chunks_logits, &sees).ok());
        CHECK(same(c, full_chunks_logits));
        int32_t next = Argmax(a.data(), vocab), next_c = Argmax(c.data(), vocab);
        for (int i = 0; i < 3; ++i) {  // the caches behind them are the same too
          REQUIRE(trimmed.Eval({&next, 1}, LogitsMode::kLastRow, &a).ok());
          REQUIRE(full.Eval({&next, 1}, LogitsMode::kLastRow, &b, &sees).ok());
          REQUIRE(trimmed_chunks.Eval({&next_c, 1}, LogitsMode::kLastRow, &c).ok());
          REQUIRE(full_chunks.Eval({&next_c, 1}, LogitsMode::kLastRow, &full_chunks_logits, &sees).ok());
          CHECK(same(a, b));
          CHECK(same(c, full_chunks_logits));
          next = Argmax(a.data(), vocab);
          next_c = Argmax(c.data(), vocab);
        }
        // Batched: two sequences, the last two rows of each.
        const Model& model = (*engine)->model();
        const auto others = CompanionPrompts(prompt);
        std::vector<float> batch_trimmed(4 * vocab), batch_full(4 * vocab);
        for (ForwardObserver* observer : {static_cast<ForwardObserver*>(nullptr), static_cast<ForwardObserver*>(&sees)}) {
          KvCache one(CacheShapeOf(model.config())), two(CacheShapeOf(model.config()));
          Model::Segment segments[] = {{prompt.data(), prompt.size(), &one, 2}, {others[0].data(), others[0].size(), &two, 2}};
          REQUIRE((*engine)
                      ->Forward((*engine)->threads(), segments, LogitsMode::kLastRow,
                                (observer ? batch_full : batch_trimmed).data(), observer)
                      .ok());
        }
        CHECK(same(batch_trimmed, batch_full));
      }
    }
  }
}

TEST_CASE("a forward pass over several prompts gives each prompt's own logits", "[golden][batch]") {
  for (const char* name : {"s1_fp32_basic", "s3_mxfp8_mixed_layers_local2", "s5_realprop_mxfp8_vl"}) {
    SECTION(name) {
      const std::string dir = test::GoldenDir(name);
      auto cj = test::ReadPythonJson(dir + "/case.json");
      const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
      const double rel = cj["tolerance"]["logits"]["rel"].get<double>();
      auto engine = Engine::Open(dir, EngineOptions{2});
      REQUIRE(engine.ok());
      const Model& model = (*engine)->model();
      const size_t vocab = model.config().vocab_size;
      const auto others = CompanionPrompts(prompt);
      // The golden prompt between the two others, all rows' logits.
      const KvCacheShape shape = CacheShapeOf(model.config());
      KvCache a(shape), golden(shape), b(shape);
      const Model::Segment segments[] = {{others[0].data(), others[0].size(), &a},
                                         {prompt.data(), prompt.size(), &golden},
                                         {others[1].data(), others[1].size(), &b}};
      const size_t rows = others[0].size() + prompt.size() + others[1].size();
      std::vector<float> all(rows * vocab);
      REQUIRE(model.ForwardBatch((*engine)->threads(), segments, LogitsMode::kAllRows, all.data()).ok());
      CHECK(a.length() == others[0].size());
      CHECK(golden.length() == prompt.size());
      CHECK(b.length() == others[1].size());
      auto pre = ReadNpy(dir + "/prefill_logits.npy");
      REQUIRE(pre.ok());
      const auto first = all.begin() + static_cast<std::ptrdiff_t>(others[0].size() * vocab);
      const std::vector<float> golden_rows(first, first + static_cast<std::ptrdiff_t>(prompt.size() * vocab));
      CHECK(WorstRowRatio(golden_rows, *pre, rel) <= 1.0);
      // kLastRow: one row per sequence, each as its own pass gives it.
      for (KvCache* c : {&a, &golden, &b}) c->Truncate(0);
      std::vector<float> last(3 * vocab), alone(vocab);
      REQUIRE(model.ForwardBatch((*engine)->threads(), segments, LogitsMode::kLastRow, last.data()).ok());
      for (size_t i = 0; i < 3; ++i) {
        KvCache own(CacheShapeOf(model.config()));
        REQUIRE(model.Forward((*engine)->threads(), segments[i].ids, segments[i].n, &own, LogitsMode::kLastRow,
                              alone.data()).ok());
        CHECK(RelDiff(&last[i * vocab], alone.data(), vocab) < 1e-5);
      }
    }
  }
}

TEST_CASE("a prompt prefilled in chunks beside another generation's decode steps gives the golden greedy ids",
          "[golden][batch]") {
  for (const char* name : {"s3_mxfp8_mixed_layers_local2", "s5_realprop_mxfp8_vl"}) {
    SECTION(name) {
      const std::string dir = test::GoldenDir(name);
      auto cj = test::ReadPythonJson(dir + "/case.json");
      const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
      const auto greedy = cj["greedy_ids"].get<std::vector<int32_t>>();
      auto engine = Engine::Open(dir, EngineOptions{2});
      REQUIRE(engine.ok());
      SamplingParams params;
      params.temperature = 0;
      GenerateOptions options;
      options.max_tokens = static_cast<int>(greedy.size());
      // B decodes from the start; A (the golden prompt) joins it, its prompt in chunks of 37
      // riding along B's decode steps, then both decode together.
      const std::vector<int32_t> other = CompanionPrompts(prompt)[1];
      std::vector<int32_t> got_a, got_b, alone_b;
      Session sa(**engine), sb(**engine), sc(**engine);
      Sampler pa(params), pb(params), pc(params);
      GenerateOptions long_options = options;
      long_options.max_tokens = 4 * options.max_tokens + static_cast<int>(prompt.size() / 37) + 8;
      Generation a(sa, options, pa, [&](int32_t id) { return got_a.push_back(id), true; });
      Generation b(sb, long_options, pb, [&](int32_t id) { return got_b.push_back(id), true; });
      REQUIRE(b.Start(other).ok());
      REQUIRE(a.Begin(prompt).ok());
      REQUIRE(a.pending().size() == prompt.size());
      std::span<const int32_t> next_a, next_b;
      size_t chunks = 0, shared_steps = 0;
      while (!a.done()) {
        std::vector<Generation*> gens;
        std::vector<std::span<const int32_t>> ids;
        if (!a.pending().empty()) {
          gens.push_back(&a);
          ids.push_back(a.pending().first(std::min<size_t>(37, a.pending().size())));
          ++chunks;
        } else if (a.Next(&next_a)) {
          gens.push_back(&a);
          ids.push_back(next_a);
        }
        REQUIRE(b.Next(&next_b));  // B outlasts A
        gens.push_back(&b);
        ids.push_back(next_b);
        shared_steps += gens.size() == 2;
        for (const Status& st : BatchStep(gens, ids)) REQUIRE(st.ok());
      }
      CHECK(chunks == (prompt.size() + 36) / 37);
      CHECK(got_a == greedy);
      CHECK(a.stats().stop_reason == "length");
      CHECK(a.stats().prompt_tokens == prompt.size());
      CHECK(sa.tokens().size() == prompt.size() + greedy.size() - 1);
      // B's tokens so far are the ones it gets alone.
      GenerateOptions b_options = options;
      b_options.max_tokens = static_cast<int>(got_b.size());
      REQUIRE(Generate(sc, other, b_options, pc, [&](int32_t id) { return alone_b.push_back(id), true; }, nullptr).ok());
      CHECK(got_b == alone_b);
      CHECK(shared_steps > chunks);
    }
  }
}

// The scheduler on golden s3 with the real tokenizer (raw turns: every id is text): five requests
// over two slots, prompts in chunks of 16 beside decode steps, with and without prompt lookup, equal to
// each turn generated alone.
TEST_CASE("the scheduler runs queued requests over its slots as each would run alone", "[golden][batch]") {
  const std::string dir = test::GoldenDir("s3_mxfp8_mixed_layers_local2");
  auto cj = test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  auto engine = Engine::Open(dir, EngineOptions{2});
  REQUIRE(engine.ok());
  auto tokenizer = Tokenizer::Load(test::TokenizerDir());
  REQUIRE(tokenizer.ok());
  std::vector<std::vector<int32_t>> prompts = {prompt};
  for (auto& p : CompanionPrompts(prompt)) prompts.push_back(std::move(p));
  prompts.push_back(std::vector<int32_t>(prompt.begin(), prompt.begin() + 5));
  prompts.push_back(std::vector<int32_t>(prompt.begin() + 3, prompt.end()));
  TurnOptions turn;
  turn.raw = true;
  turn.generate.max_tokens = 7;
  SamplingParams params;
  params.temperature = 0;
  SchedulerOptions options;
  options.slots = 2;
  options.session.prefill_chunk = 16;
  // Without prompt lookup, then with it (guesses verified in the batched steps): the same text.
  for (const int max_draft : {0, 3}) {
    INFO("lookup " << max_draft);
    TurnOptions with_lookup = turn;
    with_lookup.generate.lookup = LookupOptions{.max_draft = max_draft, .max_ngram = 3, .min_ngram = 1};
    Scheduler scheduler(**engine, **tokenizer, options);
    std::vector<std::string> streamed(prompts.size()), ended(prompts.size());
    size_t drafted = 0;
    std::vector<size_t> batches(prompts.size()), generated(prompts.size());
    size_t ends = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      ScheduledRequest r;
      r.prompt = prompts[i];
      r.turn = with_lookup;
      r.sampling = params;
      r.on_delta = [&streamed, i](const TurnDelta& d) { return streamed[i] += d.content, true; };
      r.on_end = [&, i](const Status& st, ParsedOutput out, const GenerateStats& stats, size_t largest_batch) {
        CHECK(st.ok());
        ended[i] = out.content;
        batches[i] = largest_batch;
        generated[i] = stats.generated_tokens;
        drafted += stats.drafted_tokens;
        ++ends;
      };
      scheduler.Submit(std::move(r));
    }
    scheduler.RunUntilIdle();
    CHECK(ends == prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      INFO("request " << i);
      Session alone(**engine);
      Sampler sampler(params);
      GenerateStats stats;
      auto want = GenerateTurn(alone, **tokenizer, prompts[i], turn, sampler, [](const TurnDelta&) { return true; },
                               &stats);
      REQUIRE(want.ok());
      CHECK(ended[i] == want->content);
      CHECK(streamed[i] == want->content);
      CHECK(generated[i] == stats.generated_tokens);
      CHECK((batches[i] == 1 || batches[i] == 2));
    }
    CHECK(std::count(batches.begin(), batches.end(), size_t{2}) >= 3);  // the last may run alone
    CHECK((drafted > 0) == (max_draft > 0));
  }
  Scheduler scheduler(**engine, **tokenizer, options);
  // A cancelled request stops at its next step; a prompt past the context limit ends with its error.
  auto cancelled = std::make_shared<std::atomic<bool>>(true);
  Status late_status, long_status;
  std::string stop_reason;
  ScheduledRequest c;
  c.prompt = prompts[0];
  c.turn = turn;
  c.sampling = params;
  c.cancelled = cancelled;
  c.on_end = [&](const Status& st, ParsedOutput, const GenerateStats& stats, size_t) {
    late_status = st;
    stop_reason = stats.stop_reason;
  };
  scheduler.Submit(std::move(c));
  ScheduledRequest too_long;
  too_long.prompt.assign(static_cast<size_t>((*engine)->model().config().max_position_embeddings) + 1, 1);
  too_long.turn = turn;
  too_long.on_end = [&](const Status& st, ParsedOutput, const GenerateStats&, size_t) { long_status = st; };
  scheduler.Submit(std::move(too_long));
  scheduler.RunUntilIdle();
  CHECK(late_status.ok());
  CHECK(stop_reason == "caller");
  CHECK(long_status.code() == StatusCode::kOutOfRange);
}

TEST_CASE("batched decode refuses bad requests and leaves every session as it was", "[golden][batch][errors]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto engine = Engine::Open(dir, EngineOptions{1});
  auto other_engine = Engine::Open(dir, EngineOptions{1});
  REQUIRE(engine.ok());
  REQUIRE(other_engine.ok());
  SessionOptions short_context;
  short_context.max_context = 4;
  Session a(**engine), full(**engine, short_context), foreign(**other_engine);
  std::vector<float> logits;
  for (Session* s : {&a, &full, &foreign}) REQUIRE(s->Eval(std::vector<int32_t>{1, 2, 3, 4}, LogitsMode::kNone, nullptr).ok());
  auto decode = [&](std::vector<Session*> sessions, std::vector<int32_t> ids) {
    return Session::DecodeBatch(sessions, ids, &logits);
  };
  CHECK(decode({}, {}).code() == StatusCode::kInvalidArgument);
  CHECK(decode({&a}, {1, 2}).code() == StatusCode::kInvalidArgument);
  CHECK_THAT(decode({&a, &a}, {1, 2}).message(), Catch::Contains("session 1 is session 0"));
  CHECK_THAT(decode({&a, &foreign}, {1, 2}).message(), Catch::Contains("another engine"));
  const Status at_limit = decode({&a, &full}, {1, 2});
  CHECK(at_limit.code() == StatusCode::kOutOfRange);
  CHECK_THAT(at_limit.message(), Catch::Contains("session 1") && Catch::Contains("context limit of 4"));
  CHECK_THAT(decode({&a}, {100000}).message(), Catch::Contains("outside the vocabulary"));
  // Logit rows: one count per session, each 1..its tokens.
  const std::vector<int32_t> two = {1, 2};
  const std::span<const int32_t> steps[] = {two};
  Session* just_a[] = {&a};
  for (const std::vector<size_t>& rows : {std::vector<size_t>{0}, std::vector<size_t>{3}, std::vector<size_t>{1, 1}}) {
    const Status st = Session::EvalBatch(just_a, steps, &logits, nullptr, rows);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains("logit row"));
  }
  CHECK(a.position() == 4);
  CHECK(full.position() == 4);
  // Still usable, and one sequence's error stays its own in a generation step.
  REQUIRE(decode({&a, &foreign}, {5, 5}).code() == StatusCode::kInvalidArgument);
  REQUIRE(decode({&a}, {5}).ok());
  CHECK(a.position() == 5);
}

TEST_CASE("a generation step over several sequences keeps one sequence's error its own", "[golden][batch][errors]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto engine = Engine::Open(dir, EngineOptions{1});
  REQUIRE(engine.ok());
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  // `tight` may hold no page beyond its prompt's: its step into a new page fails for memory.
  Session roomy(**engine), tight_probe(**engine);
  REQUIRE(tight_probe.Eval(prompt, LogitsMode::kNone, nullptr).ok());
  SessionOptions budget;
  budget.memory_budget_bytes = tight_probe.cache().bytes();
  Session tight(**engine, budget);
  SamplingParams greedy;
  greedy.temperature = 0;
  Sampler greedy_a(greedy), greedy_b(greedy);
  GenerateOptions options;
  options.max_tokens = 64;
  Generation ga(roomy, options, greedy_a, [](int32_t) { return true; });
  Generation gb(tight, options, greedy_b, [](int32_t) { return true; });
  REQUIRE(ga.Start(prompt).ok());
  REQUIRE(gb.Start(prompt).ok());
  Generation* gens[] = {&ga, &gb};
  bool tight_failed = false;
  for (int k = 0; k < 16 && !tight_failed; ++k) {
    std::span<const int32_t> steps[2];
    REQUIRE(ga.Next(&steps[0]));
    REQUIRE(gb.Next(&steps[1]));
    const std::vector<Status> st = BatchStep(gens, steps);
    REQUIRE(st.size() == 2);
    CHECK(st[0].ok());
    if (!st[1].ok()) {
      CHECK(st[1].code() == StatusCode::kOutOfMemory);
      tight_failed = true;
    }
  }
  CHECK(tight_failed);
  CHECK(roomy.position() == tight.position() + 1);
  CHECK(std::equal(tight.tokens().begin(), tight.tokens().end(), roomy.tokens().begin()));
  // The failed token is given again, not sampled anew, and goes through once memory allows.
  const int32_t failed = roomy.tokens()[tight.position()];
  std::span<const int32_t> again;
  REQUIRE(gb.Next(&again));
  REQUIRE(again.size() == 1);
  CHECK(again[0] == failed);
  tight.set_memory_budget(0);
  const std::span<const int32_t> retry[] = {again};
  Generation* just_b[] = {&gb};
  REQUIRE(BatchStep(just_b, retry)[0].ok());
  CHECK(tight.tokens() == roomy.tokens());
  std::span<const int32_t> next;
  REQUIRE(gb.Next(&next));
  CHECK(gb.stats().generated_tokens == static_cast<size_t>(roomy.position() - prompt.size() + 1));
  // Release gives the memory back; the session starts over.
  CHECK(tight.cache().bytes() > 0);
  tight.Release();
  CHECK(tight.cache().bytes() == 0);
  CHECK(tight.position() == 0);
  std::vector<float> logits, fresh;
  REQUIRE(tight.Eval(prompt, LogitsMode::kLastRow, &logits).ok());
  Session other(**engine);
  REQUIRE(other.Eval(prompt, LogitsMode::kLastRow, &fresh).ok());
  CHECK(logits == fresh);
}

TEST_CASE("sessions refuse bad requests with clear errors and stay usable", "[golden][errors]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto engine = Engine::Open(dir, EngineOptions{1});
  REQUIRE(engine.ok());
  SessionOptions o;
  o.max_context = 16;
  Session s(**engine, o);
  std::vector<float> logits;
  Status st = s.Eval(std::vector<int32_t>{1, 2, 512}, LogitsMode::kLastRow, &logits);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Catch::Contains("512"));
  st = s.Eval(std::vector<int32_t>{-1}, LogitsMode::kLastRow, &logits);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(s.Eval(std::vector<int32_t>{}, LogitsMode::kLastRow, &logits).code() == StatusCode::kInvalidArgument);
  st = s.Eval(std::vector<int32_t>(17, 3), LogitsMode::kLastRow, &logits);
  CHECK(st.code() == StatusCode::kOutOfRange);
  CHECK_THAT(st.message(), Catch::Contains("context limit of 16"));
  CHECK(s.position() == 0);
  REQUIRE(s.Eval(std::vector<int32_t>(10, 3), LogitsMode::kLastRow, &logits).ok());
  CHECK(s.Eval(std::vector<int32_t>(7, 3), LogitsMode::kLastRow, &logits).code() == StatusCode::kOutOfRange);
  CHECK(s.Rewind(11).code() == StatusCode::kInvalidArgument);
  REQUIRE(s.Rewind(4).ok());
  CHECK(s.position() == 4);
  CHECK(s.Eval(std::vector<int32_t>(12, 3), LogitsMode::kLastRow, &logits).ok());
  CHECK(Engine::Open(dir, EngineOptions{-1}).status().code() == StatusCode::kInvalidArgument);
}

// Runs generations together, a step of each per BatchStep, until all have ended.
void StepTogether(std::span<Generation* const> all) {
  for (;;) {
    std::vector<Generation*> gens;
    std::vector<std::span<const int32_t>> ids;
    for (Generation* g : all) {
      std::span<const int32_t> step;
      if (!g->pending().empty()) step = g->pending();
      else if (!g->Next(&step)) continue;
      gens.push_back(g);
      ids.push_back(step);
    }
    if (gens.empty()) return;
    for (const Status& st : BatchStep(gens, ids)) REQUIRE(st.ok());
  }
}

TEST_CASE("prompt lookup verifies its guesses and generates the tokens of plain decoding", "[golden][lookup]") {
  size_t drafted = 0, accepted = 0;
  for (const auto& [name, dir] : GoldenCases()) {
    INFO(name);
    {
      auto cj = test::ReadPythonJson(dir + "/case.json");
      const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
      const auto golden = cj["greedy_ids"].get<std::vector<int32_t>>();
      auto engine = Engine::Open(dir, EngineOptions{2});
      REQUIRE(engine.ok());
      GenerateOptions plain_options, lookup_options;
      plain_options.max_tokens = lookup_options.max_tokens = 48;
      lookup_options.lookup = LookupOptions{.max_draft = 4, .max_ngram = 3, .min_ngram = 1};
      for (const float temperature : {0.0f, 0.8f}) {
        INFO("temperature " << temperature);
        SamplingParams sp;
        sp.temperature = temperature;
        sp.seed = 11;
        // Greedy: plain and lookup give the same ids and leave the same cache behind. Sampling:
        // lookup's draws are its own (the same distribution), deterministic for a seed.
        std::vector<int32_t> plain, with, again;
        Session s_plain(**engine), s_with(**engine), s_again(**engine);
        Sampler p0(sp), p1(sp), p2(sp);
        GenerateStats st;
        auto collect = [](std::vector<int32_t>* out) { return [out](int32_t id) { return out->push_back(id), true; }; };
        REQUIRE(Generate(s_plain, prompt, plain_options, p0, collect(&plain), nullptr).ok());
        REQUIRE(Generate(s_with, prompt, lookup_options, p1, collect(&with), &st).ok());
        REQUIRE(Generate(s_again, prompt, lookup_options, p2, collect(&again), nullptr).ok());
        CHECK(with == again);
        CHECK(st.generated_tokens == with.size());
        CHECK(st.accepted_tokens <= st.drafted_tokens);
        CHECK(s_with.tokens().size() == prompt.size() + with.size() - 1);
        CHECK(std::equal(with.begin(), with.end() - 1, s_with.tokens().begin() + static_cast<std::ptrdiff_t>(prompt.size())));
        if (temperature == 0.0f) {
          CHECK(with == plain);
          CHECK(std::equal(golden.begin(), golden.end(), with.begin()));
          CHECK(s_with.tokens() == s_plain.tokens());
          // Rejected guesses left nothing behind: the next pass gives the same logits.
          std::vector<float> a, b;
          REQUIRE(s_plain.Eval({&plain.back(), 1}, LogitsMode::kLastRow, &a).ok());
          REQUIRE(s_with.Eval({&with.back(), 1}, LogitsMode::kLastRow, &b).ok());
          CHECK(a == b);
          drafted += st.drafted_tokens;
          accepted += st.accepted_tokens;
        }
      }
    }
  }
  // Over the cases, guesses were both taken and refused (measured: most of each).
  WARN("greedy prompt lookup over the golden cases: " << accepted << " of " << drafted << " guessed tokens accepted");
  CHECK(accepted > 0);
  CHECK(drafted > accepted);
}

TEST_CASE("prompt lookup in batched steps, stopped early or cancelled keeps each sequence's own tokens",
          "[golden][lookup][batch]") {
  const std::string dir = test::GoldenDir("s3_mxfp8_mixed_layers_local2");
  const auto prompt = test::ReadPythonJson(dir + "/case.json")["prompt_ids"].get<std::vector<int32_t>>();
  auto engine = Engine::Open(dir, EngineOptions{2});
  REQUIRE(engine.ok());
  SamplingParams greedy;
  greedy.temperature = 0;
  GenerateOptions plain, lookup;
  plain.max_tokens = lookup.max_tokens = 40;
  lookup.lookup = LookupOptions{.max_draft = 3, .max_ngram = 3, .min_ngram = 1};
  std::vector<std::vector<int32_t>> prompts = {prompt};
  for (auto& p : CompanionPrompts(prompt)) prompts.push_back(std::move(p));
  // Alone without lookup, then all three with it, stepped together (prompts ride along as chunks).
  std::vector<std::vector<int32_t>> want(prompts.size()), got(prompts.size());
  std::vector<std::unique_ptr<Session>> sessions;
  std::vector<std::unique_ptr<Sampler>> samplers;
  std::vector<std::unique_ptr<Generation>> gens;
  std::vector<Generation*> all;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Session alone(**engine);
    Sampler s(greedy);
    REQUIRE(Generate(alone, prompts[i], plain, s, [&](int32_t id) { return want[i].push_back(id), true; }, nullptr).ok());
    sessions.push_back(std::make_unique<Session>(**engine));
    samplers.push_back(std::make_unique<Sampler>(greedy));
    gens.push_back(std::make_unique<Generation>(*sessions[i], lookup, *samplers[i],
                                                [&got, i](int32_t id) { return got[i].push_back(id), true; }));
    REQUIRE(gens[i]->Begin(prompts[i]).ok());
    all.push_back(gens[i].get());
  }
  StepTogether(all);
  size_t drafted = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    CHECK(got[i] == want[i]);
    drafted += gens[i]->stats().drafted_tokens;
  }
  CHECK(drafted > 0);

  // The caller stops it after 5 tokens: the cache holds the prompt and the first 4, as without lookup.
  std::vector<int32_t> first;
  Session stopped(**engine);
  Sampler s_stop(greedy);
  REQUIRE(Generate(stopped, prompt, lookup, s_stop,
                   [&](int32_t id) { return first.push_back(id), first.size() < 5; }, nullptr)
              .ok());
  CHECK(first == std::vector<int32_t>(want[0].begin(), want[0].begin() + 5));
  CHECK(stopped.position() == prompt.size() + 4);

  // Each step guesses at most one more token than the step before confirmed (what a step
  // confirmed is what its Next emitted, less the token sampled after the last confirmed guess).
  {
    Session s(**engine);
    Sampler sampler(greedy);
    GenerateOptions wide = lookup;
    wide.lookup.max_draft = 4;
    size_t emitted = 0, guessing_steps = 0;
    Generation g(s, wide, sampler, [&](int32_t) { return ++emitted, true; });
    REQUIRE(g.Start(prompt).ok());
    bool previous_guessed = false;
    for (std::span<const int32_t> step; emitted = 0, g.Next(&step);) {
      if (previous_guessed) CHECK(step.size() - 1 <= emitted);
      previous_guessed = step.size() > 1;
      guessing_steps += previous_guessed;
      REQUIRE(g.Step(step).ok());
    }
    CHECK(guessing_steps > 0);
  }

  // Cancelled after a pass over guesses: they were never confirmed, so only the step's sampled
  // token stays in the cache.
  Session s(**engine);
  Sampler sampler(greedy);
  Generation g(s, lookup, sampler, [](int32_t) { return true; });
  REQUIRE(g.Start(prompt).ok());
  bool cancelled = false;
  for (std::span<const int32_t> step; !cancelled && g.Next(&step);) {
    const size_t before = s.position();
    const size_t n = step.size();
    REQUIRE(g.Step(step).ok());
    if (n > 1) {
      g.Cancel();
      CHECK(s.position() == before + 1);
      CHECK(g.stats().stop_reason == "caller");
      cancelled = true;
    }
  }
  CHECK(cancelled);
}

TEST_CASE("a step whose guesses do not fit in memory runs without them", "[golden][lookup][errors]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto engine = Engine::Open(dir, EngineOptions{1});
  REQUIRE(engine.ok());
  auto golden_prompt = test::ReadPythonJson(dir + "/case.json")["prompt_ids"].get<std::vector<int32_t>>();
  const std::vector<int32_t> prompt(golden_prompt.begin(), golden_prompt.end() - 4);
  // A budget of the prompt's cache pages: generation runs until the last page is full.
  Session probe(**engine);
  REQUIRE(probe.Eval(prompt, LogitsMode::kNone, nullptr).ok());
  SessionOptions budget;
  budget.memory_budget_bytes = probe.cache().bytes();
  SamplingParams greedy;
  greedy.temperature = 0;
  GenerateOptions plain, lookup;
  plain.max_tokens = lookup.max_tokens = 200;
  lookup.lookup = LookupOptions{.max_draft = 4, .max_ngram = 3, .min_ngram = 1};
  std::vector<int32_t> want, got;
  Session a(**engine, budget), b(**engine, budget);
  Sampler sa(greedy), sb(greedy);
  const Status plain_status = Generate(a, prompt, plain, sa, [&](int32_t id) { return want.push_back(id), true; }, nullptr);
  Generation g(b, lookup, sb, [&](int32_t id) { return got.push_back(id), true; });
  REQUIRE(g.Start(prompt).ok());
  Status lookup_status;
  size_t ran_alone = 0;  // steps whose guesses did not fit, while the sampled token did
  for (std::span<const int32_t> step; lookup_status.ok() && g.Next(&step);) {
    const size_t before = b.position(), n = step.size();
    lookup_status = g.Step(step);
    ran_alone += lookup_status.ok() && n > 1 && b.position() == before + 1;
  }
  CHECK(plain_status.code() == StatusCode::kOutOfMemory);
  CHECK(lookup_status.code() == StatusCode::kOutOfMemory);
  CHECK(got == want);
  CHECK(b.position() == a.position());
  CHECK(a.position() > prompt.size());
  CHECK(ran_alone > 0);
}

TEST_CASE("prompt lookup guesses what followed the latest match of the longest suffix", "[lookup]") {
  const LookupOptions o{.max_draft = 4, .max_ngram = 3, .min_ngram = 1};
  const std::vector<int32_t> ctx = {1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3, 6, 1, 2};
  // Suffix 1 2 | 3 (next): "1 2 3" occurs at 0 and 4; the latest, at 4, was followed by 4 5 7 2.
  CHECK(LookupDraft(ctx, 3, o, 4) == std::vector<int32_t>{4, 5, 7, 2});
  CHECK(LookupDraft(ctx, 3, o, 2) == std::vector<int32_t>{4, 5});
  CHECK(LookupDraft(ctx, 8, o, 4).empty());  // 8 never occurred
  // n = 1: "7" occurred at 9, followed by 2 3 6 1.
  CHECK(LookupDraft(ctx, 7, o, 4) == std::vector<int32_t>{2, 3, 6, 1});
  LookupOptions bigram = o;
  bigram.min_ngram = 2;
  CHECK(LookupDraft(ctx, 7, bigram, 4).empty());  // "2 7" never occurred
  // A guess stops at the sequence's end; repeats of one token guess more of it.
  CHECK(LookupDraft(std::vector<int32_t>{5, 5, 5}, 5, o, 4) == std::vector<int32_t>{5});
  CHECK(LookupDraft(std::vector<int32_t>{}, 5, o, 4).empty());
  CHECK(LookupDraft(ctx, 3, o, 0).empty());
  // Against the definition, longest n first and then the latest start, on random sequences of few
  // distinct ids (many matches of every length).
  std::mt19937 rng(5);
  for (int trial = 0; trial < 400; ++trial) {
    std::vector<int32_t> seq(1 + rng() % 60);
    for (int32_t& t : seq) t = static_cast<int32_t>(rng() % 4);
    const LookupOptions opt{.max_draft = 5, .max_ngram = 1 + static_cast<int>(rng() % 5),
                            .min_ngram = 1 + static_cast<int>(rng() % 2)};
    const int32_t next = static_cast<int32_t>(rng() % 4);
    std::vector<int32_t> s = seq;
    s.push_back(next);
    const size_t L = s.size();
    std::vector<int32_t> want;
    for (int n = std::min<int>(opt.max_ngram, static_cast<int>(L) - 1); n >= opt.min_ngram && want.empty(); --n)
      for (size_t i = L - static_cast<size_t>(n); i-- > 0;)
        if (std::equal(s.begin() + static_cast<std::ptrdiff_t>(i), s.begin() + static_cast<std::ptrdiff_t>(i) + n,
                       s.end() - n)) {
          for (size_t k = i + static_cast<size_t>(n); k < L && want.size() < 3; ++k) want.push_back(s[k]);
          break;
        }
    INFO("trial " << trial);
    CHECK(LookupDraft(seq, next, opt, 3) == want);
  }
  CHECK(ValidateLookupOptions(LookupOptions{.max_draft = -1}).code() == StatusCode::kInvalidArgument);
  CHECK(ValidateLookupOptions(LookupOptions{.max_draft = kMaxLookupDraft}).ok());
  CHECK_THAT(ValidateLookupOptions(LookupOptions{.max_draft = kMaxLookupDraft + 1}).message(), Catch::Contains("0..32"));
  CHECK(ValidateLookupOptions(LookupOptions{.max_draft = 2, .max_ngram = 1, .min_ngram = 2}).code() ==
        StatusCode::kInvalidArgument);
  CHECK(ValidateLookupOptions(LookupOptions{.max_draft = 2, .max_ngram = 2, .min_ngram = 0}).code() ==
        StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace m3
