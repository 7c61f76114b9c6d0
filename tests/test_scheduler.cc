// The scheduler of `m3 serve` and `m3 batch` from several threads (issue 35; CI also runs this
// under ThreadSanitizer): concurrent submits, cancellation of queued and generating requests,
// the drain of a stopping server, the cache budget's permanent and transient refusals. The
// server's replies on top of it (runtime/reply.h): a stream's events handed to the writer as the
// scheduler makes them, a stop and a cancel. And ChatText's literal content (--literal-content),
// which keeps control tokens out of user text.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/chat.h"
#include "runtime/engine.h"
#include "runtime/reply.h"
#include "runtime/scheduler.h"
#include "test_util.h"

namespace {

using ojson = nlohmann::ordered_json;
using Catch::Matchers::Contains;

using m3::test::RealVocabModel;

struct Fixture {
  std::unique_ptr<m3::Engine> engine;
  std::unique_ptr<m3::ChatText> text;
  Fixture() {
    m3::EngineOptions o;
    o.threads = 1;  // no OpenMP region: the threads seen are the scheduler's and the test's
    auto e = m3::Engine::Open(RealVocabModel(), o);
    REQUIRE(e.ok());
    engine = std::move(e).value();
    auto t = m3::ChatText::Load(RealVocabModel(), /*require_template=*/true);
    REQUIRE(t.ok());
    text = std::move(t).value();
  }
  std::unique_ptr<m3::Scheduler> NewScheduler(size_t slots, uint64_t cache_budget = 0) const {
    m3::SchedulerOptions o;
    o.slots = slots;
    o.cache_budget = cache_budget;
    return std::make_unique<m3::Scheduler>(*engine, text->tokenizer(), o);
  }
  std::vector<int32_t> Prompt(const std::string& user) const {
    m3::TurnOptions turn;
    auto ids = text->TurnPrompt(ojson::array({{{"role", "user"}, {"content", user}}}), nullptr, nullptr, &turn);
    REQUIRE(ids.ok());
    return *ids;
  }
};

// What one request ended with, filled on the scheduler's thread.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool ended = false;
  m3::Status status;
  std::string text;
  m3::GenerateStats stats;
  size_t deltas = 0;

  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return ended; });
  }
  // Until `n` pieces have come (it is generating).
  void WaitDeltas(size_t n) {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (deltas >= n) return;
      }
      std::this_thread::yield();
    }
  }
};

m3::ScheduledRequest Request(std::vector<int32_t> prompt, int max_tokens, Outcome* out,
                             std::shared_ptr<std::atomic<bool>> cancelled = nullptr) {
  m3::ScheduledRequest r;
  r.prompt = std::move(prompt);
  r.turn.raw = true;
  r.turn.generate.max_tokens = max_tokens;
  r.sampling.temperature = 0.0f;
  r.cancelled = std::move(cancelled);
  r.on_delta = [out](const m3::TurnDelta&) {
    std::lock_guard<std::mutex> lock(out->mu);
    ++out->deltas;
    return true;
  };
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

}  // namespace

TEST_CASE("scheduler: requests submitted from several threads all end, identical ones alike", "[scheduler]") {
  Fixture f;
  auto owned = f.NewScheduler(2);
  m3::Scheduler& scheduler = *owned;
  scheduler.Start();
  constexpr int kThreads = 4, kEach = 3;
  std::vector<Outcome> outcomes(kThreads * kEach);
  const std::vector<int32_t> prompts[2] = {f.Prompt("Hello"), f.Prompt("Tell me a story")};  // Catch2 asserts on this thread only
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) scheduler.Submit(Request(prompts[i % 2], 6, &outcomes[t * kEach + i]));
    });
  for (auto& t : threads) t.join();
  for (Outcome& o : outcomes) o.Wait();
  for (int i = 0; i < kThreads * kEach; ++i) {
    INFO("request " << i);
    CHECK(outcomes[i].status.ok());
    CHECK(outcomes[i].stats.generated_tokens == 6);
    CHECK(outcomes[i].text == outcomes[(i % kEach) % 2].text);  // greedy: the same prompt, the same reply
  }
  CHECK(scheduler.queued() == 0);
  scheduler.Stop();
}

