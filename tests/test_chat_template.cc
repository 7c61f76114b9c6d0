// Chat templates (lib/text/chat_template.*) and the Jinja interpreter under them
// (lib/text/jinja*.cc): every chat golden renders byte for byte, and the interpreter matches
// Python Jinja2 as transformers configures it (expected strings below were produced by
// Jinja2 3.1 with trim_blocks/lstrip_blocks and transformers' tojson).
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"
#include "test_util.h"
#include "text/chat_template.h"
#include "text/jinja.h"

namespace {

using m3::ChatTemplate;
using m3::StatusCode;
using m3::jinja::Template;
using m3::jinja::Value;
using ojson = nlohmann::ordered_json;
using Catch::Matchers::Contains;

using m3::test::TokenizerDir;

// Renders `source` with `vars` (a JSON object); returns the output or "ERROR: <message>".
std::string Run(const std::string& source, const ojson& vars = ojson::object()) {
  auto t = Template::Parse(source);
  if (!t.ok()) return "ERROR: " + t.status().message();
  std::map<std::string, Value> globals;
  for (auto it = vars.begin(); it != vars.end(); ++it) globals[it.key()] = Value::FromJson(it.value());
  auto r = t->Render(globals);
  return r.ok() ? r.value() : "ERROR: " + r.status().message();
}

TEST_CASE("every chat golden renders byte-identical", "[chat_template]") {
  auto ct = ChatTemplate::Load(TokenizerDir());
  INFO(ct.status().ToString());
  REQUIRE(ct.ok());
  // The repository's copy and ../shared's when it is there (which may hold more cases).
  for (const std::string& file : m3::test::TokenizerGoldenFiles("chat_golden.jsonl")) {
  INFO(file);
  std::ifstream in(file);
  REQUIRE(in.good());
  std::string line;
  int cases = 0, errors = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    ojson c = ojson::parse(line);  // ordered: the tool JSON in the prompt keeps the given key order
    ++cases;
    INFO("case " << c["id"].get<std::string>());
    auto r = ct->Render(c["messages"], c["tools"], c["options"]);
    if (c.contains("error")) {
      ++errors;
      REQUIRE_FALSE(r.ok());
      CHECK(r.status().code() == StatusCode::kInvalidArgument);
      CHECK(r.status().message() == c["error"].get<std::string>());
    } else {
      INFO((r.ok() ? std::string() : r.status().ToString()));
      REQUIRE(r.ok());
      CHECK(r.value() == c["rendered"].get<std::string>());
    }
  }
  CHECK(cases >= 31);
  CHECK(errors >= 1);
  }
}

TEST_CASE("chat template loading", "[chat_template]") {
  m3::test::TempDir dir;
  std::string src;
  {
    std::ifstream in(TokenizerDir() + "/chat_template.jinja");
    std::stringstream ss;
    ss << in.rdbuf();
    src = ss.str();
  }
  const ojson messages = ojson::parse(R"([{"role": "user", "content": "hi"}])");
  const ojson options = ojson::parse(R"({"add_generation_prompt": true})");
  auto expected = ChatTemplate::Load(TokenizerDir() + "/chat_template.jinja");  // a file path works too
  REQUIRE(expected.ok());
  auto want = expected->Render(messages, nullptr, options);
  REQUIRE(want.ok());
  CHECK_THAT(want.value(), Contains("]~b]user\nhi[e~[\n]~b]ai\n"));

  SECTION("falls back to tokenizer_config.json's chat_template") {
    std::ofstream(dir.path() / "tokenizer_config.json") << ojson{{"chat_template", src}}.dump();
    auto ct = ChatTemplate::Load(dir.str());
    REQUIRE(ct.ok());
    auto got = ct->Render(messages, nullptr, options);
    REQUIRE(got.ok());
    CHECK(got.value() == want.value());
  }
  SECTION("a list of named templates picks \"default\"; special tokens become variables") {
    ojson config = {{"chat_template",
                     ojson::array({{{"name", "tool_use"}, {"template", "T"}},
                                   {{"name", "default"}, {"template", "{{ bos_token }}|{{ eos_token }}"}}})},
                    {"bos_token", "<s>"},
                    {"eos_token", {{"content", "</s>"}, {"special", true}}}};
    std::ofstream(dir.path() / "tokenizer_config.json") << config.dump();
    auto ct = ChatTemplate::Load(dir.str());
    REQUIRE(ct.ok());
    auto got = ct->Render(messages, nullptr, nullptr);
    REQUIRE(got.ok());
    CHECK(got.value() == "<s>|</s>");
  }
  SECTION("nothing to load") {
    auto ct = ChatTemplate::Load(dir.str());
    REQUIRE_FALSE(ct.ok());
    CHECK(ct.status().code() == StatusCode::kNotFound);
  }
  SECTION("a syntax error names the file and line") {
    std::ofstream(dir.path() / "chat_template.jinja") << "line one\n{% if x %}\n{{ 1 + }}\n{% endif %}";
    auto ct = ChatTemplate::Load(dir.str());
    REQUIRE_FALSE(ct.ok());
    CHECK(ct.status().code() == StatusCode::kCorrupt);
    CHECK_THAT(ct.status().message(), Contains("chat_template.jinja:3:"));
  }
}

