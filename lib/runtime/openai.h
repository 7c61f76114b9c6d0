// The OpenAI-compatible shapes `m3 serve` speaks: /v1/chat/completions and /v1/completions
// request bodies into a turn's inputs, and a turn's output into responses and stream chunks.
// No HTTP here (cli/cmd_serve.cc); pure functions, unit-tested in tests/test_openai.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "ops/sampling.h"
#include "runtime/chat.h"

namespace m3::openai {

using ojson = nlohmann::ordered_json;

// What a request may leave out.
struct Defaults {
  SamplingParams sampling{.temperature = 1.0f, .top_k = 40, .top_p = 0.95f};  // CHAT_FORMAT.md §5
  int max_tokens = 512;
  LookupOptions lookup;  // the server's (not a request field)
};

struct Request {
  bool chat = true;
  // Chat: messages (tool-call arguments as objects, as the template takes them), tools (array or
  // null), template variables from chat_template_kwargs (e.g. thinking_mode).
  ojson messages, tools, template_options = ojson::object();
  std::string prompt;  // completions
  std::vector<std::string> stop;  // stop strings (at most 4, none empty)
  SamplingParams sampling;
  int max_tokens = 0;
  LookupOptions lookup;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
};

// Parses a body; InvalidArgument naming the field for a malformed or unsupported request (n > 1,
// logprobs, frequency_penalty, a response_format other than text, ...). Fields
// this server does not know are ignored, as OpenAI's clients send many.
StatusOr<Request> ParseChatRequest(const ojson& body, const Defaults& defaults);
StatusOr<Request> ParseCompletionRequest(const ojson& body, const Defaults& defaults);

// A parsed request's prompt ids and turn options: the conversation rendered by `text`'s template
// (chat) or the prompt encoded (completions), stop ids and strings, max_tokens, and tool-call ids
// "call_<id>_<n>". OutOfRange when the prompt is longer than max_context.
StatusOr<std::vector<int32_t>> TurnInputs(const ChatText& text, const Request& r, const std::string& id,
                                          size_t max_context, TurnOptions* turn);

// "tool_calls" when the turn ended on its own with tool calls, "stop" when it ended on its own
// (or the caller stopped it), "length" at the token budget or the context limit.
std::string FinishReason(const GenerateStats& stats, const ParsedOutput& out);
ojson Usage(const GenerateStats& stats);

// One tool call in OpenAI's wire form: arguments as a JSON string. `index` for stream deltas.
ojson WireToolCall(const ToolCall& call, const ojson& index = nullptr);

ojson ChatResponse(const std::string& id, int64_t created, const std::string& model, const ParsedOutput& out,
                   const GenerateStats& stats);
// A stream delta for one piece of a turn: {"reasoning_content"?, "content"?, "tool_calls"?};
// *tool_index counts the calls sent so far (their indexes in the stream).
ojson ChatDelta(const TurnDelta& d, size_t* tool_index);
ojson ChatChunk(const std::string& id, int64_t created, const std::string& model, const ojson& delta,
                const ojson& finish_reason = nullptr);

ojson CompletionResponse(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                         const GenerateStats& stats);
ojson CompletionChunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                      const ojson& finish_reason = nullptr);

// A chunk carrying only the usage (stream_options.include_usage), after the finish_reason chunk.
ojson UsageChunk(const std::string& id, int64_t created, const std::string& model, bool chat,
                 const GenerateStats& stats);

// {"error": {"message", "type", "code"}}; type "invalid_request_error" for 4xx, "server_error" else.
ojson ErrorBody(const std::string& message, int http_status);
// The HTTP status of a failed turn: 400 for bad requests and context overflow, 503 when out of
// memory, 500 for the rest (a folder without a chat template included).
int HttpStatus(const Status& s);

}  // namespace m3::openai
