// Constrained decoding (lib/constrain): the GBNF parser and its errors, the JSON-schema and
// tool-call compilers, masks against a brute-force Accept of every token, the token budget, and
// random walks over the real vocabulary whose output an independent validator
// (json_schema_check.h) and the real output parser check.
#include <random>

#include "constrain/constrain.h"
#include "constrain/grammar.h"
#include "json_schema_check.h"
#include "test_util.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace m3::constrain {
namespace {

using nlohmann::json;

struct Vocab {
  std::unique_ptr<Tokenizer> tokenizer;
  std::shared_ptr<const VocabIndex> index;
  int32_t end_id = -1;
  int32_t byte_token[256];
};

const Vocab& TheVocab() {
  static const Vocab* v = [] {
    auto* out = new Vocab;
    auto tok = Tokenizer::Load(test::TokenizerDir());
    REQUIRE(tok.ok());
    out->tokenizer = std::move(*tok);
    out->index = VocabIndex::Build(*out->tokenizer);
    out->end_id = out->tokenizer->TokenId("[e~[");
    REQUIRE(out->end_id >= 0);
    std::fill(std::begin(out->byte_token), std::end(out->byte_token), -1);
    for (size_t id = 0; id < out->index->vocab_size(); ++id) {
      const std::string& b = out->index->token_bytes(static_cast<int32_t>(id));
      if (b.size() == 1 && out->byte_token[static_cast<uint8_t>(b[0])] < 0) {
        out->byte_token[static_cast<uint8_t>(b[0])] = static_cast<int32_t>(id);
      }
    }
    return out;
  }();
  return *v;
}

std::shared_ptr<const Grammar> Gbnf(std::string_view text) {
  auto g = CompileGbnf(text);
  INFO(text);
  if (!g.ok()) FAIL(g.status().message());
  return *g;
}

// Feeds `text` byte by byte (single-byte tokens); true if all accepted and the grammar is complete.
bool Accepts(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  const Vocab& v = TheVocab();
  Matcher m(g, v.index, {v.end_id});
  for (char c : text) {
    if (!m.Accept(v.byte_token[static_cast<uint8_t>(c)])) return false;
  }
  return m.complete();
}

std::string GbnfError(std::string_view text) {
  auto g = CompileGbnf(text);
  if (g.ok()) return "(compiled)";
  CHECK(g.status().code() == StatusCode::kInvalidArgument);
  return g.status().message();
}

std::string SchemaError(const json& schema) {
  auto g = CompileJsonSchema(schema);
  if (g.ok()) return "(compiled)";
  CHECK(g.status().code() == StatusCode::kInvalidArgument);
  return g.status().message();
}

bool Bit(const std::vector<uint64_t>& mask, int32_t id) { return (mask[id >> 6] >> (id & 63)) & 1; }

std::vector<int32_t> Allowed(const std::vector<uint64_t>& mask, size_t vocab) {
  std::vector<int32_t> ids;
  for (size_t w = 0; w < mask.size(); ++w) {
    for (uint64_t bits = mask[w]; bits != 0; bits &= bits - 1) {
      const size_t id = w * 64 + static_cast<size_t>(__builtin_ctzll(bits));
      if (id < vocab) ids.push_back(static_cast<int32_t>(id));
    }
  }
  return ids;
}

struct Walk {
  std::string text;
  std::vector<int32_t> ids;
  bool done = false;
  size_t steps = 0;
};

// A random model: each step picks uniformly among the allowed tokens, under a budget of `budget`.
Walk RandomWalk(const std::shared_ptr<const Grammar>& g, size_t budget, uint32_t seed) {
  const Vocab& v = TheVocab();
  Matcher m(g, v.index, {v.end_id});
  std::mt19937 rng(seed);
  std::vector<uint64_t> mask(m.mask_words());
  Walk w;
  for (size_t left = budget; left > 0 && !m.done(); --left) {
    m.FillMask(mask, left);
    const std::vector<int32_t> ids = Allowed(mask, v.index->vocab_size());
    REQUIRE(!ids.empty());
    const int32_t id = ids[std::uniform_int_distribution<size_t>(0, ids.size() - 1)(rng)];
    REQUIRE(m.Accept(id));
    w.ids.push_back(id);
    if (id != v.end_id) w.text += v.tokenizer->TokenBytes(id);
    ++w.steps;
  }
  w.done = m.done();
  return w;
}

// ---------------------------------------------------------------------------------------------

TEST_CASE("gbnf: grammars parse and match what llama.cpp's would") {
  auto g = Gbnf(R"(root ::= "a" b+ | [x-z]{2,3}
b ::= "b" # comment
)");
  CHECK(Accepts(g, "ab"));
  CHECK(Accepts(g, "abbb"));
  CHECK(Accepts(g, "xy"));
  CHECK(Accepts(g, "xyz"));
  CHECK_FALSE(Accepts(g, "a"));
  CHECK_FALSE(Accepts(g, "x"));
  CHECK_FALSE(Accepts(g, "xyzx"));

  auto classes = Gbnf(R"(root ::= [^a-c\n] "é" [α-ω]* "\x41\u00e9\n" .)");
  CHECK(Accepts(classes, "dé\xce\xb1\xce\xb2" "A\xc3\xa9\n!"));
  CHECK(Accepts(classes, "zéAé\n\xe2\x82\xac"));
  CHECK_FALSE(Accepts(classes, "aéAé\n!"));
  CHECK_FALSE(Accepts(classes, "\néAé\n!"));

  auto groups = Gbnf(R"(
root ::= ( "x" | "y" ( "z" )? )* end
  | "only"
end ::= "!"{1} "?"{0,2} "."{2,}
)");
  CHECK(Accepts(groups, "!.."));
  CHECK(Accepts(groups, "xyzy!??..."));
  CHECK(Accepts(groups, "only"));
  CHECK_FALSE(Accepts(groups, "x!???.."));
  CHECK_FALSE(Accepts(groups, "x!."));

  // Nullable rules, right recursion, rule used before its definition.
  auto rec = Gbnf("root ::= item* tail\nitem ::= \"(\" root \")\"\ntail ::= \"\" | \"t\"");
  CHECK(Accepts(rec, ""));
  CHECK(Accepts(rec, "(()t)(t)"));
  CHECK_FALSE(Accepts(rec, "(()"));

  // A literal repeated as a whole; an escaped quote.
  auto lit = Gbnf(R"(root ::= "ab"{2} "\"")");
  CHECK(Accepts(lit, "abab\""));
  CHECK_FALSE(Accepts(lit, "abb\""));

  // Token terminals only match their token, never the same text.
  const Vocab& v = TheVocab();
  const int32_t open = v.tokenizer->TokenId("<tool_call>");
  auto tok = Gbnf("root ::= <[" + std::to_string(open) + "]> \"x\"");
  CHECK_FALSE(Accepts(tok, "<tool_call>x"));
  Matcher m(tok, v.index, {v.end_id});
  CHECK(m.Accept(open));
  CHECK(m.Accept(v.byte_token['x']));
  CHECK(m.complete());
  CHECK(m.Accept(v.end_id));
  CHECK(m.done());
  // A terminal may name a text token: matched by its id (or by its bytes where the text fits).
  auto by_id = Gbnf("root ::= <[" + std::to_string(v.byte_token['a']) + "]> \"b\"");
  Matcher m2(by_id, v.index, {v.end_id});
  std::vector<uint64_t> mask(m2.mask_words());
  m2.FillMask(mask, 100);
  CHECK(Bit(mask, v.byte_token['a']));
  CHECK(m2.Accept(v.byte_token['a']));
  CHECK(m2.Accept(v.byte_token['b']));
  CHECK(m2.complete());
  CHECK(CheckGrammarTokens(*tok, *v.index).ok());
  auto missing = CheckGrammarTokens(*Gbnf("root ::= \"x\" | <[999999]>"), *v.index);
  CHECK_THAT(missing.message(), Catch::Contains("<[999999]> is not in the vocabulary"));
}

TEST_CASE("gbnf: errors name what is wrong") {
  CHECK_THAT(GbnfError("root ::= foo"), Catch::Contains("rule 'foo' is used but never defined"));
  CHECK_THAT(GbnfError("root ::= \"abc"), Catch::Contains("unterminated literal"));
  CHECK_THAT(GbnfError("root ::= [abc"), Catch::Contains("unterminated character class"));
  CHECK_THAT(GbnfError("root ::= [z-a]"), Catch::Contains("bad character class range"));
  CHECK_THAT(GbnfError("root ::= []"), Catch::Contains("empty character class"));
  CHECK_THAT(GbnfError("root ::= \"\\q\""), Catch::Contains("unknown escape"));
  CHECK_THAT(GbnfError("root ::= root \"a\" | \"b\""), Catch::Contains("left recursion (root -> root)"));
  CHECK_THAT(GbnfError("root ::= a\na ::= b? a \"x\"\nb ::= \"b\""), Catch::Contains("left recursion"));
  CHECK_THAT(GbnfError("root ::= a\na ::= b\nb ::= a | \"x\""), Catch::Contains("left recursion"));
  CHECK_THAT(GbnfError("a ::= \"x\""), Catch::Contains("no rule named 'root'"));
  CHECK_THAT(GbnfError("root ::= \"x\"\nroot ::= \"y\""), Catch::Contains("defined twice"));
  CHECK_THAT(GbnfError("root ::= (\"x\""), Catch::Contains("expected ')'"));
  CHECK_THAT(GbnfError("root ::= \"x\" )"), Catch::Contains("expected the end of the line"));
  CHECK_THAT(GbnfError("root ::= *"), Catch::Contains("nothing to repeat"));
  CHECK_THAT(GbnfError("root ::= \"x\"{3,1}"), Catch::Contains("maximum is below the minimum"));
  CHECK_THAT(GbnfError("root ::= \"x\"{99999}"), Catch::Contains("repetition count above"));
  CHECK_THAT(GbnfError("root = \"x\""), Catch::Contains("expected '::='"));
  CHECK_THAT(GbnfError("root ::= <tok>"), Catch::Contains("<[id]>"));
  // An alternative that can never complete is dropped (no dead ends for the matcher).
  auto dead = Gbnf("root ::= \"a\" x | \"c\"\nx ::= \"b\" x");
  CHECK(Accepts(dead, "c"));
  CHECK_FALSE(Accepts(dead, "ab"));
  CHECK_THAT(GbnfError("root ::= x\nx ::= \"b\" x"), Catch::Contains("no finite sentence"));
  CHECK_THAT(GbnfError("root ::= \"\xff\""), Catch::Contains("invalid UTF-8"));
  std::string deep = "root ::= ";
  for (int i = 0; i < 100; ++i) deep += "(";
  deep += "\"x\"";
  for (int i = 0; i < 100; ++i) deep += ")";
  CHECK_THAT(GbnfError(deep), Catch::Contains("nested deeper than 64"));
  std::string big = "root ::= \"x\"{10000} \"y\"{10000} \"z\"{10000}";
  for (int i = 0; i < 250; ++i) big += " \"w\"{10000}";
  CHECK_THAT(GbnfError(big), Catch::Contains("expands past 2,000,000 grammar elements"));
  CHECK_THAT(GbnfError("root ::= \"a\"\n   | \"b\" ("), Catch::Contains("GBNF line 2"));
}

TEST_CASE("json schema: keywords compile and match") {
  auto compile = [](const json& s) {
    auto g = CompileJsonSchema(s);
    INFO(s.dump());
    if (!g.ok()) FAIL(g.status().message());
    return *g;
  };
  auto obj = compile(json::parse(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"}},
                                     "required":["a"],"additionalProperties":false})"));
  CHECK(Accepts(obj, R"({"a":1})"));
  CHECK(Accepts(obj, R"({"a":-12,"b":"x\"y\u00e9"})"));
  CHECK_FALSE(Accepts(obj, R"({"b":"x"})"));
  CHECK_FALSE(Accepts(obj, R"({"a":1,"c":2})"));
  CHECK_FALSE(Accepts(obj, R"({ "a":1})"));  // compact: no optional whitespace
  CHECK_FALSE(Accepts(obj, R"({"a":01})"));
  CHECK_FALSE(Accepts(obj, "{\"a\":1,\"b\":\"\x01\"}"));  // raw control character
  CHECK_FALSE(Accepts(obj, "{\"a\":1,\"b\":\"\xc3\"}"));  // broken UTF-8
  CHECK_FALSE(Accepts(obj, R"({"a":1,"b":"\ud800"})"));    // lone surrogate escape

  auto extra = compile(json::parse(R"({"type":"object","properties":{"id":{"type":"integer"}},
                                       "additionalProperties":{"type":"boolean"}})"));
  CHECK(Accepts(extra, R"({"id":3,"x":true,"id2":false})"));
  CHECK(Accepts(extra, R"({"i":true})"));
  CHECK_FALSE(Accepts(extra, R"({"id":true})"));  // a known key takes its own schema
  CHECK_FALSE(Accepts(extra, R"({"x":1})"));

  auto types = compile(json::parse(R"({"type":["string","null"],"maxLength":2})"));
  CHECK(Accepts(types, "null"));
  CHECK(Accepts(types, R"("ab")"));
  CHECK(Accepts(types, "\"\xe2\x82\xac\xe2\x82\xac\""));  // two characters, six bytes
  CHECK_FALSE(Accepts(types, R"("abc")"));

  auto e = compile(json::parse(R"({"enum":["red",1,null,{"a":[1]}]})"));
  CHECK(Accepts(e, R"("red")"));
  CHECK(Accepts(e, "1"));
  CHECK(Accepts(e, "null"));
  CHECK(Accepts(e, R"({"a":[1]})"));
  CHECK_FALSE(Accepts(e, R"("blue")"));
  auto c = compile(json::parse(R"({"const":"x"})"));
  CHECK(Accepts(c, R"("x")"));

  auto any = compile(json::parse(R"({"anyOf":[{"type":"boolean"},{"$ref":"#/$defs/pos"}],
                                     "$defs":{"pos":{"type":"integer","minimum":1,"maximum":250}}})"));
  CHECK(Accepts(any, "true"));
  CHECK(Accepts(any, "250"));
  CHECK(Accepts(any, "19"));
  CHECK_FALSE(Accepts(any, "251"));
  CHECK_FALSE(Accepts(any, "0"));
  CHECK_FALSE(Accepts(any, "-1"));

  auto all = compile(json::parse(R"({"allOf":[{"type":"object","properties":{"a":{"type":"null"}},"required":["a"]},
                                               {"properties":{"b":{"type":"boolean"}},"required":["b"]}]})"));
  CHECK(Accepts(all, R"({"a":null,"b":false})"));
  CHECK_FALSE(Accepts(all, R"({"a":null})"));

