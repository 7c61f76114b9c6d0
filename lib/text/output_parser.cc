#include "text/output_parser.h"
#include "base/json_guard.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <optional>
#include <set>
#include <utility>

namespace m3 {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

constexpr std::string_view kThinkOpen = "<mm:think>";
constexpr std::string_view kThinkClose = "</mm:think>";
constexpr std::string_view kNs = "]<]minimax[>[";  // namespace token before every tool tag
constexpr std::string_view kBlockOpenTag = "<tool_call>";
constexpr std::string_view kBlockCloseTag = "</tool_call>";
constexpr std::string_view kInvokePrefix = "invoke name=\"";
// Nesting deeper than this is treated as malformed instead of risking the stack.
constexpr int kMaxDepth = 64;

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

bool IsAllSpace(std::string_view s) {
  for (char c : s) {
    if (!IsSpace(c)) return false;
  }
  return true;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { n = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 4; cp = c & 0x07; }
    else return false;
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

// Length of the tail of `s` that starts a UTF-8 sequence whose remaining bytes have not arrived.
size_t IncompleteUtf8Tail(std::string_view s) {
  const size_t lookback = std::min<size_t>(3, s.size());
  for (size_t back = 1; back <= lookback; ++back) {
    const auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t need = 0;
    if ((c & 0xE0) == 0xC0) need = 2;
    else if ((c & 0xF0) == 0xE0) need = 3;
    else if ((c & 0xF8) == 0xF0) need = 4;
    return need > back ? back : 0;
  }
  return 0;
}

// Appends `text` behind `tail` and moves everything but an incomplete trailing character to `out`.
void EmitCompleteUtf8(std::string_view text, std::string& tail, std::string& out) {
  tail.append(text);
  const size_t hold = IncompleteUtf8Tail(tail);
  out.append(tail, 0, tail.size() - hold);
  tail.erase(0, tail.size() - hold);
}

// --- Incremental marker matching -------------------------------------------------------------
// Each matcher looks at buf[i..]: kNone (no marker here, whatever follows), kPartial (buf ends
// while still matching; more bytes decide) or kFull with the marker's length.

enum class Match { kNone, kPartial, kFull };
struct MatchResult {
  Match match = Match::kNone;
  size_t length = 0;
};

MatchResult MatchLiteral(std::string_view buf, size_t i, std::string_view literal) {
  const std::string_view rest = buf.substr(i);
  if (rest.size() < literal.size()) {
    return {literal.substr(0, rest.size()) == rest ? Match::kPartial : Match::kNone, 0};
  }
  if (rest.substr(0, literal.size()) == literal) return {Match::kFull, literal.size()};
  return {};
}

// `]<]minimax[>[` + optional whitespace (SGLang tolerates it) + `tag`.
MatchResult MatchNsTag(std::string_view buf, size_t i, std::string_view tag) {
  const MatchResult ns = MatchLiteral(buf, i, kNs);
  if (ns.match != Match::kFull) return ns;
  size_t j = i + kNs.size();
  while (j < buf.size() && IsSpace(buf[j])) ++j;
  if (j == buf.size()) return {Match::kPartial, 0};
  const MatchResult t = MatchLiteral(buf, j, tag);
  if (t.match != Match::kFull) return t;
  return {Match::kFull, j + tag.size() - i};
}

// Longest proper prefix of `marker` that `s` ends with (a marker possibly cut by the chunking).
size_t PartialSuffixLength(std::string_view s, std::string_view marker) {
  for (size_t len = std::min(s.size(), marker.size() - 1); len > 0; --len) {
    if (s.substr(s.size() - len) == marker.substr(0, len)) return len;
  }
  return 0;
}

// --- JSON schema helpers -----------------------------------------------------------------------
// Schemas are read defensively: any non-object where a schema is expected means "no schema".

// `key` of the schema itself, else of its first anyOf/oneOf member that has it (so pydantic's
// Optional[...] unions still type their members).
const json* SchemaField(const json* schema, const char* key) {
  if (schema == nullptr || !schema->is_object()) return nullptr;
  if (auto it = schema->find(key); it != schema->end()) return &*it;
  for (const char* combiner : {"anyOf", "oneOf"}) {
    auto members = schema->find(combiner);
    if (members == schema->end() || !members->is_array()) continue;
    for (const json& member : *members) {
      if (!member.is_object()) continue;
      if (auto it = member.find(key); it != member.end()) return &*it;
    }
  }
  return nullptr;
}

const json* AsSchema(const json* value) {
  return value != nullptr && value->is_object() ? value : nullptr;
}

// Lower-cased `type` names (string or list), with the short aliases SGLang accepts folded in.
std::set<std::string> SchemaTypes(const json* schema) {
  std::set<std::string> types;
  auto add = [&types](const json& t) {
    if (!t.is_string()) return;
    std::string name = Lower(t.get_ref<const std::string&>());
    if (name == "str") name = "string";
    if (name == "int") name = "integer";
    if (name == "float") name = "number";
    if (name == "bool") name = "boolean";
    types.insert(std::move(name));
  };
  auto collect = [&add](const json& s) {
    if (!s.is_object()) return;
    auto it = s.find("type");
    if (it == s.end()) return;
    if (it->is_array()) {
      for (const json& t : *it) add(t);
    } else {
      add(*it);
    }
  };
  if (schema == nullptr || !schema->is_object()) return types;
  collect(*schema);
  if (types.empty()) {
    for (const char* combiner : {"anyOf", "oneOf"}) {
      auto members = schema->find(combiner);
      if (members == schema->end() || !members->is_array()) continue;
      for (const json& member : *members) collect(member);
    }
  }
  return types;
}

// Schema of `<item>` number `index`: prefixItems[index], then items.
const json* ItemSchema(const json* array_schema, size_t index) {
  const json* prefix = SchemaField(array_schema, "prefixItems");
  if (prefix != nullptr && prefix->is_array() && index < prefix->size()) {
    return AsSchema(&(*prefix)[index]);
  }
  return AsSchema(SchemaField(array_schema, "items"));
}

// Schema of key `key`: properties[key], then additionalProperties when it is a schema.
const json* PropertySchema(const json* object_schema, const std::string& key) {
  const json* properties = SchemaField(object_schema, "properties");
  if (properties != nullptr && properties->is_object()) {
    if (auto it = properties->find(key); it != properties->end()) return AsSchema(&*it);
  }
  return AsSchema(SchemaField(object_schema, "additionalProperties"));
}

// `parameters` of the named tool in an OpenAI tools array, or null.
const json* FindToolSchema(const json& tools, const std::string& name) {
  if (!tools.is_array()) return nullptr;
  for (const json& tool : tools) {
    if (!tool.is_object()) continue;
    const json* function = &tool;
    if (auto it = tool.find("function"); it != tool.end() && it->is_object()) function = &*it;
    auto name_it = function->find("name");
    if (name_it == function->end() || !name_it->is_string() || *name_it != name) continue;
    auto params = function->find("parameters");
    return params != function->end() && params->is_object() ? &*params : nullptr;
  }
  return nullptr;
}

// --- Leaf typing (SGLang minimax_m3 rules, docs/MODEL.md §6.4) -------------------------------------

// Python int(): optional sign, decimal digits, surrounding whitespace.
std::optional<ordered_json> ParseInteger(std::string_view text) {
  std::string_view s = Trim(text);
  bool negative = false;
  if (!s.empty() && (s.front() == '+' || s.front() == '-')) {
    negative = s.front() == '-';
    s.remove_prefix(1);
  }
  if (s.empty()) return std::nullopt;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  uint64_t magnitude = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), magnitude);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;  // beyond 64 bits
  if (!negative) {
    if (magnitude <= static_cast<uint64_t>(INT64_MAX)) return ordered_json(static_cast<int64_t>(magnitude));
    return ordered_json(magnitude);
  }
  if (magnitude <= static_cast<uint64_t>(INT64_MAX)) return ordered_json(-static_cast<int64_t>(magnitude));
  if (magnitude == static_cast<uint64_t>(INT64_MAX) + 1) return ordered_json(INT64_MIN);
  return std::nullopt;
}

