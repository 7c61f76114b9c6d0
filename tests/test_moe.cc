// The MoE block: its work split (ForEachShare, ForEachDynamicShare) and MoeForward against the block written out
// token by token with RouteToken and MlpForward, for raw and packed weights, on 1-3 threads.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <span>
#include <thread>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/model.h"
#include "ops/matmul.h"
#include "ops/mlp.h"
#include "ops/moe.h"
#include "ops/workspace.h"
#include "platform/numa.h"
#include "platform/parallel.h"
#include "simd/kernels.h"
#include "packed_weights.h"
#include "test_util.h"
#include "simd/weight_pack.h"

namespace m3 {
namespace {

using test::RandomVec;

// 1-9 jobs of 0-49 units each, a skewed first job every third trial; unit costs from
// min_cost to min_cost + 19. owner[j][u] counts who took unit u of job j.
struct RandomJobs {
  std::vector<size_t> units;
  std::vector<uint64_t> cost;
  std::vector<std::vector<int>> owner;
  RandomJobs(std::mt19937& rng, int trial, uint64_t min_cost) {
    const size_t jobs = 1 + rng() % 9;
    for (size_t j = 0; j < jobs; ++j) {
      units.push_back(rng() % 50);
      cost.push_back(trial % 3 == 0 && j == 0 ? 1000 : min_cost + rng() % 20);
      owner.emplace_back(units.back(), 0);
    }
  }
};

TEST_CASE("ForEachShare gives every unit to exactly one thread, in shares of equal cost", "[moe]") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    RandomJobs jobs_of(rng, trial, 1);
    const auto& units = jobs_of.units;
    const auto& cost = jobs_of.cost;
    auto& owner = jobs_of.owner;
    const size_t jobs = units.size();
    uint64_t total = 0, max_unit = 0;
    for (size_t j = 0; j < jobs; ++j) {
      total += units[j] * cost[j];
      max_unit = std::max(max_unit, cost[j]);
    }
    const int threads = 1 + static_cast<int>(rng() % 8);
    for (int t = 0; t < threads; ++t) {
      uint64_t share = 0;
      ForEachShare(units, cost, t, threads, [&](size_t j, size_t b, size_t e) {
        REQUIRE(b < e);
        REQUIRE(e <= units[j]);
        for (size_t u = b; u < e; ++u) ++owner[j][u];
        share += (e - b) * cost[j];
      });
      // Equal shares up to one unit.
      CHECK(share <= total / static_cast<uint64_t>(threads) + max_unit);
    }
    for (size_t j = 0; j < jobs; ++j)
      for (int c : owner[j]) CHECK(c == 1);
  }
  // The skew case the MoE cares about: one expert with all the work still busies every thread.
  const std::vector<size_t> units{192};
  const std::vector<uint64_t> cost{512};
  for (int t = 0; t < 4; ++t) {
    size_t got = 0;
    ForEachShare(units, cost, t, 4, [&](size_t, size_t b, size_t e) { got += e - b; });
    CHECK(got == 48);
  }
}

TEST_CASE("ForEachDynamicShare gives every unit to exactly one piece", "[moe]") {
  std::mt19937 rng(6);
  for (int trial = 0; trial < 300; ++trial) {
    RandomJobs jobs_of(rng, trial, 0);  // zero-cost jobs too
    const auto& units = jobs_of.units;
    const auto& cost = jobs_of.cost;
    auto& owner = jobs_of.owner;
    const size_t jobs = units.size();
    const int threads = 1 + static_cast<int>(rng() % 8);
    // One caller drains the cursor piece by piece (pieces sized for `threads`): every unit of a
    // job with a cost is in exactly one piece, whichever thread would have taken it.
    std::atomic<uint64_t> cursor{0};
    ForEachDynamicShare(units, cost, threads, cursor, [&](size_t j, size_t b, size_t e) {
      REQUIRE(b < e);
      REQUIRE(e <= units[j]);
      for (size_t u = b; u < e; ++u) ++owner[j][u];
    });
    ForEachDynamicShare(units, cost, threads, cursor, [&](size_t, size_t, size_t) { FAIL("a drained cursor gave work"); });
    for (size_t j = 0; j < jobs; ++j)
      for (size_t u = 0; u < units[j]; ++u) CHECK(owner[j][u] == (cost[j] > 0 ? 1 : 0));
  }
}

