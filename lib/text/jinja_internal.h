// Internals of the Jinja interpreter shared by its .cc files: the AST, the error type thrown
// inside the interpreter (never outside it), and the Python-semantics helpers.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja.h"

namespace m3::jinja::internal {

// Thrown inside the interpreter only; the public entry points turn it into a Status.
struct Error {
  std::string message;
  int line = 0;                       // 0 = not known yet; the evaluator fills in its current line
  std::optional<Status> passthrough;  // a host function's status, returned unchanged
};
[[noreturn]] void Fail(std::string message);
[[noreturn]] void FailAt(int line, std::string message);

struct FunctionImpl {
  std::string name;
  std::function<Value(const CallArgs&)> call;  // may throw Error
};
Value MakeBuiltin(std::string name, std::function<Value(const CallArgs&)> fn);

// ---- tokens (jinja_lex.cc) ----

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;  // text, name, operator or the decoded string literal
  int line = 0;
  Value number;  // kInt / kFloat
};

// Splits a template into tokens; throws Error (with line) on a lexical error.
std::vector<Token> Lex(std::string_view source, const Options& options);

// ---- AST ----

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  kConst,    // value
  kName,     // name
  kAttr,     // args[0].name
  kItem,     // args[0][args[1]]
  kSlice,    // args[0][args[1]:args[2]:args[3]] (null parts allowed)
  kCall,     // args[0](args[1..], kwargs)
  kFilter,   // args[0] | name(args[1..], kwargs); args[0] null inside a filter block
  kTest,     // args[0] is [not] name(args[1..], kwargs)
  kUnary,    // name in {"-", "+", "not"} applied to args[0]
  kBinary,   // args[0] name args[1], name in {+ - * / // % **}
  kAnd,      // args[0] and args[1]
  kOr,       // args[0] or args[1]
  kCompare,  // args[0] ops[0] args[1] ops[1] args[2] ... (chained like Python)
  kCond,     // args[0] if args[1] else args[2] (args[2] may be null)
  kConcat,   // args[0] ~ args[1] ~ ...
  kList,     // [args...]
  kTuple,    // (args...)
  kDict,     // {args[0]: args[1], args[2]: args[3], ...}
};

struct Expr {
  ExprKind kind;
  int line = 0;
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Macro {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // one per param; null = no default
  Body body;
  // Jinja only accepts extra arguments when the body uses varargs/kwargs.
  bool uses_varargs = false;
  bool uses_kwargs = false;
  bool uses_caller = false;
};

enum class StmtKind {
  kText,         // text
  kOutput,       // {{ expr }}
  kIf,           // branches (a null condition is the else branch)
  kFor,          // for targets in expr [if cond]: body [else: else_body]
  kSet,          // set targets = expr, or set targets[0].attr = expr
  kSetBlock,     // set targets[0] [| filters]: body
  kMacro,        // macro
  kCallBlock,    // call(macro params) expr: macro body becomes `caller`
  kFilterBlock,  // filter filters: body
  kWith,         // with assigns: body
  kScope,        // a plain body (the transformers {% generation %} block)
  kBreak,
  kContinue,
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  std::vector<std::string> targets;
  std::string attr;
  ExprPtr cond;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::shared_ptr<Macro> macro;
  std::vector<ExprPtr> filters;
  std::vector<std::pair<std::string, ExprPtr>> assigns;
};

struct Program {
  Options options;
  Body body;
  std::vector<std::string> names;  // every variable name the template reads
};

// Parses `source`; throws Error (with line) on a syntax error.
std::shared_ptr<Program> ParseProgram(std::string_view source, const Options& options);

// ---- Python semantics (jinja.cc, jinja_builtins.cc) ----

// UTF-8 <-> code points. Invalid bytes map to U+DC80+byte and back, so nothing is lost.
std::u32string DecodeUtf8(std::string_view s);
std::string EncodeUtf8(std::u32string_view s);
bool IsPySpace(char32_t c);
std::string PyFloatRepr(double d);
std::string KindName(const Value& v);  // Python type name: 'str', 'dict', 'NoneType', ...

struct JsonFormat {
  std::string indent;  // used when has_indent
  bool has_indent = false;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
};
std::string ToJsonText(const Value& v, const JsonFormat& format);  // Python json.dumps

Value GetAttr(const Value& obj, const std::string& name);       // obj.name
Value GetItem(const Value& obj, const Value& key);              // obj[key]
Value GetAttribute(const Value& obj, const std::string& name);  // attributes only (|attr)
Value Slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
Value CallValue(const Value& fn, const CallArgs& args);
Value BinaryOp(const std::string& op, const Value& a, const Value& b);
bool Compare(const std::string& op, const Value& a, const Value& b);  // == != < <= > >= in, not in
bool PyLess(const Value& a, const Value& b);  // Python `<`; fails on unorderable types
Value ApplyFilter(const std::string& name, const Value& value, const CallArgs& args);
bool ApplyTest(const std::string& name, const Value& value, const CallArgs& args);
bool HasFilter(const std::string& name);
bool HasTest(const std::string& name);
// Items a for loop visits: list items, dict keys, string characters; Undefined is empty.
std::vector<Value> Iterate(const Value& v);
// Fails with the message an access to this Undefined raises in Jinja.
[[noreturn]] void FailUndefined(const Value& v);

// Python-style binding of call arguments to parameter names (positional, then keyword).
struct BoundArgs {
  std::vector<Value> values;  // Undefined where not given
  std::vector<bool> given;
  bool Has(size_t i) const { return given[i]; }
  const Value& operator[](size_t i) const { return values[i]; }
};
// The first `required` names must be given.
BoundArgs BindArgs(const std::string& fn, const CallArgs& args, const std::vector<std::string>& names,
                   size_t required = 0);
void NoArgs(const std::string& fn, const CallArgs& args);  // fails when any argument is given

// Shared string helpers (code-point aware, Python semantics).
std::string PyLower(const std::string& s);
std::string PyUpper(const std::string& s);
std::string PyStrip(const std::string& s, const Value& chars, bool left, bool right);
std::string PercentFormat(const std::string& fmt, const Value& args);  // "fmt" % args
std::string StrFormat(const std::string& fmt, const CallArgs& args);   // "fmt".format(...)
std::string PadTo(const std::string& s, int64_t width, char32_t fill, char align);
int64_t PyLen(const Value& v);
int64_t ToInt(const Value& v, const std::string& what);  // int or bool, else fails
bool IsAlnumChar(char32_t c);

}  // namespace m3::jinja::internal