// Python float() on decimal spellings; integral values come back as integers (`2.0` -> 2).
// inf/nan have no JSON form and stay strings.
std::optional<ordered_json> ParseNumber(std::string_view text) {
  const std::string_view s = Trim(text);
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t digits = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i, ++digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i, ++digits;
  }
  if (digits == 0) return std::nullopt;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    size_t exp_digits = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i, ++exp_digits;
    if (exp_digits == 0) return std::nullopt;
  }
  if (i != s.size()) return std::nullopt;
  const std::string_view unsigned_part = s.front() == '+' ? s.substr(1) : s;  // from_chars: no '+'
  double value = 0;
  auto [end, ec] = std::from_chars(unsigned_part.data(), unsigned_part.data() + unsigned_part.size(), value);
  if (ec != std::errc() || end != unsigned_part.data() + unsigned_part.size() || !std::isfinite(value)) {
    return std::nullopt;
  }
  if (value == std::floor(value) && std::fabs(value) < 9.2e18) {
    return ordered_json(static_cast<int64_t>(value));
  }
  return ordered_json(value);
}

std::optional<ordered_json> ParseBoolean(std::string_view text) {
  const std::string v = Lower(Trim(text));
  if (v == "true" || v == "1" || v == "yes" || v == "on") return ordered_json(true);
  if (v == "false" || v == "0" || v == "no" || v == "off") return ordered_json(false);
  return std::nullopt;
}

