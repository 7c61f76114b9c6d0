// m3 tokenize / m3 template: JSON lines in, JSON lines out (the shapes of the tokenizer goldens).
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "base/json_guard.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

void PrintLine(const ojson& j) {
  // Invalid UTF-8 (impossible from the tokenizer, possible from a bad request echo) is replaced.
  std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n' << std::flush;
}

// Every stdin line is one request; a malformed line gets an {"error": ...} line, never an abort.
template <class Fn>
int ForEachJsonLine(Fn&& fn) {
  std::string line;
  int rc = 0;
  while (std::getline(std::cin, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const StatusOr<ojson> parsed = ParseJson<ojson>(line, "the request line");
    if (!parsed.ok() || !parsed->is_object()) {
      PrintLine({{"error", parsed.ok() ? "the request line is not a JSON object" : parsed.status().message()}});
      rc = 1;
      continue;
    }
    ojson req = *parsed;
    if (!fn(req)) rc = 1;
  }
  return rc;
}

int RunTokenize(const std::string& dir, bool decode) {
  auto tok = Tokenizer::Load(dir);
  if (!tok.ok()) {
    std::fprintf(stderr, "m3 tokenize: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  return ForEachJsonLine([&](const ojson& req) {
    if (!decode) {
      if (!req.contains("text") || !req["text"].is_string()) {
        PrintLine({{"error", "request needs a string field 'text'"}});
        return false;
      }
      PrintLine({{"ids", (*tok)->Encode(req["text"].get<std::string>())}});
      return true;
    }
    if (!req.contains("ids") || !req["ids"].is_array()) {
      PrintLine({{"error", "request needs an array field 'ids'"}});
      return false;
    }
    std::vector<int32_t> ids;
    const size_t vocab = (*tok)->vocab_size();
    for (const auto& v : req["ids"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
        PrintLine({{"error", "'ids' must hold non-negative integers"}});
        return false;
      }
      if (static_cast<uint64_t>(v.get<int64_t>()) >= vocab) {  // decoding would drop it silently
        PrintLine({{"error", Str("id ", v.get<int64_t>(), " is not in the vocabulary (ids 0..", vocab - 1, ")")}});
        return false;
      }
      ids.push_back(v.get<int32_t>());
    }
    if (req.contains("skip_special_tokens") && !req["skip_special_tokens"].is_boolean()) {
      PrintLine({{"error", "'skip_special_tokens' must be true or false"}});
      return false;
    }
    const bool skip = req.value("skip_special_tokens", false);
    PrintLine({{"text", (*tok)->Decode(ids, skip)}});
    return true;
  });
}

int RunTemplate(const std::string& dir) {
  auto tok = Tokenizer::Load(dir);
  auto tmpl = ChatTemplate::Load(dir);
  for (const Status& s : {tok.status(), tmpl.status()})
    if (!s.ok()) {
      std::fprintf(stderr, "m3 template: %s\n", s.ToString().c_str());
      return 1;
    }
  return ForEachJsonLine([&](const ojson& req) {
    const ojson messages = req.value("messages", ojson::array());
    const ojson tools = req.contains("tools") ? req["tools"] : ojson();
    const ojson options = req.contains("options") ? req["options"] : ojson::object();
    auto rendered = tmpl->Render(messages, tools, options);
    if (!rendered.ok()) {
      PrintLine({{"error", rendered.status().message()}});
      return true;  // a refused conversation is an answer, not a failure of the tool
    }
    PrintLine({{"rendered", *rendered}, {"ids", (*tok)->Encode(*rendered)}});
    return true;
  });
}

}  // namespace

void AddTextCommands(CLI::App& app, int* rc) {
  auto dir = std::make_shared<std::string>();
  auto decode = std::make_shared<bool>(false);
  auto* tok = app.add_subcommand("tokenize", "JSON lines {\"text\"} -> {\"ids\"}; with --decode {\"ids\"} -> {\"text\"}");
  tok->add_option("--tokenizer", *dir, "folder with tokenizer.json (or the file)")->required();
  tok->add_flag("--decode", *decode, "decode ids instead of encoding text");
  tok->callback([dir, decode, rc] { *rc = RunTokenize(*dir, *decode); });

  auto tdir = std::make_shared<std::string>();
  auto* tpl = app.add_subcommand("template", "JSON lines {messages, tools, options} -> {rendered, ids} or {error}");
  tpl->add_option("--tokenizer", *tdir, "folder with tokenizer.json and chat_template.jinja")->required();
  tpl->callback([tdir, rc] { *rc = RunTemplate(*tdir); });
}

}  // namespace m3::cli
