// Output parsing (lib/text/output_parser.cc): reasoning split per thinking mode, tool-call markup
// typed by schema (the spec's examples and every assistant turn in chat_golden.jsonl), malformed
// and unterminated markup, and streaming equivalence under every split of every test text.
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "text/output_parser.h"

namespace {

using m3::ParsedOutput;
using m3::ParseOutput;
using m3::SerializeArguments;
using m3::StreamingOutputParser;
using m3::ThinkState;
using m3::ToolCall;
using nlohmann::json;
using nlohmann::ordered_json;

const std::string kNs = "]<]minimax[>[";

// Markup helpers in the template's exact spelling.
std::string Open(const std::string& tag) { return kNs + "<" + tag + ">"; }
std::string Close(const std::string& tag) { return kNs + "</" + tag + ">"; }
std::string Elem(const std::string& tag, const std::string& body) { return Open(tag) + body + Close(tag); }
std::string Invoke(const std::string& name, const std::string& params) {
  return kNs + "<invoke name=\"" + name + "\">" + params + Close("invoke") + "\n";
}
std::string Block(const std::string& invokes) { return Open("tool_call") + "\n" + invokes + Close("tool_call"); }

json Tools() {
  return json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                     "unit": {"type": "string", "enum": ["C", "F"]}}}}},
    {"type": "function", "function": {"name": "web_search", "parameters": {"type": "object",
      "properties": {"query": {"type": "string"},
                     "filters": {"type": "object", "properties": {"site": {"type": "string"},
                                 "recent": {"type": "boolean"}, "max_results": {"type": "integer"}}},
                     "languages": {"type": "array", "items": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "plot_points", "parameters": {"type": "object",
      "properties": {"points": {"type": "array", "items": {"type": "object",
                       "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
                     "style": {"type": "object", "properties": {"color": {"type": "string"},
                                                               "width": {"type": "number"}}},
                     "title": {"type": ["string", "null"]}}}}},
    {"name": "typed", "parameters": {"type": "object", "properties": {
      "s": {"type": "string"}, "ns": {"type": ["string", "null"]}, "i": {"type": "integer"},
      "n": {"type": "number"}, "b": {"type": "BOOLEAN"}, "o": {"type": "object"},
      "a": {"type": "array"}, "in": {"type": ["integer", "null"]},
      "opt": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
      "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
               "items": {"type": "boolean"}},
      "map": {"type": "object", "additionalProperties": {"type": "integer"}}}}}
  ])");
}

// Every emitted piece must be valid UTF-8 (checked via a strict JSON dump, which throws otherwise).
bool ValidUtf8(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::exception&) {
    return false;
  }
}

struct Streamed {
  ParsedOutput out;
  bool pieces_valid_utf8 = true;
};

void Append(const StreamingOutputParser::Delta& d, Streamed& s) {
  s.pieces_valid_utf8 = s.pieces_valid_utf8 && ValidUtf8(d.reasoning) && ValidUtf8(d.content);
  s.out.reasoning += d.reasoning;
  s.out.content += d.content;
  for (const ToolCall& c : d.tool_calls) {
    (void)SerializeArguments(c.arguments);
    (void)c.arguments.dump();  // must not throw: calls are always serializable
    s.out.tool_calls.push_back(c);
  }
}

// Feeds `text` cut at the given offsets (ascending).
Streamed Stream(const std::string& text, ThinkState initial, const json& tools, const std::vector<size_t>& cuts) {
  StreamingOutputParser parser(initial, tools);
  Streamed s;
  size_t from = 0;
  for (size_t cut : cuts) {
    Append(parser.Push(std::string_view(text).substr(from, cut - from)), s);
    from = cut;
  }
  Append(parser.Push(std::string_view(text).substr(from)), s);
  Append(parser.Finish(), s);
  return s;
}

