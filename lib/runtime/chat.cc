#include "runtime/chat.h"

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
  for (const char* s : {"[e~[", "]~b]", "]~!b["}) {  // end of turn, plus defensive stops (§5)
    const int32_t id = text->tokenizer_->TokenId(s);
    if (id >= 0) text->stop_ids_.push_back(id);
  }
  return text;
}

StatusOr<std::string> ChatText::Render(const ojson& messages, const ojson& tools, const ojson& options) const {
  if (!template_) return template_error_;
  return template_->Render(messages, tools, options);
}

StatusOr<std::string> ChatText::RenderPrompt(const ojson& messages, const ojson& tools, ojson options) const {
  if (options.is_null()) options = ojson::object();
  if (!options.is_object()) return InvalidArgument("chat options must be a JSON object");
  options["add_generation_prompt"] = true;
  return Render(messages, tools, options);
}

ThinkState OutputStart(std::string_view rendered_prompt) {
  return rendered_prompt.ends_with("<mm:think>") ? ThinkState::kInside : ThinkState::kOutside;
}

StatusOr<ParsedOutput> GenerateTurn(Session& session, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                                    const TurnOptions& options, Sampler& sampler,
                                    const std::function<bool(const TurnDelta&)>& on_delta, GenerateStats* stats) {
  StreamingDecoder decoder(tokenizer, /*skip_special_tokens=*/false);
  StreamingOutputParser parser(options.start, options.tools, options.tool_call_id_prefix);
  ParsedOutput all;
  // Collects a delta into `all` and passes it on; false when the caller wants to stop.
  auto emit = [&](TurnDelta d) {
    if (d.empty()) return true;
    all.reasoning += d.reasoning;
    all.content += d.content;
    all.tool_calls.insert(all.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
    return on_delta(d);
  };
  auto text_delta = [&](std::string text) {
    if (!options.raw) return parser.Push(text);
    TurnDelta d;
    d.content = std::move(text);
    return d;
  };
  M3_RETURN_IF_ERROR(Generate(session, prompt, options.generate, sampler,
                              [&](int32_t id) { return emit(text_delta(decoder.Push(id))); }, stats));
  // What the decoder and the parser still hold; the caller may no longer stop anything here.
  emit(text_delta(decoder.Flush()));
  if (!options.raw) emit(parser.Finish());
  return all;
}

ojson ToolCallJson(const ToolCall& call) {
  return {{"id", call.id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

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
