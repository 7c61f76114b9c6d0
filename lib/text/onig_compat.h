// HF tokenizers runs Split patterns with Oniguruma (Unicode 16.0); we run them with PCRE2 10.42
// (Unicode 14.0). The syntax of the patterns tokenizer.json files use is common to both, but a
// few escapes mean different things. This rewrites a pattern so PCRE2 (UTF + UCP) matches what
// Oniguruma matches:
//   \p{X} / \P{X} for a general category X: PCRE2's class plus the code points assigned in
//     Unicode 15.0-16.0 with category X (\P inside a [...] keeps PCRE2's own table);
//   \s, \S: Unicode White_Space (PCRE2 also counts U+180E);  \d, \D: \p{Nd};
//   \h, \H: a hex digit (horizontal space in PCRE2);  \uHHHH: \x{HHHH}.
// Other syntax passes through; nested classes and && (Oniguruma-only) are refused.
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"

namespace m3 {

StatusOr<std::string> OnigPatternToPcre2(std::string_view pattern);

}  // namespace m3
