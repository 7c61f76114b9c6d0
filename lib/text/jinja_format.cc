// Python string formatting for templates: str.format (with the common format-spec subset) and
// printf-style `"fmt" % args`.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>

#include "text/jinja_internal.h"

namespace m3::jinja::internal {
namespace {

using K = Value::Kind;

// ---- str.format ----

std::string FormatSpec(const Value& v, const std::string& spec) {
  // [[fill]align][sign][#][0][width][,][.precision][type]
  size_t i = 0;
  std::u32string u = DecodeUtf8(spec);
  char32_t fill = ' ';
  char align = 0;
  auto is_align = [](char32_t c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (u.size() >= 2 && is_align(u[1])) {
    fill = u[0];
    align = static_cast<char>(u[1]);
    i = 2;
  } else if (!u.empty() && is_align(u[0])) {
    align = static_cast<char>(u[0]);
    i = 1;
  }
  char sign = '-';
  if (i < u.size() && (u[i] == '+' || u[i] == '-' || u[i] == ' ')) sign = static_cast<char>(u[i++]);
  bool alt = i < u.size() && u[i] == '#' && ++i;
  if (i < u.size() && u[i] == '0') {
    if (!align) {
      fill = '0';
      align = '=';
    }
    ++i;
  }
  int64_t width = 0;
  while (i < u.size() && u[i] >= '0' && u[i] <= '9') width = width * 10 + (u[i++] - '0');
  bool grouping = i < u.size() && u[i] == ',' && ++i;
  int precision = -1;
  if (i < u.size() && u[i] == '.') {
    precision = 0;
    ++i;
    while (i < u.size() && u[i] >= '0' && u[i] <= '9')
      precision = precision * 10 + static_cast<int>(u[i++] - '0');
  }
  char type = i < u.size() ? static_cast<char>(u[i++]) : 0;
  if (i != u.size()) Fail("Invalid format specifier '" + spec + "'");
  std::string body;
  bool numeric = v.is_number();
  if (!numeric || type == 's') {
    if (type != 0 && type != 's')
      Fail(std::string("Unknown format code '") + type + "' for object of type '" + KindName(v) + "'");
    body = v.ToStr();
    if (precision >= 0) body = EncodeUtf8(DecodeUtf8(body).substr(0, precision));
    if (!align) align = '<';
  } else {
    bool neg = false;
    if (v.kind() != K::kFloat &&
        (type == 0 || type == 'd' || type == 'x' || type == 'X' || type == 'o' || type == 'b')) {
      int64_t x = v.int_value();
      neg = x < 0;
      uint64_t mag = neg ? 0 - static_cast<uint64_t>(x) : static_cast<uint64_t>(x);
      int base = type == 'x' || type == 'X' ? 16 : type == 'o' ? 8 : type == 'b' ? 2 : 10;
      do {
        int d = static_cast<int>(mag % base);
        body.insert(body.begin(), static_cast<char>(d < 10 ? '0' + d : (type == 'X' ? 'A' : 'a') + d - 10));
        mag /= base;
      } while (mag);
      if (grouping && base == 10)
        for (int p = static_cast<int>(body.size()) - 3; p > 0; p -= 3) body.insert(p, ",");
      if (alt && base != 10) body = std::string("0") + (base == 16 ? type : base == 8 ? 'o' : 'b') + body;
    } else {
      double x = v.float_value();
      neg = std::signbit(x) && !std::isnan(x);
      x = std::fabs(x);
      if (type == 0 && precision < 0) {
        body = v.kind() == K::kFloat ? PyFloatRepr(x) : std::to_string(static_cast<int64_t>(x));
      } else {
        char t = type == 0 ? 'g' : type == '%' ? 'f' : type;
        if (t == 'n') t = 'g';
        if (std::string("fFeEgG").find(t) == std::string::npos)
          Fail(std::string("Unknown format code '") + type + "' for float");
        if (type == '%') x *= 100;
        char fmt[16];
        std::snprintf(fmt, sizeof fmt, "%%%s.%d%c", alt ? "#" : "", precision < 0 ? 6 : precision, t);
        char buf[512];
        std::snprintf(buf, sizeof buf, fmt, x);
        body = buf;
        if (type == '%') body += '%';
      }
    }
    std::string sign_str = neg ? "-" : sign == '+' ? "+" : sign == ' ' ? " " : "";
    if (align == '=') {
      int64_t pad = width - static_cast<int64_t>(sign_str.size() + body.size());
      if (pad > 0) body = EncodeUtf8(std::u32string(pad, fill)) + body;
      return sign_str + body;
    }
    body = sign_str + body;
    if (!align) align = '>';
  }
  return PadTo(body, width, fill, align == '=' ? '>' : align);
}

}  // namespace

std::string StrFormat(const std::string& fmt, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  bool manual = false, automatic = false;  // Python refuses to mix {} and {0}
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      Fail("Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t end = fmt.find('}', i);
    if (end == std::string::npos) Fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, end - i - 1);
    i = end;
    std::string spec;
    char conversion = 0;
    if (size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field.resize(colon);
    }
    if (size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 0;
      field.resize(bang);
    }
    size_t name_end = field.find_first_of(".[");
    std::string head = field.substr(0, name_end);
    Value v;
    bool numbered = !head.empty() &&
                    std::all_of(head.begin(), head.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    automatic |= head.empty();
    manual |= numbered;
    if (manual && automatic) Fail("cannot switch between automatic and manual field numbering");
    if (head.empty()) {
      if (auto_index >= args.positional.size())
        Fail("Replacement index " + std::to_string(auto_index) + " out of range");
      v = args.positional[auto_index++];
    } else if (numbered) {
      size_t idx = std::stoul(head);
      if (idx >= args.positional.size()) Fail("Replacement index " + head + " out of range");
      v = args.positional[idx];
    } else {
      auto it = std::find_if(args.keyword.begin(), args.keyword.end(),
                             [&](const auto& kv) { return kv.first == head; });
      if (it == args.keyword.end()) Fail("KeyError: '" + head + "'");
      v = it->second;
    }
    for (size_t p = name_end; p != std::string::npos && p < field.size();) {
      if (field[p] == '.') {
        size_t q = field.find_first_of(".[", p + 1);
        v = GetAttr(v, field.substr(p + 1, q == std::string::npos ? std::string::npos : q - p - 1));
        p = q;
      } else {
        size_t q = field.find(']', p);
        if (q == std::string::npos) Fail("Missing ']' in format string");
        std::string key = field.substr(p + 1, q - p - 1);
        bool digits = !key.empty() &&
                      std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
        v = GetItem(v, digits ? Value::Int(std::stoll(key)) : Value::Str(key));
        p = q + 1;
      }
    }
    if (conversion == 'r' || conversion == 'a') v = Value::Str(v.Repr());
    if (conversion == 's') v = Value::Str(v.ToStr());
    out += FormatSpec(v, spec);
  }
  return out;
}

// Pads to `width` code points; align is <, > or ^ (CPython's rounding for ^).
std::string PadTo(const std::string& s, int64_t width, char32_t fill, char align) {
  int64_t len = static_cast<int64_t>(DecodeUtf8(s).size());
  if (width <= len) return s;
  int64_t pad = width - len;
  std::string f = EncodeUtf8(std::u32string(1, fill));
  auto rep = [&](int64_t n) {
    std::string r;
    for (int64_t i = 0; i < n; ++i) r += f;
    return r;
  };
  if (align == '<') return s + rep(pad);
  if (align == '>') return rep(pad) + s;
  int64_t left = pad / 2 + (pad & width & 1);  // CPython's str.center rounding
  return rep(left) + s + rep(pad - left);
}

// Python's printf-style formatting: "%s and %5.2f" % (a, b), "%(name)s" % mapping.
std::string PercentFormat(const std::string& fmt, const Value& args) {
  std::vector<Value> positional;
  const Value* mapping = args.kind() == K::kDict ? &args : nullptr;
  // Python skips the "not all arguments converted" check for any subscriptable non-tuple
  // argument (dicts and lists).
  const bool lenient = mapping || (args.kind() == K::kList && !args.list().tuple);
  if (args.kind() == K::kList && args.list().tuple) {
    positional = args.list().items;
  } else {
    positional = {args};
  }
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) Fail("incomplete format");
    Value v;
    bool have_value = false;
    if (fmt[i] == '(') {
      size_t close = fmt.find(')', i);
      if (close == std::string::npos || !mapping) Fail("format requires a mapping");
      const Value* found = mapping->dict().Find(Value::Str(fmt.substr(i + 1, close - i - 1)));
      if (!found) Fail("KeyError: '" + fmt.substr(i + 1, close - i - 1) + "'");
      v = *found;
      have_value = true;
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string("-+ #0").find(fmt[i]) != std::string::npos) flags += fmt[i++];
    auto take = [&]() -> Value {
      if (next >= positional.size()) Fail("not enough arguments for format string");
      return positional[next++];
    };
    auto number = [&](std::string& dst) {
      if (i < fmt.size() && fmt[i] == '*') {
        dst = std::to_string(ToInt(take(), "* width"));
        ++i;
        return;
      }
      while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') dst += fmt[i++];
    };
    std::string width, precision;
    number(width);
    bool has_precision = i < fmt.size() && fmt[i] == '.';
    if (has_precision) {
      ++i;
      number(precision);
    }
    while (i < fmt.size() && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) Fail("incomplete format");
    char conv = fmt[i];
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (!have_value) v = take();
    std::string piece;
    bool left = flags.find('-') != std::string::npos;
    if (conv == 's' || conv == 'r' || conv == 'a') {
      piece = conv == 's' ? v.ToStr() : v.Repr();
      if (has_precision)
        piece = EncodeUtf8(DecodeUtf8(piece).substr(0, precision.empty() ? 0 : std::stoul(precision)));
    } else if (conv == 'c') {
      piece = v.is_string() ? v.string_value()
                            : EncodeUtf8(std::u32string(1, static_cast<char32_t>(ToInt(v, "%c"))));
    } else if (std::string("diuxXo").find(conv) != std::string::npos) {
      if (!v.is_number())
        Fail(std::string("%") + conv + " format: a real number is required, not " + KindName(v));
      if (v.kind() == K::kFloat && conv != 'd' && conv != 'i' && conv != 'u')
        Fail(std::string("%") + conv + " format: an integer is required, not float");
      int64_t x = v.kind() == K::kFloat ? static_cast<int64_t>(v.float_value()) : v.int_value();
      std::string f = "%" + flags + width + (has_precision ? "." + precision : "") +
                      (conv == 'x'   ? PRIx64
                       : conv == 'X' ? PRIX64
                       : conv == 'o' ? PRIo64
                                     : PRId64);
      char buf[128];
      std::snprintf(buf, sizeof buf, f.c_str(), x);
      out += buf;
      continue;
    } else if (std::string("eEfFgG").find(conv) != std::string::npos) {
      if (!v.is_number()) Fail(std::string("must be real number, not ") + KindName(v));
      std::string f =
          "%" + flags + width + "." + (has_precision ? (precision.empty() ? "0" : precision) : "6") + conv;
      char buf[512];
      std::snprintf(buf, sizeof buf, f.c_str(), v.float_value());
      out += buf;
      continue;
    } else {
      Fail(std::string("unsupported format character '") + conv + "'");
    }
    out += PadTo(piece, width.empty() ? 0 : std::stoll(width), ' ', left ? '<' : '>');
  }
  if (!lenient && next < positional.size()) Fail("not all arguments converted during string formatting");
  return out;
}

}  // namespace m3::jinja::internal
