// m3 imatrix -m MODEL (-f TEXT | --ids LIST) [-o FILE] [-c N] [--chunks K]: runs calibration text
// through the model in chunks of N tokens (each from position 0) and saves every matrix's input
// mean squares (model/imatrix.h) for `m3 pack --imatrix`. Prints the perplexity of the chunks as
// it goes (a check that the text and the model make sense together).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "base/progress.h"
#include "cli/commands.h"
#include "model/imatrix.h"
#include "runtime/perplexity.h"

namespace m3::cli {
namespace {

struct ImatrixArgs {
  std::string model, tokenizer, file, ids, output = "imatrix.safetensors";
  size_t context = 512, chunks = 0;
  bool force = false;
  EngineArgs engine_args;
};

int Fail(const Status& s) {
  std::fprintf(stderr, "m3 imatrix: %s\n", s.ToString().c_str());
  return 1;
}

int RunImatrix(const ImatrixArgs& a) {
  if (!a.force && std::filesystem::exists(a.output))
    return Fail(InvalidArgument(a.output, " exists; pass --force to overwrite it"));
  if (a.context < 2) return Fail(InvalidArgument("--context must be at least 2 tokens"));
  if (a.engine_args.numa == "split")
    return Fail(InvalidArgument("--numa split: the experts' node copies are not the model's matrices the importance "
                                "matrix names; run with --numa off or distribute"));
  if (a.engine_args.gpu != "none")
    return Fail(InvalidArgument("--gpu: the importance matrix is collected on the CPU (the offloaded dense part "
                                "runs no CPU matmul); run without --gpu"));
  auto ids = ReadTextTokens(a.file, a.ids, a.tokenizer.empty() ? a.model : a.tokenizer);
  if (!ids.ok()) return Fail(ids.status());
  size_t n_chunks = ids->size() / a.context;
  if (a.chunks) n_chunks = std::min(n_chunks, a.chunks);
  if (n_chunks == 0)
    return Fail(InvalidArgument("the text has ", ids->size(), " tokens, fewer than one chunk of --context ", a.context));

  SessionOptions session_options;
  auto engine = a.engine_args.Open(a.model, &session_options);
  if (!engine.ok()) return Fail(engine.status());
  if ((*engine)->expert_parallel())
    return Fail(InvalidArgument("--dist: the importance matrix is collected in one process; run without --dist"));
  Session session(**engine, session_options);
  if (a.context > session.max_context())
    return Fail(OutOfRange("--context ", a.context, " exceeds the model's context of ", session.max_context(), " tokens"));
  if (Status s = session.CheckContextFits(a.context); !s.ok()) return Fail(s);

  ImportanceCollector collector((*engine)->model());
  const size_t vocab = static_cast<size_t>((*engine)->model().config().vocab_size);
  MeanEstimate nll;
  std::vector<float> logits, log_probs;
  ProgressMeter meter("collecting ", n_chunks * a.context, ::isatty(STDERR_FILENO) != 0, ProgressMeter::Unit::kTokens);
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t c = 0; c < n_chunks; ++c) {
    const std::span<const int32_t> chunk(ids->data() + c * a.context, a.context);
    if (Status s = session.Rewind(0); !s.ok()) return Fail(s);
    if (Status s = session.Eval(chunk, LogitsMode::kAllRows, &logits, &collector); !s.ok()) return Fail(s);
    for (size_t t = 0; t + 1 < a.context; ++t) {
      LogSoftmax(std::span<const float>(logits.data() + t * vocab, vocab), &log_probs);
      nll.Add(-static_cast<double>(log_probs[static_cast<size_t>(chunk[t + 1])]));
    }
    if (const std::string p = meter.Update((c + 1) * a.context); !p.empty()) std::fputs(p.c_str(), stderr);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string text = a.file.empty() ? "--ids" : a.file;
  Status s = collector.Save(a.output, {{"model", a.model},
                                       {"text", text},
                                       {"tokens", std::to_string(n_chunks * a.context)},
                                       {"chunks", std::to_string(n_chunks)},
                                       {"context", std::to_string(a.context)}});
  if (!s.ok()) return Fail(s);
  std::printf("imatrix          %s: %zu of %zu matrices saw tokens\n", a.output.c_str(), collector.matrices_seen(),
              collector.matrices());
  std::printf("calibration      %zu chunk(s) of %zu tokens from %s; perplexity %.4f +- %.4f\n", n_chunks, a.context,
              text.c_str(), std::exp(nll.mean()), std::exp(nll.mean()) * nll.standard_error());
  std::printf("time             %.2f s (%.1f tokens/s); %d threads\n", secs,
              secs > 0 ? static_cast<double>(n_chunks * a.context) / secs : 0.0, (*engine)->threads().threads);
  return 0;
}

}  // namespace

void AddImatrixCommand(CLI::App& app, int* rc) {
  auto* cmd = app.add_subcommand(
      "imatrix", "Collect the importance of every matrix's inputs on calibration text, for m3 pack --imatrix");
  auto a = std::make_shared<ImatrixArgs>();
  cmd->add_option("-m,--model", a->model, "model folder (a checkpoint or a pack; the best you have)")->required();
  cmd->add_option("-f,--file", a->file, "calibration text, - for stdin (tokenized as is)");
  cmd->add_option("--ids", a->ids, "token ids instead: comma-separated, or @FILE");
  cmd->add_option("--tokenizer", a->tokenizer, "folder with tokenizer.json, if not the model folder");
  cmd->add_option("-o,--output", a->output, "importance matrix file (safetensors)")->capture_default_str();
  cmd->add_option("-c,--context", a->context, "tokens per chunk, each run from position 0")->capture_default_str();
  cmd->add_option("--chunks", a->chunks, "use at most this many chunks (0: all the text gives)")->capture_default_str();
  cmd->add_flag("--force", a->force, "overwrite the output file");
  AddEngineOptions(cmd, &a->engine_args);
  cmd->callback([a, rc] { *rc = RunImatrix(*a); });
}

}  // namespace m3::cli