TEST_CASE("ForEachDynamicShare split over real threads computes each unit once", "[moe]") {
  const std::vector<size_t> units{192, 384, 5, 0, 192};
  const std::vector<uint64_t> cost{16, 16, 3, 7, 1};
  std::vector<std::vector<std::atomic<int>>> owner;
  for (size_t n : units) owner.emplace_back(n);
  std::atomic<uint64_t> cursor{0};
  ParallelRegion(ThreadConfig{3}, [&](int, int nt, auto) {
    ForEachDynamicShare(units, cost, nt, cursor, [&](size_t j, size_t b, size_t e) {
      for (size_t u = b; u < e; ++u) owner[j][u].fetch_add(1);
    });
  });
  for (const auto& job : owner)
    for (const auto& c : job) CHECK(c.load() == 1);
}

// An MoE layer's weights with storage that outlives the test's use of them.
struct TestMoe {
  test::PackedWeights storage;
  MoeWeights w;

  simd::WeightRef Matrix(simd::WeightFormat f, size_t rows, size_t cols, uint32_t seed, float scale) {
    return storage.Random(f, rows, cols, seed, scale);
  }
  MlpWeights Mlp(simd::WeightFormat f, size_t hidden, size_t inter, uint32_t seed) {
    const float s = 1.0f / std::sqrt(static_cast<float>(hidden));
    return {Matrix(f, inter, hidden, seed, s), Matrix(f, inter, hidden, seed + 1, s),
            Matrix(f, hidden, inter, seed + 2, 1.0f / std::sqrt(static_cast<float>(inter)))};
  }
  TestMoe(simd::WeightFormat expert_format, simd::WeightFormat shared_format, size_t experts, size_t hidden,
          size_t inter, bool shared, uint32_t seed) {
    w.router = Matrix(simd::WeightFormat::kF32, experts, hidden, seed, 1.0f);
    w.router_bias = RandomVec(experts, seed + 7, 0.1f);
    for (size_t e = 0; e < experts; ++e) w.experts.push_back(Mlp(expert_format, hidden, inter, seed + 10 + 3 * e));
    w.has_shared = shared;
    if (shared) w.shared = Mlp(shared_format, hidden, inter + 16, seed + 5);
  }
};

// The block written out one token at a time, with the operators' own building blocks.
std::vector<float> DirectMoe(const MoeWeights& w, const MoeParams& p, const std::vector<float>& x, size_t n,
                             std::vector<int32_t>* ids_out) {
  const size_t H = w.router.cols, E = w.router.rows, k = static_cast<size_t>(p.top_k);
  std::vector<float> out(n * H, 0.0f), logits(E), y(H);
  ids_out->resize(n * k);
  const ThreadConfig one{1};
  for (size_t t = 0; t < n; ++t) {
    const float* xt = x.data() + t * H;
    MatMul(one, w.router, xt, H, 1, logits.data(), E);
    std::vector<float> weights(k);
    RouteToken(logits.data(), w.router_bias, p, ids_out->data() + t * k, weights.data());
    float* o = out.data() + t * H;
    if (w.has_shared) MlpForward(one, w.shared, p.act, xt, 1, o);
    for (size_t s = 0; s < k; ++s) {
      MlpForward(one, w.experts[static_cast<size_t>((*ids_out)[t * k + s])], p.act, xt, 1, y.data());
      simd::Axpy(weights[s], y.data(), o, H);  // y += w * x as the engine rounds it (fma)
    }
  }
  return out;
}

