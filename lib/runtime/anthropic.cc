#include "runtime/anthropic.h"

#include <algorithm>
#include <cctype>
#include <initializer_list>
#include <limits>
#include <map>
#include <set>

namespace m3::anthropic {
namespace {

std::string Joined(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "\n\n" : "") + parts[i];
  return out;
}

bool Present(const ojson& obj, const char* key) { return obj.contains(key) && !obj[key].is_null(); }

// Refuses the keys of `obj` (at `where`) that are not in `allowed`. Nested objects let an unknown
// key pass when it is null or empty: clients send a reply's blocks back as they came (a text
// block's "citations": null); the top level (`strict`) refuses every unknown key.
Status CheckKeys(const ojson& obj, const std::string& where, std::initializer_list<const char*> allowed,
                 bool strict = false) {
  for (const auto& item : obj.items()) {
    const std::string& key = item.key();
    const ojson& value = item.value();
    if (std::any_of(allowed.begin(), allowed.end(), [&](const char* k) { return key == k; })) continue;
    if (!strict && (value.is_null() || (value.is_array() && value.empty()))) continue;
    return InvalidArgument("\"", where.empty() ? key : where + "." + key, "\" is not supported by this server");
  }
  return Status::Ok();
}

// cache_control marks where Anthropic may cache a prefix; this server keeps the longest cached
// prefix of every conversation anyway, so the mark asks for nothing more.
Status CheckCacheControl(const ojson& obj, const std::string& where) {
  if (!Present(obj, "cache_control")) return Status::Ok();
  const ojson& c = obj["cache_control"];
  const std::string at = where.empty() ? "cache_control" : where + ".cache_control";
  if (!c.is_object() || c.value("type", std::string()) != "ephemeral")
    return InvalidArgument("\"", at, "\" must be {\"type\": \"ephemeral\"}");
  M3_RETURN_IF_ERROR(CheckKeys(c, at, {"type", "ttl"}));
  if (Present(c, "ttl") && c["ttl"] != "5m" && c["ttl"] != "1h")
    return InvalidArgument("\"", at, ".ttl\" must be \"5m\" or \"1h\"");
  return Status::Ok();
}

StatusOr<std::string> ReadString(const ojson& obj, const char* key, const std::string& where, bool required = true) {
  if (!Present(obj, key)) {
    if (required) return InvalidArgument("\"", where, ".", key, "\" is required");
    return std::string();
  }
  if (!obj[key].is_string()) return InvalidArgument("\"", where, ".", key, "\" must be a string");
  return obj[key].get<std::string>();
}

// An integer field in lo..hi, or absent (null: unchanged).
template <typename T>
Status ReadInteger(const ojson& obj, const char* key, const std::string& name, int64_t lo, int64_t hi, T* out) {
  if (!Present(obj, key)) return Status::Ok();
  const ojson& v = obj[key];
  if (!v.is_number_integer()) return InvalidArgument("\"", name, "\" must be an integer");
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(hi) &&
                                                     (lo <= 0 || v.get<uint64_t>() >= static_cast<uint64_t>(lo))
                                               : v.get<int64_t>() <= hi && v.get<int64_t>() >= lo;
  if (!in_range) return InvalidArgument("\"", name, "\" must be ", lo, "..", hi, ", got ", v.dump());
  *out = static_cast<T>(v.get<int64_t>());
  return Status::Ok();
}

Status ReadFloat(const ojson& body, const char* key, float* out) {
  if (!Present(body, key)) return Status::Ok();
  if (!body[key].is_number()) return InvalidArgument("\"", key, "\" must be a number");
  *out = body[key].get<float>();
  return Status::Ok();
}

Status CheckTextBlock(const ojson& block, const std::string& where) {
  M3_RETURN_IF_ERROR(CheckKeys(block, where, {"type", "text", "cache_control", "citations"}));
  if (!block.contains("text") || !block["text"].is_string())
    return InvalidArgument("\"", where, ".text\" must be a string");
  if (Present(block, "citations"))
    return InvalidArgument("\"", where, ".citations\" are not supported (this server reads no documents)");
  return CheckCacheControl(block, where);
}

// The "type" of a content block (an object with a string "type").
StatusOr<std::string> BlockType(const ojson& block, const std::string& where) {
  if (!block.is_object() || !block.contains("type") || !block["type"].is_string())
    return InvalidArgument("\"", where, "\" must be an object with a \"type\"");
  return block["type"].get<std::string>();
}

// The refusal of a block type the endpoint does not take, by name; `place` says where it stands.
Status RefuseBlock(const std::string& type, const std::string& where, const char* place) {
  if (type == "image" || type == "document" || type == "search_result" || type == "container_upload")
    return InvalidArgument("\"", where, ".type\" '", type, "' is not supported: this server runs a text-only model");
  if (type == "redacted_thinking")
    return InvalidArgument("\"", where,
                           ".type\" 'redacted_thinking' is not supported: its reasoning is encrypted "
                           "by another provider's model and cannot be read here (leave the block out)");
  if (type.find("tool_result") != std::string::npos || type == "server_tool_use" || type == "mcp_tool_use")
    return InvalidArgument("\"", where, ".type\" '", type,
                           "' is not supported: this server runs no server tools (custom tools only)");
  return InvalidArgument("\"", where, ".type\" '", type, "' is not supported in ", place);
}

// A string, or an array of text blocks: their text joined (system prompts, tool results).
StatusOr<std::string> TextContent(const ojson& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return InvalidArgument("\"", where, "\" must be a string or an array of text blocks");
  std::vector<std::string> parts;
  for (size_t j = 0; j < content.size(); ++j) {
    const ojson& block = content[j];
    const std::string at = Str(where, "[", j, "]");
    M3_ASSIGN_OR_RETURN(const std::string type, BlockType(block, at));
    if (type != "text") return RefuseBlock(type, at, "text content (text blocks only)");
    M3_RETURN_IF_ERROR(CheckTextBlock(block, at));
    parts.push_back(block["text"].get<std::string>());
  }
  return Joined(parts);
}

// Anthropic's rule for tool names; they also stand inside the model's call markup.
bool ValidToolName(const std::string& name) {
  return !name.empty() && name.size() <= 128 &&
         std::all_of(name.begin(), name.end(), [](unsigned char c) { return std::isalnum(c) || c == '_' || c == '-'; });
}

// tools: custom tools in OpenAI's form {"type": "function", "function": {"name", "description"?,
// "parameters", "strict"?}}; server tools (a dated "type") refused by name.
StatusOr<ojson> ConvertTools(const ojson& tools) {
  if (!tools.is_array()) return InvalidArgument("\"tools\" must be an array");
  ojson out = ojson::array();
  std::set<std::string> names;
  for (size_t k = 0; k < tools.size(); ++k) {
    const ojson& t = tools[k];
    const std::string at = Str("tools[", k, "]");
    if (!t.is_object()) return InvalidArgument("\"", at, "\" must be an object");
    if (Present(t, "type") && t["type"] != "custom")
      return InvalidArgument("\"", at, ".type\" ", t["type"].dump(),
                             " is not supported: this server runs no server tools (custom tools only)");
    M3_RETURN_IF_ERROR(CheckKeys(t, at,
                                 {"type", "name", "description", "input_schema", "cache_control", "strict",
                                  "eager_input_streaming", "allowed_callers", "defer_loading"}));
    M3_ASSIGN_OR_RETURN(const std::string name, ReadString(t, "name", at));
    if (!ValidToolName(name))
      return InvalidArgument("\"", at, ".name\" must be 1 to 128 letters, digits, '_' or '-', got '", name, "'");
    if (!names.insert(name).second) return InvalidArgument("\"", at, ".name\": another tool is named '", name, "'");
    if (Present(t, "description") && !t["description"].is_string())
      return InvalidArgument("\"", at, ".description\" must be a string");
    if (!Present(t, "input_schema") || !t["input_schema"].is_object() ||
        t["input_schema"].value("type", "") != "object")
      return InvalidArgument("\"", at, ".input_schema\" must be a JSON schema object with \"type\": \"object\"");
    if (Present(t, "strict") && !t["strict"].is_boolean())
      return InvalidArgument("\"", at, ".strict\" must be true or false");
    if (Present(t, "eager_input_streaming") && !t["eager_input_streaming"].is_boolean())
      return InvalidArgument("\"", at, ".eager_input_streaming\" must be true or false");
    if (Present(t, "defer_loading") && t["defer_loading"] != false)
      return InvalidArgument("\"", at, ".defer_loading\" is not supported: tool search is a server tool");
    if (Present(t, "allowed_callers") && t["allowed_callers"] != ojson::array({"direct"}))
      return InvalidArgument("\"", at,
                             ".allowed_callers\" other than [\"direct\"] is not supported (no code execution)");
    M3_RETURN_IF_ERROR(CheckCacheControl(t, at));
    ojson fn = {{"name", name}};
    if (Present(t, "description")) fn["description"] = t["description"];
    fn["parameters"] = t["input_schema"];
    if (t.value("strict", false)) fn["strict"] = true;
    out.push_back({{"type", "function"}, {"function", std::move(fn)}});
  }
  return out;
}

// tool_choice into the request's tool choice and parallel tool calls.
Status ConvertToolChoice(const ojson& choice, Request* r) {
  if (!choice.is_object() || !choice.contains("type") || !choice["type"].is_string())
    return InvalidArgument("\"tool_choice\" must be an object with a \"type\": auto, any, tool or none");
  const std::string type = choice["type"].get<std::string>();
  if (type == "none") {
    M3_RETURN_IF_ERROR(CheckKeys(choice, "tool_choice", {"type"}));
    r->tools = nullptr;  // as the OpenAI parser does: the model is not offered the tools, so it answers freely
    return Status::Ok();
  }
  if (type != "auto" && type != "any" && type != "tool")
    return InvalidArgument("\"tool_choice.type\" '", type, "' is not one of auto, any, tool, none");
  M3_RETURN_IF_ERROR(CheckKeys(choice, "tool_choice", {"type", "name", "disable_parallel_tool_use"}));
  if (Present(choice, "disable_parallel_tool_use")) {
    if (!choice["disable_parallel_tool_use"].is_boolean())
      return InvalidArgument("\"tool_choice.disable_parallel_tool_use\" must be true or false");
    r->output.parallel_tool_calls = !choice["disable_parallel_tool_use"].get<bool>();
  }
  if (type == "auto") {
    if (Present(choice, "name")) return InvalidArgument("\"tool_choice.name\" goes with type \"tool\" only");
    return Status::Ok();
  }
  if (!r->tools.is_array() || r->tools.empty())
    return InvalidArgument("\"tool_choice\" of type \"", type, "\" needs \"tools\"");
  if (type == "any") {
    if (Present(choice, "name")) return InvalidArgument("\"tool_choice.name\" goes with type \"tool\" only");
    r->output.tool_choice = OutputSpec::ToolChoice::kRequired;
    return Status::Ok();
  }
  M3_ASSIGN_OR_RETURN(const std::string name, ReadString(choice, "name", "tool_choice"));
  if (std::none_of(r->tools.begin(), r->tools.end(), [&](const ojson& t) { return t["function"]["name"] == name; }))
    return InvalidArgument("\"tool_choice.name\" '", name, "' is not one of the tools");
  r->output.tool_choice = OutputSpec::ToolChoice::kNamed;
  r->output.tool_name = name;
  return Status::Ok();
}

// thinking into the template's thinking_mode.
StatusOr<std::string> ThinkingMode(const ojson& body, int* budget) {
  if (!Present(body, "thinking")) return std::string("disabled");  // Anthropic's default: no thinking
  const ojson& t = body["thinking"];
  if (!t.is_object() || !t.contains("type") || !t["type"].is_string())
    return InvalidArgument("\"thinking\" must be an object with a \"type\": enabled, adaptive or disabled");
  const std::string type = t["type"].get<std::string>();
  if (type == "disabled") {
    M3_RETURN_IF_ERROR(CheckKeys(t, "thinking", {"type"}));
    return type;
  }
  if (type != "enabled" && type != "adaptive")
    return InvalidArgument("\"thinking.type\" '", type, "' is not supported (enabled, adaptive or disabled)");
  M3_RETURN_IF_ERROR(CheckKeys(t, "thinking", {"type", "budget_tokens", "display"}));
  if (Present(t, "display") && t["display"] != "summarized")
    return InvalidArgument("\"thinking.display\" must be \"summarized\" (the thinking is returned as it was written)");
  if (type == "enabled") {
    if (!Present(t, "budget_tokens")) return InvalidArgument("\"thinking.budget_tokens\" is required");
    M3_RETURN_IF_ERROR(
        ReadInteger(t, "budget_tokens", "thinking.budget_tokens", 1, std::numeric_limits<int32_t>::max(), budget));
  } else if (Present(t, "budget_tokens")) {
    return InvalidArgument("\"thinking.budget_tokens\" goes with type \"enabled\" only");
  }
  return type;
}

// output_config: format (a JSON schema the answer must follow) into the request's output.
Status ConvertOutputConfig(const ojson& body, Request* r) {
  if (!Present(body, "output_config")) return Status::Ok();
  const ojson& c = body["output_config"];
  if (!c.is_object()) return InvalidArgument("\"output_config\" must be an object");
  M3_RETURN_IF_ERROR(CheckKeys(c, "output_config", {"format"}));
  if (!Present(c, "format")) return Status::Ok();
  const ojson& f = c["format"];
  if (!f.is_object() || f.value("type", std::string()) != "json_schema" || !Present(f, "schema") ||
      !f["schema"].is_object())
    return InvalidArgument("\"output_config.format\" must be {\"type\": \"json_schema\", \"schema\": {...}}");
  M3_RETURN_IF_ERROR(CheckKeys(f, "output_config.format", {"type", "schema"}));
  r->output.answer = OutputSpec::Answer::kJsonSchema;
  r->output.schema = f["schema"];
  return Status::Ok();
}

// The conversation in the template's (OpenAI's) messages, the system text first.
StatusOr<ojson> ConvertMessages(const ojson& messages, std::string system) {
  if (!messages.is_array() || messages.empty()) return InvalidArgument("\"messages\" must be a non-empty array");
  ojson out = ojson::array();
  std::vector<std::string> pending;  // tool_use ids of the assistant message before, to be answered
  size_t pending_at = 0;             // that message
  std::set<std::string> tool_use_ids;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = Str("messages[", i, "]");
    if (!m.is_object()) return InvalidArgument("\"", at, "\" must be an object");
    M3_RETURN_IF_ERROR(CheckKeys(m, at, {"role", "content"}));
    M3_ASSIGN_OR_RETURN(const std::string role, ReadString(m, "role", at));
    if (!m.contains("content") || !(m["content"].is_string() || m["content"].is_array()))
      return InvalidArgument("\"", at, ".content\" must be a string or an array of content blocks");
    const ojson& content = m["content"];
    const std::string content_at = at + ".content";
    auto unanswered = [&] {
      return InvalidArgument("\"", at, "\": the tool_use blocks of messages[", pending_at,
                             "] need their tool_result blocks in the user message that follows it (", pending.front(),
                             " has none)");
    };

    if (role == "system") {
      if (!out.empty())
        return InvalidArgument("\"", at,
                               ".role\": a system message may only come before the conversation; the "
                               "template has no place for one later");
      M3_ASSIGN_OR_RETURN(std::string text, TextContent(content, content_at));
      system = system.empty() ? text : Joined({system, text});
      continue;
    }
    if (role == "user") {
      std::vector<std::string> texts;
      std::map<std::string, std::string> results;
      if (content.is_string()) texts.push_back(content.get<std::string>());
      for (size_t j = 0; content.is_array() && j < content.size(); ++j) {
        const ojson& block = content[j];
        const std::string block_at = Str(content_at, "[", j, "]");
        M3_ASSIGN_OR_RETURN(const std::string type, BlockType(block, block_at));
        if (type == "text") {
          M3_RETURN_IF_ERROR(CheckTextBlock(block, block_at));
          texts.push_back(block["text"].get<std::string>());
        } else if (type == "tool_result") {
          M3_RETURN_IF_ERROR(
              CheckKeys(block, block_at, {"type", "tool_use_id", "content", "is_error", "cache_control"}));
          M3_RETURN_IF_ERROR(CheckCacheControl(block, block_at));
          M3_ASSIGN_OR_RETURN(const std::string id, ReadString(block, "tool_use_id", block_at));
          if (std::find(pending.begin(), pending.end(), id) == pending.end())
            return InvalidArgument("\"", block_at, ".tool_use_id\" '", id,
                                   "' answers no tool_use block of the assistant message just before");
          if (results.count(id)) return InvalidArgument("\"", block_at, ".tool_use_id\" '", id, "' is answered twice");
          std::string text;
          if (Present(block, "content")) {
            M3_ASSIGN_OR_RETURN(text, TextContent(block["content"], block_at + ".content"));
          }
          if (Present(block, "is_error")) {
            if (!block["is_error"].is_boolean())
              return InvalidArgument("\"", block_at, ".is_error\" must be true or false");
            // The template has no mark for a failed call; the model reads it in the result.
            if (block["is_error"].get<bool>()) text = "Error: " + text;
          }
          results[id] = std::move(text);
        } else {
          return RefuseBlock(type, block_at, "a user message");
        }
      }
      // The results in the order of the calls (the template matches them by order), then the text.
      if (!pending.empty() && results.empty()) return unanswered();
      for (const std::string& id : pending) {
        auto it = results.find(id);
        if (it == results.end())
          return InvalidArgument("\"", content_at, "\": tool_use '", id, "' of messages[", pending_at,
                                 "] has no tool_result block");
        out.push_back({{"role", "tool"}, {"tool_call_id", id}, {"content", std::move(it->second)}});
      }
      pending.clear();
      if (!texts.empty() || results.empty()) out.push_back({{"role", "user"}, {"content", Joined(texts)}});
      continue;
    }
    if (role != "assistant")
      return InvalidArgument("\"", at, ".role\" '", role, "' is not one of user, assistant, system");
    if (!pending.empty()) return unanswered();
    std::vector<std::string> texts, thinking;
    ojson calls = ojson::array();
    if (content.is_string()) texts.push_back(content.get<std::string>());
    for (size_t j = 0; content.is_array() && j < content.size(); ++j) {
      const ojson& block = content[j];
      const std::string block_at = Str(content_at, "[", j, "]");
      M3_ASSIGN_OR_RETURN(const std::string type, BlockType(block, block_at));
      if (type == "text") {
        M3_RETURN_IF_ERROR(CheckTextBlock(block, block_at));
        texts.push_back(block["text"].get<std::string>());
      } else if (type == "thinking") {
        // The signature is Anthropic's proof that the thinking is unchanged; this server makes
        // none ("") and checks none.
        M3_RETURN_IF_ERROR(CheckKeys(block, block_at, {"type", "thinking", "signature"}));
        M3_ASSIGN_OR_RETURN(std::string text, ReadString(block, "thinking", block_at));
        M3_RETURN_IF_ERROR(ReadString(block, "signature", block_at, /*required=*/false).status());
        thinking.push_back(std::move(text));
      } else if (type == "tool_use") {
        M3_RETURN_IF_ERROR(CheckKeys(block, block_at, {"type", "id", "name", "input", "cache_control", "caller"}));
        M3_RETURN_IF_ERROR(CheckCacheControl(block, block_at));
        M3_ASSIGN_OR_RETURN(const std::string id, ReadString(block, "id", block_at));
        M3_ASSIGN_OR_RETURN(const std::string name, ReadString(block, "name", block_at));
        if (id.empty()) return InvalidArgument("\"", block_at, ".id\" must not be empty");
        if (!tool_use_ids.insert(id).second)
          return InvalidArgument("\"", block_at, ".id\" '", id, "' is used by another tool_use block");
        if (!ValidToolName(name))
          return InvalidArgument("\"", block_at, ".name\" must be 1 to 128 letters, digits, '_' or '-', got '", name,
                                 "'");
        if (!block.contains("input") || !block["input"].is_object())
          return InvalidArgument("\"", block_at, ".input\" must be an object");
        if (Present(block, "caller") && block["caller"] != ojson{{"type", "direct"}})
          return InvalidArgument("\"", block_at, ".caller\" other than {\"type\": \"direct\"} is not supported");
        calls.push_back(
            {{"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", block["input"]}}}});
        pending.push_back(id);
      } else {
        return RefuseBlock(type, block_at, "an assistant message");
      }
    }
    ojson msg = {{"role", "assistant"}, {"content", Joined(texts)}};
    if (!thinking.empty()) msg["reasoning_content"] = Joined(thinking);
    if (!calls.empty()) msg["tool_calls"] = std::move(calls);
    pending_at = i;
    out.push_back(std::move(msg));
  }
  if (out.empty()) return InvalidArgument("\"messages\" holds no user or assistant message");
  if (out.back()["role"] == "assistant")
    return InvalidArgument(
        "\"messages\": the last message must be a user message (continuing a final assistant "
        "message, a prefill, is not supported)");
  if (!system.empty()) out.insert(out.begin(), ojson{{"role", "system"}, {"content", system}});
  return out;
}

