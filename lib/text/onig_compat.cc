#include "text/onig_compat.h"

#include <unicode/uniset.h>

#include <cctype>
#include <string>

namespace m3 {
namespace {

// Code points assigned in Unicode 15.0, 15.1 and 16.0 with their general category: what the
// Oniguruma in HF tokenizers (Unicode 16.0) knows and PCRE2 10.42 (Unicode 14.0) does not.
// Read from HF tokenizers itself (each \p{Xx} probed over every code point unassigned in 14.0);
// the counts agree with the UCD's 4,489 + 627 + 5,185 additions.
struct NewRange {
  char32_t lo, hi;
  char gc[3];
};
constexpr NewRange kNewInUnicode15To16[] = {
    {0x897, 0x897, "Mn"}, {0xCF3, 0xCF3, "Mc"}, {0xECE, 0xECE, "Mn"}, {0x1B4E, 0x1B4F, "Po"},
    {0x1B7F, 0x1B7F, "Po"}, {0x1C89, 0x1C89, "Lu"}, {0x1C8A, 0x1C8A, "Ll"}, {0x2427, 0x2429, "So"},
    {0x2FFC, 0x2FFF, "So"}, {0x31E4, 0x31E5, "So"}, {0x31EF, 0x31EF, "So"}, {0xA7CB, 0xA7CC, "Lu"},
    {0xA7CD, 0xA7CD, "Ll"}, {0xA7DA, 0xA7DA, "Lu"}, {0xA7DB, 0xA7DB, "Ll"}, {0xA7DC, 0xA7DC, "Lu"},
    {0x105C0, 0x105F3, "Lo"}, {0x10D40, 0x10D49, "Nd"}, {0x10D4A, 0x10D4D, "Lo"},
    {0x10D4E, 0x10D4E, "Lm"}, {0x10D4F, 0x10D4F, "Lo"}, {0x10D50, 0x10D65, "Lu"},
    {0x10D69, 0x10D6D, "Mn"}, {0x10D6E, 0x10D6E, "Pd"}, {0x10D6F, 0x10D6F, "Lm"},
    {0x10D70, 0x10D85, "Ll"}, {0x10D8E, 0x10D8F, "Sm"}, {0x10EC2, 0x10EC4, "Lo"},
    {0x10EFC, 0x10EFF, "Mn"}, {0x1123F, 0x11240, "Lo"}, {0x11241, 0x11241, "Mn"},
    {0x11380, 0x11389, "Lo"}, {0x1138B, 0x1138B, "Lo"}, {0x1138E, 0x1138E, "Lo"},
    {0x11390, 0x113B5, "Lo"}, {0x113B7, 0x113B7, "Lo"}, {0x113B8, 0x113BA, "Mc"},
    {0x113BB, 0x113C0, "Mn"}, {0x113C2, 0x113C2, "Mc"}, {0x113C5, 0x113C5, "Mc"},
    {0x113C7, 0x113CA, "Mc"}, {0x113CC, 0x113CD, "Mc"}, {0x113CE, 0x113CE, "Mn"},
    {0x113CF, 0x113CF, "Mc"}, {0x113D0, 0x113D0, "Mn"}, {0x113D1, 0x113D1, "Lo"},
    {0x113D2, 0x113D2, "Mn"}, {0x113D3, 0x113D3, "Lo"}, {0x113D4, 0x113D5, "Po"},
    {0x113D7, 0x113D8, "Po"}, {0x113E1, 0x113E2, "Mn"}, {0x116D0, 0x116E3, "Nd"},
    {0x11B00, 0x11B09, "Po"}, {0x11BC0, 0x11BE0, "Lo"}, {0x11BE1, 0x11BE1, "Po"},
    {0x11BF0, 0x11BF9, "Nd"}, {0x11F00, 0x11F01, "Mn"}, {0x11F02, 0x11F02, "Lo"},
    {0x11F03, 0x11F03, "Mc"}, {0x11F04, 0x11F10, "Lo"}, {0x11F12, 0x11F33, "Lo"},
    {0x11F34, 0x11F35, "Mc"}, {0x11F36, 0x11F3A, "Mn"}, {0x11F3E, 0x11F3F, "Mc"},
    {0x11F40, 0x11F40, "Mn"}, {0x11F41, 0x11F41, "Mc"}, {0x11F42, 0x11F42, "Mn"},
    {0x11F43, 0x11F4F, "Po"}, {0x11F50, 0x11F59, "Nd"}, {0x11F5A, 0x11F5A, "Mn"},
    {0x1342F, 0x1342F, "Lo"}, {0x13439, 0x1343F, "Cf"}, {0x13440, 0x13440, "Mn"},
    {0x13441, 0x13446, "Lo"}, {0x13447, 0x13455, "Mn"}, {0x13460, 0x143FA, "Lo"},
    {0x16100, 0x1611D, "Lo"}, {0x1611E, 0x16129, "Mn"}, {0x1612A, 0x1612C, "Mc"},
    {0x1612D, 0x1612F, "Mn"}, {0x16130, 0x16139, "Nd"}, {0x16D40, 0x16D42, "Lm"},
    {0x16D43, 0x16D6A, "Lo"}, {0x16D6B, 0x16D6C, "Lm"}, {0x16D6D, 0x16D6F, "Po"},
    {0x16D70, 0x16D79, "Nd"}, {0x18CFF, 0x18CFF, "Lo"}, {0x1B132, 0x1B132, "Lo"},
    {0x1B155, 0x1B155, "Lo"}, {0x1CC00, 0x1CCEF, "So"}, {0x1CCF0, 0x1CCF9, "Nd"},
    {0x1CD00, 0x1CEB3, "So"}, {0x1D2C0, 0x1D2D3, "No"}, {0x1DF25, 0x1DF2A, "Ll"},
    {0x1E030, 0x1E06D, "Lm"}, {0x1E08F, 0x1E08F, "Mn"}, {0x1E4D0, 0x1E4EA, "Lo"},
    {0x1E4EB, 0x1E4EB, "Lm"}, {0x1E4EC, 0x1E4EF, "Mn"}, {0x1E4F0, 0x1E4F9, "Nd"},
    {0x1E5D0, 0x1E5ED, "Lo"}, {0x1E5EE, 0x1E5EF, "Mn"}, {0x1E5F0, 0x1E5F0, "Lo"},
    {0x1E5F1, 0x1E5FA, "Nd"}, {0x1E5FF, 0x1E5FF, "Po"}, {0x1F6DC, 0x1F6DC, "So"},
    {0x1F774, 0x1F776, "So"}, {0x1F77B, 0x1F77F, "So"}, {0x1F7D9, 0x1F7D9, "So"},
    {0x1F8B2, 0x1F8BB, "So"}, {0x1F8C0, 0x1F8C1, "So"}, {0x1FA75, 0x1FA77, "So"},
    {0x1FA87, 0x1FA89, "So"}, {0x1FA8F, 0x1FA8F, "So"}, {0x1FAAD, 0x1FAAF, "So"},
    {0x1FABB, 0x1FABF, "So"}, {0x1FAC6, 0x1FAC6, "So"}, {0x1FACE, 0x1FACF, "So"},
    {0x1FADA, 0x1FADC, "So"}, {0x1FADF, 0x1FADF, "So"}, {0x1FAE8, 0x1FAE9, "So"},
    {0x1FAF7, 0x1FAF8, "So"}, {0x1FBCB, 0x1FBEF, "So"}, {0x2B739, 0x2B739, "Lo"},
    {0x2EBF0, 0x2EE5D, "Lo"}, {0x31350, 0x323AF, "Lo"},
};

// Appends lo..hi as PCRE2 class items; PCRE2 refuses surrogate code points in UTF mode.
void AppendRange(std::string& out, char32_t lo, char32_t hi) {
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) AppendRange(out, lo, 0xD7FF);
    if (hi > 0xDFFF) AppendRange(out, 0xE000, hi);
    return;
  }
  out += Str("\\x{", std::hex, static_cast<uint32_t>(lo), "}");
  if (hi != lo) out += Str("-\\x{", std::hex, static_cast<uint32_t>(hi), "}");
}

