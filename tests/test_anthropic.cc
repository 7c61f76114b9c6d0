// The Anthropic Messages shapes of `m3 serve` (lib/runtime/anthropic.h), without HTTP: a request
// mapped onto the chat request (system, thinking, tools, tool_choice, tool_use / tool_result
// round trips), every refusal by name, the rendered prompt, the reply, the stream's events and
// the errors.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/anthropic.h"
#include "runtime/chat.h"
#include "test_util.h"

namespace {

using Catch::Matchers::Contains;
using m3::GenerateStats;
using m3::ParsedOutput;
using m3::ToolCall;
using m3::TurnDelta;
using m3::anthropic::ojson;
namespace anthropic = m3::anthropic;

ojson Body(ojson extra = ojson::object()) {
  ojson body = {{"model", "m3"}, {"max_tokens", 64}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
  return body;
}

std::string Error(const ojson& body, bool count_tokens = false) {
  auto r = anthropic::ParseMessagesRequest(body, {}, count_tokens);
  return r.ok() ? "accepted" : r.status().message();
}

const ojson kWeatherTool = {
    {"name", "get_weather"},
    {"description", "Weather of a city"},
    {"input_schema",
     {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}}}}};

// A conversation with a round trip: the assistant called two tools, the user answers both (out
// of order) and asks on.
ojson RoundTrip() {
  return ojson::array(
      {{{"role", "user"}, {"content", "Weather in Paris and Rome?"}},
       {{"role", "assistant"},
        {"content",
         {{{"type", "thinking"}, {"thinking", "Two cities."}, {"signature", "sig"}},
          {{"type", "text"}, {"text", "Let me look."}},
          {{"type", "tool_use"}, {"id", "toolu_1"}, {"name", "get_weather"}, {"input", {{"city", "Paris"}}}},
          {{"type", "tool_use"}, {"id", "toolu_2"}, {"name", "get_weather"}, {"input", {{"city", "Rome"}}}}}}},
       {{"role", "user"},
        {"content",
         {{{"type", "tool_result"}, {"tool_use_id", "toolu_2"}, {"content", "Rome: sun"}},
          {{"type", "tool_result"},
           {"tool_use_id", "toolu_1"},
           {"content", {{{"type", "text"}, {"text", "Paris: rain"}}}},
           {"is_error", false}},
          {{"type", "text"}, {"text", "And tomorrow?"}}}}}});
}

TEST_CASE("anthropic: a request takes the server's defaults and maps its fields", "[anthropic]") {
  m3::RequestDefaults d;
  d.max_tokens = 77;
  auto r = anthropic::ParseMessagesRequest(Body(), d);
  REQUIRE(r.ok());
  CHECK(r->chat);
  CHECK(r->max_tokens == 64);  // required, so always the request's
  CHECK(r->sampling.temperature == 1.0f);
  CHECK(r->sampling.top_k == 40);
  CHECK_FALSE(r->stream);
  CHECK(r->tools.is_null());
  CHECK(r->output.tool_choice == m3::OutputSpec::ToolChoice::kAuto);
  CHECK(r->output.parallel_tool_calls);
  CHECK(r->output.answer == m3::OutputSpec::Answer::kFree);
  CHECK(r->output.reasoning_budget == 0);
  CHECK(r->tool_call_id_prefix == "toolu_");
  CHECK(r->template_options == ojson{{"thinking_mode", "disabled"}});  // Anthropic's default: no thinking
  CHECK(r->messages == ojson::array({{{"role", "user"}, {"content", "Hi"}}}));

  r = anthropic::ParseMessagesRequest(Body({{"temperature", 0},
                                            {"top_p", 0.5},
                                            {"top_k", 3},
                                            {"stream", true},
                                            {"stop_sequences", {"END", "\n\nHuman:"}},
                                            {"metadata", {{"user_id", "u-1"}}},
                                            {"service_tier", "auto"},
                                            {"cache_control", {{"type", "ephemeral"}}},
                                            {"system", "Be brief."}}),
                                      d);
  REQUIRE(r.ok());
  CHECK(r->sampling.temperature == 0.0f);
  CHECK(r->sampling.top_p == 0.5f);
  CHECK(r->sampling.top_k == 3);
  CHECK(r->stream);
  CHECK(r->stop == std::vector<std::string>{"END", "\n\nHuman:"});
  CHECK(r->messages[0] == ojson{{"role", "system"}, {"content", "Be brief."}});
  CHECK(r->messages[1]["role"] == "user");
}

