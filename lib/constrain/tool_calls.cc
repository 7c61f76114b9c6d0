// M3's tool-call markup (spec/CHAT_FORMAT.md §4) -> Grammar:
//   block  ::= <ns> <tool_call> "\n" invoke+ <ns> </tool_call>
//   invoke ::= <ns> "<invoke name=\"" NAME "\">" param* <ns> "</invoke>\n"
//   param  ::= <ns> "<" KEY ">" value <ns> "</" KEY ">"
// with each value written so that lib/text/output_parser reads it back, by the tool's schema, as
// a value valid against that schema:
//   - strings raw, never holding "]<" (so never the marker's text); with a pattern, format or
//     length bound, never a "]" at all;
//   - integers/numbers/booleans as text (no exponents past 2 digits), null as an empty element;
//   - objects as one element per key (required keys always, optional ones maybe, in key order;
//     extra keys never), arrays as <item> elements (prefixItems, items, minItems/maxItems);
//   - enum/const values only where the parser's reading of their text gives the value back
//     (checked at compile time with the parser itself).
// The parser does not follow $ref or merge allOf, and types anyOf members by their union, so
// here $ref and allOf are refused and anyOf/oneOf only as [X, {"type": "null"}] (Optional[X]).
#include <algorithm>
#include <optional>
#include <set>

#include "constrain/constrain.h"
#include "constrain/grammar.h"
#include "constrain/schema_parts.h"
#include "text/output_parser.h"

namespace m3::constrain {
namespace {

using nlohmann::json;

constexpr std::string_view kNsText = "]<]minimax[>[";

std::set<std::string> TypeSet(const json& s, const std::string& path) {
  std::set<std::string> out;
  auto it = s.find("type");
  if (it == s.end()) return out;
  auto add = [&](const json& t) {
    if (!t.is_string()) Refuse(JsonPathJoin(path, "type"), "must be a type name or a list of them");
    static const std::set<std::string> known = {"string", "integer", "number", "boolean", "null", "object", "array"};
    if (!known.count(t.get<std::string>())) Refuse(JsonPathJoin(path, "type"), "unknown type \"" + t.get<std::string>() + "\"");
    out.insert(t.get<std::string>());
  };
  if (it->is_array()) {
    for (const json& t : *it) add(t);
  } else {
    add(*it);
  }
  return out;
}

class MarkupCompiler {
 public:
  MarkupCompiler(GrammarBuilder& b, const MarkupTokens& t) : b_(b), t_(t) {}

  // <ns> "<" key ">" value <ns> "</" key ">"
  Seq Element(const std::string& key, const json& schema, const std::string& path, int depth) {
    Seq s{GrammarBuilder::Token(t_.ns)};
    Seq open = b_.Literal("<" + key + ">");
    s.insert(s.end(), open.begin(), open.end());
    Seq v = Value(schema, path, depth + 1);
    s.insert(s.end(), v.begin(), v.end());
    s.push_back(GrammarBuilder::Token(t_.ns));
    Seq close = b_.Literal("</" + key + ">");
    s.insert(s.end(), close.begin(), close.end());
    return s;
  }

  static void CheckKey(const std::string& key, const std::string& path) {
    const bool bad = key.empty() || key.find_first_of("<>") != std::string::npos || key[0] == '/' ||
                     key.front() == ' ' || key.back() == ' ' || key.find_first_of("\t\r\n") != std::string::npos;
    if (bad) Refuse(path, "key \"" + key + "\" cannot be written as a markup tag");
  }

