// The OpenAI request and response shapes of `m3 serve` (lib/runtime/openai.h), without HTTP:
// defaults and overrides, refused features by name, tool-call arguments both ways, finish reasons,
// usage, stream deltas.
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
  openai::Defaults d;
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
  CHECK_THAT(ChatError({{"n", 2}}), Contains("\"n\" must be 1"));
  CHECK_THAT(ChatError({{"stop", {"a", "b", "c", "d", "e"}}}), Contains("at most 4"));
  CHECK_THAT(ChatError({{"stop", {"a", ""}}}), Contains("non-empty"));
  CHECK_THAT(ChatError({{"stop", 5}}), Contains("\"stop\""));
  CHECK(ChatError({{"stop", ojson::array()}}) == "accepted");
  CHECK_THAT(ChatError({{"frequency_penalty", 0.5}}), Contains("frequency_penalty"));
  CHECK_THAT(ChatError({{"logprobs", true}}), Contains("logprobs"));
  CHECK_THAT(ChatError({{"tool_choice", "required"}}), Contains("tool_choice"));
  CHECK_THAT(ChatError({{"tools", {{"type", "function"}}}}), Contains("\"tools\" must be an array"));
  CHECK_THAT(ChatError({{"response_format", {{"type", "json_object"}}}}), Contains("response_format"));
  CHECK_THAT(ChatError({{"chat_template_kwargs", "x"}}), Contains("chat_template_kwargs"));
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
  const ojson c = openai::CompletionResponse("cmpl-1", 5, "m", "text", st);
  CHECK(c["object"] == "text_completion");
  CHECK(c["choices"][0]["text"] == "text");
  CHECK(c["choices"][0]["finish_reason"] == "stop");
  CHECK(openai::CompletionChunk("cmpl-1", 5, "m", "te")["choices"][0]["text"] == "te");
}

TEST_CASE("openai: completion requests and error bodies", "[openai]") {
  auto r = openai::ParseCompletionRequest(ojson{{"prompt", "Once"}, {"max_tokens", 3}}, {});
  REQUIRE(r.ok());
  CHECK_FALSE(r->chat);
  CHECK(r->prompt == "Once");
  CHECK(r->max_tokens == 3);
  CHECK(openai::ParseCompletionRequest(ojson{{"prompt", {"Once"}}}, {})->prompt == "Once");
  CHECK_THAT(openai::ParseCompletionRequest(ojson{{"prompt", {"a", "b"}}}, {}).status().message(), Contains("prompt"));
  CHECK_THAT(openai::ParseCompletionRequest(ojson{{"prompt", ""}}, {}).status().message(), Contains("prompt"));
  CHECK_THAT(openai::ParseCompletionRequest(ojson{{"prompt", "a"}, {"echo", true}}, {}).status().message(),
             Contains("echo"));
  CHECK_THAT(openai::ParseCompletionRequest(ojson{{"prompt", "a"}, {"suffix", "z"}}, {}).status().message(),
             Contains("suffix"));

  const ojson e = openai::ErrorBody("bad", 400);
  CHECK(e["error"]["message"] == "bad");
  CHECK(e["error"]["type"] == "invalid_request_error");
  CHECK(openai::ErrorBody("x", 500)["error"]["type"] == "server_error");
  CHECK(openai::HttpStatus(m3::InvalidArgument("x")) == 400);
  CHECK(openai::HttpStatus(m3::OutOfRange("x")) == 400);
  CHECK(openai::HttpStatus(m3::Status(m3::StatusCode::kOutOfMemory, "x")) == 503);
  CHECK(openai::HttpStatus(m3::NotFound("x")) == 500);
}

}  // namespace
