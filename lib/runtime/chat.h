// One assistant turn in text (docs/MODEL.md §6): a conversation rendered by the model folder's chat
// template, generated with prefix reuse, decoded as a UTF-8 stream and split into reasoning,
// content and tool calls as it arrives. Shared by `m3 run` / `m3 chat` and the C API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "runtime/generate.h"
#include "runtime/output_constraint.h"
#include "runtime/perplexity.h"
#include "text/chat_template.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace m3 {

struct TurnOptions;

// The text side of a folder: its tokenizer, its chat template when it has one, and the ids that
// end an assistant turn. Immutable once loaded: one may serve several sessions and threads.
class ChatText {
 public:
  // tokenizer.json is required; the chat template (chat_template.jinja or tokenizer_config.json)
  // only when `require_template`, else it is loaded when present. A template that is present but
  // does not load is an error either way.
  static StatusOr<std::unique_ptr<ChatText>> Load(const std::string& dir, bool require_template);

  const Tokenizer& tokenizer() const { return *tokenizer_; }
  bool has_template() const { return template_.has_value(); }
  // Renders a conversation as the template does, `options` (an object or null) as its variables.
  // NotFound when the folder has no template.
  StatusOr<std::string> Render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                               const nlohmann::ordered_json& options) const;
  // The prompt ids of the next assistant turn: `messages` (and `tools`, null for none) rendered
  // with add_generation_prompt set, `options` (an object or null) as template variables
  // (thinking_mode, ...). Sets turn->start from the rendered prompt (OutputStart) and turn->tools
  // (which types tool-call arguments). With `literal_content`, the text of every message but the
  // assistant's own is encoded as plain text: a user who types "<mm:think>" or "[e~[" gets the
  // letters, not the control tokens (HF's apply_chat_template gives the tokens; that is the
  // default).
  StatusOr<std::vector<int32_t>> TurnPrompt(const nlohmann::ordered_json& messages,
                                            const nlohmann::ordered_json& tools, nlohmann::ordered_json options,
                                            TurnOptions* turn, bool literal_content = false) const;
  // The end of an assistant turn and the defensive stops of docs/MODEL.md §6.5, those that exist.
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
  // The vocabulary as constrained decoding walks it, built on first use (any thread).
  std::shared_ptr<const constrain::VocabIndex> vocab_index() const;

 private:
  ChatText() = default;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> template_;
  Status template_error_;  // why there is no template (NotFound), for RenderPrompt
  std::vector<int32_t> stop_ids_;
  mutable std::once_flag vocab_once_;
  mutable std::shared_ptr<const constrain::VocabIndex> vocab_index_;
};

// Where the model's output starts for a rendered prompt: inside reasoning when it ends with
// `<mm:think>` (docs/MODEL.md §6.3, thinking_mode "enabled").
ThinkState OutputStart(std::string_view rendered_prompt);

// Stop strings over a text stream (OpenAI's "stop"): text passes through except a tail that may
// still become a stop string; at the first match, the text before it passes and nothing after.
class StopStrings {
 public:
  explicit StopStrings(std::vector<std::string> stops);  // empty strings are ignored
  // Text that can be shown now (whole UTF-8 characters when the pieces are: a stop string is valid
  // UTF-8, so the held tail starts at a character boundary).
  std::string Push(std::string_view piece);
  // The end of the stream: the held tail, none after a match.
  std::string Flush();
  bool matched() const { return matched_; }
  const std::string& match() const { return match_; }  // the stop string matched

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
  std::string match_;
};

// A request's "stop": null (none), a string, or an array of at most `max_count` strings; every
// string non-empty. InvalidArgument naming "stop" otherwise.
StatusOr<std::vector<std::string>> ParseStopStrings(const nlohmann::ordered_json& stop,
                                                    size_t max_count = SIZE_MAX);