TEST_CASE("chat template variables and argument checks", "[chat_template]") {
  auto ct = ChatTemplate::FromString(
      "{{ messages|length }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ custom }}|"
      "{{ strftime_now('%Y')|length }}");
  REQUIRE(ct.ok());
  const ojson msgs = ojson::array();
  auto r = ct->Render(msgs, nullptr, ojson{{"custom", "c"}});
  REQUIRE(r.ok());
  CHECK(r.value() == "0|None|None|False|c|4");
  CHECK(ct->Render(ojson::object(), nullptr, nullptr).status().code() == StatusCode::kInvalidArgument);
  CHECK(ct->Render(msgs, ojson::object(), nullptr).status().code() == StatusCode::kInvalidArgument);
  CHECK(ct->Render(msgs, nullptr, ojson{{"messages", 1}}).status().code() == StatusCode::kInvalidArgument);

  // nlohmann::json input works too (its objects come with sorted keys).
  auto plain = ct->Render(nlohmann::json::array(), nlohmann::json(), nlohmann::json{{"custom", 1}});
  REQUIRE(plain.ok());
  CHECK(plain.value() == "0|None|None|False|1|4");

  auto raising = ChatTemplate::FromString("{{ raise_exception('bad ' ~ messages[0].role) }}");
  REQUIRE(raising.ok());
  auto e = raising->Render(ojson::parse(R"([{"role": "x"}])"), nullptr, nullptr);
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().code() == StatusCode::kInvalidArgument);
  CHECK(e.status().message() == "bad x");
}

TEST_CASE("jinja: literals, operators and Python printing", "[jinja]") {
  CHECK(Run("{{ none }}|{{ true }}|{{ 2.5 }}|{{ 1e20 }}|{{ 1e-5 }}|{{ 3.0 }}|{{ 0.1 + 0.2 }}") ==
        "None|True|2.5|1e+20|1e-05|3.0|0.30000000000000004");
  CHECK(Run("{{ [1, 'a', none, true, 1.0] }}|{{ {'a': (1, 2)} }}|{{ (1,) }}|{{ \"it's\" }}|{{ [\"it's\", "
            "'a\\nb'] }}") == "[1, 'a', None, True, 1.0]|{'a': (1, 2)}|(1,)|it's|[\"it's\", 'a\\nb']");
  CHECK(Run("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 4 / 2 }} {{ -2 ** 2 }}") ==
        "3 -4 2 3.5 1024 2.0 4");
  CHECK(Run("{{ 1 == 1.0 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' in 'cat' }} {{ 2 not in [1, 2] }} {{ 'k' "
            "in {'k': 1} }}") == "True True False True False True");
  CHECK(Run("{{ 'x' ~ 1 ~ none ~ y }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 'ab' * 2 }} {{ 1_000 }} {{ 0x1f }} "
            "{{ 'a' 'b' }}") == "x1None ab [1, 2] abab 1000 31 ab");
  CHECK(Run("{{ true and 'x' }} {{ false or 'y' }} {{ 0 or [] }} {{ not 0 }} {{ 'y' if 1 else 'n' }} {{ 'y' "
            "if 0 }}|") == "x y [] True y |");
  CHECK(Run("{{ 'abc'[::-1] }} {{ 'h\xc3\xa9llo'[1:3] }} {{ 'h\xc3\xa9llo'|length }} {{ [1, 2, 3, 4, "
            "5][1:4:2] }} "
            "{{ [1, 2, 3][-1] }} {{ 'abc'[5] }}|") == "cba \xc3\xa9l 5 [2, 4] 3 |");
  CHECK(Run("{{ \"a\\u00e9\\n\\x41\\t\" }}") == "a\xc3\xa9\nA\t");
  CHECK(Run("{{ 1 + 'a' }}") == "ERROR: template:1: unsupported operand type(s) for +: 'int' and 'str'");
  CHECK(Run("{{ 1 / 0 }}") == "ERROR: template:1: division by zero");
}