  auto arr = compile(json::parse(R"({"type":"array","prefixItems":[{"type":"string"},{"type":"integer"}],
                                     "items":{"type":"boolean"},"minItems":1,"maxItems":3})"));
  CHECK(Accepts(arr, R"(["x"])"));
  CHECK(Accepts(arr, R"(["x",2,true])"));
  CHECK_FALSE(Accepts(arr, "[]"));
  CHECK_FALSE(Accepts(arr, R"(["x",2,true,false])"));
  CHECK_FALSE(Accepts(arr, R"([1])"));

  auto nums = compile(json::parse(R"({"type":"number","minimum":-2,"exclusiveMaximum":3})"));
  // At most 15 significant digits: 2.9999999999999999 would parse as 3.0.
  for (const char* ok : {"-2", "-1.5", "0", "2.99999999999999", "-0.25", "2"}) CHECK(Accepts(nums, ok));
  for (const char* bad : {"3", "-3", "3.5", "-2.5", "1e2", "2.9999999999999999"}) CHECK_FALSE(Accepts(nums, bad));
  auto free_num = compile(json::parse(R"({"type":"number"})"));
  for (const char* ok : {"0", "-0.5", "12e-3", "1E+99"}) CHECK(Accepts(free_num, ok));
  for (const char* bad : {"01", ".5", "1.", "+1", "1e999"}) CHECK_FALSE(Accepts(free_num, bad));

