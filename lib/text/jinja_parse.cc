// Jinja parser: tokens to the AST of jinja_internal.h, with Jinja2's grammar and precedence.
#include <algorithm>

#include "text/jinja_internal.h"

namespace m3::jinja {
namespace internal {
namespace {

std::string Describe(const Token& t) {
  switch (t.type) {
    case Tok::kEof: return "end of template";
    case Tok::kText: return "template data";
    case Tok::kVarEnd: return "end of print statement";
    case Tok::kBlockEnd: return "end of statement block";
    case Tok::kString: return "string";
    case Tok::kInt: return "integer";
    case Tok::kFloat: return "float";
    default: return t.text;
  }
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens, Program& program)
      : toks_(std::move(tokens)), program_(program) {}

  Body ParseTemplate() {
    std::string end;
    Body body = ParseBody({}, &end);
    return body;
  }

 private:
  // ---- token helpers ----
  const Token& Cur() const { return toks_[i_]; }
  const Token& Peek(size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  const Token& Next() { return toks_[i_ < toks_.size() - 1 ? i_++ : i_]; }
  bool IsOp(const char* op) const { return Cur().type == Tok::kOp && Cur().text == op; }
  bool IsName(const char* name) const { return Cur().type == Tok::kName && Cur().text == name; }
  bool SkipOp(const char* op) {
    if (!IsOp(op)) return false;
    ++i_;
    return true;
  }
  bool SkipName(const char* name) {
    if (!IsName(name)) return false;
    ++i_;
    return true;
  }
  [[noreturn]] void Unexpected(const std::string& expected) const {
    FailAt(Cur().line, "expected " + expected + ", got '" + Describe(Cur()) + "'");
  }
  void ExpectOp(const char* op) {
    if (!SkipOp(op)) Unexpected(std::string("token '") + op + "'");
  }
  std::string ExpectName() {
    if (Cur().type != Tok::kName) Unexpected("name");
    return Next().text;
  }
  void ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd) Unexpected("token 'end of statement block'");
    ++i_;
  }
  // Before a statement's body Jinja accepts a Python-style colon: {% if x: %}.
  void ExpectBodyStart() {
    SkipOp(":");
    ExpectBlockEnd();
  }

  ExprPtr Make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // ---- statements ----

  // Parses until a block tag named in `ends`; consumes that name and stores it in *which.
  Body ParseBody(const std::vector<std::string>& ends, std::string* which) {
    Body body;
    while (true) {
      const Token& t = Cur();
      if (t.type == Tok::kEof) {
        if (ends.empty()) return body;
        std::string list;
        for (const auto& e : ends) list += (list.empty() ? "'" : " or '") + e + "'";
        FailAt(t.line, "Unexpected end of template. Jinja was looking for the following tags: " + list + ".");
      }
      if (t.type == Tok::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        ++i_;
      } else if (t.type == Tok::kVarBegin) {
        ++i_;
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = t.line;
        s->expr = Checked(ParseTuple(true, false));
        if (Cur().type != Tok::kVarEnd) Unexpected("token 'end of print statement'");
        ++i_;
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        ++i_;
        if (Cur().type == Tok::kName && std::find(ends.begin(), ends.end(), Cur().text) != ends.end()) {
          *which = Next().text;
          return body;
        }
        body.push_back(ParseStatement());
      } else {
        Unexpected("template data");
      }
    }
  }