  // The members of an object schema as elements (the body of <invoke> or of an object element).
  Seq ObjectBody(const json& s, const std::string& path, int depth) {
    const ObjectKeys keys = ReadObjectKeys(s, path);
    const json& props = *keys.properties;
    const std::set<std::string>& required = keys.required;
    const std::set<std::string>& names = keys.names;
    const json* extra = nullptr;
    if (auto it = s.find("additionalProperties"); it != s.end()) {
      if (it->is_object()) extra = &*it;
      else if (!it->is_boolean()) Refuse(JsonPathJoin(path, "additionalProperties"), "must be a boolean or a schema");
    }
    Seq out;
    const json untyped = json::object();
    for (const std::string& key : names) {
      const std::string kpath = JsonPathJoin(JsonPathJoin(path, "properties"), key);
      const json* sub = props.contains(key) ? &props[key] : nullptr;
      if (sub == nullptr) {
        if (s.contains("additionalProperties") && s["additionalProperties"] == false) {
          Refuse(JsonPathJoin(path, "required"), "\"" + key + "\" is required but additionalProperties is false");
        }
        sub = extra != nullptr ? extra : &untyped;
      }
      const bool req = required.count(key) > 0;
      if (!req) {
        // An optional key that cannot be written as a tag is left out, not refused.
        try {
          CheckKey(key, kpath);
        } catch (const SchemaError&) {
          continue;
        }
      }
      CheckKey(key, kpath);
      Seq e = Element(key, *sub, kpath, depth);
      if (!req) e = b_.Opt(e);
      out.insert(out.end(), e.begin(), e.end());
    }
    return out;
  }

  Seq ArrayBody(const json& s, const std::string& path, int depth) {
    std::vector<const json*> prefix;
    const json untyped = json::object();
    const json* items = &untyped;
    bool items_allowed = true;
    if (auto it = s.find("prefixItems"); it != s.end()) {
      if (!it->is_array()) Refuse(JsonPathJoin(path, "prefixItems"), "must be an array of schemas");
      for (const json& p : *it) prefix.push_back(&p);
    }
    if (auto it = s.find("items"); it != s.end()) {
      if (it->is_array()) Refuse(JsonPathJoin(path, "items"), "an items array is not read by the output parser (use prefixItems)");
      if (it->is_boolean() && !it->get<bool>()) items_allowed = false;
      else if (it->is_object()) items = &*it;
    }
    auto count = [&](const char* key, int64_t fallback) -> int64_t {
      auto it = s.find(key);
      if (it == s.end()) return fallback;
      if (!it->is_number() || it->get<double>() < 0 || it->get<double>() > double(kMaxItemsBound)) {
        Refuse(JsonPathJoin(path, key), "must be an integer from 0 to " + std::to_string(kMaxItemsBound));
      }
      return static_cast<int64_t>(it->get<double>());
    };
    const int64_t min = count("minItems", 0);
    int64_t max = count("maxItems", -1);
    const auto p = static_cast<int64_t>(prefix.size());
    if (!items_allowed) max = max < 0 ? p : std::min(max, p);
    if (max >= 0 && min > max) Refuse(path, "minItems exceeds the items the schema allows");
    // The items past the prefix are one schema: compiled once, one rule reference per position.
    std::optional<Seq> item;
    auto element = [&](int64_t i) -> Seq {
      if (i < p)
        return Element("item", *prefix[i], JsonPathJoin(JsonPathJoin(path, "prefixItems"), std::to_string(i)), depth);
      if (!item) item = b_.Unit(Element("item", *items, JsonPathJoin(path, "items"), depth), "item");
      return *item;
    };
    // Elements 0..fixed-1 (each required below min), then optional ones up to max or a loop; the
    // optional ones nest (opt(e opt(e ...))), the required ones are a plain sequence.
    const int64_t fixed = std::max(p, min);
    Seq tail;
    if (max < 0) {
      tail = b_.Star(element(fixed));
    } else {
      for (int64_t i = max; i-- > fixed;) {
        Seq e = element(i);
        e.insert(e.end(), tail.begin(), tail.end());
        tail = b_.Opt(e);
      }
    }
    for (int64_t i = fixed; i-- > min;) {  // prefix items past minItems
      Seq e = element(i);
      e.insert(e.end(), tail.begin(), tail.end());
      tail = b_.Opt(e);
    }
    Seq out;
    for (int64_t i = 0; i < min; ++i) {
      const Seq e = element(i);
      b_.Charge(out.size() + e.size());  // the sequence is added whole by the caller
      out.insert(out.end(), e.begin(), e.end());
    }
    out.insert(out.end(), tail.begin(), tail.end());
    return out;
  }

