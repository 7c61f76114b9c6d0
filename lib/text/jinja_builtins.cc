// Python semantics the evaluator needs: attribute and item access (with Jinja's dot-vs-bracket
// rules and sandbox refusals), slicing, operators, comparisons, str/dict/list methods.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>

#include "text/jinja_internal.h"

namespace m3::jinja::internal {
namespace {

using K = Value::Kind;

// ---- character classes and case (ASCII, Latin-1, Greek, Cyrillic, full-width Latin: the
// scripts where case matters in practice; Python's full tables are not carried) ----

char32_t UpperChar(char32_t c) {
  if ((c >= 'a' && c <= 'z') || (c >= 0xE0 && c <= 0xFE && c != 0xF7) ||
      (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) || (c >= 0x430 && c <= 0x44F) || (c >= 0xFF41 && c <= 0xFF5A))
    return c - 0x20;
  if (c == 0x3C2) return 0x3A3;  // final sigma
  if (c >= 0x450 && c <= 0x45F) return c - 0x50;
  return c;
}

char32_t LowerChar(char32_t c) {
  if ((c >= 'A' && c <= 'Z') || (c >= 0xC0 && c <= 0xDE && c != 0xD7) ||
      (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) || (c >= 0x410 && c <= 0x42F) || (c >= 0xFF21 && c <= 0xFF3A))
    return c + 0x20;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  return c;
}

bool IsUpperChar(char32_t c) { return LowerChar(c) != c; }
bool IsLowerChar(char32_t c) { return UpperChar(c) != c || c == 0xDF; }

bool IsAlphaChar(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  return IsUpperChar(c) || IsLowerChar(c) || c == 0xAA || c == 0xBA || (c >= 0x100 && c <= 0x24F) ||
         (c >= 0x370 && c <= 0x3FF && c != 0x37E && c != 0x387) || (c >= 0x400 && c <= 0x52F) ||
         (c >= 0x5D0 && c <= 0x5EA) || (c >= 0x620 && c <= 0x64A) ||
         (c >= 0x3041 && c <= 0x30FF && c != 0x30FB) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0xAC00 && c <= 0xD7A3);
}

bool IsDigitChar(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 0x660 && c <= 0x669) || (c >= 0xFF10 && c <= 0xFF19);
}

std::string MapChars(const std::string& s, char32_t (*f)(char32_t)) {
  std::u32string u = DecodeUtf8(s);
  for (char32_t& c : u) c = f(c);
  return EncodeUtf8(u);
}

// Python str.title(): a cased run starts upper, continues lower.
std::string PyTitle(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  bool prev_cased = false;
  for (char32_t& c : u) {
    c = prev_cased ? LowerChar(c) : UpperChar(c);
    prev_cased = IsUpperChar(c) || IsLowerChar(c);
  }
  return EncodeUtf8(u);
}

std::string PyCapitalize(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  for (size_t i = 0; i < u.size(); ++i) u[i] = i == 0 ? UpperChar(u[i]) : LowerChar(u[i]);
  return EncodeUtf8(u);
}

// Python's is{upper,lower}: at least one cased character and none of the other case.
bool PyCaseTest(const std::string& s, bool upper) {
  bool cased = false;
  for (char32_t c : DecodeUtf8(s)) {
    if (upper ? IsLowerChar(c) : IsUpperChar(c)) return false;
    cased |= upper ? IsUpperChar(c) : IsLowerChar(c);
  }
  return cased;
}

// ---- Undefined hints (Jinja's wording) ----

std::string TypeRepr(const Value& obj) { return obj.is_none() ? "'None'" : "'" + KindName(obj) + " object'"; }

Value NoAttribute(const Value& obj, const std::string& name) {
  return Value::Undefined(TypeRepr(obj) + " has no attribute '" + name + "'");
}

Value NoElement(const Value& obj, const Value& key) {
  return Value::Undefined(TypeRepr(obj) + " has no element " + key.Repr());
}

const std::string& Str(const Value& v, const std::string& what) {
  if (!v.is_string()) Fail(what + " must be str, not " + KindName(v));
  return v.string_value();
}

// ---- Python str methods ----