  auto pattern = compile(json::parse(R"({"type":"string","pattern":"^[A-Z]{2}-\\d{3,4}(x|yz)?$"})"));
  CHECK(Accepts(pattern, R"("AB-123")"));
  CHECK(Accepts(pattern, R"("AB-1234yz")"));
  CHECK_FALSE(Accepts(pattern, R"("AB-12")"));
  CHECK_FALSE(Accepts(pattern, R"("ab-123")"));
  auto unanchored = compile(json::parse(R"({"type":"string","pattern":"a\"b"})"));
  CHECK(Accepts(unanchored, R"("xxa\"byy")"));
  CHECK_FALSE(Accepts(unanchored, R"("ab")"));

  auto date = compile(json::parse(R"({"type":"string","format":"date-time"})"));
  CHECK(Accepts(date, R"("2024-12-31T23:59:59.5+01:00")"));
  CHECK_FALSE(Accepts(date, R"("2024-02-30T00:00:00Z")"));
  for (const char* f : {"date", "time", "uuid", "email", "ipv4"}) CHECK(CompileJsonSchema({{"type", "string"}, {"format", f}}).ok());
  auto ip = compile(json::parse(R"({"format":"ipv4"})"));
  CHECK(Accepts(ip, R"("255.0.10.199")"));
  CHECK_FALSE(Accepts(ip, R"("256.0.0.1")"));

  // Recursion through $ref (a tree), bounded by the matcher's depth only.
  auto tree = compile(json::parse(R"({"$ref":"#/definitions/node","definitions":{"node":{"type":"object",
      "properties":{"v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/definitions/node"}}},
      "required":["v"],"additionalProperties":false}}})"));
  CHECK(Accepts(tree, R"({"kids":[{"v":1},{"kids":[],"v":2}],"v":0})"));

  auto anyobj = AnyJsonObject();
  REQUIRE(anyobj);
  CHECK(Accepts(anyobj, R"({"a b":[1,{"c":null}],"\u00e9":"x"})"));
  CHECK(Accepts(anyobj, "{}"));
  CHECK_FALSE(Accepts(anyobj, "[]"));
  CHECK_FALSE(Accepts(anyobj, "{\"a\":1,}"));
}

