// Jinja lexer: template text to tokens. Whitespace control follows Jinja2's lexer exactly ("-"
// strips, "+" keeps, trim_blocks eats one newline after a block or comment tag, lstrip_blocks
// drops the indentation before one), because chat templates rely on it byte for byte.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "text/jinja_internal.h"

namespace m3::jinja::internal {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsNameChar(char c) { return IsNameStart(c) || IsDigit(c); }

// Python str.rstrip() on UTF-8 text.
std::string RstripPy(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  while (!u.empty() && IsPySpace(u.back())) u.pop_back();
  return EncodeUtf8(u);
}

bool AllPySpace(std::string_view s) {
  for (char32_t c : DecodeUtf8(s))
    if (!IsPySpace(c)) return false;
  return true;
}

class Lexer {
 public:
  Lexer(std::string_view source, const Options& options) : opt_(options) {
    // Jinja normalizes every newline to \n and drops one trailing newline.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!opt_.keep_trailing_newline && !src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> Run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t p = FindTagStart(pos_);
      std::string text = src_.substr(pos_, p == std::string::npos ? std::string::npos : p - pos_);
      int text_line = line_;
      if (p == std::string::npos) {
        Emit(Tok::kText, text, text_line);
        CountLines(text);
        pos_ = src_.size();
        break;
      }
      char kind = src_[p + 1];  // '{', '%' or '#'
      char sign = p + 2 < src_.size() ? src_[p + 2] : '\0';
      bool raw = kind == '%' && IsRawBegin(p);
      if (sign == '-') {
        text = RstripPy(text);
      } else if (sign != '+' && opt_.lstrip_blocks && kind != '{') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && AllPySpace(text.substr(l_pos)))
          text.resize(l_pos);
      }
      Emit(Tok::kText, text, text_line);
      CountLines(src_.substr(pos_, p - pos_));
      pos_ = p + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (raw) {
        line_starting = LexRaw();
      } else if (kind == '#') {
        line_starting = LexComment();
      } else {
        line_starting = LexTag(kind == '{');
      }
    }
    tokens_.push_back(Token{Tok::kEof, "", line_, {}});
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return std::string::npos;
  }

  void Emit(Tok type, std::string text, int line) {
    if (type == Tok::kText && text.empty()) return;
    tokens_.push_back(Token{type, std::move(text), line, {}});
  }

  void CountLines(std::string_view s) { line_ += static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

  // After an end delimiter ending at pos_: "-" ate all whitespace, "+" keeps it, otherwise
  // trim_blocks eats one newline after block and comment tags. Returns Jinja's line_starting.
  bool FinishTag(char sign, bool trim) {
    if (sign == '-') {
      size_t start = pos_;
      while (pos_ < src_.size() && IsSpace(src_[pos_])) ++pos_;
      CountLines(std::string_view(src_).substr(start, pos_ - start));
      return pos_ > start && src_[pos_ - 1] == '\n';
    }
    if (sign != '+' && trim && opt_.trim_blocks && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
      ++line_;
      return true;
    }
    return false;
  }

  bool LexComment() {
    if (pos_ >= src_.size()) return false;  // Jinja accepts a bare "{#" at the very end
    size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) FailAt(line_, "Missing end of comment tag");
    char sign = end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : '\0';
    CountLines(std::string_view(src_).substr(pos_, end - pos_));
    pos_ = end + 2;
    return FinishTag(sign, true);
  }

  // Matches `{%[-+]? raw [-+]?%}` at p (the position of '{').
  bool IsRawBegin(size_t p) const {
    size_t q = p + 2;
    if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) ++q;
    while (q < src_.size() && IsSpace(src_[q])) ++q;
    if (src_.compare(q, 3, "raw") != 0) return false;
    q += 3;
    while (q < src_.size() && IsSpace(src_[q])) ++q;
    if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) ++q;
    return src_.compare(q, 2, "%}") == 0;
  }

  bool LexRaw() {
    int start_line = line_;
    size_t close = src_.find("%}", pos_);
    char sign = src_[close - 1] == '-' || src_[close - 1] == '+' ? src_[close - 1] : '\0';
    CountLines(std::string_view(src_).substr(pos_, close - pos_));
    pos_ = close + 2;
    FinishTag(sign, true);
    // The body runs to the first `{% endraw %}` (any whitespace control).
    for (size_t p = src_.find("{%", pos_); p != std::string::npos; p = src_.find("{%", p + 2)) {
      size_t q = p + 2;
      char open_sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : '\0';
      if (open_sign) ++q;
      while (q < src_.size() && IsSpace(src_[q])) ++q;
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q += 6;
      while (q < src_.size() && IsSpace(src_[q])) ++q;
      char end_sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : '\0';
      if (end_sign) ++q;
      if (src_.compare(q, 2, "%}") != 0) continue;
      std::string body = src_.substr(pos_, p - pos_);
      if (open_sign == '-') body = RstripPy(body);
      Emit(Tok::kText, body, line_);
      CountLines(std::string_view(src_).substr(pos_, q + 2 - pos_));
      pos_ = q + 2;
      return FinishTag(end_sign, true);
    }
    FailAt(start_line, "Missing end of raw directive");
  }

  // Tokens of a {{ }} or {% %} tag up to and including its end delimiter.
  bool LexTag(bool is_var) {
    int tag_line = line_;
    Emit(is_var ? Tok::kVarBegin : Tok::kBlockBegin, "", line_);
    tokens_.back().text = is_var ? "{{" : "{%";
    const char* close = is_var ? "}}" : "%}";
    int depth = 0;  // open brackets: a `}}` inside a dict literal does not end the tag
    while (true) {
      while (pos_ < src_.size() && IsSpace(src_[pos_])) {
        if (src_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= src_.size())
        FailAt(tag_line, is_var ? "unexpected end of template, expected 'end of print statement'"
                                : "unexpected end of template, expected 'end of statement block'");
      if (depth == 0) {
        char sign = src_[pos_];
        // `-}}` strips; `+%}` keeps the newline; there is no `+}}`.
        bool signed_end = (sign == '-' || (sign == '+' && !is_var)) && src_.compare(pos_ + 1, 2, close) == 0;
        if (signed_end || src_.compare(pos_, 2, close) == 0) {
          if (!signed_end) sign = '\0';
          pos_ += signed_end ? 3 : 2;
          Emit(is_var ? Tok::kVarEnd : Tok::kBlockEnd, close, line_);
          return FinishTag(sign, !is_var);
        }
      }
      char c = src_[pos_];
      if (IsNameStart(c)) {
        size_t start = pos_;
        while (pos_ < src_.size() && IsNameChar(src_[pos_])) ++pos_;
        Emit(Tok::kName, src_.substr(start, pos_ - start), line_);
      } else if (IsDigit(c)) {
        LexNumber();
      } else if (c == '\'' || c == '"') {
        LexString();
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "/", "*", "%", "~", "[",
                                     "]",  "(",  ")",  "{",  "}",  "<",  ">", "=", ".", ":", "|", ",", ";"};
        const char* op = nullptr;
        for (const char* o : kOps) {
          if (src_.compare(pos_, std::char_traits<char>::length(o), o) == 0) {
            op = o;
            break;
          }
        }
        if (!op) {
          // Name the whole UTF-8 character, not its first byte.
          size_t end = pos_ + 1;
          while (end < src_.size() && (static_cast<unsigned char>(src_[end]) & 0xC0) == 0x80) ++end;
          FailAt(line_, "unexpected char " + Value::Str(src_.substr(pos_, end - pos_)).Repr());
        }
        std::string s(op);
        if (s == "(" || s == "[" || s == "{") ++depth;
        if ((s == ")" || s == "]" || s == "}") && depth > 0) --depth;
        pos_ += s.size();
        Emit(Tok::kOp, s, line_);
      }
    }
  }

  // Ends of the digit run `(d+_)*d+` starting at p (p itself when there is none).
  size_t ScanDigits(size_t p, bool (*pred)(char)) const {
    size_t q = p;
    while (q < src_.size() && pred(src_[q])) ++q;
    while (q > p && q + 1 < src_.size() && src_[q] == '_' && pred(src_[q + 1])) {
      ++q;
      while (q < src_.size() && pred(src_[q])) ++q;
    }
    return q;
  }

  // Jinja's number rules: a float is tried first (not right after a '.', so x.1.2 is two
  // indexes); integers are 0b/0o/0x-prefixed, [1-9](_?d)*, or all zeros (so 012 is 0 then 12).
  void LexNumber() {
    const size_t start = pos_;
    const size_t n = src_.size();
    auto emit = [&](size_t end, bool is_float, int base, size_t body) {
      std::string text = src_.substr(body, end - body);
      text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
      Token t{is_float ? Tok::kFloat : Tok::kInt, src_.substr(start, end - start), line_, {}};
      if (is_float) {
        t.number = Value::Float(std::strtod(text.c_str(), nullptr));
      } else {
        errno = 0;
        unsigned long long v = std::strtoull(text.c_str(), nullptr, base);
        if (errno == ERANGE || v > static_cast<unsigned long long>(INT64_MAX))
          FailAt(line_, "integer literal " + t.text + " does not fit in 64 bits");
        t.number = Value::Int(static_cast<int64_t>(v));
      }
      tokens_.push_back(std::move(t));
      pos_ = end;
    };
    if (start == 0 || src_[start - 1] != '.') {
      size_t q = ScanDigits(start, IsDigit);
      bool is_float = false;
      if (q + 1 < n && src_[q] == '.' && IsDigit(src_[q + 1])) {
        q = ScanDigits(q + 1, IsDigit);
        is_float = true;
      }
      if (q < n && (src_[q] == 'e' || src_[q] == 'E')) {
        size_t r = q + 1;
        if (r < n && (src_[r] == '+' || src_[r] == '-')) ++r;
        size_t e = ScanDigits(r, IsDigit);
        if (e > r) {
          q = e;
          is_float = true;
        }
      }
      if (is_float) return emit(q, true, 10, start);
    }
    if (src_[start] == '0' && start + 2 < n) {
      char prefix = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[start + 1])));
      bool (*pred)(char) = nullptr;
      if (prefix == 'x') pred = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
      if (prefix == 'o') pred = [](char c) { return c >= '0' && c <= '7'; };
      if (prefix == 'b') pred = [](char c) { return c == '0' || c == '1'; };
      if (pred) {
        size_t body = start + 2 + (src_[start + 2] == '_' ? 1 : 0);
        size_t end = ScanDigits(body, pred);
        if (end > body) return emit(end, false, prefix == 'x' ? 16 : prefix == 'o' ? 8 : 2, body);
      }
    }
    if (src_[start] == '0') return emit(ScanDigits(start, [](char c) { return c == '0'; }), false, 10, start);
    return emit(ScanDigits(start, IsDigit), false, 10, start);
  }

  // A quoted literal with Python's escapes (\n, \t, \xNN, \uNNNN, ...); unknown escapes stay.
  void LexString() {
    char quote = src_[pos_++];
    int start_line = line_;
    std::u32string out;
    while (true) {
      if (pos_ >= src_.size()) FailAt(start_line, "unexpected end of string");
      char c = src_[pos_];
      if (c == quote) {
        ++pos_;
        break;
      }
      if (c == '\n') ++line_;
      if (c != '\\') {
        size_t start = pos_++;
        while (pos_ < src_.size() && src_[pos_] != quote && src_[pos_] != '\\' && src_[pos_] != '\n') ++pos_;
        out += DecodeUtf8(std::string_view(src_).substr(start, pos_ - start));
        continue;
      }
      if (pos_ + 1 >= src_.size()) FailAt(start_line, "unexpected end of string");
      char e = src_[pos_ + 1];
      pos_ += 2;
      auto hex = [&](int n) {
        if (pos_ + n > src_.size()) FailAt(line_, "truncated \\x/\\u escape in string");
        std::string h = src_.substr(pos_, n);
        for (char ch : h)
          if (!std::isxdigit(static_cast<unsigned char>(ch)))
            FailAt(line_, "truncated \\x/\\u escape in string");
        pos_ += n;
        return static_cast<char32_t>(std::strtoul(h.c_str(), nullptr, 16));
      };
      switch (e) {
        case 'n': out += U'\n'; break;
        case 't': out += U'\t'; break;
        case 'r': out += U'\r'; break;
        case '\\': out += U'\\'; break;
        case '\'': out += U'\''; break;
        case '"': out += U'"'; break;
        case 'a': out += U'\a'; break;
        case 'b': out += U'\b'; break;
        case 'f': out += U'\f'; break;
        case 'v': out += U'\v'; break;
        case '\n': ++line_; break;  // line continuation
        case 'x': out += hex(2); break;
        case 'u': out += hex(4); break;
        case 'U': out += hex(8); break;
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = static_cast<char32_t>(e - '0');
            for (int k = 0; k < 2 && pos_ < src_.size() && src_[pos_] >= '0' && src_[pos_] <= '7'; ++k)
              v = v * 8 + static_cast<char32_t>(src_[pos_++] - '0');
            out += v;
          } else {
            out += U'\\';
            pos_ -= 1;  // the character after the backslash is read as ordinary text
          }
      }
    }
    tokens_.push_back(Token{Tok::kString, EncodeUtf8(out), start_line, {}});
  }

  Options opt_;
  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> Lex(std::string_view source, const Options& options) {
  return Lexer(source, options).Run();
}

}  // namespace m3::jinja::internal