std::vector<std::string> PySplit(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep.is_none() || sep.is_undefined()) {
    // Runs of whitespace separate; leading/trailing whitespace yields nothing.
    std::u32string u = DecodeUtf8(s);
    if (from_right) std::reverse(u.begin(), u.end());
    size_t i = 0;
    while (true) {
      while (i < u.size() && IsPySpace(u[i])) ++i;
      if (i >= u.size()) break;
      size_t start = i;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) {
        size_t end = u.size();
        while (end > start && IsPySpace(u[end - 1])) --end;
        i = end;
      } else {
        while (i < u.size() && !IsPySpace(u[i])) ++i;
      }
      std::u32string piece = u.substr(start, i - start);
      if (from_right) std::reverse(piece.begin(), piece.end());
      parts.push_back(EncodeUtf8(piece));
    }
    if (from_right) std::reverse(parts.begin(), parts.end());
    return parts;
  }
  const std::string& d = Str(sep, "separator");
  if (d.empty()) Fail("empty separator");
  if (!from_right) {
    size_t start = 0;
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      size_t p = s.find(d, start);
      if (p == std::string::npos) break;
      parts.push_back(s.substr(start, p - start));
      start = p + d.size();
    }
    parts.push_back(s.substr(start));
    return parts;
  }
  size_t end = s.size();
  while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
    if (end < d.size()) break;
    size_t p = s.rfind(d, end - d.size());
    if (p == std::string::npos) break;
    parts.push_back(s.substr(p + d.size(), end - p - d.size()));
    end = p;
  }
  parts.push_back(s.substr(0, end));
  std::reverse(parts.begin(), parts.end());
  return parts;
}

std::string PyReplace(const std::string& s, const std::string& old, const std::string& with, int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {  // inserts between every character, like Python
    std::u32string u = DecodeUtf8(s);
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || done < count) {
        out += with;
        ++done;
      }
      if (i < u.size()) out += EncodeUtf8(std::u32string(1, u[i]));
    }
    return out;
  }
  size_t start = 0;
  while (count < 0 || done < count) {
    size_t p = s.find(old, start);
    if (p == std::string::npos) break;
    out += s.substr(start, p - start) + with;
    start = p + old.size();
    ++done;
  }
  return out + s.substr(start);
}

std::vector<std::string> PySplitLines(const std::string& s, bool keepends) {
  std::u32string u = DecodeUtf8(s);
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    char32_t c = u[i];
    bool is_break = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
                    c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!is_break) continue;
    size_t end = i;
    if (c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ++i;
    lines.push_back(EncodeUtf8(u.substr(start, (keepends ? i + 1 : end) - start)));
    start = i + 1;
  }
  if (start < u.size()) lines.push_back(EncodeUtf8(u.substr(start)));
  return lines;
}

// Code-point index of the byte offset `p` in s (find/index report code points).
int64_t CodePointIndex(const std::string& s, size_t p) {
  return static_cast<int64_t>(DecodeUtf8(std::string_view(s).substr(0, p)).size());
}