TEST_CASE("json schema: unsupported keywords are refused by name and path") {
  CHECK_THAT(SchemaError(json::parse(R"({"type":"object","properties":{"a":{"not":{"type":"null"}}}})")),
             Catch::Contains("/properties/a/not") && Catch::Contains("\"not\" is not supported"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"string","format":"hostname"})")),
             Catch::Contains("/format") && Catch::Contains("\"hostname\" is not supported"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"array","uniqueItems":true})")), Catch::Contains("uniqueItems"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"number","multipleOf":0.5})")), Catch::Contains("multipleOf"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"number","minimum":0.5})")), Catch::Contains("/minimum") && Catch::Contains("integral"));
  CHECK_THAT(SchemaError(json::parse(R"({"patternProperties":{"a":{}}})")), Catch::Contains("patternProperties"));
  CHECK_THAT(SchemaError(json::parse(R"({"if":{},"then":{}})")), Catch::Contains("\"if\""));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"strin"})")), Catch::Contains("unknown type \"strin\""));
  CHECK_THAT(SchemaError(json::parse(R"({"$ref":"#/$defs/missing"})")), Catch::Contains("does not resolve"));
  CHECK_THAT(SchemaError(json::parse(R"({"$ref":"http://x/y"})")), Catch::Contains("only #"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"string","pattern":"(a)\\1"})")), Catch::Contains("backreferences"));
  CHECK_THAT(SchemaError(json::parse(R"x({"type":"string","pattern":"a(?=b)"})x")), Catch::Contains("lookaround"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"string","pattern":"^a|b$"})")), Catch::Contains("top-level '|'"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"string","pattern":"[a-"})")), Catch::Contains("unterminated"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"string","maxLength":1000000})")), Catch::Contains("maxLength"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"string","minLength":3,"maxLength":2})")), Catch::Contains("below minLength"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"integer","minimum":5,"maximum":4})")), Catch::Contains("no integer"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"string","enum":[1,2]})")), Catch::Contains("no listed value"));
  CHECK_THAT(SchemaError(json::parse(R"({"allOf":[{"type":"string"}, {"minLength":1}]})")), Catch::Contains("allOf"));
  CHECK_THAT(SchemaError(json::parse(R"({"allOf":[{"properties":{"a":{}},"required":["a"]}],"additionalProperties":false})")),
             Catch::Contains("does not list it"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"array","items":{"type":"integer"},"minItems":5,"maxItems":2})")),
             Catch::Contains("minItems"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"object","properties":{"a":false},"required":["a"]})")),
             Catch::Contains("/properties/a") && Catch::Contains("false"));
  CHECK_THAT(SchemaError(json::parse(R"({"type":"object","required":["a"],"additionalProperties":false})")),
             Catch::Contains("required but additionalProperties is false"));
  // A schema whose only value would be infinite.
  CHECK_THAT(SchemaError(json::parse(R"({"$ref":"#/$defs/a","$defs":{"a":{"type":"object","properties":{"x":{"$ref":"#/$defs/a"}},"required":["x"]}}})")),
             Catch::Contains("no finite sentence"));
  // Deep nesting is bounded.
  json deep = {{"type", "integer"}};
  for (int i = 0; i < 100; ++i) deep = {{"type", "array"}, {"items", deep}};
  CHECK_THAT(SchemaError(deep), Catch::Contains("nested deeper than 64"));
  CHECK_THAT(SchemaError(json("not a schema")), Catch::Contains("must be an object"));
}

// Twenty schemas of the kinds requests carry; the walks below must produce valid JSON for each.
std::vector<json> PropertySchemas() {
  const char* texts[] = {
      R"({"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer","minimum":1,"maximum":14},
          "unit":{"type":"string","enum":["C","F"]}},"required":["city","days"],"additionalProperties":false})",
      R"({"type":"object","properties":{"name":{"type":"string","minLength":1,"maxLength":40},"age":{"type":"integer","minimum":0},
          "email":{"type":"string","format":"email"},"tags":{"type":"array","items":{"type":"string"},"maxItems":4}},
          "required":["name","age","email","tags"],"additionalProperties":false})",
      R"({"type":"object","properties":{"label":{"enum":["positive","negative","neutral"]},"score":{"type":"number","minimum":0,"maximum":1}},
          "required":["label","score"]})",
      R"({"type":"object","properties":{"order_id":{"type":"string","format":"uuid"},
          "customer":{"type":"object","properties":{"id":{"type":"integer"},"vip":{"type":"boolean"}},"required":["id","vip"],"additionalProperties":false},
          "items":{"type":"array","minItems":1,"maxItems":3,"items":{"type":"object","properties":{"sku":{"type":"string","maxLength":12},
          "qty":{"type":"integer","minimum":1}},"required":["sku","qty"],"additionalProperties":false}}},
          "required":["order_id","customer","items"],"additionalProperties":false})",
      R"({"type":"object","properties":{"nick":{"anyOf":[{"type":"string","maxLength":8},{"type":"null"}]},"age":{"type":["integer","null"]}},
          "required":["nick","age"]})",
      R"({"type":"object","properties":{"day":{"type":"string","format":"date"},"at":{"type":"string","format":"time"},
          "stamp":{"type":"string","format":"date-time"}},"required":["day","at","stamp"]})",
      R"({"type":"object","properties":{"ip":{"type":"string","format":"ipv4"},"code":{"type":"string","pattern":"^[A-Z]{3}-[0-9]{2}$"}},
          "required":["ip","code"]})",
      R"({"type":"array","items":{"type":"number"},"minItems":2,"maxItems":5})",
      R"({"type":"array","prefixItems":[{"type":"string","maxLength":5},{"type":"integer"},{"type":"boolean"}],"items":false,"minItems":2})",
      R"({"type":"object","additionalProperties":{"type":"integer","minimum":-5,"maximum":5}})",
      R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
          "kids":{"type":"array","maxItems":2,"items":{"$ref":"#/$defs/node"}}},"required":["v"],"additionalProperties":false}}})",
      R"({"allOf":[{"type":"object","properties":{"a":{"type":"boolean"}},"required":["a"]},{"properties":{"b":{"type":"null"}}}]})",
      R"({"oneOf":[{"type":"integer"},{"type":"string","maxLength":5}]})",
      R"({"enum":["a",1,true,null,{"k":[2]}]})",
      R"({})",
      R"({"type":"string"})",
      R"({"type":"object","properties":{"t":{"type":"integer","minimum":-500,"maximum":-3},
          "u":{"type":"number","exclusiveMinimum":-1,"exclusiveMaximum":1}},"required":["t","u"]})",
      R"({"type":"object","properties":{"action":{"type":"string","enum":["read","write","list","delete"]},
          "args":{"type":"object","properties":{"path":{"type":"string","pattern":"^/[a-z0-9_/]{1,30}$"},"recursive":{"type":"boolean"},
          "depth":{"type":"integer","minimum":0,"maximum":10}},"required":["path"],"additionalProperties":false},
          "notes":{"type":"array","items":{"type":"string","maxLength":20},"maxItems":3}},"required":["action","args"],"additionalProperties":false})",
      R"({"type":"object","properties":{"x":{"type":"string"},"y":{"type":"integer"}},"additionalProperties":true})",
      R"({"type":["boolean","null","array"],"items":{"type":["integer","string"],"maxLength":3}})",
  };
  std::vector<json> out;
  for (const char* t : texts) out.push_back(json::parse(t));
  return out;
}

