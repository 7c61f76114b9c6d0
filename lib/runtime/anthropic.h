// The Anthropic Messages API of `m3 serve`: POST /v1/messages and /v1/messages/count_tokens. A
// request body is read into the vendor-neutral Request (runtime/request.h), so that the same
// template, scheduler and output parser serve both APIs, and a turn's output is formatted as a
// Message or as the stream's events (message_start, content_block_start / _delta / _stop per
// block, message_delta, message_stop). No HTTP here (cli/serve_anthropic.cc); unit-tested in
// tests/test_anthropic.cc.
//
// The mapping: `system` (a string or text blocks) and leading system-role messages become the one
// system message the template renders; a user message's tool_result blocks become `tool`
// messages, in the order of the calls they answer (the template matches results to calls by
// order), then its text a user message; an assistant message's thinking blocks become
// reasoning_content, its text the content, its tool_use blocks tool_calls (arguments as
// objects). Text blocks of one message are joined with a blank line. `thinking` sets the
// template's thinking_mode: enabled, adaptive, or disabled (also when absent, as Anthropic's
// default is no thinking), and its budget_tokens the reasoning budget. tool_choice goes into
// Request::output ("none" withholds the tools, as the OpenAI parser does),
// disable_parallel_tool_use into its parallel_tool_calls, output_config.format into its JSON
// schema: TurnInputs makes the turn's constraint from them (lib/constrain), as for the OpenAI
// endpoint. Tool-use ids are "toolu_<message id>_<k>".
#pragma once

#include <nlohmann/json.hpp>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/chat.h"
#include "runtime/reply.h"
#include "runtime/request.h"

namespace m3::anthropic {

using ojson = nlohmann::ordered_json;

// The paths of this API (their errors take Anthropic's shape).
bool IsMessagesPath(const std::string& path);

// Stop sequences one request may carry.
inline constexpr size_t kMaxStopSequences = 64;

// Parses a /v1/messages body (`count_tokens`: a /v1/messages/count_tokens body, which has no
// max_tokens, sampling or streaming) into a chat request. InvalidArgument naming the field for a
// malformed, unknown or unsupported one: image and document blocks (a text-only model),
// redacted_thinking (encrypted by another provider's model), server tools, an assistant message
// last (prefill), tool results that answer no call or leave one unanswered.
StatusOr<Request> ParseMessagesRequest(const ojson& body, const RequestDefaults& defaults, bool count_tokens = false);

// Tool-use ids of a turn are this + the request's id + "_" + n.
inline constexpr const char* kToolUseIdPrefix = "toolu_";

// POST /v1/messages/count_tokens: {"input_tokens": the length of the prompt the template renders}
// (no model pass); InvalidArgument naming the field for a bad body.
StatusOr<ojson> CountTokens(const ChatText& text, const ojson& body, const RequestDefaults& defaults);

// "tool_use" when the turn ended on its own with tool calls, "stop_sequence" at a stop sequence,
// "max_tokens" at the token budget, "model_context_window_exceeded" at the context limit,
// "end_turn" otherwise.
std::string StopReason(const GenerateStats& stats, const ParsedOutput& out);
// The stop sequence that ended the turn, or null.
ojson StopSequence(const GenerateStats& stats);
// {"input_tokens" (those not read from the cache), "output_tokens", "cache_creation_input_tokens"
// (0: the cache is written as a side effect), "cache_read_input_tokens"}.
ojson Usage(const GenerateStats& stats);

// The content blocks of a whole turn: thinking {thinking, signature: ""}, text, tool_use
// {id, name, input}, in that order; none for what the turn did not produce.
ojson ContentBlocks(const ParsedOutput& out);
// A whole reply: {"id", "type": "message", "role": "assistant", "model", "content", "stop_reason",
// "stop_sequence", "usage"}.
ojson MessageResponse(const std::string& id, const std::string& model, const ParsedOutput& out,
                      const GenerateStats& stats);
// The reply to a request from its one choice once it has ended, or the choice's failure.
StatusOr<ojson> WholeMessage(const std::string& id, const std::string& model, const ChoiceResult& choice);

// One server-sent event: "event: <name>\ndata: <json>\n\n".
struct Event {
  std::string name;
  ojson data;
  std::string Text() const;
};

// A streamed reply as Anthropic's events, from the turn's deltas in order.
class MessageStream {
 public:
  MessageStream(std::string id, std::string model, size_t prompt_tokens);
  // message_start (an empty message whose usage counts the whole prompt as input so far), ping.
  std::vector<Event> Start() const;
  // The blocks a piece of the turn opens, continues and closes: reasoning goes to a thinking
  // block, text to a text block, each completed tool call to a tool_use block of its own (its
  // input in one input_json_delta).
  std::vector<Event> Next(const TurnDelta& d);
  // After the turn: closes the open block; message_delta (stop reason, stop sequence, the final
  // usage), message_stop.
  std::vector<Event> Finish(const GenerateStats& stats, const ParsedOutput& out);

 private:
  enum class Block { kNone, kThinking, kText };
  void Open(Block kind, ojson content_block, std::vector<Event>* out);
  void Close(std::vector<Event>* out);
  std::string id_, model_;
  size_t prompt_tokens_;
  Block open_ = Block::kNone;
  int index_ = -1;  // the last block started
};

// {"type": "error", "error": {"type", "message"}}: the type from the HTTP status (400
// invalid_request_error, 401 authentication_error, 403 permission_error, 404 not_found_error,
// 413 request_too_large, 429 rate_limit_error, 503 overloaded_error, other 5xx api_error).
ojson ErrorBody(const std::string& message, int http_status);
// The same as a stream's `error` event.
Event ErrorEvent(const std::string& message, int http_status);

// The reply to a request's one choice (runtime/reply.h): whole as MessageResponse, or streamed as
// MessageStream's events, ErrorEvent when it fails.
std::unique_ptr<ReplyFormat> NewReplyFormat(std::string id, std::string model, size_t prompt_tokens);

}  // namespace m3::anthropic
