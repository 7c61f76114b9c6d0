// String contents (free text, lengths, patterns, formats) and numbers for the schema compilers.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "constrain/schema_parts.h"

namespace m3::constrain {
namespace {

using nlohmann::json;

constexpr int64_t kMaxMagnitude = 999'999'999'999'999;  // 10^15 - 1
constexpr int64_t kMaxRegexRepeat = 1000;
constexpr int kMaxRegexNesting = 32;

bool Contains(const CodepointRanges& r, uint32_t cp) {
  for (auto [a, b] : r) {
    if (cp >= a && cp <= b) return true;
  }
  return false;
}

CodepointRanges Subtract(const CodepointRanges& r, const CodepointRanges& minus) {
  CodepointRanges out = r;
  for (auto [ma, mb] : minus) {
    CodepointRanges next;
    for (auto [a, b] : out) {
      if (mb < a || ma > b) {
        next.emplace_back(a, b);
        continue;
      }
      if (a < ma) next.emplace_back(a, ma - 1);
      if (b > mb) next.emplace_back(mb + 1, b);
    }
    out = std::move(next);
  }
  return out;
}

std::string ToString(int64_t v) { return std::to_string(v); }

// Decimal strings of equal length n from a to b (a <= b), digit by digit.
Seq SameLengthRange(GrammarBuilder& b, const std::string& lo, const std::string& hi) {
  if (lo.empty()) return {};
  if (lo[0] == hi[0]) {
    Seq s{b.Byte(static_cast<uint8_t>(lo[0]))};
    Seq rest = SameLengthRange(b, lo.substr(1), hi.substr(1));
    s.insert(s.end(), rest.begin(), rest.end());
    return s;
  }
  const size_t n = lo.size() - 1;
  const std::string nines(n, '9'), zeros(n, '0');
  if (lo.substr(1) == zeros && hi.substr(1) == nines) {
    Seq s{b.ByteRange(static_cast<uint8_t>(lo[0]), static_cast<uint8_t>(hi[0]))};
    for (size_t i = 0; i < n; ++i) s.push_back(b.ByteRange('0', '9'));
    return s;
  }
  std::vector<Seq> alts;
  Seq low{b.Byte(static_cast<uint8_t>(lo[0]))};
  Seq low_rest = SameLengthRange(b, lo.substr(1), nines);
  low.insert(low.end(), low_rest.begin(), low_rest.end());
  alts.push_back(std::move(low));
  if (lo[0] + 1 <= hi[0] - 1) {
    Seq mid{b.ByteRange(static_cast<uint8_t>(lo[0] + 1), static_cast<uint8_t>(hi[0] - 1))};
    for (size_t i = 0; i < n; ++i) mid.push_back(b.ByteRange('0', '9'));
    alts.push_back(std::move(mid));
  }
  Seq high{b.Byte(static_cast<uint8_t>(hi[0]))};
  Seq high_rest = SameLengthRange(b, zeros, hi.substr(1));
  high.insert(high.end(), high_rest.begin(), high_rest.end());
  alts.push_back(std::move(high));
  return b.Alt(std::move(alts), "digits");
}

// Non-negative integers in [lo, hi], no leading zeros.
Seq UnsignedRange(GrammarBuilder& b, int64_t lo, int64_t hi) {
  std::vector<Seq> alts;
  for (int d = 1; d <= 16; ++d) {
    const int64_t first = d == 1 ? 0 : static_cast<int64_t>(std::pow(10.0, d - 1));
    const int64_t last = static_cast<int64_t>(std::pow(10.0, d)) - 1;
    const int64_t a = std::max(lo, first), z = std::min(hi, last);
    if (a > z) continue;
    alts.push_back(SameLengthRange(b, ToString(a), ToString(z)));
  }
  return b.Alt(std::move(alts), "uint-range");
}

Seq SignedRange(GrammarBuilder& b, int64_t lo, int64_t hi) {
  std::vector<Seq> alts;
  if (hi >= 0) alts.push_back(UnsignedRange(b, std::max<int64_t>(lo, 0), hi));
  if (lo < 0) {
    Seq neg{b.Byte('-')};
    Seq mag = UnsignedRange(b, std::max<int64_t>(1, -hi), -lo);
    neg.insert(neg.end(), mag.begin(), mag.end());
    alts.push_back(std::move(neg));
  }
  return b.Alt(std::move(alts), "int-range");
}

struct Bounds {
  bool has_lo = false, has_hi = false, lo_exclusive = false, hi_exclusive = false;
  double lo = 0, hi = 0;
};

Bounds ReadBounds(const json& s, const std::string& path) {
  Bounds r;
  auto number = [&](const char* key) -> const json* {
    auto it = s.find(key);
    if (it == s.end()) return nullptr;
    if (it->is_boolean()) return &*it;
    if (!it->is_number()) Refuse(JsonPathJoin(path, key), "must be a number");
    return &*it;
  };
  if (const json* m = number("minimum"); m && m->is_number()) r.has_lo = true, r.lo = m->get<double>();
  if (const json* m = number("maximum"); m && m->is_number()) r.has_hi = true, r.hi = m->get<double>();
  if (const json* m = number("exclusiveMinimum")) {
    if (m->is_boolean()) {
      r.lo_exclusive = m->get<bool>() && r.has_lo;  // draft 4
    } else if (!r.has_lo || m->get<double>() >= r.lo) {
      r.has_lo = true, r.lo = m->get<double>(), r.lo_exclusive = true;
    }
  }
  if (const json* m = number("exclusiveMaximum")) {
    if (m->is_boolean()) {
      r.hi_exclusive = m->get<bool>() && r.has_hi;
    } else if (!r.has_hi || m->get<double>() <= r.hi) {
      r.has_hi = true, r.hi = m->get<double>(), r.hi_exclusive = true;
    }
  }
  return r;
}

// The JSON-string and markup characters that need no regex.
Seq JsonAnyChar(GrammarBuilder& b) {
  std::vector<Seq> alts;
  alts.push_back(b.CharClass({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}}, true));
  Seq esc{b.Byte('\\')};
  ByteSet simple{};
  for (char c : std::string("\"\\/bfnrt")) simple[uint8_t(c) >> 6] |= uint64_t{1} << (uint8_t(c) & 63);
  Seq short_esc = esc;
  short_esc.push_back(b.Bytes(simple));
  alts.push_back(short_esc);
  // \uXXXX outside the surrogates (a lone surrogate is not valid JSON text for nlohmann).
  const Seq hex = b.CharClass({{'0', '9'}, {'a', 'f'}, {'A', 'F'}});
  Seq u1 = esc, u2 = esc;
  u1.push_back(b.Byte('u'));
  u2.push_back(b.Byte('u'));
  Seq lead = b.CharClass({{'0', '9'}, {'a', 'c'}, {'A', 'C'}, {'e', 'f'}, {'E', 'F'}});
  u1.insert(u1.end(), lead.begin(), lead.end());
  for (int i = 0; i < 3; ++i) u1.insert(u1.end(), hex.begin(), hex.end());
  Seq d = b.CharClass({{'d', 'd'}, {'D', 'D'}});
  u2.insert(u2.end(), d.begin(), d.end());
  u2.push_back(b.ByteRange('0', '7'));
  for (int i = 0; i < 2; ++i) u2.insert(u2.end(), hex.begin(), hex.end());
  alts.push_back(u1);
  alts.push_back(u2);
  return b.Alt(std::move(alts), "json-char");
}

// Raw markup text of any length that never holds "]<" (so never the marker "]<]minimax[>["):
// ( C | "]"+ D )* "]"*, C any character but "]", D any character but "]" and "<".
Seq MarkupFreeText(GrammarBuilder& b) {
  const Seq c = b.CharClass({{']', ']'}}, true);
  const Seq d = b.CharClass({{']', ']'}, {'<', '<'}}, true);
  Seq brackets = b.Plus({b.Byte(']')});
  brackets.insert(brackets.end(), d.begin(), d.end());
  Seq s = b.Star(b.Alt({c, brackets}, "markup-char"));
  Seq tail = b.Star({b.Byte(']')});
  s.insert(s.end(), tail.begin(), tail.end());
  return s;
}

// --- Regex (the ECMAScript subset JSON Schema patterns use) --------------------------------------

class RegexCompiler {
 public:
  RegexCompiler(GrammarBuilder& b, std::string_view re, TextEncoding enc, std::string path)
      : b_(b), re_(re), enc_(enc), path_(std::move(path)) {}