// Typed value of an element holding only text.
ordered_json LeafValue(std::string_view text, const json* schema) {
  const std::set<std::string> types = SchemaTypes(schema);
  const bool is_string = types.count("string") > 0;
  const bool null_allowed = types.count("null") > 0;
  const bool is_array = types.count("array") > 0;
  const bool is_object = types.count("object") > 0;
  // `{}` and `[]` are written as empty elements.
  if ((is_array || is_object) && (text.empty() || (!is_string && IsAllSpace(text)))) {
    return is_array ? ordered_json::array() : ordered_json::object();
  }
  if (is_string && !null_allowed) return std::string(text);
  if (null_allowed && (text.empty() || text == "null" || text == "Null" || text == "NULL")) return nullptr;
  if (types.count("integer")) {
    if (auto v = ParseInteger(text)) return *v;
  }
  if (types.count("number")) {
    if (auto v = ParseNumber(text)) return *v;
  }
  if (types.count("boolean")) {
    if (auto v = ParseBoolean(text)) return *v;
  }
  // A container written as JSON text instead of nested elements (the M2 habit).
  if (is_array || is_object) {
    // (Nested no deeper than any JSON the engine takes: else kept as the text it is.)
    const StatusOr<ordered_json> parsed = ParseJson<ordered_json>(Trim(text), "a tool argument");
    if (parsed.ok() && ((is_array && parsed->is_array()) || (is_object && parsed->is_object()))) return *parsed;
  }
  return std::string(text);  // no schema, or the text did not parse: keep it as written
}

// --- Tool block grammar ------------------------------------------------------------------------

// Parses the text between `<tool_call>` and `</tool_call>`; nullopt when it is not well formed.
class ToolBlockParser {
 public:
  ToolBlockParser(std::string_view body, const json& tools) : body_(body), tools_(tools) {}

  std::optional<std::vector<ToolCall>> Parse() {
    std::vector<ToolCall> calls;
    while (true) {
      SkipSpace();
      if (pos_ == body_.size()) break;
      ToolCall call;
      if (!ParseInvoke(call)) return std::nullopt;
      calls.push_back(std::move(call));
    }
    if (calls.empty()) return std::nullopt;  // the grammar needs at least one invoke
    return calls;
  }

 private:
  struct Tag {
    bool closing = false;
    std::string name;
    size_t end = 0;  // offset just past '>'
  };

  void SkipSpace() {
    while (pos_ < body_.size() && IsSpace(body_[pos_])) ++pos_;
  }

