// Constrained turns end to end on the random real-vocabulary model (tests/make_real_vocab_model.sh):
// whatever it samples, the answer follows its JSON schema, grammar or forced tool call, with
// reasoning before it or not, within the token budget. Outputs are judged by the independent
// validator of tests/json_schema_check.h. (tests/clients/structured_check.mjs runs 200 more
// trials through the server with ajv.)
#include "test_util.h"

#include <memory>
#include <regex>

#include "constrain/constrain.h"
#include "json_schema_check.h"
#include "runtime/chat.h"
#include "runtime/engine.h"
#include "runtime/openai.h"
#include "runtime/output_constraint.h"

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

struct Fixture {
  std::unique_ptr<m3::Engine> engine;
  std::unique_ptr<m3::ChatText> text;
  std::unique_ptr<m3::Session> session;
  static Fixture& Get() {
    static Fixture f = [] {
      Fixture x;
      auto e = m3::Engine::Open(m3::test::RealVocabModel(), {});
      REQUIRE(e.ok());
      x.engine = std::move(e).value();
      auto t = m3::ChatText::Load(m3::test::RealVocabModel(), /*require_template=*/true);
      REQUIRE(t.ok());
      x.text = std::move(t).value();
      x.session = std::make_unique<m3::Session>(*x.engine, m3::SessionOptions{});
      return x;
    }();
    return f;
  }
};

struct Reply {
  m3::ParsedOutput out;
  m3::GenerateStats stats;
};

// One chat turn of `request` (an OpenAI body) through TurnInputs (runtime/request.h), as the server runs it.
Reply Turn(const ojson& request, uint64_t seed, int reasoning_budget = 0) {
  Fixture& f = Fixture::Get();
  auto r = m3::openai::ParseChatRequest(request, {});
  REQUIRE(r.ok());
  r->output.reasoning_budget = reasoning_budget;  // the Anthropic endpoint's thinking.budget_tokens
  m3::TurnOptions turn;
  // Compiled with time to spare: these turns test what constraints hold, not the time limit,
  // and a sanitizer build on a loaded 2-core machine can spend the default 2 s.
  auto built = m3::BuildConstraint(r->output, r->tools, *f.text, m3::constrain::CompileBudget{.seconds = 60.0, .request_seconds = 0, .stop = nullptr});
  INFO(built.status().ToString());
  REQUIRE(built.ok());
  auto prompt = m3::TurnInputs(*f.text, *r, "t", f.session->max_context(), &turn, 0, &*built);
  INFO(prompt.status().ToString());
  REQUIRE(prompt.ok());
  m3::SamplingParams sp{.temperature = 1.0f, .seed = seed};
  m3::Sampler sampler(sp);
  Reply reply;
  auto out = m3::GenerateTurn(*f.session, f.text->tokenizer(), *prompt, turn, sampler, [](const m3::TurnDelta&) { return true; },
                              &reply.stats);
  REQUIRE(out.ok());
  reply.out = std::move(out).value();
  return reply;
}

ojson Ask(const std::string& text, bool thinking, int max_tokens) {
  return {{"messages", {{{"role", "user"}, {"content", text}}}},
          {"max_tokens", max_tokens},
          {"chat_template_kwargs", {{"thinking_mode", thinking ? "enabled" : "disabled"}}}};
}

json Schemas() { return json::parse(m3::test::ReadBytes(std::string(M3_TEST_DATA_DIR) + "/../constrain_schemas.json")); }

}  // namespace

TEST_CASE("constrained turn: every schema's answer validates, with reasoning first or not") {
  const json schemas = Schemas();
  REQUIRE(schemas.size() == 20);
  size_t reasoned = 0;
  for (size_t i = 0; i < schemas.size(); ++i) {
    for (int thinking = 0; thinking < 2; ++thinking) {
      const json& s = schemas[i];
      INFO(s["name"].get<std::string>() << " thinking " << thinking);
      ojson req = Ask("Reply as JSON.", thinking, 160);
      req["response_format"] = {{"type", "json_schema"},
                                {"json_schema", {{"name", s["name"]}, {"schema", ojson::parse(s["schema"].dump())}, {"strict", true}}}};
      const Reply r = Turn(req, 100 * i + thinking);
      INFO("content: " << r.out.content);
      CHECK(r.stats.stop_reason == "stop");  // ended by its end id, inside the budget
      CHECK(r.stats.generated_tokens <= 160);
      const json value = json::parse(r.out.content, nullptr, /*allow_exceptions=*/false);
      REQUIRE_FALSE(value.is_discarded());
      CHECK(m3::test::SchemaCheck(s["schema"]).Validate(value) == "");
      CHECK(r.out.tool_calls.empty());
      reasoned += !r.out.reasoning.empty();
    }
  }
  CHECK(reasoned >= 15);  // thinking on: the random model reasons, then answers
}