TEST_CASE("json schema: random walks over the real vocabulary always give valid JSON") {
  size_t trials = 0, valid = 0, tight = 0;
  const auto schemas = PropertySchemas();
  REQUIRE(schemas.size() == 20);
  for (size_t si = 0; si < schemas.size(); ++si) {
    const json& schema = schemas[si];
    auto g = CompileJsonSchema(schema);
    INFO("schema " << si << ": " << schema.dump());
    REQUIRE(g.ok());
    const Vocab& v = TheVocab();
    const size_t min_tokens = Matcher(*g, v.index, {v.end_id}).MinTokens();
    for (uint32_t seed = 0; seed < 6; ++seed) {
      // Budgets from 64 to 300, and once exactly the minimum.
      size_t budget = 64 + (seed * 47 + si * 13) % 237;
      if (seed == 5) budget = min_tokens, ++tight;
      budget = std::max(budget, min_tokens);
      const Walk w = RandomWalk(*g, budget, seed * 1000 + static_cast<uint32_t>(si));
      ++trials;
      INFO("budget " << budget << " output " << w.text);
      REQUIRE(w.done);
      REQUIRE(w.steps <= budget);
      json parsed;
      try {
        parsed = json::parse(w.text);
      } catch (const std::exception& e) {
        FAIL("not JSON: " << e.what());
      }
      const std::string err = test::SchemaCheck(schema).Validate(parsed);
      CHECK(err == "");
      valid += err.empty();
    }
  }
  WARN("schema walks: " << valid << "/" << trials << " valid (" << tight << " at exactly MinTokens)");
  CHECK(valid == trials);
}

json ToolsJson() {
  return json::parse(R"([
    {"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{
       "city":{"type":"string"},"days":{"type":"integer","minimum":1,"maximum":14},"unit":{"type":"string","enum":["C","F"]}},
       "required":["city","days"]}}},
    {"type":"function","function":{"name":"web_search","parameters":{"type":"object","properties":{
       "query":{"type":"string","maxLength":30},
       "filters":{"type":"object","properties":{"site":{"type":"string"},"recent":{"type":"boolean"},"max_results":{"type":"integer"}},
                  "required":["site"]},
       "languages":{"type":"array","items":{"type":"string","pattern":"^[a-z]{2}$"},"maxItems":3}},
       "required":["query","filters"],"additionalProperties":false}}},
    {"type":"function","function":{"name":"plot_points","parameters":{"type":"object","properties":{
       "points":{"type":"array","minItems":1,"maxItems":3,"items":{"type":"object","properties":{"x":{"type":"number"},"y":{"type":"number"}},"required":["x","y"]}},
       "style":{"type":"object","properties":{"color":{"enum":["red","blue"]},"width":{"type":"number","minimum":0,"maximum":10}}},
       "limit":{"anyOf":[{"type":"integer","minimum":0},{"type":"null"}]},
       "label":{"type":["string","null"]},
       "when":{"type":"string","format":"date"},
       "flags":{"type":"array","prefixItems":[{"type":"boolean"},{"type":"integer"}],"items":false}},
       "required":["points","limit"]}}},
    {"type":"function","function":{"name":"no_args","parameters":{"type":"object","properties":{}}}}
  ])");
}