  // `]<]minimax[>[` [whitespace] `<` [`/`] name `>` at `pos`.
  std::optional<Tag> ReadTag(size_t pos) const {
    if (body_.substr(pos, kNs.size()) != kNs) return std::nullopt;
    pos += kNs.size();
    while (pos < body_.size() && IsSpace(body_[pos])) ++pos;
    if (pos >= body_.size() || body_[pos] != '<') return std::nullopt;
    ++pos;
    Tag tag;
    if (pos < body_.size() && body_[pos] == '/') {
      tag.closing = true;
      ++pos;
    }
    const size_t gt = body_.find('>', pos);
    if (gt == std::string_view::npos) return std::nullopt;
    const std::string_view name = Trim(body_.substr(pos, gt - pos));
    if (name.empty() || name.find('<') != std::string_view::npos) return std::nullopt;
    tag.name = std::string(name);
    tag.end = gt + 1;
    return tag;
  }

  bool ParseInvoke(ToolCall& call) {
    const std::optional<Tag> tag = ReadTag(pos_);
    if (!tag || tag->closing) return false;
    const std::string_view head = tag->name;
    if (head.substr(0, kInvokePrefix.size()) != kInvokePrefix || head.size() < kInvokePrefix.size() + 2 ||
        head.back() != '"') {
      return false;
    }
    call.name = std::string(head.substr(kInvokePrefix.size(), head.size() - kInvokePrefix.size() - 1));
    pos_ = tag->end;
    call.arguments = ordered_json::object();
    return ParseChildren("invoke", FindToolSchema(tools_, call.name), call.arguments, 0);
  }

  // Child elements up to `</parent_name>`, added to `container` (an object or an array).
  bool ParseChildren(const std::string& parent_name, const json* schema, ordered_json& container, int depth) {
    while (true) {
      SkipSpace();
      const std::optional<Tag> tag = ReadTag(pos_);
      if (!tag) return false;
      pos_ = tag->end;
      if (tag->closing) return tag->name == parent_name;
      const json* child_schema = container.is_array() && tag->name == "item"
                                     ? ItemSchema(schema, container.size())
                                     : PropertySchema(schema, tag->name);
      ordered_json value;
      if (!ParseElement(tag->name, child_schema, value, depth + 1)) return false;
      AddChild(container, tag->name, std::move(value));
    }
  }

  // Body of `<name>` (its open tag already consumed) through its closing tag.
  bool ParseElement(const std::string& name, const json* schema, ordered_json& value, int depth) {
    if (depth > kMaxDepth) return false;
    const size_t next_ns = body_.find(kNs, pos_);
    if (next_ns == std::string_view::npos) return false;
    const std::optional<Tag> next = ReadTag(next_ns);
    if (!next) return false;
    const std::string_view text = body_.substr(pos_, next_ns - pos_);
    if (next->closing) {
      if (next->name != name) return false;
      value = LeafValue(text, schema);
      pos_ = next->end;
      return true;
    }
    if (!IsAllSpace(text)) return false;  // text mixed with child elements
    value = NewContainer(schema, next->name);
    pos_ = next_ns;
    return ParseChildren(name, schema, value, depth);
  }

  // The schema decides array vs object; without one, `<item>` children mean an array.
  static ordered_json NewContainer(const json* schema, const std::string& first_child) {
    const std::set<std::string> types = SchemaTypes(schema);
    const bool is_array = types.count("array") > 0;
    const bool is_object = types.count("object") > 0;
    if (is_array != is_object) return is_array ? ordered_json::array() : ordered_json::object();
    return first_child == "item" ? ordered_json::array() : ordered_json::object();
  }

  // Arrays append; a key repeated within one object collects its values into a list (SGLang).
  static void AddChild(ordered_json& container, const std::string& key, ordered_json value) {
    if (container.is_array()) {
      container.push_back(std::move(value));
      return;
    }
    auto it = container.find(key);
    if (it == container.end()) {
      container[key] = std::move(value);
    } else if (it->is_array()) {
      it->push_back(std::move(value));
    } else {
      ordered_json list = ordered_json::array();
      list.push_back(std::move(*it));
      list.push_back(std::move(value));
      *it = std::move(list);
    }
  }