TEST_CASE("MoeForward equals the block written out token by token, for any thread count", "[moe]") {
  using F = simd::WeightFormat;
  struct Case {
    F experts, shared;
    size_t n_exp, hidden, inter;
    int top_k;
    bool has_shared;
  };
  const Case cases[] = {{F::kF32, F::kF32, 6, 40, 24, 2, true},  {F::kQ4, F::kQ8, 8, 128, 64, 3, true},
                        {F::kQ8, F::kQ8, 5, 96, 48, 1, false},   {F::kQ4, F::kQ4, 4, 64, 40, 4, true},
                        {F::kBF16Tiled, F::kF32, 3, 50, 30, 2, true}};
  Workspace session;  // one workspace through every case, as a session's (the kernels' scratch in it)
  for (const Case& c : cases) {
    TestMoe m(c.experts, c.shared, c.n_exp, c.hidden, c.inter, c.has_shared, static_cast<uint32_t>(c.hidden));
    MoeParams p;
    p.top_k = c.top_k;
    p.routed_scaling = 1.5f;
    for (size_t n : {1, 2, 7, 33}) {
      INFO(simd::WeightFormatName(c.experts) << " experts, top-" << c.top_k << ", " << n << " tokens");
      const auto x = RandomVec(n * c.hidden, static_cast<uint32_t>(n + 100));
      std::vector<int32_t> want_ids;
      const std::vector<float> want = DirectMoe(m.w, p, x, n, &want_ids);
      std::vector<float> first;
      for (int threads : {1, 2, 3}) {
        std::vector<float> got(n * c.hidden, -1.0f);
        std::vector<int32_t> ids(n * static_cast<size_t>(c.top_k), -1);
        MoeForward(ThreadConfig{threads}, m.w, p, x.data(), n, got.data(), ids.data());
        CHECK(ids == want_ids);
        // Each token's output does not depend on the other tokens, so the batched block and the
        // token-by-token one agree to rounding of the same operations: exactly, in fact.
        CHECK(got == want);
        if (threads == 1) first = got;
        CHECK(got == first);
        std::fill(got.begin(), got.end(), -1.0f);
        MoeForward(OpContext(ThreadConfig{threads}, nullptr, &session), m.w, p, x.data(), n, got.data(), ids.data());
        CHECK(got == first);
      }
    }
  }
}

TEST_CASE("MoeForward with routed experts of mixed formats (some share the tokens' int8 rows, some not)", "[moe]") {
  using F = simd::WeightFormat;
  // q4 experts share one quantization of the tokens (the shared q8 expert's does not fit them);
  // a q8 expert, an f32 one and a bf16 one each need their own inputs. Every token reaches
  // several formats with top-4 of 6.
  for (F shared : {F::kQ8, F::kQ4}) {
    TestMoe m(F::kQ4, shared, 6, 128, 64, true, 41);
    m.w.experts[1] = m.Mlp(F::kQ8, 128, 64, 501);
    m.w.experts[2] = m.Mlp(F::kF32, 128, 64, 502);
    m.w.experts[4] = m.Mlp(F::kBF16Tiled, 128, 64, 503);
    MoeParams p;
    p.top_k = 4;
    for (size_t n : {1, 5, 24}) {
      INFO(simd::WeightFormatName(shared) << " shared expert, " << n << " tokens");
      const auto x = RandomVec(n * 128, static_cast<uint32_t>(n + 7));
      std::vector<int32_t> want_ids;
      const std::vector<float> want = DirectMoe(m.w, p, x, n, &want_ids);
      for (int threads : {1, 2, 3}) {
        std::vector<float> got(n * 128, -1.0f);
        std::vector<int32_t> ids(n * 4, -1);
        MoeForward(ThreadConfig{threads}, m.w, p, x.data(), n, got.data(), ids.data());
        CHECK(ids == want_ids);
        CHECK(got == want);
      }
    }
  }
}

TEST_CASE("MoeForward with all tokens routed to one expert (skew) is unchanged", "[moe]") {
  TestMoe m(simd::WeightFormat::kQ4, simd::WeightFormat::kQ8, 8, 128, 64, true, 9);
  m.w.router_bias.assign(8, 0.0f);
  m.w.router_bias[5] = 100.0f;  // expert 5 wins every token's first slot
  MoeParams p;
  p.top_k = 2;
  const size_t n = 40;
  const auto x = RandomVec(n * 128, 77);
  std::vector<int32_t> want_ids;
  const std::vector<float> want = DirectMoe(m.w, p, x, n, &want_ids);
  for (int threads : {1, 2, 4}) {
    std::vector<float> got(n * 128);
    std::vector<int32_t> ids(n * 2);
    MoeForward(ThreadConfig{threads}, m.w, p, x.data(), n, got.data(), ids.data());
    for (size_t t = 0; t < n; ++t) CHECK(ids[t * 2] == 5);
    CHECK(got == want);
  }
}

}  // namespace
}  // namespace m3

