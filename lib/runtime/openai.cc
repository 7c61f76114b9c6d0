#include "runtime/openai.h"
#include "base/json_guard.h"

#include <algorithm>
#include <climits>
#include <initializer_list>
#include <limits>

#include "text/byte_level.h"

namespace m3::openai {
namespace {

// Reads an optional number field into `out` (null or absent: unchanged).
template <typename T>
Status ReadNumber(const ojson& body, const char* key, T* out) {
  if (!body.contains(key) || body[key].is_null()) return Status::Ok();
  const ojson& v = body[key];
  if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return InvalidArgument("\"", key, "\" must be an integer");
    constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<T>::max());
    bool fits;
    if (v.is_number_unsigned()) {
      fits = v.get<uint64_t>() <= kMax;
    } else {
      const int64_t i = v.get<int64_t>();
      fits = i < 0 ? std::is_signed_v<T> && i >= static_cast<int64_t>(std::numeric_limits<T>::min())
                   : static_cast<uint64_t>(i) <= kMax;
    }
    if (!fits) return InvalidArgument("\"", key, "\" is out of range");
    *out = v.get<T>();
  } else {
    if (!v.is_number()) return InvalidArgument("\"", key, "\" must be a number");
    *out = v.get<T>();
  }
  return Status::Ok();
}

Status ReadBool(const ojson& body, const char* key, bool* out) {
  if (!body.contains(key) || body[key].is_null()) return Status::Ok();
  if (!body[key].is_boolean()) return InvalidArgument("\"", key, "\" must be true or false");
  *out = body[key].get<bool>();
  return Status::Ok();
}

// The fields both endpoints share: sampling, budget, streaming, and what is not supported.
Status ReadCommon(const ojson& body, const RequestDefaults& defaults, Request* r) {
  if (!body.is_object()) return InvalidArgument("the request body must be a JSON object");
  r->sampling = defaults.sampling;
  r->max_tokens = defaults.max_tokens;
  r->lookup = defaults.lookup;
  r->literal_content = defaults.literal_content;
  M3_RETURN_IF_ERROR(ReadNumber(body, "temperature", &r->sampling.temperature));
  M3_RETURN_IF_ERROR(ReadNumber(body, "top_p", &r->sampling.top_p));
  M3_RETURN_IF_ERROR(ReadNumber(body, "top_k", &r->sampling.top_k));
  M3_RETURN_IF_ERROR(ReadNumber(body, "min_p", &r->sampling.min_p));
  M3_RETURN_IF_ERROR(ReadNumber(body, "presence_penalty", &r->sampling.presence_penalty));
  M3_RETURN_IF_ERROR(ReadNumber(body, "frequency_penalty", &r->sampling.frequency_penalty));
  if (!(std::abs(r->sampling.frequency_penalty) <= 2))
    return InvalidArgument("\"frequency_penalty\" must be in [-2, 2], got ", r->sampling.frequency_penalty);
  M3_RETURN_IF_ERROR(ReadNumber(body, "repetition_penalty", &r->sampling.repetition_penalty));
  // A request without a seed samples with a fresh one (each retry differs, as from OpenAI); the
  // server reports it, so that a reply can be reproduced.
  r->sampling.seed = FreshSeed();
  M3_RETURN_IF_ERROR(ReadNumber(body, "seed", &r->sampling.seed));
  M3_RETURN_IF_ERROR(ValidateSamplingParams(r->sampling));
  M3_RETURN_IF_ERROR(ReadNumber(body, "max_tokens", &r->max_tokens));
  M3_RETURN_IF_ERROR(ReadNumber(body, "max_completion_tokens", &r->max_tokens));  // the newer name wins
  M3_RETURN_IF_ERROR(ReadBool(body, "stream", &r->stream));
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    if (!body["stream_options"].is_object()) return InvalidArgument("\"stream_options\" must be an object");
    M3_RETURN_IF_ERROR(ReadBool(body["stream_options"], "include_usage", &r->include_usage));
  }

  M3_RETURN_IF_ERROR(ReadNumber(body, "n", &r->n));
  if (r->n < 1 || r->n > kMaxChoices)
    return InvalidArgument("\"n\" must be 1..", kMaxChoices, " (choices of one prompt), got ", r->n);
  if (body.contains("stop")) {
    M3_ASSIGN_OR_RETURN(r->stop, ParseStopStrings(body["stop"], 4));  // OpenAI's limit
  }
  return Status::Ok();
}