  std::string_view body_;
  const json& tools_;
  size_t pos_ = 0;
};

void AppendDelta(StreamingOutputParser::Delta& delta, ParsedOutput& out) {
  out.reasoning += delta.reasoning;
  out.content += delta.content;
  for (ToolCall& call : delta.tool_calls) out.tool_calls.push_back(std::move(call));
}

void SerializeTo(const ordered_json& value, std::string& out) {
  constexpr auto kReplace = ordered_json::error_handler_t::replace;
  if (value.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      out += ordered_json(it.key()).dump(-1, ' ', false, kReplace);
      out += ": ";
      SerializeTo(it.value(), out);
    }
    out += '}';
  } else if (value.is_array()) {
    out += '[';
    for (size_t i = 0; i < value.size(); ++i) {
      if (i > 0) out += ", ";
      SerializeTo(value[i], out);
    }
    out += ']';
  } else {
    out += value.dump(-1, ' ', false, kReplace);
  }
}

}  // namespace

std::string SerializeArguments(const ordered_json& arguments) {
  std::string out;
  SerializeTo(arguments, out);
  return out;
}

ParsedOutput ParseOutput(std::string_view text, ThinkState initial, const json& tools, std::string_view id_prefix) {
  // One code path for both entry points, so streamed and whole-text results cannot drift apart.
  StreamingOutputParser parser(initial, tools, std::string(id_prefix));
  ParsedOutput out;
  StreamingOutputParser::Delta delta = parser.Push(text);
  AppendDelta(delta, out);
  delta = parser.Finish();
  AppendDelta(delta, out);
  return out;
}

StreamingOutputParser::StreamingOutputParser(ThinkState initial, json tools, std::string id_prefix)
    : tools_(std::move(tools)),
      id_prefix_(std::move(id_prefix)),
      mode_(initial == ThinkState::kInside ? Mode::kReasoning : Mode::kStart),
      think_reopen_allowed_(initial == ThinkState::kOutside) {}

StreamingOutputParser::Delta StreamingOutputParser::Push(std::string_view text_piece) {
  Delta out;
  if (finished_) return out;
  pending_.append(text_piece);
  Process(/*final=*/false, out);
  return out;
}

StreamingOutputParser::Delta StreamingOutputParser::Finish() {
  Delta out;
  if (finished_) return out;
  Process(/*final=*/true, out);
  out.reasoning += reasoning_utf8_tail_;
  out.content += content_utf8_tail_;
  reasoning_utf8_tail_.clear();
  content_utf8_tail_.clear();
  finished_ = true;
  return out;
}

// Runs the state machine until it needs more input. `final` means no more input will come, so
// nothing is held back. Every decision depends only on the text seen so far and is deferred while
// the tail could still become a marker; that is what makes the result independent of chunking.
void StreamingOutputParser::Process(bool final, Delta& out) {
  bool progressed = true;
  while (progressed) {
    switch (mode_) {
      case Mode::kStart: progressed = StepStart(final); break;
      case Mode::kReasoning: progressed = StepReasoning(final, out); break;
      case Mode::kContent: progressed = StepContent(final, out); break;
      case Mode::kToolBlock: progressed = StepToolBlock(final, out); break;
    }
  }
}

// Spec 3 rule 2: only the very first bytes may be a dropped `</mm:think>` or an opening `<mm:think>`.
bool StreamingOutputParser::StepStart(bool final) {
  if (pending_.empty()) return false;
  for (std::string_view marker : {kThinkClose, kThinkOpen}) {
    const MatchResult m = MatchLiteral(pending_, 0, marker);
    if (m.match == Match::kFull) {
      pending_.erase(0, m.length);
      mode_ = marker == kThinkOpen ? Mode::kReasoning : Mode::kContent;
      if (marker == kThinkOpen) think_reopen_allowed_ = false;
      return true;
    }
    if (m.match == Match::kPartial && !final) return false;
  }
  mode_ = Mode::kContent;
  return true;
}