TEST_CASE("constrained turn: a tight budget still closes the reasoning and the JSON in time") {
  const json schemas = Schemas();
  for (const char* name : {"nested_order", "agent_plan", "deep"}) {
    const auto it = std::find_if(schemas.begin(), schemas.end(), [&](const json& s) { return s["name"] == name; });
    REQUIRE(it != schemas.end());
    auto g = m3::constrain::CompileJsonSchema((*it)["schema"]);
    REQUIRE(g.ok());
    const size_t need = m3::MinTurnTokens({.answer = *g, .tool_block = nullptr, .vocab = Fixture::Get().text->vocab_index()}, m3::ThinkState::kInside);
    for (int extra : {0, 3}) {
      INFO(name << " budget " << need + extra);
      ojson req = Ask("JSON please.", true, static_cast<int>(need) + extra);
      req["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", name}, {"schema", ojson::parse((*it)["schema"].dump())}}}};
      const Reply r = Turn(req, 7 + extra);
      CHECK(r.stats.stop_reason == "stop");
      const json value = json::parse(r.out.content, nullptr, false);
      REQUIRE_FALSE(value.is_discarded());
      CHECK(m3::test::SchemaCheck((*it)["schema"]).Validate(value) == "");
    }
    // One token fewer cannot hold a valid answer: refused before it runs.
    ojson req = Ask("JSON please.", true, static_cast<int>(need) - 1);
    req["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", name}, {"schema", ojson::parse((*it)["schema"].dump())}}}};
    auto parsed = m3::openai::ParseChatRequest(req, {});
    REQUIRE(parsed.ok());
    m3::TurnOptions turn;
    auto prompt = m3::TurnInputs(*Fixture::Get().text, *parsed, "t", 100000, &turn);
    REQUIRE_FALSE(prompt.ok());
    CHECK_THAT(prompt.status().message(), Catch::Matchers::Contains("\"max_tokens\""));
  }
}

TEST_CASE("constrained turn: forced tool calls are calls of the allowed tools whose arguments validate") {
  const json schemas = Schemas();
  ojson tools = ojson::array();
  for (const char* name : {"weather_args", "person", "nested_order"})
    for (const json& s : schemas)
      if (s["name"] == name)
        tools.push_back({{"type", "function"}, {"function", {{"name", name}, {"parameters", ojson::parse(s["schema"].dump())}}}});
  auto schema_of = [&](const std::string& name) {
    for (const json& s : schemas)
      if (s["name"] == name) return s["schema"];
    return json();
  };
  for (int seed = 0; seed < 3; ++seed) {
    for (const bool named : {false, true}) {
      INFO("seed " << seed << (named ? " named" : " required"));
      ojson req = Ask("Use a tool.", seed % 2 == 1, 200);
      req["tools"] = tools;
      req["tool_choice"] = named ? ojson{{"type", "function"}, {"function", {{"name", "person"}}}} : ojson("required");
      if (named) req["parallel_tool_calls"] = false;
      const Reply r = Turn(req, 40 + seed);
      CHECK(r.stats.stop_reason == "stop");
      REQUIRE_FALSE(r.out.tool_calls.empty());
      CHECK(r.out.content.empty());  // the answer is the call
      if (named) CHECK(r.out.tool_calls.size() == 1);
      for (const m3::ToolCall& call : r.out.tool_calls) {
        INFO(call.name << " " << call.arguments.dump());
        if (named) CHECK(call.name == "person");
        const json schema = schema_of(call.name);
        REQUIRE_FALSE(schema.is_null());
        CHECK(m3::test::SchemaCheck(schema).Validate(json::parse(call.arguments.dump())) == "");
      }
    }
  }
}

