// The shared prefix cache (runtime/prefix_cache.h, issue 36): pages of a common prompt prefix
// adopted copy-on-write by other sessions give BIT-IDENTICAL logits and tokens to a fresh prefill
// of the same prompt, on every golden checkpoint and cache storage type; copy-on-write after a
// truncation into a shared page; eviction (a store entry evicted while a session uses its pages);
// every page freed at the end; scored prompts never reuse; the scheduler with many slots, a small
// cache budget, and an offloading engine (where sharing is off).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ops/sampling.h"
#include "runtime/chat.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "runtime/prefix_cache.h"
#include "runtime/scheduler.h"
#include "test_util.h"

namespace m3 {
namespace {

using ojson = nlohmann::ordered_json;

std::unique_ptr<Engine> OpenEngine(const std::string& dir, EngineOptions o = {}) {
  if (!o.threads) o.threads = 2;
  auto e = Engine::Open(dir, o);
  INFO(dir << ": " << e.status().ToString());
  REQUIRE(e.ok());
  return std::move(e).value();
}

bool SameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

int32_t Argmax(std::span<const float> x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

// Greedy decode of `steps` tokens after the session's last logits row `last`: the logits of each.
std::vector<float> Decode(Session& s, std::span<const float> last, size_t vocab, int steps) {
  std::vector<float> all, step(last.begin(), last.end());
  for (int i = 0; i < steps; ++i) {
    const int32_t id = Argmax(std::span<const float>(step).last(vocab));
    REQUIRE(s.Eval({&id, 1}, LogitsMode::kLastRow, &step).ok());
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

// A prompt that shares `prompt`'s first `common` tokens and then differs.
std::vector<int32_t> OtherTail(const std::vector<int32_t>& prompt, size_t common, int32_t vocab) {
  std::vector<int32_t> other(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(common));
  for (size_t i = common; i < prompt.size(); ++i) other.push_back((prompt[i] * 7 + 13 + static_cast<int32_t>(i)) % vocab);
  if (other[common] == prompt[common]) other[common] = (other[common] + 1) % vocab;
  return other;
}

std::vector<float> FreshAllRows(const Engine& engine, const SessionOptions& so, const std::vector<int32_t>& prompt,
                                Session* session) {
  std::vector<float> logits;
  REQUIRE(session->Eval(prompt, LogitsMode::kAllRows, &logits).ok());
  (void)engine;
  (void)so;
  return logits;
}

const char* TypeName(CacheType t) { return t == CacheType::kF32 ? "f32" : t == CacheType::kBF16 ? "bf16" : "int8"; }

}  // namespace

TEST_CASE("prefix cache: adopted pages give bit-identical logits on every golden case and cache type, COW after "
          "truncation, eviction while in use",
          "[prefix_cache]") {
  for (const auto& [name, dir] : test::GoldenCases()) {
    const auto cj = test::ReadPythonJson(dir + "/case.json");
    std::vector<int32_t> prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
    if (prompt.size() > 256) prompt.resize(256);
    auto engine = OpenEngine(dir);
    const auto vocab = static_cast<size_t>(engine->model().config().vocab_size);
    for (CacheType type : {CacheType::kF32, CacheType::kBF16, CacheType::kInt8}) {
      INFO(name << ", " << TypeName(type) << " caches");
      SessionOptions so;
      so.cache = {type, type};
      Session probe(*engine, so);
      const size_t page = probe.cache().page_rows();
      PrefixCache store(page, so.cache);
      // A: the whole prompt, published.
      Session a(*engine, so);
      REQUIRE(a.set_prefix_cache(&store).ok());
      std::vector<float> la;
      REQUIRE(a.Eval(prompt, LogitsMode::kLastRow, &la).ok());
      a.PublishPrefix(a.position());
      CHECK(store.stats().pages == prompt.size() / page);
      // B: the first 2/3 and another tail; adopts the stored whole pages of the common part.
      const size_t common = prompt.size() * 2 / 3;
      const std::vector<int32_t> other = OtherTail(prompt, common, static_cast<int32_t>(vocab));
      Session b(*engine, so);
      REQUIRE(b.set_prefix_cache(&store).ok());
      const size_t kept = b.ReusePrefix(other);
      REQUIRE(kept == common / page * page);
      REQUIRE(kept >= page);
      CHECK(store.stats().hits == 1);
      CHECK(store.stats().hit_tokens == kept);
      std::vector<float> lb;
      REQUIRE(b.Eval(std::span<const int32_t>(other).subspan(kept), LogitsMode::kAllRows, &lb).ok());
      Session fresh(*engine, so);
      const std::vector<float> lf = FreshAllRows(*engine, so, other, &fresh);
      CHECK(SameBits(lb, std::span<const float>(lf).subspan(kept * vocab)));
      // Decoding on: the same logits, step by step.
      CHECK(SameBits(Decode(b, lb, vocab, 3), Decode(fresh, lf, vocab, 3)));

      // Copy-on-write: B rewinds into its last adopted page (shared with A and the store) and
      // writes there; A's page and the store's stay as they were.
      const size_t back = kept - page / 2;
      REQUIRE(b.Rewind(back).ok());
      CHECK(b.cache().CopyBytesFor(back + 1) > 0);
      std::vector<float> lb2;
      REQUIRE(b.Eval(std::span<const int32_t>(other).subspan(back), LogitsMode::kAllRows, &lb2).ok());
      CHECK(SameBits(lb2, std::span<const float>(lf).subspan(back * vocab)));
      CHECK(b.cache().CopyBytesFor(b.position()) == 0);
      std::vector<float> la2;
      REQUIRE(a.Eval(std::span<const int32_t>(other).subspan(prompt.size() - 1, 1), LogitsMode::kLastRow, &la2).ok());
      Session a_fresh(*engine, so);
      std::vector<int32_t> a_next = prompt;
      a_next.push_back(other[prompt.size() - 1]);
      std::vector<float> la_fresh;
      REQUIRE(a_fresh.Eval(a_next, LogitsMode::kLastRow, &la_fresh).ok());
      CHECK(SameBits(la2, la_fresh));

      // C adopts after B's copy-on-write: the store's pages are intact.
      Session c(*engine, so);
      REQUIRE(c.set_prefix_cache(&store).ok());
      REQUIRE(c.ReusePrefix(other) == kept);
      std::vector<float> lc;
      REQUIRE(c.Eval(std::span<const int32_t>(other).subspan(kept), LogitsMode::kAllRows, &lc).ok());
      CHECK(SameBits(lc, std::span<const float>(lf).subspan(kept * vocab)));

      // Every entry evicted while A and C use its pages: their references keep them alive.
      store.Clear();
      CHECK(store.stats().bytes == 0);
      CHECK(store.stats().pages == 0);
      CHECK(SameBits(Decode(c, lc, vocab, 3), Decode(b, lb2, vocab, 3)));
      // Every page freed once nothing holds it (the account counts each page once).
      CHECK(store.account()->bytes.load() > 0);
      a.Release();
      b.Release();
      c.Release();
      CHECK(store.account()->bytes.load() == 0);
    }
  }
}

TEST_CASE("prefix cache: a scored prompt (prompt logprobs) never reuses a prefix", "[prefix_cache]") {
  const auto cases = test::GoldenCases();
  auto engine = OpenEngine(cases.front().second);
  const auto cj = test::ReadPythonJson(cases.front().second + "/case.json");
  const auto prompt = cj["prompt_ids"].get<std::vector<int32_t>>();
  Session probe(*engine);
  PrefixCache store(probe.cache().page_rows(), {});
  Session a(*engine), b(*engine);
  REQUIRE(a.set_prefix_cache(&store).ok());
  REQUIRE(b.set_prefix_cache(&store).ok());
  REQUIRE(a.Eval(prompt, LogitsMode::kNone, nullptr).ok());
  a.PublishPrefix(a.position());
  REQUIRE(store.stats().pages > 0);
  Sampler sampler(SamplingParams{});
  GenerateOptions go;
  go.max_tokens = 1;
  Generation g(b, go, sampler, [](int32_t) { return true; });
  size_t rows = 0;
  g.ScorePrompt([&](size_t, int32_t, std::span<const float>) { ++rows; });
  REQUIRE(g.Begin(prompt).ok());
  CHECK(g.stats().reused_tokens == 0);
  CHECK(g.pending().size() == prompt.size());
  CHECK(store.stats().lookups == 0);
  REQUIRE(g.Step(g.pending()).ok());
  CHECK(rows == prompt.size() - 1);
}

TEST_CASE("prefix cache: a session refuses a store of other pages, and an offloading engine shares nothing",
          "[prefix_cache]") {
  const std::string dir = test::GoldenDir("s1_fp32_basic");
  auto engine = OpenEngine(dir);
  Session s(*engine);
  PrefixCache other_rows(s.cache().page_rows() * 2, {});
  CHECK(s.set_prefix_cache(&other_rows).code() == StatusCode::kInvalidArgument);
  PrefixCache other_type(s.cache().page_rows(), {CacheType::kInt8, CacheType::kF32});
  CHECK(s.set_prefix_cache(&other_type).code() == StatusCode::kInvalidArgument);
  PrefixCache fine(s.cache().page_rows(), {});
  REQUIRE(s.Eval(std::vector<int32_t>{1, 2, 3}, LogitsMode::kNone, nullptr).ok());
  CHECK(s.set_prefix_cache(&fine).code() == StatusCode::kInvalidArgument);  // too late: it holds positions

  // --gpu dense (on the host reference device): the rows live in the device's cache, the host
  // pages are never written, so the scheduler keeps no store and nothing is looked up.
  EngineOptions o;
  o.gpu = "dense";
  o.gpu_device = "host";
  auto offloading = OpenEngine(dir, o);
  Session d(*offloading);
  CHECK(d.set_prefix_cache(&fine).code() == StatusCode::kUnsupported);
}

}  // namespace m3

// ---- The scheduler of `m3 serve` / `m3 batch` on the tiny model with the real vocabulary. ----
namespace {

using m3::ojson;

using m3::test::RealVocabModel;

struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool ended = false;
  m3::Status status;
  std::string text;
  m3::GenerateStats stats;
  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return ended; });
  }
};