  std::unique_ptr<Stmt> ParseStatement() {
    DepthGuard guard(*this);
    int line = Cur().line;
    if (Cur().type != Tok::kName) FailAt(line, "tag name expected");
    std::string tag = Next().text;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    std::string end;
    if (tag == "if") {
      SoftScope soft(*this, true);
      s->kind = StmtKind::kIf;
      ExprPtr cond = ParseTuple(false, false);  // Jinja: a tuple, without inline if
      while (true) {
        ExpectBodyStart();
        Body b = ParseBody({"elif", "else", "endif"}, &end);
        s->branches.emplace_back(std::move(cond), std::move(b));
        if (end == "elif") {
          cond = ParseTuple(false, false);
        } else if (end == "else") {
          ExpectBodyStart();
          s->else_body = ParseBody({"endif"}, &end);
          break;
        } else {
          break;
        }
      }
    } else if (tag == "for") {
      s->kind = StmtKind::kFor;
      s->targets = ParseTargets();
      if (!SkipName("in")) Unexpected("'in'");
      s->expr = Checked(ParseTuple(false, false, /*stop_at_if=*/true));
      if (SkipName("if")) {
        s->cond = ParseExpression();
        CheckNames(*s->cond);  // the loop filter is never a soft frame in Jinja
      }
      if (IsName("recursive")) FailAt(Cur().line, "recursive for loops are not supported");
      ExpectBodyStart();
      SoftScope hard(*this, false);
      ++loop_depth_;
      s->body = ParseBody({"endfor", "else"}, &end);
      --loop_depth_;
      if (end == "else") {
        ExpectBodyStart();
        s->else_body = ParseBody({"endfor"}, &end);
      }
    } else if (tag == "set") {
      s->targets = ParseTargets();
      if (s->targets.size() == 1 && SkipOp(".")) s->attr = ExpectName();
      if (SkipOp("=")) {
        s->kind = StmtKind::kSet;
        s->expr = Checked(ParseTuple(true, false));
      } else {
        if (s->targets.size() != 1 || !s->attr.empty()) Unexpected("token '='");
        s->kind = StmtKind::kSetBlock;
        SoftScope hard(*this, false);
        while (SkipOp("|")) s->filters.push_back(Checked(ParseFilter(nullptr)));
        ExpectBodyStart();
        s->body = ParseBody({"endset"}, &end);
      }
    } else if (tag == "macro") {
      SoftScope hard(*this, false);
      s->kind = StmtKind::kMacro;
      s->macro = std::make_shared<Macro>();
      s->macro->name = ExpectName();
      ParseMacroParams(*s->macro);
      ExpectBodyStart();
      ParseMacroBody(*s->macro, "endmacro");
    } else if (tag == "call") {
      s->kind = StmtKind::kCallBlock;
      s->macro = std::make_shared<Macro>();
      s->macro->name = "caller";
      if (IsOp("(")) {
        SoftScope hard(*this, false);
        ParseMacroParams(*s->macro);
      }
      s->expr = Checked(ParseExpression());  // the call itself is in the enclosing frame
      if (s->expr->kind != ExprKind::kCall) FailAt(line, "expected call");
      ExpectBodyStart();
      SoftScope hard(*this, false);
      ParseMacroBody(*s->macro, "endcall");
    } else if (tag == "filter") {
      s->kind = StmtKind::kFilterBlock;
      SoftScope hard(*this, false);
      do {
        s->filters.push_back(Checked(ParseFilter(nullptr)));
      } while (SkipOp("|"));
      ExpectBodyStart();
      s->body = ParseBody({"endfilter"}, &end);
    } else if (tag == "with") {
      s->kind = StmtKind::kWith;
      while (Cur().type != Tok::kBlockEnd && !IsOp(":")) {
        if (!s->assigns.empty()) ExpectOp(",");
        std::string name = ExpectName();
        ExpectOp("=");
        s->assigns.emplace_back(name, Checked(ParseExpression()));
      }
      ExpectBodyStart();
      SoftScope hard(*this, false);
      s->body = ParseBody({"endwith"}, &end);
    } else if (tag == "generation") {
      s->kind = StmtKind::kScope;
      ExpectBodyStart();
      s->body = ParseBody({"endgeneration"}, &end);
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) FailAt(line, "'" + tag + "' outside of a loop");
      s->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
    } else if (tag == "include" || tag == "import" || tag == "from" || tag == "extends" || tag == "block") {
      FailAt(line, "tag '" + tag + "' is not supported (no template loader)");
    } else {
      FailAt(line, "Encountered unknown tag '" + tag + "'.");
    }
    ExpectBlockEnd();
    return s;
  }

  // for/set targets: a name or a (possibly parenthesized) comma-separated list of names.
  std::vector<std::string> ParseTargets() {
    bool paren = SkipOp("(");
    std::vector<std::string> names{ExpectTargetName()};
    while (SkipOp(",")) {
      if (paren && IsOp(")")) break;  // a trailing comma only inside parentheses, as in Jinja
      names.push_back(ExpectTargetName());
    }
    if (paren) ExpectOp(")");
    return names;
  }

  std::string ExpectTargetName() {
    static const char* const kConstants[] = {"true", "false", "none", "True", "False", "None"};
    for (const char* c : kConstants)
      if (IsName(c)) FailAt(Cur().line, std::string("can't assign to the constant '") + c + "'");
    return ExpectName();
  }