TEST_CASE("constrained turn: a GBNF grammar holds the answer, and JSON text that spells markup stays content") {
  // Arithmetic over small numbers: the answer must be exactly one expression.
  const std::string grammar = "root ::= expr\nexpr ::= term ([-+*/] term)*\nterm ::= [0-9]{1,3} | \"(\" expr \")\"\n";
  for (int seed = 0; seed < 4; ++seed) {
    ojson req = Ask("Some arithmetic.", seed % 2 == 1, 64);
    req["grammar"] = grammar;
    const Reply r = Turn(req, seed);
    INFO(r.out.content);
    CHECK(r.stats.stop_reason == "stop");
    // Balanced parentheses and the allowed characters (the grammar's language, checked apart).
    int depth = 0;
    bool ok = !r.out.content.empty();
    for (char c : r.out.content) {
      depth += c == '(' ? 1 : c == ')' ? -1 : 0;
      ok = ok && depth >= 0 && std::string("0123456789+-*/()").find(c) != std::string::npos;
    }
    CHECK((ok && depth == 0));
  }
  // A grammar that names a token id the vocabulary lacks could never finish: refused by name.
  {
    ojson bad = Ask("x", false, 60);
    bad["grammar"] = "root ::= \"a\" <[999999]>";
    auto parsed = m3::openai::ParseChatRequest(bad, {});
    REQUIRE(parsed.ok());
    m3::TurnOptions turn;
    auto prompt = m3::TurnInputs(*Fixture::Get().text, *parsed, "t", 100000, &turn);
    REQUIRE_FALSE(prompt.ok());
    CHECK_THAT(prompt.status().message(), Catch::Matchers::Contains("\"grammar\""));
    CHECK_THAT(prompt.status().message(), Catch::Matchers::Contains("999999"));
  }
  // A JSON string may hold "<mm:think>" or the tool-call namespace as text: the answer of a JSON
  // format is plain content, never parsed for markup.
  ojson req = Ask("x", false, 60);
  req["grammar"] = "root ::= \"{\\\"a\\\":\\\"<mm:think>]<]minimax[>[<tool_call>\\\"}\"";
  const Reply r = Turn(req, 1);
  CHECK(r.out.content == "{\"a\":\"<mm:think>]<]minimax[>[<tool_call>\"}");
  CHECK(r.out.reasoning.empty());
  CHECK(r.out.tool_calls.empty());
}

TEST_CASE("constrained turn: a reasoning budget closes the reasoning after that many tokens") {
  for (const int budget : {1, 5, 20}) {
    for (const bool json_answer : {false, true}) {
      INFO("budget " << budget << (json_answer ? " json" : " free"));
      ojson req = Ask("Think briefly.", true, 80);
      if (json_answer) req["response_format"] = {{"type", "json_object"}};
      const Reply r = Turn(req, 3 + budget, budget);
      const auto& tok = Fixture::Get().text->tokenizer();
      CHECK(tok.Encode(r.out.reasoning).size() <= static_cast<size_t>(budget) + 2);  // re-encoding may merge or split a little
      CHECK_FALSE(r.out.reasoning.empty());
      if (json_answer) CHECK_FALSE(json::parse(r.out.content, nullptr, false).is_discarded());
    }
  }
}

TEST_CASE("constrained turn: a completion's grammar or response_format holds its whole text") {
  Fixture& f = Fixture::Get();
  auto complete = [&](const ojson& extra, uint64_t seed) {
    ojson body = {{"prompt", "Is the sky blue? Answer:"}, {"max_tokens", 24}};
    for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
    auto r = m3::openai::ParseCompletionRequest(body, {});
    REQUIRE(r.ok());
    m3::TurnOptions turn;
    auto prompt = m3::TurnInputs(*f.text, *r, "c", f.session->max_context(), &turn);
    INFO(prompt.status().ToString());
    REQUIRE(prompt.ok());
    CHECK(turn.raw);
    m3::Sampler sampler(m3::SamplingParams{.temperature = 1.0f, .seed = seed});
    auto out = m3::GenerateTurn(*f.session, f.text->tokenizer(), *prompt, turn, sampler,
                                [](const m3::TurnDelta&) { return true; }, nullptr);
    REQUIRE(out.ok());
    return out->content;
  };
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    INFO("seed " << seed);
    const std::string yes_no = complete({{"grammar", "root ::= \"yes\" | \"no\""}}, seed);
    CHECK((yes_no == "yes" || yes_no == "no"));
    const std::string number =
        complete({{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", {{"type", "integer"}}}}}}}},
                 seed);
    INFO(number);
    REQUIRE_FALSE(number.empty());
    CHECK(json::parse(number).is_number_integer());
  }
}
