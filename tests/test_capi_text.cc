// The C API's text layer (m3.h: tokenizer, chat rendering, generation, chat turns) and its C++
// wrappers (m3.hpp): the tokenizer and chat goldens through it, the output-buffer protocol, greedy
// generation against the golden ids, chat turns against the same turn done by hand, and errors.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "m3/m3.hpp"
#include "format/npy.h"
#include "test_util.h"
#include "text/output_parser.h"

namespace {

using ojson = nlohmann::ordered_json;
using Catch::Matchers::Contains;

using m3::test::TokenizerDir;

using m3::test::RealVocabModel;

std::vector<ojson> JsonLines(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in);
  std::vector<ojson> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(ojson::parse(line));
  return out;
}

m3_generate_options Greedy(int max_tokens) {
  m3_generate_options o = m3api::DefaultGenerateOptions();
  o.temperature = 0.0f;
  o.max_tokens = max_tokens;
  return o;
}

TEST_CASE("every tokenizer golden encodes and decodes through the C API", "[capi]") {
  const m3api::Tokenizer tok(TokenizerDir());
  CHECK(tok.vocab_size() == 200061);  // one past the highest id (the model pads to 200064)
  CHECK(tok.TokenId("<mm:think>") == 200059);
  CHECK(tok.TokenId("no such token") == -1);
  size_t n = 0;
  for (const ojson& c : JsonLines(TokenizerDir() + "/golden.jsonl")) {
    INFO(c["id"].get<std::string>());
    const auto ids = tok.Encode(c["text"].get<std::string>());
    CHECK(ids == c["ids"].get<std::vector<int32_t>>());
    CHECK(tok.Decode(ids) == c["decoded"].get<std::string>());
    CHECK(tok.Decode(ids, true) == c["decoded_skip_special"].get<std::string>());
    ++n;
  }
  CHECK(n > 300);
  // Texts longer than m3api's first guess of their size (8 bytes per id): the second call.
  const std::string long_run(4000, ' ');
  const auto run_ids = tok.Encode(long_run);
  REQUIRE(run_ids.size() * 8 < long_run.size());
  CHECK(tok.Decode(run_ids) == long_run);
}

TEST_CASE("every chat golden renders through the C API, the refused one with the template's message", "[capi]") {
  const m3api::Tokenizer tok(TokenizerDir());
  size_t n = 0, refused = 0;
  for (const ojson& c : JsonLines(TokenizerDir() + "/chat_golden.jsonl")) {
    INFO(c["id"].get<std::string>());
    const ojson req = {{"messages", c["messages"]}, {"tools", c["tools"]}, {"options", c["options"]}};
    if (c.contains("error")) {
      size_t len = 0;
      CHECK(m3_chat_render(tok.get(), req.dump().c_str(), nullptr, 0, &len) == M3_ERR_INVALID_ARGUMENT);
      CHECK(std::string(m3_last_error()) == c["error"].get<std::string>());
      ++refused;
      continue;
    }
    const std::string rendered = tok.Render(req.dump());
    CHECK(rendered == c["rendered"].get<std::string>());
    CHECK(tok.Encode(rendered) == c["ids"].get<std::vector<int32_t>>());
    ++n;
  }
  CHECK(n >= 30);
  CHECK(refused == 1);
}

