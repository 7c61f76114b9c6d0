// Chat prompts rendered by the model's own Jinja chat template, the way Hugging Face
// transformers' apply_chat_template(tokenize=False) does: same variables (messages, tools,
// documents, add_generation_prompt, the tokenizer's special-token strings, raise_exception,
// strftime_now), same Jinja configuration. A new template works without code changes.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"
#include "text/jinja.h"

namespace m3 {

class ChatTemplate {
 public:
  // `dir_or_file`: a folder holding chat_template.jinja (else the `chat_template` field of its
  // tokenizer_config.json), a .jinja file, or a tokenizer_config.json. Special-token strings
  // (bos_token, eos_token, ...) come from a tokenizer_config.json beside it when there is one.
  static StatusOr<ChatTemplate> Load(const std::string& dir_or_file);
  // From template text; `name` labels error messages.
  static StatusOr<ChatTemplate> FromString(const std::string& source,
                                           const std::string& name = "chat_template",
                                           std::map<std::string, std::string> special_tokens = {});

  // `messages`: an array of message objects (tool-call arguments as objects, not JSON strings);
  // `tools`: an array of tool schemas, or null; `options`: an object (or null) whose members
  // become template variables (add_generation_prompt, thinking_mode, ...). Key order is kept
  // as given, which matters wherever the template prints JSON (tool schemas, arguments): pass
  // ordered_json to keep the request's order (nlohmann::json sorts keys).
  // A template's raise_exception(msg) comes back as InvalidArgument with exactly msg.
  StatusOr<std::string> Render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                               const nlohmann::ordered_json& options) const;
  StatusOr<std::string> Render(const nlohmann::json& messages, const nlohmann::json& tools,
                               const nlohmann::json& options) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
  jinja::Template template_;
  std::map<std::string, std::string> special_tokens_;
};

}  // namespace m3