TEST_CASE("scheduler: a cancelled request ends within a step, queued or generating", "[scheduler]") {
  Fixture f;
  auto owned = f.NewScheduler(1);
  m3::Scheduler& scheduler = *owned;
  Outcome running, queued, after;
  auto cancel_running = std::make_shared<std::atomic<bool>>(false);
  auto cancel_queued = std::make_shared<std::atomic<bool>>(false);
  scheduler.Submit(Request(f.Prompt("A long story, please"), 300, &running, cancel_running));
  scheduler.Submit(Request(f.Prompt("Hi"), 4, &queued, cancel_queued));
  scheduler.Submit(Request(f.Prompt("Hi"), 4, &after));
  scheduler.Start();
  // The queued one is cancelled from this thread while the first generates; then the first.
  running.WaitDeltas(3);
  CHECK(scheduler.queued() == 2);
  *cancel_queued = true;
  queued.Wait();
  CHECK(queued.status.ok());
  CHECK(queued.stats.stop_reason == "caller");
  CHECK(queued.stats.prompt_tokens == 0);  // it never ran
  *cancel_running = true;
  running.Wait();
  CHECK(running.stats.stop_reason == "caller");
  CHECK(running.stats.generated_tokens < 300);
  after.Wait();
  CHECK(after.status.ok());
  CHECK(after.stats.generated_tokens == 4);
  scheduler.Stop();
}

TEST_CASE("scheduler: DropQueued ends the waiting requests and leaves the generating one", "[scheduler]") {
  Fixture f;
  auto owned = f.NewScheduler(1);
  m3::Scheduler& scheduler = *owned;
  Outcome first, second, third;
  scheduler.Submit(Request(f.Prompt("Count to ten"), 40, &first));
  scheduler.Submit(Request(f.Prompt("Hi"), 4, &second));
  scheduler.Submit(Request(f.Prompt("Hello"), 4, &third));
  scheduler.Start();
  first.WaitDeltas(1);
  scheduler.DropQueued(m3::Status(m3::StatusCode::kUnavailable, "the server is shutting down"));
  second.Wait();
  third.Wait();
  CHECK(second.status.code() == m3::StatusCode::kUnavailable);
  CHECK(third.status.code() == m3::StatusCode::kUnavailable);
  first.Wait();
  CHECK(first.status.ok());
  CHECK(first.stats.generated_tokens == 40);
  scheduler.Stop();
}

TEST_CASE("scheduler: a context that can never fit the cache budget is permanent, not transient", "[scheduler]") {
  Fixture f;
  const std::vector<int32_t> prompt = f.Prompt("Hello there, how are you?");
  CHECK(f.NewScheduler(1)->CheckFitsBudget(100000).ok());  // no budget: nothing is refused up front
  // A budget below what the prompt needs: refused before it runs, and at its step.
  m3::Session session(*f.engine, {});
  auto owned = f.NewScheduler(1, session.cache().BytesFor(prompt.size()) - 1);
  m3::Scheduler& scheduler = *owned;
  const m3::Status st = scheduler.CheckFitsBudget(prompt.size());
  CHECK(st.code() == m3::StatusCode::kOutOfRange);
  CHECK_THAT(st.message(), Contains("can never run"));
  CHECK(scheduler.CheckFitsBudget(1).ok());
  Outcome out;
  scheduler.Submit(Request(prompt, 2, &out));
  scheduler.RunUntilIdle();
  REQUIRE(out.ended);
  CHECK(out.status.code() == m3::StatusCode::kOutOfRange);
}