// Class items for the code points of `name` (a general category such as "L", "Lu", "LC") that
// PCRE2 lacks. False when `name` is not a general category.
bool NewCodePoints(std::string_view name, std::string& items) {
  static const std::string_view kCategories =
      "Lu Ll Lt Lm Lo Mn Mc Me Nd Nl No Pc Pd Ps Pe Pi Pf Po Sm Sc Sk So Zs Zl Zp Cc Cf Cs Co Cn";
  const bool major = name.size() == 1 && std::string_view("LMNPSZC").find(name[0]) != std::string_view::npos;
  const bool cased = name == "LC" || name == "L&";
  const bool minor = name.size() == 2 && kCategories.find(name) != std::string_view::npos &&
                     kCategories.find(name) % 3 == 0;
  if (!major && !cased && !minor) return false;
  for (const NewRange& r : kNewInUnicode15To16) {
    const std::string_view gc(r.gc, 2);
    const bool in = major ? gc[0] == name[0]
                  : cased ? (gc == "Lu" || gc == "Ll" || gc == "Lt")
                          : gc == name;
    if (in) AppendRange(items, r.lo, r.hi);
  }
  return true;
}

// Oniguruma's \s is the Unicode White_Space property; PCRE2's also takes U+180E.
std::string WhiteSpaceItems(bool complement) {
  UErrorCode ec = U_ZERO_ERROR;
  icu::UnicodeSet set(icu::UnicodeString(u"[:White_Space:]"), ec);
  if (complement) set.complement();
  std::string items;
  for (int32_t i = 0; i < set.getRangeCount(); ++i) AppendRange(items, set.getRangeStart(i), set.getRangeEnd(i));
  return items;
}

