// Jinja's builtin filters and tests (Jinja2 3.1 signatures and behaviour), with transformers'
// tojson (json.dumps: no HTML escaping, ensure_ascii/indent/separators/sort_keys options).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <unordered_map>

#include "text/jinja_internal.h"

namespace m3::jinja::internal {
namespace {

using K = Value::Kind;
using FilterFn = std::function<Value(const Value&, const CallArgs&)>;
using TestFn = std::function<bool(const Value&, const CallArgs&)>;

Value List(std::vector<Value> items) { return Value::MakeList(std::move(items)); }

// Lowercases strings for the case-insensitive comparisons of sort/unique/min/max/dictsort.
Value CaseKey(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_string() ? Value::Str(PyLower(v.string_value())) : v;
}

// Jinja's make_attrgetter: "a.b.0" walks items/attributes; ints index sequences.
std::function<Value(const Value&)> AttrGetter(const Value& attribute, const Value& dflt = Value()) {
  std::vector<Value> parts;
  if (attribute.kind() == K::kInt) {
    parts.push_back(attribute);
  } else {
    std::string a = attribute.ToStr();
    size_t start = 0;
    while (true) {
      size_t dot = a.find('.', start);
      std::string p = a.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      bool digits =
          !p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; });
      parts.push_back(digits ? Value::Int(std::stoll(p)) : Value::Str(p));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
  }
  return [parts, dflt](const Value& item) {
    Value v = item;
    for (const Value& p : parts) v = GetItem(v, p);
    if (v.is_undefined() && !dflt.is_undefined()) return dflt;
    return v;
  };
}

// A key by attribute path. With `multi` (the sort filter), "a,b" names several attributes and
// the key is always a tuple, like Jinja's make_multi_attrgetter (so two missing attributes
// compare equal instead of failing).
std::function<Value(const Value&)> SortKeyGetter(const Value& attribute, bool case_sensitive,
                                                 bool multi = false) {
  if (attribute.is_undefined() || attribute.is_none())
    return [case_sensitive](const Value& v) { return CaseKey(v, case_sensitive); };
  std::vector<std::function<Value(const Value&)>> getters;
  std::string a = attribute.kind() == K::kInt ? "" : attribute.ToStr();
  if (!multi || a.find(',') == std::string::npos) {
    getters.push_back(AttrGetter(attribute));
  } else {
    size_t start = 0;
    while (true) {
      size_t comma = a.find(',', start);
      getters.push_back(AttrGetter(
          Value::Str(a.substr(start, comma == std::string::npos ? std::string::npos : comma - start))));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return [getters, case_sensitive, multi](const Value& item) {
    if (!multi) return CaseKey(getters[0](item), case_sensitive);
    std::vector<Value> key;
    for (const auto& g : getters) key.push_back(CaseKey(g(item), case_sensitive));
    return Value::MakeList(std::move(key), true);
  };
}

std::vector<Value> SortBy(std::vector<Value> items, const std::function<Value(const Value&)>& key,
                          bool reverse) {
  std::vector<std::pair<Value, Value>> keyed;
  for (Value& v : items) keyed.emplace_back(key(v), std::move(v));
  std::stable_sort(keyed.begin(), keyed.end(), [reverse](const auto& x, const auto& y) {
    return reverse ? PyLess(y.first, x.first) : PyLess(x.first, y.first);
  });
  std::vector<Value> out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return out;
}

CallArgs Rest(const CallArgs& a, size_t from) {
  CallArgs r;
  if (from < a.positional.size()) r.positional.assign(a.positional.begin() + from, a.positional.end());
  r.keyword = a.keyword;
  return r;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Python int(str) / float(str): optional surrounding whitespace, sign, underscores between digits.
std::optional<int64_t> ParsePyInt(const std::string& raw, int base) {
  std::string s = PyStrip(raw, Value(), true, true);
  if (s.empty()) return std::nullopt;
  size_t i = (s[0] == '+' || s[0] == '-') ? 1 : 0;
  std::string digits;
  for (size_t k = i; k < s.size(); ++k) {
    if (s[k] == '_' && k > i && k + 1 < s.size() && s[k + 1] != '_') continue;
    digits += s[k];
  }
  if (digits.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(digits.c_str(), &end, base);
  if (*end != '\0' || errno == ERANGE || digits[0] == '+' || digits[0] == '-' || digits[0] == ' ')
    return std::nullopt;
  return s[0] == '-' ? -v : v;
}

std::optional<double> ParsePyFloat(const std::string& raw) {
  std::string s = PyStrip(raw, Value(), true, true);
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (*end != '\0') return std::nullopt;
  std::string lower = PyLower(s);
  if (lower.find("x") != std::string::npos) return std::nullopt;  // strtod takes hex, Python does not
  return d;
}

Value FilterInt(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("int", a, {"default", "base"});
  Value dflt = b.Has(0) ? b[0] : Value::Int(0);
  int base = b.Has(1) ? static_cast<int>(ToInt(b[1], "base")) : 10;
  if (v.is_undefined()) FailUndefined(v);
  if (v.kind() == K::kInt || v.kind() == K::kBool) return Value::Int(v.int_value());
  if (v.kind() == K::kFloat) {
    if (!std::isfinite(v.float_value())) return dflt;
    return Value::Int(static_cast<int64_t>(v.float_value()));
  }
  if (v.is_string()) {
    if (auto i = ParsePyInt(v.string_value(), base)) return Value::Int(*i);
    if (auto d = ParsePyFloat(v.string_value()); d && std::isfinite(*d))
      return Value::Int(static_cast<int64_t>(*d));
  }
  return dflt;
}

Value FilterFloat(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("float", a, {"default"});
  Value dflt = b.Has(0) ? b[0] : Value::Float(0.0);
  if (v.is_undefined()) FailUndefined(v);
  if (v.is_number()) return Value::Float(v.float_value());
  if (v.is_string())
    if (auto d = ParsePyFloat(v.string_value())) return Value::Float(*d);
  return dflt;
}

Value FilterTojson(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonFormat f;
  f.ensure_ascii = b.Has(0) && b[0].Truthy();
  if (b.Has(1) && !b[1].is_none()) {
    f.has_indent = true;
    f.indent = b[1].is_string() ? b[1].string_value()
                                : std::string(std::max<int64_t>(0, ToInt(b[1], "indent")), ' ');
    f.item_sep = ",";
  }
  if (b.Has(2) && !b[2].is_none()) {
    std::vector<Value> seps = Iterate(b[2]);
    if (seps.size() != 2) Fail("separators must be an (item_separator, key_separator) pair");
    f.item_sep = seps[0].ToStr();
    f.key_sep = seps[1].ToStr();
  }
  f.sort_keys = b.Has(3) && b[3].Truthy();
  return Value::Str(ToJsonText(v, f));
}

Value FilterIndent(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("indent", a, {"width", "first", "blank"});
  std::string ind = b.Has(0)
                        ? (b[0].is_string() ? b[0].string_value()
                                            : std::string(std::max<int64_t>(0, ToInt(b[0], "width")), ' '))
                        : std::string(4, ' ');
  std::string s = v.ToStr() + "\n";  // Jinja's quirk so that splitlines keeps a trailing blank line
  CallArgs no_args;
  std::vector<Value> lines = Iterate(GetAttr(Value::Str(s), "splitlines").function().call(no_args));
  std::string out;
  if (b[2].Truthy()) {
    for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" + ind : "") + lines[i].string_value();
  } else {
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string& line = lines[i].string_value();
      out += i == 0 ? line : "\n" + (line.empty() ? line : ind + line);
    }
  }
  if (b[1].Truthy()) out = ind + out;
  return Value::Str(out);
}

Value FilterTruncate(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("truncate", a, {"length", "killwords", "end", "leeway"});
  std::u32string s = DecodeUtf8(v.ToStr());
  int64_t length = b.Has(0) ? ToInt(b[0], "length") : 255;
  std::u32string end = DecodeUtf8(b.Has(2) ? b[2].ToStr() : "...");
  int64_t leeway = b.Has(3) && !b[3].is_none() ? ToInt(b[3], "leeway") : 5;
  if (length < static_cast<int64_t>(end.size()))
    Fail("expected length >= " + std::to_string(end.size()) + ", got " + std::to_string(length));
  if (static_cast<int64_t>(s.size()) <= length + leeway) return Value::Str(EncodeUtf8(s));
  std::u32string head = s.substr(0, length - end.size());
  if (!b[1].Truthy()) {
    size_t sp = head.rfind(U' ');
    if (sp != std::u32string::npos) head.resize(sp);
  }
  return Value::Str(EncodeUtf8(head + end));
}

Value FilterRound(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("round", a, {"precision", "method"});
  int64_t precision = b.Has(0) ? ToInt(b[0], "precision") : 0;
  std::string method = b.Has(1) ? b[1].ToStr() : "common";
  if (method != "common" && method != "ceil" && method != "floor")
    Fail("method must be 'common', 'ceil' or 'floor'");
  if (!v.is_number()) Fail("type " + KindName(v) + " doesn't define __round__ method");
  if (method == "common" && v.kind() != K::kFloat && precision >= 0) return Value::Int(v.int_value());
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = v.float_value() * scale;
  // Python's round() is round-half-even.
  x = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::nearbyint(x);
  return Value::Float(x / scale);
}

Value MinMax(const Value& v, const CallArgs& a, bool want_max) {
  BoundArgs b = BindArgs(want_max ? "max" : "min", a, {"case_sensitive", "attribute"});
  auto key = SortKeyGetter(b[1], b[0].Truthy());
  std::vector<Value> items = Iterate(v);
  if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  Value best_key = key(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(items[i]);
    if (want_max ? PyLess(best_key, k) : PyLess(k, best_key)) {
      best = i;
      best_key = k;
    }
  }
  return items[best];
}

// select/reject (by test) and selectattr/rejectattr (test on an attribute).
Value SelectOrReject(const Value& v, const CallArgs& a, bool select, bool by_attr) {
  size_t first_test_arg = by_attr ? 1 : 0;
  std::function<Value(const Value&)> get = [](const Value& x) { return x; };
  if (by_attr) {
    if (a.positional.empty()) Fail("Missing parameter for attribute name");
    get = AttrGetter(a.positional[0]);
  }
  std::function<bool(const Value&)> pass = [](const Value& x) { return x.Truthy(); };
  if (a.positional.size() > first_test_arg) {
    std::string test = a.positional[first_test_arg].ToStr();
    CallArgs rest = Rest(a, first_test_arg + 1);
    pass = [test, rest](const Value& x) { return ApplyTest(test, x, rest); };
  }
  std::vector<Value> out;
  for (const Value& item : Iterate(v))
    if (pass(get(item)) == select) out.push_back(item);
  return List(std::move(out));
}

Value FilterMap(const Value& v, const CallArgs& a) {
  std::function<Value(const Value&)> f;
  if (a.positional.empty()) {
    const Value* attribute = nullptr;
    Value dflt;
    for (const auto& [k, val] : a.keyword) {
      if (k == "attribute")
        attribute = &val;
      else if (k == "default")
        dflt = val;
      else
        Fail("Unexpected keyword argument '" + k + "'");
    }
    if (!attribute) Fail("map requires a filter name or an attribute");
    f = AttrGetter(*attribute, dflt);
  } else {
    std::string name = a.positional[0].ToStr();
    if (!HasFilter(name)) Fail("No filter named '" + name + "'.");
    CallArgs rest = Rest(a, 1);
    f = [name, rest](const Value& x) { return ApplyFilter(name, x, rest); };
  }
  std::vector<Value> out;
  for (const Value& item : Iterate(v)) out.push_back(f(item));
  return List(std::move(out));
}

Value FilterJoin(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("join", a, {"d", "attribute"});
  std::string sep = b.Has(0) ? b[0].ToStr() : "";
  std::function<Value(const Value&)> get = [](const Value& x) { return x; };
  if (b.Has(1) && !b[1].is_none()) get = AttrGetter(b[1]);
  std::string out;
  bool first = true;
  for (const Value& item : Iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += get(item).ToStr();
  }
  return Value::Str(out);
}

Value FilterBatch(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("batch", a, {"linecount", "fill_with"}, 1);
  int64_t n = ToInt(b[0], "linecount");
  if (n <= 0) Fail("batch size must be positive");
  std::vector<Value> out, cur;
  for (const Value& item : Iterate(v)) {
    cur.push_back(item);
    if (static_cast<int64_t>(cur.size()) == n) {
      out.push_back(List(std::move(cur)));
      cur.clear();
    }
  }
  if (!cur.empty()) {
    if (b.Has(1) && !b[1].is_none())
      while (static_cast<int64_t>(cur.size()) < n) cur.push_back(b[1]);
    out.push_back(List(std::move(cur)));
  }
  return List(std::move(out));
}

Value FilterSlice(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("slice", a, {"slices", "fill_with"}, 1);
  std::vector<Value> seq = Iterate(v);
  int64_t slices = ToInt(b[0], "slices");
  if (slices <= 0) Fail("slices must be positive");
  int64_t n = static_cast<int64_t>(seq.size()), per = n / slices, extra = n % slices, offset = 0;
  std::vector<Value> out;
  for (int64_t k = 0; k < slices; ++k) {
    int64_t start = offset + k * per;
    if (k < extra) ++offset;
    int64_t end = offset + (k + 1) * per;
    std::vector<Value> part(seq.begin() + start, seq.begin() + end);
    if (b.Has(1) && !b[1].is_none() && k >= extra) part.push_back(b[1]);
    out.push_back(List(std::move(part)));
  }
  return List(std::move(out));
}

Value FilterUnique(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("unique", a, {"case_sensitive", "attribute"});
  auto key = SortKeyGetter(b[1], b[0].Truthy());
  std::vector<Value> out, seen;
  for (const Value& item : Iterate(v)) {
    Value k = key(item);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return Equals(s, k); })) continue;
    seen.push_back(k);
    out.push_back(item);
  }
  return List(std::move(out));
}

Value FilterDictsort(const Value& v, const CallArgs& a) {
  BoundArgs b = BindArgs("dictsort", a, {"case_sensitive", "by", "reverse"});
  if (v.kind() != K::kDict) Fail("dictsort requires a mapping");
  std::string by = b.Has(1) ? b[1].ToStr() : "key";
  if (by != "key" && by != "value") Fail("You can only sort by either \"key\" or \"value\"");
  bool cs = b[0].Truthy();
  std::vector<Value> items;
  for (const auto& [k, val] : v.dict().items) items.push_back(Value::MakeList({k, val}, true));
  size_t idx = by == "key" ? 0 : 1;
  return List(SortBy(
      std::move(items), [idx, cs](const Value& p) { return CaseKey(p.list().items[idx], cs); },
      b[2].Truthy()));
}

Value FilterWordcount(const Value& v) {
  int64_t n = 0;
  bool in_word = false;
  for (char32_t c : DecodeUtf8(v.ToStr())) {
    bool w = IsAlnumChar(c) || c == '_';
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value::Int(n);
}

Value FilterStriptags(const Value& v) {
  std::string s = v.ToStr(), out;
  bool in_tag = false;
  for (char c : s) {
    if (c == '<')
      in_tag = true;
    else if (c == '>' && in_tag)
      in_tag = false;
    else if (!in_tag)
      out += c;
  }
  // Collapse whitespace like " ".join(s.split()).
  std::vector<Value> words = Iterate(GetAttr(Value::Str(out), "split").function().call(CallArgs{}));
  std::string joined;
  for (size_t i = 0; i < words.size(); ++i) joined += (i ? " " : "") + words[i].string_value();
  return Value::Str(joined);
}

// Jinja's title: words begin after whitespace or one of -({[<.
std::string JinjaTitle(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  bool start = true;
  for (char32_t& c : u) {
    bool sep = IsPySpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      start = true;
      continue;
    }
    std::string one = EncodeUtf8(std::u32string(1, c));
    c = DecodeUtf8(start ? PyUpper(one) : PyLower(one))[0];
    start = false;
  }
  return EncodeUtf8(u);
}

using FilterTable = std::unordered_map<std::string, FilterFn>;

// Filters of one value: numbers, attributes, defaults.
void AddValueFilters(FilterTable& t) {
  t.insert({
      {"abs",
       [](const Value& v, const CallArgs& a) {
         NoArgs("abs", a);
         if (!v.is_number()) Fail("bad operand type for abs(): '" + KindName(v) + "'");
         if (v.kind() == K::kFloat) return Value::Float(std::fabs(v.float_value()));
         return v.int_value() < 0 ? BinaryOp("-", Value::Int(0), v) : Value::Int(v.int_value());
       }},
      {"attr",
       [](const Value& v, const CallArgs& a) {
         BoundArgs b = BindArgs("attr", a, {"name"}, 1);
         return GetAttribute(v, b[0].ToStr());
       }},
      {"default",
       [](const Value& v, const CallArgs& a) {
         BoundArgs b = BindArgs("default", a, {"default_value", "boolean"});
         bool use_default = v.is_undefined() || (b[1].Truthy() && !v.Truthy());
         return use_default ? (b.Has(0) ? b[0] : Value::Str("")) : v;
       }},
      {"float", FilterFloat},
      {"int", FilterInt},
      {"round", FilterRound},
  });
}

// Filters that take or give text.
void AddStringFilters(FilterTable& t) {
  t.insert({
      {"capitalize",
       [](const Value& v, const CallArgs& a) {
         NoArgs("capitalize", a);
         return GetAttr(Value::Str(v.ToStr()), "capitalize").function().call({});
       }},
      {"center",
       [](const Value& v, const CallArgs& a) {
         BoundArgs b = BindArgs("center", a, {"width"});
         CallArgs args{{b.Has(0) ? b[0] : Value::Int(80)}, {}};
         return GetAttr(Value::Str(v.ToStr()), "center").function().call(args);
       }},
      {"escape",
       [](const Value& v, const CallArgs& a) {
         NoArgs("escape", a);
         return Value::Str(HtmlEscape(v.ToStr()));
       }},
      {"format",
       [](const Value& v, const CallArgs& a) {
         if (!a.positional.empty() && !a.keyword.empty())
           Fail("can't handle positional and keyword arguments at the same time");
         Value args;
         if (!a.keyword.empty()) {
           Value::Dict d;
           for (const auto& [k, val] : a.keyword) d.Set(Value::Str(k), val);
           args = Value::MakeDict(std::move(d));
         } else {
           args = Value::MakeList(a.positional, true);
         }
         return Value::Str(PercentFormat(v.ToStr(), args));
       }},
      {"indent", FilterIndent},
      {"lower",
       [](const Value& v, const CallArgs& a) {
         NoArgs("lower", a);
         return Value::Str(PyLower(v.ToStr()));
       }},
      {"pprint",
       [](const Value& v, const CallArgs& a) {
         NoArgs("pprint", a);
         return Value::Str(v.Repr());
       }},
      {"replace",
       [](const Value& v, const CallArgs& a) {
         BoundArgs b = BindArgs("replace", a, {"old", "new", "count"}, 2);
         CallArgs args{{Value::Str(b[0].ToStr()), Value::Str(b[1].ToStr())}, {}};
         if (b.Has(2) && !b[2].is_none()) args.positional.push_back(b[2]);
         return GetAttr(Value::Str(v.ToStr()), "replace").function().call(args);
       }},
      {"safe",
       [](const Value& v, const CallArgs& a) {
         NoArgs("safe", a);
         return Value::Str(v.ToStr());
       }},
      {"string",
       [](const Value& v, const CallArgs& a) {
         NoArgs("string", a);
         return Value::Str(v.ToStr());
       }},
      {"striptags",
       [](const Value& v, const CallArgs& a) {
         NoArgs("striptags", a);
         return FilterStriptags(v);
       }},
      {"title",
       [](const Value& v, const CallArgs& a) {
         NoArgs("title", a);
         return Value::Str(JinjaTitle(v.ToStr()));
       }},
      {"tojson", FilterTojson},
      {"trim",
       [](const Value& v, const CallArgs& a) {
         BoundArgs b = BindArgs("trim", a, {"chars"});
         return Value::Str(PyStrip(v.ToStr(), b[0], true, true));
       }},
      {"truncate", FilterTruncate},
      {"upper",
       [](const Value& v, const CallArgs& a) {
         NoArgs("upper", a);
         return Value::Str(PyUpper(v.ToStr()));
       }},
      {"wordcount",
       [](const Value& v, const CallArgs& a) {
         NoArgs("wordcount", a);
         return FilterWordcount(v);
       }},
  });
}

// Filters over the items of a sequence or mapping.
void AddSequenceFilters(FilterTable& t) {
  t.insert({
      {"batch", FilterBatch},
      {"count",
       [](const Value& v, const CallArgs& a) {
         NoArgs("count", a);
         return Value::Int(PyLen(v));
       }},
      {"dictsort", FilterDictsort},
      {"first",
       [](const Value& v, const CallArgs& a) {
         NoArgs("first", a);
         std::vector<Value> items = Iterate(v);
         return items.empty() ? Value::Undefined("No first item, sequence was empty.") : items.front();
       }},
      {"items",
       [](const Value& v, const CallArgs& a) {
         NoArgs("items", a);
         if (v.is_undefined()) return List({});
         if (v.kind() != K::kDict) Fail("Can only get item pairs from a mapping.");
         return GetAttr(v, "items").function().call({});
       }},
      {"join", FilterJoin},
      {"last",
       [](const Value& v, const CallArgs& a) {
         NoArgs("last", a);
         std::vector<Value> items = Iterate(v);
         return items.empty() ? Value::Undefined("No last item, sequence was empty.") : items.back();
       }},
      {"length",
       [](const Value& v, const CallArgs& a) {
         NoArgs("length", a);
         return Value::Int(PyLen(v));
       }},
      {"list",
       [](const Value& v, const CallArgs& a) {
         NoArgs("list", a);
         return List(Iterate(v));
       }},
      {"map", FilterMap},
      {"max", [](const Value& v, const CallArgs& a) { return MinMax(v, a, true); }},
      {"min", [](const Value& v, const CallArgs& a) { return MinMax(v, a, false); }},
      {"reject", [](const Value& v, const CallArgs& a) { return SelectOrReject(v, a, false, false); }},
      {"rejectattr", [](const Value& v, const CallArgs& a) { return SelectOrReject(v, a, false, true); }},
      {"reverse",
       [](const Value& v, const CallArgs& a) {
         NoArgs("reverse", a);
         if (v.is_string()) {
           std::u32string u = DecodeUtf8(v.string_value());
           std::reverse(u.begin(), u.end());
           return Value::Str(EncodeUtf8(u));
         }
         std::vector<Value> items = Iterate(v);
         std::reverse(items.begin(), items.end());
         return List(std::move(items));
       }},
      {"select", [](const Value& v, const CallArgs& a) { return SelectOrReject(v, a, true, false); }},
      {"selectattr", [](const Value& v, const CallArgs& a) { return SelectOrReject(v, a, true, true); }},
      {"slice", FilterSlice},
      {"sort",
       [](const Value& v, const CallArgs& a) {
         BoundArgs b = BindArgs("sort", a, {"reverse", "case_sensitive", "attribute"});
         return List(SortBy(Iterate(v), SortKeyGetter(b[2], b[1].Truthy(), /*multi=*/true), b[0].Truthy()));
       }},
      {"sum",
       [](const Value& v, const CallArgs& a) {
         BoundArgs b = BindArgs("sum", a, {"attribute", "start"});
         Value total = b.Has(1) ? b[1] : Value::Int(0);
         std::function<Value(const Value&)> get = [](const Value& x) { return x; };
         if (b.Has(0) && !b[0].is_none()) get = AttrGetter(b[0]);
         for (const Value& item : Iterate(v)) total = BinaryOp("+", total, get(item));
         return total;
       }},
      {"unique", FilterUnique},
  });
}
const FilterTable& Filters() {
  static const FilterTable* table = [] {
    auto* t = new FilterTable;
    AddValueFilters(*t);
    AddStringFilters(*t);
    AddSequenceFilters(*t);
    return t;
  }();
  return *table;
}

const std::unordered_map<std::string, std::string>& FilterAliases() {
  static const auto* aliases = new std::unordered_map<std::string, std::string>{
      {"d", "default"}, {"e", "escape"}, {"forceescape", "escape"}};
  return *aliases;
}

bool NumericTest(const Value& v, int64_t divisor, int64_t remainder) {
  if (v.is_undefined()) FailUndefined(v);
  Value r = BinaryOp("%", v, Value::Int(divisor));
  return Equals(r, Value::Int(remainder));
}

const Value& TestArg(const CallArgs& a, const char* test) {
  if (a.positional.size() != 1 || !a.keyword.empty())
    Fail(std::string("test '") + test + "' takes exactly one argument");
  return a.positional[0];
}

const std::unordered_map<std::string, TestFn>& Tests() {
  static const auto* table = new std::unordered_map<std::string, TestFn>{
      {"boolean",
       [](const Value& v, const CallArgs& a) {
         NoArgs("boolean", a);
         return v.kind() == K::kBool;
       }},
      // Python's callable(Undefined) is true: the class defines __call__ (to raise).
      {"callable",
       [](const Value& v, const CallArgs& a) {
         NoArgs("callable", a);
         return v.kind() == K::kFunction || v.is_undefined();
       }},
      {"defined",
       [](const Value& v, const CallArgs& a) {
         NoArgs("defined", a);
         return !v.is_undefined();
       }},
      {"divisibleby",
       [](const Value& v, const CallArgs& a) {
         return NumericTest(v, ToInt(TestArg(a, "divisibleby"), "divisibleby"), 0);
       }},
      {"eq", [](const Value& v, const CallArgs& a) { return Equals(v, TestArg(a, "eq")); }},
      {"escaped", [](const Value&, const CallArgs&) { return false; }},
      {"even",
       [](const Value& v, const CallArgs& a) {
         NoArgs("even", a);
         return NumericTest(v, 2, 0);
       }},
      {"false",
       [](const Value& v, const CallArgs& a) {
         NoArgs("false", a);
         return v.kind() == K::kBool && !v.bool_value();
       }},
      {"filter",
       [](const Value& v, const CallArgs& a) {
         NoArgs("filter", a);
         return v.is_string() && HasFilter(v.string_value());
       }},
      {"float",
       [](const Value& v, const CallArgs& a) {
         NoArgs("float", a);
         return v.kind() == K::kFloat;
       }},
      {"ge", [](const Value& v, const CallArgs& a) { return Compare(">=", v, TestArg(a, "ge")); }},
      {"gt", [](const Value& v, const CallArgs& a) { return Compare(">", v, TestArg(a, "gt")); }},
      {"in", [](const Value& v, const CallArgs& a) { return Compare("in", v, TestArg(a, "in")); }},
      {"integer",
       [](const Value& v, const CallArgs& a) {
         NoArgs("integer", a);
         return v.kind() == K::kInt;
       }},
      {"iterable",
       [](const Value& v, const CallArgs& a) {
         NoArgs("iterable", a);
         return v.is_string() || v.kind() == K::kList || v.kind() == K::kDict || v.is_undefined();
       }},
      {"le", [](const Value& v, const CallArgs& a) { return Compare("<=", v, TestArg(a, "le")); }},
      {"lower",
       [](const Value& v, const CallArgs& a) {
         NoArgs("lower", a);
         return GetAttr(Value::Str(v.ToStr()), "islower").function().call({}).Truthy();
       }},
      {"lt", [](const Value& v, const CallArgs& a) { return Compare("<", v, TestArg(a, "lt")); }},
      {"mapping",
       [](const Value& v, const CallArgs& a) {
         NoArgs("mapping", a);
         return v.kind() == K::kDict;
       }},
      {"ne", [](const Value& v, const CallArgs& a) { return !Equals(v, TestArg(a, "ne")); }},
      {"none",
       [](const Value& v, const CallArgs& a) {
         NoArgs("none", a);
         return v.is_none();
       }},
      {"number",
       [](const Value& v, const CallArgs& a) {
         NoArgs("number", a);
         return v.is_number();
       }},
      {"odd",
       [](const Value& v, const CallArgs& a) {
         NoArgs("odd", a);
         return NumericTest(v, 2, 1);
       }},
      {"sameas", [](const Value& v, const CallArgs& a) { return v.SameAs(TestArg(a, "sameas")); }},
      {"sequence",
       [](const Value& v, const CallArgs& a) {
         NoArgs("sequence", a);
         return v.is_string() || v.kind() == K::kList || v.kind() == K::kDict || v.is_undefined();
       }},
      {"string",
       [](const Value& v, const CallArgs& a) {
         NoArgs("string", a);
         return v.is_string();
       }},
      {"test",
       [](const Value& v, const CallArgs& a) {
         NoArgs("test", a);
         return v.is_string() && HasTest(v.string_value());
       }},
      {"true",
       [](const Value& v, const CallArgs& a) {
         NoArgs("true", a);
         return v.kind() == K::kBool && v.bool_value();
       }},
      {"undefined",
       [](const Value& v, const CallArgs& a) {
         NoArgs("undefined", a);
         return v.is_undefined();
       }},
      {"upper",
       [](const Value& v, const CallArgs& a) {
         NoArgs("upper", a);
         return GetAttr(Value::Str(v.ToStr()), "isupper").function().call({}).Truthy();
       }},
  };
  return *table;
}

const std::unordered_map<std::string, std::string>& TestAliases() {
  static const auto* aliases = new std::unordered_map<std::string, std::string>{
      {"==", "eq"}, {"equalto", "eq"}, {"!=", "ne"},          {"<", "lt"}, {"lessthan", "lt"},
      {"<=", "le"}, {">", "gt"},       {"greaterthan", "gt"}, {">=", "ge"}};
  return *aliases;
}

const std::string& Resolve(const std::string& name,
                           const std::unordered_map<std::string, std::string>& aliases) {
  auto it = aliases.find(name);
  return it == aliases.end() ? name : it->second;
}

}  // namespace

bool HasFilter(const std::string& name) { return Filters().count(Resolve(name, FilterAliases())) > 0; }
bool HasTest(const std::string& name) { return Tests().count(Resolve(name, TestAliases())) > 0; }

Value ApplyFilter(const std::string& name, const Value& value, const CallArgs& args) {
  auto it = Filters().find(Resolve(name, FilterAliases()));
  if (it == Filters().end()) Fail("No filter named '" + name + "'.");
  return it->second(value, args);
}

bool ApplyTest(const std::string& name, const Value& value, const CallArgs& args) {
  auto it = Tests().find(Resolve(name, TestAliases()));
  if (it == Tests().end()) Fail("No test named '" + name + "'.");
  return it->second(value, args);
}

}  // namespace m3::jinja::internal
