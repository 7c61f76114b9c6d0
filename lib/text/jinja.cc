// Jinja values: construction, Python's str()/repr()/==/bool(), JSON in and out (json.dumps
// spelling), UTF-8 helpers.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "text/jinja_internal.h"

namespace m3::jinja {

using internal::Fail;

// ---- construction ----

Value Value::Undefined(std::string hint) {
  Value v;
  v.data_ = std::move(hint);
  return v;
}
Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  v.data_ = std::monostate();
  return v;
}
Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.data_ = b;
  return v;
}
Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.data_ = i;
  return v;
}
Value Value::Float(double d) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.data_ = d;
  return v;
}
Value Value::Str(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.data_ = std::move(s);
  return v;
}
Value Value::MakeList(std::vector<Value> items, bool tuple) {
  Value v;
  v.kind_ = Kind::kList;
  v.data_ = std::make_shared<const List>(List{std::move(items), tuple});
  return v;
}
Value Value::MakeDict(Dict dict) {
  Value v;
  v.kind_ = Kind::kDict;
  v.data_ = std::make_shared<const Dict>(std::move(dict));
  return v;
}
Value Value::MakeNamespace(Dict attrs) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.data_ = std::make_shared<Dict>(std::move(attrs));
  return v;
}
Value Value::FromInternalFunction(std::shared_ptr<const internal::FunctionImpl> fn) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.data_ = std::move(fn);
  return v;
}
Value Value::MakeFunction(std::string name, NativeFunction fn) {
  // Host functions report errors as a Status; inside the interpreter they travel as Error.
  return internal::MakeBuiltin(name, [fn = std::move(fn)](const CallArgs& args) {
    StatusOr<Value> r = fn(args);
    if (!r.ok()) throw internal::Error{r.status().message(), 0, r.status()};
    return std::move(r).value();
  });
}

namespace {
template <class J>
Value FromJsonImpl(const J& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::None();
    case nlohmann::json::value_t::boolean: return Value::Bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::Int(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value::Int(static_cast<int64_t>(u));
      return Value::Float(static_cast<double>(u));  // beyond 64-bit ints
    }
    case nlohmann::json::value_t::number_float: return Value::Float(j.template get<double>());
    case nlohmann::json::value_t::string: return Value::Str(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(FromJsonImpl(e));
      return Value::MakeList(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Value::Dict d;
      d.items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it)
        d.items.emplace_back(Value::Str(it.key()), FromJsonImpl(it.value()));
      return Value::MakeDict(std::move(d));
    }
    default: return Value::None();  // binary / discarded: not produced by parsing JSON text
  }
}
}  // namespace

Value Value::FromJson(const nlohmann::ordered_json& j) { return FromJsonImpl(j); }
Value Value::FromJson(const nlohmann::json& j) { return FromJsonImpl(j); }

// ---- accessors and Python protocols ----

int64_t Value::int_value() const {
  if (kind_ == Kind::kBool) return std::get<bool>(data_) ? 1 : 0;
  return std::get<int64_t>(data_);
}

double Value::float_value() const {
  if (kind_ == Kind::kFloat) return std::get<double>(data_);
  return static_cast<double>(int_value());
}

const Value* Value::Dict::Find(const Value& key) const {
  for (const auto& [k, v] : items)
    if (Equals(k, key)) return &v;
  return nullptr;
}
Value* Value::Dict::Find(const Value& key) {
  for (auto& [k, v] : items)
    if (Equals(k, key)) return &v;
  return nullptr;
}
void Value::Dict::Set(Value key, Value value) {
  if (Value* existing = Find(key)) {
    *existing = std::move(value);
  } else {
    items.emplace_back(std::move(key), std::move(value));
  }
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return bool_value();
    case Kind::kInt: return int_value() != 0;
    case Kind::kFloat: return float_value() != 0.0;
    case Kind::kString: return !string_value().empty();
    case Kind::kList: return !list().items.empty();
    case Kind::kDict: return !dict().items.empty();
    case Kind::kFunction:
    case Kind::kNamespace: return true;
  }
  return false;
}

bool Equals(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() != K::kFloat && b.kind() != K::kFloat) return a.int_value() == b.int_value();
    return a.float_value() == b.float_value();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::kUndefined:
    case K::kNone: return true;
    case K::kString: return a.string_value() == b.string_value();
    case K::kList: {
      const auto& x = a.list();
      const auto& y = b.list();
      if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i)
        if (!Equals(x.items[i], y.items[i])) return false;
      return true;
    }
    case K::kDict: {
      const auto& x = a.dict();
      const auto& y = b.dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* other = y.Find(k);
        if (!other || !Equals(v, *other)) return false;
      }
      return true;
    }
    default: return a.SameAs(b);
  }
}