std::vector<ToolSpec> ToolSpecs(const json& tools) {
  std::vector<ToolSpec> out;
  for (const json& t : tools) out.push_back({t["function"]["name"], t["function"]["parameters"]});
  return out;
}

TEST_CASE("tool calls: random walks give markup the output parser reads as valid calls") {
  const Vocab& v = TheVocab();
  auto tokens = MarkupTokens::From(*v.tokenizer);
  REQUIRE(tokens.ok());
  CHECK(tokens->ns == 200058);
  const json tools = ToolsJson();
  const std::vector<ToolSpec> specs = ToolSpecs(tools);
  size_t trials = 0, valid = 0, calls = 0;
  for (bool single : {false, true}) {
    auto g = CompileToolCalls(specs, *tokens, single);
    if (!g.ok()) FAIL(g.status().message());
    const size_t min_tokens = Matcher(*g, v.index, {v.end_id}).MinTokens();
    for (uint32_t seed = 0; seed < 20; ++seed) {
      const size_t budget = seed == 0 ? min_tokens : std::max<size_t>(min_tokens, 100 + seed * 23);
      const Walk w = RandomWalk(*g, budget, seed + (single ? 100 : 0));
      ++trials;
      INFO("budget " << budget << " output " << w.text);
      REQUIRE(w.done);
      const ParsedOutput out = ParseOutput(w.text, ThinkState::kOutside, tools);
      CHECK(out.content.empty());
      REQUIRE(!out.tool_calls.empty());
      if (single) CHECK(out.tool_calls.size() == 1);
      bool ok = out.content.empty();
      for (const ToolCall& call : out.tool_calls) {
        ++calls;
        const ToolSpec* spec = nullptr;
        for (const ToolSpec& s : specs) spec = s.name == call.name ? &s : spec;
        REQUIRE(spec != nullptr);
        const std::string err = test::SchemaCheck(spec->parameters).Validate(json::parse(call.arguments.dump()));
        INFO(call.name << " " << call.arguments.dump());
        CHECK(err == "");
        ok = ok && err.empty();
      }
      valid += ok;
    }
  }
  WARN("tool-call walks: " << valid << "/" << trials << " valid, " << calls << " calls");
  CHECK(valid == trials);
}

