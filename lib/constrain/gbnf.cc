// GBNF (llama.cpp's grammar format) -> Grammar. Bounded: input size, group nesting, repetition
// counts, and the builder's element limit; every error names the line and what is wrong.
#include <algorithm>
#include <charconv>

#include "constrain/constrain.h"
#include "constrain/grammar.h"

namespace m3::constrain {
namespace {

constexpr size_t kMaxGbnfBytes = 1 << 20;
constexpr int kMaxNesting = 64;
constexpr int64_t kMaxRepeat = 10000;

bool IsWordChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

class GbnfParser {
 public:
  GbnfParser(std::string_view text, const CompileBudget& budget) : t_(text), b_(budget) {}

  StatusOr<std::shared_ptr<const Grammar>> Parse() {
    if (t_.size() > kMaxGbnfBytes) {
      return InvalidArgument("GBNF: the grammar is ", t_.size(), " bytes (at most ", kMaxGbnfBytes, ")");
    }
    try {
      SkipSpace(true);
      while (ok() && p_ < t_.size()) {
        ParseRule();
        SkipSpace(true);
      }
    } catch (const GrammarTooLarge& e) {
      Fail("the grammar expands past ", e.what, " (repetitions and rules as compiled)");
    } catch (const CompileInterrupted& e) {
      return Status(e.status.code(), "GBNF: " + e.status.message());
    }
    if (!ok()) return error_;
    auto it = std::find(names_.begin(), names_.end(), std::string("root"));
    if (it == names_.end()) return InvalidArgument("GBNF: no rule named 'root'");
    return b_.Finish(b_.NamedRule("root"), "GBNF");
  }

 private:
  bool ok() const { return error_.ok(); }

  template <class... Args>
  void Fail(const Args&... args) {
    if (!ok()) return;
    size_t line = 1, col = 1;
    for (size_t i = 0; i < std::min(p_, t_.size()); ++i) {
      if (t_[i] == '\n') { ++line; col = 1; } else { ++col; }
    }
    error_ = InvalidArgument("GBNF line ", line, " column ", col, ": ", Str(args...));
    p_ = t_.size();
  }

  char Peek(size_t ahead = 0) const { return p_ + ahead < t_.size() ? t_[p_ + ahead] : '\0'; }
  bool AtEnd() const { return p_ >= t_.size(); }

  void SkipSpace(bool newlines) {
    while (p_ < t_.size()) {
      const char c = t_[p_];
      if (c == ' ' || c == '\t') {
        ++p_;
      } else if (c == '#') {
        while (p_ < t_.size() && t_[p_] != '\n') ++p_;
      } else if (newlines && (c == '\n' || c == '\r')) {
        ++p_;
      } else {
        break;
      }
    }
  }

  std::string ParseName() {
    const size_t start = p_;
    while (p_ < t_.size() && IsWordChar(t_[p_])) ++p_;
    return std::string(t_.substr(start, p_ - start));
  }

  void ParseRule() {
    const std::string name = ParseName();
    if (name.empty()) return Fail("expected a rule name, found '", std::string(1, Peek()), "'");
    SkipSpace(false);
    if (t_.substr(p_, 3) != "::=") return Fail("expected '::=' after rule name '", name, "'");
    p_ += 3;
    SkipSpace(true);
    const uint32_t rule = b_.NamedRule(name);
    if (std::find(names_.begin(), names_.end(), name) != names_.end()) {
      return Fail("rule '", name, "' is defined twice");
    }
    names_.push_back(name);
    std::vector<Seq> alts = ParseAlternates(false, 0);
    if (!ok()) return;
    for (auto& a : alts) b_.AddAlt(rule, std::move(a));
    SkipSpace(false);
    if (!AtEnd() && Peek() != '\n' && Peek() != '\r') {
      return Fail("expected the end of the line after rule '", name, "', found '", std::string(1, Peek()), "'");
    }
  }

  std::vector<Seq> ParseAlternates(bool nested, int depth) {
    std::vector<Seq> alts;
    alts.push_back(ParseSequence(nested, depth));
    while (ok()) {
      if (Peek() == '|') {
        ++p_;
        SkipSpace(true);
        alts.push_back(ParseSequence(nested, depth));
        continue;
      }
      if (!nested) {
        // A top-level rule may continue on a following line that starts with '|'.
        const size_t save = p_;
        SkipSpace(true);
        if (Peek() == '|') continue;
        p_ = save;
      }
      break;
    }
    return alts;
  }

