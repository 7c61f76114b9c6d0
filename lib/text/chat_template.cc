#include "text/chat_template.h"
#include "base/json_guard.h"

#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

namespace m3 {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

Status ReadText(const fs::path& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open ", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return IoError("cannot read ", path.string());
  out = ss.str();
  return Status::Ok();
}

StatusOr<ojson> ReadJson(const fs::path& path) {
  std::string text;
  M3_RETURN_IF_ERROR(ReadText(path, text));
  StatusOr<ojson> j = ParseJson<ojson>(text, path.string());
  if (!j.ok()) return Corrupt(j.status().message());
  return j;
}

// tokenizer_config.json's chat_template: a string, or (newer configs) a list of named
// templates of which transformers uses the one called "default".
StatusOr<std::string> TemplateFromConfig(const ojson& config, const std::string& where) {
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return NotFound(where, " has no chat_template");
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const auto& entry : *it) {
      if (entry.is_object() && entry.contains("name") && entry["name"] == "default" &&
          entry.contains("template") && entry["template"].is_string())
        return entry["template"].get<std::string>();
    }
    return NotFound(where, ": chat_template lists no template named \"default\"");
  }
  return Corrupt(where, ": chat_template must be a string or a list of {name, template}");
}

// The special-token strings transformers passes to every template (special_tokens_map).
std::map<std::string, std::string> SpecialTokens(const ojson& config) {
  std::map<std::string, std::string> out;
  for (const char* key :
       {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    auto it = config.find(key);
    if (it == config.end()) continue;
    if (it->is_string()) {
      out[key] = it->get<std::string>();
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      out[key] = (*it)["content"].get<std::string>();
    }
  }
  return out;
}

// transformers' strftime_now(format): the current local time.
StatusOr<jinja::Value> StrftimeNow(const jinja::CallArgs& args) {
  if (args.positional.size() != 1 || !args.positional[0].is_string() || !args.keyword.empty())
    return InvalidArgument("strftime_now expects one format string");
  std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[512];
  size_t n = std::strftime(buf, sizeof buf, args.positional[0].string_value().c_str(), &local);
  return jinja::Value::Str(std::string(buf, n));
}

StatusOr<jinja::Value> RaiseException(const jinja::CallArgs& args) {
  std::string message =
      args.positional.empty() ? std::string("raise_exception called") : args.positional[0].ToStr();
  return InvalidArgument(message);
}

}  // namespace

StatusOr<ChatTemplate> ChatTemplate::FromString(const std::string& source, const std::string& name,
                                                std::map<std::string, std::string> special_tokens) {
  jinja::Options options;  // transformers: trim_blocks, lstrip_blocks, no trailing newline kept
  options.name = name;
  M3_ASSIGN_OR_RETURN(jinja::Template t, jinja::Template::Parse(source, options));
  ChatTemplate ct;
  ct.source_ = source;
  ct.template_ = std::move(t);
  ct.special_tokens_ = std::move(special_tokens);
  return ct;
}

StatusOr<ChatTemplate> ChatTemplate::Load(const std::string& dir_or_file) {
  std::error_code ec;
  fs::path path(dir_or_file);
  fs::path dir = fs::is_directory(path, ec) ? path : path.parent_path();
  fs::path config_path = dir / "tokenizer_config.json";
  std::map<std::string, std::string> special_tokens;
  std::optional<ojson> config;
  if (fs::is_regular_file(config_path, ec)) {
    M3_ASSIGN_OR_RETURN(ojson j, ReadJson(config_path));
    if (!j.is_object()) return Corrupt(config_path.string(), ": expected a JSON object");
    special_tokens = SpecialTokens(j);
    config = std::move(j);
  }

  fs::path template_path;
  if (fs::is_directory(path, ec)) {
    template_path = path / "chat_template.jinja";
    if (!fs::is_regular_file(template_path, ec)) {
      if (!config) return NotFound(path.string(), ": no chat_template.jinja and no tokenizer_config.json");
      M3_ASSIGN_OR_RETURN(std::string source, TemplateFromConfig(*config, config_path.string()));
      return FromString(source, config_path.string(), std::move(special_tokens));
    }
  } else if (path.extension() == ".json") {
    M3_ASSIGN_OR_RETURN(ojson j, ReadJson(path));
    if (!j.is_object()) return Corrupt(path.string(), ": expected a JSON object");
    M3_ASSIGN_OR_RETURN(std::string source, TemplateFromConfig(j, path.string()));
    return FromString(source, path.string(), SpecialTokens(j));
  } else {
    template_path = path;
  }
  std::string source;
  M3_RETURN_IF_ERROR(ReadText(template_path, source));
  return FromString(source, template_path.string(), std::move(special_tokens));
}

StatusOr<std::string> ChatTemplate::Render(const ojson& messages, const ojson& tools,
                                           const ojson& options) const {
  if (!messages.is_array()) return InvalidArgument("chat template: messages must be an array");
  if (!tools.is_null() && !tools.is_array())
    return InvalidArgument("chat template: tools must be an array or null");
  if (!options.is_null() && !options.is_object())
    return InvalidArgument("chat template: options must be an object");

  std::map<std::string, jinja::Value> vars;
  for (const auto& [k, v] : special_tokens_) vars[k] = jinja::Value::Str(v);
  vars["documents"] = jinja::Value::None();
  vars["add_generation_prompt"] = jinja::Value::Bool(false);
  if (options.is_object()) {
    for (auto it = options.begin(); it != options.end(); ++it) {
      if (it.key() == "messages" || it.key() == "tools")
        return InvalidArgument("chat template: option '", it.key(), "' would replace the ", it.key(),
                               " argument");
      vars[it.key()] = jinja::Value::FromJson(it.value());
    }
  }
  vars["messages"] = jinja::Value::FromJson(messages);
  vars["tools"] = jinja::Value::FromJson(tools);  // null -> None, as transformers passes tools=None
  vars["raise_exception"] = jinja::Value::MakeFunction("raise_exception", RaiseException);
  vars["strftime_now"] = jinja::Value::MakeFunction("strftime_now", StrftimeNow);
  return template_.Render(vars);
}

StatusOr<std::string> ChatTemplate::Render(const nlohmann::json& messages, const nlohmann::json& tools,
                                           const nlohmann::json& options) const {
  return Render(ojson(messages), ojson(tools), ojson(options));
}

}  // namespace m3