TEST_CASE("tool calls: refusals name the tool and the keyword") {
  const Vocab& v = TheVocab();
  auto tokens = MarkupTokens::From(*v.tokenizer);
  REQUIRE(tokens.ok());
  auto err = [&](const json& params, const std::string& name = "f") {
    std::vector<ToolSpec> specs{{name, params}};
    auto g = CompileToolCalls(specs, *tokens);
    return g.ok() ? std::string("(compiled)") : g.status().message();
  };
  CHECK_THAT(err(json::parse(R"({"type":"object","properties":{"a":{"$ref":"#/$defs/x"}},"$defs":{"x":{}}})")),
             Catch::Contains("$ref") && Catch::Contains("tools/0 (f)/parameters/properties/a"));
  CHECK_THAT(err(json::parse(R"({"type":"object","properties":{"a":{"anyOf":[{"type":"string"},{"type":"integer"}]}}})")),
             Catch::Contains("anyOf"));
  CHECK_THAT(err(json::parse(R"({"type":"object","properties":{"a":{"type":"string","format":"hostname"}}})")),
             Catch::Contains("hostname"));
  CHECK_THAT(err(json::parse(R"({"type":"object","properties":{"a<b":{"type":"string"}},"required":["a<b"]})")),
             Catch::Contains("cannot be written as a markup tag"));
  CHECK_THAT(err(json::parse(R"({"type":"array"})")), Catch::Contains("must be \"object\""));
  CHECK_THAT(err(json::object(), "bad>name"), Catch::Contains("tool name"));
  CHECK_THAT(err(json::parse(R"({"type":"object","properties":{"a":{"enum":[1,2]}}})")), Catch::Contains("enum"));
  std::vector<ToolSpec> none;
  CHECK_FALSE(CompileToolCalls(none, *tokens).ok());
}

TEST_CASE("budgets: compiling any schema, grammar or tool list stays within the builder's limits") {
  const Vocab& v = TheVocab();
  // Repeated items are one rule reference per copy: the documented bounds at their largest
  // compile to a grammar linear in the counts (it was min x the item's size, 10^8 elements).
  auto big = CompileJsonSchema(json::parse(
      R"({"type":"array","minItems":1000,"items":{"type":"string","minLength":100000,"maxLength":100000}})"));
  INFO(big.status().ToString());
  REQUIRE(big.ok());
  CHECK((*big)->elements().size() < 500'000);
  // Nested, its shortest text (10^13 bytes) is refused as that, not as a grammar without one.
  auto huge = CompileJsonSchema(json::parse(
      R"({"type":"array","minItems":10000,"items":{"type":"array","minItems":10000,)"
      R"("items":{"type":"string","minLength":100000}}})"));
  REQUIRE_FALSE(huge.ok());
  CHECK_THAT(huge.status().message(), Catch::Contains("shortest text the grammar allows is over"));
  CHECK(Accepts(*CompileJsonSchema(json::parse(R"({"type":"array","minItems":3,"maxItems":4,"items":{"type":"string",)"
                                              R"("minLength":2,"maxLength":2}})")),
                R"(["ab","cd","ef"])"));
  // What does pass the limits is refused as it grows, at the schema that passed them, before a
  // copy is made.
  json wide = {{"type", "array"}, {"prefixItems", json::array()}};
  for (int i = 0; i < 40; ++i) wide["prefixItems"].push_back({{"type", "string"}, {"minLength", 100000}});
  auto too_wide = CompileJsonSchema({{"type", "object"}, {"properties", {{"list", wide}}}});
  REQUIRE_FALSE(too_wide.ok());
  CHECK_THAT(too_wide.status().message(),
             Catch::Contains("expands past 2,000,000 grammar elements") && Catch::Contains("/properties/list"));
  // The tool-call compiler is linear in minItems (it was quadratic: 800 items took 31 s).
  auto tokens = MarkupTokens::From(*v.tokenizer);
  REQUIRE(tokens.ok());
  std::vector<ToolSpec> specs{{"f", json::parse(R"({"type":"object","properties":{"a":{"type":"array",)"
                                                 R"("minItems":10000,"items":{"type":"string"}}},"required":["a"]})")}};
  auto calls = CompileToolCalls(specs, *tokens);
  REQUIRE(calls.ok());
  CHECK((*calls)->elements().size() < 100'000);
  // A grammar the matcher cannot follow from its start says so (it was reported as a reply
  // needing 1,073,741,823 tokens).
  json many = {{"enum", json::array()}};
  for (int i = 0; i < 1025; ++i) many["enum"].push_back("choice" + std::to_string(i));
  auto wide_enum = CompileJsonSchema(many);
  REQUIRE(wide_enum.ok());
  const Status start = Matcher(*wide_enum, v.index, {v.end_id}).StartStatus();
  CHECK_THAT(start.message(), Catch::Contains("more than 1,024 parse stacks"));
  CHECK(Matcher(Gbnf("root ::= \"a\" | \"b\""), v.index, {v.end_id}).StartStatus().ok());
}

TEST_CASE("budgets: a compilation stops at its time limit and when its requester stops it") {
  // Many long repetitions in one alternative grow the grammar as they are written, so the limit
  // refuses them (they were sequences held outside it: 300 x 10,000 copies, ~24 MB each time).
  std::string gbnf = "root ::=";
  for (int i = 0; i < 300; ++i) gbnf += " \"a\"{10000}";
  auto repeats = CompileGbnf(gbnf);
  REQUIRE_FALSE(repeats.ok());
  CHECK_THAT(repeats.status().message(), Catch::Contains("expands past 2,000,000 grammar elements"));
  // Under the limit, the same repetitions are one rule each and compile.
  auto fewer = CompileGbnf("root ::= \"a\"{10000} \"b\"{3}");
  REQUIRE(fewer.ok());
  CHECK(Accepts(*fewer, std::string(10000, 'a') + "bbb"));
  CHECK_FALSE(Accepts(*fewer, std::string(9999, 'a') + "bbb"));

  // A schema that takes a while to compile (a wide object of bounded strings): refused past its
  // time, by what it is, and stopped at once by its requester.
  json wide = {{"type", "object"}, {"properties", json::object()}};
  for (int i = 0; i < 400; ++i)
    wide["properties"]["p" + std::to_string(i)] = {{"type", "string"}, {"maxLength", 200}};
  auto slow = CompileJsonSchema(wide, {.seconds = 0.001, .stop = nullptr});
  REQUIRE_FALSE(slow.ok());
  CHECK(slow.status().code() == m3::StatusCode::kInvalidArgument);
  CHECK_THAT(slow.status().message(), Catch::Contains("took longer than 0.001 s"));
  // A later grammar of a request whose time is already spent names the request's limit.
  auto spent = CompileJsonSchema(wide, {.seconds = -0.5, .request_seconds = 2.0, .stop = nullptr});
  REQUIRE_FALSE(spent.ok());
  CHECK_THAT(spent.status().message(), Catch::Contains("took longer than 2 s (the limit per request)"));
  int polls = 0;
  auto stopped = CompileJsonSchema(wide, {.stop = [&] { return ++polls >= 1; }});
  REQUIRE_FALSE(stopped.ok());
  CHECK(stopped.status().code() == m3::StatusCode::kUnavailable);
  CHECK(polls == 1);
  // The same budget through GBNF and tool calls.
  auto gbnf_slow = CompileGbnf(gbnf.substr(0, 2000), {.stop = [] { return true; }});
  REQUIRE_FALSE(gbnf_slow.ok());
  CHECK_THAT(gbnf_slow.status().message(), Catch::StartsWith("GBNF: the request was stopped"));
  auto tokens = MarkupTokens::From(*TheVocab().tokenizer);
  REQUIRE(tokens.ok());
  std::vector<ToolSpec> specs{{"f", wide}};
  auto calls_slow = CompileToolCalls(specs, *tokens, false, {.seconds = 0.001, .stop = nullptr});
  REQUIRE_FALSE(calls_slow.ok());
  CHECK_THAT(calls_slow.status().message(), Catch::StartsWith("tool calls: compiling it took longer than"));
  // Within the default budget it compiles.
  CHECK(CompileJsonSchema(wide).ok());
}

// Masks against Accept on a fresh copy for every token of a sample, on states along a walk,
// unbudgeted, cached (the same state again) and with a tight budget.
size_t shared_hits = 0;

void CheckMasksAgainstBruteForce(const std::shared_ptr<const Grammar>& g, uint32_t seed, std::vector<int32_t> specials) {
  const Vocab& v = TheVocab();
  const size_t vocab = v.index->vocab_size();
  Matcher m(g, v.index, {v.end_id});
  std::mt19937 rng(seed);
  std::vector<uint64_t> mask(m.mask_words()), again(m.mask_words()), tight(m.mask_words());
  specials.push_back(v.end_id);
  size_t checked = 0;
  for (int step = 0; step < 40 && !m.done(); ++step) {
    m.FillMask(mask, 1 << 20);
    m.FillMask(again, 1 << 20);  // the cached path
    REQUIRE(mask == again);
    const std::vector<int32_t> allowed = Allowed(mask, vocab);
    REQUIRE(!allowed.empty());
    if (step % 4 == 0) {
      std::vector<int32_t> sample(specials);
      for (int b = 0; b < 256; ++b) sample.push_back(v.byte_token[b]);
      for (int i = 0; i < 1500; ++i) sample.push_back(std::uniform_int_distribution<int32_t>(0, int32_t(vocab) - 1)(rng));
      for (size_t i = 0; i < std::min<size_t>(allowed.size(), 1500); ++i) sample.push_back(allowed[rng() % allowed.size()]);
      const size_t left = m.MinTokens() + rng() % 4;
      m.FillMask(tight, left);
      for (int32_t id : sample) {
        Matcher copy = m.Clone();
        const bool ok = copy.Accept(id);
        INFO("step " << step << " token " << id << " '" << v.index->token_bytes(id) << "'");
        REQUIRE(Bit(mask, id) == ok);
        const bool fits = ok && (id == v.end_id ? true : copy.MinTokens() + 1 <= left);
        REQUIRE(Bit(tight, id) == fits);
        ++checked;
      }
    }
    REQUIRE(m.Accept(allowed[rng() % allowed.size()]));
  }
  CHECK(checked > 1000);
  shared_hits += m.stats().shared;
}

TEST_CASE("masks equal a brute-force Accept of every sampled token, cached and budgeted") {
  const Vocab& v = TheVocab();
  auto tokens = MarkupTokens::From(*v.tokenizer);
  REQUIRE(tokens.ok());
  const auto schemas = PropertySchemas();
  for (size_t i : {0, 3, 10, 17}) {
    auto g = CompileJsonSchema(schemas[i]);
    REQUIRE(g.ok());
    CheckMasksAgainstBruteForce(*g, static_cast<uint32_t>(i), {});
    // Again on the same grammar: now the masks come from the grammar's shared cache.
    CheckMasksAgainstBruteForce(*g, static_cast<uint32_t>(i), {});
  }
  const std::vector<ToolSpec> specs = ToolSpecs(ToolsJson());
  auto tc = CompileToolCalls(specs, *tokens);
  REQUIRE(tc.ok());
  CheckMasksAgainstBruteForce(*tc, 7, {tokens->ns, tokens->tool_call_open, tokens->tool_call_close});
  auto gb = CompileGbnf("root ::= (\"ab\" | [a-c]+ \" \" | \"é\"+)* \"!\" <[" + std::to_string(tokens->ns) + "]>");
  REQUIRE(gb.ok());
  CheckMasksAgainstBruteForce(*gb, 9, {tokens->ns});
  CHECK(shared_hits > 20);
}

TEST_CASE("budget: MinTokens is exact enough that a walk at exactly that budget completes") {
  const Vocab& v = TheVocab();
  auto g = CompileJsonSchema(PropertySchemas()[3]);
  REQUIRE(g.ok());
  Matcher m(*g, v.index, {v.end_id});
  const size_t min = m.MinTokens();
  // {"customer":{"id":0,"vip":true},"items":[{"qty":1,"sku":""}],"order_id":"<36>"} + the end id,
  // as single bytes at worst.
  CHECK(min > 60);
  CHECK(min < 120);
  for (uint32_t seed = 0; seed < 5; ++seed) {
    const Walk w = RandomWalk(*g, min, seed);
    CHECK(w.done);
  }
  // The mask is never empty, even for a budget below MinTokens (then it is the unbudgeted one).
  std::vector<uint64_t> mask(m.mask_words());
  m.FillMask(mask, 3);
  CHECK(!Allowed(mask, v.index->vocab_size()).empty());
  // ApplyMask: -inf where disallowed, and past the vocabulary (the model's padded rows).
  std::vector<float> logits(200064, 1.0f);
  m.ApplyMask(logits, 1000);
  size_t finite = 0;
  for (float x : logits) finite += std::isfinite(x);
  CHECK(finite == Allowed([&] { std::vector<uint64_t> k(m.mask_words()); m.FillMask(k, 1000); return k; }(), v.index->vocab_size()).size());
  CHECK(std::isinf(logits[200063]));
}

TEST_CASE("vocab index: every byte is a token, added tokens are left out") {
  const Vocab& v = TheVocab();
  for (int b = 0; b < 256; ++b) CHECK(v.byte_token[b] >= 0);
  CHECK_FALSE(v.index->is_text_token(v.end_id));
  CHECK_FALSE(v.index->is_text_token(v.tokenizer->TokenId("]<]minimax[>[")));
  CHECK(v.index->vocab_size() == v.tokenizer->vocab_size());
  const auto t0 = std::chrono::steady_clock::now();
  auto again = VocabIndex::Build(*v.tokenizer);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WARN("VocabIndex::Build: " << s << " s, " << again->trie_nodes() << " trie nodes");
  CHECK(s < 5.0);
}

}  // namespace
}  // namespace m3::constrain
