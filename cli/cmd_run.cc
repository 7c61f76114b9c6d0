// m3 run: one prompt, streamed answer (reasoning shown apart), timing line.
// m3 chat: interactive multi-turn; each turn reuses the cached prefix of the conversation.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "base/json_guard.h"
#include "cli/commands.h"
#include "ops/sampling.h"
#include "runtime/chat.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

struct RunArgs {
  std::string model, tokenizer, prompt, system, think = "adaptive";
  bool raw = false;
  int max_tokens = 512;
  EngineArgs engine_args;
  size_t context = 0;
  SamplingParams sampling{.temperature = 1.0f, .top_k = 40, .top_p = 0.95f};  // docs/MODEL.md §6.5
  LookupOptions lookup;
  std::string json_schema, grammar;  // files: what the answer must be
};

// A grammar or schema file, read whole (at most 4 MiB: these are hand-written).
StatusOr<std::string> ReadSpecFile(const std::string& option, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(option, ": cannot open '", path, "'");
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > (size_t{4} << 20)) return InvalidArgument(option, ": '", path, "' is larger than 4 MiB");
  }
  return text;
}

// --json-schema / --grammar: the answer's constraint (lib/constrain); empty when neither is given.
StatusOr<OutputConstraint> ReadConstraint(const RunArgs& a, const ChatText& text) {
  OutputConstraint c;
  if (!a.json_schema.empty() && !a.grammar.empty()) return InvalidArgument("give --json-schema or --grammar, not both");
  if (!a.json_schema.empty()) {
    M3_ASSIGN_OR_RETURN(const std::string body, ReadSpecFile("--json-schema", a.json_schema));
    M3_ASSIGN_OR_RETURN(const nlohmann::json schema, ParseJson<nlohmann::json>(body, "--json-schema " + a.json_schema));
    auto g = constrain::CompileJsonSchema(schema);
    if (!g.ok()) return InvalidArgument("--json-schema ", a.json_schema, ": ", g.status().message());
    c.answer = *g;
  } else if (!a.grammar.empty()) {
    M3_ASSIGN_OR_RETURN(const std::string body, ReadSpecFile("--grammar", a.grammar));
    auto g = CompileUserGrammar(body, *text.vocab_index());
    if (!g.ok()) return InvalidArgument("--grammar ", a.grammar, ": ", g.status().message());
    c.answer = *g;
  }
  if (!c.empty()) c.vocab = text.vocab_index();
  return c;
}

// Everything one conversation needs: engine, session, text layer, sampler.
struct Runner {
  explicit Runner(const RunArgs& a) : args(a) {}
  RunArgs args;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Session> session;
  std::unique_ptr<ChatText> text;
  std::unique_ptr<Sampler> sampler;
  OutputConstraint constraint;
  bool color = isatty(STDOUT_FILENO);

  Status Open() {
    M3_RETURN_IF_ERROR(ValidateSamplingParams(args.sampling));
    M3_RETURN_IF_ERROR(ValidateLookupOptions(args.lookup));
    if (args.think != "enabled" && args.think != "disabled" && args.think != "adaptive")
      return InvalidArgument("--think must be enabled, disabled or adaptive, got '", args.think, "'");
    M3_ASSIGN_OR_RETURN(const EngineOptions engine_options, args.engine_args.Options());
    SessionOptions session_options;
    session_options.max_context = args.context;
    M3_RETURN_IF_ERROR(args.engine_args.Configure(&session_options));
    const std::string tok_dir = args.tokenizer.empty() ? args.model : args.tokenizer;
    auto t = ChatText::Load(tok_dir, /*require_template=*/!args.raw);
    if (!t.ok()) {
      if (args.raw) return t.status();
      return Status(t.status().code(), t.status().message() + " (use --raw for plain completion)");
    }
    text = std::move(t).value();
    M3_ASSIGN_OR_RETURN(constraint, ReadConstraint(args, *text));  // before the model: a bad file fails fast
    M3_ASSIGN_OR_RETURN(engine, Engine::Open(args.model, engine_options));
    session = std::make_unique<Session>(*engine, session_options);
    sampler = std::make_unique<Sampler>(args.sampling);
    const size_t model_vocab = engine->model().config().vocab_size;
    if (text->tokenizer().vocab_size() > model_vocab)
      std::fprintf(stderr, "warning: the tokenizer has %zu ids but the model only %zu; prompts using higher ids are refused\n",
                   text->tokenizer().vocab_size(), model_vocab);
    return Status::Ok();
  }

  void Print(const std::string& s, const char* style) {
    if (s.empty()) return;
    if (color && style) std::fputs(style, stdout);
    std::fputs(s.c_str(), stdout);
    if (color && style) std::fputs("\x1b[0m", stdout);
    std::fflush(stdout);
  }