TEST_CASE("C API output buffers: sizes, partial writes, termination", "[capi]") {
  const m3api::Tokenizer tok(TokenizerDir());
  const std::string text = "Hello, world! How are you doing today?";
  const auto ids = tok.Encode(text);
  REQUIRE(ids.size() > 4);

  size_t n = 99;
  CHECK(m3_tokenize(tok.get(), text.data(), text.size(), nullptr, 0, &n) == M3_ERR_OUT_OF_RANGE);
  CHECK(n == ids.size());
  CHECK_THAT(m3_last_error(), Contains("needs " + std::to_string(ids.size()) + " ids"));
  std::vector<int32_t> part(3, -7);
  CHECK(m3_tokenize(tok.get(), text.data(), text.size(), part.data(), part.size(), &n) == M3_ERR_OUT_OF_RANGE);
  CHECK(std::equal(part.begin(), part.end(), ids.begin()));
  std::vector<int32_t> exact(ids.size());
  CHECK(m3_tokenize(tok.get(), text.data(), text.size(), exact.data(), exact.size(), &n) == M3_OK);
  CHECK(exact == ids);
  CHECK(std::string(m3_last_error()).empty());
  CHECK(m3_tokenize(tok.get(), nullptr, 0, nullptr, 0, &n) == M3_OK);  // empty text: no ids
  CHECK(n == 0);

  size_t len = 0;
  CHECK(m3_detokenize(tok.get(), ids.data(), ids.size(), 0, nullptr, 0, &len) == M3_ERR_OUT_OF_RANGE);
  CHECK(len == text.size());
  std::string buf(text.size(), 'x');  // exact size: no room for the NUL, still complete
  CHECK(m3_detokenize(tok.get(), ids.data(), ids.size(), 0, buf.data(), buf.size(), &len) == M3_OK);
  CHECK(buf == text);
  std::vector<char> more(text.size() + 5, 'x');
  CHECK(m3_detokenize(tok.get(), ids.data(), ids.size(), 0, more.data(), more.size(), &len) == M3_OK);
  CHECK(std::string(more.data()) == text);  // NUL-terminated
  std::vector<char> small(4, 'x');
  CHECK(m3_detokenize(tok.get(), ids.data(), ids.size(), 0, small.data(), small.size(), &len) == M3_ERR_OUT_OF_RANGE);
  CHECK(std::string(small.data(), 4) == text.substr(0, 4));

  // NULL where a buffer or handle is needed: an error, not a crash.
  CHECK(m3_tokenize(nullptr, "a", 1, exact.data(), exact.size(), &n) == M3_ERR_INVALID_ARGUMENT);
  CHECK(m3_tokenize(tok.get(), nullptr, 3, exact.data(), exact.size(), &n) == M3_ERR_INVALID_ARGUMENT);
  CHECK(m3_tokenize(tok.get(), "a", 1, nullptr, 5, &n) == M3_ERR_INVALID_ARGUMENT);
  CHECK(m3_detokenize(tok.get(), nullptr, 2, 0, more.data(), more.size(), &len) == M3_ERR_INVALID_ARGUMENT);
  CHECK(m3_chat_render(tok.get(), nullptr, more.data(), more.size(), &len) == M3_ERR_INVALID_ARGUMENT);
  CHECK(m3_tokenizer_vocab_size(nullptr) == 0);
  CHECK(m3_tokenizer_token_id(nullptr, "a") == -1);
  CHECK(m3_tokenizer_token_id(tok.get(), nullptr) == -1);
}

TEST_CASE("m3_tokenize: 3 ids per input byte always suffice, on random bytes and mixed scripts", "[capi]") {
  const m3api::Tokenizer tok(TokenizerDir());
  std::mt19937 rng(5);
  // Decompositions that NFC keeps (U+0344 -> 2 marks, U+0F73 -> 2 marks) and invalid bytes, which
  // become U+FFFD: the inputs that grow the most.
  const std::string pieces[] = {"\xCD\x84", "\xE0\xBD\xB3", "\xFF", "\x80", "a", " ", "\xE4\xBD\xA0", "\n"};
  for (int round = 0; round < 200; ++round) {
    std::string text;
    const int len = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) {
      if (round % 2) text += pieces[rng() % std::size(pieces)];
      else text += static_cast<char>(rng() & 0xFF);
    }
    std::vector<int32_t> ids(3 * text.size());
    size_t n = 0;
    REQUIRE(m3_tokenize(tok.get(), text.data(), text.size(), ids.data(), ids.size(), &n) == M3_OK);
    CHECK(n <= 3 * text.size());
  }
}

TEST_CASE("one tokenizer serves two threads at once", "[capi]") {
  const m3api::Tokenizer tok(TokenizerDir());
  std::vector<std::string> texts, requests;
  for (const ojson& c : JsonLines(TokenizerDir() + "/golden.jsonl")) texts.push_back(c["text"].get<std::string>());
  for (const ojson& c : JsonLines(TokenizerDir() + "/chat_golden.jsonl"))
    if (!c.contains("error"))
      requests.push_back(ojson{{"messages", c["messages"]}, {"tools", c["tools"]}, {"options", c["options"]}}.dump());
  std::vector<std::vector<int32_t>> expect;
  for (const auto& t : texts) expect.push_back(tok.Encode(t));
  std::vector<std::string> rendered;
  for (const auto& r : requests) rendered.push_back(tok.Render(r));
  std::vector<int> bad(2, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (size_t i = t; i < texts.size(); ++i) bad[t] += tok.Encode(texts[i]) != expect[i];
        for (size_t i = t; i < requests.size(); ++i) bad[t] += tok.Render(requests[i]) != rendered[i];
      }
    });
  for (auto& th : threads) th.join();
  CHECK(bad[0] == 0);
  CHECK(bad[1] == 0);
}

