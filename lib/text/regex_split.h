// The Split pre-tokenizer of HF tokenizers on PCRE2 (UTF + UCP, JIT when available). HF runs the
// pattern with Oniguruma; both are backtracking engines with leftmost-first alternation, and
// onig_compat.h bridges the escapes whose meaning differs, so patterns split identically.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace m3 {

// PCRE2's match state for one caller at a time (the compiled pattern is shared between threads,
// this is not): an encode call makes one and passes it to every Split it runs.
class RegexMatchState {
 public:
  RegexMatchState();
  ~RegexMatchState();
  RegexMatchState(const RegexMatchState&) = delete;
  RegexMatchState& operator=(const RegexMatchState&) = delete;
  void* data() const { return md_; }  // pcre2_match_data_8*

 private:
  void* md_;
};

class RegexSplit {
 public:
  enum class Behavior { kRemoved, kIsolated };

  // `pattern` is a regex, or a literal string when `literal`. With kRemoved the segments that
  // count as matches (the regex matches, or with `invert` the text between them) are dropped;
  // with kIsolated every segment is kept as its own piece.
  static StatusOr<std::unique_ptr<RegexSplit>> Create(const std::string& pattern, bool literal,
                                                      Behavior behavior, bool invert);
  ~RegexSplit();

  // Appends the pieces of `text` (valid UTF-8) to `pieces`, in order, empty ones left out.
  void Split(std::string_view text, std::vector<std::string_view>& pieces, RegexMatchState& state) const;
  void Split(std::string_view text, std::vector<std::string_view>& pieces) const {  // a state of its own
    RegexMatchState state;
    Split(text, pieces, state);
  }

 private:
  RegexSplit() = default;
  void* code_ = nullptr;  // pcre2_code_8*; kept opaque so callers need no PCRE2 headers
  Behavior behavior_ = Behavior::kRemoved;
  bool invert_ = false;
};

}  // namespace m3