TEST_CASE("jinja: filters", "[jinja]") {
  CHECK(Run("{{ {'a': 1}|tojson(indent=2) }}|{{ {'a': [1, 2.0, none, true, '\xc3\xa9<']}|tojson }}|"
            "{{ '\xc3\xa9'|tojson(ensure_ascii=true) }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|"
            "{{ {'a': 1, 'b': 2}|tojson(separators=(',', ':')) }}") ==
        "{\n  \"a\": 1\n}|{\"a\": [1, 2.0, null, true, \"\xc3\xa9<\"]}|\"\\u00e9\"|{\"a\": 2, \"b\": "
        "1}|{\"a\":1,\"b\":2}");
  CHECK(Run("{{ '  Hi  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'hello world'|title }}|{{ 'hELLO'|capitalize }}|"
            "{{ 'abc'|upper }}|{{ 'a b'|wordcount }}|{{ '<a&>'|e }}") ==
        "Hi|hi|Hello World|Hello|ABC|2|&lt;a&amp;&gt;");
  CHECK(Run("{{ [3, 1, 2]|sort }} {{ ['b', 'A', 'c']|sort }} {{ [{'n': 2}, {'n': 1}]|sort(attribute='n') }} "
            "{{ [1, 2, 3]|join(',') }} {{ [{'v': 1}, {'v': 2}]|sum(attribute='v') }} {{ [4, 2, 8]|max }}") ==
        "[1, 2, 3] ['A', 'b', 'c'] [{'n': 1}, {'n': 2}] 1,2,3 3 8");
  CHECK(Run("{{ x|default('d') }} {{ none|default('d') }} {{ ''|default('d', true) }} {{ [1, 2, 3, "
            "4]|select('odd')|list }} "
            "{{ [1, 2, 3]|reject('>', 1)|list }} {{ ['a', 'b']|map('upper')|list }}") ==
        "d None d [1, 3] [1] ['A', 'B']");
  const ojson users = ojson::parse(R"({"users": [{"name": "a", "on": true}, {"name": "b", "on": false}]})");
  CHECK(Run("{{ users|selectattr('on')|map(attribute='name')|list }} {{ "
            "users|rejectattr('on')|map(attribute='name')|join }}",
            users) == "['a'] b");
  CHECK(Run("{{ d|dictsort }} {{ d|items|list }} {{ d.items()|list }} {{ d.get('zz', 5) }}",
            ojson::parse(R"({"d": {"b": 1, "a": 2}})")) ==
        "[('a', 2), ('b', 1)] [('b', 1), ('a', 2)] [('b', 1), ('a', 2)] 5");
  CHECK(Run("{{ '42'|int }} {{ '42.7'|int }} {{ 'abc'|int(7) }} {{ '3.5'|float }} {{ 2.567|round(2) }} {{ "
            "2.5|round }} {{ -3|abs }}") == "42 42 7 3.5 2.57 2.0 3");
  CHECK(
      Run("{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'hello world foo'|truncate(9) }}") ==
      "a\n    b\n\n    c|  a\n  b|hello...");
  CHECK(Run("{{ [1, 2, 3, 4, 5]|batch(2)|list }} {{ [1, 2, 1, 'a', 'A']|unique|list }} {{ 'abc'|reverse }} "
            "{{ [1, 2]|first }}") == "[[1, 2], [3, 4], [5]] [1, 2, 'a'] cba 1");
  CHECK(Run("{{ '%s-%05.1f'|format('a', 3.14159) }} {{ '%(a)s' % {'a': 3} }} {{ '{0}-{name}'.format(1, "
            "name='n') }} "
            "{{ '{:>4}|{:.2f}'.format('a', 2) }}") == "a-003.1 3 1-n    a|2.00");
  CHECK(Run("{{ x|nosuch }}") == "ERROR: template:1: syntax error: No filter named 'nosuch'.");
}