m3::ScheduledRequest Request(std::vector<int32_t> prompt, int max_tokens, Outcome* out) {
  m3::ScheduledRequest r;
  r.prompt = std::move(prompt);
  r.turn.raw = true;
  r.turn.generate.max_tokens = max_tokens;
  r.sampling.temperature = 0.0f;
  r.on_end = [out](const m3::Status& st, m3::ParsedOutput parsed, const m3::GenerateStats& stats, size_t) {
    {
      std::lock_guard<std::mutex> lock(out->mu);
      out->status = st;
      out->text = parsed.content;
      out->stats = stats;
      out->ended = true;
    }
    out->cv.notify_all();
  };
  return r;
}

struct Fixture {
  std::unique_ptr<m3::Engine> engine;
  std::unique_ptr<m3::ChatText> text;
  Fixture() {
    m3::EngineOptions o;
    o.threads = 2;
    auto e = m3::Engine::Open(RealVocabModel(), o);
    REQUIRE(e.ok());
    engine = std::move(e).value();
    auto t = m3::ChatText::Load(RealVocabModel(), /*require_template=*/true);
    REQUIRE(t.ok());
    text = std::move(t).value();
  }
  std::unique_ptr<m3::Scheduler> NewScheduler(size_t slots, bool share, uint64_t budget = 0) const {
    m3::SchedulerOptions o;
    o.slots = slots;
    o.prefix_cache = share;
    o.cache_budget = budget;
    return std::make_unique<m3::Scheduler>(*engine, text->tokenizer(), o);
  }
  // A conversation: a long system prompt (`system` repeated), then `user`.
  std::vector<int32_t> Prompt(const std::string& system, int repeats, const std::string& user) const {
    std::string sys;
    for (int i = 0; i < repeats; ++i) sys += system + " (rule " + std::to_string(i) + ")\n";
    m3::TurnOptions turn;
    auto ids = text->TurnPrompt(ojson::array({{{"role", "system"}, {"content", sys}}, {{"role", "user"}, {"content", user}}}),
                                nullptr, nullptr, &turn);
    REQUIRE(ids.ok());
    return *ids;
  }
  struct Result {
    std::string text;
    m3::GenerateStats stats;
  };
  // Runs each prompt alone in a scheduler of its own, without sharing: the reference.
  Result Fresh(const std::vector<int32_t>& prompt, int max_tokens) const {
    auto s = NewScheduler(1, false);
    Outcome o;
    s->Submit(Request(prompt, max_tokens, &o));
    s->RunUntilIdle();
    REQUIRE(o.ended);
    REQUIRE(o.status.ok());
    return {o.text, o.stats};
  }
};