  // One code point of a literal or class at p_ (escapes decoded, UTF-8 decoded).
  bool ParseChar(uint32_t& cp, const char* where) {
    if (AtEnd()) {
      Fail("unterminated ", where);
      return false;
    }
    auto c = static_cast<unsigned char>(t_[p_]);
    if (c == '\\') {
      ++p_;
      if (AtEnd()) {
        Fail("unterminated ", where);
        return false;
      }
      const char e = t_[p_++];
      int hex_digits = 0;
      switch (e) {
        case 'n': cp = '\n'; return true;
        case 'r': cp = '\r'; return true;
        case 't': cp = '\t'; return true;
        case '0': cp = 0; return true;
        case '\\': case '"': case '[': case ']': case '-': case '^': case '/': case '\'':
          cp = static_cast<unsigned char>(e);
          return true;
        case 'x': hex_digits = 2; break;
        case 'u': hex_digits = 4; break;
        case 'U': hex_digits = 8; break;
        default:
          --p_;
          Fail("unknown escape '\\", std::string(1, e), "' in ", where);
          return false;
      }
      uint32_t v = 0;
      for (int i = 0; i < hex_digits; ++i) {
        const char h = Peek();
        int d = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
        if (d < 0) {
          Fail("escape '\\", std::string(1, e), "' needs ", hex_digits, " hex digits in ", where);
          return false;
        }
        v = v * 16 + static_cast<uint32_t>(d);
        ++p_;
      }
      if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        Fail("escape '\\", std::string(1, e), "' is not a Unicode scalar value in ", where);
        return false;
      }
      cp = v;
      return true;
    }
    int n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0 || p_ + n > t_.size()) {
      Fail("invalid UTF-8 in ", where);
      return false;
    }
    uint32_t v = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < n; ++i) {
      const auto cc = static_cast<unsigned char>(t_[p_ + i]);
      if ((cc & 0xC0) != 0x80) {
        Fail("invalid UTF-8 in ", where);
        return false;
      }
      v = (v << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < kMin[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
      Fail("invalid UTF-8 in ", where);
      return false;
    }
    p_ += n;
    cp = v;
    return true;
  }

  static std::string Utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  }

  Seq ParseLiteral() {
    ++p_;  // '"'
    std::string bytes;
    while (ok()) {
      if (AtEnd() || Peek() == '\n') {
        Fail("unterminated literal (missing '\"')");
        break;
      }
      if (Peek() == '"') {
        ++p_;
        break;
      }
      uint32_t cp;
      if (!ParseChar(cp, "literal")) break;
      bytes += Utf8(cp);
    }
    return b_.Literal(bytes);
  }

  Seq ParseClass() {
    ++p_;  // '['
    bool negate = false;
    if (Peek() == '^') {
      negate = true;
      ++p_;
    }
    CodepointRanges ranges;
    while (ok()) {
      if (AtEnd() || Peek() == '\n') {
        Fail("unterminated character class (missing ']')");
        break;
      }
      if (Peek() == ']') {
        ++p_;
        break;
      }
      uint32_t lo, hi;
      if (!ParseChar(lo, "character class")) break;
      hi = lo;
      if (Peek() == '-' && Peek(1) != ']' && p_ + 1 < t_.size()) {
        ++p_;
        if (!ParseChar(hi, "character class")) break;
        if (hi < lo) {
          Fail("bad character class range (end below start)");
          break;
        }
      }
      ranges.emplace_back(lo, hi);
    }
    if (!ok()) return {};
    if (ranges.empty() && !negate) {
      Fail("empty character class");
      return {};
    }
    return b_.CharClass(ranges, negate);
  }

  bool ParseCount(int64_t& v) {
    const size_t start = p_;
    while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9' && p_ - start < 9) ++p_;
    if (p_ == start) return false;
    std::from_chars(t_.data() + start, t_.data() + p_, v);
    return true;
  }