  Seq Compile() {
    std::string_view body = re_;
    bool start = false, end = false;
    if (!body.empty() && body.front() == '^') start = true, body.remove_prefix(1);
    if (!body.empty() && body.back() == '$') {
      size_t slashes = 0;
      for (size_t i = body.size() - 1; i-- > 0 && body[i] == '\\';) ++slashes;
      if (slashes % 2 == 0) end = true, body.remove_suffix(1);
    }
    re_ = body;
    bool top_alternation = false;
    Seq s = ParseAlt(0, &top_alternation);
    if (p_ != re_.size()) Fail("unmatched ')'");
    if (top_alternation && (start || end)) {
      Fail("'^' or '$' with a top-level '|' (wrap the alternatives in a group: ^(a|b)$)");
    }
    const Seq any = EncodedChar(b_, {}, true, enc_);
    Seq out;
    if (!start) out = b_.Star(any);
    out.insert(out.end(), s.begin(), s.end());
    if (!end) {
      Seq t = b_.Star(any);
      out.insert(out.end(), t.begin(), t.end());
    }
    return out;
  }

 private:
  [[noreturn]] void Fail(const std::string& what) {
    Refuse(path_, "pattern \"" + std::string(re_) + "\": " + what);
  }

  Seq ParseAlt(int depth, bool* top) {
    std::vector<Seq> alts;
    alts.push_back(ParseConcat(depth));
    while (p_ < re_.size() && re_[p_] == '|') {
      ++p_;
      if (top) *top = true;
      alts.push_back(ParseConcat(depth));
    }
    return b_.Alt(std::move(alts), "re-alt");
  }