TEST_CASE("anthropic: system text blocks and leading system messages make one system message", "[anthropic]") {
  auto r = anthropic::ParseMessagesRequest(
      Body({{"system",
             {{{"type", "text"}, {"text", "One."}, {"cache_control", {{"type", "ephemeral"}, {"ttl", "1h"}}}},
              {{"type", "text"}, {"text", "Two."}, {"citations", nullptr}}}},
            {"messages",
             {{{"role", "system"}, {"content", "Three."}},
              {{"role", "user"},
               {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}}}}}),
      {});
  REQUIRE(r.ok());
  CHECK(r->messages == ojson::array({{{"role", "system"}, {"content", "One.\n\nTwo.\n\nThree."}},
                                     {{"role", "user"}, {"content", "a\n\nb"}}}));
}

TEST_CASE("anthropic: thinking sets the template's thinking mode", "[anthropic]") {
  auto mode = [](const ojson& thinking) {
    auto r = anthropic::ParseMessagesRequest(Body({{"thinking", thinking}}), {});
    REQUIRE(r.ok());
    return r->template_options["thinking_mode"].get<std::string>();
  };
  CHECK(mode({{"type", "enabled"}, {"budget_tokens", 2048}}) == "enabled");
  CHECK(anthropic::ParseMessagesRequest(Body({{"thinking", {{"type", "enabled"}, {"budget_tokens", 2048}}}}), {})
            ->output.reasoning_budget == 2048);
  CHECK(mode({{"type", "enabled"}, {"budget_tokens", 2048}, {"display", "summarized"}}) == "enabled");
  CHECK(mode({{"type", "adaptive"}}) == "adaptive");
  CHECK(mode({{"type", "disabled"}}) == "disabled");
  CHECK(mode(nullptr) == "disabled");
  CHECK_THAT(Error(Body({{"thinking", {{"type", "enabled"}}}})), Contains("\"thinking.budget_tokens\" is required"));
  CHECK_THAT(Error(Body({{"thinking", {{"type", "enabled"}, {"budget_tokens", 0}}}})),
             Contains("\"thinking.budget_tokens\" must be"));
  CHECK_THAT(Error(Body({{"thinking", {{"type", "between_tools"}}}})), Contains("\"thinking.type\" 'between_tools'"));
  CHECK_THAT(Error(Body({{"thinking", {{"type", "adaptive"}, {"display", "omitted"}}}})),
             Contains("\"thinking.display\""));
  CHECK_THAT(Error(Body({{"thinking", {{"type", "disabled"}, {"budget_tokens", 5}}}})),
             Contains("\"thinking.budget_tokens\""));
  CHECK_THAT(Error(Body({{"thinking", "on"}})), Contains("\"thinking\" must be an object"));
}

TEST_CASE("anthropic: tools in OpenAI's form, tool_choice in the request's output", "[anthropic]") {
  ojson tool = kWeatherTool;
  tool["cache_control"] = {{"type", "ephemeral"}};
  tool["type"] = "custom";
  auto r = anthropic::ParseMessagesRequest(Body({{"tools", {tool}}}), {});
  REQUIRE(r.ok());
  CHECK(r->tools == ojson::array({{{"type", "function"},
                                   {"function",
                                    {{"name", "get_weather"},
                                     {"description", "Weather of a city"},
                                     {"parameters", kWeatherTool["input_schema"]}}}}}));
  // The template's tools section renders the function object, key order kept.
  auto choice = [](const ojson& tool_choice) -> ojson {
    auto r = anthropic::ParseMessagesRequest(Body({{"tools", {kWeatherTool}}, {"tool_choice", tool_choice}}), {});
    if (!r.ok()) return r.status().message();
    using Choice = m3::OutputSpec::ToolChoice;
    const m3::OutputSpec& o = r->output;
    const ojson forced = o.tool_choice == Choice::kAuto       ? ojson("auto")
                         : o.tool_choice == Choice::kRequired ? ojson("required")
                                                              : ojson{{"name", o.tool_name}};
    return {{"tool_choice", forced}, {"parallel", o.parallel_tool_calls}, {"tools", !r->tools.is_null()}};
  };
  CHECK(choice({{"type", "auto"}}) == ojson{{"tool_choice", "auto"}, {"parallel", true}, {"tools", true}});
  // "none" withholds the tools, as the OpenAI parser does ("auto" then: nothing is forced).
  CHECK(choice({{"type", "none"}}) == ojson{{"tool_choice", "auto"}, {"parallel", true}, {"tools", false}});
  CHECK(choice({{"type", "any"}}) == ojson{{"tool_choice", "required"}, {"parallel", true}, {"tools", true}});
  CHECK(choice({{"type", "tool"}, {"name", "get_weather"}, {"disable_parallel_tool_use", true}}) ==
        ojson{{"tool_choice", {{"name", "get_weather"}}}, {"parallel", false}, {"tools", true}});
  CHECK(choice({{"type", "auto"}, {"disable_parallel_tool_use", true}})["parallel"] == false);
  CHECK(choice({{"type", "auto"}, {"disable_parallel_tool_use", false}})["parallel"] == true);
  CHECK_THAT(choice({{"type", "tool"}, {"name", "other"}}).get<std::string>(),
             Contains("\"tool_choice.name\" 'other' is not one of the tools"));
  CHECK_THAT(choice({{"type", "tool"}}).get<std::string>(), Contains("\"tool_choice.name\" is required"));
  CHECK_THAT(choice({{"type", "sometimes"}}).get<std::string>(), Contains("\"tool_choice.type\" 'sometimes'"));
  CHECK_THAT(choice("auto").get<std::string>(), Contains("\"tool_choice\" must be an object"));
  CHECK_THAT(Error(Body({{"tool_choice", {{"type", "any"}}}})), Contains("needs \"tools\""));
  CHECK_THAT(Error(Body({{"tools", {kWeatherTool}}, {"tool_choice", {{"type", "any"}}}, {"stop_sequences", {"x"}}})),
             Contains("\"stop_sequences\" cannot be combined with a forced tool call"));
}

