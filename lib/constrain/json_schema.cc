// JSON schema -> Grammar of compact JSON text (no optional whitespace).
//
// Supported: type (a name or a list), properties, required, additionalProperties (false, true or
// a schema; absent: no extra keys are generated, as in OpenAI's strict mode), enum, const, anyOf,
// oneOf (as anyOf: exclusivity is not enforced), allOf of object schemas (merged), items,
// prefixItems, minItems/maxItems, $ref to #, #/$defs/... or #/definitions/... (recursion allowed:
// the matcher's depth bound limits it), string minLength/maxLength/pattern/format, integer and
// number minimum/maximum/exclusiveMinimum/exclusiveMaximum (numbers: integral bounds only),
// boolean, null. Annotations (title, description, default, examples, ...) are ignored. Anything
// else is refused with its JSON path. Generated values are a subset of the valid ones: integers
// up to 15 digits, numbers up to 15 + 15 digits, extra keys from [A-Za-z0-9_-].
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "constrain/constrain.h"
#include "constrain/grammar.h"
#include "constrain/schema_parts.h"

namespace m3::constrain {
namespace {

using nlohmann::json;

const std::set<std::string>& Annotations() {
  static const std::set<std::string> k = {"title",       "description", "default",          "examples",
                                          "$schema",     "$id",         "$comment",         "deprecated",
                                          "readOnly",    "writeOnly",   "$defs",            "definitions",
                                          "contentMediaType", "contentEncoding", "strict"};
  return k;
}
const std::set<std::string>& Handled() {
  static const std::set<std::string> k = {
      "type",      "properties", "required",  "additionalProperties", "enum",      "const",
      "anyOf",     "oneOf",      "allOf",     "items",                "prefixItems", "minItems",
      "maxItems",  "$ref",       "minLength", "maxLength",            "pattern",   "format",
      "minimum",   "maximum",    "exclusiveMinimum", "exclusiveMaximum", "uniqueItems", "multipleOf",
      "minProperties", "maxProperties"};
  return k;
}

bool MatchesType(const json& v, const std::string& t) {
  if (t == "string") return v.is_string();
  if (t == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()));
  if (t == "number") return v.is_number();
  if (t == "boolean") return v.is_boolean();
  if (t == "null") return v.is_null();
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  return false;
}

class SchemaCompiler {
 public:
  SchemaCompiler(GrammarBuilder& b, const json& root) : b_(b), root_(root) {}

  // The grammar of the values `s` admits; past the builder's limits, refused at the innermost
  // schema whose grammar passed them.
  Seq Value(const json& s, const std::string& path, int depth) {
    return RefusedPastLimits(path, [&] { return ValueOf(s, path, depth); });
  }

 private:
  Seq ValueOf(const json& s, const std::string& path, int depth) {
    if (depth > kMaxSchemaDepth) Refuse(path, "schema nested deeper than " + std::to_string(kMaxSchemaDepth));
    if (s.is_boolean()) {
      if (s.get<bool>()) return Any();
      Refuse(path, "the schema false admits no value");
    }
    if (!s.is_object()) Refuse(path, "a schema must be an object or a boolean");
    CheckKeywords(s, path);
    if (auto it = s.find("$ref"); it != s.end()) {
      for (auto& [k, unused] : s.items()) {
        if (k != "$ref" && !Annotations().count(k)) Refuse(JsonPathJoin(path, k), "keyword beside $ref is not supported");
      }
      if (!it->is_string()) Refuse(JsonPathJoin(path, "$ref"), "must be a string");
      return {GrammarBuilder::Ref(RefRule(it->get<std::string>(), JsonPathJoin(path, "$ref"), depth))};
    }
    if (auto it = s.find("allOf"); it != s.end()) return Value(MergeAllOf(s, path, depth), path, depth + 1);
    for (const char* combiner : {"anyOf", "oneOf"}) {
      auto it = s.find(combiner);
      if (it == s.end()) continue;
      const std::string cpath = JsonPathJoin(path, combiner);
      if (!it->is_array() || it->empty()) Refuse(cpath, "must be a non-empty array");
      for (auto& [k, unused] : s.items()) {
        if (k != combiner && !Annotations().count(k)) {
          Refuse(JsonPathJoin(path, k), std::string("keyword beside ") + combiner + " is not supported");
        }
      }
      std::vector<Seq> alts;
      for (size_t i = 0; i < it->size(); ++i) alts.push_back(Value((*it)[i], JsonPathJoin(cpath, std::to_string(i)), depth + 1));
      return b_.Alt(std::move(alts), combiner);
    }
    const std::vector<std::string> types = Types(s, path);
    if (auto it = s.find("const"); it != s.end()) return Literal({*it}, types, JsonPathJoin(path, "const"));
    if (auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) Refuse(JsonPathJoin(path, "enum"), "must be a non-empty array");
      return Literal(std::vector<json>(it->begin(), it->end()), types, JsonPathJoin(path, "enum"));
    }
    if (types.empty()) return Any();
    std::vector<Seq> alts;
    for (const std::string& t : types) alts.push_back(Typed(s, t, path, depth));
    return b_.Alt(std::move(alts), "types");
  }

