// The compiled grammar: rules of alternatives of elements over bytes, and the builder that the
// GBNF parser, the JSON-schema compiler and the tool-call compiler all lower into.
//
// Elements are a byte set (one byte), a token id (a special token), or a rule reference. Every
// alternative lies in one flat array ending with kEnd, so a parse position is one index. Text
// is UTF-8: a character class becomes a rule whose alternatives are byte-range sequences.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "constrain/budget.h"

namespace m3::constrain {

struct Element {
  enum Kind : uint8_t { kEnd, kBytes, kToken, kRef };
  Kind kind = kEnd;
  uint32_t arg = 0;  // kBytes: byte-set index; kToken: token id; kRef: rule index
};

using ByteSet = std::array<uint64_t, 4>;
inline bool Has(const ByteSet& s, uint8_t b) { return (s[b >> 6] >> (b & 63)) & 1; }

inline constexpr uint32_t kInfiniteLength = std::numeric_limits<uint32_t>::max() / 4;

// A token mask as the matchers compute it: bit per token id, and the largest minimal completion
// (in bytes/tokens) after any allowed token (for the budget rule).
struct TokenMask {
  std::vector<uint64_t> bits;
  uint32_t max_after = 0;
};

class Grammar {
 public:
  const std::vector<Element>& elements() const { return elements_; }
  const std::vector<ByteSet>& byte_sets() const { return byte_sets_; }
  // Start positions (into elements()) of each rule's alternatives.
  const std::vector<uint32_t>& alternatives(uint32_t rule) const { return rule_alts_[rule]; }
  uint32_t root() const { return root_; }
  size_t rule_count() const { return rule_alts_.size(); }
  const std::string& rule_name(uint32_t rule) const { return rule_names_[rule]; }
  // Fewest bytes/tokens from position `pos` to the end of its alternative.
  uint32_t suffix_min(uint32_t pos) const { return suffix_min_[pos]; }
  uint32_t rule_min(uint32_t rule) const { return rule_min_[rule]; }
  // The <[id]> terminals it uses (sorted, unique).
  const std::vector<int32_t>& token_ids() const { return token_ids_; }
  // Readable dump (GBNF-like; byte sets as [..] ranges) for errors and tests.
  std::string Dump() const;

  // Masks shared by every Matcher of this grammar, keyed by the parse state (its stacks as
  // grammar positions), the vocabulary and the end ids: a state one request has walked costs the
  // next request a lookup. Thread-safe; bounded (dropped whole past kMaxSharedMasks).
  static constexpr size_t kMaxSharedMasks = 512;  // ~12.8 MB at 200K tokens
  std::shared_ptr<const TokenMask> FindMask(const std::string& key) const;
  void StoreMask(const std::string& key, std::shared_ptr<const TokenMask> mask) const;

 private:
  mutable std::mutex masks_mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const TokenMask>> masks_;
  friend class GrammarBuilder;
  std::vector<Element> elements_;
  std::vector<ByteSet> byte_sets_;
  std::vector<std::vector<uint32_t>> rule_alts_;
  std::vector<std::string> rule_names_;
  std::vector<uint32_t> suffix_min_;
  std::vector<uint32_t> rule_min_;
  uint32_t root_ = 0;
  std::vector<int32_t> token_ids_;
};

// A sequence of elements: one alternative, or a piece of one.
using Seq = std::vector<Element>;

// Code-point ranges (inclusive).
using CodepointRanges = std::vector<std::pair<uint32_t, uint32_t>>;
// Sorted and merged (empty ranges dropped); `negate`: the complement over [0, 0x10FFFF].
CodepointRanges NormalizeRanges(CodepointRanges r, bool negate);

// Thrown by GrammarBuilder the moment a grammar would grow past its limits, before the copy that
// would pass them; the compilers catch it and return an error naming the limit (and where).
struct GrammarTooLarge {
  std::string what;  // "2,000,000 grammar elements", "200,000 rules"
};

class GrammarBuilder {
 public:
  explicit GrammarBuilder(const CompileBudget& budget = {});

  // Limits on what one grammar may grow to (a schema's {0,100000} or a huge GBNF is refused), so
  // that compiling any request costs at most ~40 MB and a fraction of a second: every
  // alternative added and every repetition is checked against them as the grammar grows.
  static constexpr size_t kMaxElements = 2'000'000;
  static constexpr size_t kMaxRules = 200'000;
  // Repeat's required copies longer than this are made a rule (see Repeat).
  static constexpr size_t kMaxInlineCopies = 16;

  uint32_t NewRule(std::string name);
  void AddAlt(uint32_t rule, Seq alt);
  // A rule by name, created on first use (GBNF references before definitions).
  uint32_t NamedRule(const std::string& name);
  bool defined(uint32_t rule) const { return defined_[rule]; }
  const std::string& name(uint32_t rule) const { return names_[rule]; }
  size_t rule_count() const { return alts_.size(); }
  // Throws GrammarTooLarge when `more` elements would pass kMaxElements.
  void Charge(size_t more) const;

  static Element Ref(uint32_t rule) { return {Element::kRef, rule}; }
  static Element Token(int32_t id) { return {Element::kToken, static_cast<uint32_t>(id)}; }
  Element Bytes(const ByteSet& set);
  Element Byte(uint8_t b);
  Element ByteRange(uint8_t lo, uint8_t hi);
  Seq Literal(std::string_view bytes);
  // One UTF-8 character in `ranges` (surrogates never match).
  Seq CharClass(const CodepointRanges& ranges, bool negate = false);
  // Groups: the alternatives as a new rule (a single alternative is returned as it is).
  Seq Alt(std::vector<Seq> alts, const char* hint = "alt");
  Seq Star(const Seq& x);
  Seq Plus(const Seq& x);
  Seq Opt(const Seq& x);
  // x{min,max}; max < 0: unbounded. An x of more than one element is made a rule first, so that
  // the copies are one reference each.
  Seq Repeat(const Seq& x, int64_t min, int64_t max);
  // x itself when it is at most one element, else a new rule with x as its one alternative: what
  // a compiler repeats (array items) is one element per copy.
  Seq Unit(Seq x, const char* hint);

  // Checks (every rule defined, no left recursion, finite), computes the minimal lengths.
  // `what` names the source in errors ("GBNF", "JSON schema").
  StatusOr<std::shared_ptr<const Grammar>> Finish(uint32_t root, std::string_view what);

 private:
  std::vector<std::vector<Seq>> alts_;
  std::vector<std::string> names_;
  std::vector<bool> defined_;
  std::map<std::string, uint32_t> by_name_;
  std::vector<ByteSet> sets_;
  std::map<ByteSet, uint32_t> set_index_;
  size_t elements_ = 0;

  // The budget's checks: every kPollEvery growths, the clock; `stop` at most every 10 ms.
  void Poll();
  static constexpr unsigned kPollEvery = 256;
  CompileBudget budget_;
  std::chrono::steady_clock::time_point deadline_, next_stop_check_;
  unsigned growths_ = 0;
};

// Code points as UTF-8 byte-range sequences: each inner vector is one sequence of (lo, hi) byte
// ranges; together they match exactly the valid encodings of [lo, hi] minus surrogates.
std::vector<std::vector<std::pair<uint8_t, uint8_t>>> Utf8Sequences(uint32_t lo, uint32_t hi);

}  // namespace m3::constrain