TEST_CASE("anthropic: tools that are not custom tools are refused by name", "[anthropic]") {
  CHECK_THAT(Error(Body({{"tools", {{{"type", "web_search_20250305"}, {"name", "web_search"}}}}})),
             Contains("\"tools[0].type\" \"web_search_20250305\" is not supported"));
  CHECK_THAT(Error(Body({{"tools", {{{"type", "bash_20250124"}, {"name", "bash"}}}}})),
             Contains("\"tools[0].type\" \"bash_20250124\""));
  CHECK_THAT(Error(Body({{"tools", {{{"name", "f"}}}}})), Contains("\"tools[0].input_schema\""));
  CHECK_THAT(Error(Body({{"tools", {{{"name", "f"}, {"input_schema", {{"type", "array"}}}}}}})),
             Contains("\"tools[0].input_schema\""));
  CHECK_THAT(Error(Body({{"tools", {{{"name", "a b"}, {"input_schema", {{"type", "object"}}}}}}})),
             Contains("\"tools[0].name\""));
  CHECK_THAT(Error(Body({{"tools", {kWeatherTool, kWeatherTool}}})), Contains("\"tools[1].name\": another tool"));
  ojson examples = kWeatherTool;
  examples["input_examples"] = {{{"city", "Oslo"}}};
  CHECK_THAT(Error(Body({{"tools", {examples}}})), Contains("\"tools[0].input_examples\" is not supported"));
  ojson deferred = kWeatherTool;
  deferred["defer_loading"] = true;
  CHECK_THAT(Error(Body({{"tools", {deferred}}})), Contains("\"tools[0].defer_loading\" is not supported"));
  ojson callers = kWeatherTool;
  callers["allowed_callers"] = {"code_execution_20250825"};
  CHECK_THAT(Error(Body({{"tools", {callers}}})), Contains("\"tools[0].allowed_callers\""));
  CHECK_THAT(Error(Body({{"tools", kWeatherTool}})), Contains("\"tools\" must be an array"));
}