Value StringMethod(const std::string& s, const std::string& name, const CallArgs& a) {
  auto bind = [&](std::vector<std::string> names, size_t required = 0) {
    return BindArgs("str." + name, a, names, required);
  };
  auto list_of = [](std::vector<std::string> parts) {
    std::vector<Value> out;
    for (auto& p : parts) out.push_back(Value::Str(std::move(p)));
    return Value::MakeList(std::move(out));
  };
  if (name == "startswith" || name == "endswith") {
    BoundArgs b = bind({"prefix"}, 1);
    std::vector<Value> options = b[0].kind() == K::kList ? b[0].list().items : std::vector<Value>{b[0]};
    for (const Value& o : options) {
      const std::string& p = Str(o, name + " arg");
      bool hit = name == "startswith"
                     ? s.compare(0, p.size(), p) == 0
                     : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
      if (hit) return Value::Bool(true);
    }
    return Value::Bool(false);
  }
  if (name == "split" || name == "rsplit") {
    BoundArgs b = bind({"sep", "maxsplit"});
    return list_of(PySplit(s, b[0], b.Has(1) ? ToInt(b[1], "maxsplit") : -1, name == "rsplit"));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    BoundArgs b = bind({"chars"});
    return Value::Str(PyStrip(s, b[0], name != "rstrip", name != "lstrip"));
  }
  if (name == "replace") {
    BoundArgs b = bind({"old", "new", "count"}, 2);
    return Value::Str(PyReplace(s, Str(b[0], "old"), Str(b[1], "new"), b.Has(2) ? ToInt(b[2], "count") : -1));
  }
  static const char* const kNoArgs[] = {"upper",    "lower",   "casefold",  "title",     "capitalize",
                                        "swapcase", "isdigit", "isdecimal", "isnumeric", "isalpha",
                                        "isalnum",  "isspace", "isupper",   "islower",   "istitle"};
  if (std::find_if(std::begin(kNoArgs), std::end(kNoArgs), [&](const char* n) { return name == n; }) !=
      std::end(kNoArgs))
    NoArgs("str." + name, a);
  if (name == "upper") return Value::Str(PyUpper(s));
  if (name == "lower" || name == "casefold") return Value::Str(PyLower(s));
  if (name == "title") return Value::Str(PyTitle(s));
  if (name == "capitalize") return Value::Str(PyCapitalize(s));
  if (name == "swapcase") {
    std::u32string u = DecodeUtf8(s);
    for (char32_t& c : u) c = IsUpperChar(c) ? LowerChar(c) : UpperChar(c);
    return Value::Str(EncodeUtf8(u));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    BoundArgs b = bind({"sub"}, 1);
    const std::string& sub = Str(b[0], "substring");
    size_t p = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
    if (p == std::string::npos) {
      if (name.find("index") != std::string::npos) Fail("substring not found");
      return Value::Int(-1);
    }
    return Value::Int(CodePointIndex(s, p));
  }
  if (name == "count") {
    BoundArgs b = bind({"sub"}, 1);
    const std::string& sub = Str(b[0], "substring");
    if (sub.empty()) return Value::Int(static_cast<int64_t>(DecodeUtf8(s).size()) + 1);
    int64_t n = 0;
    for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
    return Value::Int(n);
  }
  if (name == "join") {
    BoundArgs b = bind({"iterable"}, 1);
    std::string out;
    bool first = true;
    for (const Value& v : Iterate(b[0])) {
      if (!first) out += s;
      first = false;
      out += Str(v, "sequence item");
    }
    return Value::Str(out);
  }
  if (name == "splitlines") {
    BoundArgs b = bind({"keepends"});
    return list_of(PySplitLines(s, b[0].Truthy()));
  }
  if (name == "format") return Value::Str(StrFormat(s, a));
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric" || name == "isalpha" ||
      name == "isalnum" || name == "isspace") {
    std::u32string u = DecodeUtf8(s);
    auto pred = [&](char32_t c) {
      if (name == "isalpha") return IsAlphaChar(c);
      if (name == "isalnum") return IsAlnumChar(c);
      if (name == "isspace") return IsPySpace(c);
      return IsDigitChar(c);
    };
    return Value::Bool(!u.empty() && std::all_of(u.begin(), u.end(), pred));
  }
  if (name == "isupper" || name == "islower") return Value::Bool(PyCaseTest(s, name == "isupper"));
  if (name == "istitle")
    return Value::Bool(!s.empty() && PyTitle(s) == s && PyCaseTest(s, false) != PyCaseTest(s, true));
  if (name == "ljust" || name == "rjust" || name == "center") {
    BoundArgs b = bind({"width", "fillchar"}, 1);
    std::u32string fill = b.Has(1) ? DecodeUtf8(Str(b[1], "fillchar")) : U" ";
    if (fill.size() != 1) Fail("The fill character must be exactly one character long");
    char align = name == "ljust" ? '<' : name == "rjust" ? '>' : '^';
    return Value::Str(PadTo(s, ToInt(b[0], "width"), fill[0], align));
  }
  if (name == "zfill") {
    BoundArgs b = bind({"width"}, 1);
    int64_t width = ToInt(b[0], "width");
    int64_t len = static_cast<int64_t>(DecodeUtf8(s).size());
    if (width <= len) return Value::Str(s);
    size_t sign = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
    return Value::Str(s.substr(0, sign) + std::string(width - len, '0') + s.substr(sign));
  }
  if (name == "removeprefix" || name == "removesuffix") {
    BoundArgs b = bind({"affix"}, 1);
    const std::string& x = Str(b[0], name + " arg");
    if (name == "removeprefix") return Value::Str(s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s);
    bool ends = s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
    return Value::Str(ends ? s.substr(0, s.size() - x.size()) : s);
  }
  if (name == "partition" || name == "rpartition") {
    BoundArgs b = bind({"sep"}, 1);
    const std::string& sep = Str(b[0], "separator");
    if (sep.empty()) Fail("empty separator");
    size_t p = name == "partition" ? s.find(sep) : s.rfind(sep);
    std::vector<Value> parts;
    if (p == std::string::npos) {
      parts = name == "partition" ? std::vector<Value>{Value::Str(s), Value::Str(""), Value::Str("")}
                                  : std::vector<Value>{Value::Str(""), Value::Str(""), Value::Str(s)};
    } else {
      parts = {Value::Str(s.substr(0, p)), Value::Str(sep), Value::Str(s.substr(p + sep.size()))};
    }
    return Value::MakeList(std::move(parts), true);
  }
  Fail("'str' object has no attribute '" + name + "'");
}