  uint32_t ReadCodepoint() {
    const auto c = static_cast<unsigned char>(re_[p_]);
    const int n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0 || p_ + n > re_.size()) Fail("invalid UTF-8");
    uint32_t v = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < n; ++i) {
      const auto cc = static_cast<unsigned char>(re_[p_ + i]);
      if ((cc & 0xC0) != 0x80) Fail("invalid UTF-8");
      v = (v << 6) | (cc & 0x3F);
    }
    p_ += n;
    return v;
  }

  uint32_t Hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (p_ >= re_.size()) Fail("short hex escape");
      const char h = re_[p_++];
      const int d = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
      if (d < 0) Fail("bad hex escape");
      v = v * 16 + static_cast<uint32_t>(d);
    }
    return v;
  }

  // After a backslash: a class (\d \w \s and negations) or one code point.
  void ParseEscape(CodepointRanges& ranges, bool& negated_class, bool in_class) {
    if (p_ >= re_.size()) Fail("trailing backslash");
    const char e = re_[p_++];
    const CodepointRanges digit{{'0', '9'}}, word{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}},
        space{{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x2028, 0x2029}, {0xFEFF, 0xFEFF}};
    negated_class = false;
    switch (e) {
      case 'd': ranges = digit; return;
      case 'w': ranges = word; return;
      case 's': ranges = space; return;
      case 'D': ranges = NormalizeRanges(digit, true); negated_class = true; return;
      case 'W': ranges = NormalizeRanges(word, true); negated_class = true; return;
      case 'S': ranges = NormalizeRanges(space, true); negated_class = true; return;
      case 'n': ranges = {{'\n', '\n'}}; return;
      case 't': ranges = {{'\t', '\t'}}; return;
      case 'r': ranges = {{'\r', '\r'}}; return;
      case 'f': ranges = {{'\f', '\f'}}; return;
      case 'v': ranges = {{'\v', '\v'}}; return;
      case '0': ranges = {{0, 0}}; return;
      case 'x': { const uint32_t v = Hex(2); ranges = {{v, v}}; return; }
      case 'u': {
        const uint32_t v = Hex(4);
        if (v >= 0xD800 && v <= 0xDFFF) Fail("surrogate escapes are not supported");
        ranges = {{v, v}};
        return;
      }
      case 'b':
        if (in_class) { ranges = {{8, 8}}; return; }
        Fail("word boundaries (\\b) are not supported");
      case 'B': Fail("word boundaries (\\B) are not supported");
      default: break;
    }
    if (e >= '1' && e <= '9') Fail("backreferences are not supported");
    if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) Fail(std::string("unknown escape \\") + e);
    --p_;
    const uint32_t cp = ReadCodepoint();
    ranges = {{cp, cp}};
  }

  Seq ParseClass() {
    ++p_;  // '['
    bool negate = false;
    if (p_ < re_.size() && re_[p_] == '^') negate = true, ++p_;
    CodepointRanges ranges;
    bool first = true;
    while (true) {
      if (p_ >= re_.size()) Fail("unterminated character class");
      if (re_[p_] == ']' && !first) {
        ++p_;
        break;
      }
      if (re_[p_] == ']') Fail("empty character class");
      first = false;
      CodepointRanges item;
      bool is_class = false;
      if (re_[p_] == '\\') {
        ++p_;
        ParseEscape(item, is_class, true);
        if (item.size() != 1 || item[0].first != item[0].second) is_class = true;
      } else {
        const uint32_t cp = ReadCodepoint();
        item = {{cp, cp}};
      }
      if (!is_class && p_ + 1 < re_.size() && re_[p_] == '-' && re_[p_ + 1] != ']') {
        ++p_;
        CodepointRanges hi_item;
        bool hi_class = false;
        if (re_[p_] == '\\') {
          ++p_;
          ParseEscape(hi_item, hi_class, true);
        } else {
          const uint32_t cp = ReadCodepoint();
          hi_item = {{cp, cp}};
        }
        if (hi_class || hi_item.size() != 1 || hi_item[0].first != hi_item[0].second) Fail("bad range in a class");
        if (hi_item[0].first < item[0].first) Fail("range out of order in a class");
        item = {{item[0].first, hi_item[0].first}};
      }
      ranges.insert(ranges.end(), item.begin(), item.end());
    }
    return EncodedChar(b_, ranges, negate, enc_);
  }

  Seq ParseConcat(int depth) {
    Seq seq;
    size_t last = 0;
    bool has_last = false;
    while (p_ < re_.size()) {
      const char c = re_[p_];
      if (c == '|' || c == ')') break;
      if (c == '(') {
        if (depth + 1 > kMaxRegexNesting) Fail("groups nested too deeply");
        ++p_;
        if (p_ < re_.size() && re_[p_] == '?') {
          if (p_ + 1 < re_.size() && re_[p_ + 1] == ':') {
            p_ += 2;
          } else if (p_ + 1 < re_.size() && re_[p_ + 1] == '<' && p_ + 2 < re_.size() && re_[p_ + 2] != '=' &&
                     re_[p_ + 2] != '!') {
            const size_t close = re_.find('>', p_);
            if (close == std::string_view::npos) Fail("unterminated group name");
            p_ = close + 1;
          } else {
            Fail("lookaround and other (?...) groups are not supported");
          }
        }
        Seq inner = ParseAlt(depth + 1, nullptr);
        if (p_ >= re_.size() || re_[p_] != ')') Fail("missing ')'");
        ++p_;
        last = seq.size();
        const uint32_t r = b_.NewRule("re-group");
        b_.AddAlt(r, std::move(inner));
        seq.push_back(GrammarBuilder::Ref(r));
        has_last = true;
        continue;
      }
      if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (!has_last) Fail(std::string("'") + c + "' has nothing to repeat");
        ++p_;
        int64_t min = 0, max = -1;
        if (c == '+') min = 1;
        if (c == '?') max = 1;
        if (c == '{') {
          auto num = [&](int64_t& v) {
            const size_t s = p_;
            v = 0;
            while (p_ < re_.size() && re_[p_] >= '0' && re_[p_] <= '9' && p_ - s < 7) v = v * 10 + (re_[p_++] - '0');
            return p_ > s;
          };
          if (!num(min)) Fail("bad {m,n} quantifier");
          max = min;
          if (p_ < re_.size() && re_[p_] == ',') {
            ++p_;
            max = -1;
            if (p_ < re_.size() && re_[p_] != '}' && !num(max)) Fail("bad {m,n} quantifier");
          }
          if (p_ >= re_.size() || re_[p_] != '}') Fail("bad {m,n} quantifier");
          ++p_;
          if (min > kMaxRegexRepeat || max > kMaxRegexRepeat) Fail("repetition count above 1000");
          if (max >= 0 && max < min) Fail("{m,n} with n < m");
        }
        if (p_ < re_.size() && re_[p_] == '?') ++p_;  // lazy: the same language
        if (p_ < re_.size() && re_[p_] == '+') Fail("possessive quantifiers are not supported");
        Seq item(seq.begin() + static_cast<ptrdiff_t>(last), seq.end());
        seq.resize(last);
        Seq rep = b_.Repeat(item, min, max);
        const uint32_t r = b_.NewRule("re-rep");
        b_.AddAlt(r, std::move(rep));
        seq.push_back(GrammarBuilder::Ref(r));
        has_last = false;  // a{2}{3} is an error in ECMAScript
        continue;
      }
      if (c == '^' || c == '$') Fail("anchors are supported only at the start and the end");
      last = seq.size();
      has_last = true;
      Seq atom;
      if (c == '[') {
        atom = ParseClass();
      } else if (c == '.') {
        ++p_;
        atom = EncodedChar(b_, {{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}, true, enc_);
      } else if (c == '\\') {
        ++p_;
        CodepointRanges r;
        bool neg = false;
        ParseEscape(r, neg, false);
        atom = EncodedChar(b_, r, false, enc_);
      } else {
        const uint32_t cp = ReadCodepoint();
        atom = EncodedChar(b_, {{cp, cp}}, false, enc_);
      }
      seq.insert(seq.end(), atom.begin(), atom.end());
    }
    return seq;
  }

  GrammarBuilder& b_;
  std::string_view re_;
  TextEncoding enc_;
  std::string path_;
  size_t p_ = 0;
};

