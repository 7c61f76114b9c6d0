#include "constrain/grammar.h"

#include <algorithm>
#include <cstdio>
#include <queue>

namespace m3::constrain {
namespace {

uint32_t AddSat(uint32_t a, uint32_t b) { return std::min<uint64_t>(uint64_t(a) + b, kInfiniteLength); }

void EncodeUtf8(uint32_t cp, uint8_t* out, int n) {
  if (n == 1) {
    out[0] = static_cast<uint8_t>(cp);
  } else if (n == 2) {
    out[0] = static_cast<uint8_t>(0xC0 | (cp >> 6));
    out[1] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  } else if (n == 3) {
    out[0] = static_cast<uint8_t>(0xE0 | (cp >> 12));
    out[1] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
    out[2] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  } else {
    out[0] = static_cast<uint8_t>(0xF0 | (cp >> 18));
    out[1] = static_cast<uint8_t>(0x80 | ((cp >> 12) & 0x3F));
    out[2] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
    out[3] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  }
}

int Utf8Length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

// [lo, hi] within one encoded length, split until every byte position is a plain range
// (the utf8-ranges construction: a range is split where a lower position would not be full).
void SplitSameLength(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  const int n = Utf8Length(lo);
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        SplitSameLength(lo, lo | m, out);
        SplitSameLength((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        SplitSameLength(lo, (hi & ~m) - 1, out);
        SplitSameLength(hi & ~m, hi, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  EncodeUtf8(lo, a, n);
  EncodeUtf8(hi, b, n);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (int i = 0; i < n; ++i) seq.emplace_back(a[i], b[i]);
  out.push_back(std::move(seq));
}

}  // namespace

std::vector<std::vector<std::pair<uint8_t, uint8_t>>> Utf8Sequences(uint32_t lo, uint32_t hi) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> out;
  hi = std::min<uint32_t>(hi, 0x10FFFF);
  // Pieces: no surrogates, one encoded length each.
  const uint32_t cuts[][2] = {{0, 0x7F}, {0x80, 0x7FF}, {0x800, 0xD7FF}, {0xE000, 0xFFFF}, {0x10000, 0x10FFFF}};
  for (const auto& c : cuts) {
    const uint32_t a = std::max(lo, c[0]), b = std::min(hi, c[1]);
    if (a <= b) SplitSameLength(a, b, out);
  }
  return out;
}

namespace {

// 2000000 -> "2,000,000".
std::string WithCommas(size_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

GrammarBuilder::GrammarBuilder(const CompileBudget& budget)
    : budget_(budget),
      deadline_(std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(budget.seconds))),
      next_stop_check_(std::chrono::steady_clock::now()) {}

void GrammarBuilder::Poll() {
  if (++growths_ % kPollEvery != 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (now > deadline_) {
    const double limit = budget_.request_seconds > 0 ? budget_.request_seconds : budget_.seconds;
    throw CompileInterrupted{InvalidArgument("compiling it took longer than ", limit,
                                             " s (the limit per request): the grammar is too large or too "
                                             "repetitive")};
  }
  if (budget_.stop && now >= next_stop_check_) {
    next_stop_check_ = now + std::chrono::milliseconds(10);
    if (budget_.stop()) throw CompileInterrupted{Status(StatusCode::kUnavailable, "the request was stopped while it compiled")};
  }
}

void GrammarBuilder::Charge(size_t more) const {
  if (more > kMaxElements - std::min(elements_, kMaxElements))
    throw GrammarTooLarge{WithCommas(kMaxElements) + " grammar elements"};
}

uint32_t GrammarBuilder::NewRule(std::string name) {
  Poll();
  if (alts_.size() >= kMaxRules) throw GrammarTooLarge{WithCommas(kMaxRules) + " rules"};
  const auto id = static_cast<uint32_t>(alts_.size());
  alts_.emplace_back();
  names_.push_back(std::move(name));
  defined_.push_back(true);
  return id;
}

uint32_t GrammarBuilder::NamedRule(const std::string& name) {
  auto it = by_name_.find(name);
  if (it != by_name_.end()) return it->second;
  const uint32_t id = NewRule(name);
  defined_[id] = false;
  by_name_[name] = id;
  return id;
}

void GrammarBuilder::AddAlt(uint32_t rule, Seq alt) {
  Poll();
  Charge(alt.size() + 1);
  elements_ += alt.size() + 1;
  defined_[rule] = true;
  alts_[rule].push_back(std::move(alt));
}

Element GrammarBuilder::Bytes(const ByteSet& set) {
  auto it = set_index_.find(set);
  if (it != set_index_.end()) return {Element::kBytes, it->second};
  const auto id = static_cast<uint32_t>(sets_.size());
  sets_.push_back(set);
  set_index_[set] = id;
  return {Element::kBytes, id};
}

Element GrammarBuilder::ByteRange(uint8_t lo, uint8_t hi) {
  ByteSet s{};
  for (int b = lo; b <= hi; ++b) s[b >> 6] |= uint64_t{1} << (b & 63);
  return Bytes(s);
}

CodepointRanges NormalizeRanges(CodepointRanges r, bool negate) {
  std::sort(r.begin(), r.end());
  CodepointRanges merged;
  for (auto [a, b] : r) {
    if (a > b) continue;
    if (!merged.empty() && a <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, b);
    } else {
      merged.emplace_back(a, b);
    }
  }
  if (!negate) return merged;
  CodepointRanges comp;
  uint32_t next = 0;
  for (auto [a, b] : merged) {
    if (a > next) comp.emplace_back(next, a - 1);
    next = b + 1;
  }
  if (next <= 0x10FFFF) comp.emplace_back(next, 0x10FFFF);
  return comp;
}

Element GrammarBuilder::Byte(uint8_t b) { return ByteRange(b, b); }

Seq GrammarBuilder::Literal(std::string_view bytes) {
  Seq s;
  for (char c : bytes) s.push_back(Byte(static_cast<uint8_t>(c)));
  return s;
}

Seq GrammarBuilder::CharClass(const CodepointRanges& ranges_in, bool negate) {
  const CodepointRanges merged = NormalizeRanges(ranges_in, negate);
  // Single-byte part in one set; multi-byte sequences grouped by their leading bytes' tails.
  ByteSet ascii{};
  bool has_ascii = false;
  std::map<std::vector<std::pair<uint8_t, uint8_t>>, ByteSet> by_tail;  // tail ranges -> lead bytes
  for (auto [a, b] : merged) {
    for (auto& seq : Utf8Sequences(a, b)) {
      if (seq.size() == 1) {
        for (int x = seq[0].first; x <= seq[0].second; ++x) ascii[x >> 6] |= uint64_t{1} << (x & 63);
        has_ascii = true;
        continue;
      }
      std::vector<std::pair<uint8_t, uint8_t>> tail(seq.begin() + 1, seq.end());
      ByteSet& lead = by_tail[tail];
      for (int x = seq[0].first; x <= seq[0].second; ++x) lead[x >> 6] |= uint64_t{1} << (x & 63);
    }
  }
  std::vector<Seq> alts;
  if (has_ascii) alts.push_back({Bytes(ascii)});
  for (auto& [tail, lead] : by_tail) {
    Seq s{Bytes(lead)};
    for (auto [lo, hi] : tail) s.push_back(ByteRange(lo, hi));
    alts.push_back(std::move(s));
  }
  if (alts.empty()) {
    // An empty class matches nothing: a rule with no alternatives (Finish drops what needs it).
    const uint32_t none = NewRule("empty-class");
    return {Ref(none)};
  }
  return Alt(std::move(alts), "char");
}

Seq GrammarBuilder::Alt(std::vector<Seq> alts, const char* hint) {
  if (alts.size() == 1) return std::move(alts[0]);
  const uint32_t r = NewRule(hint);
  for (auto& a : alts) AddAlt(r, std::move(a));
  return {Ref(r)};
}

Seq GrammarBuilder::Star(const Seq& x) {
  // r ::= x r | ε  (right recursion: the matcher's stacks do not grow with the count)
  const uint32_t r = NewRule("star");
  Seq loop = x;
  loop.push_back(Ref(r));
  AddAlt(r, std::move(loop));
  AddAlt(r, {});
  return {Ref(r)};
}

Seq GrammarBuilder::Plus(const Seq& x) {
  Seq s = x;
  Seq tail = Star(x);
  s.insert(s.end(), tail.begin(), tail.end());
  return s;
}

Seq GrammarBuilder::Opt(const Seq& x) {
  const uint32_t r = NewRule("opt");
  AddAlt(r, x);
  AddAlt(r, {});
  return {Ref(r)};
}

Seq GrammarBuilder::Unit(Seq x, const char* hint) {
  if (x.size() <= 1) return x;
  const uint32_t r = NewRule(hint);
  AddAlt(r, std::move(x));
  return {Ref(r)};
}

Seq GrammarBuilder::Repeat(const Seq& x_in, int64_t min, int64_t max) {
  if (max == 0 || x_in.empty()) return {};
  const int64_t uses = min + (max < 0 ? 1 : max - min);
  const Seq x = uses > 1 ? Unit(x_in, "rep") : x_in;
  // The required copies are charged before they are made (the optional ones are rules, each
  // charged as it is added). More than a few become a rule of their own at once, so that what the
  // callers hold and concatenate before adding it stays small: a thousand `x{10000}` in one
  // alternative grow the grammar (and are refused past its limit), not a sequence in flight.
  Charge(static_cast<size_t>(min) * x.size());
  Seq s;
  for (int64_t i = 0; i < min; ++i) s.insert(s.end(), x.begin(), x.end());
  if (s.size() > kMaxInlineCopies) s = Unit(std::move(s), "rep");
  if (max < 0) {
    Seq t = Star(x);
    s.insert(s.end(), t.begin(), t.end());
    return s;
  }
  // x{0,k} as opt(x opt(x ...)): one way to split the count, so no ambiguity.
  Seq tail;
  for (int64_t i = min; i < max; ++i) {
    Seq inner = x;
    inner.insert(inner.end(), tail.begin(), tail.end());
    tail = Opt(inner);
  }
  s.insert(s.end(), tail.begin(), tail.end());
  return s;
}

StatusOr<std::shared_ptr<const Grammar>> GrammarBuilder::Finish(uint32_t root, std::string_view what) {
  const size_t n = alts_.size();
  for (size_t r = 0; r < n; ++r) {
    if (!defined_[r]) return InvalidArgument(what, ": rule '", names_[r], "' is used but never defined");
  }
  // Shortest derivation of each rule (Knuth's generalization of Dijkstra to grammars).
  struct AltRef { uint32_t rule, alt; };
  std::vector<AltRef> alt_list;
  std::vector<uint32_t> pending, sum;
  std::vector<std::vector<uint32_t>> uses(n);  // rule -> alt ids, once per occurrence
  for (uint32_t r = 0; r < n; ++r) {
    for (uint32_t a = 0; a < alts_[r].size(); ++a) {
      const auto id = static_cast<uint32_t>(alt_list.size());
      alt_list.push_back({r, a});
      uint32_t p = 0, s = 0;
      for (const Element& e : alts_[r][a]) {
        if (e.kind == Element::kRef) {
          uses[e.arg].push_back(id);
          ++p;
        } else {
          s = AddSat(s, 1);
        }
      }
      pending.push_back(p);
      sum.push_back(s);
    }
  }
  std::vector<uint32_t> rule_min(n, kInfiniteLength);
  std::vector<bool> done(n, false);
  using Item = std::pair<uint32_t, uint32_t>;  // (length, rule)
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
  for (uint32_t id = 0; id < alt_list.size(); ++id) {
    if (pending[id] == 0) heap.push({sum[id], alt_list[id].rule});
  }
  while (!heap.empty()) {
    auto [d, r] = heap.top();
    heap.pop();
    if (done[r]) continue;
    done[r] = true;
    rule_min[r] = d;
    for (uint32_t id : uses[r]) {
      sum[id] = AddSat(sum[id], d);
      if (--pending[id] == 0) heap.push({sum[id], alt_list[id].rule});
    }
  }
  // Nullable rules and left recursion: an edge A -> B where B can come first in A.
  std::vector<std::vector<uint32_t>> first(n);
  for (uint32_t r = 0; r < n; ++r) {
    for (const Seq& alt : alts_[r]) {
      for (const Element& e : alt) {
        if (e.kind != Element::kRef) break;
        first[r].push_back(e.arg);
        if (rule_min[e.arg] != 0) break;
      }
    }
  }
  {
    std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 finished
    std::vector<std::pair<uint32_t, size_t>> stack;
    for (uint32_t s = 0; s < n; ++s) {
      if (color[s]) continue;
      stack.push_back({s, 0});
      color[s] = 1;
      while (!stack.empty()) {
        auto& [r, i] = stack.back();
        if (i == first[r].size()) {
          color[r] = 2;
          stack.pop_back();
          continue;
        }
        const uint32_t next = first[r][i++];
        if (color[next] == 1) {
          std::string cycle;
          bool on = false;
          for (auto& [q, unused] : stack) {
            on = on || q == next;
            if (on) cycle += names_[q] + " -> ";
          }
          cycle += names_[next];
          return InvalidArgument(what, ": left recursion (", cycle,
                                 "): a rule may not derive itself before matching a byte");
        }
        if (color[next] == 0) {
          color[next] = 1;
          stack.push_back({next, 0});
        }
      }
    }
  }
  if (!done[root]) {
    return InvalidArgument(what, ": the grammar has no finite sentence (rule '", names_[root],
                           "' never completes)");
  }
  if (rule_min[root] >= kInfiniteLength) {
    return InvalidArgument(what, ": the shortest text the grammar allows is over ", kInfiniteLength - 1,
                           " bytes, more than any reply can hold");
  }
  // Flatten, dropping alternatives that can never complete (dead ends for the matcher).
  auto g = std::make_shared<Grammar>();
  g->rule_alts_.resize(n);
  g->rule_names_ = names_;
  g->rule_min_ = rule_min;
  g->byte_sets_ = sets_;
  g->root_ = root;
  for (uint32_t r = 0; r < n; ++r) {
    for (const Seq& alt : alts_[r]) {
      uint32_t len = 0;
      for (const Element& e : alt) len = AddSat(len, e.kind == Element::kRef ? rule_min[e.arg] : 1);
      if (len >= kInfiniteLength) continue;
      g->rule_alts_[r].push_back(static_cast<uint32_t>(g->elements_.size()));
      g->elements_.insert(g->elements_.end(), alt.begin(), alt.end());
      g->elements_.push_back({Element::kEnd, 0});
    }
  }
  for (const Element& e : g->elements_) {
    if (e.kind == Element::kToken) g->token_ids_.push_back(static_cast<int32_t>(e.arg));
  }
  std::sort(g->token_ids_.begin(), g->token_ids_.end());
  g->token_ids_.erase(std::unique(g->token_ids_.begin(), g->token_ids_.end()), g->token_ids_.end());
  g->suffix_min_.assign(g->elements_.size(), 0);
  for (size_t i = g->elements_.size(); i-- > 0;) {
    const Element& e = g->elements_[i];
    if (e.kind == Element::kEnd) {
      g->suffix_min_[i] = 0;
    } else {
      g->suffix_min_[i] = AddSat(g->suffix_min_[i + 1], e.kind == Element::kRef ? rule_min[e.arg] : 1);
    }
  }
  return std::shared_ptr<const Grammar>(std::move(g));
}

std::shared_ptr<const TokenMask> Grammar::FindMask(const std::string& key) const {
  std::lock_guard<std::mutex> lock(masks_mu_);
  auto it = masks_.find(key);
  return it == masks_.end() ? nullptr : it->second;
}

void Grammar::StoreMask(const std::string& key, std::shared_ptr<const TokenMask> mask) const {
  std::lock_guard<std::mutex> lock(masks_mu_);
  if (masks_.size() >= kMaxSharedMasks) masks_.clear();
  masks_.emplace(key, std::move(mask));
}

std::string Grammar::Dump() const {
  std::string out;
  auto set_text = [&](const ByteSet& s) {
    std::string t = "[";
    for (int b = 0; b < 256; ++b) {
      if (!Has(s, static_cast<uint8_t>(b))) continue;
      int e = b;
      while (e + 1 < 256 && Has(s, static_cast<uint8_t>(e + 1))) ++e;
      auto hex = [](int v) {
        if (v > 0x20 && v < 0x7F && v != '\\' && v != ']' && v != '-' && v != '^') return std::string(1, char(v));
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02X", v);
        return std::string(buf);
      };
      t += hex(b);
      if (e > b) {
        t += '-';
        t += hex(e);
      }
      b = e;
    }
    t += ']';
    return t;
  };
  for (uint32_t r = 0; r < rule_alts_.size(); ++r) {
    out += rule_names_[r] + "#" + std::to_string(r) + " ::=";
    for (size_t a = 0; a < rule_alts_[r].size(); ++a) {
      if (a) out += " |";
      for (uint32_t p = rule_alts_[r][a]; elements_[p].kind != Element::kEnd; ++p) {
        const Element& e = elements_[p];
        if (e.kind == Element::kBytes) {
          out += ' ';
          out += set_text(byte_sets_[e.arg]);
        }
        if (e.kind == Element::kToken) out += " <[" + std::to_string(e.arg) + "]>";
        if (e.kind == Element::kRef) out += " " + rule_names_[e.arg] + "#" + std::to_string(e.arg);
      }
    }
    out += "\n";
  }
  return out;
}

}  // namespace m3::constrain