namespace m3 {
namespace {

TEST_CASE("a NUMA split (simulated nodes) gives the same bits as no split", "[moe][numa]") {
  using F = simd::WeightFormat;
  for (F f : {F::kQ4, F::kQ8, F::kF32, F::kBF16Tiled}) {
    TestMoe m(f, f == F::kQ4 ? F::kQ8 : f, 6, 128, 80, true, 21);
    MoeParams p;
    p.top_k = 2;
    for (int nodes : {2, 3}) {
      const Topology topo = SimulatedTopology({0, 1, 2, 3}, nodes);
      auto split = BuildMoeSplit(topo, nodes, m.w.experts, &m.w.shared);
      REQUIRE(split.ok());
      for (size_t n : {1, 9}) {
        INFO(simd::WeightFormatName(f) << ", " << nodes << " nodes, " << n << " tokens");
        const auto x = RandomVec(n * 128, static_cast<uint32_t>(n));
        std::vector<float> want(n * 128), got(n * 128);
        m.w.split = nullptr;
        MoeForward(ThreadConfig{1}, m.w, p, x.data(), n, want.data());
        m.w.split = split.value();
        for (int threads : {nodes, nodes + 1, 4}) {
          std::fill(got.begin(), got.end(), -1.0f);
          MoeForward(ThreadConfig{threads}, m.w, p, x.data(), n, got.data());
          CHECK(got == want);
        }
        // Fewer threads than nodes: the unsplit weights, still the same bits.
        MoeForward(ThreadConfig{1}, m.w, p, x.data(), n, got.data());
        CHECK(got == want);
      }
      // Every byte of every expert is on exactly one node: the slices add up to the whole.
      size_t rows = 0;
      for (const auto& node : split.value()->slices) rows += node[0].local.gate.rows + node[0].local.down.rows;
      CHECK(rows == m.w.experts[0].gate.rows + m.w.experts[0].down.rows);
    }
  }
}

// The processes of a MoePart as threads of this one: each part's exchange meets the others'
// at a barrier and copies their values.
struct ThreadExchanges {
  explicit ThreadExchanges(int count) : sync(count), own(static_cast<size_t>(count)) {
    for (int i = 0; i < count; ++i) parts.push_back(std::make_unique<Part>(this, i));
  }
  struct Part : MoeExchange {
    Part(ThreadExchanges* all, int index) : all(all), index(index) {}
    Status AllGather(const float* mine, std::span<const size_t> counts, float* out) override {
      return Collect(mine, counts, out, true);
    }
    Status Gather(const float* mine, std::span<const size_t> counts, float* out) override {
      return Collect(mine, counts, out, index == 0);
    }
    Status Collect(const float* mine, std::span<const size_t> counts, float* out, bool receive) {
      all->own[static_cast<size_t>(index)] = mine;
      all->sync.arrive_and_wait();
      if (receive)
        for (size_t q = 0, at = 0; q < counts.size(); at += counts[q++])
          std::copy_n(all->own[q], counts[q], out + at);
      all->sync.arrive_and_wait();
      return Status::Ok();
    }
    ThreadExchanges* all;
    int index;
  };
  std::barrier<> sync;
  std::vector<const float*> own;
  std::vector<std::unique_ptr<Part>> parts;
};

TEST_CASE("a MoE block shared out over processes (MoePart) gives process 0 the same bits as one process", "[moe][dist]") {
  using F = simd::WeightFormat;
  struct Shape {
    F f;
    size_t hidden, inter;
  };
  // Partial last tiles (72 = 4.5 tiles, 40 = 2.5) and more processes than some matrices have tiles.
  for (const Shape& sh : {Shape{F::kQ4, 128, 80}, Shape{F::kQ8, 128, 80}, Shape{F::kBF16Tiled, 128, 80},
                          Shape{F::kF32, 72, 40}, Shape{F::kF32, 40, 24}}) {
    for (bool shared : {true, false}) {
      TestMoe m(sh.f, sh.f == F::kQ4 ? F::kQ8 : sh.f, 6, sh.hidden, sh.inter, shared, 31);
      MoeParams p;
      p.top_k = 2;
      for (size_t n : {1, 7}) {
        const auto x = RandomVec(n * sh.hidden, static_cast<uint32_t>(n + 3));
        std::vector<float> want(n * sh.hidden);
        std::vector<int32_t> ids(n * 2);
        std::vector<float> weights(n * 2);
        MoeForward(ThreadConfig{2}, m.w, p, x.data(), n, want.data());
        MoeRoute(ThreadConfig{1}, m.w, p, x.data(), n, ids.data(), weights.data());
        for (int count : {2, 3, 4}) {
          INFO(simd::WeightFormatName(sh.f) << " H " << sh.hidden << (shared ? " with" : " without")
                                            << " a shared expert, " << count << " processes, " << n << " tokens");
          ThreadExchanges ex(count);
          std::vector<MoeWeights> parts;
          for (int i = 0; i < count; ++i) parts.push_back(MoePartOf(m.w, MoePart{i, count}));
          std::vector<std::vector<float>> out(static_cast<size_t>(count), std::vector<float>(n * sh.hidden, -1.0f));
          std::vector<Status> status(static_cast<size_t>(count));
          std::vector<std::thread> threads;
          for (int i = 0; i < count; ++i)
            threads.emplace_back([&, i] {
              const auto u = static_cast<size_t>(i);
              status[u] = MoePartForward(ThreadConfig{1 + i % 2}, parts[u], p, x.data(), n, ids.data(), weights.data(),
                                         *ex.parts[u], out[u].data());
            });
          for (std::thread& t : threads) t.join();
          for (const Status& st : status) CHECK(st.ok());
          CHECK(out[0] == want);
          // The slices add up to the whole expert: each row of gate and down on one process.
          size_t rows = 0;
          for (const MoeWeights& w : parts) rows += w.experts[0].gate.rows + w.experts[0].down.rows;
          CHECK(rows == sh.hidden + sh.inter);
        }
      }
    }
  }
}

// Expert parallelism within this process: part 0's passes give their MoE blocks to this runner
// (OpContext::moe_runner), which computes every other part's slices on a thread of its own, as the
// follower ranks do over MPI (lib/cluster).
class ThreadPartsRunner : public MoeRunner {
 public:
  explicit ThreadPartsRunner(std::vector<const Model*> parts) : parts_(std::move(parts)) {}
  Status Run(const OpContext& tc, int layer, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
             float* out, int32_t* routed_ids) const override {
    const size_t k = static_cast<size_t>(p.top_k), hidden = w.router.cols;
    std::vector<int32_t> ids(n * k);
    std::vector<float> weights(n * k);
    MoeRoute(tc, w, p, x, n, ids.data(), weights.data());
    if (routed_ids) std::copy(ids.begin(), ids.end(), routed_ids);
    ThreadExchanges ex(static_cast<int>(parts_.size()));
    std::vector<Status> status(parts_.size());
    std::vector<std::vector<float>> others(parts_.size(), std::vector<float>(n * hidden));
    std::vector<std::thread> threads;
    for (size_t i = 1; i < parts_.size(); ++i)
      threads.emplace_back([&, i] {
        status[i] = MoePartForward(ThreadConfig{1}, *parts_[i]->MoeOfLayer(layer), p, x, n, ids.data(), weights.data(),
                                   *ex.parts[i], others[i].data());
      });
    status[0] = MoePartForward(tc, w, p, x, n, ids.data(), weights.data(), *ex.parts[0], out);
    for (std::thread& t : threads) t.join();
    for (const Status& st : status) M3_RETURN_IF_ERROR(st);
    return Status::Ok();
  }