bool Value::SameAs(const Value& other) const {
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined: return false;  // every lookup makes a fresh Undefined in Jinja
    case Kind::kNone: return true;
    case Kind::kBool:
    case Kind::kInt:
    case Kind::kFloat:
    case Kind::kString: return Equals(*this, other);
    case Kind::kList: return &list() == &other.list();
    case Kind::kDict: return &dict() == &other.dict();
    case Kind::kFunction: return &function() == &other.function();
    case Kind::kNamespace: return &namespace_attrs() == &other.namespace_attrs();
  }
  return false;
}

namespace {

void AppendUtf8(std::string& out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF) {  // an invalid input byte, see DecodeUtf8
    out += static_cast<char>(c - 0xDC00);
  } else if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// Python's str.isprintable(), approximated by the control, format and separator ranges that
// occur in practice (full Unicode tables are not worth carrying for repr()).
bool IsPyPrintable(char32_t c) {
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F)) return false;
  if ((c >= 0x205F && c <= 0x2064) || c == 0x3000 || c == 0xFEFF) return false;
  if ((c >= 0xD800 && c <= 0xF8FF) || (c >= 0xFFF9 && c <= 0xFFFB)) return false;
  return true;
}

std::string PyStrRepr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  char buf[16];
  for (char32_t c : internal::DecodeUtf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (IsPyPrintable(c)) {
      AppendUtf8(out, c);
    } else {
      if (c < 0x100) {
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      } else if (c < 0x10000) {
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      } else {
        std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
      }
      out += buf;
    }
  }
  out += quote;
  return out;
}

}  // namespace

std::string Value::ToStr() const {
  switch (kind_) {
    case Kind::kUndefined: return "";
    case Kind::kString: return string_value();
    default: return Repr();
  }
}

std::string Value::Repr() const {
  switch (kind_) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "None";
    case Kind::kBool: return bool_value() ? "True" : "False";
    case Kind::kInt: return std::to_string(int_value());
    case Kind::kFloat: return internal::PyFloatRepr(float_value());
    case Kind::kString: return PyStrRepr(string_value());
    case Kind::kList: {
      const List& l = list();
      std::string out = l.tuple ? "(" : "[";
      for (size_t i = 0; i < l.items.size(); ++i) {
        if (i) out += ", ";
        out += l.items[i].Repr();
      }
      if (l.tuple && l.items.size() == 1) out += ",";
      out += l.tuple ? ")" : "]";
      return out;
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      const Dict& d = kind_ == Kind::kDict ? dict() : namespace_attrs();
      std::string out = "{";
      for (size_t i = 0; i < d.items.size(); ++i) {
        if (i) out += ", ";
        out += d.items[i].first.Repr() + ": " + d.items[i].second.Repr();
      }
      out += "}";
      return kind_ == Kind::kDict ? out : "<Namespace " + out + ">";
    }
    case Kind::kFunction: return "<function " + function().name + ">";
  }
  return "";
}

StatusOr<nlohmann::ordered_json> Value::ToJson() const {
  switch (kind_) {
    case Kind::kNone: return nlohmann::ordered_json(nullptr);
    case Kind::kBool: return nlohmann::ordered_json(bool_value());
    case Kind::kInt: return nlohmann::ordered_json(int_value());
    case Kind::kFloat: return nlohmann::ordered_json(float_value());
    case Kind::kString: return nlohmann::ordered_json(string_value());
    case Kind::kList: {
      auto out = nlohmann::ordered_json::array();
      for (const Value& v : list().items) {
        M3_ASSIGN_OR_RETURN(auto j, v.ToJson());
        out.push_back(std::move(j));
      }
      return out;
    }
    case Kind::kDict: {
      auto out = nlohmann::ordered_json::object();
      for (const auto& [k, v] : dict().items) {
        M3_ASSIGN_OR_RETURN(auto j, v.ToJson());
        out[k.ToStr()] = std::move(j);
      }
      return out;
    }
    default: return InvalidArgument("a ", internal::KindName(*this), " value has no JSON form");
  }
}