bool IsHex(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }

}  // namespace

StatusOr<std::string> OnigPatternToPcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() * 2);
  bool in_class = false;
  const size_t n = p.size();
  // Emits a class (outside brackets) or bare items (inside them).
  auto emit_set = [&](const std::string& items, bool negate) {
    if (in_class) {
      out += items;
    } else {
      out += negate ? "[^" : "[";
      out += items;
      out += "]";
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < n) {
      const char e = p[i + 1];
      if (e == 'p' || e == 'P') {
        size_t end = i + 3;
        std::string name;
        if (i + 2 < n && p[i + 2] == '{') {
          const size_t close = p.find('}', i + 3);
          if (close == std::string_view::npos) return InvalidArgument("unterminated \\p{ at offset ", i);
          name = std::string(p.substr(i + 3, close - i - 3));
          end = close + 1;
        } else if (i + 2 < n) {
          name = std::string(1, p[i + 2]);
        }
        bool negate = e == 'P';
        if (!name.empty() && name[0] == '^') {
          negate = !negate;
          name.erase(0, 1);
        }
        std::string items;
        const bool known = NewCodePoints(name, items);
        if (!known || items.empty() || (negate && in_class)) {
          // Scripts and other properties, and \P inside a class (PCRE2 cannot subtract), keep
          // PCRE2's own tables: they differ only on characters new since Unicode 14.
          out.append(p.substr(i, end - i));
        } else {
          emit_set("\\p{" + name + "}" + items, negate);
        }
        i = end - 1;
        continue;
      }
      if (e == 's' || e == 'S') {
        const bool negate = e == 'S';
        emit_set(WhiteSpaceItems(negate && in_class), negate);
        ++i;
        continue;
      }
      if (e == 'd' || e == 'D') {  // Oniguruma: Decimal_Number
        std::string items;
        NewCodePoints("Nd", items);
        if (e == 'D' && in_class) {
          out += "\\D";
        } else {
          emit_set("\\p{Nd}" + items, e == 'D');
        }
        ++i;
        continue;
      }
      if (e == 'h' || e == 'H') {  // Oniguruma: a hex digit, not horizontal space
        if (e == 'H' && in_class) return Unsupported("\\H inside a character class at offset ", i);
        emit_set("0-9A-Fa-f", e == 'H');
        ++i;
        continue;
      }
      if (e == 'u' && i + 5 < n && IsHex(p[i + 2]) && IsHex(p[i + 3]) && IsHex(p[i + 4]) && IsHex(p[i + 5])) {
        out += "\\x{";
        out.append(p.substr(i + 2, 4));
        out += "}";
        i += 5;
        continue;
      }
      if (e == 'Q') {  // quoted run: copied as is through \E
        const size_t close = p.find("\\E", i + 2);
        const size_t end = close == std::string_view::npos ? n : close + 2;
        out.append(p.substr(i, end - i));
        i = end - 1;
        continue;
      }
      out += c;
      out += e;
      ++i;
      continue;
    }
    if (in_class) {
      if (c == '[') {
        const size_t close = p.compare(i, 2, "[:") == 0 ? p.find(":]", i + 2) : std::string_view::npos;
        if (close == std::string_view::npos) return Unsupported("nested character class at offset ", i);
        out.append(p.substr(i, close + 2 - i));  // POSIX class such as [:alpha:]
        i = close + 1;
        continue;
      }
      if (c == '&' && i + 1 < n && p[i + 1] == '&') return Unsupported("class intersection at offset ", i);
      if (c == ']') in_class = false;
      out += c;
      continue;
    }
    out += c;
    if (c == '[') {
      in_class = true;
      if (i + 1 < n && p[i + 1] == '^') out += p[++i];
      if (i + 1 < n && p[i + 1] == ']') out += p[++i];  // a leading ] is literal
    }
  }
  return out;
}

}  // namespace m3
