#include "runtime/chat.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <utility>

namespace m3 {

using ojson = nlohmann::ordered_json;

StatusOr<std::unique_ptr<ChatText>> ChatText::Load(const std::string& dir, bool require_template) {
  std::unique_ptr<ChatText> text(new ChatText());
  M3_ASSIGN_OR_RETURN(text->tokenizer_, Tokenizer::Load(dir));
  auto tmpl = ChatTemplate::Load(dir);
  if (tmpl.ok()) {
    text->template_ = std::move(tmpl).value();
  } else if (require_template || tmpl.status().code() != StatusCode::kNotFound) {
    // A template that exists but does not load is an error even where it is optional: silently
    // falling back to raw text would hide it.
    return tmpl.status();
  } else {
    text->template_error_ = tmpl.status();
  }
  for (const char* s : {"[e~[", "]~b]", "]~!b["}) {  // end of turn, plus defensive stops (docs/MODEL.md §6.5)
    const int32_t id = text->tokenizer_->TokenId(s);
    if (id >= 0) text->stop_ids_.push_back(id);
  }
  return text;
}

StatusOr<std::string> ChatText::Render(const ojson& messages, const ojson& tools, const ojson& options) const {
  // The load error names the folder; a client is told what is missing without the server's paths.
  if (!template_)
    return Status(template_error_.code(), "this model has no chat template (chat_template.jinja or a chat_template "
                                          "in tokenizer_config.json): only completions are served");
  return template_->Render(messages, tools, options);
}

namespace {

// Literal content: each message's text goes through the template between two marks (private-use
// code points around a random nonce, so that no text can forge one), which are then taken out of
// the rendering, leaving the byte ranges they enclosed. The marks travel with the text wherever
// the template puts it.
struct LiteralMarks {
  std::string open, close;
  LiteralMarks() {
    static std::atomic<uint64_t> counter{0};
    const uint64_t nonce = (static_cast<uint64_t>(std::random_device()()) << 32) ^ ++counter;
    const std::string hex = Str(std::hex, nonce);
    open = "\uE000" + hex + "\uE000";
    close = "\uE001" + hex + "\uE001";
  }