ojson ToolUseBlock(const ToolCall& call) {
  return {{"type", "tool_use"}, {"id", call.id}, {"name", call.name}, {"input", call.arguments}};
}

}  // namespace

bool IsMessagesPath(const std::string& path) { return path == "/v1/messages" || path.rfind("/v1/messages/", 0) == 0; }

StatusOr<Request> ParseMessagesRequest(const ojson& body, const RequestDefaults& defaults, bool count_tokens) {
  if (!body.is_object()) return InvalidArgument("the request body must be a JSON object");
  if (count_tokens) {
    M3_RETURN_IF_ERROR(CheckKeys(
        body, "", {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control", "output_config"},
        /*strict=*/true));
  } else {
    M3_RETURN_IF_ERROR(CheckKeys(
        body, "",
        {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature", "top_p",
         "top_k", "stream", "metadata", "thinking", "cache_control", "service_tier", "output_config"},
        /*strict=*/true));
  }
  Request r;
  r.chat = true;
  r.tool_call_id_prefix = kToolUseIdPrefix;
  r.sampling = defaults.sampling;
  r.sampling.seed = FreshSeed();
  r.max_tokens = defaults.max_tokens;
  r.lookup = defaults.lookup;
  r.literal_content = defaults.literal_content;
  if (!Present(body, "model") || !body["model"].is_string())
    return InvalidArgument("\"model\" is required (a string; this server serves one model whatever it names)");
  M3_RETURN_IF_ERROR(CheckCacheControl(body, ""));

  if (!count_tokens) {
    if (!Present(body, "max_tokens")) return InvalidArgument("\"max_tokens\" is required");
    M3_RETURN_IF_ERROR(
        ReadInteger(body, "max_tokens", "max_tokens", 1, std::numeric_limits<int32_t>::max(), &r.max_tokens));
    M3_RETURN_IF_ERROR(ReadFloat(body, "temperature", &r.sampling.temperature));
    M3_RETURN_IF_ERROR(ReadFloat(body, "top_p", &r.sampling.top_p));
    M3_RETURN_IF_ERROR(ReadInteger(body, "top_k", "top_k", 0, std::numeric_limits<int32_t>::max(), &r.sampling.top_k));
    M3_RETURN_IF_ERROR(ValidateSamplingParams(r.sampling));
    if (Present(body, "stream")) {
      if (!body["stream"].is_boolean()) return InvalidArgument("\"stream\" must be true or false");
      r.stream = body["stream"].get<bool>();
    }
    if (Present(body, "stop_sequences")) {
      const ojson& s = body["stop_sequences"];
      if (!s.is_array() || s.size() > kMaxStopSequences)
        return InvalidArgument("\"stop_sequences\" must be an array of at most ", kMaxStopSequences, " strings");
      for (const ojson& one : s) {
        if (!one.is_string() || one.get<std::string>().empty())
          return InvalidArgument("\"stop_sequences\" must hold non-empty strings");
        r.stop.push_back(one.get<std::string>());
      }
    }
    if (Present(body, "metadata")) {  // user_id: a label for the client's own accounting
      const ojson& m = body["metadata"];
      if (!m.is_object()) return InvalidArgument("\"metadata\" must be an object");
      M3_RETURN_IF_ERROR(CheckKeys(m, "metadata", {"user_id"}, /*strict=*/true));
      if (Present(m, "user_id") && !m["user_id"].is_string())
        return InvalidArgument("\"metadata.user_id\" must be a string");
    }
    if (Present(body, "service_tier") && body["service_tier"] != "auto" && body["service_tier"] != "standard_only")
      return InvalidArgument("\"service_tier\" must be \"auto\" or \"standard_only\"");
  }

  std::string system;
  if (Present(body, "system")) {
    M3_ASSIGN_OR_RETURN(system, TextContent(body["system"], "system"));
  }
  M3_ASSIGN_OR_RETURN(const std::string mode, ThinkingMode(body, &r.output.reasoning_budget));
  r.template_options = {{"thinking_mode", mode}};
  r.tools = nullptr;
  if (Present(body, "tools")) {
    M3_ASSIGN_OR_RETURN(r.tools, ConvertTools(body["tools"]));
    if (r.tools.empty()) r.tools = nullptr;
  }
  if (Present(body, "tool_choice")) M3_RETURN_IF_ERROR(ConvertToolChoice(body["tool_choice"], &r));
  M3_RETURN_IF_ERROR(ConvertOutputConfig(body, &r));
  if (!body.contains("messages")) return InvalidArgument("\"messages\" is required");
  M3_ASSIGN_OR_RETURN(r.messages, ConvertMessages(body["messages"], std::move(system)));
  // TurnInputs refuses stop strings with a constrained reply too, but by OpenAI's name.
  const bool forced = r.output.tool_choice != OutputSpec::ToolChoice::kAuto;
  if (!r.stop.empty() && (forced || r.output.answer != OutputSpec::Answer::kFree))
    return InvalidArgument("\"stop_sequences\" cannot be combined with ",
                           forced ? "a forced tool call (\"tool_choice\")" : "\"output_config.format\"",
                           ": a stop sequence would cut the reply short of its format");
  return r;
}

std::string StopReason(const GenerateStats& stats, const ParsedOutput& out) {
  if (stats.stop_reason == "length") return "max_tokens";
  if (stats.stop_reason == "context") return "model_context_window_exceeded";
  if (!out.tool_calls.empty()) return "tool_use";
  if (!stats.stop_string.empty()) return "stop_sequence";
  return "end_turn";
}

ojson StopSequence(const GenerateStats& stats) {
  return stats.stop_reason == "stop" && !stats.stop_string.empty() ? ojson(stats.stop_string) : ojson(nullptr);
}

ojson Usage(const GenerateStats& stats) {
  return {{"input_tokens", stats.prompt_tokens - std::min(stats.reused_tokens, stats.prompt_tokens)},
          {"output_tokens", stats.generated_tokens},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", stats.reused_tokens}};
}

ojson ContentBlocks(const ParsedOutput& out) {
  ojson blocks = ojson::array();
  if (!out.reasoning.empty()) blocks.push_back({{"type", "thinking"}, {"thinking", out.reasoning}, {"signature", ""}});
  if (!out.content.empty()) blocks.push_back({{"type", "text"}, {"text", out.content}});
  for (const ToolCall& call : out.tool_calls) blocks.push_back(ToolUseBlock(call));
  return blocks;
}

ojson MessageResponse(const std::string& id, const std::string& model, const ParsedOutput& out,
                      const GenerateStats& stats) {
  const std::string reason = StopReason(stats, out);
  return {{"id", id},
          {"type", "message"},
          {"role", "assistant"},
          {"model", model},
          {"content", ContentBlocks(out)},
          {"stop_reason", reason},
          {"stop_sequence", reason == "stop_sequence" ? StopSequence(stats) : ojson(nullptr)},
          {"usage", Usage(stats)}};
}

StatusOr<ojson> WholeMessage(const std::string& id, const std::string& model, const ChoiceResult& choice) {
  M3_RETURN_IF_ERROR(choice.status);
  return MessageResponse(id, model, choice.output, choice.stats);
}

std::string Event::Text() const { return "event: " + name + "\ndata: " + JsonText(data) + "\n\n"; }

MessageStream::MessageStream(std::string id, std::string model, size_t prompt_tokens)
    : id_(std::move(id)), model_(std::move(model)), prompt_tokens_(prompt_tokens) {}

std::vector<Event> MessageStream::Start() const {
  // The cached part of the prompt is known once the turn ends: message_delta's usage has it.
  const ojson usage = {{"input_tokens", prompt_tokens_},
                       {"output_tokens", 0},
                       {"cache_creation_input_tokens", 0},
                       {"cache_read_input_tokens", 0}};
  const ojson message = {{"id", id_},
                         {"type", "message"},
                         {"role", "assistant"},
                         {"model", model_},
                         {"content", ojson::array()},
                         {"stop_reason", nullptr},
                         {"stop_sequence", nullptr},
                         {"usage", usage}};
  return {{"message_start", {{"type", "message_start"}, {"message", message}}}, {"ping", {{"type", "ping"}}}};
}

void MessageStream::Open(Block kind, ojson content_block, std::vector<Event>* out) {
  Close(out);
  ++index_;
  open_ = kind;
  out->push_back(
      {"content_block_start", {{"type", "content_block_start"}, {"index", index_}, {"content_block", content_block}}});
}

void MessageStream::Close(std::vector<Event>* out) {
  if (open_ == Block::kNone) return;
  out->push_back({"content_block_stop", {{"type", "content_block_stop"}, {"index", index_}}});
  open_ = Block::kNone;
}

std::vector<Event> MessageStream::Next(const TurnDelta& d) {
  std::vector<Event> out;
  auto delta = [&](ojson body) {
    out.push_back(
        {"content_block_delta", {{"type", "content_block_delta"}, {"index", index_}, {"delta", std::move(body)}}});
  };
  if (!d.reasoning.empty()) {
    if (open_ != Block::kThinking)
      Open(Block::kThinking, {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}, &out);
    delta({{"type", "thinking_delta"}, {"thinking", d.reasoning}});
  }
  if (!d.content.empty()) {
    if (open_ != Block::kText) Open(Block::kText, {{"type", "text"}, {"text", ""}}, &out);
    delta({{"type", "text_delta"}, {"text", d.content}});
  }
  for (const ToolCall& call : d.tool_calls) {
    ojson block = ToolUseBlock(call);
    block["input"] = ojson::object();  // filled by the deltas, as Anthropic streams it
    Open(Block::kNone, std::move(block), &out);
    delta({{"type", "input_json_delta"}, {"partial_json", JsonText(call.arguments)}});
    out.push_back({"content_block_stop", {{"type", "content_block_stop"}, {"index", index_}}});
  }
  return out;
}

std::vector<Event> MessageStream::Finish(const GenerateStats& stats, const ParsedOutput& out) {
  std::vector<Event> events;
  Close(&events);
  const std::string reason = StopReason(stats, out);
  events.push_back({"message_delta",
                    {{"type", "message_delta"},
                     {"delta",
                      {{"stop_reason", reason},
                       {"stop_sequence", reason == "stop_sequence" ? StopSequence(stats) : ojson(nullptr)}}},
                     {"usage", Usage(stats)}}});
  events.push_back({"message_stop", {{"type", "message_stop"}}});
  return events;
}

ojson ErrorBody(const std::string& message, int http_status) {
  const char* type = "api_error";
  switch (http_status) {
    case 401:
      type = "authentication_error";
      break;
    case 403:
      type = "permission_error";
      break;
    case 404:
      type = "not_found_error";
      break;
    case 413:
      type = "request_too_large";
      break;
    case 429:
      type = "rate_limit_error";
      break;
    case 503:
      type = "overloaded_error";
      break;
    default:
      if (http_status >= 400 && http_status < 500) type = "invalid_request_error";
      break;
  }
  return {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

Event ErrorEvent(const std::string& message, int http_status) { return {"error", ErrorBody(message, http_status)}; }

StatusOr<ojson> CountTokens(const ChatText& text, const ojson& body, const RequestDefaults& defaults) {
  StatusOr<Request> r = ParseMessagesRequest(body, defaults, /*count_tokens=*/true);
  if (!r.ok()) return Status(StatusCode::kInvalidArgument, r.status().message());  // the body's fault
  TurnOptions turn;
  M3_ASSIGN_OR_RETURN(const std::vector<int32_t> ids, TurnInputs(text, *r, "count", SIZE_MAX, &turn));
  return ojson{{"input_tokens", ids.size()}};
}

namespace {

// Anthropic's reply (NewReplyFormat).
class MessageReply final : public ReplyFormat {
 public:
  MessageReply(std::string id, std::string model, size_t prompt_tokens)
      : id_(std::move(id)), model_(std::move(model)), stream_(id_, model_, prompt_tokens) {}

  void Open(std::vector<std::string>* events) override { Add(stream_.Start(), events); }
  void Piece(size_t, const TurnDelta& d, std::vector<std::string>* events) override { Add(stream_.Next(d), events); }
  void ChoiceEnd(size_t, const ChoiceResult& result, std::vector<std::string>* events) override {
    Add(stream_.Finish(result.stats, result.output), events);
  }
  void Close(const std::vector<ChoiceResult>&, std::vector<std::string>*) override {}
  void Fail(const Status& why, std::vector<std::string>* events) override {
    events->push_back(ErrorEvent(why.message(), HttpStatus(why)).Text());
  }
  StatusOr<std::string> Whole(const std::vector<ChoiceResult>& choices) override {
    M3_ASSIGN_OR_RETURN(const ojson message, WholeMessage(id_, model_, choices.at(0)));
    return JsonText(message);
  }

 private:
  static void Add(const std::vector<Event>& more, std::vector<std::string>* events) {
    for (const Event& e : more) events->push_back(e.Text());
  }
  const std::string id_, model_;
  MessageStream stream_;
};

}  // namespace

std::unique_ptr<ReplyFormat> NewReplyFormat(std::string id, std::string model, size_t prompt_tokens) {
  return std::make_unique<MessageReply>(std::move(id), std::move(model), prompt_tokens);
}

}  // namespace m3::anthropic