namespace internal {

[[noreturn]] void Fail(std::string message) { throw Error{std::move(message), 0, std::nullopt}; }
[[noreturn]] void FailAt(int line, std::string message) {
  throw Error{std::move(message), line, std::nullopt};
}

Value MakeBuiltin(std::string name, std::function<Value(const CallArgs&)> fn) {
  return Value::FromInternalFunction(
      std::make_shared<const FunctionImpl>(FunctionImpl{std::move(name), std::move(fn)}));
}

std::string KindName(const Value& v) {
  using K = Value::Kind;
  switch (v.kind()) {
    case K::kUndefined: return "Undefined";
    case K::kNone: return "NoneType";
    case K::kBool: return "bool";
    case K::kInt: return "int";
    case K::kFloat: return "float";
    case K::kString: return "str";
    case K::kList: return v.list().tuple ? "tuple" : "list";
    case K::kDict: return "dict";
    case K::kFunction: return "function";
    case K::kNamespace: return "Namespace";
  }
  return "object";
}

std::u32string DecodeUtf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    char32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Reject overlong forms, surrogates and out-of-range values like a strict decoder.
    if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
               cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)))
      ok = false;
    if (ok) {
      out += cp;
      i += len;
    } else {
      out += static_cast<char32_t>(0xDC00 + c);  // keep the raw byte (surrogateescape)
      ++i;
    }
  }
  return out;
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) AppendUtf8(out, c);
  return out;
}

bool IsPySpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Python's repr(float): the shortest round-trip digits, positional for exponents -4..15,
// otherwise scientific with a two-digit (at least) exponent.
std::string PyFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // e.g. "-2.5e+00"
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exp = std::stoi(sci.substr(e + 1));
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      if (digits.size() <= static_cast<size_t>(exp) + 1) {
        out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
      }
    } else {
      out = "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += eb;
  }
  return sign + out;
}

namespace {

void AppendJsonString(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  char buf[16];
  for (char32_t c : DecodeUtf8(s)) {
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
      if (c < 0x10000) {
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
        out += buf;
      } else {
        char32_t v = c - 0x10000;
        std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                      static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
        out += buf;
      }
    } else {
      AppendUtf8(out, c);
    }
  }
  out += '"';
}

std::string JsonFloat(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d < 0 ? "-Infinity" : "Infinity";
  return PyFloatRepr(d);
}

void AppendJson(std::string& out, const Value& v, const JsonFormat& f, int level) {
  using K = Value::Kind;
  auto newline = [&](int lvl) {
    out += '\n';
    for (int i = 0; i < lvl; ++i) out += f.indent;
  };
  switch (v.kind()) {
    case K::kNone: out += "null"; return;
    case K::kBool: out += v.bool_value() ? "true" : "false"; return;
    case K::kInt: out += std::to_string(v.int_value()); return;
    case K::kFloat: out += JsonFloat(v.float_value()); return;
    case K::kString: AppendJsonString(out, v.string_value(), f.ensure_ascii); return;
    case K::kList: {
      const auto& items = v.list().items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += f.item_sep;
        if (f.has_indent) newline(level + 1);
        AppendJson(out, items[i], f, level + 1);
      }
      if (f.has_indent) newline(level);
      out += ']';
      return;
    }
    case K::kDict: {
      std::vector<std::pair<Value, Value>> items = v.dict().items;
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (f.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](const auto& a, const auto& b) { return PyLess(a.first, b.first); });
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += f.item_sep;
        if (f.has_indent) newline(level + 1);
        const Value& k = items[i].first;
        switch (k.kind()) {
          case K::kString: AppendJsonString(out, k.string_value(), f.ensure_ascii); break;
          case K::kNone: out += "\"null\""; break;
          case K::kBool: out += k.bool_value() ? "\"true\"" : "\"false\""; break;
          case K::kInt: out += "\"" + std::to_string(k.int_value()) + "\""; break;
          case K::kFloat: out += "\"" + JsonFloat(k.float_value()) + "\""; break;
          default: Fail("keys must be str, int, float, bool or None, not " + KindName(k));
        }
        out += f.key_sep;
        AppendJson(out, items[i].second, f, level + 1);
      }
      if (f.has_indent) newline(level);
      out += '}';
      return;
    }
    default: Fail("Object of type " + KindName(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string ToJsonText(const Value& v, const JsonFormat& format) {
  std::string out;
  AppendJson(out, v, format, 0);
  return out;
}

[[noreturn]] void FailUndefined(const Value& v) {
  Fail(v.undefined_hint().empty() ? std::string("value is undefined") : v.undefined_hint());
}

}  // namespace internal
}  // namespace m3::jinja