struct TurnOptions {
  bool raw = false;  // plain completion: all text is content, no markup parsed
  ThinkState start = ThinkState::kOutside;
  nlohmann::json tools;  // the request's tools array (types tool-call arguments), or null
  std::string tool_call_id_prefix = "call_";  // call ids are this + 0, 1, ... (a server: per request)
  // Generation ends at the first of these in the decoded text, which is cut before it (the stop
  // reason is then "stop"). Matched before the reasoning / tool-call parser, as vLLM does.
  std::vector<std::string> stop_strings;
  GenerateOptions generate;
  // Log-probabilities (TokenLogprob, each with this many most likely tokens) of every generated
  // token, passed on in the deltas; off when negative. With prompt_logprobs also those of every
  // prompt token but the first (the prompt then runs whole, without reusing the cached prefix).
  int top_logprobs = -1;
  bool prompt_logprobs = false;
  // What the answer must be (JSON schema, grammar, forced tool calls); empty: free.
  OutputConstraint constraint;
};

// A piece of a turn: its text and, when the turn records log-probabilities, those of the tokens
// decoded since the previous piece (this one's included). Tokens whose text is held back (markup,
// a possible stop string, a partial character) pass theirs on with a later piece, the last ones
// in a piece without text at the end.
struct TurnDelta : StreamingOutputParser::Delta {
  TurnDelta() = default;
  TurnDelta(StreamingOutputParser::Delta text) : Delta(std::move(text)) {}  // NOLINT: text alone
  std::vector<TokenLogprob> prompt_logprobs;  // the first piece of a turn with prompt_logprobs
  std::vector<TokenLogprob> logprobs;
};

// One assistant turn as steps: a Generation whose tokens are decoded as a UTF-8 stream, cut at
// stop strings and split into reasoning, content and tool calls, every non-empty delta going to
// on_delta as it is decoded (returning false stops generation). Step generation() as Generation
// says (a server advances many turns with BatchStep), then Finish.
class TurnGeneration {
 public:
  TurnGeneration(Session& session, const Tokenizer& tokenizer, const TurnOptions& options, Sampler& sampler,
                 std::function<bool(const TurnDelta&)> on_delta);
  TurnGeneration(const TurnGeneration&) = delete;
  TurnGeneration& operator=(const TurnGeneration&) = delete;

  // Runs `prompt` (the whole conversation's ids: the session's cached prefix is reused).
  Status Start(std::span<const int32_t> prompt) { return generation_.Start(prompt); }
  Generation& generation() { return generation_; }
  // After the generation has ended: passes on what the decoder, the stop strings and the parser
  // still hold (on_delta can no longer stop anything) and returns the whole turn, parsed.
  ParsedOutput Finish(GenerateStats* stats);

 private:
  // Collects into all_ and passes on with the log-probabilities not yet passed on (a piece with
  // neither text nor, when `last`, log-probabilities is not passed on); false when the caller
  // wants to stop.
  bool Emit(TurnDelta d, bool last = false);
  TurnDelta TextDelta(std::string text);

  const TurnOptions& options_;
  std::function<bool(const TurnDelta&)> on_delta_;
  StreamingDecoder decoder_;
  StreamingOutputParser parser_;
  StopStrings stops_;
  ParsedOutput all_;
  std::vector<TokenLogprob> unsent_logprobs_, unsent_prompt_logprobs_;
  std::optional<TurnConstraint> constraint_;
  bool raw_answer_ = false;  // the constrained answer is plain content: its text skips the parser
  Generation generation_;
};

// Generates one turn for `prompt` start to end (TurnGeneration stepped with Session::Eval).
StatusOr<ParsedOutput> GenerateTurn(Session& session, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                                    const TurnOptions& options, Sampler& sampler,
                                    const std::function<bool(const TurnDelta&)>& on_delta, GenerateStats* stats);

// The OpenAI-style assistant message of a turn, to append to the conversation's messages:
// {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}.
nlohmann::ordered_json AssistantMessage(const ParsedOutput& out);
// One tool call as it appears in an assistant message's tool_calls (arguments as an object).
nlohmann::ordered_json ToolCallJson(const ToolCall& call);
// Compact JSON text of generated output: a model can emit invalid UTF-8, which is replaced
// (U+FFFD) rather than thrown on.
std::string JsonText(const nlohmann::ordered_json& j);

}  // namespace m3
