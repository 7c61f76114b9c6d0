// The bound every JSON text meets before it reaches a parser (issue 35). nlohmann's parser is
// iterative, but copying, comparing and dumping a value recurse once per level of nesting: a
// request of ~200 KB of '[' overflows the stack long after parsing. So depth is checked on the
// text first, in one pass without recursion, and every parse of untrusted or file JSON goes
// through ParseJson.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "base/status.h"

namespace m3 {

// Deeper than any config, tokenizer, template data or API request needs (tool schemas nest a few
// tens of levels at most), and shallow enough for every recursive walk of a value.
inline constexpr size_t kMaxJsonDepth = 256;

// Ok when no array or object in `text` lies deeper than max_depth levels (strings skipped with
// their escapes; text that is not JSON is left to the parser to refuse). Otherwise
// InvalidArgument "<what>: JSON nested deeper than 256 levels".
Status CheckJsonDepth(std::string_view text, std::string_view what, size_t max_depth = kMaxJsonDepth);

// CheckJsonDepth, then Json::parse without exceptions: the value, or InvalidArgument
// "<what>: not valid JSON". Json is nlohmann::json or ordered_json (base does not include it).
template <class Json>
StatusOr<Json> ParseJson(std::string_view text, std::string_view what) {
  M3_RETURN_IF_ERROR(CheckJsonDepth(text, what));
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(what, ": not valid JSON");
  return j;
}

}  // namespace m3