size_t Common(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return static_cast<size_t>(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin());
}

}  // namespace

TEST_CASE("scheduler: a second conversation with the same system prompt adopts its pages, same output", "[prefix_cache]") {
  Fixture f;
  const auto a = f.Prompt("You are a careful assistant; answer briefly and cite the tool you used.", 30, "What is 2+2?");
  const auto b = f.Prompt("You are a careful assistant; answer briefly and cite the tool you used.", 30,
                          "Name a prime number larger than ten.");
  const size_t page = f.engine->model().config().sparse.block_size;
  const size_t common = Common(a, b);
  REQUIRE(common > 300);
  auto s = f.NewScheduler(2, true);
  Outcome oa, ob;
  s->Submit(Request(a, 8, &oa));
  s->RunUntilIdle();
  s->Submit(Request(b, 8, &ob));
  s->RunUntilIdle();
  REQUIRE(oa.status.ok());
  REQUIRE(ob.status.ok());
  CHECK(oa.stats.reused_tokens == 0);
  CHECK(ob.stats.reused_tokens >= common / page * page);
  const m3::PrefixCacheStats st = s->prefix_stats();
  CHECK(st.lookups == 2);
  CHECK(st.hits == 1);
  CHECK(st.hit_tokens == ob.stats.reused_tokens);
  CHECK(st.bytes > 0);
  const Fixture::Result fa = f.Fresh(a, 8), fb = f.Fresh(b, 8);
  CHECK(oa.text == fa.text);
  CHECK(ob.text == fb.text);
  CHECK(ob.stats.generated_tokens == fb.stats.generated_tokens);
  CHECK(fb.stats.reused_tokens == 0);
}