  // Non-empty text only: an empty one must stay falsy for the template.
  void Wrap(ojson& text) const {
    if (text.is_string() && !text.get_ref<const std::string&>().empty())
      text = open + text.get<std::string>() + close;
  }
  ojson WrapMessages(const ojson& messages) const {
    ojson out = messages;
    for (ojson& m : out) {
      if (!m.is_object() || !m.contains("content") || m.value("role", std::string()) == "assistant") continue;
      ojson& content = m["content"];
      Wrap(content);
      if (content.is_array())
        for (ojson& part : content) {
          Wrap(part);
          if (part.is_object() && part.contains("text")) Wrap(part["text"]);
        }
    }
    return out;
  }
  // Takes the marks out of `rendered`; the byte ranges they enclosed, in order.
  std::vector<std::pair<size_t, size_t>> Take(std::string& rendered) const {
    std::string out;
    std::vector<std::pair<size_t, size_t>> ranges;
    constexpr size_t kNone = std::string::npos;
    size_t begin = kNone;  // of the range open now
    for (size_t pos = 0;;) {
      const size_t o = rendered.find(open, pos), c = rendered.find(close, pos), next = std::min(o, c);
      out.append(rendered, pos, next == kNone ? kNone : next - pos);
      if (next == kNone) break;
      if (next == o) {
        if (begin == kNone) begin = out.size();
        pos = o + open.size();
      } else {
        if (begin != kNone && begin < out.size()) ranges.emplace_back(begin, out.size());
        begin = kNone;
        pos = c + close.size();
      }
    }
    if (begin != kNone && begin < out.size()) ranges.emplace_back(begin, out.size());
    rendered = std::move(out);
    return ranges;
  }
};

}  // namespace

StatusOr<std::vector<int32_t>> ChatText::TurnPrompt(const ojson& messages, const ojson& tools, ojson options,
                                                    TurnOptions* turn, bool literal_content) const {
  if (options.is_null()) options = ojson::object();
  if (!options.is_object()) return InvalidArgument("chat options must be a JSON object");
  options["add_generation_prompt"] = true;
  std::string rendered;
  std::vector<std::pair<size_t, size_t>> literal;
  if (literal_content) {  // only then a nonce and a copy of the messages
    const LiteralMarks marks;
    M3_ASSIGN_OR_RETURN(rendered, Render(marks.WrapMessages(messages), tools, options));
    literal = marks.Take(rendered);
  } else {
    M3_ASSIGN_OR_RETURN(rendered, Render(messages, tools, options));
  }
  turn->start = OutputStart(rendered);
  turn->tools = nlohmann::json(tools);  // the parser takes unordered json: converted node by node
  return tokenizer_->Encode(rendered, literal);
}

StopStrings::StopStrings(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string StopStrings::Push(std::string_view piece) {
  if (matched_) return {};
  held_ += piece;
  size_t first = std::string::npos;  // the earliest match of any stop string
  for (const std::string& s : stops_)
    if (const size_t at = held_.find(s); at < first) {
      first = at;
      match_ = s;
    }
  if (first != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold the longest tail that is a proper prefix of a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(s.size() - 1, held_.size()); k > hold; --k)
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopStrings::Flush() {
  std::string out = matched_ ? std::string() : std::move(held_);
  held_.clear();
  return out;
}

StatusOr<std::vector<std::string>> ParseStopStrings(const ojson& stop, size_t max_count) {
  std::vector<std::string> out;
  if (stop.is_null()) return out;
  const ojson list = stop.is_string() ? ojson::array({stop}) : stop;
  if (!list.is_array() || list.size() > max_count)
    return InvalidArgument(max_count == SIZE_MAX ? "\"stop\" must be a string or an array of strings"
                                                 : Str("\"stop\" must be a string or an array of at most ",
                                                       max_count, " strings"));
  for (const ojson& s : list) {
    if (!s.is_string() || s.get<std::string>().empty()) return InvalidArgument("\"stop\" must hold non-empty strings");
    out.push_back(s.get<std::string>());
  }
  return out;
}

std::shared_ptr<const constrain::VocabIndex> ChatText::vocab_index() const {
  std::call_once(vocab_once_, [this] { vocab_index_ = constrain::VocabIndex::Build(*tokenizer_); });
  return vocab_index_;
}

ThinkState OutputStart(std::string_view rendered_prompt) {
  return rendered_prompt.ends_with("<mm:think>") ? ThinkState::kInside : ThinkState::kOutside;
}

TurnGeneration::TurnGeneration(Session& session, const Tokenizer& tokenizer, const TurnOptions& options,
                               Sampler& sampler, std::function<bool(const TurnDelta&)> on_delta)
    : options_(options),
      on_delta_(std::move(on_delta)),
      decoder_(tokenizer, /*skip_special_tokens=*/false),
      parser_(options.start, options.tools, options.tool_call_id_prefix),
      stops_(options.stop_strings),
      generation_(session, options.generate, sampler, [this](int32_t id) {
        if (constraint_ && constraint_->Accept(id) && !raw_answer_) {
          raw_answer_ = true;  // what the parser holds is before the answer
          if (!Emit(parser_.Finish())) return false;
        }
        if (options_.top_logprobs >= 0)
          unsent_logprobs_.push_back(
              ScoreToken(generation_.token_logits(), id, static_cast<size_t>(options_.top_logprobs)));
        const bool go = Emit(TextDelta(stops_.Push(decoder_.Push(id))));
        return go && !stops_.matched();
      }) {
  if (!options.constraint.empty()) {
    constraint_.emplace(options.constraint, options.start, MarkupIds::From(tokenizer), options.generate.stop_ids,
                        options.raw);
    generation_.MaskLogits([this](std::span<float> logits, size_t left) { constraint_->Mask(logits, left); });
  }
  if (options.top_logprobs >= 0 && options.prompt_logprobs)
    generation_.ScorePrompt([this](size_t, int32_t id, std::span<const float> logits) {
      unsent_prompt_logprobs_.push_back(ScoreToken(logits, id, static_cast<size_t>(options_.top_logprobs)));
    });
}

bool TurnGeneration::Emit(TurnDelta d, bool last) {
  if (d.empty() && !(last && (!unsent_logprobs_.empty() || !unsent_prompt_logprobs_.empty()))) return true;
  d.logprobs = std::move(unsent_logprobs_);
  d.prompt_logprobs = std::move(unsent_prompt_logprobs_);
  unsent_logprobs_.clear();
  unsent_prompt_logprobs_.clear();
  all_.reasoning += d.reasoning;
  all_.content += d.content;
  all_.tool_calls.insert(all_.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
  return on_delta_(d);
}

TurnDelta TurnGeneration::TextDelta(std::string text) {
  if (!options_.raw && !raw_answer_) return parser_.Push(text);
  TurnDelta d;
  d.content = std::move(text);
  return d;
}

ParsedOutput TurnGeneration::Finish(GenerateStats* stats) {
  Emit(TextDelta(stops_.Push(decoder_.Flush())));
  Emit(TextDelta(stops_.Flush()));
  if (!options_.raw && !raw_answer_) Emit(parser_.Finish());
  Emit(TurnDelta(), /*last=*/true);  // log-probabilities of tokens whose text never came out
  GenerateStats st = generation_.stats();
  if (stops_.matched()) {
    st.stop_reason = "stop";
    st.stop_string = stops_.match();
  }
  if (stats) *stats = st;
  return std::move(all_);
}

StatusOr<ParsedOutput> GenerateTurn(Session& session, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                                    const TurnOptions& options, Sampler& sampler,
                                    const std::function<bool(const TurnDelta&)>& on_delta, GenerateStats* stats) {
  TurnGeneration turn(session, tokenizer, options, sampler, on_delta);
  M3_RETURN_IF_ERROR(turn.Start(prompt));
  M3_RETURN_IF_ERROR(turn.generation().Run());
  return turn.Finish(stats);
}

ojson ToolCallJson(const ToolCall& call) {
  return {{"id", call.id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

std::string JsonText(const ojson& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

ojson AssistantMessage(const ParsedOutput& out) {
  ojson m = {{"role", "assistant"}, {"content", out.content}};
  if (!out.reasoning.empty()) m["reasoning_content"] = out.reasoning;
  if (!out.tool_calls.empty()) {
    m["tool_calls"] = ojson::array();
    for (const auto& c : out.tool_calls) m["tool_calls"].push_back(ToolCallJson(c));
  }
  return m;
}

}  // namespace m3