  // The markup of the values `s` admits; past the builder's limits, refused at the innermost
  // schema whose grammar passed them.
  Seq Value(const json& s, const std::string& path, int depth) {
    return RefusedPastLimits(path, [&] { return ValueOf(s, path, depth); });
  }

  Seq ValueOf(const json& s_in, const std::string& path, int depth) {
    if (depth > kMaxSchemaDepth) Refuse(path, "schema nested deeper than " + std::to_string(kMaxSchemaDepth));
    if (s_in.is_boolean()) {
      if (!s_in.get<bool>()) Refuse(path, "the schema false admits no value");
      return StringContent(b_, json::object(), TextEncoding::kMarkup, path);  // untyped: a string
    }
    if (!s_in.is_object()) Refuse(path, "a schema must be an object or a boolean");
    for (const char* k : {"$ref", "allOf"}) {
      if (s_in.contains(k)) {
        Refuse(JsonPathJoin(path, k), std::string("\"") + k +
                                          "\" in tool parameters is not supported (the output parser does not follow it)");
      }
    }
    for (auto& [k, v] : s_in.items()) {
      static const std::set<std::string> ok = {
          "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf", "oneOf", "items",
          "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
          "exclusiveMinimum", "exclusiveMaximum", "title", "description", "default", "examples", "$schema", "$id",
          "$comment", "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict"};
      if (!ok.count(k) && !(k == "uniqueItems" && v == false)) {
        Refuse(JsonPathJoin(path, k), "keyword \"" + k + "\" is not supported");
      }
    }
    const json* s = &s_in;
    std::set<std::string> types = TypeSet(*s, path);
    bool optional = false;  // anyOf [X, null]
    for (const char* combiner : {"anyOf", "oneOf"}) {
      auto it = s_in.find(combiner);
      if (it == s_in.end()) continue;
      const std::string cpath = JsonPathJoin(path, combiner);
      const bool shape = it->is_array() && it->size() == 2 && s_in.size() - Annotations(s_in) == 1;
      int null_at = -1;
      if (shape) {
        for (int i = 0; i < 2; ++i) {
          const json& m = (*it)[i];
          if (m.is_object() && m.contains("type") && m["type"] == "null") null_at = i;
        }
      }
      if (null_at < 0) {
        Refuse(cpath, std::string(combiner) + " in tool parameters is supported only as [X, {\"type\": \"null\"}]");
      }
      s = &(*it)[1 - null_at];
      if (!s->is_object() || !s->contains("type")) {
        Refuse(JsonPathJoin(cpath, std::to_string(1 - null_at)), "the non-null member needs a \"type\" (the output parser types by it)");
      }
      if (s->contains("anyOf") || s->contains("oneOf") || s->contains("$ref") || s->contains("allOf")) {
        Refuse(JsonPathJoin(cpath, std::to_string(1 - null_at)), "nested combinators in tool parameters are not supported");
      }
      types = TypeSet(*s, path);
      types.insert("null");
      optional = true;
    }
    (void)optional;
    const bool is_string = types.count("string") > 0, null_ok = types.count("null") > 0;
    const bool is_array = types.count("array") > 0, is_object = types.count("object") > 0;
    if (s->contains("enum") || s->contains("const")) return Enum(*s, s_in, path);
    if (is_array || is_object) {
      if (is_array && is_object) Refuse(path, "a value that is an array or an object is not supported in tool parameters");
      for (const std::string& t : types) {
        if (t != "array" && t != "object" && t != "null") {
          Refuse(JsonPathJoin(path, "type"), "a container mixed with scalar types is not supported in tool parameters");
        }
      }
      return is_array ? ArrayBody(*s, path, depth) : ObjectBody(*s, path, depth);
    }
    if (types.empty() || (is_string && !null_ok)) return StringContent(b_, *s, TextEncoding::kMarkup, path);
    std::vector<Seq> alts;
    if (null_ok) alts.push_back({});
    if (is_string) alts.push_back(StringContent(b_, *s, TextEncoding::kMarkup, path));
    if (types.count("number")) {
      alts.push_back(NumberText(b_, *s, path));
    } else if (types.count("integer")) {
      alts.push_back(IntegerText(b_, *s, path));
    }
    if (types.count("boolean")) alts.push_back(b_.Alt({b_.Literal("true"), b_.Literal("false")}, "boolean"));
    return b_.Alt(std::move(alts), "markup-value");
  }