// RFC 3339 / JSON Schema formats as patterns over ASCII (Feb 29 is left out: no leap-year logic).
const char* FormatPattern(const std::string& format) {
  static constexpr const char* kDate =
      "\\d{4}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1\\d|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)";
  static constexpr const char* kTime =
      "(?:[01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(?:\\.\\d{1,6})?(?:Z|[+-](?:[01]\\d|2[0-3]):[0-5]\\d)";
  static const std::string kDateTime = std::string(kDate) + "T" + kTime;
  if (format == "date") return kDate;
  if (format == "time") return kTime;
  if (format == "date-time") return kDateTime.c_str();
  if (format == "uuid") return "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";
  if (format == "email") {
    return "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,32}(?:\\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,32}){0,3}"
           "@[A-Za-z0-9](?:[A-Za-z0-9-]{0,20}[A-Za-z0-9])?(?:\\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,20}[A-Za-z0-9])?){1,3}";
  }
  if (format == "ipv4") return "(?:25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)(?:\\.(?:25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)){3}";
  return nullptr;
}

int64_t ReadLength(const json& s, const char* key, const std::string& path, int64_t fallback) {
  auto it = s.find(key);
  if (it == s.end()) return fallback;
  if (!it->is_number_integer() && !(it->is_number_float() && it->get<double>() == std::floor(it->get<double>()))) {
    Refuse(JsonPathJoin(path, key), "must be a non-negative integer");
  }
  const double v = it->get<double>();
  if (v < 0) Refuse(JsonPathJoin(path, key), "must be a non-negative integer");
  if (v > kMaxStringLengthBound) {
    Refuse(JsonPathJoin(path, key), "above " + std::to_string(kMaxStringLengthBound) + " is not supported");
  }
  return static_cast<int64_t>(v);
}

}  // namespace