TEST_CASE("jinja: tests and string methods", "[jinja]") {
  CHECK(Run("{{ x is defined }} {{ none is none }} {{ 1 is number }} {{ true is integer }} {{ true is "
            "boolean }} {{ {} is mapping }} "
            "{{ 's' is iterable }} {{ 1 is iterable }} {{ 9 is divisibleby 3 }} {{ 3 is odd }} {{ 1 is in "
            "[1] }} {{ 'ab' is lower }}") ==
        "False True True False True True True False True True True True");
  CHECK(Run("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a,b,c'.rsplit(',', 1) }} {{ '  x '.strip() "
            "}}|"
            "{{ 'xhix'.strip('x') }} {{ 'aaa'.replace('a', 'b', 2) }}") ==
        "['a', 'b', '', 'c'] ['a', 'b'] ['a,b', 'c'] x|hi bba");
  CHECK(
      Run("{{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith(('x', 'lo')) }} {{ 'h\xc3\xa9llo'.find('l') }} "
          "{{ '-'.join(['a', 'b']) }} {{ 'a\\nb'.splitlines() }} {{ 'hello'.upper() }} {{ '5'.zfill(3) }}") ==
      "True True 2 a-b ['a', 'b'] HELLO 005");
  // Dot access prefers methods (Jinja's getattr), brackets prefer keys.
  CHECK(Run("{{ d['items'] }} {{ d.x }} {{ d.items()|list }}",
            ojson::parse(R"({"d": {"items": 1, "x": 2}})")) == "1 2 [('items', 1), ('x', 2)]");
}

TEST_CASE("jinja: whitespace control as transformers configures it", "[jinja]") {
  // trim_blocks eats the newline after a block tag, lstrip_blocks the indentation before it.
  CHECK(Run("  {% if true %}\n  x\n  {% endif %}\n  y {{ 1 }}  \n  {# c #}\nz") == "  x\n  y 1  \nz");
  CHECK(Run("a  {%- if true %}  b  {% endif -%}  c") == "a  b  c");
  CHECK(Run("a\n  {%+ if true %}\n    b\n  {% endif +%}\nc") ==
        "a\n      b\n\nc");  // "+" keeps the whitespace
  CHECK(Run("{{- '  a  ' -}}\n   x   \n{{- 1 }}") == "  a  x1");
  CHECK(Run("{% for i in [1, 2] %}\n  - {{ i }}\n{% endfor %}\ndone") == "  - 1\n  - 2\ndone");
  CHECK(Run("text {% if true %}\ninline\n{% endif %} after") == "text inline\n after");
  CHECK(Run("{% raw %}{{ not parsed }}{% endraw %}|{%- raw -%}  {{ x }}  {%- endraw -%}  z") ==
        "{{ not parsed }}|{{ x }}z");
  CHECK(Run("line\n") == "line");  // one trailing newline is dropped, like Jinja
  CHECK(Run("a\r\nb") == "a\nb");
}