// Every top-level field must be one this server acts on (or one that asks for what it does
// anyway): anything else is refused by name instead of being dropped. `extra`: the endpoint's own.
Status CheckFields(const ojson& body, std::initializer_list<const char*> extra) {
  static constexpr const char* kCommon[] = {
      "model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty",
      "frequency_penalty", "seed", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n", "stop",
      "logprobs", "user", "logit_bias"};
  for (const auto& item : body.items()) {
    const std::string& key = item.key();
    const auto is = [&](const char* k) { return key == k; };
    if (std::none_of(std::begin(kCommon), std::end(kCommon), is) && std::none_of(extra.begin(), extra.end(), is))
      return InvalidArgument("\"", key, "\" is not supported by this server");
  }
  // Accepted only where they ask for nothing (an empty bias; one candidate; "user" is a label).
  if (body.contains("logit_bias") && !body["logit_bias"].is_null() &&
      !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
    return InvalidArgument("\"logit_bias\" is not supported");
  if (body.contains("user") && !body["user"].is_null() && !body["user"].is_string())
    return InvalidArgument("\"user\" must be a string");
  return Status::Ok();
}

// The roles the chat template renders, where it renders them, and text-only content: a message
// the template would skip, or a part it would drop (an image of a text-only server), is refused
// by name rather than vanishing from the prompt.
Status CheckMessages(const ojson& messages) {
  size_t system_at = 0;  // where a system or developer message may stand: first, or after "root"
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = Str("messages[", i, "]");
    if (!m.is_object()) return InvalidArgument("\"", at, "\" must be an object");
    if (!m.contains("role") || !m["role"].is_string())
      return InvalidArgument("\"", at, ".role\" is missing (one of root, system, developer, user, assistant, tool)");
    const std::string role = m["role"].get<std::string>();
    if (role == "root") {
      if (i != 0) return InvalidArgument("\"", at, ".role\": a root message may only come first");
      system_at = 1;
    } else if (role == "system" || role == "developer") {
      if (i != system_at)
        return InvalidArgument("\"", at, ".role\": a ", role, " message may only come first (or after root); the "
                               "template has no place for one later in the conversation");
    } else if (role != "user" && role != "assistant" && role != "tool") {
      return InvalidArgument("\"", at, ".role\" '", role, "' is not one of root, system, developer, user, assistant, tool");
    }
    for (const auto& [key, value] : m.items()) {
      const bool known = key == "role" || key == "content" || (key == "name" && role == "tool") ||
                         (role == "assistant" && (key == "tool_calls" || key == "reasoning_content")) ||
                         (role == "tool" && key == "tool_call_id");
      // Clients echo a reply back with its empty fields ("refusal": null, "annotations": []).
      if (!known && !value.is_null() && !(value.is_array() && value.empty()))
        return InvalidArgument("\"", at, ".", key, "\" is not supported in a ", role, " message");
    }
    if (!m.contains("content") || m["content"].is_null()) {
      if (role == "assistant") continue;  // a message of tool calls only
      return InvalidArgument("\"", at, ".content\" is missing");
    }
    const ojson& content = m["content"];
    if (content.is_string()) continue;
    if (!content.is_array())
      return InvalidArgument("\"", at, ".content\" must be a string or an array of text parts");
    for (size_t j = 0; j < content.size(); ++j) {
      const ojson& part = content[j];
      if (part.is_string()) continue;
      const std::string where = Str(at, ".content[", j, "]");
      if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
        return InvalidArgument("\"", where, "\" must be a string or an object with a \"type\"");
      if (part["type"] != "text")
        return InvalidArgument("\"", where, ".type\" '", part["type"].get<std::string>(),
                               "' is not supported: this server runs the text model (text parts only)");
      if (!part.contains("text") || !part["text"].is_string())
        return InvalidArgument("\"", where, ".text\" must be a string");
    }
  }
  return Status::Ok();
}

// max_tokens once the endpoint's own fields are read: 0 only to score an echoed prompt.
Status CheckMaxTokens(const Request& r) {
  if (r.max_tokens < 0 || (r.max_tokens == 0 && !r.echo))
    return InvalidArgument("\"max_tokens\" must be at least 1 (0 only with \"echo\"), got ", r.max_tokens);
  return Status::Ok();
}

Status CheckTopLogprobs(const char* key, int n) {
  if (n < 0 || n > kMaxTopLogprobs) return InvalidArgument("\"", key, "\" must be 0..", kMaxTopLogprobs, ", got ", n);
  return Status::Ok();
}

// Chat: "logprobs" true asks for them, "top_logprobs" (which needs it) how many alternatives.
Status ReadChatLogprobs(const ojson& body, Request* r) {
  bool logprobs = false;
  M3_RETURN_IF_ERROR(ReadBool(body, "logprobs", &logprobs));
  const bool has_top = body.contains("top_logprobs") && !body["top_logprobs"].is_null();
  if (has_top && !logprobs) return InvalidArgument("\"top_logprobs\" needs \"logprobs\": true");
  if (!logprobs) return Status::Ok();
  r->logprobs = 0;
  M3_RETURN_IF_ERROR(ReadNumber(body, "top_logprobs", &r->logprobs));
  return CheckTopLogprobs("top_logprobs", r->logprobs);
}

