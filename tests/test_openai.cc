// The OpenAI request and response shapes of `m3 serve` (lib/runtime/openai.h), without HTTP:
// defaults and overrides, refused features by name, tool-call arguments both ways, finish reasons,
// usage, stream deltas.
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/openai.h"
#include "test_util.h"

namespace {

using m3::GenerateStats;
using m3::ParsedOutput;
using m3::ToolCall;
using m3::openai::ojson;
using Catch::Matchers::Contains;
namespace openai = m3::openai;

ojson Chat(ojson extra = ojson::object()) {
  ojson body = {{"model", "anything"}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
  return body;
}

std::string ChatError(const ojson& extra) {
  auto r = openai::ParseChatRequest(Chat(extra), {});
  return r.ok() ? "accepted" : r.status().message();
}

TEST_CASE("openai: a chat request takes the server's defaults and the request's overrides", "[openai]") {
  m3::RequestDefaults d;
  d.max_tokens = 77;
  auto r = openai::ParseChatRequest(Chat(), d);
  REQUIRE(r.ok());
  CHECK(r->chat);
  CHECK(r->max_tokens == 77);
  CHECK(r->sampling.temperature == 1.0f);
  CHECK(r->sampling.top_k == 40);
  CHECK(r->sampling.top_p == 0.95f);
  CHECK_FALSE(r->stream);
  CHECK(r->tools.is_null());
  CHECK(r->template_options == ojson::object());

  r = openai::ParseChatRequest(Chat({{"temperature", 0},
                                     {"top_p", 0.5},
                                     {"top_k", 3},
                                     {"min_p", 0.1},
                                     {"presence_penalty", 0.5},
                                     {"repetition_penalty", 1.1},
                                     {"seed", 42},
                                     {"max_tokens", 9},
                                     {"max_completion_tokens", 11},
                                     {"stream", true},
                                     {"stream_options", {{"include_usage", true}}},
                                     {"stop", nullptr},
                                     {"n", 1},
                                     {"frequency_penalty", 0},
                                     {"tool_choice", "auto"},
                                     {"response_format", {{"type", "text"}}},
                                     {"user", "ignored"},
                                     {"chat_template_kwargs", {{"thinking_mode", "disabled"}}}}),
                               d);
  REQUIRE(r.ok());
  CHECK(r->sampling.temperature == 0.0f);
  CHECK(r->sampling.top_p == 0.5f);
  CHECK(r->sampling.top_k == 3);
  CHECK(r->sampling.min_p == Approx(0.1f));
  CHECK(r->sampling.presence_penalty == 0.5f);
  CHECK(r->sampling.repetition_penalty == Approx(1.1f));
  CHECK(r->sampling.seed == 42);
  CHECK(r->max_tokens == 11);  // max_completion_tokens wins
  CHECK(r->stream);
  CHECK(r->include_usage);
  CHECK(r->template_options == ojson{{"thinking_mode", "disabled"}});
  CHECK(r->stop.empty());
  CHECK(openai::ParseChatRequest(Chat({{"stop", "\n"}}), d)->stop == std::vector<std::string>{"\n"});
  CHECK(openai::ParseChatRequest(Chat({{"stop", {"a", "bc"}}}), d)->stop == std::vector<std::string>{"a", "bc"});
}

// Feeds `text` in pieces cut at `cuts` through StopStrings; returns what passed, and whether it matched.
std::pair<std::string, bool> RunStops(const std::vector<std::string>& stops, const std::string& text, size_t step) {
  m3::StopStrings s(stops);
  std::string out;
  for (size_t i = 0; i < text.size(); i += step) out += s.Push(text.substr(i, step));
  out += s.Flush();
  return {out, s.matched()};
}

TEST_CASE("StopStrings cut the text before the first stop string, however the text is split", "[openai]") {
  struct Case {
    std::vector<std::string> stops;
    std::string text, want;
    bool matched;
  };
  const Case cases[] = {
      {{"\nObservation:"}, "Thought: x\nAction: y\nObservation: z", "Thought: x\nAction: y", true},
      {{"END", "ND!"}, "abcEND!", "abc", true},      // the earliest match wins
      {{"ND!", "END"}, "abcEND!", "abc", true},      // whatever the order of the list
      {{"aab"}, "aaaab tail", "aa", true},           // overlapping partial matches
      {{"xyz"}, "xy xyzz", "xy ", true},
      {{"xyz"}, "no match, ends with xy", "no match, ends with xy", false},  // the held tail comes out
      {{"日本"}, "こんにちは日本語", "こんにちは", true},  // multi-byte
      {{}, "nothing to stop", "nothing to stop", false},
      {{""}, "empty stops are ignored", "empty stops are ignored", false},
  };
  for (const Case& c : cases)
    for (size_t step = 1; step <= c.text.size(); ++step) {
      INFO(c.text << " in pieces of " << step);
      const auto [out, matched] = RunStops(c.stops, c.text, step);
      CHECK(out == c.want);
      CHECK(matched == c.matched);
    }
  // Nothing that could still be a stop string is released early.
  m3::StopStrings s({"<end>"});
  CHECK(s.Push("abc<e") == "abc");
  CHECK(s.Push("n") == "");
  CHECK(s.Push("x") == "<enx");
  CHECK(s.Push("<end>more") == "");
  CHECK(s.matched());
  CHECK(s.Push("after") == "");
  CHECK(s.Flush() == "");
}

TEST_CASE("openai: malformed and unsupported requests are refused by name", "[openai]") {
  CHECK_THAT(openai::ParseChatRequest(ojson::array(), {}).status().message(), Contains("JSON object"));
  CHECK_THAT(openai::ParseChatRequest(ojson::object(), {}).status().message(), Contains("\"messages\""));
  CHECK_THAT(ChatError({{"messages", ojson::array()}}), Contains("non-empty"));
  CHECK_THAT(ChatError({{"messages", {1}}}), Contains("messages[0]"));
  CHECK_THAT(ChatError({{"temperature", "hot"}}), Contains("\"temperature\" must be a number"));
  CHECK_THAT(ChatError({{"temperature", -1}}), Contains("temperature"));
  CHECK_THAT(ChatError({{"top_p", 1.5}}), Contains("top_p"));
  CHECK_THAT(ChatError({{"top_k", 2.5}}), Contains("\"top_k\" must be an integer"));
  CHECK_THAT(ChatError({{"max_tokens", 0}}), Contains("max_tokens"));
  CHECK_THAT(ChatError({{"max_tokens", 1e12}}), Contains("max_tokens"));
  CHECK_THAT(ChatError({{"max_tokens", 99999999999}}), Contains("out of range"));
  CHECK_THAT(ChatError({{"seed", -1}}), Contains("seed"));
  CHECK_THAT(ChatError({{"stream", "yes"}}), Contains("\"stream\" must be true or false"));
  CHECK_THAT(ChatError({{"stream_options", 1}}), Contains("stream_options"));
  CHECK_THAT(ChatError({{"n", 17}}), Contains("\"n\" must be 1..16"));
  CHECK_THAT(ChatError({{"n", 0}}), Contains("\"n\" must be 1..16"));
  CHECK_THAT(ChatError({{"n", 2.5}}), Contains("\"n\" must be an integer"));
  CHECK_THAT(ChatError({{"stop", {"a", "b", "c", "d", "e"}}}), Contains("at most 4"));
  CHECK_THAT(ChatError({{"stop", {"a", ""}}}), Contains("non-empty"));
  CHECK_THAT(ChatError({{"stop", 5}}), Contains("\"stop\""));
  CHECK(ChatError({{"stop", ojson::array()}}) == "accepted");
  CHECK_THAT(ChatError({{"frequency_penalty", 2.5}}), Contains("\"frequency_penalty\" must be in [-2, 2]"));
  CHECK_THAT(ChatError({{"frequency_penalty", "x"}}), Contains("\"frequency_penalty\" must be a number"));
  CHECK_THAT(ChatError({{"logprobs", 1}}), Contains("\"logprobs\" must be true or false"));
  CHECK_THAT(ChatError({{"top_logprobs", 2}}), Contains("needs \"logprobs\": true"));
  CHECK_THAT(ChatError({{"logprobs", true}, {"top_logprobs", 21}}), Contains("\"top_logprobs\" must be 0..20, got 21"));
  CHECK_THAT(ChatError({{"logprobs", true}, {"top_logprobs", -1}}), Contains("must be 0..20"));
  CHECK_THAT(ChatError({{"max_tokens", 0}}), Contains("0 only with \"echo\""));
  CHECK_THAT(ChatError({{"echo", true}}), Contains("\"echo\" is not supported"));  // completions' field
  CHECK_THAT(ChatError({{"tool_choice", "required"}}), Contains("tool_choice"));
  CHECK_THAT(ChatError({{"tools", {{"type", "function"}}}}), Contains("\"tools\" must be an array"));
  CHECK(ChatError({{"response_format", {{"type", "json_object"}}}}) == "accepted");
  CHECK_THAT(ChatError({{"response_format", {{"type", "xml"}}}}), Contains("\"response_format.type\" must be"));
  CHECK_THAT(ChatError({{"response_format", {{"type", "json_schema"}}}}),
             Contains("\"response_format.json_schema\" must be an object"));
  CHECK_THAT(ChatError({{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", 3}}}}}}),
             Contains("\"response_format.json_schema.schema\" must be a JSON schema"));
  CHECK_THAT(ChatError({{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", ojson::object()},
                                                                                      {"format", "x"}}}}}}),
             Contains("\"response_format.json_schema.format\" is not supported"));
  CHECK_THAT(ChatError({{"response_format", {{"type", "json_object"}}}, {"grammar", "root ::= \"a\""}}),
             Contains("cannot both be given"));
  CHECK_THAT(ChatError({{"grammar", 5}}), Contains("\"grammar\" must be a non-empty string"));
  CHECK_THAT(ChatError({{"tool_choice", {{"type", "function"}, {"function", {{"name", "f"}}}}}}),
             Contains("'f' is not one of the request's tools"));
  CHECK_THAT(ChatError({{"tool_choice", "any"}}), Contains("\"tool_choice\" must be"));
  CHECK_THAT(ChatError({{"tool_choice", {{"type", "allowed_tools"}}}}),
             Contains("\"tool_choice.type\" 'allowed_tools' is not supported"));
  const ojson custom_tool = {{"type", "custom"}, {"custom", {{"name", "sql"}}}};
  CHECK_THAT(ChatError({{"tools", {custom_tool}}}), Contains("\"tools[0].type\" 'custom' is not supported"));
  CHECK_THAT(ChatError({{"tools", {{{"type", "function"}, {"function", {{"name", ""}}}}}}}),
             Contains("\"tools[0].function.name\" must be a non-empty string"));
  CHECK_THAT(ChatError({{"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", 1}}}}}}}),
             Contains("\"tools[0].function.parameters\" must be a JSON schema"));
  CHECK_THAT(ChatError({{"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"strict", "yes"}}}}}}}),
             Contains("\"tools[0].function.strict\" must be true or false"));
  CHECK_THAT(ChatError({{"chat_template_kwargs", "x"}}), Contains("chat_template_kwargs"));
}

TEST_CASE("openai: fields, roles and content parts the server does not implement are refused, never dropped",
          "[openai]") {
  // Unknown fields, and known ones that ask for what is not implemented.
  CHECK_THAT(ChatError({{"functions", ojson::array()}}), Contains("\"functions\" is not supported"));
  CHECK_THAT(ChatError({{"best_of", 2}}), Contains("\"best_of\" is not supported"));  // completions only
  CHECK_THAT(ChatError({{"logit_bias", {{"50256", -100}}}}), Contains("\"logit_bias\" is not supported"));
  CHECK(ChatError({{"logit_bias", ojson::object()}}) == "accepted");  // asks for nothing
  CHECK(ChatError({{"logit_bias", nullptr}, {"user", "u-1"}, {"model", "any"}}) == "accepted");
  CHECK_THAT(ChatError({{"user", 5}}), Contains("\"user\" must be a string"));
  CHECK(ChatError({{"parallel_tool_calls", false}}) == "accepted");  // a forced tool call is then one call
  CHECK(ChatError({{"parallel_tool_calls", true}}) == "accepted");
  CHECK_THAT(ChatError({{"parallel_tool_calls", "no"}}), Contains("\"parallel_tool_calls\" must be true or false"));
  // Roles: missing, unknown, or where the template would skip them.
  auto with = [](ojson messages) { return ChatError({{"messages", std::move(messages)}}); };
  const ojson user = {{"role", "user"}, {"content", "hi"}};
  CHECK_THAT(with({{{"content", "hi"}}}), Contains("\"messages[0].role\" is missing"));
  CHECK_THAT(with({{{"role", "function"}, {"content", "x"}}}), Contains("'function' is not one of"));
  CHECK_THAT(with({user, {{"role", "system"}, {"content", "late"}}}), Contains("\"messages[1].role\": a system message"));
  CHECK_THAT(with({user, {{"role", "root"}, {"content", "x"}}}), Contains("root message may only come first"));
  CHECK(with({{{"role", "root"}, {"content", "r"}}, {{"role", "developer"}, {"content", "d"}}, user}) == "accepted");
  CHECK_THAT(with({{{"role", "user"}, {"content", "hi"}, {"name", "ann"}}}), Contains("\"messages[0].name\""));
  CHECK_THAT(with({{{"role", "user"}}}), Contains("\"messages[0].content\" is missing"));
  CHECK_THAT(with({{{"role", "user"}, {"content", 5}}}), Contains("must be a string or an array"));
  // An echoed reply with its empty fields is fine.
  CHECK(with({user, {{"role", "assistant"}, {"content", "yo"}, {"refusal", nullptr}, {"annotations", ojson::array()}},
              user}) == "accepted");
  // Content parts: text only.
  const ojson image = {{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,AAAA"}}}};
  CHECK_THAT(with({{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "look"}}, image}}}}),
             Contains("\"messages[0].content[1].type\" 'image_url' is not supported"));
  CHECK_THAT(with({{{"role", "user"}, {"content", {{{"type", "text"}}}}}}), Contains("content[0].text\" must be a string"));
  CHECK(with({{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a"}}, "b"}}}}) == "accepted");
  // Completions: best_of 1 only; suffix refused.
  CHECK_THAT(openai::ParseCompletionRequest({{"prompt", "x"}, {"best_of", 3}}, {}).status().message(),
             Contains("\"best_of\" must be 1"));
  CHECK(openai::ParseCompletionRequest({{"prompt", "x"}, {"best_of", 1}}, {}).ok());
  CHECK_THAT(openai::ParseCompletionRequest({{"prompt", "x"}, {"messages", 1}}, {}).status().message(),
             Contains("\"messages\" is not supported"));
}

TEST_CASE("openai: tool-call arguments arrive as JSON strings and reach the template as objects", "[openai]") {
  const ojson call = {{"id", "call_1"},
                      {"type", "function"},
                      {"function", {{"name", "get_weather"}, {"arguments", R"({"city": "Paris", "days": 2})"}}}};
  ojson messages = {{{"role", "user"}, {"content", "Weather?"}},
                    {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}},
                    {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny"}}};
  auto r = openai::ParseChatRequest(Chat({{"messages", messages}, {"tools", ojson::array()}, {"tool_choice", "none"}}), {});
  REQUIRE(r.ok());
  const ojson& args = r->messages[1]["tool_calls"][0]["function"]["arguments"];
  CHECK(args.is_object());
  CHECK(args.dump() == R"({"city":"Paris","days":2})");  // key order kept
  CHECK(r->tools.is_null());  // tool_choice "none": not offered

  messages[1]["tool_calls"][0]["function"]["arguments"] = "not json";
  CHECK_THAT(ChatError({{"messages", messages}}), Contains("messages[1].tool_calls[0].function.arguments"));
  messages[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]";
  CHECK_THAT(ChatError({{"messages", messages}}), Contains("not a JSON object"));
}

TEST_CASE("openai: responses, finish reasons, usage and stream chunks", "[openai]") {
  ParsedOutput out;
  out.reasoning = "think";
  ToolCall call{"call_x_0", "get_weather", ojson{{"city", "Paris"}, {"unit", "c"}}};
  out.tool_calls.push_back(call);
  GenerateStats st;
  st.prompt_tokens = 10;
  st.reused_tokens = 4;
  st.generated_tokens = 6;
  st.stop_reason = "stop";

  const ojson r = openai::ChatResponse("chatcmpl-1", 123, "m", out, st);
  CHECK(r["object"] == "chat.completion");
  CHECK(r["model"] == "m");
  CHECK(r["created"] == 123);
  const ojson& choice = r["choices"][0];
  CHECK(choice["finish_reason"] == "tool_calls");
  CHECK(choice["message"]["role"] == "assistant");
  CHECK(choice["message"]["content"].is_null());  // tool calls and no text
  CHECK(choice["message"]["reasoning_content"] == "think");
  const ojson& wire = choice["message"]["tool_calls"][0];
  CHECK(wire["id"] == "call_x_0");
  CHECK(wire["type"] == "function");
  CHECK(wire["function"]["name"] == "get_weather");
  CHECK(wire["function"]["arguments"] == R"({"city": "Paris", "unit": "c"})");  // a string, as OpenAI sends
  CHECK(r["usage"] == ojson{{"prompt_tokens", 10},
                            {"completion_tokens", 6},
                            {"total_tokens", 16},
                            {"prompt_tokens_details", {{"cached_tokens", 4}}}});

  CHECK(openai::FinishReason(st, ParsedOutput{}) == "stop");
  st.stop_reason = "caller";
  CHECK(openai::FinishReason(st, ParsedOutput{}) == "stop");
  st.stop_reason = "length";
  CHECK(openai::FinishReason(st, out) == "length");
  st.stop_reason = "context";
  CHECK(openai::FinishReason(st, out) == "length");

  // Stream deltas: text pieces as they come, tool calls with their running index.
  m3::TurnDelta d;
  d.content = "Hel";
  size_t index = 0;
  CHECK(openai::ChatDelta(d, &index) == ojson{{"content", "Hel"}});
  d.content.clear();
  d.tool_calls = {call, call};
  const ojson calls = openai::ChatDelta(d, &index)["tool_calls"];
  CHECK(calls.size() == 2);
  CHECK(calls[0]["index"] == 0);
  CHECK(calls[1]["index"] == 1);
  CHECK(index == 2);
  const ojson chunk = openai::ChatChunk("chatcmpl-1", 5, "m", ojson{{"content", "x"}});
  CHECK(chunk["object"] == "chat.completion.chunk");
  CHECK(chunk["choices"][0]["finish_reason"].is_null());
  CHECK(openai::ChatChunk("id", 5, "m", ojson::object(), "stop")["choices"][0]["finish_reason"] == "stop");
  const ojson usage = openai::UsageChunk("id", 5, "m", true, st);
  CHECK(usage["choices"].empty());
  CHECK(usage["usage"]["total_tokens"] == 16);

  st.stop_reason = "stop";
  GenerateStats total;
  openai::AddUsage(&total, st);
  openai::AddUsage(&total, st);
  const ojson c = openai::CompletionResponse("cmpl-1", 5, "m", {{"text", nullptr, "stop"}, {"more", {{"x", 1}}, "length"}},
                                             total);
  CHECK(c["object"] == "text_completion");
  CHECK(c["choices"][0]["text"] == "text");
  CHECK(c["choices"][0]["finish_reason"] == "stop");
  CHECK(c["choices"][0]["logprobs"].is_null());
  CHECK(c["choices"][1]["index"] == 1);
  CHECK(c["choices"][1]["logprobs"] == ojson{{"x", 1}});
  CHECK(c["usage"]["total_tokens"] == 32);
  CHECK(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 8);
  CHECK(openai::CompletionChunk("cmpl-1", 5, "m", "te")["choices"][0]["text"] == "te");
}

TEST_CASE("openai: completion requests and error bodies", "[openai]") {
  auto r = openai::ParseCompletionRequest(ojson{{"prompt", "Once"}, {"max_tokens", 3}}, {});
  REQUIRE(r.ok());
  CHECK_FALSE(r->chat);
  REQUIRE(r->prompts.size() == 1);
  CHECK(r->prompts[0].text == "Once");
  CHECK(r->max_tokens == 3);
  CHECK(r->logprobs == -1);
  CHECK_FALSE(r->echo);
  CHECK(openai::ParseCompletionRequest(ojson{{"prompt", {"Once"}}}, {})->prompts[0].text == "Once");
  CHECK_THAT(openai::ParseCompletionRequest(ojson{{"prompt", ""}}, {}).status().message(), Contains("prompt"));
  CHECK_THAT(openai::ParseCompletionRequest(ojson{{"prompt", "a"}, {"suffix", "z"}}, {}).status().message(),
             Contains("suffix"));

  const ojson e = openai::ErrorBody("bad", 400);
  CHECK(e["error"]["message"] == "bad");
  CHECK(e["error"]["type"] == "invalid_request_error");
  CHECK(openai::ErrorBody("x", 500)["error"]["type"] == "server_error");
  CHECK(m3::HttpStatus(m3::InvalidArgument("x")) == 400);
  CHECK(m3::HttpStatus(m3::OutOfRange("x")) == 400);
  CHECK(m3::HttpStatus(m3::Status(m3::StatusCode::kOutOfMemory, "x")) == 503);
  CHECK(m3::HttpStatus(m3::NotFound("x")) == 500);
}

}  // namespace

namespace {

std::string CompletionError(const ojson& body) {
  auto r = openai::ParseCompletionRequest(body, {});
  return r.ok() ? "accepted" : r.status().message();
}

}  // namespace

TEST_CASE("openai: completions prompts as text or token ids, one or several, echo and logprobs", "[openai]") {
  auto r = openai::ParseCompletionRequest(ojson{{"prompt", {1, 2, 3}}, {"logprobs", 2}, {"echo", true}, {"max_tokens", 0}}, {});
  REQUIRE(r.ok());
  REQUIRE(r->prompts.size() == 1);
  CHECK(r->prompts[0].text.empty());
  CHECK(r->prompts[0].ids == std::vector<int32_t>{1, 2, 3});
  CHECK(r->logprobs == 2);
  CHECK(r->echo);
  CHECK(r->max_tokens == 0);
  r = openai::ParseCompletionRequest(ojson{{"prompt", ojson::array({"a", ojson::array({7, 8}), "b"})}}, {});
  REQUIRE(r.ok());
  REQUIRE(r->prompts.size() == 3);
  CHECK(r->prompts[0].text == "a");
  CHECK(r->prompts[1].ids == std::vector<int32_t>{7, 8});
  CHECK(r->prompts[2].text == "b");
  CHECK(openai::ParseCompletionRequest(ojson{{"prompt", {{5}}}}, {})->prompts[0].ids == std::vector<int32_t>{5});
  CHECK(openai::ParseCompletionRequest(ojson{{"prompt", "a"}, {"logprobs", nullptr}}, {})->logprobs == -1);
  CHECK(openai::ParseCompletionRequest(ojson{{"prompt", "a"}, {"logprobs", 0}}, {})->logprobs == 0);

  CHECK_THAT(CompletionError({{"prompt", ojson::array()}}), Contains("\"prompt\" must be"));
  CHECK_THAT(CompletionError({{"prompt", {1, -2}}}), Contains("token ids must be integers"));
  CHECK_THAT(CompletionError({{"prompt", {1, 2.5}}}), Contains("token ids must be integers"));
  CHECK_THAT(CompletionError({{"prompt", {"a", ""}}}), Contains("\"prompt\" must be"));
  CHECK_THAT(CompletionError({{"prompt", {"a", 3}}}), Contains("\"prompt\" must be"));
  CHECK_THAT(CompletionError({{"prompt", {ojson::array()}}}), Contains("\"prompt\" must be"));
  CHECK_THAT(CompletionError({{"prompt", 5}}), Contains("\"prompt\" must be"));
  CHECK_THAT(CompletionError({{"max_tokens", 1}}), Contains("\"prompt\" must be"));
  CHECK_THAT(CompletionError({{"prompt", std::vector<std::string>(257, "a")}}), Contains("at most 256 prompts"));
  CHECK(CompletionError({{"prompt", {"a", "b"}}, {"stream", true}}) == "accepted");  // choices by "index"
  CHECK_THAT(CompletionError({{"prompt", std::vector<std::string>(20, "a")}, {"n", 16}}), Contains("at most 256"));
  CHECK(CompletionError({{"prompt", {"a", "b"}}}) == "accepted");
  CHECK_THAT(CompletionError({{"prompt", "a"}, {"logprobs", true}}), Contains("is a number"));
  CHECK_THAT(CompletionError({{"prompt", "a"}, {"logprobs", 21}}), Contains("\"logprobs\" must be 0..20"));
  CHECK_THAT(CompletionError({{"prompt", "a"}, {"max_tokens", 0}}), Contains("0 only with \"echo\""));
  CHECK_THAT(CompletionError({{"prompt", "a"}, {"max_tokens", -1}, {"echo", true}}), Contains("max_tokens"));
  CHECK_THAT(CompletionError({{"prompt", "a"}, {"echo", 1}}), Contains("\"echo\" must be true or false"));

  auto chat = openai::ParseChatRequest(Chat({{"logprobs", true}}), {});
  REQUIRE(chat.ok());
  CHECK(chat->logprobs == 0);
  CHECK(openai::ParseChatRequest(Chat({{"logprobs", true}, {"top_logprobs", 5}}), {})->logprobs == 5);
  CHECK(openai::ParseChatRequest(Chat({{"logprobs", false}}), {})->logprobs == -1);
}

TEST_CASE("openai: token log-probabilities in the chat and completions forms", "[openai]") {
  auto tokenizer = m3::Tokenizer::Load(m3::test::TokenizerDir());
  REQUIRE(tokenizer.ok());
  const m3::Tokenizer& tok = **tokenizer;
  const std::vector<int32_t> hello = tok.Encode("Hello wörld");  // "ö": two bytes, maybe split
  REQUIRE(hello.size() >= 2);
  auto entry = [&](int32_t id, float lp, std::vector<std::pair<int32_t, float>> top) {
    return m3::TokenLogprob{id, lp, std::move(top)};
  };
  const std::vector<m3::TokenLogprob> tokens = {entry(hello[1], -0.5f, {{hello[0], -0.25f}, {hello[1], -0.5f}}),
                                                entry(hello[0], -2.0f, {{hello[1], -0.1f}})};

  openai::LogprobsJson chat(tok, true);
  const ojson c = chat.Of(tokens);
  REQUIRE(c["content"].size() == 2);
  CHECK(c["content"][0]["token"] == tok.TokenBytes(hello[1]));
  CHECK(c["content"][0]["logprob"] == -0.5f);
  CHECK(c["content"][0]["bytes"].size() == tok.TokenBytes(hello[1]).size());
  CHECK(c["content"][0]["top_logprobs"].size() == 2);
  CHECK(c["content"][0]["top_logprobs"][0]["token"] == tok.TokenBytes(hello[0]));
  CHECK(c["content"][1]["top_logprobs"].size() == 1);  // the chat form lists the top ones only

  // Completions: the echoed prompt's first token unscored, offsets in characters, each token's own
  // log-probability among its alternatives.
  openai::LogprobsJson completion(tok, false);
  ojson all = completion.Of(tokens, hello[0]);
  openai::LogprobsJson::Append(&all, completion.Of({tokens.data(), 1}));
  REQUIRE(all["tokens"].size() == 4);
  CHECK(all["token_logprobs"][0].is_null());
  CHECK(all["top_logprobs"][0].is_null());
  CHECK(all["token_logprobs"][1] == -0.5f);
  CHECK(all["top_logprobs"][2].size() == 2);  // top 1 plus the token itself
  CHECK(all["top_logprobs"][2][tok.TokenBytes(hello[0])] == -2.0f);
  const std::string first = tok.TokenBytes(hello[0]), second = tok.TokenBytes(hello[1]);
  CHECK(all["text_offset"] == ojson::array({0, first.size(), first.size() + second.size(),
                                            2 * first.size() + second.size()}));  // ASCII: bytes = characters

  // A byte token that is not whole UTF-8 is spelled as OpenAI does; offsets count characters.
  int32_t partial = -1;
  for (int32_t id = 0; id < 300 && partial < 0; ++id)
    if (tok.TokenBytes(id) == "\xc3") partial = id;
  REQUIRE(partial >= 0);
  openai::LogprobsJson bytes_form(tok, false);
  const ojson b = bytes_form.Of(std::vector<m3::TokenLogprob>{entry(partial, -1, {}), entry(partial, -1, {})});
  CHECK(b["tokens"][0] == "bytes:\\xc3");
  CHECK(b["text_offset"] == ojson::array({0, 1}));  // a lead byte starts a character

  // Pieces of a completion with echo: the prompt's text and log-probabilities come first.
  m3::Request r = *openai::ParseCompletionRequest(ojson{{"prompt", {hello[0], hello[1]}}, {"echo", true},
                                                            {"logprobs", 1}, {"max_tokens", 0}}, {});
  const std::vector<int32_t> prompt = {hello[0], hello[1]};
  openai::ChoicePieces pieces(tok, r, prompt);
  m3::TurnDelta d;
  d.prompt_logprobs = {tokens[0]};
  d.content = "X";
  d.logprobs = {tokens[1]};
  openai::JoinedPieces joined;
  joined.Add(pieces.Next(d));
  CHECK(pieces.Last().is_null());  // the echo went out with the first piece
  CHECK(joined.text == tok.Decode(prompt, false) + "X");
  CHECK(joined.logprobs["tokens"].size() == 3);
  CHECK(joined.logprobs["token_logprobs"][0].is_null());
  CHECK(joined.logprobs["token_logprobs"][2] == -2.0f);
  openai::ChoicePieces no_piece(tok, r, prompt);
  const ojson last = no_piece.Last();  // max_tokens 0 and nothing held: the echo alone
  CHECK(last["text"] == tok.Decode(prompt, false));
  CHECK(last["logprobs"]["tokens"].size() == 1);

  // Without echo or logprobs: the text alone, "logprobs" null.
  r = *openai::ParseCompletionRequest(ojson{{"prompt", "Hi"}}, {});
  openai::ChoicePieces plain(tok, r, std::vector<int32_t>{1});
  const ojson p = plain.Next(d);
  CHECK(p["text"] == "X");
  CHECK(p["logprobs"].is_null());
  CHECK(plain.Last().is_null());
}

namespace {

const m3::ChatText& TestChatText() {
  static const auto text = m3::ChatText::Load(m3::test::TokenizerDir(), true);
  REQUIRE(text.ok());
  return **text;
}

m3::ChoiceResult Ended(const std::string& content, size_t prompt_tokens, size_t generated) {
  m3::ChoiceResult c;
  c.prompt.assign(prompt_tokens, 1);
  c.output.content = content;
  c.stats.prompt_tokens = prompt_tokens;
  c.stats.generated_tokens = generated;
  c.stats.stop_reason = "stop";
  m3::TurnDelta d;
  d.content = content;
  c.deltas.push_back(d);
  return c;
}

}  // namespace

TEST_CASE("openai: n choices of a prompt, each its own seed, prompt-major, counted as OpenAI counts them",
          "[openai]") {
  auto r = openai::ParseChatRequest(Chat({{"n", 3}, {"seed", 10}, {"frequency_penalty", -0.5}}), {});
  REQUIRE(r.ok());
  CHECK(r->n == 3);
  CHECK(r->sampling.frequency_penalty == -0.5f);
  CHECK(m3::ChoiceCount(*r) == 3);
  CHECK(m3::ChoiceSampling(*r, 0).seed == 10);
  CHECK(m3::ChoiceSampling(*r, 2).seed == 12);
  CHECK(m3::ChoiceSampling(*r, 2).frequency_penalty == -0.5f);
  auto c = openai::ParseCompletionRequest(ojson{{"prompt", {"a", "b"}}, {"n", 2}, {"seed", 5}}, {});
  REQUIRE(c.ok());
  CHECK(m3::ChoiceCount(*c) == 4);
  CHECK(m3::ChoiceSampling(*c, 3).seed == 6);  // prompt 1, its second choice

  // Tool-call ids: unique per choice ("call_<id>_<choice>_" past choice 0) and per request.
  const m3::ChatText& text = TestChatText();
  std::set<std::string> prefixes;
  for (const std::string id : {"chatcmpl-a", "chatcmpl-b"})
    for (size_t k = 0; k < 3; ++k) {
      m3::TurnOptions turn;
      REQUIRE(m3::TurnInputs(text, *r, id, 1000, &turn, k).ok());
      prefixes.insert(turn.tool_call_id_prefix);
    }
  CHECK(prefixes.size() == 6);
  CHECK(prefixes.count("call_chatcmpl-a_") == 1);
  CHECK(prefixes.count("call_chatcmpl-a_2_") == 1);
  // Completions: choice c runs prompt c / n.
  m3::TurnOptions turn;
  auto a = m3::TurnInputs(text, *c, "x", 1000, &turn, 1);
  auto b = m3::TurnInputs(text, *c, "x", 1000, &turn, 2);
  REQUIRE((a.ok() && b.ok()));
  CHECK(*a == text.tokenizer().Encode("a"));
  CHECK(*b == text.tokenizer().Encode("b"));

  // The whole chat response: a choice per index; the prompt counted once, the outputs summed.
  std::vector<m3::ChoiceResult> ended = {Ended("one", 7, 2), Ended("two", 7, 3), Ended("three", 7, 4)};
  ended[1].stats.reused_tokens = 6;
  auto whole = openai::WholeResponse(text.tokenizer(), *r, "chatcmpl-1", 5, "m", ended);
  REQUIRE(whole.ok());
  REQUIRE((*whole)["choices"].size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK((*whole)["choices"][i]["index"] == i);
  CHECK((*whole)["choices"][2]["message"]["content"] == "three");
  CHECK((*whole)["usage"]["prompt_tokens"] == 7);
  CHECK((*whole)["usage"]["completion_tokens"] == 9);
  CHECK((*whole)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0);  // the first choice's
  // Completions: per prompt once.
  std::vector<m3::ChoiceResult> four = {Ended("a", 1, 1), Ended("b", 1, 2), Ended("c", 2, 3), Ended("d", 2, 4)};
  whole = openai::WholeResponse(text.tokenizer(), *c, "cmpl-1", 5, "m", four);
  REQUIRE(whole.ok());
  CHECK((*whole)["choices"].size() == 4);
  CHECK((*whole)["choices"][3]["text"] == "d");
  CHECK((*whole)["usage"]["prompt_tokens"] == 3);
  CHECK((*whole)["usage"]["completion_tokens"] == 10);
  // A failed choice fails the response.
  four[2].status = m3::InvalidArgument("bad");
  CHECK(openai::WholeResponse(text.tokenizer(), *c, "cmpl-1", 5, "m", four).status().message() == "bad");
  // Stream chunks name their choice.
  CHECK(openai::ChatChunk("id", 5, "m", ojson::object(), "stop", nullptr, 2)["choices"][0]["index"] == 2);
  CHECK(openai::CompletionChunk("id", 5, "m", "t", nullptr, nullptr, 3)["choices"][0]["index"] == 3);
}

TEST_CASE("openai: /tokenize and /detokenize bodies", "[openai]") {
  const m3::ChatText& text = TestChatText();
  const m3::Tokenizer& tok = text.tokenizer();
  const std::vector<int32_t> hello = tok.Encode("Hello world");
  auto out = openai::Tokenize(text, ojson{{"content", "Hello world"}}, {}, 4096);
  REQUIRE(out.ok());
  CHECK((*out)["tokens"].get<std::vector<int32_t>>() == hello);
  CHECK((*out)["count"] == hello.size());
  CHECK((*out)["max_model_len"] == 4096);
  // vLLM's spelling, token strings beside; llama.cpp's pieces.
  out = openai::Tokenize(text, ojson{{"prompt", "Hello world"}, {"add_special_tokens", true}, {"return_token_strs", true}},
                         {}, 4096);
  REQUIRE(out.ok());
  CHECK((*out)["tokens"].get<std::vector<int32_t>>() == hello);
  CHECK((*out)["token_strs"].size() == hello.size());
  out = openai::Tokenize(text, ojson{{"content", "Hello world"}, {"with_pieces", true}}, {}, 4096);
  REQUIRE(out.ok());
  std::string joined;
  for (const ojson& t : (*out)["tokens"]) joined += t["piece"].get<std::string>();
  CHECK(joined == "Hello world");
  CHECK((*out)["tokens"][0]["id"] == hello[0]);
  // A piece that is not whole UTF-8 is its bytes.
  out = openai::Tokenize(text, ojson{{"content", "\xe2\x9c\x93\xf0\x9f\x98\x80"}, {"with_pieces", true}}, {}, 4096);
  REQUIRE(out.ok());
  for (const ojson& t : (*out)["tokens"]) CHECK((t["piece"].is_string() || t["piece"].is_array()));

  // Messages: the ids a chat completion would run; without the generation prompt, fewer.
  const ojson messages = {{{"role", "user"}, {"content", "Hi"}}};
  out = openai::Tokenize(text, ojson{{"messages", messages}}, {}, 4096);
  REQUIRE(out.ok());
  m3::TurnOptions turn;
  auto parsed = openai::ParseChatRequest(Chat(), {});
  REQUIRE(parsed.ok());
  auto ids = m3::TurnInputs(text, *parsed, "x", 4096, &turn);
  REQUIRE(ids.ok());
  CHECK((*out)["tokens"].get<std::vector<int32_t>>() == *ids);
  auto bare = openai::Tokenize(text, ojson{{"messages", messages}, {"add_generation_prompt", false}}, {}, 4096);
  REQUIRE(bare.ok());
  CHECK((*bare)["count"].get<size_t>() < (*out)["count"].get<size_t>());

  auto error = [&](const ojson& body) {
    auto r = openai::Tokenize(text, body, {}, 4096);
    return r.ok() ? std::string("accepted") : r.status().message();
  };
  CHECK_THAT(error(ojson::array()), Contains("JSON object"));
  CHECK_THAT(error(ojson::object()), Contains("\"content\""));
  CHECK_THAT(error(ojson{{"content", "a"}, {"messages", messages}}), Contains("one of them"));
  CHECK_THAT(error(ojson{{"content", 5}}), Contains("\"content\" must be a string"));
  CHECK_THAT(error(ojson{{"content", "a"}, {"with_pieces", 1}}), Contains("\"with_pieces\" must be true or false"));
  // Pieces are bounded by count (~200 bytes each in memory); the ids alone only by the text.
  std::string many;
  for (size_t i = 0; i <= openai::kMaxTokenizePieces; ++i) many += " x";
  CHECK_THAT(error(ojson{{"content", many}, {"with_pieces", true}}), Contains("at most 262144 tokens"));
  CHECK_THAT(error(ojson{{"content", many}, {"return_token_strs", true}}), Contains("at most 262144 tokens"));
  auto ids_only = openai::Tokenize(text, ojson{{"content", many}}, {}, 4096);
  REQUIRE(ids_only.ok());
  CHECK((*ids_only)["count"].get<size_t>() > openai::kMaxTokenizePieces);
  CHECK_THAT(error(ojson{{"content", "a"}, {"bogus", 1}}), Contains("\"bogus\" is not supported"));
  CHECK_THAT(error(ojson{{"messages", ojson::array()}}), Contains("\"messages\" must be a non-empty array"));
  CHECK_THAT(error(ojson{{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}), Contains("messages[0].role"));
  CHECK_THAT(error(ojson{{"content", std::string(openai::kMaxTokenizeBytes + 1, 'a')}}), Contains("longer than"));

  auto back = openai::Detokenize(tok, ojson{{"tokens", hello}});
  REQUIRE(back.ok());
  CHECK((*back)["content"] == "Hello world");
  CHECK((*back)["prompt"] == "Hello world");
  CHECK((*openai::Detokenize(tok, ojson{{"tokens", ojson::array()}}))["content"] == "");
  auto derror = [&](const ojson& body) {
    auto r = openai::Detokenize(tok, body);
    return r.ok() ? std::string("accepted") : r.status().message();
  };
  const int64_t vocab = static_cast<int64_t>(tok.vocab_size());
  CHECK_THAT(derror(ojson{{"tokens", {1, vocab}}}), Contains("\"tokens[1]\" must be a token id"));
  CHECK_THAT(derror(ojson{{"tokens", {-1}}}), Contains("\"tokens[0]\""));
  CHECK_THAT(derror(ojson{{"tokens", {1.5}}}), Contains("\"tokens[0]\""));
  CHECK_THAT(derror(ojson{{"tokens", {"x"}}}), Contains("got a string"));
  CHECK_THAT(derror(ojson{{"tokens", 3}}), Contains("\"tokens\" must be an array"));
  CHECK_THAT(derror(ojson{{"tokens", {1}}, {"extra", 1}}), Contains("\"extra\" is not supported"));
  CHECK(derror(ojson{{"tokens", {1}}, {"model", "m"}}) == "accepted");
}

TEST_CASE("openai: a reply's stream events and whole text, as the server writes them", "[openai]") {
  const m3::ChatText& text = TestChatText();
  auto r = openai::ParseChatRequest(
      Chat({{"n", 2}, {"seed", 3}, {"stream", true}, {"stream_options", {{"include_usage", true}}}}), {});
  REQUIRE(r.ok());
  std::vector<m3::ChoiceResult> ended = {Ended("one", 7, 2), Ended("two", 7, 3)};
  auto format = openai::NewReplyFormat(text.tokenizer(), *r, ended, "chatcmpl-1", 5, "m");
  std::vector<std::string> events;
  auto data = [&](size_t i) {
    REQUIRE(events[i].rfind("data: ", 0) == 0);
    REQUIRE(events[i].ends_with("\n\n"));
    return ojson::parse(events[i].substr(6));
  };
  format->Open(&events);  // the assistant's role, of each choice
  REQUIRE(events.size() == 2);
  CHECK(data(1)["choices"][0]["index"] == 1);
  CHECK(data(1)["choices"][0]["delta"] == ojson{{"role", "assistant"}, {"content", ""}});
  format->Piece(1, ended[1].deltas[0], &events);
  REQUIRE(events.size() == 3);
  CHECK(events[2] == "data: " + m3::JsonText(openai::ChatChunk("chatcmpl-1", 5, "m", ojson{{"content", "two"}},
                                                               nullptr, nullptr, 1)) +
                         "\n\n");
  format->ChoiceEnd(1, ended[1], &events);
  REQUIRE(events.size() == 4);
  CHECK(data(3)["choices"][0]["finish_reason"] == "stop");
  format->Close(ended, &events);  // the usage, then [DONE]
  REQUIRE(events.size() == 6);
  CHECK(data(4)["usage"]["completion_tokens"] == 5);
  CHECK(events[5] == "data: [DONE]\n\n");
  events.clear();
  format->Fail(m3::Status(m3::StatusCode::kUnavailable, "draining"), &events);
  REQUIRE(events.size() == 2);
  CHECK(data(0) == openai::ErrorBody("draining", 503));
  CHECK(events[1] == "data: [DONE]\n\n");
  auto whole = format->Whole(ended);
  REQUIRE(whole.ok());
  CHECK(*whole == m3::JsonText(*openai::WholeResponse(text.tokenizer(), *r, "chatcmpl-1", 5, "m", ended)));
  ended[0].status = m3::InvalidArgument("bad");
  CHECK(format->Whole(ended).status().message() == "bad");

  // Completions: no role chunk; each piece's text.
  auto c = openai::ParseCompletionRequest(ojson{{"prompt", "a"}, {"stream", true}}, {});
  REQUIRE(c.ok());
  std::vector<m3::ChoiceResult> one = {Ended("b", 1, 1)};
  auto completion = openai::NewReplyFormat(text.tokenizer(), *c, one, "cmpl-1", 5, "m");
  events.clear();
  completion->Open(&events);
  CHECK(events.empty());
  completion->Piece(0, one[0].deltas[0], &events);
  completion->ChoiceEnd(0, one[0], &events);
  completion->Close(one, &events);
  REQUIRE(events.size() == 3);
  CHECK(data(0)["choices"][0]["text"] == "b");
  CHECK(data(1)["choices"][0]["finish_reason"] == "stop");
  CHECK(events[2] == "data: [DONE]\n\n");
}

TEST_CASE("openai: output constraints come from the request's output, compiled in one place", "[openai]") {
  const m3::ChatText& text = TestChatText();
  using Answer = m3::OutputSpec::Answer;
  using Choice = m3::OutputSpec::ToolChoice;
  const ojson params = {{"type", "object"}, {"properties", ojson::object()}};
  const ojson tool = {{"type", "function"}, {"function", {{"name", "f"}, {"parameters", params}}}};
  auto spec = [](const ojson& extra) {
    auto r = openai::ParseChatRequest(Chat(extra), {});
    REQUIRE(r.ok());
    return r->output;
  };
  CHECK(spec({}).answer == Answer::kFree);
  CHECK(spec({{"response_format", {{"type", "text"}}}}).answer == Answer::kFree);
  CHECK(spec({{"response_format", {{"type", "json_object"}}}}).answer == Answer::kJsonObject);
  const m3::OutputSpec schema =
      spec({{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", {{"type", "integer"}}}}}}}});
  CHECK(schema.answer == Answer::kJsonSchema);
  CHECK(schema.schema == ojson{{"type", "integer"}});
  CHECK(spec({{"grammar", "root ::= \"a\""}}).answer == Answer::kGrammar);
  CHECK(spec({{"tools", {tool}}, {"tool_choice", "required"}}).tool_choice == Choice::kRequired);
  const m3::OutputSpec named = spec({{"tools", {tool}},
                                     {"tool_choice", {{"type", "function"}, {"function", {{"name", "f"}}}}},
                                     {"parallel_tool_calls", false}});
  CHECK(named.tool_choice == Choice::kNamed);
  CHECK(named.tool_name == "f");
  CHECK_FALSE(named.parallel_tool_calls);

  auto built = m3::BuildConstraint(m3::OutputSpec{}, nullptr, text);
  REQUIRE(built.ok());
  CHECK(built->empty());
  auto json = m3::BuildConstraint(schema, nullptr, text);
  REQUIRE(json.ok());
  CHECK(json->answer);
  CHECK_FALSE(json->answer_is_markup);
  CHECK(json->vocab);
  auto forced = m3::BuildConstraint(named, ojson::array({tool}), text);
  REQUIRE(forced.ok());
  CHECK(forced->answer_is_markup);
  m3::OutputSpec bad;
  bad.answer = Answer::kJsonSchema;
  bad.schema = {{"type", "no such type"}};
  CHECK_THAT(m3::BuildConstraint(bad, nullptr, text).status().message(),
             Contains("\"response_format.json_schema.schema\": "));
  // A limit is reported as itself: a grammar whose start the decoder cannot follow is refused
  // here, not later as a reply that would need more tokens than any budget.
  bad.schema = {{"enum", ojson::array()}};
  for (int i = 0; i < 1025; ++i) bad.schema["enum"].push_back("choice" + std::to_string(i));
  CHECK_THAT(m3::BuildConstraint(bad, nullptr, text).status().message(),
             Contains("\"response_format.json_schema.schema\": ") && Contains("more than 1,024 parse stacks"));
  // A request's constraint is built once, whatever its count of choices: the later choices share
  // the first one's grammar.
  auto request = openai::ParseChatRequest(
      Chat({{"n", 3}, {"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", {{"type", "integer"}}}}}}}}),
      {});
  REQUIRE(request.ok());
  std::vector<m3::TurnOptions> turns(3);
  for (size_t c = 0; c < 3; ++c)
    REQUIRE(m3::TurnInputs(text, *request, "x", 4096, &turns[c], c, c > 0 ? &turns[0].constraint : nullptr).ok());
  CHECK(turns[0].constraint.answer);
  CHECK(turns[2].constraint.answer == turns[0].constraint.answer);
}