TEST_CASE("scheduler: many slots adopt one stored prefix at once, each reply as if alone", "[prefix_cache]") {
  Fixture f;
  const std::string sys = "Tools: search(query), fetch(url), calc(expr). Use them when needed.";
  const size_t page = f.engine->model().config().sparse.block_size;
  auto s = f.NewScheduler(4, true);
  Outcome warm;
  s->Submit(Request(f.Prompt(sys, 20, "warm up"), 2, &warm));
  s->RunUntilIdle();
  REQUIRE(warm.status.ok());
  const char* users[] = {"one", "two two", "three three three", "four", "five", "six six", "seven", "eight"};
  std::vector<std::vector<int32_t>> prompts;
  for (const char* u : users) prompts.push_back(f.Prompt(sys, 20, u));
  std::vector<Outcome> outs(prompts.size());
  s->Start();
  for (size_t i = 0; i < prompts.size(); ++i) s->Submit(Request(prompts[i], 6, &outs[i]));
  for (Outcome& o : outs) o.Wait();
  s->Stop();
  const auto warm_prompt = f.Prompt(sys, 20, "warm up");
  for (size_t i = 0; i < prompts.size(); ++i) {
    INFO("request " << i);
    REQUIRE(outs[i].status.ok());
    CHECK(outs[i].stats.reused_tokens >= Common(warm_prompt, prompts[i]) / page * page);
    const Fixture::Result fresh = f.Fresh(prompts[i], 6);
    CHECK(outs[i].text == fresh.text);
  }
  // The three unused slots adopt from the store; the slot of the warm-up, and the later requests
  // on slots of the same system prompt, keep it from their own caches.
  CHECK(s->prefix_stats().hits >= 3);
}