void Refuse(const std::string& path, const std::string& message) {
  throw SchemaError{InvalidArgument(path.empty() ? "/" : path, ": ", message)};
}

std::string JsonPathJoin(const std::string& path, const std::string& key) {
  std::string k;
  for (char c : key) {
    if (c == '~') k += "~0";
    else if (c == '/') k += "~1";
    else k += c;
  }
  return path + "/" + k;
}

ObjectKeys ReadObjectKeys(const json& s, const std::string& path) {
  static const json empty = json::object();
  ObjectKeys keys;
  keys.properties = s.contains("properties") ? &s["properties"] : &empty;
  if (!keys.properties->is_object()) Refuse(JsonPathJoin(path, "properties"), "must be an object");
  if (auto it = s.find("required"); it != s.end()) {
    if (!it->is_array()) Refuse(JsonPathJoin(path, "required"), "must be an array of strings");
    for (const json& r : *it) {
      if (!r.is_string()) Refuse(JsonPathJoin(path, "required"), "must be an array of strings");
      keys.required.insert(r.get<std::string>());
    }
  }
  for (auto& [k, unused] : keys.properties->items()) keys.names.insert(k);
  keys.names.insert(keys.required.begin(), keys.required.end());
  return keys;
}

Seq EncodedChar(GrammarBuilder& b, CodepointRanges ranges, bool negate, TextEncoding enc) {
  CodepointRanges set = NormalizeRanges(std::move(ranges), negate);
  if (enc == TextEncoding::kMarkup) {
    set = Subtract(set, {{']', ']'}});
    if (set.empty()) return b.CharClass({});  // matches nothing
    return b.CharClass(set);
  }
  std::vector<Seq> alts;
  const CodepointRanges raw = Subtract(set, {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});
  if (!raw.empty()) alts.push_back(b.CharClass(raw));
  if (Contains(set, '"')) alts.push_back(b.Literal("\\\""));
  if (Contains(set, '\\')) alts.push_back(b.Literal("\\\\"));
  for (uint32_t c = 0; c < 0x20; ++c) {
    if (!Contains(set, c)) continue;
    const char* short_form = c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : nullptr;
    if (short_form) {
      alts.push_back(b.Literal(short_form));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      alts.push_back(b.Literal(buf));
    }
  }
  if (alts.empty()) return b.CharClass({});
  return b.Alt(std::move(alts), "char");
}

