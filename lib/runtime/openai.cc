#include "runtime/openai.h"

#include <limits>

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
Status ReadCommon(const ojson& body, const Defaults& defaults, Request* r) {
  if (!body.is_object()) return InvalidArgument("the request body must be a JSON object");
  r->sampling = defaults.sampling;
  r->max_tokens = defaults.max_tokens;
  r->lookup = defaults.lookup;
  M3_RETURN_IF_ERROR(ReadNumber(body, "temperature", &r->sampling.temperature));
  M3_RETURN_IF_ERROR(ReadNumber(body, "top_p", &r->sampling.top_p));
  M3_RETURN_IF_ERROR(ReadNumber(body, "top_k", &r->sampling.top_k));
  M3_RETURN_IF_ERROR(ReadNumber(body, "min_p", &r->sampling.min_p));
  M3_RETURN_IF_ERROR(ReadNumber(body, "presence_penalty", &r->sampling.presence_penalty));
  M3_RETURN_IF_ERROR(ReadNumber(body, "repetition_penalty", &r->sampling.repetition_penalty));
  M3_RETURN_IF_ERROR(ReadNumber(body, "seed", &r->sampling.seed));
  M3_RETURN_IF_ERROR(ValidateSamplingParams(r->sampling));
  M3_RETURN_IF_ERROR(ReadNumber(body, "max_tokens", &r->max_tokens));
  M3_RETURN_IF_ERROR(ReadNumber(body, "max_completion_tokens", &r->max_tokens));  // the newer name wins
  if (r->max_tokens < 1) return InvalidArgument("\"max_tokens\" must be at least 1, got ", r->max_tokens);
  M3_RETURN_IF_ERROR(ReadBool(body, "stream", &r->stream));
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    if (!body["stream_options"].is_object()) return InvalidArgument("\"stream_options\" must be an object");
    M3_RETURN_IF_ERROR(ReadBool(body["stream_options"], "include_usage", &r->include_usage));
  }

  // Unsupported features: refused by name rather than silently ignored.
  int n = 1;
  M3_RETURN_IF_ERROR(ReadNumber(body, "n", &n));
  if (n != 1) return InvalidArgument("\"n\" must be 1: one choice per request");
  double frequency_penalty = 0;
  M3_RETURN_IF_ERROR(ReadNumber(body, "frequency_penalty", &frequency_penalty));
  if (frequency_penalty != 0)
    return InvalidArgument("\"frequency_penalty\" is not supported (use presence_penalty or repetition_penalty)");
  if (body.contains("stop")) {
    M3_ASSIGN_OR_RETURN(r->stop, ParseStopStrings(body["stop"], 4));  // OpenAI's limit
  }
  bool logprobs = false;
  if (body.contains("logprobs") && body["logprobs"].is_boolean()) logprobs = body["logprobs"].get<bool>();
  if (logprobs || (body.contains("logprobs") && body["logprobs"].is_number() && body["logprobs"].get<double>() > 0))
    return InvalidArgument("\"logprobs\" is not supported");
  return Status::Ok();
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
      ojson args = ojson::parse((*fn)["arguments"].get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (args.is_discarded() || !args.is_object())
        return InvalidArgument("messages[", i, "].tool_calls[", j, "].function.arguments is not a JSON object");
      (*fn)["arguments"] = std::move(args);
    }
  }
  return Status::Ok();
}

ojson Envelope(const std::string& id, const char* object, int64_t created, const std::string& model) {
  return {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
}

}  // namespace

StatusOr<Request> ParseChatRequest(const ojson& body, const Defaults& defaults) {
  Request r;
  r.chat = true;
  M3_RETURN_IF_ERROR(ReadCommon(body, defaults, &r));
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    return InvalidArgument("\"messages\" must be a non-empty array");
  r.messages = body["messages"];
  M3_RETURN_IF_ERROR(ArgumentsToObjects(r.messages));
  r.tools = body.contains("tools") ? body["tools"] : ojson(nullptr);
  if (!r.tools.is_null() && !r.tools.is_array()) return InvalidArgument("\"tools\" must be an array");
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const ojson& choice = body["tool_choice"];
    if (choice == "none") r.tools = nullptr;  // the model is not offered the tools
    else if (choice != "auto")
      return InvalidArgument("\"tool_choice\" must be \"auto\" or \"none\" (forced tool calls are not supported)");
  }
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    if (!body["chat_template_kwargs"].is_object()) return InvalidArgument("\"chat_template_kwargs\" must be an object");
    r.template_options = body["chat_template_kwargs"];
  }
  if (body.contains("response_format") && !body["response_format"].is_null()) {
    const ojson& f = body["response_format"];
    if (!f.is_object() || f.value("type", std::string()) != "text")
      return InvalidArgument("\"response_format\" other than {\"type\": \"text\"} is not supported");
  }
  return r;
}