  static size_t Annotations(const json& s) {
    static const std::set<std::string> k = {"title", "description", "default", "examples", "$comment", "deprecated"};
    size_t n = 0;
    for (auto& [key, unused] : s.items()) n += k.count(key);
    return n;
  }

  // enum/const values whose markup text the output parser reads back as the same value.
  Seq Enum(const json& s, const json& parser_schema, const std::string& path) {
    std::vector<json> values;
    if (auto it = s.find("const"); it != s.end()) values.push_back(*it);
    if (auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) Refuse(JsonPathJoin(path, "enum"), "must be a non-empty array");
      values.insert(values.end(), it->begin(), it->end());
    }
    const std::set<std::string> types = TypeSet(s, path);
    std::vector<Seq> alts;
    for (const json& v : values) {
      if (!types.empty()) {
        bool match = false;
        for (const std::string& t : types) {
          match = match || (t == "string" && v.is_string()) || (t == "integer" && v.is_number_integer()) ||
                  (t == "number" && v.is_number()) || (t == "boolean" && v.is_boolean()) || (t == "null" && v.is_null());
        }
        if (!match) continue;
      }
      std::string text;
      if (v.is_string()) text = v.get<std::string>();
      else if (v.is_null()) text = "";
      else if (v.is_number() || v.is_boolean()) text = v.dump();
      else continue;  // containers in enums: not written as markup here
      if (RoundTrips(text, parser_schema, v)) alts.push_back(b_.Literal(text));
    }
    if (alts.empty()) {
      Refuse(path, "no enum/const value can be written as markup that the output parser reads back as that value");
    }
    return b_.Alt(std::move(alts), "enum");
  }

  static bool RoundTrips(const std::string& text, const json& schema, const json& value) {
    if (text.find(kNsText) != std::string::npos) return false;
    const std::string ns(kNsText);
    const std::string markup = ns + "<tool_call>\n" + ns + "<invoke name=\"f\">" + ns + "<k>" + text + ns + "</k>" + ns +
                               "</invoke>\n" + ns + "</tool_call>";
    const json tools = json::array({{{"name", "f"}, {"parameters", {{"type", "object"}, {"properties", {{"k", schema}}}}}}});
    const ParsedOutput out = ParseOutput(markup, ThinkState::kOutside, tools);
    if (out.tool_calls.size() != 1 || !out.tool_calls[0].arguments.contains("k")) return false;
    return json::parse(out.tool_calls[0].arguments["k"].dump()) == value;
  }

 private:
  GrammarBuilder& b_;
  const MarkupTokens& t_;
};

}  // namespace

StatusOr<MarkupTokens> MarkupTokens::From(const Tokenizer& tokenizer) {
  MarkupTokens t;
  const std::pair<int32_t*, const char*> wanted[] = {
      {&t.ns, "]<]minimax[>["}, {&t.tool_call_open, "<tool_call>"}, {&t.tool_call_close, "</tool_call>"}};
  for (auto [field, name] : wanted) {
    *field = tokenizer.TokenId(name);
    if (*field < 0) return NotFound("tool-call markup: the tokenizer has no token \"", name, "\"");
  }
  return t;
}