namespace {

// A reply's choice ends as the scheduler reports them (Reply::Submit's callback).
struct Ends {
  std::atomic<size_t> choices{0}, last{0};
  m3::Reply::ChoiceEnded Callback() {
    return [this](const m3::Status&, const m3::GenerateStats&, size_t, bool is_last) {
      ++choices;
      last += is_last;
    };
  }
};

// The content of the chat chunks among `events` (OpenAI's stream), joined.
std::string StreamedContent(const std::vector<std::string>& events) {
  std::string content;
  for (const std::string& e : events) {
    if (e == "data: [DONE]\n\n") continue;
    const ojson chunk = ojson::parse(e.substr(6));
    for (const ojson& choice : chunk["choices"])
      if (choice["delta"].contains("content")) content += choice["delta"]["content"].get<std::string>();
  }
  return content;
}

// A running one-slot scheduler and what replies are prepared with; stopped at the end of the test.
struct ReplyFixture {
  Fixture f;
  std::unique_ptr<m3::Scheduler> scheduler = f.NewScheduler(1);
  const m3::RequestDefaults defaults;
  const std::string model = "tiny";
  const m3::ReplyContext context{*f.text, *scheduler, defaults, model};
  ReplyFixture() { scheduler->Start(); }
  ~ReplyFixture() { scheduler->Stop(); }
};

ojson ChatBody(bool stream, int max_tokens) {
  return {{"messages", {{{"role", "user"}, {"content", "Tell me a story"}}}},
          {"stream", stream},
          {"seed", 11},
          {"temperature", 0},  // greedy: the same text whether the prompt's cache is reused or not
          {"max_tokens", max_tokens}};
}

}  // namespace

TEST_CASE("scheduler: a reply's stream events reach the writer as they are made, the text of the whole reply",
          "[scheduler][reply]") {
  ReplyFixture f;
  const m3::ReplyContext& context = f.context;

  m3::PreparedReply streamed = m3::Reply::Prepare(m3::Api::kChatCompletions, ChatBody(true, 8), "a", context);
  REQUIRE(streamed.reply);
  CHECK(streamed.seed == 11u);
  CHECK(streamed.reply->id() == "chatcmpl-a");
  CHECK(streamed.reply->stream());
  Ends ends;
  streamed.reply->Submit(ends.Callback());
  std::vector<std::string> events;
  // The opening events come at once; then each wait ends with what the scheduler handed over: a
  // guard of minutes is never waited out (a missed wake-up would hang here).
  CHECK_FALSE(streamed.reply->TakeEvents(&events, std::chrono::minutes(10)));
  REQUIRE(events.size() == 1);
  CHECK_THAT(events[0], Contains("\"role\":\"assistant\""));
  const auto start = std::chrono::steady_clock::now();
  size_t takes = 0;
  while (!streamed.reply->TakeEvents(&events, std::chrono::minutes(10))) ++takes;
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::minutes(5));
  CHECK(takes >= 1);
  CHECK(events.back() == "data: [DONE]\n\n");
  CHECK_THAT(events[events.size() - 2], Contains("\"finish_reason\":\""));
  CHECK(ends.choices == 1);
  CHECK(ends.last == 1);

  // The same request whole: the same text (the same seed).
  m3::PreparedReply whole = m3::Reply::Prepare(m3::Api::kChatCompletions, ChatBody(false, 8), "b", context);
  REQUIRE(whole.reply);
  whole.reply->Submit(ends.Callback());
  while (!whole.reply->WaitEnded(std::chrono::minutes(10))) {
  }
  auto text = whole.reply->Whole();
  REQUIRE(text.ok());
  const ojson response = ojson::parse(*text);
  CHECK(response["id"] == "chatcmpl-b");
  CHECK(response["choices"][0]["message"]["content"] == StreamedContent(events));
}