TEST_CASE("m3_session_generate at temperature 0 gives each golden case's greedy ids", "[capi]") {
  for (const char* name : {"s1_fp32_basic", "s2_bf16_sharded_init1", "s6_fp16_mha_top1_sharded3"}) {
    INFO(name);
    const auto cs = m3::test::ReadPythonJson(m3::test::GoldenDir(name) + "/case.json");
    const auto prompt = cs["prompt_ids"].get<std::vector<int32_t>>();
    const auto greedy = cs["greedy_ids"].get<std::vector<int32_t>>();
    m3api::Engine engine(m3::test::GoldenDir(name), 2);
    m3api::Session session(engine);
    std::vector<int32_t> streamed;
    const auto ids = session.Generate(prompt, Greedy(static_cast<int>(greedy.size())), [&](int32_t id) {
      streamed.push_back(id);
      return true;
    });
    CHECK(ids == greedy);
    CHECK(streamed == greedy);
    // The last sampled id is not evaluated: the session holds the prompt and all but it.
    CHECK(session.position() == prompt.size() + greedy.size() - 1);
  }
}

TEST_CASE("Session::DecodeBatch decodes the golden greedy ids of two sequences at once", "[capi]") {
  const auto cs = m3::test::ReadPythonJson(m3::test::GoldenDir("s2_bf16_sharded_init1") + "/case.json");
  const auto prompt = cs["prompt_ids"].get<std::vector<int32_t>>();
  const auto greedy = cs["greedy_ids"].get<std::vector<int32_t>>();
  m3api::Engine engine(m3::test::GoldenDir("s2_bf16_sharded_init1"), 2);
  const size_t vocab = static_cast<size_t>(engine.vocab_size());
  // The golden prompt, and another one (its second half) whose greedy ids come from a lone session.
  const std::vector<int32_t> other(prompt.begin() + static_cast<std::ptrdiff_t>(prompt.size() / 2), prompt.end());
  m3api::Session a(engine), b(engine), alone(engine);
  auto argmax = [&](const float* x) { return static_cast<int32_t>(std::max_element(x, x + vocab) - x); };
  std::vector<int32_t> next = {argmax(a.Eval(prompt).data()), argmax(b.Eval(other).data())};
  int32_t alone_next = argmax(alone.Eval(other).data());
  std::vector<int32_t> got_a = {next[0]};
  for (size_t k = 1; k < greedy.size(); ++k) {
    const std::vector<float> logits = m3api::Session::DecodeBatch({&a, &b}, next);
    REQUIRE(logits.size() == 2 * vocab);
    CHECK(next[1] == alone_next);
    alone_next = argmax(alone.Eval({alone_next}).data());
    next = {argmax(logits.data()), argmax(logits.data() + vocab)};
    got_a.push_back(next[0]);
  }
  CHECK(got_a == greedy);
  CHECK_THROWS_AS(m3api::Session::DecodeBatch({&a, &a}, {1, 2}), m3api::Error);
}

TEST_CASE("Session::Score gives every prompt token's log-probability from the golden prefill rows", "[capi]") {
  const std::string dir = m3::test::GoldenDir("s5_realprop_mxfp8_vl");  // 2300 tokens: several passes
  const auto cs = m3::test::ReadPythonJson(dir + "/case.json");
  const auto prompt = cs["prompt_ids"].get<std::vector<int32_t>>();
  auto golden = m3::ReadNpy(dir + "/prefill_logits.npy");
  REQUIRE(golden.ok());
  m3api::Engine engine(dir, 2);
  const size_t vocab = static_cast<size_t>(engine.vocab_size());
  m3api::Session s(engine);
  const std::vector<double> lp = s.Score(prompt);
  REQUIRE(lp.size() == prompt.size() - 1);
  CHECK(s.position() == prompt.size() - 1);
  double worst = 0;
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    const float* row = &golden->data[i * vocab];
    double m = row[0], z = 0, mag = 0;
    for (size_t v = 0; v < vocab; ++v) m = std::max<double>(m, row[v]), mag = std::max<double>(mag, std::fabs(row[v]));
    for (size_t v = 0; v < vocab; ++v) z += std::exp(row[v] - m);
    const double want = row[prompt[i + 1]] - m - std::log(z);
    // Each logit within the golden rule's 1e-3 * (1 + max|logit|): the log-probability within twice that.
    worst = std::max(worst, std::fabs(lp[i] - want) / (2e-3 * (1 + mag)));
  }
  CHECK(worst <= 1.0);
  CHECK(s.Score({prompt[0]}).empty());
  CHECK_THROWS_AS(s.Score({prompt[0], static_cast<int32_t>(vocab)}), m3api::Error);
  CHECK(s.position() == prompt.size() - 1);
}