// "response_format" and "grammar": what the output must be (lib/constrain compiles them per turn).
Status ReadOutputFormat(const ojson& body, Request* r) {
  if (body.contains("grammar") && !body["grammar"].is_null()) {
    if (!body["grammar"].is_string() || body["grammar"].get<std::string>().empty())
      return InvalidArgument("\"grammar\" must be a non-empty string (GBNF, root rule \"root\")");
    r->output.grammar = body["grammar"].get<std::string>();
    r->output.answer = OutputSpec::Answer::kGrammar;
  }
  if (!body.contains("response_format") || body["response_format"].is_null()) return Status::Ok();
  const ojson& f = body["response_format"];
  if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
    return InvalidArgument("\"response_format.type\" must be \"text\", \"json_object\" or \"json_schema\"");
  for (const auto& item : f.items())
    if (item.key() != "type" && item.key() != "json_schema")
      return InvalidArgument("\"response_format.", item.key(), "\" is not supported by this server");
  const std::string type = f["type"].get<std::string>();
  if (type == "text") return Status::Ok();
  if (type != "json_object" && type != "json_schema")
    return InvalidArgument("\"response_format.type\" must be \"text\", \"json_object\" or \"json_schema\", got '",
                           type, "'");
  if (type == "json_schema") {
    if (!f.contains("json_schema") || !f["json_schema"].is_object())
      return InvalidArgument("\"response_format.json_schema\" must be an object with a \"schema\"");
    for (const auto& item : f["json_schema"].items()) {
      static constexpr const char* kKnown[] = {"name", "description", "schema", "strict"};
      if (std::none_of(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return item.key() == k; }))
        return InvalidArgument("\"response_format.json_schema.", item.key(), "\" is not supported by this server");
    }
    const ojson& js = f["json_schema"];
    if (!js.contains("schema") || !(js["schema"].is_object() || js["schema"].is_boolean()))
      return InvalidArgument("\"response_format.json_schema.schema\" must be a JSON schema (an object)");
    if (js.contains("strict") && !js["strict"].is_null() && !js["strict"].is_boolean())
      return InvalidArgument("\"response_format.json_schema.strict\" must be true or false");
  } else if (f.contains("json_schema")) {
    return InvalidArgument("\"response_format.json_schema\" needs \"type\": \"json_schema\"");
  }
  if (r->output.answer == OutputSpec::Answer::kGrammar)
    return InvalidArgument("\"grammar\" and a JSON \"response_format\" cannot both be given");
  if (type == "json_object") {
    r->output.answer = OutputSpec::Answer::kJsonObject;
  } else {
    r->output.answer = OutputSpec::Answer::kJsonSchema;
    r->output.schema = f["json_schema"]["schema"];
  }
  return Status::Ok();
}

// "tools": function tools only, each {"type": "function", "function": {"name", "description"?,
// "parameters"?, "strict"?}}.
Status CheckTools(const ojson& tools) {
  if (tools.is_null()) return Status::Ok();
  if (!tools.is_array()) return InvalidArgument("\"tools\" must be an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string at = Str("tools[", i, "]");
    if (!t.is_object()) return InvalidArgument("\"", at, "\" must be an object");
    const std::string type = t.contains("type") && t["type"].is_string() ? t["type"].get<std::string>() : "";
    if (type != "function")
      return InvalidArgument("\"", at, ".type\" '", type, "' is not supported (function tools only)");
    if (!t.contains("function") || !t["function"].is_object() || !t["function"].contains("name") ||
        !t["function"]["name"].is_string() || t["function"]["name"].get<std::string>().empty())
      return InvalidArgument("\"", at, ".function.name\" must be a non-empty string");
    const ojson& f = t["function"];
    if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object())
      return InvalidArgument("\"", at, ".function.parameters\" must be a JSON schema (an object)");
    if (f.contains("strict") && !f["strict"].is_null() && !f["strict"].is_boolean())
      return InvalidArgument("\"", at, ".function.strict\" must be true or false");
  }
  return Status::Ok();
}

// "tool_choice": "auto", "none" (the tools are then not offered), "required", or one named
// function, which must be among the tools.
Status ReadToolChoice(const ojson& body, Request* r) {
  if (!body.contains("tool_choice") || body["tool_choice"].is_null()) return Status::Ok();
  const ojson& c = body["tool_choice"];
  if (c.is_object() && c.contains("type") && c["type"].is_string() && c["type"] != "function")
    return InvalidArgument("\"tool_choice.type\" '", c["type"].get<std::string>(),
                           "' is not supported (\"auto\", \"none\", \"required\" or a named function)");
  if (c == "none") {
    r->tools = nullptr;  // the model is not offered the tools
    return Status::Ok();
  }
  if (c == "auto") return Status::Ok();
  const bool has_tools = r->tools.is_array() && !r->tools.empty();
  if (c == "required") {
    if (!has_tools) return InvalidArgument("\"tool_choice\" \"required\" needs \"tools\"");
    r->output.tool_choice = OutputSpec::ToolChoice::kRequired;
    return Status::Ok();
  }
  if (!c.is_object() || c.value("type", std::string()) != "function" || !c.contains("function") ||
      !c["function"].is_object() || !c["function"].contains("name") || !c["function"]["name"].is_string())
    return InvalidArgument(
        "\"tool_choice\" must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": "
        "{\"name\": ...}}");
  const std::string name = c["function"]["name"].get<std::string>();
  auto is_named = [&](const ojson& t) {
    return t.is_object() && t.contains("function") && t["function"].is_object() &&
           t["function"].value("name", "") == name;
  };
  if (has_tools && std::any_of(r->tools.begin(), r->tools.end(), is_named)) {
    r->output.tool_choice = OutputSpec::ToolChoice::kNamed;
    r->output.tool_name = name;
    return Status::Ok();
  }
  return InvalidArgument("\"tool_choice.function.name\" '", name, "' is not one of the request's tools");
}

