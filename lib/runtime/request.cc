#include "runtime/request.h"

#include <mutex>
#include <random>
#include <string>

namespace m3 {
namespace {

// The request field that asks for constrained output, for messages (in OpenAI's names, which the
// Anthropic endpoint's fields map onto).
std::string ConstraintField(const OutputSpec& spec) {
  if (spec.tool_choice != OutputSpec::ToolChoice::kAuto) return "\"tool_choice\"";
  if (spec.answer == OutputSpec::Answer::kGrammar) return "\"grammar\"";
  if (spec.answer != OutputSpec::Answer::kFree) return "\"response_format\"";
  return "\"tools\" (strict)";
}

// The prompt ids of choice `choice`: the conversation rendered, or its completions prompt.
StatusOr<std::vector<int32_t>> PromptIds(const ChatText& text, const Request& r, size_t choice, TurnOptions* turn) {
  const size_t prompt_index = choice / static_cast<size_t>(r.n);
  if (r.chat) return text.TurnPrompt(r.messages, r.tools, r.template_options, turn, r.literal_content);
  if (prompt_index >= r.prompts.size())
    return InvalidArgument("no prompt ", prompt_index, " in a request of ", r.prompts.size());
  const CompletionPrompt& p = r.prompts[prompt_index];
  if (!p.text.empty()) return text.tokenizer().Encode(p.text);
  for (const int32_t t : p.ids)
    if (static_cast<size_t>(t) >= text.tokenizer().vocab_size())
      return InvalidArgument("\"prompt\": token id ", t, " is outside the vocabulary (", text.tokenizer().vocab_size(),
                             " ids)");
  return p.ids;
}

}  // namespace

uint64_t FreshSeed() {
  static std::random_device device;
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  return (static_cast<uint64_t>(device()) << 32 | device()) & ((uint64_t{1} << 53) - 1);
}

size_t ChoiceCount(const Request& r) { return (r.chat ? 1 : r.prompts.size()) * static_cast<size_t>(r.n); }

SamplingParams ChoiceSampling(const Request& r, size_t choice) {
  SamplingParams p = r.sampling;
  p.seed += choice % static_cast<size_t>(r.n);
  return p;
}

StatusOr<std::vector<int32_t>> TurnInputs(const ChatText& text, const Request& r, const std::string& id,
                                          size_t max_context, TurnOptions* turn, size_t choice,
                                          const OutputConstraint* built) {
  turn->raw = !r.chat;
  turn->generate = GenerateOptions{r.max_tokens, text.stop_ids(), r.lookup};
  turn->tool_call_id_prefix = r.tool_call_id_prefix + id + "_" + (choice > 0 ? std::to_string(choice) + "_" : "");
  turn->stop_strings = r.stop;
  turn->top_logprobs = r.logprobs;
  turn->prompt_logprobs = !r.chat && r.echo && r.logprobs >= 0;
  M3_ASSIGN_OR_RETURN(std::vector<int32_t> ids, PromptIds(text, r, choice, turn));
  if (ids.empty()) return InvalidArgument("the prompt encodes to no tokens");
  if (ids.size() > max_context)
    return OutOfRange("the prompt has ", ids.size(), " tokens but the context limit is ", max_context);
  if (built) {
    turn->constraint = *built;
  } else {
    M3_ASSIGN_OR_RETURN(turn->constraint, BuildConstraint(r.output, r.tools, text));
  }
  if (turn->constraint.answer || turn->constraint.tool_block) {
    // A reply under a constraint is complete and valid whatever the model, if it has the room.
    const std::string field = ConstraintField(r.output);
    if (!r.stop.empty())
      return InvalidArgument("\"stop\" cannot be combined with constrained output (", field,
                             "): a stop string would cut the reply short of its format");
    const size_t need = MinTurnTokens(turn->constraint, turn->start);
    if (static_cast<size_t>(r.max_tokens) < need)
      return InvalidArgument("\"max_tokens\" is ", r.max_tokens, " but a reply in the format ", field,
                             " asks for needs at least ", need, " tokens");
    if (need > max_context - ids.size() + 1)  // ids.size() + need > max_context + 1, SIZE_MAX included
      return OutOfRange("the prompt has ", ids.size(), " tokens and a reply in the format ", field,
                        " asks for needs at least ", need, ", past the context limit of ", max_context);
  }
  return ids;
}

int HttpStatus(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return 400;
    case StatusCode::kOutOfMemory:  // memory others hold now (one that can never fit is kOutOfRange)
    case StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

}  // namespace m3