  void ParseMacroParams(Macro& m) {
    ExpectOp("(");
    while (!SkipOp(")")) {
      if (!m.params.empty()) ExpectOp(",");
      if (SkipOp(")")) break;
      m.params.push_back(ExpectName());
      if (SkipOp("=")) {
        m.defaults.push_back(Checked(ParseExpression()));
      } else {
        if (!m.defaults.empty() && m.defaults.back())
          FailAt(Cur().line, "non-default argument follows default argument");
        m.defaults.push_back(nullptr);
      }
    }
  }

  void ParseMacroBody(Macro& m, const char* end_tag) {
    size_t first_name = program_.names.size();
    int saved_depth = loop_depth_;
    loop_depth_ = 0;  // break/continue cannot cross a macro boundary
    std::string end;
    m.body = ParseBody({end_tag}, &end);
    loop_depth_ = saved_depth;
    for (size_t k = first_name; k < program_.names.size(); ++k) {
      m.uses_varargs |= program_.names[k] == "varargs";
      m.uses_kwargs |= program_.names[k] == "kwargs";
      m.uses_caller |= program_.names[k] == "caller";
    }
  }

  // ---- expressions (Jinja's precedence, lowest first) ----

  // expr (, expr)*: a tuple when there is a comma. `stop_at_if` is for `for x in y if z`.
  ExprPtr ParseTuple(bool with_condexpr, bool explicit_parens, bool stop_at_if = false) {
    int line = Cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) ExpectOp(",");
      if (Cur().type == Tok::kVarEnd || Cur().type == Tok::kBlockEnd || IsOp(")") ||
          (stop_at_if && IsName("if")))
        break;
      items.push_back(with_condexpr ? ParseExpression() : ParseOr());
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) Unexpected("an expression");
    }
    auto e = Make(ExprKind::kTuple, line);
    e->args = std::move(items);
    return e;
  }

  ExprPtr ParseExpression() {
    DepthGuard guard(*this);
    ExprPtr expr = ParseOr();
    while (IsName("if")) {
      int line = Next().line;
      auto e = Make(ExprKind::kCond, line);
      ExprPtr cond = ParseOr();
      ExprPtr other = SkipName("else") ? ParseExpression() : nullptr;
      e->args.push_back(std::move(expr));
      e->args.push_back(std::move(cond));
      e->args.push_back(std::move(other));
      expr = std::move(e);
    }
    return expr;
  }

  ExprPtr ParseOr() {
    ExprPtr left = ParseAnd();
    while (IsName("or")) {
      auto e = Make(ExprKind::kOr, Next().line);
      e->args.push_back(std::move(left));
      e->args.push_back(ParseAnd());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr ParseAnd() {
    ExprPtr left = ParseNot();
    while (IsName("and")) {
      auto e = Make(ExprKind::kAnd, Next().line);
      e->args.push_back(std::move(left));
      e->args.push_back(ParseNot());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (IsName("not")) {
      DepthGuard guard(*this);
      auto e = Make(ExprKind::kUnary, Next().line);
      e->name = "not";
      e->args.push_back(ParseNot());
      return e;
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    int line = Cur().line;
    ExprPtr first = ParseMath1();
    auto e = Make(ExprKind::kCompare, line);
    e->args.push_back(std::move(first));
    while (true) {
      std::string op;
      if (Cur().type == Tok::kOp && (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" ||
                                     Cur().text == ">" || Cur().text == "<=" || Cur().text == ">=")) {
        op = Next().text;
      } else if (SkipName("in")) {
        op = "in";
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().text == "in") {
        i_ += 2;
        op = "not in";
      } else {
        break;
      }
      e->ops.push_back(op);
      e->args.push_back(ParseMath1());
    }
    if (e->ops.empty()) return std::move(e->args[0]);
    return e;
  }

  ExprPtr Binary(const std::string& op, ExprPtr left, ExprPtr right, int line) {
    auto e = Make(ExprKind::kBinary, line);
    e->name = op;
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  ExprPtr ParseMath1() {
    ExprPtr left = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const Token& t = Next();
      left = Binary(t.text, std::move(left), ParseConcat(), t.line);
    }
    return left;
  }

  ExprPtr ParseConcat() {
    int line = Cur().line;
    ExprPtr first = ParseMath2();
    if (!IsOp("~")) return first;
    auto e = Make(ExprKind::kConcat, line);
    e->args.push_back(std::move(first));
    while (SkipOp("~")) e->args.push_back(ParseMath2());
    return e;
  }

  ExprPtr ParseMath2() {
    ExprPtr left = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token& t = Next();
      left = Binary(t.text, std::move(left), ParsePow(), t.line);
    }
    return left;
  }

  ExprPtr ParsePow() {
    ExprPtr left = ParseUnary(true);
    while (IsOp("**")) {
      const Token& t = Next();
      left = Binary("**", std::move(left), ParseUnary(true), t.line);
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      const Token& t = Next();
      node = Make(ExprKind::kUnary, t.line);
      node->name = t.text;
      node->args.push_back(ParseUnary(false));
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr ParsePrimary() {
    const Token& t = Cur();
    int line = t.line;
    if (t.type == Tok::kName) {
      ++i_;
      auto e = Make(ExprKind::kConst, line);
      if (t.text == "true" || t.text == "True") {
        e->value = Value::Bool(true);
      } else if (t.text == "false" || t.text == "False") {
        e->value = Value::Bool(false);
      } else if (t.text == "none" || t.text == "None") {
        e->value = Value::None();
      } else {
        e->kind = ExprKind::kName;
        e->name = t.text;
        program_.names.push_back(t.text);
      }
      return e;
    }
    if (t.type == Tok::kString) {
      std::string s;
      while (Cur().type == Tok::kString) s += Next().text;  // adjacent literals concatenate
      auto e = Make(ExprKind::kConst, line);
      e->value = Value::Str(std::move(s));
      return e;
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) {
      auto e = Make(ExprKind::kConst, line);
      e->value = Next().number;
      return e;
    }
    if (SkipOp("(")) {
      ExprPtr e = ParseTuple(true, true);
      ExpectOp(")");
      return e;
    }
    if (SkipOp("[")) {
      auto e = Make(ExprKind::kList, line);
      while (!SkipOp("]")) {
        if (!e->args.empty()) ExpectOp(",");
        if (SkipOp("]")) break;
        e->args.push_back(ParseExpression());
      }
      return e;
    }
    if (SkipOp("{")) {
      auto e = Make(ExprKind::kDict, line);
      while (!SkipOp("}")) {
        if (!e->args.empty()) ExpectOp(",");
        if (SkipOp("}")) break;
        e->args.push_back(ParseExpression());
        ExpectOp(":");
        e->args.push_back(ParseExpression());
      }
      return e;
    }
    FailAt(line, "unexpected '" + Describe(t) + "'");
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (true) {
      int line = Cur().line;
      if (SkipOp(".")) {
        if (Cur().type == Tok::kName) {
          auto e = Make(ExprKind::kAttr, line);
          e->name = Next().text;
          e->args.push_back(std::move(node));
          node = std::move(e);
        } else if (Cur().type == Tok::kInt) {
          auto e = Make(ExprKind::kItem, line);
          e->args.push_back(std::move(node));
          auto idx = Make(ExprKind::kConst, line);
          idx->value = Next().number;
          e->args.push_back(std::move(idx));
          node = std::move(e);
        } else {
          Unexpected("name or number");
        }
      } else if (SkipOp("[")) {
        node = ParseSubscript(std::move(node), line);
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  // obj[i], obj[a:b:c], or obj[a, b] / obj[] (a tuple key, as in Jinja).
  ExprPtr ParseSubscript(ExprPtr obj, int line) {
    ExprPtr parts[3];
    bool is_slice = false;
    if (SkipOp("]")) {
      auto e = Make(ExprKind::kItem, line);
      auto key = Make(ExprKind::kTuple, line);
      e->args.push_back(std::move(obj));
      e->args.push_back(std::move(key));
      return e;
    }
    if (!IsOp(":")) parts[0] = ParseExpression();
    if (SkipOp(":")) {
      is_slice = true;
      if (!IsOp("]") && !IsOp(":")) parts[1] = ParseExpression();
      if (SkipOp(":") && !IsOp("]")) parts[2] = ParseExpression();
    }
    if (!is_slice && IsOp(",")) {
      auto key = Make(ExprKind::kTuple, line);
      key->args.push_back(std::move(parts[0]));
      while (SkipOp(",")) key->args.push_back(ParseExpression());
      parts[0] = std::move(key);
    }
    ExpectOp("]");
    auto e = Make(is_slice ? ExprKind::kSlice : ExprKind::kItem, line);
    e->args.push_back(std::move(obj));
    e->args.push_back(std::move(parts[0]));
    if (is_slice) {
      e->args.push_back(std::move(parts[1]));
      e->args.push_back(std::move(parts[2]));
    }
    return e;
  }

  // Arguments of a call, filter or test; `*x` and `**x` are kept as keyword "*" / "**".
  void ParseCallArgs(Expr& e) {
    ExpectOp("(");
    bool first = true;
    while (!SkipOp(")")) {
      if (!first) ExpectOp(",");
      first = false;
      if (SkipOp(")")) break;
      if (SkipOp("**")) {
        e.kwargs.emplace_back("**", ParseExpression());
      } else if (SkipOp("*")) {
        e.kwargs.emplace_back("*", ParseExpression());
      } else if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().text == "=") {
        std::string key = Next().text;
        ++i_;
        e.kwargs.emplace_back(key, ParseExpression());
      } else {
        if (!e.kwargs.empty()) FailAt(Cur().line, "positional argument follows keyword argument");
        e.args.push_back(ParseExpression());
      }
    }
  }

  ExprPtr ParseCall(ExprPtr callee) {
    auto e = Make(ExprKind::kCall, Cur().line);
    e->args.push_back(std::move(callee));
    ParseCallArgs(*e);
    return e;
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (SkipOp("|")) {
        node = ParseFilter(std::move(node));
      } else if (IsName("is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseFilter(ExprPtr operand) {
    auto e = Make(ExprKind::kFilter, Cur().line);
    e->name = ExpectName();
    while (SkipOp(".")) e->name += "." + ExpectName();
    e->args.push_back(std::move(operand));
    if (IsOp("(")) ParseCallArgs(*e);
    return e;
  }

  ExprPtr ParseTest(ExprPtr operand) {
    auto e = Make(ExprKind::kTest, Next().line);  // `is`
    e->negated = SkipName("not");
    e->name = ExpectName();
    while (SkipOp(".")) e->name += "." + ExpectName();
    e->args.push_back(std::move(operand));
    const Token& t = Cur();
    bool arg_start = t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt ||
                     t.type == Tok::kFloat || IsOp("[") || IsOp("{");
    if (IsOp("(")) {
      ParseCallArgs(*e);
    } else if (arg_start && !IsName("else") && !IsName("or") && !IsName("and")) {
      if (IsName("is")) FailAt(t.line, "You cannot chain multiple tests with is");
      e->args.push_back(ParsePostfix(ParsePrimary()));  // `x is divisibleby 3`
    }
    return e;
  }

  // Unknown filters and tests fail at parse time, except where Jinja defers them to run time:
  // inside an if statement or an inline if-expression (a "soft" frame), so a template may use
  // a filter it only needs on a branch that is never taken here.
  ExprPtr Checked(ExprPtr e) {
    if (!soft_ && e) CheckNames(*e);
    return e;
  }
  void CheckNames(const Expr& e) const {
    if (e.kind == ExprKind::kCond) return;
    if (e.kind == ExprKind::kFilter && !HasFilter(e.name))
      FailAt(e.line, "No filter named '" + e.name + "'.");
    if (e.kind == ExprKind::kTest && !HasTest(e.name)) FailAt(e.line, "No test named '" + e.name + "'.");
    for (const auto& a : e.args)
      if (a) CheckNames(*a);
    for (const auto& kv : e.kwargs) CheckNames(*kv.second);
  }
  struct SoftScope {
    SoftScope(Parser& p, bool soft) : p_(p), saved_(p.soft_) { p_.soft_ = soft; }
    ~SoftScope() { p_.soft_ = saved_; }
    Parser& p_;
    bool saved_;
  };

  // Deeply nested input must give an error, not a stack overflow.
  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > 200) FailAt(p_.Cur().line, "template nested too deeply");
    }
    ~DepthGuard() { --p_.depth_; }
    Parser& p_;
  };

  std::vector<Token> toks_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  int depth_ = 0;
  bool soft_ = false;
  Program& program_;
};

}  // namespace

std::shared_ptr<Program> ParseProgram(std::string_view source, const Options& options) {
  auto program = std::make_shared<Program>();
  program->options = options;
  Parser parser(Lex(source, options), *program);
  program->body = parser.ParseTemplate();
  return program;
}

}  // namespace internal

StatusOr<Template> Template::Parse(std::string_view source, const Options& options) {
  try {
    Template t;
    t.program_ = internal::ParseProgram(source, options);
    return t;
  } catch (const internal::Error& e) {
    return Corrupt(options.name, ":", e.line, ": syntax error: ", e.message);
  } catch (const std::exception& e) {
    return Corrupt(options.name, ": ", e.what());
  }
}

bool Template::References(const std::string& name) const {
  if (!program_) return false;
  const auto& names = program_->names;
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace m3::jinja