const char* const kStringMethods[] = {
    "startswith",   "endswith",     "split",     "rsplit",    "strip",   "lstrip",     "rstrip",
    "replace",      "upper",        "lower",     "casefold",  "title",   "capitalize", "swapcase",
    "find",         "rfind",        "index",     "rindex",    "count",   "join",       "splitlines",
    "format",       "isdigit",      "isdecimal", "isnumeric", "isalpha", "isalnum",    "isspace",
    "isupper",      "islower",      "istitle",   "ljust",     "rjust",   "center",     "zfill",
    "removeprefix", "removesuffix", "partition", "rpartition"};
const char* const kDictMethods[] = {"items", "keys", "values", "get", "copy"};
const char* const kListMethods[] = {"index", "count", "copy"};
// Methods that mutate: the immutable sandbox refuses them.
const char* const kDictMutators[] = {"update", "pop", "popitem", "setdefault", "clear"};
const char* const kListMutators[] = {"append", "extend", "insert", "pop",
                                     "remove", "clear",  "sort",   "reverse"};

template <size_t N>
bool In(const char* const (&names)[N], const std::string& name) {
  return std::find_if(std::begin(names), std::end(names), [&](const char* n) { return name == n; }) !=
         std::end(names);
}

Value DictMethod(const Value& d, const std::string& name, const CallArgs& a) {
  BoundArgs b =
      BindArgs("dict." + name, a,
               name == "get" ? std::vector<std::string>{"key", "default"} : std::vector<std::string>{},
               name == "get" ? 1 : 0);
  std::vector<Value> out;
  if (name == "get") {
    const Value* v = d.dict().Find(b[0]);
    return v ? *v : b.Has(1) ? b[1] : Value::None();
  }
  if (name == "copy") return d;
  for (const auto& [k, v] : d.dict().items) {
    if (name == "items") out.push_back(Value::MakeList({k, v}, true));
    if (name == "keys") out.push_back(k);
    if (name == "values") out.push_back(v);
  }
  return Value::MakeList(std::move(out));
}

Value ListMethod(const Value& l, const std::string& name, const CallArgs& a) {
  if (name == "copy") {
    NoArgs("list.copy", a);
    return l;
  }
  BoundArgs b = BindArgs("list." + name, a, {"value"}, 1);
  const auto& items = l.list().items;
  if (name == "count")
    return Value::Int(
        std::count_if(items.begin(), items.end(), [&](const Value& v) { return Equals(v, b[0]); }));
  for (size_t i = 0; i < items.size(); ++i)
    if (Equals(items[i], b[0])) return Value::Int(static_cast<int64_t>(i));
  Fail(b[0].Repr() + " is not in list");
}

Value BoundMethod(const Value& obj, const std::string& name) {
  return MakeBuiltin(name, [obj, name](const CallArgs& a) {
    if (obj.kind() == K::kString) return StringMethod(obj.string_value(), name, a);
    if (obj.kind() == K::kDict) return DictMethod(obj, name, a);
    return ListMethod(obj, name, a);
  });
}

Value Unsafe(const Value& obj, const std::string& name) {
  return Value::Undefined("access to attribute '" + name + "' of '" + KindName(obj) + "' object is unsafe.");
}

// Attribute lookup only (methods, namespace attributes); Undefined when absent.
Value LookupAttribute(const Value& obj, const std::string& name, bool* found) {
  *found = true;
  switch (obj.kind()) {
    case K::kString:
      if (In(kStringMethods, name)) return BoundMethod(obj, name);
      break;
    case K::kDict:
      if (In(kDictMethods, name)) return BoundMethod(obj, name);
      if (In(kDictMutators, name)) return Unsafe(obj, name);
      break;
    case K::kList:
      if (In(kListMethods, name)) return BoundMethod(obj, name);
      if (In(kListMutators, name) && !obj.list().tuple) return Unsafe(obj, name);
      break;
    case K::kNamespace:
      if (const Value* v = obj.namespace_attrs().Find(Value::Str(name))) return *v;
      break;
    default: break;
  }
  *found = false;
  return Value();
}