bool Same(const ParsedOutput& a, const ParsedOutput& b) {
  if (a.reasoning != b.reasoning || a.content != b.content || a.tool_calls.size() != b.tool_calls.size()) return false;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    const ToolCall& x = a.tool_calls[i];
    const ToolCall& y = b.tool_calls[i];
    if (x.id != y.id || x.name != y.name || x.arguments != y.arguments) return false;
  }
  return true;
}

// The streaming property: one cut at every byte, all single bytes, and random 3-5 piece splits.
void CheckStreaming(const std::string& text, ThinkState initial, const json& tools, bool input_is_utf8 = true) {
  const ParsedOutput whole = ParseOutput(text, initial, tools);
  INFO("text: " << text);
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    const Streamed s = Stream(text, initial, tools, {cut});
    INFO("cut at " << cut);
    REQUIRE(Same(s.out, whole));
    if (input_is_utf8) REQUIRE(s.pieces_valid_utf8);
  }
  std::vector<size_t> every_byte;
  for (size_t i = 1; i < text.size(); ++i) every_byte.push_back(i);
  const Streamed bytes = Stream(text, initial, tools, every_byte);
  REQUIRE(Same(bytes.out, whole));
  if (input_is_utf8) REQUIRE(bytes.pieces_valid_utf8);
  std::mt19937 rng(static_cast<uint32_t>(text.size()));
  for (int trial = 0; trial < 50 && !text.empty(); ++trial) {
    std::vector<size_t> cuts;
    for (int k = 0; k < 4; ++k) cuts.push_back(rng() % (text.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    REQUIRE(Same(Stream(text, initial, tools, cuts).out, whole));
  }
}

ParsedOutput Parse(const std::string& text, ThinkState initial = ThinkState::kOutside, const json& tools = Tools()) {
  CheckStreaming(text, initial, tools);
  return ParseOutput(text, initial, tools);
}

// ---------------------------------------------------------------------------------------------

TEST_CASE("reasoning: thinking enabled (prompt opened <mm:think>)", "[output_parser]") {
  ParsedOutput out = Parse("plan step 1\nstep 2</mm:think>answer", ThinkState::kInside);
  CHECK(out.reasoning == "plan step 1\nstep 2");
  CHECK(out.content == "answer");
  CHECK(out.tool_calls.empty());

  out = Parse("still thinking <mm:", ThinkState::kInside);  // unterminated: all reasoning
  CHECK(out.reasoning == "still thinking <mm:");
  CHECK(out.content.empty());

  // A nested opener is not special; after the block, openers are plain content.
  out = Parse("a<mm:think>b</mm:think>c<mm:think>d</mm:think>e", ThinkState::kInside);
  CHECK(out.reasoning == "a<mm:think>b");
  CHECK(out.content == "c<mm:think>d</mm:think>e");

  out = Parse("</mm:think>", ThinkState::kInside);
  CHECK(out.reasoning.empty());
  CHECK(out.content.empty());
}

TEST_CASE("reasoning: adaptive / disabled / unset (no open block)", "[output_parser]") {
  ParsedOutput out = Parse("<mm:think>plan</mm:think>answer");
  CHECK(out.reasoning == "plan");
  CHECK(out.content == "answer");

  out = Parse("</mm:think>answer");  // leading closer (disabled prefix echoed) is dropped
  CHECK(out.reasoning.empty());
  CHECK(out.content == "answer");

  out = Parse("plain answer");
  CHECK(out.reasoning.empty());
  CHECK(out.content == "plain answer");

  out = Parse("XXX</mm:think>YYY");  // a later closer without opener stays visible
  CHECK(out.content == "XXX</mm:think>YYY");

  out = Parse("<mm:think>still thinking");
  CHECK(out.reasoning == "still thinking");
  CHECK(out.content.empty());

  // An opener after some content still opens the (single) reasoning span; text around it joins.
  out = Parse("Hi <mm:think>hmm</mm:think> there <mm:think>x</mm:think>");
  CHECK(out.reasoning == "hmm");
  CHECK(out.content == "Hi  there <mm:think>x</mm:think>");

  out = Parse("<mm:think>a</mm:think>b<mm:think>c</mm:think>d");
  CHECK(out.reasoning == "a");
  CHECK(out.content == "b<mm:think>c</mm:think>d");

  // No trimming anywhere (rule 7).
  out = Parse("<mm:think>\nthink\n</mm:think>  answer  ");
  CHECK(out.reasoning == "\nthink\n");
  CHECK(out.content == "  answer  ");

  // Cut-off markers at the end are plain text.
  CHECK(Parse("</mm:thi").content == "</mm:thi");
  CHECK(Parse("answer <mm:th").content == "answer <mm:th");
  CHECK(Parse("<mm:think>x</mm:thi").reasoning == "x</mm:thi");
  CHECK(Parse("").content.empty());

  out = Parse("<mm:think>思考 👋</mm:think>café — ¿qué?");
  CHECK(out.reasoning == "思考 👋");
  CHECK(out.content == "café — ¿qué?");
}

TEST_CASE("tool calls: spec example 1 (scalar arguments typed by schema)", "[output_parser]") {
  const std::string text = Block(Invoke("get_weather", Elem("city", "Paris") + Elem("days", "3")));
  ParsedOutput out = Parse(text);
  CHECK(out.content.empty());
  REQUIRE(out.tool_calls.size() == 1);
  CHECK(out.tool_calls[0].id == "call_0");
  CHECK(out.tool_calls[0].name == "get_weather");
  CHECK(SerializeArguments(out.tool_calls[0].arguments) == R"({"city": "Paris", "days": 3})");
  CHECK(out.tool_calls[0].arguments["days"].is_number_integer());

  // After reasoning (enabled mode), as in the tool-call-simple golden.
  out = Parse("I should call get_weather.</mm:think>" + text, ThinkState::kInside);
  CHECK(out.reasoning == "I should call get_weather.");
  CHECK(out.content.empty());
  REQUIRE(out.tool_calls.size() == 1);
}

TEST_CASE("tool calls: spec example 2 (nested object and arrays)", "[output_parser]") {
  const std::string text =
      "Let me search." +
      Block(Invoke("web_search", Elem("query", "fusion energy breakthrough") +
                                     Elem("filters", Elem("site", "example.org") + Elem("recent", "true") +
                                                         Elem("max_results", "5")) +
                                     Elem("languages", Elem("item", "en") + Elem("item", "de"))));
  const ParsedOutput out = Parse(text);
  CHECK(out.content == "Let me search.");
  REQUIRE(out.tool_calls.size() == 1);
  CHECK(SerializeArguments(out.tool_calls[0].arguments) ==
        R"({"query": "fusion energy breakthrough", "filters": {"site": "example.org", "recent": true, )"
        R"("max_results": 5}, "languages": ["en", "de"]})");

  const std::string points =
      Block(Invoke("plot_points",
                   Elem("points", Elem("item", Elem("x", "1") + Elem("y", "2.5")) +
                                      Elem("item", Elem("x", "3") + Elem("y", "-4"))) +
                       Elem("style", Elem("color", "red") + Elem("width", "0.5"))));
  const ParsedOutput p = Parse(points);
  REQUIRE(p.tool_calls.size() == 1);
  CHECK(SerializeArguments(p.tool_calls[0].arguments) ==
        R"({"points": [{"x": 1, "y": 2.5}, {"x": 3, "y": -4}], "style": {"color": "red", "width": 0.5}})");
}

TEST_CASE("tool calls: spec example 3 (several calls in one block) and content around blocks", "[output_parser]") {
  const std::string block = Block(Invoke("get_weather", Elem("city", "Tokyo")) +
                                  Invoke("get_weather", Elem("city", "Berlin") + Elem("unit", "C")));
  ParsedOutput out = Parse(block);
  REQUIRE(out.tool_calls.size() == 2);
  CHECK(out.tool_calls[0].id == "call_0");
  CHECK(out.tool_calls[1].id == "call_1");
  CHECK(out.tool_calls[0].arguments == ordered_json{{"city", "Tokyo"}});
  CHECK(out.tool_calls[1].arguments == ordered_json{{"city", "Berlin"}, {"unit", "C"}});

  out = Parse("before " + block + " middle " + Block(Invoke("get_time", "")) + " after");
  CHECK(out.content == "before  middle  after");
  REQUIRE(out.tool_calls.size() == 3);
  CHECK(out.tool_calls[2].name == "get_time");
  CHECK(out.tool_calls[2].arguments == ordered_json::object());
  CHECK(SerializeArguments(out.tool_calls[2].arguments) == "{}");

  // The id prefix is the caller's.
  out = ParseOutput(block, ThinkState::kOutside, Tools(), "call_req7_");
  CHECK(out.tool_calls[1].id == "call_req7_1");
}

TEST_CASE("tool calls: raw strings and whitespace tolerance and unknown tools", "[output_parser]") {
  const std::string html = "<html>\n  <body class=\"x\">Hello & <b>bye</b></body>\n</html>\n";
  ParsedOutput out = Parse(Block(Invoke("write_file", Elem("content", html) + Elem("note", " <mm:think> </mm:think> "))));
  REQUIRE(out.tool_calls.size() == 1);
  CHECK(out.tool_calls[0].arguments["content"] == html);  // unknown tool: strings kept as written
  CHECK(out.tool_calls[0].arguments["note"] == " <mm:think> </mm:think> ");
  CHECK(out.reasoning.empty());

  // Whitespace between the namespace token and '<' is tolerated, also between elements.
  out = Parse(kNs + " \n<tool_call>\n" + kNs + "\n<invoke name=\"get_weather\">\n" + kNs + " <city>Oslo" + kNs +
              "\t</city>\n" + kNs + "</invoke>\n" + kNs + " </tool_call>");
  REQUIRE(out.tool_calls.size() == 1);
  CHECK(out.tool_calls[0].arguments == ordered_json{{"city", "Oslo"}});

  // No tools given: every leaf stays a string; <item> children still make an array.
  out = Parse(Block(Invoke("f", Elem("n", "3") + Elem("l", Elem("item", "1") + Elem("item", "x")) +
                                    Elem("o", Elem("k", "true")) + Elem("e", ""))),
              ThinkState::kOutside, nullptr);
  REQUIRE(out.tool_calls.size() == 1);
  CHECK(SerializeArguments(out.tool_calls[0].arguments) == R"({"n": "3", "l": ["1", "x"], "o": {"k": "true"}, "e": ""})");

  out = Parse("我来查 " + Block(Invoke("get_weather", Elem("city", "東京 🗼"))));
  CHECK(out.content == "我来查 ");
  CHECK(SerializeArguments(out.tool_calls[0].arguments) == "{\"city\": \"東京 🗼\"}");
}

TEST_CASE("tool calls: leaf typing rules", "[output_parser]") {
  auto args = [](const std::string& params) {
    const ParsedOutput out = Parse(Block(Invoke("typed", params)));
    REQUIRE(out.tool_calls.size() == 1);
    return SerializeArguments(out.tool_calls[0].arguments);
  };
  CHECK(args(Elem("s", " 3 ")) == R"({"s": " 3 "})");
  CHECK(args(Elem("s", "null")) == R"({"s": "null"})");
  CHECK(args(Elem("s", "")) == R"({"s": ""})");
  CHECK(args(Elem("ns", "null") + Elem("in", "NULL") + Elem("opt", "")) == R"({"ns": null, "in": null, "opt": null})");
  CHECK(args(Elem("ns", "none")) == R"({"ns": "none"})");
  CHECK(args(Elem("i", " -42 ") + Elem("in", "7") + Elem("opt", "+8")) == R"({"i": -42, "in": 7, "opt": 8})");
  CHECK(args(Elem("i", "3.0") + Elem("i", "abc")) == R"({"i": ["3.0", "abc"]})");  // repeated key -> list
  CHECK(args(Elem("n", "2.0")) == R"({"n": 2})");
  CHECK(args(Elem("n", "1e3")) == R"({"n": 1000})");
  CHECK(args(Elem("n", "-0.25")) == R"({"n": -0.25})");
  CHECK(args(Elem("n", ".5")) == R"({"n": 0.5})");
  CHECK(args(Elem("n", "inf")) == R"({"n": "inf"})");
  CHECK(args(Elem("n", "0x10")) == R"({"n": "0x10"})");
  CHECK(args(Elem("b", "Yes") + Elem("b", "off")) == R"({"b": [true, false]})");
  CHECK(args(Elem("b", "maybe")) == R"({"b": "maybe"})");
  CHECK(args(Elem("o", "") + Elem("a", "")) == R"({"o": {}, "a": []})");
  CHECK(args(Elem("o", R"({"k": [1, 2]})") + Elem("a", "[1, \"x\"]")) == R"({"o": {"k": [1, 2]}, "a": [1, "x"]})");
  CHECK(args(Elem("o", "not json")) == R"({"o": "not json"})");
  CHECK(args(Elem("o", Elem("item", "1"))) == R"({"o": {"item": "1"}})");  // schema says object
  CHECK(args(Elem("pair", Elem("item", "5") + Elem("item", "5") + Elem("item", "true"))) ==
        R"({"pair": [5, "5", true]})");
  CHECK(args(Elem("map", Elem("x", "1") + Elem("y", "two"))) == R"({"map": {"x": 1, "y": "two"}})");
  CHECK(args(Elem("i", "99999999999999999999999")) == R"({"i": "99999999999999999999999"})");
  CHECK(args(Elem("s", Elem("inner", "v"))) == R"({"s": {"inner": "v"}})");  // nested body wins
}

TEST_CASE("tool calls: malformed or unterminated markup falls back to content", "[output_parser]") {
  const std::vector<std::string> bad_blocks = {
      Block(""),                                                                   // no invoke
      Block(Invoke("get_weather", Open("city") + "Paris" + Close("town"))),         // mismatched close
      Block(Invoke("get_weather", Open("city") + "Paris")),                         // element never closed
      Block(Invoke("get_weather", Elem("city", "a") + "junk")),                     // text between elements
      Block(Invoke("get_weather", Open("o") + "text" + Elem("k", "v") + Close("o"))),  // mixed content
      Block("junk" + Invoke("get_weather", Elem("city", "a"))),                     // junk before invoke
      Block(kNs + "<invoke name=\"\">" + Close("invoke")),                          // empty name
      Block(kNs + "<invoke>" + Close("invoke")),                                    // no name attribute
      Block(kNs + "<invoke name=\"f\"" + Close("invoke")),                         // tag without '>'
      Block(Invoke("f", kNs + "<>" + Close(""))),                                  // empty tag name
      Block(Invoke("f", Close("x"))),                                               // stray close
      Block(Invoke("f", Elem("a", "1")) + Close("invoke")),                         // extra close
      Block(Invoke("f", Elem("a", "x" + kNs + "y"))),                               // bare namespace token
      Block(Invoke("f", Elem("a", "\xff\xfe"))),                                    // invalid UTF-8
  };
  for (const std::string& bad : bad_blocks) {
    const std::string text = "A" + bad + "B";
    INFO(text);
    CheckStreaming(text, ThinkState::kOutside, Tools(), /*input_is_utf8=*/ValidUtf8(text));
    const ParsedOutput out = ParseOutput(text, ThinkState::kOutside, Tools());
    CHECK(out.content == text);
    CHECK(out.tool_calls.empty());
  }

  // A malformed block does not spoil a good one before or after it.
  const std::string good = Block(Invoke("get_weather", Elem("city", "Rome")));
  const ParsedOutput mixed = Parse(good + "x" + bad_blocks[1] + good);
  CHECK(mixed.content == "x" + bad_blocks[1]);
  REQUIRE(mixed.tool_calls.size() == 2);
  CHECK(mixed.tool_calls[1].id == "call_1");

  // Unterminated block: everything from the opener on is content, calls included.
  const std::string open = "Sure. " + Open("tool_call") + "\n" + Invoke("get_weather", Elem("city", "Rome"));
  ParsedOutput out = Parse(open);
  CHECK(out.content == open);
  CHECK(out.tool_calls.empty());
  out = Parse(open + kNs + " </tool_ca");
  CHECK(out.content == open + kNs + " </tool_ca");

  // Think markers inside an unterminated block stay in it; namespace token without a block is text.
  out = Parse(Open("tool_call") + "<mm:think>x</mm:think>");
  CHECK(out.content == Open("tool_call") + "<mm:think>x</mm:think>");
  CHECK(out.reasoning.empty());
  out = Parse(kNs + " " + Invoke("get_weather", "") + kNs);
  CHECK(out.content == kNs + " " + Invoke("get_weather", "") + kNs);

  // Deep nesting is refused, not recursed into without bound.
  std::string deep = "v";
  for (int i = 0; i < 200; ++i) deep = Elem("k", deep);
  const std::string deep_text = Block(Invoke("f", deep));
  out = ParseOutput(deep_text, ThinkState::kOutside, nullptr);
  CHECK(out.content == deep_text);
  CHECK(Same(Stream(deep_text, ThinkState::kOutside, nullptr, {100, 2000}).out, out));
}

// Every assistant turn the template renders in chat_golden.jsonl parses back to its message.
TEST_CASE("golden: parser inverts the template assistant turns", "[output_parser]") {
  std::ifstream in(m3::test::TokenizerDir() + "/chat_golden.jsonl");
  REQUIRE(in.good());
  auto drop_nulls = [](auto&& self, const json& v) -> json {
    if (v.is_object()) {
      json out = json::object();
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!it->is_null()) out[it.key()] = self(self, *it);
      }
      return out;
    }
    if (v.is_array()) {
      json out = json::array();
      for (const json& e : v) out.push_back(self(self, e));
      return out;
    }
    return v;
  };
  auto strip_newlines = [](std::string s) {
    while (!s.empty() && s.front() == '\n') s.erase(0, 1);
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  };
  int turns_checked = 0;
  std::string line;
  while (std::getline(in, line)) {
    const json g = json::parse(line);
    if (!g.contains("rendered") || !g["rendered"].is_string()) continue;
    const std::string rendered = g["rendered"];
    std::vector<json> assistants;
    for (const json& m : g["messages"]) {
      if (m.value("role", "") == "assistant") assistants.push_back(m);
    }
    std::vector<std::string> turns;
    for (size_t at = rendered.find("]~b]ai\n"); at != std::string::npos; at = rendered.find("]~b]ai\n", at + 1)) {
      const size_t end = rendered.find("[e~[", at);
      if (end != std::string::npos) turns.push_back(rendered.substr(at + 7, end - at - 7));
    }
    if (turns.size() != assistants.size()) continue;  // a user message spelling the markers
    const json tools = g.contains("tools") ? g["tools"] : json();
    for (size_t t = 0; t < turns.size(); ++t) {
      const json& m = assistants[t];
      std::string reasoning = m.contains("reasoning_content") ? m["reasoning_content"].get<std::string>() : "";
      std::string content = m.value("content", "");
      if (!m.contains("reasoning_content") && content.find("</mm:think>") != std::string::npos) {
        std::string before = strip_newlines(content.substr(0, content.find("</mm:think>")));
        const size_t open = before.rfind("<mm:think>");
        reasoning = strip_newlines(open == std::string::npos ? before : before.substr(open + 10));
        content = strip_newlines(content.substr(content.rfind("</mm:think>") + 11));
      }
      INFO(g["id"] << " turn " << t << ": " << turns[t]);
      const ParsedOutput out = Parse(turns[t], ThinkState::kOutside, tools);
      CHECK(out.reasoning == reasoning);
      CHECK(out.content == content);
      const json calls = m.contains("tool_calls") ? m["tool_calls"] : json::array();
      REQUIRE(out.tool_calls.size() == calls.size());
      for (size_t c = 0; c < calls.size(); ++c) {
        const json& fn = calls[c].contains("function") ? calls[c]["function"] : calls[c];
        CHECK(out.tool_calls[c].name == fn["name"]);
        CHECK(json(out.tool_calls[c].arguments) == drop_nulls(drop_nulls, fn["arguments"]));
      }
      // Same turn with the opener already in the prompt (thinking_mode=enabled).
      if (turns[t].rfind("<mm:think>", 0) == 0) {
        const ParsedOutput inside = Parse(turns[t].substr(10), ThinkState::kInside, tools);
        CHECK(Same(inside, out));
      }
      ++turns_checked;
    }
  }
  CHECK(turns_checked >= 15);
}