// A completions prompt: a string, an array of token ids, or an array of those.
StatusOr<std::vector<CompletionPrompt>> ReadPrompts(const ojson& body) {
  static constexpr const char* kForm =
      "\"prompt\" must be a non-empty string, an array of token ids, or an array of those";
  if (!body.contains("prompt")) return InvalidArgument(kForm);
  const ojson& p = body["prompt"];
  auto one = [](const ojson& v) -> StatusOr<CompletionPrompt> {
    CompletionPrompt out;
    if (v.is_string()) {
      out.text = v.get<std::string>();
      if (out.text.empty()) return InvalidArgument(kForm);
      return out;
    }
    if (!v.is_array() || v.empty()) return InvalidArgument(kForm);
    for (const ojson& id : v) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        return InvalidArgument("\"prompt\": token ids must be integers from 0 to the vocabulary size");
      out.ids.push_back(id.get<int32_t>());
    }
    return out;
  };
  std::vector<CompletionPrompt> prompts;
  if (p.is_array() && !p.empty() && !p[0].is_number()) {  // several prompts
    if (p.size() > kMaxPrompts) return InvalidArgument("\"prompt\" holds at most ", kMaxPrompts, " prompts");
    for (const ojson& v : p) {
      M3_ASSIGN_OR_RETURN(CompletionPrompt one_prompt, one(v));
      prompts.push_back(std::move(one_prompt));
    }
  } else {
    M3_ASSIGN_OR_RETURN(CompletionPrompt one_prompt, one(p));
    prompts.push_back(std::move(one_prompt));
  }
  return prompts;
}

// The template takes tool-call arguments as objects; OpenAI clients send them as JSON strings.
Status ArgumentsToObjects(ojson& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    ojson& m = messages[i];
    if (!m.is_object()) return InvalidArgument("messages[", i, "] must be an object");
    if (!m.contains("tool_calls") || !m["tool_calls"].is_array()) continue;
    for (size_t j = 0; j < m["tool_calls"].size(); ++j) {
      ojson& call = m["tool_calls"][j];
      ojson* fn = call.is_object() && call.contains("function") ? &call["function"] : &call;
      if (!fn->is_object() || !fn->contains("arguments") || !(*fn)["arguments"].is_string()) continue;
      const std::string where = Str("messages[", i, "].tool_calls[", j, "].function.arguments");
      M3_ASSIGN_OR_RETURN(ojson args, ParseJson<ojson>((*fn)["arguments"].get<std::string>(), where));
      if (!args.is_object()) return InvalidArgument(where, " is not a JSON object");
      (*fn)["arguments"] = std::move(args);
    }
  }
  return Status::Ok();
}

ojson Envelope(const std::string& id, const char* object, int64_t created, const std::string& model) {
  return {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
}

ojson ChatChoice(size_t index, const ParsedOutput& out, const GenerateStats& stats, const ojson& logprobs);

}  // namespace

StatusOr<Request> ParseChatRequest(const ojson& body, const RequestDefaults& defaults) {
  Request r;
  r.chat = true;
  M3_RETURN_IF_ERROR(ReadCommon(body, defaults, &r));
  M3_RETURN_IF_ERROR(CheckFields(body, {"messages", "tools", "tool_choice", "parallel_tool_calls",
                                         "chat_template_kwargs", "response_format", "grammar", "top_logprobs"}));
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    return InvalidArgument("\"messages\" must be a non-empty array");
  M3_RETURN_IF_ERROR(CheckMessages(body["messages"]));
  M3_RETURN_IF_ERROR(ReadBool(body, "parallel_tool_calls", &r.output.parallel_tool_calls));
  r.messages = body["messages"];
  M3_RETURN_IF_ERROR(ArgumentsToObjects(r.messages));
  r.tools = body.contains("tools") ? body["tools"] : ojson(nullptr);
  M3_RETURN_IF_ERROR(CheckTools(r.tools));
  M3_RETURN_IF_ERROR(ReadToolChoice(body, &r));
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    if (!body["chat_template_kwargs"].is_object()) return InvalidArgument("\"chat_template_kwargs\" must be an object");
    r.template_options = body["chat_template_kwargs"];
  }
  M3_RETURN_IF_ERROR(ReadOutputFormat(body, &r));
  M3_RETURN_IF_ERROR(ReadChatLogprobs(body, &r));
  M3_RETURN_IF_ERROR(CheckMaxTokens(r));
  return r;
}

StatusOr<Request> ParseCompletionRequest(const ojson& body, const RequestDefaults& defaults) {
  Request r;
  r.chat = false;
  M3_RETURN_IF_ERROR(ReadCommon(body, defaults, &r));
  M3_RETURN_IF_ERROR(CheckFields(body, {"prompt", "echo", "suffix", "best_of", "response_format", "grammar"}));
  M3_RETURN_IF_ERROR(ReadOutputFormat(body, &r));
  int best_of = 1;
  M3_RETURN_IF_ERROR(ReadNumber(body, "best_of", &best_of));
  if (best_of != 1) return InvalidArgument("\"best_of\" must be 1: one candidate per prompt");
  M3_ASSIGN_OR_RETURN(r.prompts, ReadPrompts(body));
  if (r.prompts.size() * static_cast<size_t>(r.n) > kMaxPrompts)
    return InvalidArgument("\"n\" times the prompts makes ", r.prompts.size() * static_cast<size_t>(r.n),
                           " choices; at most ", kMaxPrompts, " a request");
  M3_RETURN_IF_ERROR(ReadBool(body, "echo", &r.echo));
  if (body.contains("logprobs") && body["logprobs"].is_boolean())
    return InvalidArgument("\"logprobs\" of a completion is a number (0..", kMaxTopLogprobs, "), not true/false");
  M3_RETURN_IF_ERROR(ReadNumber(body, "logprobs", &r.logprobs));
  if (body.contains("logprobs") && !body["logprobs"].is_null())
    M3_RETURN_IF_ERROR(CheckTopLogprobs("logprobs", r.logprobs));
  if (body.contains("suffix") && !body["suffix"].is_null()) return InvalidArgument("\"suffix\" is not supported");
  M3_RETURN_IF_ERROR(CheckMaxTokens(r));
  return r;
}

