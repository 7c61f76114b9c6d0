// m3 batch: offline generation for a file of requests, continuously batched (lib/runtime/
// scheduler.h) over --slots sessions. Input: one OpenAI request body per line, a chat completion
// ({"messages", ...}) or a completion ({"prompt", ...}). Output: one line per request, in input
// order, {"index", "response"} with the OpenAI response object, or {"index", "error"}.
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "base/json_guard.h"
#include "runtime/chat.h"
#include "runtime/openai.h"
#include "runtime/scheduler.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

struct BatchArgs {
  std::string model, tokenizer, input = "-", output = "-", name;
  int slots = 4;
  size_t context = 0;
  EngineArgs engine_args;
  RequestDefaults defaults;
};

// Writes results in input order as they arrive.
class OrderedWriter {
 public:
  explicit OrderedWriter(std::ostream& out) : out_(out) {}
  void Put(size_t index, ojson line) {
    pending_.emplace(index, std::move(line));
    for (auto it = pending_.find(next_); it != pending_.end(); it = pending_.find(next_)) {
      out_ << JsonText(it->second) << '\n';
      pending_.erase(it);
      ++next_;
    }
    out_.flush();
  }

 private:
  std::ostream& out_;
  std::map<size_t, ojson> pending_;
  size_t next_ = 0;
};

ojson ErrorLine(size_t index, const Status& s) {
  return {{"index", index}, {"error", openai::ErrorBody(s.message(), HttpStatus(s))["error"]}};
}

// A request line while its choices run (on the scheduler's thread).
struct RequestRun {
  Request request;
  std::vector<ChoiceResult> choices;
  size_t ended = 0;
};