Seq StringContent(GrammarBuilder& b, const json& s, TextEncoding enc, const std::string& path) {
  const int64_t min = ReadLength(s, "minLength", path, 0);
  const int64_t max = ReadLength(s, "maxLength", path, -1);
  if (max >= 0 && max < min) Refuse(path, "maxLength is below minLength");
  const auto pattern = s.find("pattern");
  const auto format = s.find("format");
  const bool lengths = s.contains("minLength") || s.contains("maxLength");
  if (pattern != s.end() && format != s.end()) Refuse(path, "pattern together with format is not supported");
  if ((pattern != s.end() || format != s.end()) && lengths) {
    Refuse(path, std::string(pattern != s.end() ? "pattern" : "format") +
                     " together with minLength/maxLength is not supported");
  }
  if (format != s.end()) {
    if (!format->is_string()) Refuse(JsonPathJoin(path, "format"), "must be a string");
    const char* re = FormatPattern(format->get<std::string>());
    if (re == nullptr) {
      Refuse(JsonPathJoin(path, "format"), "format \"" + format->get<std::string>() +
                                               "\" is not supported (date, time, date-time, uuid, email, ipv4)");
    }
    return RegexCompiler(b, std::string("^") + re + "$", enc, JsonPathJoin(path, "format")).Compile();
  }
  if (pattern != s.end()) {
    if (!pattern->is_string()) Refuse(JsonPathJoin(path, "pattern"), "must be a string");
    return RegexCompiler(b, pattern->get_ref<const std::string&>(), enc, JsonPathJoin(path, "pattern")).Compile();
  }
  if (enc == TextEncoding::kJson) return b.Repeat(JsonAnyChar(b), min, max);
  if (max < 0) {
    Seq s_min = b.Repeat(EncodedChar(b, {}, true, enc), min, min);
    Seq free = MarkupFreeText(b);
    s_min.insert(s_min.end(), free.begin(), free.end());
    return s_min;
  }
  return b.Repeat(EncodedChar(b, {}, true, enc), min, max);
}

