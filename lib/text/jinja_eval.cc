// Jinja evaluator: runs the AST against a scope chain. Scoping follows Jinja2: a for-loop
// iteration, a macro call and a with-block each get a fresh scope (so `set` inside them does not
// leak out, and does not survive into the next iteration); if-blocks share their parent's.
#include <filesystem>
#include <algorithm>
#include <optional>
#include <unordered_map>

#include "text/jinja_internal.h"

namespace m3::jinja {
namespace internal {
namespace {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};
using ScopePtr = std::shared_ptr<Scope>;

ScopePtr Child(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

constexpr int kMaxCallDepth = 200;     // macro recursion, like Python's recursion limit
constexpr int64_t kMaxRange = 100000;  // Jinja's sandbox caps range() the same way

Value BuiltinRange(const CallArgs& a) {
  if (!a.keyword.empty()) Fail("range() takes no keyword arguments");
  std::vector<int64_t> n;
  for (const Value& v : a.positional) {
    if (v.kind() != Value::Kind::kInt && v.kind() != Value::Kind::kBool)
      Fail("'" + KindName(v) + "' object cannot be interpreted as an integer");
    n.push_back(v.int_value());
  }
  if (n.empty() || n.size() > 3) Fail("range expected 1 to 3 arguments, got " + std::to_string(n.size()));
  int64_t start = n.size() == 1 ? 0 : n[0];
  int64_t stop = n.size() == 1 ? n[0] : n[1];
  int64_t step = n.size() == 3 ? n[2] : 1;
  if (step == 0) Fail("range() arg 3 must not be zero");
  std::vector<Value> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (static_cast<int64_t>(out.size()) >= kMaxRange)
      Fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    out.push_back(Value::Int(i));
  }
  return Value::MakeList(std::move(out));
}

// dict(mapping_or_pairs?, **kwargs) and namespace(...) share the argument rules.
Value::Dict DictFromArgs(const CallArgs& a, const char* fn) {
  Value::Dict d;
  if (a.positional.size() > 1) Fail(std::string(fn) + " expected at most 1 positional argument");
  if (!a.positional.empty()) {
    const Value& src = a.positional[0];
    if (src.kind() == Value::Kind::kDict) {
      d = src.dict();
    } else {
      for (const Value& pair : Iterate(src)) {
        if (pair.kind() != Value::Kind::kList || pair.list().items.size() != 2)
          Fail(std::string(fn) + ": sequence elements must be pairs");
        d.Set(pair.list().items[0], pair.list().items[1]);
      }
    }
  }
  for (const auto& [k, v] : a.keyword) d.Set(Value::Str(k), v);
  return d;
}

Value BuiltinJoiner(const CallArgs& a) {
  std::string sep = a.positional.empty() ? ", " : a.positional[0].ToStr();
  auto used = std::make_shared<bool>(false);
  return MakeBuiltin("joiner", [sep, used](const CallArgs&) {
    if (!*used) {
      *used = true;
      return Value::Str("");
    }
    return Value::Str(sep);
  });
}

class Renderer {
 public:
  Renderer(const Program& program, const std::map<std::string, Value>& globals) : program_(program) {
    root_ = std::make_shared<Scope>();
    builtins_["range"] = MakeBuiltin("range", BuiltinRange);
    builtins_["dict"] =
        MakeBuiltin("dict", [](const CallArgs& a) { return Value::MakeDict(DictFromArgs(a, "dict")); });
    builtins_["namespace"] = MakeBuiltin("namespace", [this](const CallArgs& a) {
      namespaces_.push_back(Value::MakeNamespace(DictFromArgs(a, "namespace")));
      return namespaces_.back();
    });
    builtins_["joiner"] = MakeBuiltin("joiner", BuiltinJoiner);
    for (const auto& [k, v] : globals) root_->vars[k] = v;
  }

  std::string Run() {
    std::string out;
    Exec(program_.body, root_, out);
    return out;
  }

  int line() const { return line_; }