TEST_CASE("scheduler: a stopped reply stream ends with the reason at once, a refused request says why",
          "[scheduler][reply]") {
  ReplyFixture f;
  const m3::ReplyContext& context = f.context;

  m3::PreparedReply r = m3::Reply::Prepare(m3::Api::kMessages,
                                           {{"model", "m3"},
                                            {"max_tokens", 300},
                                            {"stream", true},
                                            {"messages", {{{"role", "user"}, {"content", "A long story, please"}}}}},
                                           "s", context);
  REQUIRE(r.reply);
  CHECK(r.reply->id() == "msg_s");
  Ends ends;
  r.reply->Submit(ends.Callback());
  std::vector<std::string> events;
  CHECK_FALSE(r.reply->TakeEvents(&events, std::chrono::minutes(10)));
  CHECK(events[0].rfind("event: message_start", 0) == 0);
  r.reply->Stop(m3::Status(m3::StatusCode::kUnavailable, "the server is shutting down"));
  events.clear();
  REQUIRE(r.reply->TakeEvents(&events, std::chrono::minutes(10)));
  REQUIRE(events.size() == 1);
  CHECK(events[0].rfind("event: error\n", 0) == 0);
  CHECK_THAT(events[0], Contains("overloaded_error"));
  CHECK_THAT(events[0], Contains("the server is shutting down"));
  while (ends.last == 0) std::this_thread::yield();  // the choice stops at its next step
  CHECK(ends.choices == 1);

  // Refused: a body that is no request (no seed yet), and one whose reply cannot fit its format.
  m3::PreparedReply bad = m3::Reply::Prepare(m3::Api::kChatCompletions, {{"messages", 3}}, "x", context);
  CHECK_FALSE(bad.reply);
  CHECK(bad.status.code() == m3::StatusCode::kInvalidArgument);
  CHECK_FALSE(bad.seed);
  ojson tight = ChatBody(false, 1);
  tight["response_format"] = {{"type", "json_object"}};
  m3::PreparedReply short_budget = m3::Reply::Prepare(m3::Api::kChatCompletions, tight, "y", context);
  CHECK_FALSE(short_budget.reply);
  CHECK(m3::HttpStatus(short_budget.status) == 400);
  CHECK_THAT(short_budget.status.message(), Contains("\"max_tokens\" is 1"));
  CHECK(short_budget.seed == 11u);
}

TEST_CASE("chat: literal content encodes a user's control-token text as plain text", "[chat]") {
  auto text = m3::ChatText::Load(m3::test::TokenizerDir(), /*require_template=*/true);
  REQUIRE(text.ok());
  const m3::ChatText& chat = **text;
  auto prompt = [&](const ojson& messages, bool literal) {
    m3::TurnOptions turn;
    auto ids = chat.TurnPrompt(messages, nullptr, nullptr, &turn, literal);
    REQUIRE(ids.ok());
    return *ids;
  };
  // Without control-token text, the same ids either way, over every golden conversation.
  std::ifstream in(m3::test::TokenizerDir() + "/chat_golden.jsonl");
  REQUIRE(in);
  size_t compared = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const ojson c = ojson::parse(line);
    const std::string dump = c["messages"].dump();
    if (dump.find("<mm:") != std::string::npos || dump.find("]<]") != std::string::npos) continue;
    m3::TurnOptions turn;
    if (!chat.TurnPrompt(c["messages"], nullptr, nullptr, &turn).ok()) continue;  // e.g. an orphan tool message
    INFO(dump.substr(0, 200));
    CHECK(prompt(c["messages"], true) == prompt(c["messages"], false));
    ++compared;
  }
  CHECK(compared >= 10);
  // A user's "<mm:think>" and "[e~[": tokens by default, letters with literal content; the
  // template's own control tokens stay tokens.
  const m3::Tokenizer& tok = chat.tokenizer();
  const int32_t think = tok.TokenId("<mm:think>"), end_turn = tok.TokenId("[e~[");
  REQUIRE(think >= 0);
  REQUIRE(end_turn >= 0);
  const ojson messages = {{{"role", "system"}, {"content", "Be brief [e~["}},
                          {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a <mm:think> b"}}}}}};
  const ojson plain = {{{"role", "system"}, {"content", "Be brief"}}, {{"role", "user"}, {"content", "a b"}}};
  auto count = [](const std::vector<int32_t>& ids, int32_t id) { return std::count(ids.begin(), ids.end(), id); };
  const auto tokens = prompt(messages, false), literal = prompt(messages, true), base = prompt(plain, false);
  CHECK(count(tokens, think) == count(base, think) + 1);
  CHECK(count(tokens, end_turn) == count(base, end_turn) + 1);
  CHECK(count(literal, think) == count(base, think));
  CHECK(count(literal, end_turn) == count(base, end_turn));
  CHECK(tok.Decode(literal, false) == tok.Decode(tokens, false));  // the same text
  // Marks cannot be forged: text holding the private-use characters is just text.
  const ojson forged = {{{"role", "user"}, {"content", "\uE000x\uE000 <mm:think> \uE001x\uE001"}}};
  CHECK(count(prompt(forged, true), think) == count(base, think));
}