StatusOr<std::shared_ptr<const Grammar>> CompileToolCalls(std::span<const ToolSpec> tools, const MarkupTokens& t,
                                                          bool single_call, const CompileBudget& budget) {
  if (tools.empty()) return InvalidArgument("tool calls: no tools given");
  if (t.ns < 0 || t.tool_call_open < 0 || t.tool_call_close < 0) return InvalidArgument("tool calls: markup token ids missing");
  try {
    GrammarBuilder b(budget);
    MarkupCompiler c(b, t);
    std::vector<Seq> invokes;
    std::set<std::string> seen;
    for (size_t i = 0; i < tools.size(); ++i) {
      const ToolSpec& tool = tools[i];
      const std::string path = "tools/" + std::to_string(i) + " (" + tool.name + ")";
      if (tool.name.empty() || tool.name.find_first_of("<>\"\n") != std::string::npos ||
          tool.name.find(kNsText) != std::string::npos) {
        Refuse(path, "the tool name cannot be written in <invoke name=\"...\">");
      }
      if (!seen.insert(tool.name).second) Refuse(path, "two tools named \"" + tool.name + "\"");
      Seq inv{GrammarBuilder::Token(t.ns)};
      Seq head = b.Literal("<invoke name=\"" + tool.name + "\">");
      inv.insert(inv.end(), head.begin(), head.end());
      const json& p = tool.parameters;
      if (!p.is_null()) {
        if (!p.is_object()) Refuse(path + "/parameters", "must be a JSON schema object");
        if (p.contains("type") && p["type"] != "object") Refuse(path + "/parameters/type", "must be \"object\"");
        for (const char* k : {"anyOf", "oneOf", "allOf", "$ref", "enum", "const"}) {
          if (p.contains(k)) Refuse(path + "/parameters/" + k, "is not supported at the top of tool parameters");
        }
        json checked = p;
        checked["type"] = "object";
        Seq body = c.ObjectBody(checked, path + "/parameters", 0);
        // Keywords at the top level are checked the same way as nested ones.
        for (auto& [k, unused] : p.items()) {
          static const std::set<std::string> ok = {"type", "properties", "required", "additionalProperties", "title",
                                                   "description", "$schema", "$defs", "definitions", "$comment", "strict"};
          if (!ok.count(k)) Refuse(path + "/parameters/" + k, "keyword \"" + k + "\" is not supported");
        }
        inv.insert(inv.end(), body.begin(), body.end());
      }
      inv.push_back(GrammarBuilder::Token(t.ns));
      Seq close = b.Literal("</invoke>\n");
      inv.insert(inv.end(), close.begin(), close.end());
      invokes.push_back(std::move(inv));
    }
    const Seq invoke = b.Alt(std::move(invokes), "invoke");
    const uint32_t root = b.NewRule("root");
    Seq block{GrammarBuilder::Token(t.ns), GrammarBuilder::Token(t.tool_call_open), b.Byte('\n')};
    Seq calls = single_call ? invoke : b.Plus(invoke);
    block.insert(block.end(), calls.begin(), calls.end());
    block.push_back(GrammarBuilder::Token(t.ns));
    block.push_back(GrammarBuilder::Token(t.tool_call_close));
    b.AddAlt(root, block);
    return b.Finish(root, "tool calls");
  } catch (const SchemaError& e) {
    return Status(e.status.code(), "tool calls: " + e.status.message());
  } catch (const GrammarTooLarge& e) {
    return InvalidArgument("tool calls: the tools expand past ", e.what);
  } catch (const CompileInterrupted& e) {
    return Status(e.status.code(), "tool calls: " + e.status.message());
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument("tool calls: ", e.what());
  }
}

}  // namespace m3::constrain