int64_t NormalizeIndex(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

// Python slice indices for a sequence of length n.
std::vector<int64_t> SliceIndices(int64_t n, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto get = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    if (v.kind() != K::kInt && v.kind() != K::kBool)
      Fail(std::string("slice indices must be integers or None, not ") + KindName(v) + " (" + what + ")");
    return v.int_value();
  };
  int64_t step = get(step_v, "step").value_or(1);
  if (step == 0) Fail("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  int64_t start = clamp(get(start_v, "start"), step > 0 ? 0 : n - 1);
  int64_t stop = clamp(get(stop_v, "stop"), step > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(i);
  return out;
}

[[noreturn]] void BadOperands(const std::string& op, const Value& a, const Value& b) {
  Fail("unsupported operand type(s) for " + op + ": '" + KindName(a) + "' and '" + KindName(b) + "'");
}

// Python ints are unbounded; ours are 64-bit, so an overflow is an error, not a wrong number.
Value CheckedInt(bool overflowed, int64_t v) {
  if (overflowed) Fail("integer overflow: the result does not fit in 64 bits");
  return Value::Int(v);
}

int64_t FloorDiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

}  // namespace

// ---- shared helpers ----

BoundArgs BindArgs(const std::string& fn, const CallArgs& args, const std::vector<std::string>& names,
                   size_t required) {
  BoundArgs b;
  b.values.resize(names.size());
  b.given.assign(names.size(), false);
  if (args.positional.size() > names.size())
    Fail(fn + "() takes at most " + std::to_string(names.size()) + " argument(s) (" +
         std::to_string(args.positional.size()) + " given)");
  for (size_t i = 0; i < args.positional.size(); ++i) {
    b.values[i] = args.positional[i];
    b.given[i] = true;
  }
  for (const auto& [k, v] : args.keyword) {
    auto it = std::find(names.begin(), names.end(), k);
    if (it == names.end()) Fail(fn + "() got an unexpected keyword argument '" + k + "'");
    size_t i = static_cast<size_t>(it - names.begin());
    if (b.given[i]) Fail(fn + "() got multiple values for argument '" + k + "'");
    b.values[i] = v;
    b.given[i] = true;
  }
  for (size_t i = 0; i < required; ++i)
    if (!b.given[i]) Fail(fn + "() missing required argument: '" + names[i] + "'");
  return b;
}

void NoArgs(const std::string& fn, const CallArgs& args) {
  if (!args.positional.empty() || !args.keyword.empty()) Fail(fn + "() takes no arguments");
}

std::string PyLower(const std::string& s) { return MapChars(s, LowerChar); }
std::string PyUpper(const std::string& s) { return MapChars(s, UpperChar); }
bool IsAlnumChar(char32_t c) { return IsAlphaChar(c) || IsDigitChar(c); }

std::string PyStrip(const std::string& s, const Value& chars, bool left, bool right) {
  std::u32string u = DecodeUtf8(s);
  std::u32string set;
  bool whitespace = chars.is_none() || chars.is_undefined();
  if (!whitespace) set = DecodeUtf8(Str(chars, "strip arg"));
  auto strip_it = [&](char32_t c) { return whitespace ? IsPySpace(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return EncodeUtf8(u.substr(b, e - b));
}

int64_t ToInt(const Value& v, const std::string& what) {
  if (v.kind() != K::kInt && v.kind() != K::kBool)
    Fail(what + ": '" + KindName(v) + "' object cannot be interpreted as an integer");
  return v.int_value();
}

int64_t PyLen(const Value& v) {
  switch (v.kind()) {
    case K::kUndefined: return 0;
    case K::kString: return static_cast<int64_t>(DecodeUtf8(v.string_value()).size());
    case K::kList: return static_cast<int64_t>(v.list().items.size());
    case K::kDict: return static_cast<int64_t>(v.dict().items.size());
    default: Fail("object of type '" + KindName(v) + "' has no len()");
  }
}

std::vector<Value> Iterate(const Value& v) {
  switch (v.kind()) {
    case K::kUndefined: return {};
    case K::kList: return v.list().items;
    case K::kDict: {
      std::vector<Value> keys;
      for (const auto& kv : v.dict().items) keys.push_back(kv.first);
      return keys;
    }
    case K::kString: {
      std::vector<Value> chars;
      for (char32_t c : DecodeUtf8(v.string_value()))
        chars.push_back(Value::Str(EncodeUtf8(std::u32string(1, c))));
      return chars;
    }
    default: Fail("'" + KindName(v) + "' object is not iterable");
  }
}

// ---- access ----

// `obj.name`: attributes (methods) first, then items, as Jinja's getattr does.
Value GetAttr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) FailUndefined(obj);
  bool found = false;
  Value attr = LookupAttribute(obj, name, &found);
  if (found) return attr;
  if (obj.kind() == K::kDict) {
    if (const Value* v = obj.dict().Find(Value::Str(name))) return *v;
  }
  return NoAttribute(obj, name);
}

Value GetAttribute(const Value& obj, const std::string& name) {
  bool found = false;
  Value attr = LookupAttribute(obj, name, &found);
  return found ? attr : NoAttribute(obj, name);
}

// `obj[key]`: items first, then attributes for string keys, as Jinja's getitem does.
Value GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) FailUndefined(obj);
  if (obj.kind() == K::kDict) {
    if (const Value* v = obj.dict().Find(key)) return *v;
  } else if ((obj.kind() == K::kList || obj.kind() == K::kString) &&
             (key.kind() == K::kInt || key.kind() == K::kBool)) {
    if (obj.kind() == K::kList) {
      const auto& items = obj.list().items;
      int64_t i = NormalizeIndex(key.int_value(), static_cast<int64_t>(items.size()));
      if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[i];
    } else {
      std::u32string u = DecodeUtf8(obj.string_value());
      int64_t i = NormalizeIndex(key.int_value(), static_cast<int64_t>(u.size()));
      if (i >= 0 && i < static_cast<int64_t>(u.size())) return Value::Str(EncodeUtf8(u.substr(i, 1)));
    }
    return NoElement(obj, key);
  }
  if (key.is_string()) {
    bool found = false;
    Value attr = LookupAttribute(obj, key.string_value(), &found);
    if (found) return attr;
    return NoAttribute(obj, key.string_value());
  }
  return NoElement(obj, key);
}