TEST_CASE("anthropic: a tool_use / tool_result round trip becomes tool calls and tool messages", "[anthropic]") {
  auto r = anthropic::ParseMessagesRequest(Body({{"messages", RoundTrip()}, {"tools", {kWeatherTool}}}), {});
  REQUIRE(r.ok());
  const ojson& m = r->messages;
  REQUIRE(m.size() == 5);
  CHECK(m[1] == ojson{{"role", "assistant"},
                      {"content", "Let me look."},
                      {"reasoning_content", "Two cities."},
                      {"tool_calls",
                       {{{"id", "toolu_1"},
                         {"type", "function"},
                         {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Paris"}}}}}},
                        {{"id", "toolu_2"},
                         {"type", "function"},
                         {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Rome"}}}}}}}}});
  // In the order of the calls, whatever the order of the results.
  CHECK(m[2] == ojson{{"role", "tool"}, {"tool_call_id", "toolu_1"}, {"content", "Paris: rain"}});
  CHECK(m[3] == ojson{{"role", "tool"}, {"tool_call_id", "toolu_2"}, {"content", "Rome: sun"}});
  CHECK(m[4] == ojson{{"role", "user"}, {"content", "And tomorrow?"}});

  // The template renders it: reasoning, the calls as markup, both results under one tool header.
  auto text = m3::ChatText::Load(m3::test::TokenizerDir(), /*require_template=*/true);
  REQUIRE(text.ok());
  auto rendered = (*text)->Render(r->messages, r->tools, r->template_options);
  REQUIRE(rendered.ok());
  CHECK_THAT(*rendered, Contains("<mm:think>Two cities.</mm:think>Let me look.]<]minimax[>[<tool_call>"));
  CHECK_THAT(*rendered, Contains("<invoke name=\"get_weather\">]<]minimax[>[<city>Paris]<]minimax[>[</city>"));
  CHECK_THAT(*rendered, Contains("]~b]tool\n<response>Paris: rain</response>\n<response>Rome: sun</response>[e~["));
  CHECK_THAT(*rendered, Contains("<tool>{\"name\": \"get_weather\""));
  CHECK_THAT(*rendered, Contains("Current thinking mode: disabled"));

  // A failed call: the model reads that it failed.
  ojson failed = RoundTrip();
  failed[2]["content"][0]["is_error"] = true;
  r = anthropic::ParseMessagesRequest(Body({{"messages", failed}}), {});
  REQUIRE(r.ok());
  CHECK(r->messages[2]["content"] == "Paris: rain");
  CHECK(r->messages[3]["content"] == "Error: Rome: sun");
}

TEST_CASE("anthropic: tool results must answer the calls just before them", "[anthropic]") {
  ojson missing = RoundTrip();
  missing[2]["content"].erase(0);  // toolu_2 unanswered
  CHECK_THAT(Error(Body({{"messages", missing}})), Contains("tool_use 'toolu_2' of messages[1] has no tool_result"));
  ojson stranger = RoundTrip();
  stranger[2]["content"][0]["tool_use_id"] = "toolu_9";
  CHECK_THAT(Error(Body({{"messages", stranger}})),
             Contains("\"messages[2].content[0].tool_use_id\" 'toolu_9' answers no tool_use block"));
  ojson twice = RoundTrip();
  twice[2]["content"][1]["tool_use_id"] = "toolu_2";
  CHECK_THAT(Error(Body({{"messages", twice}})), Contains("'toolu_2' is answered twice"));
  ojson text_only = RoundTrip();
  text_only[2]["content"] = "no results";
  CHECK_THAT(Error(Body({{"messages", text_only}})), Contains("need their tool_result blocks"));
  ojson early = ojson::array(
      {{{"role", "user"}, {"content", {{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}, {"content", "x"}}}}}});
  CHECK_THAT(Error(Body({{"messages", early}})), Contains("answers no tool_use block"));
  ojson dup = RoundTrip();
  dup[1]["content"][3]["id"] = "toolu_1";
  CHECK_THAT(Error(Body({{"messages", dup}})), Contains("\"messages[1].content[3].id\" 'toolu_1' is used by another"));
  ojson bad_input = RoundTrip();
  bad_input[1]["content"][2]["input"] = "{\"city\": \"Paris\"}";
  CHECK_THAT(Error(Body({{"messages", bad_input}})), Contains("\"messages[1].content[2].input\" must be an object"));
  ojson image_result = RoundTrip();
  image_result[2]["content"][1]["content"] = {{{"type", "image"}, {"source", {{"type", "url"}, {"url", "x"}}}}};
  CHECK_THAT(Error(Body({{"messages", image_result}})),
             Contains("\"messages[2].content[1].content[0].type\" 'image' is not supported"));
}

TEST_CASE("anthropic: unsupported fields and blocks are refused by name", "[anthropic]") {
  CHECK_THAT(Error(Body({{"frequency_penalty", 0.5}})), Contains("\"frequency_penalty\" is not supported"));
  CHECK_THAT(Error(Body({{"container", nullptr}})), Contains("\"container\" is not supported"));
  CHECK_THAT(Error(Body({{"mcp_servers", ojson::array()}})), Contains("\"mcp_servers\" is not supported"));
  CHECK_THAT(Error(Body({{"max_tokens", nullptr}})), Contains("\"max_tokens\" is required"));
  CHECK_THAT(Error(Body({{"max_tokens", 0}})), Contains("\"max_tokens\" must be 1.."));
  CHECK_THAT(Error(Body({{"max_tokens", "9"}})), Contains("\"max_tokens\" must be an integer"));
  CHECK_THAT(Error(Body({{"model", 3}})), Contains("\"model\" is required"));
  CHECK_THAT(Error(Body({{"temperature", "hot"}})), Contains("\"temperature\" must be a number"));
  CHECK_THAT(Error(Body({{"temperature", -1}})), Contains("temperature"));
  CHECK_THAT(Error(Body({{"top_k", 1.5}})), Contains("\"top_k\" must be an integer"));
  CHECK_THAT(Error(Body({{"stream", "yes"}})), Contains("\"stream\" must be true or false"));
  CHECK_THAT(Error(Body({{"stop_sequences", "END"}})), Contains("\"stop_sequences\" must be an array"));
  CHECK_THAT(Error(Body({{"stop_sequences", {""}}})), Contains("\"stop_sequences\" must hold non-empty strings"));
  CHECK_THAT(Error(Body({{"stop_sequences", std::vector<std::string>(65, "x")}})), Contains("at most 64"));
  CHECK_THAT(Error(Body({{"metadata", {{"user_id", "u"}, {"session", "s"}}}})),
             Contains("\"metadata.session\" is not supported"));
  CHECK_THAT(Error(Body({{"metadata", {{"user_id", 5}}}})), Contains("\"metadata.user_id\" must be a string"));
  CHECK_THAT(Error(Body({{"service_tier", "priority"}})), Contains("\"service_tier\""));
  CHECK_THAT(Error(Body({{"cache_control", {{"type", "persistent"}}}})), Contains("\"cache_control\" must be"));
  CHECK_THAT(Error(Body({{"output_config", {{"effort", "high"}}}})),
             Contains("\"output_config.effort\" is not supported"));
  auto format = anthropic::ParseMessagesRequest(
      Body({{"output_config", {{"format", {{"type", "json_schema"}, {"schema", {{"type", "object"}}}}}}}}), {});
  REQUIRE(format.ok());
  CHECK(format->output.answer == m3::OutputSpec::Answer::kJsonSchema);
  CHECK(format->output.schema == ojson{{"type", "object"}});
  CHECK_THAT(Error(Body({{"output_config", {{"format", {{"type", "text"}}}}}})),
             Contains("\"output_config.format\" must be"));
  CHECK_THAT(Error(Body({{"system", 5}})), Contains("\"system\" must be a string or an array of text blocks"));
  CHECK_THAT(Error(Body({{"system", {{{"type", "image"}}}}})), Contains("\"system[0].type\" 'image'"));
  CHECK_THAT(Error(ojson::array()), Contains("must be a JSON object"));

  auto user = [](const ojson& block) {
    return Body({{"messages", {{{"role", "user"}, {"content", ojson::array({block})}}}}});
  };
  CHECK_THAT(Error(user({{"type", "image"}, {"source", {{"type", "base64"}}}})),
             Contains("\"messages[0].content[0].type\" 'image' is not supported: this server runs a text-only model"));
  CHECK_THAT(Error(user({{"type", "document"}, {"source", {{"type", "text"}}}})),
             Contains("\"messages[0].content[0].type\" 'document' is not supported"));
  CHECK_THAT(Error(user({{"type", "tool_use"}, {"id", "a"}, {"name", "f"}, {"input", ojson::object()}})),
             Contains("'tool_use' is not supported in a user message"));
  CHECK_THAT(Error(user({{"type", "text"}, {"text", "x"}, {"citations", {{{"type", "char_location"}}}}})),
             Contains("\"messages[0].content[0].citations\" are not supported"));
  CHECK_THAT(Error(user({{"type", "text"}, {"text", 5}})),
             Contains("\"messages[0].content[0].text\" must be a string"));
  CHECK_THAT(Error(user({{"type", "text"}, {"text", "x"}, {"extra", 1}})),
             Contains("\"messages[0].content[0].extra\" is not supported"));
  CHECK_THAT(Error(user("plain")), Contains("\"messages[0].content[0]\" must be an object with a \"type\""));

  auto assistant = [](const ojson& block) {
    return Body({{"messages",
                  {{{"role", "user"}, {"content", "a"}},
                   {{"role", "assistant"}, {"content", ojson::array({block})}},
                   {{"role", "user"}, {"content", "b"}}}}});
  };
  CHECK_THAT(Error(assistant({{"type", "redacted_thinking"}, {"data", "xyz"}})),
             Contains("\"messages[1].content[0].type\" 'redacted_thinking' is not supported"));
  CHECK_THAT(
      Error(assistant({{"type", "server_tool_use"}, {"id", "s"}, {"name", "web_search"}, {"input", ojson::object()}})),
      Contains("'server_tool_use' is not supported: this server runs no server tools"));
  CHECK_THAT(Error(assistant({{"type", "web_search_tool_result"}, {"tool_use_id", "s"}, {"content", ojson::array()}})),
             Contains("'web_search_tool_result' is not supported"));
  CHECK_THAT(Error(assistant({{"type", "thinking"}, {"signature", "s"}})),
             Contains("\"messages[1].content[0].thinking\" is required"));
  CHECK(Error(assistant({{"type", "text"}, {"text", "x"}, {"citations", nullptr}})) == "accepted");

  CHECK_THAT(Error(Body({{"messages", ojson::array()}})), Contains("\"messages\" must be a non-empty array"));
  CHECK_THAT(Error(Body({{"messages", {{{"role", "bot"}, {"content", "x"}}}}})),
             Contains("\"messages[0].role\" 'bot'"));
  CHECK_THAT(Error(Body({{"messages", {{{"role", "user"}}}}})), Contains("\"messages[0].content\" must be"));
  CHECK_THAT(Error(Body({{"messages", {{{"role", "user"}, {"content", "x"}, {"name", "n"}}}}})),
             Contains("\"messages[0].name\" is not supported"));
  CHECK_THAT(
      Error(Body({{"messages", {{{"role", "user"}, {"content", "x"}}, {{"role", "assistant"}, {"content", "Sure"}}}}})),
      Contains("a prefill, is not supported"));
  CHECK_THAT(
      Error(Body({{"messages", {{{"role", "user"}, {"content", "x"}}, {{"role", "system"}, {"content", "late"}}}}})),
      Contains("\"messages[1].role\": a system message may only come before"));
}

TEST_CASE("anthropic: count_tokens takes the prompt's fields only", "[anthropic]") {
  ojson body = {{"model", "m3"},
                {"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                {"system", "S"},
                {"tools", {kWeatherTool}},
                {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}}};
  auto r = anthropic::ParseMessagesRequest(body, {}, /*count_tokens=*/true);
  REQUIRE(r.ok());
  CHECK(r->template_options["thinking_mode"] == "enabled");
  CHECK(r->tools.size() == 1);
  body["max_tokens"] = 5;
  CHECK_THAT(Error(body, true), Contains("\"max_tokens\" is not supported"));
  body.erase("max_tokens");
  body["stream"] = true;
  CHECK_THAT(Error(body, true), Contains("\"stream\" is not supported"));
}

GenerateStats Stats(const char* stop_reason, size_t prompt = 12, size_t reused = 4, size_t generated = 7) {
  GenerateStats st;
  st.prompt_tokens = prompt;
  st.reused_tokens = reused;
  st.generated_tokens = generated;
  st.stop_reason = stop_reason;
  return st;
}

ParsedOutput Output(bool reasoning, bool content, size_t calls) {
  ParsedOutput out;
  if (reasoning) out.reasoning = "hmm";
  if (content) out.content = "Hello";
  for (size_t i = 0; i < calls; ++i)
    out.tool_calls.push_back({"toolu_x_" + std::to_string(i), "get_weather", {{"city", "Paris"}, {"days", 3}}});
  return out;
}

TEST_CASE("anthropic: stop reasons, stop sequence and usage", "[anthropic]") {
  CHECK(anthropic::StopReason(Stats("stop"), Output(false, true, 0)) == "end_turn");
  CHECK(anthropic::StopReason(Stats("caller"), Output(false, true, 0)) == "end_turn");
  CHECK(anthropic::StopReason(Stats("stop"), Output(false, true, 1)) == "tool_use");
  CHECK(anthropic::StopReason(Stats("length"), Output(false, true, 1)) == "max_tokens");
  CHECK(anthropic::StopReason(Stats("context"), Output(false, true, 0)) == "model_context_window_exceeded");
  GenerateStats st = Stats("stop");
  st.stop_string = "END";
  CHECK(anthropic::StopReason(st, Output(false, true, 0)) == "stop_sequence");
  CHECK(anthropic::StopSequence(st) == "END");
  CHECK(anthropic::StopSequence(Stats("stop")).is_null());
  CHECK(anthropic::Usage(Stats("stop")) == ojson{{"input_tokens", 8},
                                                 {"output_tokens", 7},
                                                 {"cache_creation_input_tokens", 0},
                                                 {"cache_read_input_tokens", 4}});
}

TEST_CASE("anthropic: a whole reply", "[anthropic]") {
  const ojson msg = anthropic::MessageResponse("msg_1", "tiny", Output(true, true, 2), Stats("stop"));
  CHECK(msg == ojson{{"id", "msg_1"},
                     {"type", "message"},
                     {"role", "assistant"},
                     {"model", "tiny"},
                     {"content",
                      {{{"type", "thinking"}, {"thinking", "hmm"}, {"signature", ""}},
                       {{"type", "text"}, {"text", "Hello"}},
                       {{"type", "tool_use"},
                        {"id", "toolu_x_0"},
                        {"name", "get_weather"},
                        {"input", {{"city", "Paris"}, {"days", 3}}}},
                       {{"type", "tool_use"},
                        {"id", "toolu_x_1"},
                        {"name", "get_weather"},
                        {"input", {{"city", "Paris"}, {"days", 3}}}}}},
                     {"stop_reason", "tool_use"},
                     {"stop_sequence", nullptr},
                     {"usage", anthropic::Usage(Stats("stop"))}});
  GenerateStats st = Stats("stop");
  st.stop_string = "\n\n";
  const ojson cut = anthropic::MessageResponse("msg_2", "tiny", Output(false, true, 0), st);
  CHECK(cut["content"] == ojson::array({{{"type", "text"}, {"text", "Hello"}}}));
  CHECK(cut["stop_reason"] == "stop_sequence");
  CHECK(cut["stop_sequence"] == "\n\n");
  CHECK(anthropic::MessageResponse("msg_3", "tiny", ParsedOutput{}, Stats("length"))["content"] == ojson::array());
  m3::ChoiceResult choice;
  choice.output = Output(false, true, 0);
  choice.stats = Stats("stop");
  auto whole = anthropic::WholeMessage("msg_4", "tiny", choice);
  REQUIRE(whole.ok());
  CHECK(*whole == anthropic::MessageResponse("msg_4", "tiny", choice.output, choice.stats));
  choice.status = m3::Status(m3::StatusCode::kUnavailable, "draining");
  CHECK(anthropic::WholeMessage("msg_4", "tiny", choice).status().message() == "draining");
}

TEST_CASE("anthropic: a streamed reply as Anthropic's events", "[anthropic]") {
  anthropic::MessageStream stream("msg_1", "tiny", 12);
  std::vector<anthropic::Event> events = stream.Start();
  auto add = [&](std::vector<anthropic::Event> more) { events.insert(events.end(), more.begin(), more.end()); };
  TurnDelta d;
  d.reasoning = "Let me ";
  add(stream.Next(d));
  d.reasoning = "think.";
  add(stream.Next(d));
  d.reasoning = "";  // a piece that closes the reasoning and starts the answer
  d.reasoning = "";
  TurnDelta both;
  both.reasoning = "!";
  both.content = "Hi";
  add(stream.Next(both));
  TurnDelta text;
  text.content = " there";
  add(stream.Next(text));
  TurnDelta calls;
  calls.tool_calls = Output(false, false, 2).tool_calls;
  add(stream.Next(calls));
  add(stream.Finish(Stats("stop"), Output(true, true, 2)));

  std::vector<std::string> names;
  for (const auto& e : events) names.push_back(e.name);
  CHECK(names == std::vector<std::string>{"message_start", "ping", "content_block_start", "content_block_delta",
                                          "content_block_delta", "content_block_delta", "content_block_stop",
                                          "content_block_start", "content_block_delta", "content_block_delta",
                                          "content_block_stop", "content_block_start", "content_block_delta",
                                          "content_block_stop", "content_block_start", "content_block_delta",
                                          "content_block_stop", "message_delta", "message_stop"});
  for (const auto& e : events) CHECK(e.data["type"] == e.name);
  CHECK(events[0].data["message"] == ojson{{"id", "msg_1"},
                                           {"type", "message"},
                                           {"role", "assistant"},
                                           {"model", "tiny"},
                                           {"content", ojson::array()},
                                           {"stop_reason", nullptr},
                                           {"stop_sequence", nullptr},
                                           {"usage",
                                            {{"input_tokens", 12},
                                             {"output_tokens", 0},
                                             {"cache_creation_input_tokens", 0},
                                             {"cache_read_input_tokens", 0}}}});
  CHECK(events[2].data == ojson{{"type", "content_block_start"},
                                {"index", 0},
                                {"content_block", {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}}});
  CHECK(events[3].data == ojson{{"type", "content_block_delta"},
                                {"index", 0},
                                {"delta", {{"type", "thinking_delta"}, {"thinking", "Let me "}}}});
  CHECK(events[5].data["delta"]["thinking"] == "!");
  CHECK(events[6].data == ojson{{"type", "content_block_stop"}, {"index", 0}});
  CHECK(events[7].data["content_block"] == ojson{{"type", "text"}, {"text", ""}});
  CHECK(events[7].data["index"] == 1);
  CHECK(events[8].data["delta"] == ojson{{"type", "text_delta"}, {"text", "Hi"}});
  CHECK(events[9].data["delta"] == ojson{{"type", "text_delta"}, {"text", " there"}});
  CHECK(events[11].data ==
        ojson{{"type", "content_block_start"},
              {"index", 2},
              {"content_block",
               {{"type", "tool_use"}, {"id", "toolu_x_0"}, {"name", "get_weather"}, {"input", ojson::object()}}}});
  CHECK(events[12].data["delta"] ==
        ojson{{"type", "input_json_delta"}, {"partial_json", "{\"city\":\"Paris\",\"days\":3}"}});
  CHECK(events[13].data["index"] == 2);
  CHECK(events[14].data["index"] == 3);
  CHECK(events[14].data["content_block"]["id"] == "toolu_x_1");
  CHECK(events[17].data == ojson{{"type", "message_delta"},
                                 {"delta", {{"stop_reason", "tool_use"}, {"stop_sequence", nullptr}}},
                                 {"usage", anthropic::Usage(Stats("stop"))}});
  CHECK(events[18].data == ojson{{"type", "message_stop"}});
  CHECK(events[18].Text() == "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");

  // A turn with no output at all: no blocks, just the ends.
  anthropic::MessageStream empty("msg_2", "tiny", 3);
  const auto ends = empty.Finish(Stats("length"), ParsedOutput{});
  REQUIRE(ends.size() == 2);
  CHECK(ends[0].data["delta"]["stop_reason"] == "max_tokens");
}

TEST_CASE("anthropic: errors in Anthropic's shape", "[anthropic]") {
  CHECK(anthropic::ErrorBody("\"x\" is bad", 400) ==
        ojson{{"type", "error"}, {"error", {{"type", "invalid_request_error"}, {"message", "\"x\" is bad"}}}});
  CHECK(anthropic::ErrorBody("m", 401)["error"]["type"] == "authentication_error");
  CHECK(anthropic::ErrorBody("m", 403)["error"]["type"] == "permission_error");
  CHECK(anthropic::ErrorBody("m", 404)["error"]["type"] == "not_found_error");
  CHECK(anthropic::ErrorBody("m", 405)["error"]["type"] == "invalid_request_error");
  CHECK(anthropic::ErrorBody("m", 413)["error"]["type"] == "request_too_large");
  CHECK(anthropic::ErrorBody("m", 429)["error"]["type"] == "rate_limit_error");
  CHECK(anthropic::ErrorBody("m", 500)["error"]["type"] == "api_error");
  CHECK(anthropic::ErrorBody("m", 503)["error"]["type"] == "overloaded_error");
  const anthropic::Event e = anthropic::ErrorEvent("busy", 503);
  CHECK(e.Text() ==
        "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"busy\"}}\n\n");
  CHECK(anthropic::IsMessagesPath("/v1/messages"));
  CHECK(anthropic::IsMessagesPath("/v1/messages/count_tokens"));
  CHECK_FALSE(anthropic::IsMessagesPath("/v1/messagesx"));
  CHECK_FALSE(anthropic::IsMessagesPath("/v1/chat/completions"));
}

}  // namespace

TEST_CASE("anthropic: a reply's stream events and whole text, as the server writes them", "[anthropic]") {
  auto format = anthropic::NewReplyFormat("msg_1", "tiny", 12);
  std::vector<std::string> events;
  format->Open(&events);
  REQUIRE(events.size() == 2);
  CHECK(events[0].rfind("event: message_start\ndata: ", 0) == 0);
  CHECK(events[1] == "event: ping\ndata: {\"type\":\"ping\"}\n\n");
  TurnDelta d;
  d.content = "Hello";
  format->Piece(0, d, &events);
  m3::ChoiceResult choice;
  choice.output = Output(false, true, 0);
  choice.stats = Stats("stop");
  format->ChoiceEnd(0, choice, &events);
  const size_t before_close = events.size();
  format->Close({choice}, &events);
  CHECK(events.size() == before_close);  // no [DONE] in Anthropic's stream
  // The same events as MessageStream gives.
  anthropic::MessageStream stream("msg_1", "tiny", 12);
  std::vector<std::string> expected;
  for (auto part : {stream.Start(), stream.Next(d), stream.Finish(choice.stats, choice.output)})
    for (const anthropic::Event& e : part) expected.push_back(e.Text());
  CHECK(events == expected);
  events.clear();
  format->Fail(m3::Status(m3::StatusCode::kUnavailable, "draining"), &events);
  CHECK(events == std::vector<std::string>{anthropic::ErrorEvent("draining", 503).Text()});
  auto whole = format->Whole({choice});
  REQUIRE(whole.ok());
  CHECK(*whole == m3::JsonText(anthropic::MessageResponse("msg_1", "tiny", choice.output, choice.stats)));
}

TEST_CASE("anthropic: count_tokens counts the prompt the template renders", "[anthropic]") {
  auto text = m3::ChatText::Load(m3::test::TokenizerDir(), /*require_template=*/true);
  REQUIRE(text.ok());
  const ojson body = {{"model", "m3"}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  auto count = anthropic::CountTokens(**text, body, {});
  REQUIRE(count.ok());
  auto r = anthropic::ParseMessagesRequest(body, {}, /*count_tokens=*/true);
  REQUIRE(r.ok());
  m3::TurnOptions turn;
  CHECK((*count)["input_tokens"] == (*text)->TurnPrompt(r->messages, r->tools, r->template_options, &turn)->size());
  // A constrained reply (a forced tool call) counts too: no context limit applies to counting.
  ojson forced = body;
  forced["tools"] = ojson::array({kWeatherTool});
  forced["tool_choice"] = {{"type", "any"}};
  auto with_tools = anthropic::CountTokens(**text, forced, {});
  INFO(with_tools.status().ToString());
  REQUIRE(with_tools.ok());
  CHECK((*with_tools)["input_tokens"] > (*count)["input_tokens"]);
  auto bad = anthropic::CountTokens(**text, ojson{{"model", "m3"}}, {});
  CHECK(bad.status().code() == m3::StatusCode::kInvalidArgument);
  CHECK_THAT(bad.status().message(), Contains("\"messages\" is required"));
}
