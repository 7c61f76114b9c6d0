// JSON nesting is bounded before any parse (base/json_guard.h): a value nested tens of thousands
// deep once crashed every command that reads JSON (issue 35), since copying and dumping recurse.
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "base/json_guard.h"
#include "format/safetensors.h"
#include "runtime/openai.h"
#include "test_util.h"

namespace m3 {
namespace {

std::string Nested(size_t depth, char open = '[', char close = ']') {
  return std::string(depth, open) + std::string(depth, close);
}

TEST_CASE("JSON deeper than the limit is refused before parsing, whatever it hides in strings", "[json]") {
  CHECK(CheckJsonDepth(Nested(kMaxJsonDepth), "x").ok());
  const Status deep = CheckJsonDepth(Nested(kMaxJsonDepth + 1), "the request");
  CHECK(deep.code() == StatusCode::kInvalidArgument);
  CHECK(deep.message() == "the request: JSON nested deeper than 256 levels");
  CHECK(!CheckJsonDepth(std::string(kMaxJsonDepth / 2, '[') + std::string(kMaxJsonDepth, '{'), "x").ok());
  // Brackets inside strings are text, escaped quotes do not end a string, stray closers do not
  // lower the count below zero.
  CHECK(CheckJsonDepth("[\"" + std::string(100000, '[') + "\"]", "x").ok());
  CHECK(CheckJsonDepth("[\"\\\"" + std::string(1000, '{') + "\"]", "x").ok());
  CHECK(!CheckJsonDepth(std::string(1000, ']') + Nested(kMaxJsonDepth + 1), "x").ok());
  CHECK(CheckJsonDepth("not json [[[ at all", "x").ok());  // the parser's to refuse

  auto parsed = ParseJson<nlohmann::ordered_json>(R"({"a": [1, {"b": null}]})", "x");
  REQUIRE(parsed.ok());
  CHECK((*parsed)["a"][1].contains("b"));
  CHECK(ParseJson<nlohmann::json>("{\"a\":", "the body").status().message() == "the body: not valid JSON");
  // 200 KB of nesting (what crashed m3 serve): refused at once.
  const auto huge = ParseJson<nlohmann::json>("{\"x\": " + Nested(100000) + "}", "the request body");
  CHECK(huge.status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("a deeply nested request, tool call or file is an error, never a crash", "[json][errors]") {
  // A client's tool call arguments nested too deep.
  nlohmann::ordered_json body = {{"messages",
                                  {{{"role", "assistant"},
                                    {"content", ""},
                                    {"tool_calls",
                                     {{{"id", "c1"},
                                       {"type", "function"},
                                       {"function", {{"name", "f"}, {"arguments", Nested(5000, '{', '}')}}}}}}}}}};
  const auto r = openai::ParseChatRequest(body, m3::RequestDefaults{});
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("messages[0].tool_calls[0].function.arguments: JSON nested deeper"));
  // A safetensors index file.
  test::TempDir tmp;
  const std::string index = (tmp.path() / "model.safetensors.index.json").string();
  test::WriteBytes(index, "{\"weight_map\": " + Nested(50000) + "}");
  const auto j = ReadJsonFile(index);
  CHECK(j.status().code() == StatusCode::kCorrupt);
  CHECK_THAT(j.status().message(), Catch::Contains("nested deeper than 256"));
}

}  // namespace
}  // namespace m3