Value Slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) FailUndefined(obj);
  if (obj.kind() == K::kList) {
    const auto& items = obj.list().items;
    std::vector<Value> out;
    for (int64_t i : SliceIndices(static_cast<int64_t>(items.size()), start, stop, step))
      out.push_back(items[i]);
    return Value::MakeList(std::move(out), obj.list().tuple);
  }
  if (obj.kind() == K::kString) {
    std::u32string u = DecodeUtf8(obj.string_value());
    std::u32string out;
    for (int64_t i : SliceIndices(static_cast<int64_t>(u.size()), start, stop, step)) out += u[i];
    return Value::Str(EncodeUtf8(out));
  }
  Fail("'" + KindName(obj) + "' object is not subscriptable");
}

Value CallValue(const Value& fn, const CallArgs& args) {
  if (fn.is_undefined()) FailUndefined(fn);
  if (fn.kind() != K::kFunction) Fail("'" + KindName(fn) + "' object is not callable");
  return fn.function().call(args);
}

// ---- operators ----

Value BinaryOp(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  bool nums = a.is_number() && b.is_number();
  int64_t r = 0;
  bool ints = nums && a.kind() != K::kFloat && b.kind() != K::kFloat;
  if (op == "+") {
    if (ints) {
      bool overflow = __builtin_add_overflow(a.int_value(), b.int_value(), &r);
      return CheckedInt(overflow, r);
    }
    if (nums) return Value::Float(a.float_value() + b.float_value());
    if (a.is_string() && b.is_string()) return Value::Str(a.string_value() + b.string_value());
    if (a.kind() == K::kList && b.kind() == K::kList && a.list().tuple == b.list().tuple) {
      std::vector<Value> items = a.list().items;
      items.insert(items.end(), b.list().items.begin(), b.list().items.end());
      return Value::MakeList(std::move(items), a.list().tuple);
    }
    if (a.is_string()) Fail("can only concatenate str (not \"" + KindName(b) + "\") to str");
    BadOperands(op, a, b);
  }
  if (op == "-") {
    if (ints) {
      bool overflow = __builtin_sub_overflow(a.int_value(), b.int_value(), &r);
      return CheckedInt(overflow, r);
    }
    if (nums) return Value::Float(a.float_value() - b.float_value());
    BadOperands(op, a, b);
  }
  if (op == "*") {
    if (ints) {
      bool overflow = __builtin_mul_overflow(a.int_value(), b.int_value(), &r);
      return CheckedInt(overflow, r);
    }
    if (nums) return Value::Float(a.float_value() * b.float_value());
    const Value* seq = a.kind() == K::kString || a.kind() == K::kList ? &a : &b;
    const Value* count = seq == &a ? &b : &a;
    if ((seq->kind() == K::kString || seq->kind() == K::kList) &&
        (count->kind() == K::kInt || count->kind() == K::kBool)) {
      int64_t n = std::max<int64_t>(0, count->int_value());
      if (seq->kind() == K::kString) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq->string_value();
        return Value::Str(std::move(out));
      }
      std::vector<Value> out;
      for (int64_t i = 0; i < n; ++i)
        out.insert(out.end(), seq->list().items.begin(), seq->list().items.end());
      return Value::MakeList(std::move(out), seq->list().tuple);
    }
    BadOperands(op, a, b);
  }
  if (op == "%" && a.is_string()) return Value::Str(PercentFormat(a.string_value(), b));
  if (!nums) BadOperands(op, a, b);
  if (op == "/") {
    if (b.float_value() == 0) Fail("division by zero");
    return Value::Float(a.float_value() / b.float_value());
  }
  if (op == "//" || op == "%") {
    if (ints) {
      if (b.int_value() == 0)
        Fail(op == "//" ? "integer division or modulo by zero" : "integer modulo by zero");
      if (a.int_value() == INT64_MIN && b.int_value() == -1) {
        if (op == "%") return Value::Int(0);
        CheckedInt(true, 0);
      }
      int64_t q = FloorDiv(a.int_value(), b.int_value());
      return Value::Int(op == "//" ? q : a.int_value() - q * b.int_value());
    }
    double x = a.float_value(), y = b.float_value();
    if (y == 0) Fail("float division by zero");
    double q = std::floor(x / y);
    if (op == "//") return Value::Float(q);
    double r = std::fmod(x, y);
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    return Value::Float(r);
  }
  if (op == "**") {
    if (ints && b.int_value() >= 0) {
      int64_t base = a.int_value(), e = b.int_value();
      if (base == 0 || base == 1) return Value::Int(e == 0 ? 1 : base);
      if (base == -1) return Value::Int(e % 2 ? -1 : 1);
      int64_t result = 1;
      for (int64_t i = 0; i < e; ++i)
        if (__builtin_mul_overflow(result, base, &result)) return CheckedInt(true, 0);
      return Value::Int(result);
    }
    return Value::Float(std::pow(a.float_value(), b.float_value()));
  }
  BadOperands(op, a, b);
}

