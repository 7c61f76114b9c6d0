#include "runtime/output_constraint.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <utility>

#include "runtime/chat.h"

namespace m3 {

MarkupIds MarkupIds::From(const Tokenizer& tokenizer) {
  return {.think_open = tokenizer.TokenId("<mm:think>"),
          .think_close = tokenizer.TokenId("</mm:think>"),
          .ns = tokenizer.TokenId("]<]minimax[>[")};
}

StatusOr<std::shared_ptr<const constrain::Grammar>> CompileUserGrammar(std::string_view gbnf,
                                                                       const constrain::VocabIndex& vocab,
                                                                       const constrain::CompileBudget& budget) {
  M3_ASSIGN_OR_RETURN(auto g, constrain::CompileGbnf(gbnf, budget));
  M3_RETURN_IF_ERROR(constrain::CheckGrammarTokens(*g, vocab));
  return g;
}

namespace {

// A grammar the constrained decoder cannot follow from its start is refused as that (not as a
// reply that would need more tokens than any budget).
Status Followable(const std::shared_ptr<const constrain::Grammar>& g, const OutputConstraint& c,
                  std::string_view field) {
  if (!g) return Status::Ok();
  const Status s = constrain::Matcher(g, c.vocab, {}).StartStatus();
  if (!s.ok()) return InvalidArgument(field, ": ", s.message());
  return Status::Ok();
}

}  // namespace

StatusOr<OutputConstraint> BuildConstraint(const OutputSpec& spec, const nlohmann::ordered_json& tools,
                                           const ChatText& text, const constrain::CompileBudget& budget) {
  using Spec = OutputSpec;
  // Each grammar compiles within what is left of the request's time.
  const auto start = std::chrono::steady_clock::now();
  auto left = [&] {
    constrain::CompileBudget b = budget;
    if (b.request_seconds <= 0) b.request_seconds = budget.seconds;
    b.seconds -= std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return b;
  };
  OutputConstraint c;
  const bool forced = spec.tool_choice != Spec::ToolChoice::kAuto;
  bool strict = false;
  std::vector<constrain::ToolSpec> specs;
  for (size_t i = 0; tools.is_array() && i < tools.size(); ++i) {
    const nlohmann::ordered_json& t = tools[i];
    const auto* f = t.is_object() && t.contains("function") && t["function"].is_object() ? &t["function"] : nullptr;
    if (!f || !f->contains("name") || !(*f)["name"].is_string())
      return InvalidArgument("\"tools[", i, "].function.name\" is missing (a tool is {\"type\": \"function\", "
                             "\"function\": {\"name\", \"parameters\"}})");
    strict = strict || f->value("strict", nlohmann::ordered_json(false)) == true;
    const std::string name = (*f)["name"].get<std::string>();
    if (spec.tool_choice == Spec::ToolChoice::kNamed && spec.tool_name != name) continue;
    // lib/constrain reads schemas as nlohmann::json (its keys sorted): converted node by node.
    const bool has_params = f->contains("parameters") && !(*f)["parameters"].is_null();
    specs.push_back({name, has_params ? nlohmann::json((*f)["parameters"])
                                      : nlohmann::json{{"type", "object"}, {"properties", nlohmann::json::object()}}});
  }
  c.reasoning_budget = static_cast<size_t>(std::max(0, spec.reasoning_budget));
  if (!forced && spec.answer == Spec::Answer::kFree && !strict) return c;
  c.vocab = text.vocab_index();
  if (forced || strict) {
    M3_ASSIGN_OR_RETURN(const constrain::MarkupTokens markup, constrain::MarkupTokens::From(text.tokenizer()));
    auto g = constrain::CompileToolCalls(specs, markup, !spec.parallel_tool_calls, left());
    if (!g.ok()) return InvalidArgument("\"tools\": ", g.status().message());
    M3_RETURN_IF_ERROR(Followable(*g, c, "\"tools\""));
    if (forced) {
      c.answer = *g;
      c.answer_is_markup = true;
      return c;
    }
    c.tool_block = *g;
  }
  switch (spec.answer) {
    case Spec::Answer::kFree:
      break;
    case Spec::Answer::kGrammar: {
      auto g = CompileUserGrammar(spec.grammar, *c.vocab, left());
      if (!g.ok()) return InvalidArgument("\"grammar\": ", g.status().message());
      M3_RETURN_IF_ERROR(Followable(*g, c, "\"grammar\""));
      c.answer = *g;
      break;
    }
    case Spec::Answer::kJsonObject:
      c.answer = constrain::AnyJsonObject();
      break;
    case Spec::Answer::kJsonSchema: {
      auto g = constrain::CompileJsonSchema(nlohmann::json(spec.schema), left());
      if (!g.ok()) return InvalidArgument("\"response_format.json_schema.schema\": ", g.status().message());
      M3_RETURN_IF_ERROR(Followable(*g, c, "\"response_format.json_schema.schema\""));
      c.answer = *g;
      break;
    }
  }
  return c;
}

size_t MinTurnTokens(const OutputConstraint& c, ThinkState start) {
  if (!c.answer) return 1;  // an end id
  const constrain::Matcher m(c.answer, c.vocab, {});
  return m.MinTokens() + (start == ThinkState::kInside ? 1 : 0);
}

TurnConstraint::TurnConstraint(const OutputConstraint& c, ThinkState start, const MarkupIds& ids,
                               std::vector<int32_t> stop_ids, bool raw)
    : constraint_(c), ids_(ids), stop_ids_(std::move(stop_ids)) {
  if (raw)
    phase_ = c.answer ? Phase::kAnswer : Phase::kFree;
  else
    phase_ = start == ThinkState::kInside ? Phase::kReasoning : Phase::kStart;
  if (c.answer) answer_.emplace(c.answer, c.vocab, stop_ids_);
  if (c.tool_block) tool_.emplace(c.tool_block, c.vocab, stop_ids_);
}

size_t TurnConstraint::AnswerNeeds() const { return answer_ ? answer_->MinTokens() : 1; }

void TurnConstraint::MaskAllBut(std::span<float> logits, std::span<const int32_t> keep) const {
  std::vector<float> kept;
  for (int32_t id : keep) kept.push_back(id >= 0 && static_cast<size_t>(id) < logits.size() ? logits[id] : 0.0f);
  std::fill(logits.begin(), logits.end(), -std::numeric_limits<float>::infinity());
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i] >= 0 && static_cast<size_t>(keep[i]) < logits.size()) logits[keep[i]] = kept[i];
}