  void CheckKeywords(const json& s, const std::string& path) {
    for (auto& [k, v] : s.items()) {
      if (Annotations().count(k)) continue;
      if (!Handled().count(k)) Refuse(JsonPathJoin(path, k), "keyword \"" + k + "\" is not supported");
      if (k == "uniqueItems" && !(v.is_boolean() && !v.get<bool>())) {
        Refuse(JsonPathJoin(path, k), "keyword \"uniqueItems\" is not supported");
      }
      if (k == "multipleOf" && !(v.is_number() && v.get<double>() == 1.0 && Types(s, path) == std::vector<std::string>{"integer"})) {
        Refuse(JsonPathJoin(path, k), "keyword \"multipleOf\" is not supported (except 1 on integers)");
      }
      if (k == "minProperties" && !(v.is_number() && v.get<double>() <= 0)) {
        Refuse(JsonPathJoin(path, k), "keyword \"minProperties\" is not supported");
      }
      if (k == "maxProperties") Refuse(JsonPathJoin(path, k), "keyword \"maxProperties\" is not supported");
    }
  }

  // Declared types, or the one the keywords imply; empty: any value.
  std::vector<std::string> Types(const json& s, const std::string& path) {
    std::vector<std::string> types;
    if (auto it = s.find("type"); it != s.end()) {
      auto add = [&](const json& t) {
        if (!t.is_string()) Refuse(JsonPathJoin(path, "type"), "must be a type name or a list of them");
        const std::string& name = t.get_ref<const std::string&>();
        static const std::set<std::string> known = {"string", "integer", "number", "boolean", "null", "object", "array"};
        if (!known.count(name)) Refuse(JsonPathJoin(path, "type"), "unknown type \"" + name + "\"");
        if (std::find(types.begin(), types.end(), name) == types.end()) types.push_back(name);
      };
      if (it->is_array()) {
        for (const json& t : *it) add(t);
        if (types.empty()) Refuse(JsonPathJoin(path, "type"), "an empty type list admits no value");
      } else {
        add(*it);
      }
      // "integer" is within "number": generating both would only duplicate.
      if (std::count(types.begin(), types.end(), "number") && std::count(types.begin(), types.end(), "integer")) {
        types.erase(std::find(types.begin(), types.end(), "integer"));
      }
      return types;
    }
    if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) return {"object"};
    if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems")) return {"array"};
    if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern") || s.contains("format")) return {"string"};
    if (s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") || s.contains("exclusiveMaximum")) {
      return {"number"};
    }
    return {};
  }

  Seq Literal(const std::vector<json>& values, const std::vector<std::string>& types, const std::string& path) {
    std::vector<Seq> alts;
    for (const json& v : values) {
      bool ok = types.empty();
      for (const std::string& t : types) ok = ok || MatchesType(v, t);
      if (!ok) continue;
      alts.push_back(b_.Literal(v.dump(-1, ' ', false, json::error_handler_t::replace)));
    }
    if (alts.empty()) Refuse(path, "no listed value matches the schema's type");
    return b_.Alt(std::move(alts), "enum");
  }

  Seq Typed(const json& s, const std::string& t, const std::string& path, int depth) {
    if (t == "string") {
      Seq out{b_.Byte('"')};
      Seq content = StringContent(b_, s, TextEncoding::kJson, path);
      out.insert(out.end(), content.begin(), content.end());
      out.push_back(b_.Byte('"'));
      return out;
    }
    if (t == "integer") return IntegerText(b_, s, path);
    if (t == "number") return NumberText(b_, s, path);
    if (t == "boolean") return b_.Alt({b_.Literal("true"), b_.Literal("false")}, "boolean");
    if (t == "null") return b_.Literal("null");
    if (t == "object") return Object(s, path, depth);
    return Array(s, path, depth);
  }

  Seq Object(const json& s, const std::string& path, int depth) {
    const ObjectKeys keys = ReadObjectKeys(s, path);
    const json& props = *keys.properties;
    const std::set<std::string>& required = keys.required;
    const std::set<std::string>& names = keys.names;
    const json* extra = nullptr;  // schema of extra keys; null: none generated
    json true_schema = true;
    if (auto it = s.find("additionalProperties"); it != s.end()) {
      if (it->is_boolean()) {
        if (it->get<bool>()) extra = &true_schema;
      } else if (it->is_object()) {
        extra = &*it;
      } else {
        Refuse(JsonPathJoin(path, "additionalProperties"), "must be a boolean or a schema");
      }
    }
    struct Prop {
      std::string key;
      Seq kv;
      bool required;
    };
    std::vector<Prop> list;
    for (const std::string& key : names) {
      const std::string ppath = JsonPathJoin(JsonPathJoin(path, "properties"), key);
      const json* sub = props.contains(key) ? &props[key] : nullptr;
      if (sub == nullptr) {
        if (s.contains("additionalProperties") && s["additionalProperties"].is_boolean() &&
            !s["additionalProperties"].get<bool>()) {
          Refuse(JsonPathJoin(path, "required"), "\"" + key + "\" is required but additionalProperties is false");
        }
        sub = extra != nullptr ? extra : &true_schema;
      }
      Seq kv = b_.Literal(json(key).dump(-1, ' ', false, json::error_handler_t::replace) + ":");
      Seq value = Value(*sub, ppath, depth + 1);
      kv.insert(kv.end(), value.begin(), value.end());
      list.push_back({key, std::move(kv), required.count(key) > 0});
    }
    Seq extra_kv;
    if (extra != nullptr) {
      extra_kv = {b_.Byte('"')};
      Seq k = KeyNotIn(names);
      extra_kv.insert(extra_kv.end(), k.begin(), k.end());
      Seq tail = b_.Literal("\":");
      extra_kv.insert(extra_kv.end(), tail.begin(), tail.end());
      Seq v = Value(*extra, JsonPathJoin(path, "additionalProperties"), depth + 1);
      extra_kv.insert(extra_kv.end(), v.begin(), v.end());
    }
    // head[i]: nothing written yet, properties i.. to go; tail[i]: something written (commas).
    const size_t n = list.size();
    std::vector<uint32_t> head(n + 1), tail(n + 1);
    for (size_t i = 0; i <= n; ++i) head[i] = b_.NewRule("obj-head"), tail[i] = b_.NewRule("obj-tail");
    if (extra != nullptr) {
      Seq comma_kv{b_.Byte(',')};
      comma_kv.insert(comma_kv.end(), extra_kv.begin(), extra_kv.end());
      b_.AddAlt(tail[n], b_.Star(comma_kv));
      Seq first = extra_kv;
      Seq rest = b_.Star(comma_kv);
      first.insert(first.end(), rest.begin(), rest.end());
      b_.AddAlt(head[n], first);
      b_.AddAlt(head[n], {});
    } else {
      b_.AddAlt(tail[n], {});
      b_.AddAlt(head[n], {});
    }
    for (size_t i = n; i-- > 0;) {
      Seq with_comma{b_.Byte(',')};
      with_comma.insert(with_comma.end(), list[i].kv.begin(), list[i].kv.end());
      with_comma.push_back(GrammarBuilder::Ref(tail[i + 1]));
      b_.AddAlt(tail[i], with_comma);
      Seq first = list[i].kv;
      first.push_back(GrammarBuilder::Ref(tail[i + 1]));
      b_.AddAlt(head[i], first);
      if (!list[i].required) {
        b_.AddAlt(tail[i], {GrammarBuilder::Ref(tail[i + 1])});
        b_.AddAlt(head[i], {GrammarBuilder::Ref(head[i + 1])});
      }
    }
    return {b_.Byte('{'), GrammarBuilder::Ref(head[0]), b_.Byte('}')};
  }

  // Key characters [A-Za-z0-9_-]+ spelling none of `taken` (a complement of their trie).
  Seq KeyNotIn(const std::set<std::string>& taken) {
    const CodepointRanges alphabet{{'-', '-'}, {'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
    const Seq any = b_.CharClass(alphabet);
    const Seq free = b_.Star(any);
    auto in_alphabet = [](char c) {
      return c == '-' || c == '_' || (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
    };
    // Only keys spelled in the alphabet can collide.
    std::set<std::string> keys;
    for (const std::string& k : taken) {
      if (!k.empty() && std::all_of(k.begin(), k.end(), in_alphabet)) keys.insert(k);
    }
    // rule(prefix): the rest of a key that starts with `prefix` and is not in `keys`.
    std::function<Seq(const std::string&)> rest = [&](const std::string& prefix) -> Seq {
      std::set<char> next;
      bool is_key = keys.count(prefix) > 0;
      for (const std::string& k : keys) {
        if (k.size() > prefix.size() && k.compare(0, prefix.size(), prefix) == 0) next.insert(k[prefix.size()]);
      }
      if (next.empty() && !is_key) return free;
      const uint32_t r = b_.NewRule("key");
      if (!is_key && !prefix.empty()) b_.AddAlt(r, {});
      CodepointRanges others = alphabet;
      CodepointRanges taken_chars;
      for (char c : next) taken_chars.emplace_back(uint8_t(c), uint8_t(c));
      CodepointRanges rem;
      for (auto [a, z] : others) {
        uint32_t from = a;
        for (uint32_t c = a; c <= z + 1; ++c) {
          const bool hit = c <= z && next.count(static_cast<char>(c));
          if (c == z + 1 || hit) {
            if (from < c) rem.emplace_back(from, c - 1);
            from = c + 1;
          }
        }
      }
      if (!rem.empty()) {
        Seq s = b_.CharClass(rem);
        s.insert(s.end(), free.begin(), free.end());
        b_.AddAlt(r, s);
      }
      for (char c : next) {
        Seq s{b_.Byte(static_cast<uint8_t>(c))};
        Seq sub = rest(prefix + c);
        s.insert(s.end(), sub.begin(), sub.end());
        b_.AddAlt(r, s);
      }
      return {GrammarBuilder::Ref(r)};
    };
    if (keys.empty()) return b_.Plus(any);
    return rest("");
  }

  Seq Array(const json& s, const std::string& path, int depth) {
    std::vector<Seq> prefix;
    Seq items;
    bool items_allowed = true;
    if (auto it = s.find("prefixItems"); it != s.end()) {
      if (!it->is_array()) Refuse(JsonPathJoin(path, "prefixItems"), "must be an array of schemas");
      for (size_t i = 0; i < it->size(); ++i) {
        prefix.push_back(Value((*it)[i], JsonPathJoin(JsonPathJoin(path, "prefixItems"), std::to_string(i)), depth + 1));
      }
    }
    if (auto it = s.find("items"); it != s.end()) {
      if (it->is_array()) {  // draft 4 tuple: the prefix, nothing after it generated
        if (!prefix.empty()) Refuse(JsonPathJoin(path, "items"), "an items array beside prefixItems");
        for (size_t i = 0; i < it->size(); ++i) {
          prefix.push_back(Value((*it)[i], JsonPathJoin(JsonPathJoin(path, "items"), std::to_string(i)), depth + 1));
        }
        items_allowed = false;
      } else if (it->is_boolean() && !it->get<bool>()) {
        items_allowed = false;
      } else {
        items = Value(*it, JsonPathJoin(path, "items"), depth + 1);
      }
    } else {
      items = Any();
    }
    items = b_.Unit(std::move(items), "item");  // copied once per position below
    auto count = [&](const char* key, int64_t fallback) -> int64_t {
      auto it = s.find(key);
      if (it == s.end()) return fallback;
      if (!it->is_number() || it->get<double>() < 0 || it->get<double>() != std::floor(it->get<double>())) {
        Refuse(JsonPathJoin(path, key), "must be a non-negative integer");
      }
      if (it->get<double>() > double(kMaxItemsBound)) {
        Refuse(JsonPathJoin(path, key), "above " + std::to_string(kMaxItemsBound) + " is not supported");
      }
      return static_cast<int64_t>(it->get<double>());
    };
    const int64_t min = count("minItems", 0);
    int64_t max = count("maxItems", -1);
    const auto p = static_cast<int64_t>(prefix.size());
    if (!items_allowed) max = max < 0 ? p : std::min(max, p);
    if (max >= 0 && min > max) Refuse(path, "minItems exceeds the items the schema allows");
    auto element = [&](int64_t i) -> const Seq& { return i < p ? prefix[i] : items; };
    // after[i]: i elements written.
    const int64_t fixed = std::max(p, min);
    const int64_t last = max < 0 ? fixed : max;
    std::vector<uint32_t> after(last + 1);
    for (int64_t i = 1; i <= last; ++i) after[i] = b_.NewRule("arr");
    for (int64_t i = last; i >= 1; --i) {
      if (i >= min) b_.AddAlt(after[i], {});
      if (max < 0 && i == last) {
        Seq comma{b_.Byte(',')};
        comma.insert(comma.end(), items.begin(), items.end());
        Seq loop = b_.Star(comma);
        if (i < min) Refuse(path, "internal: array bounds");
        b_.AddAlt(after[i], loop);
        continue;
      }
      if (i < last) {
        Seq s2{b_.Byte(',')};
        const Seq& e = element(i);
        s2.insert(s2.end(), e.begin(), e.end());
        s2.push_back(GrammarBuilder::Ref(after[i + 1]));
        b_.AddAlt(after[i], s2);
      }
    }
    Seq out{b_.Byte('[')};
    std::vector<Seq> body;
    if (min == 0) body.push_back({});
    if (last >= 1) {
      Seq first = element(0);
      first.push_back(GrammarBuilder::Ref(after[1]));
      body.push_back(first);
    } else if (max < 0) {
      // No fixed part and unbounded: value ("," value)*.
      Seq first = items;
      Seq comma{b_.Byte(',')};
      comma.insert(comma.end(), items.begin(), items.end());
      Seq loop = b_.Star(comma);
      first.insert(first.end(), loop.begin(), loop.end());
      body.push_back(first);
    }
    Seq bodies = b_.Alt(std::move(body), "arr-body");
    out.insert(out.end(), bodies.begin(), bodies.end());
    out.push_back(b_.Byte(']'));
    return out;
  }

  // allOf members (following $ref) merged into one object schema.
  json MergeAllOf(const json& s, const std::string& path, int depth) {
    json merged = json::object();
    std::vector<std::pair<const json*, std::string>> parts;
    json rest = s;
    rest.erase("allOf");
    parts.push_back({&rest, path});
    const json& all = s["allOf"];
    if (!all.is_array() || all.empty()) Refuse(JsonPathJoin(path, "allOf"), "must be a non-empty array");
    for (size_t i = 0; i < all.size(); ++i) parts.push_back({&all[i], JsonPathJoin(JsonPathJoin(path, "allOf"), std::to_string(i))});
    if (all.size() == 1 && rest.size() == 0) return all[0];
    bool closed = false;            // some part has additionalProperties false
    std::set<std::string> allowed;  // then: the keys every such part lists
    for (auto [part, ppath] : parts) {
      const json* p = part;
      for (int hops = 0; p->is_object() && p->contains("$ref"); ++hops) {
        if (hops > kMaxSchemaDepth || !(*p)["$ref"].is_string()) Refuse(ppath, "$ref chain too long");
        p = &Resolve((*p)["$ref"].get<std::string>(), ppath);
      }
      if (!p->is_object()) Refuse(ppath, "allOf members must be object schemas");
      for (auto& [k, v] : p->items()) {
        if (Annotations().count(k)) continue;
        if (k == "type") {
          if (v != "object") Refuse(JsonPathJoin(ppath, k), "allOf is supported for object schemas only");
          merged["type"] = "object";
        } else if (k == "properties") {
          if (!v.is_object()) Refuse(JsonPathJoin(ppath, k), "must be an object");
          for (auto& [name, sub] : v.items()) {
            if (merged["properties"].contains(name)) Refuse(JsonPathJoin(ppath, k), "property \"" + name + "\" in two allOf members");
            merged["properties"][name] = sub;
          }
        } else if (k == "required") {
          if (!v.is_array()) Refuse(JsonPathJoin(ppath, k), "must be an array");
          for (const json& r : v) merged["required"].push_back(r);
        } else if (k == "additionalProperties") {
          if (!(v.is_boolean() && !v.get<bool>())) Refuse(JsonPathJoin(ppath, k), "allOf members may only set additionalProperties false");
          // This part admits only its own properties: the merge keeps their intersection.
          std::set<std::string> own;
          if (p->contains("properties") && (*p)["properties"].is_object()) {
            for (auto& [name, unused] : (*p)["properties"].items()) own.insert(name);
          }
          if (!closed) {
            allowed = own;
          } else {
            std::set<std::string> both;
            for (const std::string& n : allowed) {
              if (own.count(n)) both.insert(n);
            }
            allowed = both;
          }
          closed = true;
        } else {
          Refuse(JsonPathJoin(ppath, k), "keyword \"" + k + "\" in allOf is not supported (object members only)");
        }
      }
    }
    merged["type"] = "object";
    if (closed) {
      merged["additionalProperties"] = false;
      if (merged.contains("properties")) {
        json kept = json::object();
        for (auto& [name, sub] : merged["properties"].items()) {
          if (allowed.count(name)) kept[name] = sub;
        }
        merged["properties"] = kept;
      }
      for (const json& r : merged.value("required", json::array())) {
        if (!allowed.count(r.get<std::string>())) {
          Refuse(JsonPathJoin(path, "allOf"), "\"" + r.get<std::string>() +
                                                  "\" is required but a part with additionalProperties false does not list it");
        }
      }
    }
    (void)depth;
    return merged;
  }

  const json& Resolve(const std::string& ref, const std::string& path) {
    if (ref == "#") return root_;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string pre = prefix;
      if (ref.compare(0, pre.size(), pre) != 0) continue;
      std::string name = ref.substr(pre.size());
      std::string decoded;
      for (size_t i = 0; i < name.size(); ++i) {
        if (name[i] == '~' && i + 1 < name.size() && (name[i + 1] == '0' || name[i + 1] == '1')) {
          decoded += name[i + 1] == '0' ? '~' : '/';
          ++i;
        } else {
          decoded += name[i];
        }
      }
      const std::string container = pre.substr(2, pre.size() - 3);
      if (root_.is_object() && root_.contains(container) && root_[container].is_object() &&
          root_[container].contains(decoded)) {
        return root_[container][decoded];
      }
      Refuse(path, "\"" + ref + "\" does not resolve");
    }
    Refuse(path, "\"" + ref + "\": only #, #/$defs/... and #/definitions/... references are supported");
  }

  uint32_t RefRule(const std::string& ref, const std::string& path, int depth) {
    auto it = refs_.find(ref);
    if (it != refs_.end()) return it->second;
    const json& target = Resolve(ref, path);
    const uint32_t r = b_.NewRule("ref");
    refs_[ref] = r;
    b_.AddAlt(r, Value(target, ref.substr(1), depth + 1));
    return r;
  }

  Seq Any() {
    if (any_.empty()) any_ = AnyJsonValue(b_);
    return any_;
  }

  GrammarBuilder& b_;
  const json& root_;
  std::map<std::string, uint32_t> refs_;
  Seq any_;
};

}  // namespace

StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(const nlohmann::json& schema, const CompileBudget& budget) {
  try {
    GrammarBuilder b(budget);
    SchemaCompiler c(b, schema);
    const uint32_t root = b.NewRule("root");
    b.AddAlt(root, c.Value(schema, "", 0));
    return b.Finish(root, "JSON schema");
  } catch (const SchemaError& e) {
    return Status(e.status.code(), "JSON schema " + e.status.message());
  } catch (const GrammarTooLarge& e) {
    return InvalidArgument("JSON schema: the schema expands past ", e.what);
  } catch (const CompileInterrupted& e) {
    return Status(e.status.code(), "JSON schema: " + e.status.message());
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument("JSON schema: ", e.what());
  }
}

std::shared_ptr<const Grammar> AnyJsonObject() {
  // Immutable once made; shared by every request that asks for json_object.
  static const std::shared_ptr<const Grammar> g = [] {
    GrammarBuilder b;
    const uint32_t root = b.NewRule("root");
    const Seq value = AnyJsonValue(b);
    Seq object{b.Byte('{')};
    const uint32_t after = b.NewRule("object-rest");
    // object-rest ::= "}" | member ("," member)* "}" where member is "string":value
    Seq member = AnyJsonString(b);
    member.push_back(b.Byte(':'));
    member.insert(member.end(), value.begin(), value.end());
    Seq more{b.Byte(',')};
    more.insert(more.end(), member.begin(), member.end());
    Seq members = member;
    Seq loop = b.Star(more);
    members.insert(members.end(), loop.begin(), loop.end());
    members.push_back(b.Byte('}'));
    b.AddAlt(after, {b.Byte('}')});
    b.AddAlt(after, members);
    object.push_back(GrammarBuilder::Ref(after));
    b.AddAlt(root, object);
    auto r = b.Finish(root, "json_object");
    return r.ok() ? *r : nullptr;
  }();
  return g;
}

}  // namespace m3::constrain
