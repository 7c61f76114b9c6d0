// Constrained output for one assistant turn (lib/constrain does the grammars and the masks): what
// a request asks its answer to be (OutputSpec), the one place that compiles that into what the
// answer must be (BuildConstraint), and the per-turn state that masks each step's logits so that
// the answer follows it whatever the model. The reasoning before the answer stays free, but it
// must close in time for the answer to fit the token budget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "constrain/constrain.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace m3 {

class ChatText;

// What a request asks of its answer, as its API said it (runtime/request.h), before it is compiled.
struct OutputSpec {
  // Tool calls: free (the model calls a tool or not), at least one, or one named tool.
  enum class ToolChoice { kAuto, kRequired, kNamed };
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_name;            // kNamed: the tool the answer calls
  bool parallel_tool_calls = true;  // false: a forced tool call is a single call
  // The answer: free, any JSON object, JSON that follows `schema`, or text of the GBNF `grammar`.
  enum class Answer { kFree, kJsonObject, kJsonSchema, kGrammar };
  Answer answer = Answer::kFree;
  nlohmann::ordered_json schema;  // kJsonSchema, as the request gave it
  std::string grammar;            // kGrammar
  int reasoning_budget = 0;       // most reasoning tokens before the answer; 0: any
};

struct OutputConstraint {
  // The whole answer (a JSON schema, a grammar, a forced tool call); null: the answer is free.
  std::shared_ptr<const constrain::Grammar> answer;
  // The answer is M3 markup the output parser reads (a forced tool call); otherwise its text is
  // plain content (a JSON string may hold "<mm:think>" without opening reasoning).
  bool answer_is_markup = false;
  // A free answer may start a tool-call block (`]<]minimax[>[` first), which then follows this
  // grammar (tools with strict: true); null: tool calls are free too.
  std::shared_ptr<const constrain::Grammar> tool_block;
  std::shared_ptr<const constrain::VocabIndex> vocab;  // of the turn's tokenizer
  // Most reasoning tokens before the reasoning is closed (the close not counted); 0: any.
  size_t reasoning_budget = 0;
  bool empty() const { return !answer && !tool_block && reasoning_budget == 0; }
};

// A user's GBNF grammar (a request's "grammar", --grammar) compiled; refused when it names a
// token id the vocabulary lacks (it could never be finished).
StatusOr<std::shared_ptr<const constrain::Grammar>> CompileUserGrammar(std::string_view gbnf,
                                                                       const constrain::VocabIndex& vocab,
                                                                       const constrain::CompileBudget& budget = {});

// The turn's constraint from what its request asks: a forced tool call (tool_choice required or
// named), a grammar, a JSON answer, and tool calls under their schemas when any tool is strict
// (then every tool's schema must compile: the model may call any of them). `tools`: the request's
// tools in the chat template's form ([{"type": "function", "function": {"name", "parameters"?,
// "strict"?}}], or null). InvalidArgument naming the request field at fault ("tools", "grammar",
// "response_format.json_schema.schema"). `budget` is the whole request's: its grammars compile
// within its time together, and stop when it says (the client left).
StatusOr<OutputConstraint> BuildConstraint(const OutputSpec& spec, const nlohmann::ordered_json& tools,
                                           const ChatText& text, const constrain::CompileBudget& budget = {});

// The markup tokens a turn's constraint needs to know (-1 where the vocabulary lacks one).
struct MarkupIds {
  int32_t think_open = -1, think_close = -1, ns = -1;
  static MarkupIds From(const Tokenizer& tokenizer);
};

// The fewest tokens a turn under `c` needs, starting in `start` (reasoning still to close
// included): max_tokens below it cannot give a valid answer.
size_t MinTurnTokens(const OutputConstraint& c, ThinkState start);

// One turn's state: Mask before each token is sampled, Accept with each token generated.
class TurnConstraint {
 public:
  // stop_ids: the ids that end the turn (allowed once the answer is complete). raw: the whole
  // output is the answer from its first token (a completions prompt: no reasoning, no markup).
  TurnConstraint(const OutputConstraint& c, ThinkState start, const MarkupIds& ids, std::vector<int32_t> stop_ids,
                 bool raw = false);
  // Sets the logits of the tokens that may not come next to -infinity; tokens_left counts the
  // tokens the turn may still emit, this one included.
  void Mask(std::span<float> logits, size_t tokens_left);
  // After a token was generated (one Mask allowed): true when it belongs to an answer of plain
  // content, whose text then bypasses the output parser.
  bool Accept(int32_t id);

 private:
  enum class Phase { kStart, kReasoning, kAnswer, kFree, kTool };
  // Tokens the answer needs from here (its end id included), once reasoning is closed.
  size_t AnswerNeeds() const;
  void MaskAllBut(std::span<float> logits, std::span<const int32_t> keep) const;
  void StartAnswer(int32_t id);
  bool RawAnswer() const { return phase_ == Phase::kAnswer && !constraint_.answer_is_markup; }

  OutputConstraint constraint_;
  MarkupIds ids_;
  std::vector<int32_t> stop_ids_;
  Phase phase_;
  size_t reasoning_tokens_ = 0;
  std::optional<constrain::Matcher> answer_, tool_;
};

}  // namespace m3