// Spec 3 rule 3: everything up to `</mm:think>` is reasoning; a nested `<mm:think>` is just text.
bool StreamingOutputParser::StepReasoning(bool final, Delta& out) {
  const size_t close = pending_.find(kThinkClose);
  if (close != std::string::npos) {
    EmitReasoning(std::string_view(pending_).substr(0, close), out);
    pending_.erase(0, close + kThinkClose.size());
    mode_ = Mode::kContent;
    return true;
  }
  const size_t keep = final ? 0 : PartialSuffixLength(pending_, kThinkClose);
  EmitReasoning(std::string_view(pending_).substr(0, pending_.size() - keep), out);
  pending_.erase(0, pending_.size() - keep);
  return false;
}

// Content until a tool block opener or (while allowed) a reasoning opener.
bool StreamingOutputParser::StepContent(bool final, Delta& out) {
  size_t i = pending_.find_first_of("<]");
  while (i != std::string::npos) {
    MatchResult think;
    if (think_reopen_allowed_) think = MatchLiteral(pending_, i, kThinkOpen);
    const MatchResult block = MatchNsTag(pending_, i, kBlockOpenTag);
    if (think.match == Match::kFull || block.match == Match::kFull) {
      EmitContent(std::string_view(pending_).substr(0, i), out);
      if (think.match == Match::kFull) {
        pending_.erase(0, i + think.length);
        mode_ = Mode::kReasoning;
        think_reopen_allowed_ = false;
      } else {
        block_ = pending_.substr(i, block.length);
        block_opener_size_ = block.length;
        block_scan_from_ = block.length;
        pending_.erase(0, i + block.length);
        mode_ = Mode::kToolBlock;
      }
      return true;
    }
    if (!final && (think.match == Match::kPartial || block.match == Match::kPartial)) {
      EmitContent(std::string_view(pending_).substr(0, i), out);
      pending_.erase(0, i);
      return false;
    }
    i = pending_.find_first_of("<]", i + 1);
  }
  EmitContent(pending_, out);
  pending_.clear();
  return false;
}

// Holds the block until its closer; an unterminated block is content at the end.
bool StreamingOutputParser::StepToolBlock(bool final, Delta& out) {
  block_ += pending_;
  pending_.clear();
  size_t i = block_.find(']', block_scan_from_);
  while (i != std::string::npos) {
    const MatchResult close = MatchNsTag(block_, i, kBlockCloseTag);
    if (close.match == Match::kFull) {
      CloseToolBlock(i + close.length, out);
      return true;
    }
    if (close.match == Match::kPartial && !final) {
      block_scan_from_ = i;
      return false;
    }
    i = block_.find(']', i + 1);
  }
  block_scan_from_ = block_.size();
  if (final) {
    EmitContent(block_, out);
    block_.clear();
    mode_ = Mode::kContent;
  }
  return false;
}

// `block_end`: offset in block_ just past the closer. Text after it goes back to content.
void StreamingOutputParser::CloseToolBlock(size_t block_end, Delta& out) {
  const std::string_view raw = std::string_view(block_).substr(0, block_end);
  const size_t closer_start = raw.rfind(kNs);
  const std::string_view body = raw.substr(block_opener_size_, closer_start - block_opener_size_);
  std::optional<std::vector<ToolCall>> calls;
  // Arguments must serialize as JSON, so a block with invalid UTF-8 is not accepted as calls.
  if (IsValidUtf8(body)) calls = ToolBlockParser(body, tools_).Parse();
  if (calls) {
    for (ToolCall& call : *calls) {
      call.id = id_prefix_ + std::to_string(next_call_index_++);
      out.tool_calls.push_back(std::move(call));
    }
  } else {
    EmitContent(raw, out);
  }
  pending_ = block_.substr(block_end);
  block_.clear();
  mode_ = Mode::kContent;
}

void StreamingOutputParser::EmitReasoning(std::string_view text, Delta& out) {
  EmitCompleteUtf8(text, reasoning_utf8_tail_, out.reasoning);
}

void StreamingOutputParser::EmitContent(std::string_view text, Delta& out) {
  EmitCompleteUtf8(text, content_utf8_tail_, out.content);
}

}  // namespace m3
