// A small Jinja2 interpreter for chat templates. It follows Python Jinja2 as Hugging Face
// transformers configures it for apply_chat_template: trim_blocks and lstrip_blocks on, the
// default Undefined (prints as "", iterates as empty, fails on attribute access), an immutable
// sandbox (no list/dict mutation) and loop controls (break/continue). Values follow Python:
// str() of None is "None", floats print as Python's repr, dicts keep insertion order.
//
// Not covered: template inheritance/includes/imports (there is no loader), recursive for loops,
// autoescaping. Ints are 64-bit: an overflow is an error where Python would grow the int.
// Unicode case mapping and character classes cover Latin, Greek and Cyrillic (plus CJK etc.
// as letters), not Python's full tables.
//
// A parsed Template is immutable; Render may run on several threads at once.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "base/status.h"

namespace m3::jinja {

class Value;

// Arguments of a call from the template: f(a, b, key=c).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A function a host hands to the template (raise_exception, strftime_now, ...). A non-ok status
// aborts rendering and is returned by Template::Render unchanged.
using NativeFunction = std::function<StatusOr<Value>(const CallArgs&)>;

namespace internal {
struct FunctionImpl;
}

// A template value: Python's None/bool/int/float/str/list/tuple/dict plus Jinja's Undefined,
// callables (macros, builtins, bound methods) and namespace() objects. Lists and dicts are
// immutable and shared; a namespace is shared and mutable (that is its purpose).
class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction, kNamespace };

  struct List {
    std::vector<Value> items;
    bool tuple = false;  // prints as (a, b) instead of [a, b]
  };
  // Insertion-ordered mapping with Python key equality (1 == 1.0 == True).
  struct Dict {
    std::vector<std::pair<Value, Value>> items;
    const Value* Find(const Value& key) const;
    Value* Find(const Value& key);
    void Set(Value key, Value value);  // replaces in place or appends
  };

  Value() = default;                              // Undefined
  static Value Undefined(std::string hint = "");  // hint: the message an access would raise
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double d);
  static Value Str(std::string s);
  static Value MakeList(std::vector<Value> items, bool tuple = false);
  static Value MakeDict(Dict dict);
  static Value MakeNamespace(Dict attrs);
  static Value MakeFunction(std::string name, NativeFunction fn);
  static Value FromInternalFunction(std::shared_ptr<const internal::FunctionImpl> fn);
  // JSON maps to Python values the way json.loads does (ints stay ints, 3.0 stays a float).
  static Value FromJson(const nlohmann::ordered_json& j);
  static Value FromJson(const nlohmann::json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }

  bool bool_value() const { return std::get<bool>(data_); }
  int64_t int_value() const;   // bool and int
  double float_value() const;  // bool, int and float
  const std::string& string_value() const { return std::get<std::string>(data_); }
  const std::string& undefined_hint() const { return std::get<std::string>(data_); }
  const List& list() const { return *std::get<std::shared_ptr<const List>>(data_); }
  const Dict& dict() const { return *std::get<std::shared_ptr<const Dict>>(data_); }
  Dict& namespace_attrs() const { return *std::get<std::shared_ptr<Dict>>(data_); }
  const internal::FunctionImpl& function() const {
    return *std::get<std::shared_ptr<const internal::FunctionImpl>>(data_);
  }

  bool Truthy() const;                    // Python bool()
  std::string ToStr() const;              // Python str(); Undefined is ""
  std::string Repr() const;               // Python repr()
  bool SameAs(const Value& other) const;  // Python `is`, as far as it is observable
  // json.loads-style value to JSON; fails on Undefined, callables and namespaces.
  StatusOr<nlohmann::ordered_json> ToJson() const;

 private:
  Kind kind_ = Kind::kUndefined;
  std::variant<std::monostate, bool, int64_t, double, std::string, std::shared_ptr<const List>,
               std::shared_ptr<const Dict>, std::shared_ptr<const internal::FunctionImpl>,
               std::shared_ptr<Dict>>
      data_ = std::string();
};

// Python equality (==) between two values.
bool Equals(const Value& a, const Value& b);

struct Options {
  bool trim_blocks = true;             // drop the first newline after a block tag
  bool lstrip_blocks = true;           // drop spaces/tabs before a block tag on its own line
  bool keep_trailing_newline = false;  // Jinja drops one trailing newline of the source
  std::string name = "template";       // used in error messages: "<name>:<line>: ..."
};

namespace internal {
struct Program;
}

class Template {
 public:
  // Syntax errors come back as Corrupt with the line number.
  static StatusOr<Template> Parse(std::string_view source, const Options& options = {});

  // Renders with `globals` as the template's variables (beside the builtins range, dict,
  // namespace, joiner). Runtime errors are InvalidArgument with the line number;
  // a status returned by a NativeFunction comes back unchanged.
  StatusOr<std::string> Render(const std::map<std::string, Value>& globals) const;

  // Whether the template mentions `name` as a variable anywhere (e.g. to provide only the
  // special-token variables a template uses).
  bool References(const std::string& name) const;

 private:
  std::shared_ptr<const internal::Program> program_;
};

}  // namespace m3::jinja