  ~Renderer() {
    for (Value& ns : namespaces_) ns.namespace_attrs().items.clear();
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  Value Lookup(const std::string& name, const ScopePtr& scope) const {
    for (const Scope* s = scope.get(); s; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    auto it = builtins_.find(name);
    if (it != builtins_.end()) return it->second;
    return Value::Undefined("'" + name + "' is undefined");
  }

  std::string RenderBody(const Body& body, const ScopePtr& scope) {
    std::string out;
    Exec(body, scope, out);
    return out;
  }

  Flow Exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& s : body) {
      Flow f = ExecStmt(*s, scope, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  void Assign(const std::vector<std::string>& targets, const Value& v, Scope& scope) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = v;
      return;
    }
    std::vector<Value> items = Iterate(v);
    if (items.size() != targets.size())
      Fail(items.size() < targets.size()
               ? "not enough values to unpack (expected " + std::to_string(targets.size()) + ", got " +
                     std::to_string(items.size()) + ")"
               : "too many values to unpack (expected " + std::to_string(targets.size()) + ")");
    for (size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = items[i];
  }

  Value ApplyFilters(const std::vector<ExprPtr>& filters, Value v, const ScopePtr& scope) {
    for (const auto& f : filters) v = ApplyFilter(f->name, v, EvalArgs(*f, 1, scope));
    return v;
  }

  Flow ExecStmt(const Stmt& s, const ScopePtr& scope, std::string& out) {
    line_ = s.line;
    switch (s.kind) {
      case StmtKind::kText: out += s.text; break;
      case StmtKind::kOutput: out += Eval(*s.expr, scope).ToStr(); break;
      case StmtKind::kIf:
        for (const auto& [cond, body] : s.branches)
          if (Eval(*cond, scope).Truthy()) return Exec(body, scope, out);
        return Exec(s.else_body, scope, out);
      case StmtKind::kFor: ExecFor(s, scope, out); break;
      case StmtKind::kSet: {
        Value v = Eval(*s.expr, scope);
        if (s.attr.empty()) {
          Assign(s.targets, v, *scope);
          break;
        }
        Value target = Lookup(s.targets[0], scope);
        if (target.kind() != Value::Kind::kNamespace) Fail("cannot assign attribute on non-namespace object");
        target.namespace_attrs().Set(Value::Str(s.attr), v);
        break;
      }
      case StmtKind::kSetBlock: {
        Value v = Value::Str(RenderBody(s.body, scope));
        scope->vars[s.targets[0]] = ApplyFilters(s.filters, v, scope);
        break;
      }
      case StmtKind::kMacro: scope->vars[s.macro->name] = MakeMacro(*s.macro, scope); break;
      case StmtKind::kCallBlock: {
        const Expr& call = *s.expr;
        Value fn = Eval(*call.args[0], scope);
        CallArgs args = EvalArgs(call, 1, scope);
        args.keyword.emplace_back("caller", MakeMacro(*s.macro, scope));
        out += Call(fn, args).ToStr();
        break;
      }
      case StmtKind::kFilterBlock:
        out += ApplyFilters(s.filters, Value::Str(RenderBody(s.body, scope)), scope).ToStr();
        break;
      case StmtKind::kWith: {
        ScopePtr inner = Child(scope);
        for (const auto& [name, expr] : s.assigns) inner->vars[name] = Eval(*expr, scope);
        return Exec(s.body, inner, out);
      }
      case StmtKind::kScope: return Exec(s.body, scope, out);
      case StmtKind::kBreak: return Flow::kBreak;
      case StmtKind::kContinue: return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void ExecFor(const Stmt& s, const ScopePtr& scope, std::string& out) {
    Value seq = Eval(*s.expr, scope);
    std::vector<Value> all = Iterate(seq);
    std::vector<Value> items;
    if (s.cond) {
      // The inline filter sees the loop target but not `loop` (Jinja filters before counting).
      for (Value& v : all) {
        ScopePtr tmp = Child(scope);
        Assign(s.targets, v, *tmp);
        if (Eval(*s.cond, tmp).Truthy()) items.push_back(std::move(v));
      }
    } else {
      items = std::move(all);
    }
    if (items.empty()) {
      Exec(s.else_body, scope, out);
      return;
    }
    const int64_t n = static_cast<int64_t>(items.size());
    auto last_changed = std::make_shared<std::optional<Value>>();
    for (int64_t i = 0; i < n; ++i) {
      ScopePtr iter = Child(scope);
      Assign(s.targets, items[i], *iter);
      Value::Dict loop;
      auto set = [&loop](const char* k, Value v) { loop.items.emplace_back(Value::Str(k), std::move(v)); };
      set("index", Value::Int(i + 1));
      set("index0", Value::Int(i));
      set("revindex", Value::Int(n - i));
      set("revindex0", Value::Int(n - i - 1));
      set("first", Value::Bool(i == 0));
      set("last", Value::Bool(i == n - 1));
      set("length", Value::Int(n));
      set("depth", Value::Int(1));
      set("depth0", Value::Int(0));
      set("previtem", i > 0 ? items[i - 1] : Value::Undefined("there is no previous item"));
      set("nextitem", i + 1 < n ? items[i + 1] : Value::Undefined("there is no next item"));
      set("cycle", MakeBuiltin("cycle", [i](const CallArgs& a) {
            if (a.positional.empty()) Fail("no items for cycling given");
            return a.positional[static_cast<size_t>(i) % a.positional.size()];
          }));
      set("changed", MakeBuiltin("changed", [last_changed](const CallArgs& a) {
            Value now = Value::MakeList(a.positional);
            if (*last_changed && Equals(**last_changed, now)) return Value::Bool(false);
            *last_changed = now;
            return Value::Bool(true);
          }));
      iter->vars["loop"] = Value::MakeDict(std::move(loop));
      if (Exec(s.body, iter, out) == Flow::kBreak) break;
    }
  }

  // A macro stored in the scope it closes over would make a shared_ptr cycle (a leak per
  // render), so it holds the scope weakly and the renderer keeps it alive until the end.
  Value MakeMacro(const Macro& m, const ScopePtr& closure) {
    closures_.push_back(closure);
    std::weak_ptr<Scope> weak = closure;
    return MakeBuiltin(m.name, [this, &m, weak](const CallArgs& args) {
      ScopePtr scope = weak.lock();
      if (!scope) Fail("macro '" + m.name + "' called after its template finished rendering");
      return CallMacro(m, scope, args);
    });
  }

  Value CallMacro(const Macro& m, const ScopePtr& closure, const CallArgs& args) {
    if (call_depth_ >= kMaxCallDepth) Fail("maximum recursion depth exceeded in macro '" + m.name + "'");
    struct DepthGuard {
      int& d;
      explicit DepthGuard(int& depth) : d(depth) { ++d; }
      ~DepthGuard() { --d; }
    } guard(call_depth_);
    const int saved_line = line_;
    ScopePtr scope = Child(closure);
    std::vector<bool> bound(m.params.size(), false);
    std::vector<Value> varargs;
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (i < m.params.size()) {
        scope->vars[m.params[i]] = args.positional[i];
        bound[i] = true;
      } else if (m.uses_varargs) {
        varargs.push_back(args.positional[i]);
      } else {
        Fail("macro '" + m.name + "' takes not more than " + std::to_string(m.params.size()) +
             " argument(s)");
      }
    }
    Value::Dict kwargs;
    for (const auto& [k, v] : args.keyword) {
      auto it = std::find(m.params.begin(), m.params.end(), k);
      if (it != m.params.end()) {
        size_t idx = static_cast<size_t>(it - m.params.begin());
        if (bound[idx]) Fail("macro '" + m.name + "' got multiple values for argument '" + k + "'");
        scope->vars[k] = v;
        bound[idx] = true;
      } else if (k == "caller" && m.uses_caller) {
        scope->vars["caller"] = v;
      } else if (m.uses_kwargs) {
        kwargs.Set(Value::Str(k), v);
      } else {
        Fail("macro '" + m.name + "' takes no keyword argument '" + k + "'");
      }
    }
    for (size_t i = 0; i < m.params.size(); ++i) {
      if (bound[i]) continue;
      // Defaults are evaluated at call time and may use the parameters before them.
      scope->vars[m.params[i]] = m.defaults[i] ? Eval(*m.defaults[i], scope)
                                               : Value::Undefined("'" + m.params[i] + "' is undefined");
    }
    if (m.uses_varargs) scope->vars["varargs"] = Value::MakeList(std::move(varargs), true);
    if (m.uses_kwargs) scope->vars["kwargs"] = Value::MakeDict(std::move(kwargs));
    std::string out;
    Exec(m.body, scope, out);
    line_ = saved_line;
    return Value::Str(std::move(out));
  }

  // Positional arguments from e.args[first..] plus keywords, with *x / **x spread.
  CallArgs EvalArgs(const Expr& e, size_t first, const ScopePtr& scope) {
    CallArgs a;
    for (size_t i = first; i < e.args.size(); ++i) a.positional.push_back(Eval(*e.args[i], scope));
    for (const auto& [k, expr] : e.kwargs) {
      Value v = Eval(*expr, scope);
      if (k == "*") {
        for (Value& item : Iterate(v)) a.positional.push_back(std::move(item));
      } else if (k == "**") {
        if (v.kind() != Value::Kind::kDict) Fail("argument after ** must be a mapping, not " + KindName(v));
        for (const auto& [dk, dv] : v.dict().items) a.keyword.emplace_back(dk.ToStr(), dv);
      } else {
        a.keyword.emplace_back(k, std::move(v));
      }
    }
    return a;
  }

  Value Call(const Value& fn, const CallArgs& args) {
    if (fn.is_undefined()) FailUndefined(fn);
    return CallValue(fn, args);
  }

  Value Eval(const Expr& e, const ScopePtr& scope) {
    line_ = e.line;
    switch (e.kind) {
      case ExprKind::kConst: return e.value;
      case ExprKind::kName: return Lookup(e.name, scope);
      case ExprKind::kAttr: return GetAttr(Eval(*e.args[0], scope), e.name);
      case ExprKind::kItem: {
        Value obj = Eval(*e.args[0], scope);
        return GetItem(obj, Eval(*e.args[1], scope));
      }
      case ExprKind::kSlice: {
        Value obj = Eval(*e.args[0], scope);
        Value parts[3];
        for (int k = 0; k < 3; ++k) parts[k] = e.args[k + 1] ? Eval(*e.args[k + 1], scope) : Value::None();
        return Slice(obj, parts[0], parts[1], parts[2]);
      }
      case ExprKind::kCall: {
        Value fn = Eval(*e.args[0], scope);
        CallArgs args = EvalArgs(e, 1, scope);
        line_ = e.line;
        return Call(fn, args);
      }
      case ExprKind::kFilter: {
        Value v = Eval(*e.args[0], scope);
        CallArgs args = EvalArgs(e, 1, scope);
        line_ = e.line;
        return ApplyFilter(e.name, v, args);
      }
      case ExprKind::kTest: {
        Value v = Eval(*e.args[0], scope);
        CallArgs args = EvalArgs(e, 1, scope);
        line_ = e.line;
        return Value::Bool(ApplyTest(e.name, v, args) != e.negated);
      }
      case ExprKind::kUnary: {
        Value v = Eval(*e.args[0], scope);
        if (e.name == "not") return Value::Bool(!v.Truthy());
        if (v.is_undefined()) FailUndefined(v);
        if (!v.is_number()) Fail("bad operand type for unary " + e.name + ": '" + KindName(v) + "'");
        if (e.name == "+") return v.kind() == Value::Kind::kFloat ? v : Value::Int(v.int_value());
        if (v.kind() == Value::Kind::kFloat) return Value::Float(-v.float_value());
        return BinaryOp("-", Value::Int(0), v);  // overflow-checked
      }
      case ExprKind::kBinary: {
        Value a = Eval(*e.args[0], scope);
        Value b = Eval(*e.args[1], scope);
        line_ = e.line;
        return BinaryOp(e.name, a, b);
      }
      case ExprKind::kAnd: {
        Value a = Eval(*e.args[0], scope);
        return a.Truthy() ? Eval(*e.args[1], scope) : a;
      }
      case ExprKind::kOr: {
        Value a = Eval(*e.args[0], scope);
        return a.Truthy() ? a : Eval(*e.args[1], scope);
      }
      case ExprKind::kCompare: {
        Value left = Eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = Eval(*e.args[i + 1], scope);
          line_ = e.line;
          if (!Compare(e.ops[i], left, right)) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case ExprKind::kCond:
        if (Eval(*e.args[1], scope).Truthy()) return Eval(*e.args[0], scope);
        if (e.args[2]) return Eval(*e.args[2], scope);
        return Value::Undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      case ExprKind::kConcat: {
        std::string s;
        for (const auto& a : e.args) s += Eval(*a, scope).ToStr();
        return Value::Str(std::move(s));
      }
      case ExprKind::kList:
      case ExprKind::kTuple: {
        std::vector<Value> items;
        items.reserve(e.args.size());
        for (const auto& a : e.args) items.push_back(Eval(*a, scope));
        return Value::MakeList(std::move(items), e.kind == ExprKind::kTuple);
      }
      case ExprKind::kDict: {
        Value::Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = Eval(*e.args[i], scope);
          if (k.kind() == Value::Kind::kList && !k.list().tuple) Fail("unhashable type: 'list'");
          if (k.kind() == Value::Kind::kDict) Fail("unhashable type: 'dict'");
          d.Set(std::move(k), Eval(*e.args[i + 1], scope));
        }
        return Value::MakeDict(std::move(d));
      }
    }
    return Value();
  }

  const Program& program_;
  ScopePtr root_;
  std::vector<ScopePtr> closures_;  // scopes that macros close over (see MakeMacro)
  std::vector<Value> namespaces_;   // cleared at the end: `set ns.me = ns` must not leak
  std::unordered_map<std::string, Value> builtins_;
  int line_ = 0;
  int call_depth_ = 0;
};

}  // namespace
}  // namespace internal

StatusOr<std::string> Template::Render(const std::map<std::string, Value>& globals) const {
  if (!program_) return InvalidArgument("template was not parsed");
  // Render errors reach a server's clients: the template's file name, never the folder it is in.
  const std::string name = std::filesystem::path(program_->options.name).filename().string();
  std::optional<internal::Renderer> renderer;
  try {
    renderer.emplace(*program_, globals);
    return renderer->Run();
  } catch (const internal::Error& e) {
    if (e.passthrough) return *e.passthrough;
    int line = e.line ? e.line : renderer ? renderer->line() : 0;
    return InvalidArgument(name, ":", line, ": ", e.message);
  } catch (const std::exception& e) {
    return InvalidArgument(name, ": ", e.what());
  }
}

}  // namespace m3::jinja