bool PyLess(const Value& a, const Value& b) {
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.kind() != K::kFloat && b.kind() != K::kFloat) return a.int_value() < b.int_value();
    return a.float_value() < b.float_value();
  }
  if (a.is_string() && b.is_string()) return a.string_value() < b.string_value();
  if (a.kind() == K::kList && b.kind() == K::kList && a.list().tuple == b.list().tuple) {
    const auto& x = a.list().items;
    const auto& y = b.list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (Equals(x[i], y[i])) continue;
      return PyLess(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  Fail("'<' not supported between instances of '" + KindName(a) + "' and '" + KindName(b) + "'");
}

bool Compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return Equals(a, b);
  if (op == "!=") return !Equals(a, b);
  if (op == "<") return PyLess(a, b);
  if (op == ">") return PyLess(b, a);
  if (op == "<=") return PyLess(a, b) || Equals(a, b);
  if (op == ">=") return PyLess(b, a) || Equals(a, b);
  bool negate = op == "not in";
  bool found = false;
  switch (b.kind()) {
    case K::kString:
      if (!a.is_string()) Fail("'in <string>' requires string as left operand, not " + KindName(a));
      found = b.string_value().find(a.string_value()) != std::string::npos;
      break;
    case K::kList:
      found = std::any_of(b.list().items.begin(), b.list().items.end(),
                          [&](const Value& v) { return Equals(v, a); });
      break;
    case K::kDict: found = b.dict().Find(a) != nullptr; break;
    case K::kUndefined: found = false; break;  // iterates as empty
    default: Fail("argument of type '" + KindName(b) + "' is not iterable");
  }
  return found != negate;
}

}  // namespace m3::jinja::internal
