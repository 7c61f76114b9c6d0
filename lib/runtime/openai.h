// The OpenAI-compatible shapes `m3 serve` speaks: /v1/chat/completions and /v1/completions
// request bodies into the vendor-neutral Request (runtime/request.h), and a turn's output into
// responses and stream chunks (NewReplyFormat, for runtime/reply.h). No HTTP here
// (cli/serve_openai.cc); unit-tested in tests/test_openai.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "ops/sampling.h"
#include "runtime/chat.h"
#include "runtime/reply.h"
#include "runtime/request.h"

namespace m3::openai {

using ojson = nlohmann::ordered_json;

// Most likely tokens listed with each token's log-probability (OpenAI's chat top_logprobs limit).
inline constexpr int kMaxTopLogprobs = 20;
// Prompts one completions request may carry (n choices each).
inline constexpr size_t kMaxPrompts = 256;
// Choices of one prompt ("n"): each is a request of its own to the scheduler.
inline constexpr int kMaxChoices = 16;

// Parses a body into the neutral request; InvalidArgument naming the field for a malformed or
// unsupported request (n past kMaxChoices, best_of, suffix, a field this server does not act on,
// ...). A completions prompt is a string, an array of token ids, or an array of those (several
// prompts); max_tokens may be 0 with echo (scoring a prompt). Chat: tool_choice, parallel_tool_calls,
// response_format ({"type": "text" | "json_object"} or {"type": "json_schema", "json_schema":
// {"name", "schema", "strict"}}) and grammar (GBNF) go into Request::output; tool_choice "none"
// withholds the tools.
StatusOr<Request> ParseChatRequest(const ojson& body, const RequestDefaults& defaults);
StatusOr<Request> ParseCompletionRequest(const ojson& body, const RequestDefaults& defaults);

// "tool_calls" when the turn ended on its own with tool calls, "stop" when it ended on its own
// (or the caller stopped it), "length" at the token budget or the context limit.
std::string FinishReason(const GenerateStats& stats, const ParsedOutput& out);
ojson Usage(const GenerateStats& stats);

// One tool call in OpenAI's wire form: arguments as a JSON string. `index` for stream deltas.
ojson WireToolCall(const ToolCall& call, const ojson& index = nullptr);

// Log-probabilities in the endpoints' forms, for the tokens of one choice in order. Chat:
// {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]};
// completions: {"tokens", "token_logprobs", "top_logprobs" (objects token -> log-probability, the
// token's own included), "text_offset" (characters before the token in the choice's text)}.
// A token that is not whole UTF-8 is spelled "bytes:\\xNN...", as OpenAI does.
class LogprobsJson {
 public:
  LogprobsJson(const Tokenizer& tokenizer, bool chat) : tokenizer_(tokenizer), chat_(chat) {}
  // The next tokens; `unscored_first` >= 0 lists that token first, without a log-probability (a
  // prompt's first token). Completions' text offsets go on from the previous call's.
  ojson Of(std::span<const TokenLogprob> tokens, int32_t unscored_first = -1);
  // Appends the lists of `part` to those of *all (null: none yet).
  static void Append(ojson* all, const ojson& part);

 private:
  std::string Spelling(int32_t id) const;
  const Tokenizer& tokenizer_;
  bool chat_;
  size_t offset_ = 0;  // completions: characters so far
};

// One choice's pieces in the endpoint's form, from its turn's deltas in order: chat {"delta",
// "logprobs"} (delta as ChatDelta), completions {"text", "logprobs"} with the echoed prompt (text
// and log-probabilities) before the first piece. "logprobs" is null when not asked.
class ChoicePieces {
 public:
  // `prompt`: the ids of choice `choice`'s prompt (echo lists them).
  ChoicePieces(const Tokenizer& tokenizer, const Request& r, std::span<const int32_t> prompt, size_t choice = 0);
  ojson Next(const TurnDelta& d);
  // After the turn: the echoed prompt when no piece came (a null piece otherwise).
  ojson Last();