TEST_CASE("scheduler: under a small cache budget the store's pages are evicted first, replies unchanged",
          "[prefix_cache]") {
  Fixture f;
  const auto a = f.Prompt("Alpha rules: be terse and precise.", 25, "Say hi.");
  const auto b = f.Prompt("Beta guide: write long friendly answers with examples.", 25, "Say hello.");
  REQUIRE(Common(a, b) < a.size() / 2);  // the template's preamble alone
  const size_t longest = std::max(a.size(), b.size()) + 8;
  const uint64_t one_context = m3::Session(*f.engine).cache().BytesFor(longest);
  // Room for one conversation and a bit: B's pages need what A's (held by the store alone once
  // the slot moves on) hold.
  auto s = f.NewScheduler(1, true, one_context + one_context / 4);
  std::vector<std::string> notes;
  Outcome oa, ob, oa2;
  s->Submit(Request(a, 6, &oa));
  s->RunUntilIdle();
  REQUIRE(oa.status.ok());
  const uint64_t stored = s->prefix_stats().bytes;
  CHECK(stored > 0);
  s->Submit(Request(b, 6, &ob));
  s->RunUntilIdle();
  REQUIRE(ob.status.ok());
  CHECK(s->prefix_stats().evicted > 0);
  CHECK(ob.text == f.Fresh(b, 6).text);
  s->Submit(Request(a, 6, &oa2));
  s->RunUntilIdle();
  REQUIRE(oa2.status.ok());
  CHECK(oa2.text == oa.text);
}

TEST_CASE("scheduler: without a budget the store keeps what its limit allows of pages no slot holds",
          "[prefix_cache]") {
  Fixture f;
  const auto a = f.Prompt("Alpha rules: be terse and precise.", 25, "Say hi.");
  const auto b = f.Prompt("Beta guide: write long friendly answers with examples.", 25, "Say hello.");
  m3::SchedulerOptions o;
  o.slots = 1;
  o.prefix_cache_limit = 1;  // nothing the slot has let go of
  m3::Scheduler s(*f.engine, f.text->tokenizer(), o);
  Outcome oa, ob;
  s.Submit(Request(a, 4, &oa));
  s.RunUntilIdle();
  const m3::PrefixCacheStats after_a = s.prefix_stats();
  CHECK(after_a.evicted == 0);  // the slot holds every page
  CHECK(after_a.bytes > 0);
  s.Submit(Request(b, 4, &ob));
  s.RunUntilIdle();
  REQUIRE(oa.status.ok());
  REQUIRE(ob.status.ok());
  const m3::PrefixCacheStats after_b = s.prefix_stats();
  CHECK(after_b.evicted > 0);  // A's own pages, once the slot moved on to B
  const size_t page = f.engine->model().config().sparse.block_size;
  CHECK(after_b.pages == b.size() / page);  // B's pages, all held by the slot too
  CHECK(ob.text == f.Fresh(b, 4).text);
}

TEST_CASE("scheduler: an offloading engine keeps no prefix store", "[prefix_cache]") {
  m3::EngineOptions o;
  o.threads = 2;
  o.gpu = "dense";
  o.gpu_device = "host";
  auto e = m3::Engine::Open(RealVocabModel(), o);
  REQUIRE(e.ok());
  auto t = m3::ChatText::Load(RealVocabModel(), true);
  REQUIRE(t.ok());
  m3::SchedulerOptions so;
  so.slots = 2;
  m3::Scheduler s(**e, (*t)->tokenizer(), so);
  Outcome oa, ob;
  std::vector<int32_t> p(200);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<int32_t>(1000 + i);
  std::vector<int32_t> q = p;
  q[100] = 7;  // not a continuation of p: the other slot
  s.Submit(Request(p, 3, &oa));
  s.RunUntilIdle();
  s.Submit(Request(q, 3, &ob));
  s.RunUntilIdle();
  REQUIRE(oa.status.ok());
  REQUIRE(ob.status.ok());
  CHECK(ob.stats.reused_tokens == 0);  // another slot, and no store
  CHECK(s.prefix_stats().lookups == 0);
}