int Batch(const BatchArgs& a) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "m3 batch: %s\n", s.ToString().c_str());
    return 1;
  };
  if (Status s = ValidateSamplingParams(a.defaults.sampling); !s.ok()) return fail(s);
  if (Status s = ValidateLookupOptions(a.defaults.lookup); !s.ok()) return fail(s);
  if (a.defaults.max_tokens < 1) return fail(InvalidArgument("--max-tokens must be at least 1"));
  if (a.slots < 1 || a.slots > 256) return fail(InvalidArgument("--slots must be 1..256, got ", a.slots));

  // The requests, read whole before the model loads (a bad file fails fast).
  std::ifstream file;
  if (a.input != "-") {
    file.open(a.input);
    if (!file) return fail(NotFound(a.input, ": cannot open the request file"));
  }
  std::istream& in = a.input == "-" ? std::cin : file;
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (line.find_first_not_of(" \t\r") != std::string::npos) lines.push_back(line);
  if (lines.empty()) return fail(InvalidArgument("no requests in ", a.input == "-" ? "stdin" : a.input));

  SchedulerOptions scheduling;
  scheduling.slots = static_cast<size_t>(a.slots);
  scheduling.log = [](const std::string& note) { std::fprintf(stderr, "m3 batch: %s\n", note.c_str()); };
  scheduling.session.max_context = a.context;
  if (Status s = a.engine_args.Configure(&scheduling.session); !s.ok()) return fail(s);
  auto engine_options = a.engine_args.Options();
  if (!engine_options.ok()) return fail(engine_options.status());
  auto text = ChatText::Load(a.tokenizer.empty() ? a.model : a.tokenizer, /*require_template=*/false);
  if (!text.ok()) return fail(text.status());
  auto engine = Engine::Open(a.model, *engine_options);
  if (!engine.ok()) return fail(engine.status());
  std::ofstream out_file;
  if (a.output != "-") {
    out_file.open(a.output);
    if (!out_file) return fail(IoError(a.output, ": cannot write the results"));
  }
  OrderedWriter writer(a.output == "-" ? std::cout : out_file);
  const std::string model = a.name.empty() ? "m3" : a.name;
  const int64_t created = std::time(nullptr);
  size_t done = 0, failed = 0, prompt_tokens = 0, generated = 0;
  GenerateStats lookup;  // guesses drafted and accepted over all requests
  // After what its callbacks use: it ends (and reports) any request left when it goes.
  Scheduler scheduler(**engine, (*text)->tokenizer(), scheduling);
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < lines.size(); ++i) {
    const StatusOr<ojson> line = ParseJson<ojson>(lines[i], Str("line ", i + 1));
    StatusOr<Request> parsed = line.status();
    if (line.ok()) {
      const ojson& body = *line;
      parsed = body.is_object() && body.contains("messages") ? openai::ParseChatRequest(body, a.defaults)
                                                             : openai::ParseCompletionRequest(body, a.defaults);
    }
    const std::string id = Str(parsed.ok() && parsed->chat ? "chatcmpl-batch-" : "cmpl-batch-", i);
    if (!parsed.ok()) {
      writer.Put(i, ErrorLine(i, parsed.status()));
      ++done, ++failed;
      continue;
    }
    // Each choice (n of each prompt) runs on its own; the line is written when all have ended.
    auto request = std::make_shared<RequestRun>();
    request->request = std::move(parsed).value();
    const Request& r = request->request;
    const size_t n_choices = ChoiceCount(r);
    request->choices.resize(n_choices);
    std::vector<TurnOptions> turns(n_choices);
    Status bad;
    for (size_t c = 0; c < n_choices && bad.ok(); ++c) {
      auto prompt =
          TurnInputs(**text, r, id, scheduler.max_context(), &turns[c], c, c > 0 ? &turns[0].constraint : nullptr);
      if (prompt.ok())
        request->choices[c].prompt = std::move(prompt).value();
      else
        bad = prompt.status();
    }
    if (!bad.ok()) {
      writer.Put(i, ErrorLine(i, bad));
      ++done, ++failed;
      continue;
    }
    for (size_t c = 0; c < n_choices; ++c) {
      ScheduledRequest sr;
      sr.prompt = request->choices[c].prompt;
      sr.turn = std::move(turns[c]);
      sr.sampling = ChoiceSampling(r, c);
      sr.on_delta = [request, c](const TurnDelta& d) {
        request->choices[c].deltas.push_back(d);
        return true;
      };
      sr.on_end = [&, i, id, request, c](const Status& status, ParsedOutput out, const GenerateStats& st, size_t) {
        prompt_tokens += st.prompt_tokens;
        generated += st.generated_tokens;
        lookup.drafted_tokens += st.drafted_tokens;
        lookup.accepted_tokens += st.accepted_tokens;
        ChoiceResult& choice = request->choices[c];
        choice.status = status;
        choice.output = std::move(out);
        choice.stats = st;
        if (++request->ended < request->choices.size()) return;
        ++done;
        auto response = openai::WholeResponse((*text)->tokenizer(), request->request, id, created, model,
                                              request->choices);
        if (!response.ok()) ++failed;
        writer.Put(i, response.ok() ? ojson{{"index", i}, {"seed", request->request.sampling.seed}, {"response", *response}}
                                    : ErrorLine(i, response.status()));
        std::fprintf(stderr, "\rm3 batch: %zu / %zu requests done", done, lines.size());
      };
      scheduler.Submit(std::move(sr));
    }
  }
  scheduler.RunUntilIdle();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr,
               "\rm3 batch: %zu requests (%zu failed) in %.1f s | %zu prompt tokens | %zu generated at %.1f tok/s "
               "over %d slots%s\n",
               lines.size(), failed, seconds, prompt_tokens, generated, seconds > 0 ? generated / seconds : 0.0,
               a.slots, LookupSummary(lookup).c_str());
  return failed == lines.size() ? 1 : 0;
}

}  // namespace

void AddBatchCommand(CLI::App& app, int* rc) {
  auto a = std::make_shared<BatchArgs>();
  auto* cmd = app.add_subcommand("batch",
                                 "Offline generation for a JSON-lines file of OpenAI request bodies (chat "
                                 "{\"messages\"} or completion {\"prompt\"}), decoded together; results in input order");
  cmd->add_option("-m,--model", a->model, "model folder (with tokenizer.json and chat_template.jinja)")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "folder with the tokenizer files, if not the model folder");
  cmd->add_option("-i,--input", a->input, "request file, one JSON body per line (- = stdin)")->default_val("-");
  cmd->add_option("-o,--output", a->output, "result file, one JSON line per request (- = stdout)")->default_val("-");
  cmd->add_option("--name", a->name, "model name in the responses")->default_val("m3");
  cmd->add_option("--slots", a->slots, "requests generating at once, each in its own session")->default_val(4);
  AddEngineOptions(cmd, &a->engine_args);
  cmd->add_option("-c,--context", a->context, "context limit in tokens (0 = the model's)")->default_val(0);
  cmd->add_option("-n,--max-tokens", a->defaults.max_tokens, "tokens per reply when a request gives no max_tokens")
      ->default_val(512);
  AddSamplingOptions(cmd, &a->defaults.sampling);
  AddLookupOption(cmd, &a->defaults.lookup);
  AddLiteralContentOption(cmd, &a->defaults.literal_content);
  cmd->callback([a, rc] { *rc = Batch(*a); });
}

}  // namespace m3::cli