 private:
  bool chat_, echo_, logprobs_;
  std::string echo_text_;
  int32_t first_prompt_id_;  // echo: listed without a log-probability
  LogprobsJson json_;
  size_t tool_index_ = 0;
  bool started_ = false;
};

// A choice's pieces joined for a whole (non-streamed) response: the text and the log-probabilities.
struct JoinedPieces {
  std::string text;  // completions
  ojson logprobs;    // null when not asked
  void Add(const ojson& piece);
};

ojson ChatResponse(const std::string& id, int64_t created, const std::string& model, const ParsedOutput& out,
                   const GenerateStats& stats, const ojson& logprobs = nullptr);

// The whole (non-streamed) response to `r` from its choices, or the first failed choice's status.
StatusOr<ojson> WholeResponse(const Tokenizer& tokenizer, const Request& r, const std::string& id, int64_t created,
                              const std::string& model, const std::vector<ChoiceResult>& choices);
// A stream delta for one piece of a turn: {"reasoning_content"?, "content"?, "tool_calls"?};
// *tool_index counts the calls sent so far (their indexes in the stream).
ojson ChatDelta(const TurnDelta& d, size_t* tool_index);
// Stream chunks of choice `index`.
ojson ChatChunk(const std::string& id, int64_t created, const std::string& model, const ojson& delta,
                const ojson& finish_reason = nullptr, const ojson& logprobs = nullptr, size_t index = 0);

// A finished completions choice.
struct CompletionChoice {
  std::string text;  // the echoed prompt (echo), then the completion
  ojson logprobs;    // null when not asked
  std::string finish_reason;
};
// Choices in prompt order; `usage` counts them all.
ojson CompletionResponse(const std::string& id, int64_t created, const std::string& model,
                         const std::vector<CompletionChoice>& choices, const GenerateStats& usage);
ojson CompletionChunk(const std::string& id, int64_t created, const std::string& model, const std::string& text,
                      const ojson& finish_reason = nullptr, const ojson& logprobs = nullptr, size_t index = 0);
// Adds a choice's token counts to a request's usage.
void AddUsage(GenerateStats* total, const GenerateStats& choice);
// A request's usage from its ended choices, as OpenAI counts it: each prompt once (the first of
// its choices: its prompt and cached tokens), the generated tokens of every choice.
GenerateStats RequestUsage(const Request& r, const std::vector<ChoiceResult>& choices);

// A chunk carrying only the usage (stream_options.include_usage), after the finish_reason chunk.
ojson UsageChunk(const std::string& id, int64_t created, const std::string& model, bool chat,
                 const GenerateStats& stats);

// The reply to `r` (chat or completions) in OpenAI's shapes: whole (WholeResponse), or streamed as
// server-sent events "data: <chunk>" - chat first names the assistant's role of each choice; each
// choice's pieces (ChoicePieces) and its finish_reason chunk; the usage chunk if asked; then
// "data: [DONE]", which also follows an error body. `r` and `tokenizer` must outlive it;
// `choices` gives each choice's prompt.
std::unique_ptr<ReplyFormat> NewReplyFormat(const Tokenizer& tokenizer, const Request& r,
                                            const std::vector<ChoiceResult>& choices, std::string id,
                                            int64_t created, std::string model);

// {"error": {"message", "type", "param", "code"}} as OpenAI writes it: type "invalid_request_error"
// for 4xx, "server_error" else; param the field a message names first (in quotes) or null; code a
// string for the statuses that have one (401 "invalid_api_key", 429 "rate_limit_exceeded", ...)
// or null.
ojson ErrorBody(const std::string& message, int http_status);
// POST /tokenize, in llama.cpp's and vLLM's spellings: {"content" | "prompt": text} or {"messages",
// "tools"?, "chat_template_kwargs"?, "add_generation_prompt"? (default true: the ids a chat
// completion of them would run), "add_special" | "add_special_tokens"? (this tokenizer has no
// post-processor: nothing is added either way), "with_pieces"? (llama.cpp: tokens as {"id",
// "piece"}, the piece a string when whole UTF-8, else its bytes), "return_token_strs"? (vLLM:
// "token_strs" beside)} -> {"tokens", "count", "max_model_len"}. InvalidArgument naming the field.
inline constexpr size_t kMaxTokenizeBytes = size_t{8} << 20;  // text of one /tokenize request
inline constexpr size_t kMaxDetokenizeTokens = size_t{1} << 20;
// Tokens of one /tokenize reply with "with_pieces" or "return_token_strs": each is a JSON object
// or string of ~200 bytes in memory (the ids alone have no limit but the text's).
inline constexpr size_t kMaxTokenizePieces = size_t{1} << 18;
StatusOr<ojson> Tokenize(const ChatText& text, const ojson& body, const RequestDefaults& defaults,
                         size_t max_model_len);
// POST /detokenize: {"tokens": [ids]} -> {"content": text, "prompt": text} (llama.cpp's and vLLM's
// names; special tokens spelled out). InvalidArgument for an id outside the vocabulary.
StatusOr<ojson> Detokenize(const Tokenizer& tokenizer, const ojson& body);

}  // namespace m3::openai