TEST_CASE("m3_session_generate: stats, stop ids, the callback stopping, and bad options", "[capi]") {
  const auto cs = m3::test::ReadPythonJson(m3::test::GoldenDir("s1_fp32_basic") + "/case.json");
  const auto prompt = cs["prompt_ids"].get<std::vector<int32_t>>();
  const auto greedy = cs["greedy_ids"].get<std::vector<int32_t>>();
  REQUIRE(greedy.size() >= 3);
  m3api::Engine engine(m3::test::GoldenDir("s1_fp32_basic"), 1);
  m3_engine* e = engine.get();
  m3_session* s = nullptr;
  REQUIRE(m3_session_new(e, &s) == M3_OK);

  m3_generate_options o = Greedy(10);
  o.stop_ids = &greedy[2];
  o.n_stop_ids = 1;
  m3_generate_stats st{};
  st.struct_size = sizeof(st);
  std::vector<int32_t> got;
  auto collect = [](int32_t id, void* user) {
    static_cast<std::vector<int32_t>*>(user)->push_back(id);
    return 0;
  };
  REQUIRE(m3_session_generate(s, prompt.data(), prompt.size(), &o, collect, &got, &st) == M3_OK);
  const size_t first_stop = static_cast<size_t>(std::find(greedy.begin(), greedy.end(), greedy[2]) - greedy.begin());
  CHECK(got == std::vector<int32_t>(greedy.begin(), greedy.begin() + static_cast<long>(first_stop)));
  CHECK(st.stop_reason == M3_STOP_ID);
  CHECK(st.generated_tokens == first_stop + 1);
  CHECK(st.prompt_tokens == prompt.size());
  CHECK(st.reused_tokens == 0);
  CHECK(st.prefill_seconds > 0);

  // The same prompt again: all but its last token come from the cache.
  got.clear();
  o.n_stop_ids = 0;
  o.max_tokens = 3;
  REQUIRE(m3_session_generate(s, prompt.data(), prompt.size(), &o, collect, &got, &st) == M3_OK);
  CHECK(st.reused_tokens == prompt.size() - 1);
  CHECK(st.stop_reason == M3_STOP_LENGTH);
  CHECK(got == std::vector<int32_t>(greedy.begin(), greedy.begin() + 3));

  // The callback stops it; a stats struct from an older, shorter layout is written only that far.
  auto stop_now = [](int32_t, void*) { return 1; };
  m3_generate_stats old{};
  old.struct_size = offsetof(m3_generate_stats, generated_tokens);
  old.generated_tokens = 12345;
  REQUIRE(m3_session_generate(s, prompt.data(), prompt.size(), &o, stop_now, nullptr, &old) == M3_OK);
  CHECK(old.prompt_tokens == prompt.size());
  CHECK(old.generated_tokens == 12345);
  REQUIRE(m3_session_generate(s, prompt.data(), prompt.size(), &o, stop_now, nullptr, &st) == M3_OK);
  CHECK(st.stop_reason == M3_STOP_CALLER);
  CHECK(st.generated_tokens == 1);

  m3_generate_stats unsized{};  // struct_size left 0
  CHECK(m3_session_generate(s, prompt.data(), prompt.size(), &o, nullptr, nullptr, &unsized) == M3_ERR_INVALID_ARGUMENT);
  CHECK_THAT(m3_last_error(), Contains("struct_size"));
  o.top_p = 2.0f;
  CHECK(m3_session_generate(s, prompt.data(), prompt.size(), &o, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  CHECK_THAT(m3_last_error(), Contains("top_p"));
  o = Greedy(2);
  o.n_stop_ids = 2;  // stop_ids NULL
  CHECK(m3_session_generate(s, prompt.data(), prompt.size(), &o, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  CHECK_THAT(m3_last_error(), Contains("stop_ids"));
  o = Greedy(2);
  o.struct_size = 8;
  CHECK(m3_session_generate(s, prompt.data(), prompt.size(), &o, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  CHECK_THAT(m3_last_error(), Contains("struct_size"));
  CHECK(m3_session_generate(s, prompt.data(), 0, nullptr, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  const int32_t too_big = m3_engine_vocab_size(e);
  CHECK(m3_session_generate(s, &too_big, 1, nullptr, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  m3_session_free(s);
}

struct Parts {
  std::string reasoning, content;
  std::vector<ojson> tool_calls;
  int calls = 0, stop_after = -1;
};

int CollectPart(m3_chat_part part, const char* text, size_t len, void* user) {
  auto* p = static_cast<Parts*>(user);
  const std::string s(text, len);
  if (part == M3_PART_REASONING) p->reasoning += s;
  if (part == M3_PART_CONTENT) p->content += s;
  if (part == M3_PART_TOOL_CALL) p->tool_calls.push_back(ojson::parse(s));
  return ++p->calls == p->stop_after;
}

TEST_CASE("m3_session_chat: a turn equals rendering, generating and parsing by hand, and the next turn reuses it",
          "[capi]") {
  const std::string model = RealVocabModel();
  m3api::Engine engine(model, 2);
  const m3api::Tokenizer tok(model);
  for (const char* mode : {"enabled", "adaptive"}) {
    INFO(mode);
    ojson req = {{"messages", {{{"role", "user"}, {"content", "Hello! Who are you?"}}}},
                 {"options", {{"thinking_mode", mode}}}};
    m3_generate_options o = Greedy(24);
    m3api::Session session(engine);
    Parts parts;
    const char* message = nullptr;
    m3_generate_stats st{};
    st.struct_size = sizeof(st);
    REQUIRE(m3_session_chat(session.get(), tok.get(), req.dump().c_str(), &o, CollectPart, &parts, &message, &st) ==
            M3_OK);
    REQUIRE(message != nullptr);
    const ojson msg = ojson::parse(message);
    CHECK(msg["role"] == "assistant");
    CHECK(msg["content"].get<std::string>() == parts.content);
    CHECK(msg.value("reasoning_content", std::string()) == parts.reasoning);
    CHECK(parts.calls > 0);
    CHECK(st.generated_tokens > 0);
    CHECK(st.generated_tokens <= 24);

    // By hand: render with the generation prompt, generate greedily with the end-of-turn stops,
    // decode, parse from the state the prompt leaves.
    ojson render_req = req;
    render_req["options"]["add_generation_prompt"] = true;
    const std::string rendered = tok.Render(render_req.dump());
    const auto prompt = tok.Encode(rendered);
    CHECK(st.prompt_tokens == prompt.size());
    std::vector<int32_t> stops;
    for (const char* t : {"[e~[", "]~b]", "]~!b["}) stops.push_back(tok.TokenId(t));
    m3_generate_options by_hand = Greedy(24);
    by_hand.stop_ids = stops.data();
    by_hand.n_stop_ids = stops.size();
    m3api::Session other(engine);
    const auto ids = other.Generate(prompt, by_hand);
    const bool enabled = std::string(mode) == "enabled";
    CHECK(rendered.ends_with("<mm:think>") == enabled);
    const m3::ParsedOutput expect =
        m3::ParseOutput(tok.Decode(ids), enabled ? m3::ThinkState::kInside : m3::ThinkState::kOutside, nullptr);
    CHECK(parts.reasoning == expect.reasoning);
    CHECK(parts.content == expect.content);
    if (enabled) CHECK(!parts.reasoning.empty());

    // The second turn renders the whole conversation; the session reuses at least what its prompt
    // shares with the first turn's (the template may re-render the first reply differently).
    req["messages"].push_back(msg);
    req["messages"].push_back({{"role", "user"}, {"content", "And a second question?"}});
    render_req = req;
    render_req["options"]["add_generation_prompt"] = true;
    const auto prompt2 = tok.Encode(tok.Render(render_req.dump()));
    const size_t shared =
        static_cast<size_t>(std::mismatch(prompt.begin(), prompt.end(), prompt2.begin(), prompt2.end()).first - prompt.begin());
    Parts second;
    REQUIRE(m3_session_chat(session.get(), tok.get(), req.dump().c_str(), &o, CollectPart, &second, &message, &st) ==
            M3_OK);
    CHECK(st.prompt_tokens == prompt2.size());
    CHECK(shared > prompt.size() / 2);
    CHECK(st.reused_tokens >= shared);
    CHECK(st.reused_tokens < st.prompt_tokens);
  }
}

TEST_CASE("m3_session_chat: raw prompts, stopping from the callback, the C++ wrapper", "[capi]") {
  const std::string model = RealVocabModel();
  m3api::Engine engine(model, 1);
  const m3api::Tokenizer tok(model);
  m3api::Session session(engine);

  // A plain completion: everything is content, equal to decoding the greedy ids.
  Parts parts;
  const char* message = nullptr;
  m3_generate_options o = Greedy(12);
  REQUIRE(m3_session_chat(session.get(), tok.get(), R"({"prompt": "The capital of France is"})", &o, CollectPart,
                          &parts, &message, nullptr) == M3_OK);
  m3api::Session other(engine);
  std::vector<int32_t> stops;
  for (const char* t : {"[e~[", "]~b]", "]~!b["}) stops.push_back(tok.TokenId(t));
  m3_generate_options by_hand = Greedy(12);
  by_hand.stop_ids = stops.data();
  by_hand.n_stop_ids = stops.size();
  CHECK(parts.content == tok.Decode(other.Generate(tok.Encode("The capital of France is"), by_hand)));
  CHECK(parts.reasoning.empty());
  CHECK(ojson::parse(message)["content"].get<std::string>() == parts.content);

  // A stop string taken from the middle of that completion cuts it there.
  const std::string whole = parts.content;
  REQUIRE(whole.size() >= 6);
  // Two whole UTF-8 characters from a third of the way in.
  auto next_char = [&](size_t i) {
    for (++i; i < whole.size() && (static_cast<unsigned char>(whole[i]) & 0xC0) == 0x80;) ++i;
    return i;
  };
  size_t begin = whole.size() / 3;
  while (begin > 0 && (static_cast<unsigned char>(whole[begin]) & 0xC0) == 0x80) --begin;
  const std::string stop_string = whole.substr(begin, next_char(next_char(begin)) - begin);
  Parts cut;
  m3_generate_stats cut_stats{};
  cut_stats.struct_size = sizeof(cut_stats);
  const ojson stop_req = {{"prompt", "The capital of France is"}, {"stop", {"never appears \u0001", stop_string}}};
  m3api::Session fresh(engine);
  REQUIRE(m3_session_chat(fresh.get(), tok.get(), stop_req.dump().c_str(), &o, CollectPart, &cut, nullptr,
                          &cut_stats) == M3_OK);
  CHECK(cut.content == whole.substr(0, whole.find(stop_string)));
  CHECK(cut_stats.stop_reason == M3_STOP_ID);

  // The callback stops generation at its first piece.
  Parts stop;
  stop.stop_after = 1;
  m3_generate_stats st{};
  st.struct_size = sizeof(st);
  REQUIRE(m3_session_chat(session.get(), tok.get(), R"({"prompt": "Once upon a time"})", &o, CollectPart, &stop,
                          nullptr, &st) == M3_OK);
  CHECK(st.stop_reason == M3_STOP_CALLER);
  CHECK(st.generated_tokens < 12);

  // The wrapper: parts streamed, the message returned; an exception thrown by the callback comes
  // out of Chat after the C call has returned.
  std::string streamed;
  const std::string msg = session.Chat(tok, R"({"messages": [{"role": "user", "content": "Hi"}]})", Greedy(8),
                                       [&](m3_chat_part, std::string_view text) {
                                         streamed += text;
                                         return true;
                                       });
  const ojson m = ojson::parse(msg);
  CHECK(m.value("reasoning_content", std::string()) + m["content"].get<std::string>() == streamed);
  CHECK_THROWS_WITH(session.Chat(tok, R"({"prompt": "x"})", Greedy(4),
                                 [](m3_chat_part, std::string_view) -> bool { throw std::runtime_error("boom"); }),
                    "boom");
  CHECK(session.Chat(tok, R"({"prompt": "x"})", Greedy(2)).size() > 0);  // still usable
}

TEST_CASE("m3_scheduler: queued chat requests over two slots equal each m3_session_chat alone", "[capi]") {
  const std::string model = RealVocabModel();
  m3api::Engine engine(model, 2);
  const m3api::Tokenizer tok(model);
  const std::vector<std::string> requests = {
      R"({"messages": [{"role": "user", "content": "Hello! Who are you?"}], "options": {"thinking_mode": "enabled"}})",
      R"({"prompt": "The capital of France is"})",
      R"({"messages": [{"role": "user", "content": "Name three colours."}]})",
      R"({"prompt": "Once upon a time", "stop": ["the"]})"};
  const m3_generate_options o = Greedy(12);
  std::vector<std::string> alone;
  for (const std::string& r : requests) {
    m3api::Session session(engine);
    alone.push_back(session.Chat(tok, r, o));
  }
  // C: two slots, four requests; parts streamed, the end once each.
  m3_scheduler* sched = nullptr;
  REQUIRE(m3_scheduler_new(engine.get(), tok.get(), 2, &sched) == M3_OK);
  struct End {
    m3_status status = M3_ERR_INTERNAL;
    std::string text;
    uint64_t generated = 0;
    int calls = 0;
  };
  std::vector<Parts> parts(requests.size());
  std::vector<End> ends(requests.size());
  struct Ctx {
    Parts* parts;
    End* end;
  };
  std::vector<Ctx> ctx;
  for (size_t i = 0; i < requests.size(); ++i) ctx.push_back({&parts[i], &ends[i]});
  for (size_t i = 0; i < requests.size(); ++i)
    REQUIRE(m3_scheduler_submit(
                sched, requests[i].c_str(), &o,
                [](m3_chat_part part, const char* text, size_t len, void* user) {
                  return CollectPart(part, text, len, static_cast<Ctx*>(user)->parts);
                },
                [](m3_status status, const char* text, const m3_generate_stats* stats, void* user) {
                  End* e = static_cast<Ctx*>(user)->end;
                  e->status = status;
                  e->text = text;
                  e->generated = stats->generated_tokens;
                  ++e->calls;
                },
                &ctx[i]) == M3_OK);
  REQUIRE(m3_scheduler_run(sched) == M3_OK);
  for (size_t i = 0; i < requests.size(); ++i) {
    INFO("request " << i);
    CHECK(ends[i].calls == 1);
    CHECK(ends[i].status == M3_OK);
    CHECK(ends[i].text == alone[i]);
    CHECK(ends[i].generated > 0);
    const ojson msg = ojson::parse(ends[i].text);
    CHECK(parts[i].content == msg["content"].get<std::string>());
  }
  // Bad requests are refused at submit, with no callback.
  CHECK(m3_scheduler_submit(sched, "{not json", &o, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  CHECK_THAT(m3_last_error(), Contains("m3_scheduler_submit"));
  CHECK(m3_scheduler_submit(nullptr, "{}", &o, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  m3_scheduler_free(sched);
  CHECK(m3_scheduler_new(engine.get(), tok.get(), 0, &sched) == M3_ERR_INVALID_ARGUMENT);
  CHECK(sched == nullptr);
  // A request left queued at free ends with an error.
  REQUIRE(m3_scheduler_new(engine.get(), tok.get(), 1, &sched) == M3_OK);
  End left;
  Parts left_parts;
  Ctx left_ctx{&left_parts, &left};
  REQUIRE(m3_scheduler_submit(sched, requests[1].c_str(), &o, nullptr,
                              [](m3_status status, const char* text, const m3_generate_stats*, void* user) {
                                static_cast<Ctx*>(user)->end->status = status;
                                static_cast<Ctx*>(user)->end->text = text;
                              },
                              &left_ctx) == M3_OK);
  m3_scheduler_free(sched);
  CHECK(left.status == M3_ERR_INTERNAL);

  // Started: its own thread steps while this one submits and waits.
  REQUIRE(m3_scheduler_new(engine.get(), tok.get(), 2, &sched) == M3_OK);
  REQUIRE(m3_scheduler_start(sched) == M3_OK);
  CHECK(m3_scheduler_start(sched) == M3_ERR_INVALID_ARGUMENT);
  CHECK(m3_scheduler_run(sched) == M3_ERR_INVALID_ARGUMENT);
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::string> texts;
    size_t ended = 0;
  } waiter;
  waiter.texts.resize(requests.size());
  std::vector<std::pair<Waiter*, size_t>> slots_of;
  for (size_t i = 0; i < requests.size(); ++i) slots_of.emplace_back(&waiter, i);
  for (size_t i = 0; i < requests.size(); ++i)
    REQUIRE(m3_scheduler_submit(sched, requests[i].c_str(), &o, nullptr,
                                [](m3_status, const char* text, const m3_generate_stats*, void* user) {
                                  const auto [w, index] = *static_cast<std::pair<Waiter*, size_t>*>(user);
                                  std::lock_guard<std::mutex> lock(w->mu);
                                  w->texts[index] = text;
                                  ++w->ended;
                                  w->cv.notify_all();
                                },
                                &slots_of[i]) == M3_OK);
  {
    std::unique_lock<std::mutex> lock(waiter.mu);
    REQUIRE(waiter.cv.wait_for(lock, std::chrono::minutes(2), [&] { return waiter.ended == requests.size(); }));
  }
  CHECK(waiter.texts == alone);
  m3_scheduler_free(sched);

  // C++: the same through m3api::Scheduler; a throwing callback comes out of Run.
  m3api::Scheduler scheduler(engine, tok, 2);
  std::vector<std::string> got(requests.size());
  for (size_t i = 0; i < requests.size(); ++i)
    scheduler.Submit(requests[i], o, nullptr, [&got, i](const m3api::Scheduler::Result& r) { got[i] = r.text; });
  scheduler.Run();
  CHECK(got == alone);
  scheduler.Submit(requests[1], o, [](m3_chat_part, std::string_view) -> bool { throw std::runtime_error("boom"); });
  CHECK_THROWS_WITH(scheduler.Run(), "boom");
}

TEST_CASE("m3_session_chat refuses bad requests with a message and leaves the session usable", "[capi]") {
  const std::string model = RealVocabModel();
  m3api::Engine engine(model, 1);
  const m3api::Tokenizer tok(model);
  m3api::Session session(engine);
  const m3_generate_options o = Greedy(2);
  struct Bad {
    const char* request;
    m3_status status;
    const char* message;
  };
  const Bad bad[] = {
      {"not json", M3_ERR_INVALID_ARGUMENT, "not valid JSON"},
      {"[1, 2]", M3_ERR_INVALID_ARGUMENT, "JSON object"},
      {"{}", M3_ERR_INVALID_ARGUMENT, "\"messages\" array or a \"prompt\""},
      {R"({"messages": {"role": "user"}})", M3_ERR_INVALID_ARGUMENT, "\"messages\" array"},
      {R"({"prompt": 5})", M3_ERR_INVALID_ARGUMENT, "\"prompt\" must be a string"},
      {R"({"prompt": "a", "messages": []})", M3_ERR_INVALID_ARGUMENT, "both"},
      {R"({"prompt": ""})", M3_ERR_INVALID_ARGUMENT, "empty"},
      {R"({"prompt": "a", "stop": [""]})", M3_ERR_INVALID_ARGUMENT, "non-empty"},
      {R"({"prompt": "a", "stop": 3})", M3_ERR_INVALID_ARGUMENT, "\"stop\""},
      {R"({"messages": [], "tools": {}})", M3_ERR_INVALID_ARGUMENT, "\"tools\" must be an array"},
      {R"({"messages": [], "options": 3})", M3_ERR_INVALID_ARGUMENT, "\"options\" must be an object"},
      {R"({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "orphan"}]})",
       M3_ERR_INVALID_ARGUMENT, "Message has tool role, but there was no previous assistant message with a tool call!"},
  };
  for (const Bad& b : bad) {
    INFO(b.request);
    const char* message = "unchanged";
    CHECK(m3_session_chat(session.get(), tok.get(), b.request, &o, nullptr, nullptr, &message, nullptr) == b.status);
    CHECK_THAT(m3_last_error(), Contains(b.message));
    CHECK(message == nullptr);
  }
  CHECK(session.position() == 0);
  CHECK(m3_session_chat(nullptr, tok.get(), "{}", &o, nullptr, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  CHECK(m3_session_chat(session.get(), nullptr, "{}", &o, nullptr, nullptr, nullptr, nullptr) == M3_ERR_INVALID_ARGUMENT);
  m3_generate_options greedy_bad = o;
  greedy_bad.temperature = -1.0f;
  CHECK(m3_session_chat(session.get(), tok.get(), R"({"prompt": "a"})", &greedy_bad, nullptr, nullptr, nullptr,
                        nullptr) == M3_ERR_INVALID_ARGUMENT);
  CHECK_THAT(m3_last_error(), Contains("temperature"));
  CHECK(session.Chat(tok, R"({"prompt": "a"})", o).size() > 0);
}

TEST_CASE("a tokenizer folder without a chat template: text works, chat says what is missing", "[capi]") {
  const auto dir = std::filesystem::temp_directory_path() / ("m3_capi_notemplate_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(TokenizerDir() + "/tokenizer.json", dir / "tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  m3_tokenizer* tok = nullptr;
  REQUIRE(m3_tokenizer_open(dir.c_str(), &tok) == M3_OK);
  std::vector<int32_t> ids(16);
  size_t n = 0;
  CHECK(m3_tokenize(tok, "Hello world", 11, ids.data(), ids.size(), &n) == M3_OK);
  CHECK(n == 2);
  size_t len = 0;
  CHECK(m3_chat_render(tok, R"({"messages": []})", nullptr, 0, &len) == M3_ERR_NOT_FOUND);
  CHECK_THAT(m3_last_error(), Contains("chat_template.jinja"));
  m3_tokenizer_free(tok);

  m3_tokenizer* none = nullptr;
  CHECK(m3_tokenizer_open((dir / "nowhere").c_str(), &none) == M3_ERR_NOT_FOUND);
  CHECK(none == nullptr);
  CHECK(m3_tokenizer_open(nullptr, &none) == M3_ERR_INVALID_ARGUMENT);
  // A template that exists but is broken is an error at open, not a silent fallback to raw text.
  m3::test::WriteBytes(dir / "chat_template.jinja", "{% if %}");
  CHECK(m3_tokenizer_open(dir.c_str(), &none) != M3_OK);
  CHECK(none == nullptr);
  std::filesystem::remove_all(dir);
}

}  // namespace