  // Generates one assistant turn for `prompt`, streaming it; returns the parsed output.
  StatusOr<ParsedOutput> Turn(const std::vector<int32_t>& prompt, TurnOptions options) {
    bool in_reasoning = false;
    auto show = [&](const TurnDelta& d) {
      if (!d.reasoning.empty()) {
        if (!in_reasoning) Print("[reasoning]\n", "\x1b[2m");
        in_reasoning = true;
        Print(d.reasoning, "\x1b[2m");
      }
      if (!d.content.empty()) {
        if (in_reasoning) Print("\n[answer]\n", "\x1b[1m");
        in_reasoning = false;
        Print(d.content, nullptr);
      }
      for (const auto& call : d.tool_calls)
        Print("\n[tool call] " + call.name + " " + SerializeArguments(call.arguments) + "\n", "\x1b[36m");
      return true;
    };
    options.raw = args.raw;
    options.generate = GenerateOptions{args.max_tokens, text->stop_ids(), args.lookup};
    options.constraint = constraint;
    if (!constraint.empty()) {
      const size_t need = MinTurnTokens(constraint, options.start);
      if (static_cast<size_t>(args.max_tokens) < need)
        return InvalidArgument("--max-tokens ", args.max_tokens, " is too few for the answer's format: it needs at least ",
                               need);
    }
    GenerateStats stats;
    auto out = GenerateTurn(*session, text->tokenizer(), prompt, options, *sampler, show, &stats);
    if (!out.ok()) return out;
    std::printf("\n");
    std::fprintf(stderr, "[prompt %zu tokens (%zu reused from cache, %zu prefilled) at %.1f tok/s | generated %zu tokens at %.1f tok/s%s | stop: %s]\n",
                 stats.prompt_tokens, stats.reused_tokens, stats.prompt_tokens - stats.reused_tokens,
                 stats.prefill_tok_s(), stats.generated_tokens, stats.decode_tok_s(), LookupSummary(stats).c_str(),
                 stats.stop_reason.c_str());
    return out;
  }

  // Renders and runs one turn of `messages` (or the raw prompt).
  StatusOr<ParsedOutput> Reply(const ojson& messages) {
    TurnOptions options;
    if (args.raw) return Turn(text->tokenizer().Encode(args.prompt), options);
    M3_ASSIGN_OR_RETURN(const auto prompt, text->TurnPrompt(messages, nullptr, {{"thinking_mode", args.think}}, &options));
    return Turn(prompt, options);
  }
};

int Fail(const char* cmd, const Status& s) {
  std::fprintf(stderr, "m3 %s: %s\n", cmd, s.ToString().c_str());
  return 1;
}

int RunOnce(const RunArgs& args) {
  Runner r(args);
  if (Status s = r.Open(); !s.ok()) return Fail("run", s);
  ojson messages = ojson::array();
  if (!args.system.empty()) messages.push_back({{"role", "system"}, {"content", args.system}});
  messages.push_back({{"role", "user"}, {"content", args.prompt}});
  auto out = r.Reply(messages);
  return out.ok() ? 0 : Fail("run", out.status());
}

int RunChat(const RunArgs& args) {
  Runner r(args);
  if (Status s = r.Open(); !s.ok()) return Fail("chat", s);
  const bool interactive = isatty(STDIN_FILENO);
  ojson messages = ojson::array();
  if (!args.system.empty()) messages.push_back({{"role", "system"}, {"content", args.system}});
  if (interactive) std::fprintf(stderr, "m3 chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.\n");
  std::string line;
  while (true) {
    if (interactive) std::fprintf(stderr, "> ");
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      messages.erase(messages.begin() + (args.system.empty() ? 0 : 1), messages.end());
      continue;
    }
    if (line.empty()) continue;
    messages.push_back({{"role", "user"}, {"content", line}});
    auto out = r.Reply(messages);
    if (!out.ok()) return Fail("chat", out.status());
    messages.push_back(AssistantMessage(*out));
  }
  return 0;
}

void AddGenerationOptions(CLI::App* cmd, RunArgs& a) {
  cmd->add_option("-m,--model", a.model, "model folder (with tokenizer.json and chat_template.jinja)")->required();
  cmd->add_option("--tokenizer", a.tokenizer, "folder with the tokenizer files, if not the model folder");
  cmd->add_option("--system", a.system, "system message");
  cmd->add_option("--think", a.think, "thinking mode: enabled, disabled or adaptive")->default_val("adaptive");
  cmd->add_option("-n,--max-tokens", a.max_tokens, "most tokens to generate per turn")->default_val(512);
  AddEngineOptions(cmd, &a.engine_args);
  cmd->add_option("-c,--context", a.context, "context limit in tokens (0 = the model's)")->default_val(0);
  AddSamplingOptions(cmd, &a.sampling);
  AddLookupOption(cmd, &a.lookup);
  cmd->add_option("--json-schema", a.json_schema, "file with a JSON schema the answer must follow (the reasoning stays free)");
  cmd->add_option("--grammar", a.grammar, "file with a GBNF grammar (root rule \"root\") the answer must follow");
}

}  // namespace

void AddRunCommands(CLI::App& app, int* rc) {
  auto run = std::make_shared<RunArgs>();
  auto* cmd = app.add_subcommand("run", "Generate a reply to one prompt (chat-formatted unless --raw)");
  AddGenerationOptions(cmd, *run);
  cmd->add_option("-p,--prompt", run->prompt, "the prompt")->required();
  cmd->add_flag("--raw", run->raw, "plain completion of the prompt text, no chat template");
  cmd->callback([run, rc] { *rc = RunOnce(*run); });

  auto chat = std::make_shared<RunArgs>();
  auto* ccmd = app.add_subcommand("chat", "Interactive multi-turn chat reading lines from stdin");
  AddGenerationOptions(ccmd, *chat);
  ccmd->callback([chat, rc] { *rc = RunChat(*chat); });
}

}  // namespace m3::cli