StatusOr<Request> ParseCompletionRequest(const ojson& body, const Defaults& defaults) {
  Request r;
  r.chat = false;
  M3_RETURN_IF_ERROR(ReadCommon(body, defaults, &r));
  const ojson* prompt = body.contains("prompt") ? &body["prompt"] : nullptr;
  if (prompt && prompt->is_array() && prompt->size() == 1) prompt = &(*prompt)[0];
  if (!prompt || !prompt->is_string() || prompt->get<std::string>().empty())
    return InvalidArgument("\"prompt\" must be a non-empty string");
  r.prompt = prompt->get<std::string>();
  bool echo = false;
  M3_RETURN_IF_ERROR(ReadBool(body, "echo", &echo));
  if (echo) return InvalidArgument("\"echo\" is not supported");
  if (body.contains("suffix") && !body["suffix"].is_null()) return InvalidArgument("\"suffix\" is not supported");
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

ojson ChatResponse(const std::string& id, int64_t created, const std::string& model, const ParsedOutput& out,
                   const GenerateStats& stats) {
  ojson message = {{"role", "assistant"},
                   {"content", out.content.empty() && !out.tool_calls.empty() ? ojson(nullptr) : ojson(out.content)}};
  if (!out.reasoning.empty()) message["reasoning_content"] = out.reasoning;
  if (!out.tool_calls.empty()) {
    message["tool_calls"] = ojson::array();
    for (const ToolCall& c : out.tool_calls) message["tool_calls"].push_back(WireToolCall(c));
  }
  ojson r = Envelope(id, "chat.completion", created, model);
  r["choices"] = ojson::array(
      {{{"index", 0}, {"message", message}, {"logprobs", nullptr}, {"finish_reason", FinishReason(stats, out)}}});
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
                const ojson& finish_reason) {
  ojson r = Envelope(id, "chat.completion.chunk", created, model);
  r["choices"] = ojson::array({{{"index", 0}, {"delta", delta}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}});
  return r;
}

ojson CompletionResponse(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                         const GenerateStats& stats) {
  ojson r = Envelope(id, "text_completion", created, model);
  r["choices"] = ojson::array({{{"index", 0},
                                {"text", text},
                                {"logprobs", nullptr},
                                {"finish_reason", FinishReason(stats, ParsedOutput{})}}});
  r["usage"] = Usage(stats);
  return r;
}

ojson CompletionChunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                      const ojson& finish_reason) {
  ojson r = Envelope(id, "text_completion", created, model);
  r["choices"] = ojson::array({{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}});
  return r;
}

ojson UsageChunk(const std::string& id, int64_t created, const std::string& model, bool chat,
                 const GenerateStats& stats) {
  ojson r = Envelope(id, chat ? "chat.completion.chunk" : "text_completion", created, model);
  r["choices"] = ojson::array();
  r["usage"] = Usage(stats);
  return r;
}

ojson ErrorBody(const std::string& message, int http_status) {
  return {{"error",
           {{"message", message},
            {"type", http_status < 500 ? "invalid_request_error" : "server_error"},
            {"code", http_status}}}};
}

StatusOr<std::vector<int32_t>> TurnInputs(const ChatText& text, const Request& r, const std::string& id,
                                          size_t max_context, TurnOptions* turn) {
  turn->raw = !r.chat;
  turn->generate = GenerateOptions{r.max_tokens, text.stop_ids(), r.lookup};
  turn->tool_call_id_prefix = "call_" + id + "_";
  turn->stop_strings = r.stop;
  std::vector<int32_t> ids;
  if (r.chat) {
    M3_ASSIGN_OR_RETURN(ids, text.TurnPrompt(r.messages, r.tools, r.template_options, turn));
  } else {
    ids = text.tokenizer().Encode(r.prompt);
  }
  if (ids.size() > max_context)
    return OutOfRange("the prompt has ", ids.size(), " tokens but the context limit is ", max_context);
  return ids;
}

int HttpStatus(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return 400;
    case StatusCode::kOutOfMemory:
      return 503;
    default:
      return 500;
  }
}

}  // namespace m3::openai