TEST_CASE("jinja: loops, scoping, macros, namespaces", "[jinja]") {
  CHECK(Run("{% for a in [1, 2, 3] if a > 1 %}{{ loop.index }}/{{ loop.length }}{{ loop.previtem }}{{ "
            "loop.first }}"
            "{{ loop.last }};{% else %}E{% endfor %}") == "1/2TrueFalse;2/22FalseTrue;");
  CHECK(Run("{% for a in [] %}x{% else %}empty{% endfor %}") == "empty");
  CHECK(Run("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}") == "a=1;b=2;");
  CHECK(Run("{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% "
            "endif %}{{ i }}{% endfor %}") == "0134");
  CHECK(Run("{% for i in [1, 2, 3] %}{{ loop.cycle('o', 'e') }}{% endfor %}") == "oeo");
  // set inside a loop neither leaks out nor survives into the next iteration; if shares scope.
  CHECK(Run("{% set x = 0 %}{% for i in [1, 2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}{{ x }}") ==
        "01020");
  CHECK(Run("{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}") == "2");
  CHECK(Run("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ "
            "ns.n }}") == "6");
  CHECK(Run("{% set a, b = [1, 2] %}{{ a }}{{ b }}{% set s %}[{{ a }}]{% endset %}{{ s }}") == "12[1]");
  CHECK(Run("{% macro m(a, b=2, c=a) %}{{ a }}-{{ b }}-{{ c }}{% endmacro %}{{ m(1) }} {{ m(1, 3) }} {{ m(1, "
            "c=5) }} {{ m() }}|") == "1-2-1 1-3-1 1-2-5 -2-|");
  CHECK(Run("{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, x=4) }}") ==
        "1(2,){'x': 4}");
  CHECK(Run("{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }}") ==
        "321");
  CHECK(Run("{% macro outer() %}[{{ caller() }}]{% endmacro %}{% call outer() %}in{% endcall %}") == "[in]");
  CHECK(Run("{% filter upper %}a{{ 'b' }}{% endfilter %}{% with q = 1 %}{{ q }}{% endwith %}{{ q }}|") ==
        "AB1|");
  CHECK(Run("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}") ==
        "ERROR: template:1: macro 'm' takes not more than 1 argument(s)");
  CHECK_THAT(Run("{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}"),
             Contains("maximum recursion depth exceeded"));
  // Self-references and macros stored in namespaces must not leak (checked under ASan).
  CHECK(Run("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{% macro m() %}{{ ns.a }}{% endmacro %}"
            "{% set ns.m = m %}{{ ns.me.me.a }}{{ ns.m() }}") == "11");
  CHECK(Run("{% set x = 1 %}{% set x.a = 2 %}") ==
        "ERROR: template:1: cannot assign attribute on non-namespace object");
}

TEST_CASE("jinja: undefined behaves like Jinja's default Undefined", "[jinja]") {
  CHECK(Run("[{{ x }}]{{ x|length }}{{ x|list }}{{ x is defined }}{{ x == none }}{% for i in x %}no{% endfor "
            "%}{{ 'a' in x }}") == "[]0[]FalseFalseFalse");
  CHECK(Run("{% if x %}y{% else %}n{% endif %}{{ x ~ 'z' }}{{ x|default(1) }}{{ x is not defined and true "
            "}}") == "nz1True");
  CHECK(Run("{{ d.missing }}|{{ d['missing'] }}|{{ d.missing is defined }}", ojson::parse(R"({"d": {}})")) ==
        "||False");
  CHECK(Run("{{ x.y }}") == "ERROR: template:1: 'x' is undefined");
  CHECK(Run("{{ d.a.b }}", ojson::parse(R"({"d": {}})")) ==
        "ERROR: template:1: 'dict object' has no attribute 'a'");
  CHECK(Run("{{ x + 1 }}") == "ERROR: template:1: 'x' is undefined");
  CHECK(Run("{{ f() }}") == "ERROR: template:1: 'f' is undefined");
  CHECK(Run("{{ [1].append(2) }}") ==
        "ERROR: template:1: access to attribute 'append' of 'list' object is unsafe.");
}

TEST_CASE("jinja: syntax errors carry the line number", "[jinja]") {
  auto bad = Template::Parse("line 1\n{% if x %}\n{{ 1 + }}\n{% endif %}");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kCorrupt);
  CHECK(bad.status().message() == "template:3: syntax error: unexpected 'end of print statement'");
  auto unclosed = Template::Parse("a\n{% for x in y %}\nb");
  REQUIRE_FALSE(unclosed.ok());
  CHECK_THAT(unclosed.status().message(), Contains("template:3:") && Contains("'endfor' or 'else'"));
  CHECK_THAT(Run("{% endif %}"), Contains("Encountered unknown tag 'endif'"));
  CHECK_THAT(Run("{{ 'abc }}"), Contains("unexpected end of string"));
  CHECK_THAT(Run("{% break %}"), Contains("'break' outside of a loop"));
  CHECK_THAT(Run("{% include 'x' %}"), Contains("not supported"));
  CHECK_THAT(Run("{{ " + std::string(1000, '(') + "1" + std::string(1000, ')') + " }}"),
             Contains("nested too deeply"));
  std::string deep;
  for (int i = 0; i < 1000; ++i) deep += "{% if true %}";
  CHECK_THAT(Run(deep), Contains("nested too deeply"));
  // Runtime errors report the line too.
  CHECK(Run("a\nb\n{{ 1 // 0 }}") == "ERROR: template:3: integer division or modulo by zero");
}