  Seq ParseSequence(bool nested, int depth) {
    Seq seq;
    size_t last_start = 0;
    bool has_last = false;
    while (ok()) {
      SkipSpace(nested);
      if (AtEnd()) break;
      const char c = Peek();
      if (c == '"') {
        last_start = seq.size();
        Seq lit = ParseLiteral();
        // (A following operator repeats all of it: the item is seq[last_start..].)
        seq.insert(seq.end(), lit.begin(), lit.end());
        has_last = true;
      } else if (c == '[') {
        last_start = seq.size();
        Seq cls = ParseClass();
        seq.insert(seq.end(), cls.begin(), cls.end());
        has_last = true;
      } else if (c == '.') {
        ++p_;
        last_start = seq.size();
        Seq any = b_.CharClass({}, true);
        seq.insert(seq.end(), any.begin(), any.end());
        has_last = true;
      } else if (c == '(') {
        if (depth + 1 > kMaxNesting) {
          Fail("groups nested deeper than ", kMaxNesting);
          break;
        }
        ++p_;
        SkipSpace(true);
        std::vector<Seq> alts = ParseAlternates(true, depth + 1);
        if (!ok()) break;
        SkipSpace(true);
        if (Peek() != ')') {
          Fail("expected ')' to close the group");
          break;
        }
        ++p_;
        last_start = seq.size();
        const uint32_t r = b_.NewRule("group");
        for (auto& a : alts) b_.AddAlt(r, std::move(a));
        seq.push_back(GrammarBuilder::Ref(r));
        has_last = true;
      } else if (c == '<') {
        if (Peek(1) != '[') {
          Fail("token terminals are written <[id]> (tokens by text are not supported)");
          break;
        }
        p_ += 2;
        int64_t id = 0;
        if (!ParseCount(id) || Peek() != ']' || Peek(1) != '>') {
          Fail("bad token terminal: expected <[id]> with a decimal id");
          break;
        }
        p_ += 2;
        if (id > INT32_MAX) {
          Fail("token id ", id, " out of range");
          break;
        }
        last_start = seq.size();
        seq.push_back(GrammarBuilder::Token(static_cast<int32_t>(id)));
        has_last = true;
      } else if (c == '!') {
        Fail("negated token terminals (!<[id]>) are not supported");
        break;
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (!has_last) {
          Fail("'", std::string(1, c), "' has nothing to repeat");
          break;
        }
        ++p_;
        int64_t min = 0, max = -1;
        if (c == '+') min = 1;
        if (c == '?') max = 1;
        if (c == '{') {
          SkipSpace(false);
          if (!ParseCount(min)) {
            Fail("expected a count after '{'");
            break;
          }
          SkipSpace(false);
          max = min;
          if (Peek() == ',') {
            ++p_;
            SkipSpace(false);
            max = -1;
            if (Peek() != '}' && !ParseCount(max)) {
              Fail("expected a count or '}' after ','");
              break;
            }
            SkipSpace(false);
          }
          if (Peek() != '}') {
            Fail("expected '}' to close the repetition");
            break;
          }
          ++p_;
          if (min > kMaxRepeat || max > kMaxRepeat) {
            Fail("repetition count above ", kMaxRepeat);
            break;
          }
          if (max >= 0 && max < min) {
            Fail("repetition {", min, ",", max, "}: the maximum is below the minimum");
            break;
          }
        }
        Seq item(seq.begin() + static_cast<ptrdiff_t>(last_start), seq.end());
        seq.resize(last_start);
        Seq rep = b_.Repeat(item, min, max);
        last_start = seq.size();
        // The repeated item is one unit for a further operator ("a"{2}? ).
        if (rep.size() != 1) {
          const uint32_t r = b_.NewRule("rep");
          b_.AddAlt(r, std::move(rep));
          rep = {GrammarBuilder::Ref(r)};
        }
        seq.insert(seq.end(), rep.begin(), rep.end());
      } else if (IsWordChar(c)) {
        const size_t save = p_;
        const std::string name = ParseName();
        // `name ::=` starts the next rule (only reachable where newlines are skipped: a group).
        SkipSpace(false);
        if (t_.substr(p_, 3) == "::=") {
          p_ = save;
          Fail("missing ')' before the next rule '", name, "'");
          break;
        }
        last_start = seq.size();
        seq.push_back(GrammarBuilder::Ref(b_.NamedRule(name)));
        has_last = true;
      } else if (c == '|' || c == ')' || c == '\n' || c == '\r') {
        break;
      } else {
        Fail("unexpected character '", std::string(1, c), "'");
        break;
      }
    }
    return seq;
  }

  std::string_view t_;
  size_t p_ = 0;
  GrammarBuilder b_;
  std::vector<std::string> names_;
  Status error_;
};

}  // namespace

StatusOr<std::shared_ptr<const Grammar>> CompileGbnf(std::string_view text, const CompileBudget& budget) {
  return GbnfParser(text, budget).Parse();
}

}  // namespace m3::constrain