std::string FinishReason(const GenerateStats& stats, const ParsedOutput& out) {
  if (stats.stop_reason == "length" || stats.stop_reason == "context") return "length";
  return out.tool_calls.empty() ? "stop" : "tool_calls";
}

ojson Usage(const GenerateStats& stats) {
  return {{"prompt_tokens", stats.prompt_tokens},
          {"completion_tokens", stats.generated_tokens},
          {"total_tokens", stats.prompt_tokens + stats.generated_tokens},
          {"prompt_tokens_details", {{"cached_tokens", stats.reused_tokens}}}};
}

ojson WireToolCall(const ToolCall& call, const ojson& index) {
  ojson c = ojson::object();
  if (!index.is_null()) c["index"] = index;
  c["id"] = call.id;
  c["type"] = "function";
  c["function"] = {{"name", call.name}, {"arguments", SerializeArguments(call.arguments)}};
  return c;
}

std::string LogprobsJson::Spelling(int32_t id) const {
  const std::string& bytes = tokenizer_.TokenBytes(id);
  if (byte_level::IsValidUtf8(bytes)) return bytes;
  std::string s = "bytes:";
  for (const unsigned char c : bytes) s += Str("\\x", "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]);
  return s;
}

ojson LogprobsJson::Of(std::span<const TokenLogprob> tokens, int32_t unscored_first) {
  auto bytes_of = [&](int32_t id) {
    ojson b = ojson::array();
    for (const unsigned char c : tokenizer_.TokenBytes(id)) b.push_back(c);
    return b;
  };
  if (chat_) {
    ojson content = ojson::array();
    for (const TokenLogprob& t : tokens) {
      ojson top = ojson::array();
      for (const auto& [id, lp] : t.top) top.push_back({{"token", Spelling(id)}, {"logprob", lp}, {"bytes", bytes_of(id)}});
      content.push_back({{"token", Spelling(t.id)}, {"logprob", t.logprob}, {"bytes", bytes_of(t.id)}, {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  ojson out = {{"tokens", ojson::array()},
               {"token_logprobs", ojson::array()},
               {"top_logprobs", ojson::array()},
               {"text_offset", ojson::array()}};
  auto add = [&](int32_t id, const ojson& logprob, const ojson& top) {
    out["tokens"].push_back(Spelling(id));
    out["token_logprobs"].push_back(logprob);
    out["top_logprobs"].push_back(top);
    out["text_offset"].push_back(offset_);
    for (const unsigned char c : tokenizer_.TokenBytes(id)) offset_ += (c & 0xC0) != 0x80;  // characters
  };
  if (unscored_first >= 0) add(unscored_first, nullptr, nullptr);
  for (const TokenLogprob& t : tokens) {
    ojson top = ojson::object();
    for (const auto& [id, lp] : t.top) top.emplace(Spelling(id), lp);  // the first of equal spellings
    top.emplace(Spelling(t.id), t.logprob);                            // OpenAI: the token's own too
    add(t.id, t.logprob, top);
  }
  return out;
}

void LogprobsJson::Append(ojson* all, const ojson& part) {
  if (part.is_null()) return;
  if (all->is_null()) {
    *all = part;
    return;
  }
  for (auto& [key, list] : all->items())
    for (const ojson& v : part[key]) list.push_back(v);
}

ChoicePieces::ChoicePieces(const Tokenizer& tokenizer, const Request& r, std::span<const int32_t> prompt,
                           size_t choice)
    : chat_(r.chat),
      echo_(!r.chat && r.echo),
      logprobs_(r.logprobs >= 0),
      first_prompt_id_(prompt.empty() ? -1 : prompt.front()),
      json_(tokenizer, r.chat) {
  if (echo_) {
    const CompletionPrompt& p = r.prompts.at(choice / static_cast<size_t>(r.n));
    echo_text_ = p.text.empty() ? tokenizer.Decode(p.ids, /*skip_special_tokens=*/false) : p.text;
  }
}

ojson ChoicePieces::Next(const TurnDelta& d) {
  ojson logprobs = nullptr;
  if (chat_) {
    if (logprobs_) logprobs = json_.Of(d.logprobs);
    return {{"delta", ChatDelta(d, &tool_index_)}, {"logprobs", logprobs}};
  }
  std::string text = d.content;
  if (echo_ && !started_) {
    text = echo_text_ + text;
    if (logprobs_) logprobs = json_.Of(d.prompt_logprobs, first_prompt_id_);
  }
  started_ = true;
  if (logprobs_) LogprobsJson::Append(&logprobs, json_.Of(d.logprobs));
  return {{"text", text}, {"logprobs", logprobs}};
}

ojson ChoicePieces::Last() {
  if (!echo_ || started_) return nullptr;
  return Next(TurnDelta());
}

void JoinedPieces::Add(const ojson& piece) {
  if (piece.is_null()) return;
  if (piece.contains("text")) text += piece["text"].get<std::string>();
  LogprobsJson::Append(&logprobs, piece["logprobs"]);
}

StatusOr<ojson> WholeResponse(const Tokenizer& tokenizer, const Request& r, const std::string& id, int64_t created,
                              const std::string& model, const std::vector<ChoiceResult>& choices) {
  std::vector<CompletionChoice> completions;
  ojson chat_choices = ojson::array();
  for (size_t c = 0; c < choices.size(); ++c) {
    const ChoiceResult& choice = choices[c];
    M3_RETURN_IF_ERROR(choice.status);
    ChoicePieces pieces(tokenizer, r, choice.prompt, c);
    JoinedPieces joined;
    for (const TurnDelta& d : choice.deltas) joined.Add(pieces.Next(d));
    joined.Add(pieces.Last());
    if (r.chat) chat_choices.push_back(ChatChoice(c, choice.output, choice.stats, joined.logprobs));
    else completions.push_back({joined.text, joined.logprobs, FinishReason(choice.stats, ParsedOutput{})});
  }
  if (!r.chat) return CompletionResponse(id, created, model, completions, RequestUsage(r, choices));
  ojson response = Envelope(id, "chat.completion", created, model);
  response["choices"] = std::move(chat_choices);
  response["usage"] = Usage(RequestUsage(r, choices));
  return response;
}

namespace {

// One whole chat choice: {"index", "message", "logprobs", "finish_reason"}.
ojson ChatChoice(size_t index, const ParsedOutput& out, const GenerateStats& stats, const ojson& logprobs) {
  ojson message = {{"role", "assistant"},
                   {"content", out.content.empty() && !out.tool_calls.empty() ? ojson(nullptr) : ojson(out.content)}};
  if (!out.reasoning.empty()) message["reasoning_content"] = out.reasoning;
  if (!out.tool_calls.empty()) {
    message["tool_calls"] = ojson::array();
    for (const ToolCall& c : out.tool_calls) message["tool_calls"].push_back(WireToolCall(c));
  }
  return {{"index", index}, {"message", message}, {"logprobs", logprobs}, {"finish_reason", FinishReason(stats, out)}};
}

}  // namespace

ojson ChatResponse(const std::string& id, int64_t created, const std::string& model, const ParsedOutput& out,
                   const GenerateStats& stats, const ojson& logprobs) {
  ojson r = Envelope(id, "chat.completion", created, model);
  r["choices"] = ojson::array({ChatChoice(0, out, stats, logprobs)});
  r["usage"] = Usage(stats);
  return r;
}

ojson ChatDelta(const TurnDelta& d, size_t* tool_index) {
  ojson delta = ojson::object();
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.tool_calls.empty()) {
    delta["tool_calls"] = ojson::array();
    for (const ToolCall& c : d.tool_calls) delta["tool_calls"].push_back(WireToolCall(c, (*tool_index)++));
  }
  return delta;
}

ojson ChatChunk(const std::string& id, int64_t created, const std::string& model, const ojson& delta,
                const ojson& finish_reason, const ojson& logprobs, size_t index) {
  ojson r = Envelope(id, "chat.completion.chunk", created, model);
  r["choices"] = ojson::array({{{"index", index}, {"delta", delta}, {"logprobs", logprobs}, {"finish_reason", finish_reason}}});
  return r;
}

ojson CompletionResponse(const std::string& id, int64_t created, const std::string& model,
                         const std::vector<CompletionChoice>& choices, const GenerateStats& usage) {
  ojson r = Envelope(id, "text_completion", created, model);
  r["choices"] = ojson::array();
  for (size_t i = 0; i < choices.size(); ++i)
    r["choices"].push_back({{"index", i},
                            {"text", choices[i].text},
                            {"logprobs", choices[i].logprobs},
                            {"finish_reason", choices[i].finish_reason}});
  r["usage"] = Usage(usage);
  return r;
}

ojson CompletionChunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                      const ojson& finish_reason, const ojson& logprobs, size_t index) {
  ojson r = Envelope(id, "text_completion", created, model);
  r["choices"] = ojson::array({{{"index", index}, {"text", text}, {"logprobs", logprobs}, {"finish_reason", finish_reason}}});
  return r;
}

void AddUsage(GenerateStats* total, const GenerateStats& choice) {
  total->prompt_tokens += choice.prompt_tokens;
  total->reused_tokens += choice.reused_tokens;
  total->generated_tokens += choice.generated_tokens;
}

GenerateStats RequestUsage(const Request& r, const std::vector<ChoiceResult>& choices) {
  GenerateStats total;
  for (size_t c = 0; c < choices.size(); ++c) {
    if (c % static_cast<size_t>(r.n) == 0) {
      AddUsage(&total, choices[c].stats);
    } else {
      total.generated_tokens += choices[c].stats.generated_tokens;
    }
  }
  return total;
}

ojson UsageChunk(const std::string& id, int64_t created, const std::string& model, bool chat,
                 const GenerateStats& stats) {
  ojson r = Envelope(id, chat ? "chat.completion.chunk" : "text_completion", created, model);
  r["choices"] = ojson::array();
  r["usage"] = Usage(stats);
  return r;
}

ojson ErrorBody(const std::string& message, int http_status) {
  // OpenAI's shape: `code` a string or null, `param` the request field at fault or null (our
  // messages about a field start with its name in quotes: "\"n\" must be 1 ...").
  const char* code = nullptr;
  switch (http_status) {
    case 401: code = "invalid_api_key"; break;
    case 403: code = "forbidden"; break;
    case 404: code = "not_found"; break;
    case 405: code = "method_not_allowed"; break;
    case 413: code = "request_too_large"; break;
    case 415: code = "unsupported_media_type"; break;
    case 429: code = "rate_limit_exceeded"; break;
    case 503: code = "server_busy"; break;
    default: break;
  }
  ojson param = nullptr;
  if (message.size() > 2 && message[0] == '"') {
    const size_t end = message.find('"', 1);
    if (end != std::string::npos && end > 1) param = message.substr(1, end - 1);
  }
  return {{"error",
           {{"message", message},
            {"type", http_status < 500 ? "invalid_request_error" : "server_error"},
            {"param", param},
            {"code", code ? ojson(code) : ojson(nullptr)}}}};
}

namespace {

// OpenAI's reply (NewReplyFormat): each event "data: <chunk>\n\n".
class OpenAIReply final : public ReplyFormat {
 public:
  OpenAIReply(const Tokenizer& tokenizer, const Request& r, const std::vector<ChoiceResult>& choices, std::string id,
              int64_t created, std::string model)
      : tokenizer_(tokenizer), r_(r), id_(std::move(id)), created_(created), model_(std::move(model)) {
    for (size_t c = 0; c < choices.size(); ++c)
      pieces_.emplace_back(std::make_unique<ChoicePieces>(tokenizer, r, choices[c].prompt, c));
  }

  void Open(std::vector<std::string>* events) override {
    for (size_t c = 0; c < pieces_.size() && r_.chat; ++c)
      Add(ChatChunk(id_, created_, model_, {{"role", "assistant"}, {"content", ""}}, nullptr, nullptr, c), events);
  }
  void Piece(size_t choice, const TurnDelta& d, std::vector<std::string>* events) override {
    AddPiece(choice, pieces_[choice]->Next(d), events);
  }
  void ChoiceEnd(size_t choice, const ChoiceResult& result, std::vector<std::string>* events) override {
    if (const ojson last = pieces_[choice]->Last(); !last.is_null()) AddPiece(choice, last, events);
    const std::string reason = FinishReason(result.stats, result.output);
    Add(r_.chat ? ChatChunk(id_, created_, model_, ojson::object(), reason, nullptr, choice)
                : CompletionChunk(id_, created_, model_, "", reason, nullptr, choice),
        events);
  }
  void Close(const std::vector<ChoiceResult>& choices, std::vector<std::string>* events) override {
    if (r_.include_usage) Add(UsageChunk(id_, created_, model_, r_.chat, RequestUsage(r_, choices)), events);
    events->push_back(kDone);
  }
  void Fail(const Status& why, std::vector<std::string>* events) override {
    Add(ErrorBody(why.message(), HttpStatus(why)), events);
    events->push_back(kDone);
  }
  StatusOr<std::string> Whole(const std::vector<ChoiceResult>& choices) override {
    M3_ASSIGN_OR_RETURN(const ojson response, WholeResponse(tokenizer_, r_, id_, created_, model_, choices));
    return JsonText(response);
  }

 private:
  static constexpr const char* kDone = "data: [DONE]\n\n";
  static void Add(const ojson& chunk, std::vector<std::string>* events) {
    events->push_back("data: " + JsonText(chunk) + "\n\n");
  }
  void AddPiece(size_t choice, const ojson& piece, std::vector<std::string>* events) const {
    Add(r_.chat ? ChatChunk(id_, created_, model_, piece["delta"], nullptr, piece["logprobs"], choice)
                : CompletionChunk(id_, created_, model_, piece["text"], nullptr, piece["logprobs"], choice),
        events);
  }

  const Tokenizer& tokenizer_;
  const Request& r_;
  const std::string id_;
  const int64_t created_;
  const std::string model_;
  std::vector<std::unique_ptr<ChoicePieces>> pieces_;  // of each choice
};

}  // namespace

std::unique_ptr<ReplyFormat> NewReplyFormat(const Tokenizer& tokenizer, const Request& r,
                                            const std::vector<ChoiceResult>& choices, std::string id,
                                            int64_t created, std::string model) {
  return std::make_unique<OpenAIReply>(tokenizer, r, choices, std::move(id), created, std::move(model));
}

StatusOr<ojson> Tokenize(const ChatText& text, const ojson& body, const RequestDefaults& defaults,
                         size_t max_model_len) {
  if (!body.is_object()) return InvalidArgument("the request body must be a JSON object");
  static constexpr const char* kKnown[] = {"model", "content", "prompt", "messages", "tools", "chat_template_kwargs",
                                           "add_generation_prompt", "add_special", "add_special_tokens",
                                           "with_pieces", "return_token_strs"};
  for (const auto& item : body.items())
    if (std::none_of(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return item.key() == k; }))
      return InvalidArgument("\"", item.key(), "\" is not supported by /tokenize");
  bool add_special = false, with_pieces = false, token_strs = false, add_generation_prompt = true;
  M3_RETURN_IF_ERROR(ReadBool(body, "add_special", &add_special));
  M3_RETURN_IF_ERROR(ReadBool(body, "add_special_tokens", &add_special));
  M3_RETURN_IF_ERROR(ReadBool(body, "with_pieces", &with_pieces));
  M3_RETURN_IF_ERROR(ReadBool(body, "return_token_strs", &token_strs));
  M3_RETURN_IF_ERROR(ReadBool(body, "add_generation_prompt", &add_generation_prompt));
  const bool has_messages = body.contains("messages") && !body["messages"].is_null();
  const char* text_key = body.contains("content") && !body["content"].is_null() ? "content"
                         : body.contains("prompt") && !body["prompt"].is_null() ? "prompt"
                                                                                 : nullptr;
  if (has_messages == (text_key != nullptr))
    return InvalidArgument("\"content\" (or \"prompt\"): a text, or \"messages\": a conversation, must be given (one of them)");
  std::vector<int32_t> ids;
  if (text_key) {
    if (!body[text_key].is_string()) return InvalidArgument("\"", text_key, "\" must be a string");
    const std::string& s = body[text_key].get_ref<const std::string&>();
    if (s.size() > kMaxTokenizeBytes)
      return InvalidArgument("\"", text_key, "\" is longer than ", kMaxTokenizeBytes >> 20, " MiB");
    ids = text.tokenizer().Encode(s);
  } else {
    const ojson& messages = body["messages"];
    if (!messages.is_array() || messages.empty()) return InvalidArgument("\"messages\" must be a non-empty array");
    M3_RETURN_IF_ERROR(CheckMessages(messages));
    ojson m = messages;
    M3_RETURN_IF_ERROR(ArgumentsToObjects(m));
    const ojson tools = body.contains("tools") ? body["tools"] : ojson(nullptr);
    if (!tools.is_null() && !tools.is_array()) return InvalidArgument("\"tools\" must be an array");
    ojson options = ojson::object();
    if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
      if (!body["chat_template_kwargs"].is_object())
        return InvalidArgument("\"chat_template_kwargs\" must be an object");
      options = body["chat_template_kwargs"];
    }
    if (add_generation_prompt) {  // the ids a chat completion runs (literal content included)
      TurnOptions turn;
      M3_ASSIGN_OR_RETURN(ids, text.TurnPrompt(m, tools, options, &turn, defaults.literal_content));
    } else {
      options["add_generation_prompt"] = false;
      M3_ASSIGN_OR_RETURN(const std::string rendered, text.Render(m, tools, options));
      ids = text.tokenizer().Encode(rendered);
    }
  }
  if ((with_pieces || token_strs) && ids.size() > kMaxTokenizePieces)
    return InvalidArgument("\"with_pieces\" and \"return_token_strs\" take at most ", kMaxTokenizePieces,
                           " tokens; this input has ", ids.size(), " (ask for the ids alone, or in parts)");
  ojson tokens = ojson::array(), strs = ojson::array();
  for (const int32_t id : ids) {
    if (token_strs) strs.push_back(text.tokenizer().TokenString(id));
    if (!with_pieces) {
      tokens.push_back(id);
      continue;
    }
    const std::string& bytes = text.tokenizer().TokenBytes(id);
    ojson piece = ojson::array();
    if (byte_level::IsValidUtf8(bytes)) {
      piece = bytes;
    } else {
      for (const unsigned char b : bytes) piece.push_back(b);
    }
    tokens.push_back({{"id", id}, {"piece", piece}});
  }
  ojson out = ojson::object();
  out["tokens"] = std::move(tokens);
  out["count"] = ids.size();
  out["max_model_len"] = max_model_len;
  if (token_strs) out["token_strs"] = std::move(strs);
  return out;
}

StatusOr<ojson> Detokenize(const Tokenizer& tokenizer, const ojson& body) {
  if (!body.is_object()) return InvalidArgument("the request body must be a JSON object");
  for (const auto& item : body.items())
    if (item.key() != "tokens" && item.key() != "model")
      return InvalidArgument("\"", item.key(), "\" is not supported by /detokenize");
  if (!body.contains("tokens") || !body["tokens"].is_array())
    return InvalidArgument("\"tokens\" must be an array of token ids");
  const ojson& list = body["tokens"];
  if (list.size() > kMaxDetokenizeTokens)
    return InvalidArgument("\"tokens\" has ", list.size(), " ids; at most ", kMaxDetokenizeTokens);
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const ojson& v = list[i];
    const bool ok = v.is_number_unsigned() ? v.get<uint64_t>() < tokenizer.vocab_size()
                    : v.is_number_integer() ? v.get<int64_t>() >= 0 && static_cast<uint64_t>(v.get<int64_t>()) < tokenizer.vocab_size()
                                            : false;
    if (!ok)
      return InvalidArgument("\"tokens[", i, "]\" must be a token id 0..", tokenizer.vocab_size() - 1, ", got ",
                             v.is_number() ? v.dump() : std::string("a ") + v.type_name());
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  const std::string text = tokenizer.Decode(ids, /*skip_special_tokens=*/false);
  return ojson{{"content", text}, {"prompt", text}};
}

}  // namespace m3::openai