 private:
  std::vector<const Model*> parts_;
};

TEST_CASE("models loaded in expert parts, their MoE blocks run by the pass's MoeRunner, give one model's logits",
          "[moe][dist]") {
  for (const char* name : test::kGoldenCases) {
    const std::string dir = test::GoldenDir(name);
    auto cj = test::ReadPythonJson(dir + "/case.json");
    const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
    auto whole = Model::Load(dir);
    REQUIRE(whole.ok());
    const size_t vocab = static_cast<size_t>((*whole)->config().vocab_size);
    std::vector<float> want(prompt.size() * vocab);
    KvCache want_cache(CacheShapeOf((*whole)->config()));
    REQUIRE((*whole)
                ->Forward(ThreadConfig{2}, prompt.data(), prompt.size(), &want_cache, LogitsMode::kAllRows, want.data())
                .ok());
    for (int count : {2, 3}) {
      INFO(name << ", " << count << " parts");
      std::vector<std::unique_ptr<Model>> parts;
      std::vector<const Model*> views;
      std::vector<size_t> rows((*whole)->config().num_layers, 0);  // of every part's first expert
      for (int i = 0; i < count; ++i) {
        auto part = Model::Load(dir, ModelLoadOptions{.expert_part = MoePart{i, count}});
        REQUIRE(part.ok());
        for (int l = 0; l < (*part)->config().num_layers; ++l)
          if (const MoeWeights* w = (*part)->MoeOfLayer(l)) {
            CHECK(w->part.index == i);
            CHECK(w->part.count == count);
            rows[static_cast<size_t>(l)] += w->experts[0].gate.rows + w->experts[0].down.rows;
          }
        views.push_back(part->get());
        parts.push_back(std::move(part).value());
      }
      // Each part holds its rows alone: together the whole experts.
      for (int l = 0; l < (*whole)->config().num_layers; ++l)
        if (const MoeWeights* w = (*whole)->MoeOfLayer(l))
          CHECK(rows[static_cast<size_t>(l)] == w->experts[0].gate.rows + w->experts[0].down.rows);
      const ThreadPartsRunner runner(views);
      OpContext tc(ThreadConfig{2});
      tc.moe_runner = &runner;
      std::vector<float> got(prompt.size() * vocab);
      KvCache cache(CacheShapeOf(parts[0]->config()));
      REQUIRE(parts[0]->Forward(tc, prompt.data(), prompt.size(), &cache, LogitsMode::kAllRows, got.data()).ok());
      CHECK(got == want);
    }
  }
  CHECK_FALSE(Model::Load(test::GoldenDir(test::kGoldenCases[0]), ModelLoadOptions{.expert_part = MoePart{2, 2}}).ok());
}

TEST_CASE("NUMA modes parse, and threads map to nodes in contiguous blocks", "[moe][numa]") {
  CHECK(ParseNumaMode("off").value() == NumaMode::kOff);
  CHECK(ParseNumaMode("distribute").value() == NumaMode::kDistribute);
  CHECK(ParseNumaMode("split").value() == NumaMode::kSplit);
  CHECK(!ParseNumaMode("interleave").ok());
  for (int threads = 1; threads <= 9; ++threads)
    for (int nodes = 1; nodes <= threads; ++nodes) {
      std::vector<int> count(static_cast<size_t>(nodes), 0);
      int last = 0;
      for (int t = 0; t < threads; ++t) {
        const int node = NodeOfThread(t, threads, nodes);
        REQUIRE(node >= last);
        REQUIRE(node < nodes);
        last = node;
        ++count[static_cast<size_t>(node)];
      }
      for (int c : count) CHECK(c >= threads / nodes);
    }
}

}  // namespace
}  // namespace m3

namespace m3 {
namespace {

TEST_CASE("split expert slices live on their nodes (real multi-node machines)", "[moe][numa]") {
  const Topology topo = DetectHardwareTopology();
  TestMoe m(simd::WeightFormat::kQ4, simd::WeightFormat::kQ8, 4, 128, 64, true, 3);
  const int nodes = static_cast<int>(topo.nodes.size());
  auto split = BuildMoeSplit(topo, nodes, m.w.experts, &m.w.shared);
  REQUIRE(split.ok());
  REQUIRE(split.value()->memory->size() == static_cast<size_t>(nodes));
  if (!topo.binds_memory()) {
    WARN("single NUMA node: page placement of split slices not checkable here");
    return;
  }
  for (int n = 0; n < nodes; ++n) {
    const NodeBuffer& buf = (*split.value()->memory)[static_cast<size_t>(n)];
    auto pages = PageNodes(buf.data(), buf.size());
    REQUIRE(pages.ok());
    for (int node : pages.value()) CHECK(node == topo.nodes[static_cast<size_t>(n)].id);
  }
}

}  // namespace
}  // namespace m3