TEST_CASE("jinja: parsing corner cases follow Jinja2", "[jinja]") {
  // Unknown filters/tests inside if-statements and inline ifs fail only when reached.
  CHECK(Run("{% if false %}{{ x|nosuch }}{% endif %}{{ 'a' if true else x|nosuch2 }}ok") == "aok");
  CHECK(Run("{% if true %}{{ x|nosuch }}{% endif %}") == "ERROR: template:1: No filter named 'nosuch'.");
  CHECK_THAT(Run("{% if false %}{% for i in [1] %}{{ i|nosuch }}{% endfor %}{% endif %}"),
             Contains("syntax error: No filter named 'nosuch'."));
  // A Python-style colon may end a block tag; if-tests may be tuples.
  CHECK(Run("{% if x: %}a{% elif true: %}b{% endif %}{% for i in [1]: %}{{ i }}{% endfor %}{% if 1, 0 %}t{% "
            "endif %}") == "b1t");
  CHECK(Run("{{ d[1, 2] }}|{{ l[] }}|", ojson::parse(R"({"d": {}, "l": [1]})")) == "||");
  CHECK(Run("{{ 0o17 + 0b11 + 0x_f }} {{ 00 }} {{ 0or 1 }}") == "33 0 1");
  CHECK_THAT(Run("{{ 012 }}"), Contains("got 'integer'"));
  CHECK_THAT(Run("{% for k, in [[1]] %}{% endfor %}"), Contains("syntax error"));
  CHECK_THAT(Run("{% set none = 1 %}"), Contains("can't assign"));
  CHECK(Run("{{ 'a' }}{#") == "a");  // Jinja accepts a bare comment opener at the very end
  // printf-style formatting is lenient with list/dict arguments exactly where Python is.
  CHECK(Run("{{ '<s' % [1, 2] }}|{{ 'x' % {'a': 1} }}") == "<s|x");
  CHECK(Run("{{ 'x' % 5 }}") == "ERROR: template:1: not all arguments converted during string formatting");
  // Ints are 64-bit: where Python would grow the int, the result is an error, never a wrong number.
  CHECK(Run("{{ 2 ** 62 }} {{ -9223372036854775807 - 1 }}") == "4611686018427387904 -9223372036854775808");
  CHECK_THAT(Run("{{ 9223372036854775807 + 1 }}"), Contains("integer overflow"));
  CHECK_THAT(Run("{{ 99999999999999999999 }}"), Contains("does not fit in 64 bits"));
}

TEST_CASE("jinja: host functions and values", "[jinja]") {
  auto t = Template::Parse("{{ add(1, b=2) }}|{{ fail('boom') }}");
  REQUIRE(t.ok());
  std::map<std::string, Value> globals;
  globals["add"] = Value::MakeFunction("add", [](const m3::jinja::CallArgs& a) -> m3::StatusOr<Value> {
    return Value::Int(a.positional.at(0).int_value() + a.keyword.at(0).second.int_value());
  });
  globals["fail"] = Value::MakeFunction("fail", [](const m3::jinja::CallArgs& a) -> m3::StatusOr<Value> {
    return m3::Status(StatusCode::kOutOfRange, a.positional.at(0).ToStr());
  });
  auto r = t->Render(globals);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kOutOfRange);  // a host status comes back unchanged
  CHECK(r.status().message() == "boom");
  CHECK(t->References("add"));
  CHECK_FALSE(t->References("sub"));

  Value v = Value::FromJson(ojson::parse(R"({"b": [1, 2.5, "s", null, true], "a": {}})"));
  CHECK(v.Repr() == "{'b': [1, 2.5, 's', None, True], 'a': {}}");
  auto back = v.ToJson();
  REQUIRE(back.ok());
  CHECK(back.value().dump() == R"({"b":[1,2.5,"s",null,true],"a":{}})");
}

}  // namespace