// Random markup soup and random bytes: never throws or crashes, streaming still matches.
TEST_CASE("fuzz: markup fragments and garbage bytes", "[output_parser]") {
  const std::vector<std::string> pieces = {
      kNs, "<tool_call>", "</tool_call>", "<invoke name=\"get_weather\">", "<invoke name=\"typed\">",
      "</invoke>", "<city>", "</city>", "<i>", "</i>", "<o>", "</o>", "<item>", "</item>", "<mm:think>",
      "</mm:think>", "\n", " ", "Paris", "3", "true", "é", "\xe2\x82", "\xac", "\xff", "<", ">", "]", "\""};
  const json tools = Tools();
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 1500; ++trial) {
    std::string text;
    const int n = static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) {
      if (rng() % 8 == 0) {
        text += static_cast<char>(rng() % 256);
      } else {
        text += pieces[rng() % pieces.size()];
      }
    }
    const ThinkState initial = trial % 2 ? ThinkState::kInside : ThinkState::kOutside;
    const ParsedOutput whole = ParseOutput(text, initial, tools);
    for (const ToolCall& c : whole.tool_calls) (void)c.arguments.dump();
    std::vector<size_t> cuts;
    for (size_t i = 0; i < text.size(); ++i) {
      if (rng() % 3 == 0) cuts.push_back(i);
    }
    INFO(text);
    REQUIRE(Same(Stream(text, initial, tools, cuts).out, whole));
  }
  // Well-formed calls built from the pieces survive every single-byte split too.
  CheckStreaming("x" + Block(Invoke("typed", Elem("i", "1") + Elem("o", Elem("k", "\xe2\x82\xac")))) + "y",
                 ThinkState::kOutside, tools);
  CheckStreaming("\xff\xfe<mm:think>\xc3</mm:think>\x80", ThinkState::kOutside, tools, /*input_is_utf8=*/false);
}

TEST_CASE("streaming: holds back partial markers and UTF-8 then releases them", "[output_parser]") {
  StreamingOutputParser p(ThinkState::kOutside, Tools());
  CHECK(p.Push("<mm:").empty());
  StreamingOutputParser::Delta d = p.Push("think>ab\xe2\x82");
  CHECK(d.reasoning == "ab");
  d = p.Push("\xac</mm:th");
  CHECK(d.reasoning == "\xe2\x82\xac");
  d = p.Push("ink>Hello ]<]mini");
  CHECK(d.content == "Hello ");
  d = p.Push("max[>[ \n");
  CHECK(d.empty());
  d = p.Push("<tool_call>\n" + Invoke("get_weather", Elem("city", "Paris")));
  CHECK(d.empty());  // a block is held until it closes
  d = p.Push(Close("tool_call") + "!");
  REQUIRE(d.tool_calls.size() == 1);
  CHECK(d.tool_calls[0].arguments == ordered_json{{"city", "Paris"}});
  CHECK(d.content == "!");
  d = p.Push("]<]");
  CHECK(d.empty());
  d = p.Finish();
  CHECK(d.content == "]<]");
  CHECK(p.Push("more").empty());
  CHECK(p.Finish().empty());
}

}  // namespace
