// Pieces shared by the JSON-schema and tool-call compilers: string contents (JSON-escaped or
// raw markup), numbers, patterns, formats. Internal to lib/constrain.
#pragma once

#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "constrain/grammar.h"

namespace m3::constrain {

// Thrown inside the schema compilers and caught at their entry points (never escapes them).
struct SchemaError {
  Status status;
};
[[noreturn]] void Refuse(const std::string& path, const std::string& message);
// compile(); past the grammar builder's limits, refused at `path` (the innermost schema whose
// grammar passed them, when each schema's compilation goes through here).
template <class Compile>
Seq RefusedPastLimits(const std::string& path, Compile&& compile) {
  try {
    return compile();
  } catch (const GrammarTooLarge& e) {
    Refuse(path, "the schema expands past " + e.what);
  }
}

enum class TextEncoding {
  kJson,    // inside a JSON string: '"', '\\' and control characters escaped
  kMarkup,  // raw (M3 tool-call values): never the namespace marker's text
};

// Bounds on what a schema may ask for (beyond them: refused by name).
inline constexpr int64_t kMaxStringLengthBound = 100000;
inline constexpr int64_t kMaxItemsBound = 10000;
inline constexpr int kMaxSchemaDepth = 64;
// Integers are written with at most this many digits (|value| < 10^15: exact as a double too).
inline constexpr int kMaxIntegerDigits = 15;

// The characters of a string (not its quotes) valid against the string keywords of `schema`
// (minLength, maxLength, pattern, format).
Seq StringContent(GrammarBuilder& b, const nlohmann::json& schema, TextEncoding enc, const std::string& path);
// One character of the class (negated: of its complement), as written in `enc` (in markup never
// a "]", so no run of such characters can spell the namespace marker).
Seq EncodedChar(GrammarBuilder& b, CodepointRanges ranges, bool negate, TextEncoding enc);
// Integer / number text valid against minimum, maximum, exclusiveMinimum, exclusiveMaximum.
Seq IntegerText(GrammarBuilder& b, const nlohmann::json& schema, const std::string& path);
Seq NumberText(GrammarBuilder& b, const nlohmann::json& schema, const std::string& path);
// A JSON string of any content (quotes included; every escape JSON has but lone surrogates).
Seq AnyJsonString(GrammarBuilder& b);
// Compact JSON value of any type (a shared recursive rule).
Seq AnyJsonValue(GrammarBuilder& b);
std::string JsonPathJoin(const std::string& path, const std::string& key);

// An object schema's "properties" (an empty object when absent) and "required" names, checked
// (refused by name when malformed); `names`: the keys of both, in key order.
struct ObjectKeys {
  const nlohmann::json* properties;
  std::set<std::string> required;
  std::set<std::string> names;
};
ObjectKeys ReadObjectKeys(const nlohmann::json& schema, const std::string& path);

}  // namespace m3::constrain