Seq IntegerText(GrammarBuilder& b, const json& s, const std::string& path) {
  const Bounds r = ReadBounds(s, path);
  if (!r.has_lo && !r.has_hi) {
    // -?(0|[1-9][0-9]{0,14})
    Seq nonzero{b.ByteRange('1', '9')};
    Seq more = b.Repeat({b.ByteRange('0', '9')}, 0, kMaxIntegerDigits - 1);
    nonzero.insert(nonzero.end(), more.begin(), more.end());
    Seq mag = b.Alt({{b.Byte('0')}, nonzero}, "int");
    Seq out = b.Opt({b.Byte('-')});
    out.insert(out.end(), mag.begin(), mag.end());
    return out;
  }
  int64_t lo = -kMaxMagnitude, hi = kMaxMagnitude;
  if (r.has_lo) {
    const double v = r.lo_exclusive ? std::floor(r.lo) + 1 : std::ceil(r.lo);
    lo = v > double(kMaxMagnitude) ? kMaxMagnitude + 1 : std::max<int64_t>(lo, static_cast<int64_t>(std::max(v, -1e16)));
  }
  if (r.has_hi) {
    const double v = r.hi_exclusive ? std::ceil(r.hi) - 1 : std::floor(r.hi);
    hi = v < -double(kMaxMagnitude) ? -kMaxMagnitude - 1 : std::min<int64_t>(hi, static_cast<int64_t>(std::min(v, 1e16)));
  }
  if (lo > hi) Refuse(path, "no integer (of at most 15 digits) satisfies minimum/maximum");
  return SignedRange(b, lo, hi);
}

