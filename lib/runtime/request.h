// The request of `m3 serve` and `m3 batch` whatever API it came by: what an OpenAI
// (runtime/openai.h) or Anthropic (runtime/anthropic.h) body asks for once its API's fields are
// read, the prompt and turn options each of its choices runs with, and what each choice ends with.
// No wire shapes and no HTTP here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"
#include "ops/sampling.h"
#include "runtime/chat.h"
#include "runtime/output_constraint.h"

namespace m3 {

// What a request may leave out: the server's settings.
struct RequestDefaults {
  SamplingParams sampling{.temperature = 1.0f, .top_k = 40, .top_p = 0.95f};  // docs/MODEL.md §6.5
  int max_tokens = 512;
  LookupOptions lookup;  // the server's (not a request field)
  // The server's: chat messages' text (but the assistant's) encoded as plain text, so that a
  // user typing "<mm:think>" cannot inject control tokens (ChatText::TurnPrompt).
  bool literal_content = false;
};

// A completions prompt: text, or token ids when `text` is empty.
struct CompletionPrompt {
  std::string text;
  std::vector<int32_t> ids;
};

struct Request {
  bool chat = true;
  // Chat: messages and tools (array or null) in the chat template's form (OpenAI's; tool-call
  // arguments as objects), template variables (e.g. thinking_mode).
  nlohmann::ordered_json messages, tools, template_options = nlohmann::ordered_json::object();
  std::vector<CompletionPrompt> prompts;  // completions: n choices each
  // Choices of each prompt. Choice c (prompt-major, as OpenAI orders them) is of prompt c / n and
  // samples with seed + c % n: the choices differ, and the request is reproducible from its seed.
  int n = 1;
  // Log-probabilities of the tokens, each with this many most likely tokens; -1: not asked.
  int logprobs = -1;
  bool echo = false;              // completions: the prompt (text, log-probabilities) before the completion
  std::vector<std::string> stop;  // stop strings (none empty)
  SamplingParams sampling;
  int max_tokens = 0;
  LookupOptions lookup;
  bool literal_content = false;  // RequestDefaults::literal_content
  bool stream = false;
  bool include_usage = false;  // a stream ends with the usage
  OutputSpec output;           // constrained output (lib/constrain); a completion's whole text
  // Tool-call ids are this + the request's id + "_" + (the choice past 0 + "_") + k.
  std::string tool_call_id_prefix = "call_";
};

// A seed for a request that gives none (each retry then samples differently, as from OpenAI and
// Anthropic); below 2^53, so that a JSON number holds it exactly.
uint64_t FreshSeed();

// The choices of a request (n per prompt; chat has one prompt), and the sampling of choice c.
size_t ChoiceCount(const Request& r);
SamplingParams ChoiceSampling(const Request& r, size_t choice);

// A request's prompt ids and turn options for choice `choice`: the conversation rendered by
// `text`'s template (chat) or its completions prompt encoded, stop ids and strings, max_tokens,
// log-probabilities, tool-call ids (Request::tool_call_id_prefix, unique in the request and
// across requests as `id` is) and the output constraint (BuildConstraint). OutOfRange when the
// prompt, or the prompt and the shortest reply its constraint allows, is longer than max_context;
// InvalidArgument for a token id outside the vocabulary or a constraint the request cannot meet.
// `built`: the request's constraint as an earlier choice built it (a request compiles its schema,
// grammar or tools once, whatever its count of choices and prompts).
StatusOr<std::vector<int32_t>> TurnInputs(const ChatText& text, const Request& r, const std::string& id,
                                          size_t max_context, TurnOptions* turn, size_t choice = 0,
                                          const OutputConstraint* built = nullptr);

// One choice's turn once it has ended: its prompt ids, the pieces it passed on, how it ended.
struct ChoiceResult {
  std::vector<int32_t> prompt;
  std::vector<TurnDelta> deltas;
  Status status;
  ParsedOutput output;
  GenerateStats stats;
};

// The HTTP status of a refused request or a failed turn: 400 for bad requests and context
// overflow (a cache budget it can never fit included), 503 for what may pass (memory others hold,
// a server draining), 500 for the rest (a folder without a chat template included).
int HttpStatus(const Status& s);

}  // namespace m3