void TurnConstraint::Mask(std::span<float> logits, size_t tokens_left) {
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  auto in_vocab = [&](int32_t id) { return id >= 0 && static_cast<size_t>(id) < logits.size(); };
  switch (phase_) {
    case Phase::kReasoning:
      if (constraint_.reasoning_budget > 0 && reasoning_tokens_ >= constraint_.reasoning_budget &&
          in_vocab(ids_.think_close)) {
        const int32_t close[] = {ids_.think_close};
        return MaskAllBut(logits, close);
      }
      if (!answer_) return;  // a free answer may also end inside reasoning
      // Another reasoning token must leave room for the close and the whole answer.
      if (tokens_left < AnswerNeeds() + 2 && in_vocab(ids_.think_close)) {
        const int32_t close[] = {ids_.think_close};
        return MaskAllBut(logits, close);
      }
      for (int32_t id : stop_ids_)
        if (in_vocab(id)) logits[id] = kNever;  // the turn may not end before its answer
      return;
    case Phase::kStart:
      if (answer_) {
        // The answer, or reasoning first (a leading <mm:think>) while there is room for it.
        const float open = in_vocab(ids_.think_open) ? logits[ids_.think_open] : kNever;
        answer_->ApplyMask(logits, tokens_left);
        if (in_vocab(ids_.think_open) && tokens_left >= AnswerNeeds() + 3) logits[ids_.think_open] = open;
        return;
      }
      [[fallthrough]];
    case Phase::kFree:
      // A tool block may start only where it can still be finished.
      if (tool_ && in_vocab(ids_.ns) && tokens_left < tool_->MinTokens()) logits[ids_.ns] = kNever;
      return;
    case Phase::kAnswer:
      return answer_->ApplyMask(logits, tokens_left);
    case Phase::kTool:
      return tool_->ApplyMask(logits, tokens_left);
  }
}

void TurnConstraint::StartAnswer(int32_t id) {
  if (answer_) {
    phase_ = Phase::kAnswer;
    answer_->Accept(id);
  } else if (tool_ && id == ids_.ns) {
    phase_ = Phase::kTool;
    tool_->Accept(id);
  } else {
    phase_ = Phase::kFree;
  }
}

bool TurnConstraint::Accept(int32_t id) {
  switch (phase_) {
    case Phase::kStart:
      if (id == ids_.think_open) {
        phase_ = Phase::kReasoning;
        return false;
      }
      StartAnswer(id);
      return RawAnswer();
    case Phase::kReasoning:
      if (id == ids_.think_close) phase_ = answer_ ? Phase::kAnswer : Phase::kFree;
      else ++reasoning_tokens_;
      return false;  // the close is the parser's
    case Phase::kFree:
      if (tool_ && id == ids_.ns) StartAnswer(id);
      return false;
    case Phase::kAnswer:
      answer_->Accept(id);
      return RawAnswer();
    case Phase::kTool:
      tool_->Accept(id);
      return false;
  }
  return false;
}

}  // namespace m3