Seq NumberText(GrammarBuilder& b, const json& s, const std::string& path) {
  const Bounds r = ReadBounds(s, path);
  const Seq digit{b.ByteRange('0', '9')};
  Seq frac{b.Byte('.')};
  Seq frac_digits = b.Repeat(digit, 1, kMaxIntegerDigits);
  frac.insert(frac.end(), frac_digits.begin(), frac_digits.end());
  if (!r.has_lo && !r.has_hi) {
    Seq out = IntegerText(b, json::object(), path);
    Seq f = b.Opt(frac);
    out.insert(out.end(), f.begin(), f.end());
    Seq exp = b.CharClass({{'e', 'e'}, {'E', 'E'}});
    Seq sign = b.Opt(b.CharClass({{'+', '+'}, {'-', '-'}}));
    exp.insert(exp.end(), sign.begin(), sign.end());
    Seq ed = b.Repeat(digit, 1, 2);
    exp.insert(exp.end(), ed.begin(), ed.end());
    Seq e = b.Opt(exp);
    out.insert(out.end(), e.begin(), e.end());
    return out;
  }
  for (auto [has, v, key] : {std::tuple{r.has_lo, r.lo, "minimum"}, std::tuple{r.has_hi, r.hi, "maximum"}}) {
    if (has && v != std::floor(v)) {
      Refuse(JsonPathJoin(path, key), "a non-integral bound on a number is not supported (only integral bounds)");
    }
  }
  const double big = double(kMaxMagnitude);
  const int64_t L = r.has_lo ? static_cast<int64_t>(std::clamp(r.lo, -big, big + 1)) : -kMaxMagnitude;
  const int64_t H = r.has_hi ? static_cast<int64_t>(std::clamp(r.hi, -big - 1, big)) : kMaxMagnitude;
  std::vector<Seq> alts;
  const int64_t ilo = r.lo_exclusive ? L + 1 : L, ihi = r.hi_exclusive ? H - 1 : H;
  if (ilo <= ihi) alts.push_back(SignedRange(b, ilo, ihi));
  // I.F with I >= 0 lies in [I, I+1); -I.F in (-(I+1), -I]. At most 15 significant digits in
  // all, so that the double it parses to never rounds to I+1 (an exclusive bound's value).
  auto fractions = [&](int64_t lo, int64_t hi, bool negative) {
    for (int d = 1; d < kMaxIntegerDigits; ++d) {
      const int64_t first = d == 1 ? 0 : static_cast<int64_t>(std::pow(10.0, d - 1));
      const int64_t last = static_cast<int64_t>(std::pow(10.0, d)) - 1;
      const int64_t a = std::max(lo, first), z = std::min(hi, last);
      if (a > z) continue;
      Seq f = negative ? Seq{b.Byte('-')} : Seq{};
      Seq m = UnsignedRange(b, a, z);
      f.insert(f.end(), m.begin(), m.end());
      f.push_back(b.Byte('.'));
      Seq fd = b.Repeat(digit, 1, kMaxIntegerDigits - d);
      f.insert(f.end(), fd.begin(), fd.end());
      alts.push_back(std::move(f));
    }
  };
  fractions(std::max<int64_t>(0, r.lo_exclusive ? L + 1 : L), H - 1, false);
  fractions(std::max<int64_t>(0, r.hi_exclusive ? -H + 1 : -H), -L - 1, true);
  if (alts.empty()) Refuse(path, "no number satisfies minimum/maximum");
  return b.Alt(std::move(alts), "number");
}

Seq AnyJsonString(GrammarBuilder& b) {
  Seq str{b.Byte('"')};
  Seq chars = b.Star(JsonAnyChar(b));
  str.insert(str.end(), chars.begin(), chars.end());
  str.push_back(b.Byte('"'));
  return str;
}

Seq AnyJsonValue(GrammarBuilder& b) {
  const uint32_t value = b.NewRule("json-value");
  const Seq v{GrammarBuilder::Ref(value)};
  const Seq str = AnyJsonString(b);
  // object: "{" (string ":" value ("," string ":" value)*)? "}"
  Seq member = str;
  member.push_back(b.Byte(':'));
  member.push_back(v[0]);
  Seq more{b.Byte(',')};
  more.insert(more.end(), member.begin(), member.end());
  Seq members = member;
  Seq more_star = b.Star(more);
  members.insert(members.end(), more_star.begin(), more_star.end());
  Seq object{b.Byte('{')};
  Seq om = b.Opt(members);
  object.insert(object.end(), om.begin(), om.end());
  object.push_back(b.Byte('}'));
  Seq elems = v;
  Seq more_v{b.Byte(',')};
  more_v.push_back(v[0]);
  Seq mv = b.Star(more_v);
  elems.insert(elems.end(), mv.begin(), mv.end());
  Seq array{b.Byte('[')};
  Seq oe = b.Opt(elems);
  array.insert(array.end(), oe.begin(), oe.end());
  array.push_back(b.Byte(']'));
  b.AddAlt(value, object);
  b.AddAlt(value, array);
  b.AddAlt(value, str);
  b.AddAlt(value, NumberText(b, json::object(), ""));
  b.AddAlt(value, b.Literal("true"));
  b.AddAlt(value, b.Literal("false"));
  b.AddAlt(value, b.Literal("null"));
  return v;
}

}  // namespace m3::constrain
