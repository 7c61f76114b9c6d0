// What compiling one grammar (GBNF, a JSON schema, tool calls) may spend beside its size limits
// (GrammarBuilder's): docs/CONSTRAIN.md "Limits".
#pragma once

#include <functional>

#include "base/status.h"

namespace m3::constrain {

// What one compilation may spend beside size: wall-clock time (past it the grammar is refused as
// too costly to compile), and its requester's interest: `stop`, polled every few milliseconds,
// ends it at once when it returns true (the client left). Checked where the grammar grows.
struct CompileBudget {
  static constexpr double kDefaultSeconds = 2.0;
  double seconds = kDefaultSeconds;  // what this compilation may take
  // The request's whole limit when `seconds` is what is left of it (several grammars in one
  // request), for the refusal's message; 0: `seconds` is the limit.
  double request_seconds = 0;
  std::function<bool()> stop;
};

// Thrown by GrammarBuilder when a compilation's budget is spent (the time) or it was stopped;
// the compilers return `status`.
struct CompileInterrupted {
  Status status;
};

}  // namespace m3::constrain
