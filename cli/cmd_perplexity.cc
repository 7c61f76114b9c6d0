// m3 perplexity -m DIR (-f TEXT | --ids LIST) [-c N] [--stride S] [--save-base F | --kl-base F]
// Scores a text with the model (runtime/perplexity.h): perplexity with its standard error and
// top-1 accuracy; against a base model's saved log-probabilities, the KL divergence of every
// scored token's distribution from the base's (how much a packed type or a cache type changes
// the model on real text).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/progress.h"
#include "cli/commands.h"
#include "runtime/perplexity.h"
#include "text/tokenizer.h"

namespace m3::cli {
namespace {

constexpr size_t kDefaultContext = 2048;

struct PerplexityArgs {
  std::string model, tokenizer, file, ids, per_token, save_base, kl_base;
  size_t context = 0, stride = 0, max_tokens = 0;
  bool json = false, force = false;
  EngineArgs engine_args;
};

int Fail(const Status& s) {
  std::fprintf(stderr, "m3 perplexity: %s\n", s.ToString().c_str());
  return 1;
}

// The q-th quantile (0..1) of v, nearest rank; 0 for none.
double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

int RunPerplexity(const PerplexityArgs& a) {
  if (!a.save_base.empty() && !a.kl_base.empty() &&
      std::filesystem::weakly_canonical(a.save_base) == std::filesystem::weakly_canonical(a.kl_base))
    return Fail(InvalidArgument("--save-base and --kl-base name the same file"));
  if (!a.save_base.empty() && !a.force && std::filesystem::exists(a.save_base))
    return Fail(InvalidArgument(a.save_base, " exists; pass --force to overwrite it"));
  auto ids = ReadTextTokens(a.file, a.ids, a.tokenizer.empty() ? a.model : a.tokenizer);
  if (!ids.ok()) return Fail(ids.status());
  if (a.max_tokens > 0 && ids->size() > a.max_tokens) ids->resize(a.max_tokens);

  SessionOptions session_options;
  auto engine = a.engine_args.Open(a.model, &session_options);
  if (!engine.ok()) return Fail(engine.status());
  Session session(**engine, session_options);
  const size_t context = a.context ? a.context : std::min(kDefaultContext, session.max_context());
  if (context > session.max_context())
    return Fail(OutOfRange("--context ", context, " exceeds the model's context of ", session.max_context(), " tokens"));
  const size_t stride = a.stride ? a.stride : std::max<size_t>(context / 2, 1);
  auto windows = PlanScoreWindows(ids->size(), context, stride);
  if (!windows.ok()) return Fail(windows.status());
  if (Status s = session.CheckContextFits(context); !s.ok()) return Fail(s);

  const size_t vocab = static_cast<size_t>((*engine)->model().config().vocab_size);
  LogProbFileInfo info;
  info.vocab = vocab;
  info.n_ids = ids->size();
  info.ids_hash = Hash64(ids->data(), ids->size() * sizeof(int32_t));
  info.context = context;
  info.stride = stride;
  uint64_t fed = 0;  // tokens the windows run (the progress total)
  for (const ScoreWindow& w : *windows) {
    info.scored += w.end - w.first_target;
    fed += w.end - 1 - w.begin;
  }
  std::unique_ptr<LogProbFileReader> base;
  if (!a.kl_base.empty()) {
    auto r = LogProbFileReader::Open(a.kl_base);
    if (!r.ok()) return Fail(r.status());
    if (Status s = CheckSameScoring((*r)->info(), info, a.kl_base); !s.ok()) return Fail(s);
    base = std::move(*r);
  }
  std::unique_ptr<LogProbFileWriter> save;
  if (!a.save_base.empty()) {
    auto w = LogProbFileWriter::Create(a.save_base, info);
    if (!w.ok()) return Fail(w.status());
    save = std::move(*w);
  }
  std::ofstream per_token;
  if (!a.per_token.empty()) {
    per_token.open(a.per_token);
    if (!per_token) return Fail(IoError(a.per_token, ": cannot create"));
  }

  MeanEstimate nll, log_ratio;  // log_ratio: this model's NLL minus the base's, per token
  size_t top1 = 0, same_top = 0;
  std::vector<double> kls;
  std::vector<float> log_probs, base_row;
  ProgressMeter meter("scoring ", fed, ::isatty(STDERR_FILENO) != 0, ProgressMeter::Unit::kTokens);
  size_t window = 0, fed_before = 0;
  Status row_error;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = ScoreTokens(
      session, *ids, *windows,
      [&](size_t index, std::span<const float> logits) {
        const int32_t target = (*ids)[index];
        LogSoftmax(logits, &log_probs);
        const double token_nll = -static_cast<double>(log_probs[static_cast<size_t>(target)]);
        nll.Add(token_nll);
        const size_t argmax = static_cast<size_t>(std::max_element(log_probs.begin(), log_probs.end()) - log_probs.begin());
        top1 += argmax == static_cast<size_t>(target);
        nlohmann::json line;
        if (per_token.is_open()) line = {{"index", index}, {"id", target}, {"nll", token_nll}, {"top1", argmax == static_cast<size_t>(target)}};
        if (base) {
          if (row_error = base->Next(&base_row); !row_error.ok()) return false;
          const double kl = KlDivergence(base_row, log_probs);
          kls.push_back(kl);
          log_ratio.Add(token_nll + static_cast<double>(base_row[static_cast<size_t>(target)]));
          same_top += static_cast<size_t>(std::max_element(base_row.begin(), base_row.end()) - base_row.begin()) == argmax;
          if (per_token.is_open()) line["kl"] = kl;
        }
        if (save)
          if (row_error = save->Append(log_probs); !row_error.ok()) return false;
        if (per_token.is_open()) per_token << line.dump() << "\n";
        if (const std::string p = meter.Update(fed_before + index - (*windows)[window].begin); !p.empty())
          std::fputs(p.c_str(), stderr);
        return true;
      },
      [&](size_t w) {
        fed_before += (*windows)[w].end - 1 - (*windows)[w].begin;
        window = w + 1;
        return true;
      });
  if (s.ok()) s = row_error;
  if (s.ok() && save) s = save->Finish();
  if (s.ok() && per_token.is_open() && !per_token.flush()) s = IoError(a.per_token, ": write failed");
  if (!s.ok()) return Fail(s);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const size_t n = nll.count();
  const double ppl = std::exp(nll.mean()), ppl_err = ppl * nll.standard_error();
  const double accuracy = n ? static_cast<double>(top1) / static_cast<double>(n) : 0;
  nlohmann::json j = {{"tokens", ids->size()},   {"scored", n},
                      {"context", context},      {"stride", stride},
                      {"windows", windows->size()}, {"nll_mean", nll.mean()},
                      {"nll_stderr", nll.standard_error()}, {"perplexity", ppl},
                      {"perplexity_stderr", ppl_err}, {"top1_accuracy", accuracy},
                      {"seconds", secs},         {"tokens_per_second", secs > 0 ? static_cast<double>(fed) / secs : 0.0},
                      {"threads", (*engine)->threads().threads}};
  if (base) {
    double kl_max = 0;
    MeanEstimate kl;
    for (const double k : kls) kl.Add(k), kl_max = std::max(kl_max, k);
    const double ratio = std::exp(log_ratio.mean());
    j["kl_base"] = a.kl_base;
    j["kl_mean"] = kl.mean();
    j["kl_stderr"] = kl.standard_error();
    j["kl_median"] = Quantile(kls, 0.5);
    j["kl_p99"] = Quantile(kls, 0.99);
    j["kl_max"] = kl_max;
    j["same_top1"] = n ? static_cast<double>(same_top) / static_cast<double>(n) : 0;
    j["perplexity_ratio"] = ratio;  // PPL(this) / PPL(base)
    j["perplexity_ratio_stderr"] = ratio * log_ratio.standard_error();
  }
  if (a.json) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("perplexity %.4f +- %.4f (mean NLL %.5f +- %.5f nats) over %zu scored tokens; top-1 accuracy %.2f%%\n",
              ppl, ppl_err, nll.mean(), nll.standard_error(), n, 100 * accuracy);
  std::printf("%zu window(s) of up to %zu tokens, stride %zu; %.2f s (%.1f tokens/s); %d threads, %s\n", windows->size(),
              context, stride, secs, j["tokens_per_second"].get<double>(), (*engine)->threads().threads,
              (*engine)->simd_target().c_str());
  if (base)
    std::printf("against %s: KL mean %.6f +- %.6f, median %.6f, p99 %.6f, max %.6f nats; same top-1 %.2f%%; "
                "PPL ratio %.5f +- %.5f\n",
                a.kl_base.c_str(), j["kl_mean"].get<double>(), j["kl_stderr"].get<double>(), j["kl_median"].get<double>(),
                j["kl_p99"].get<double>(), j["kl_max"].get<double>(), 100 * j["same_top1"].get<double>(),
                j["perplexity_ratio"].get<double>(), j["perplexity_ratio_stderr"].get<double>());
  if (save) std::printf("saved the log-probabilities of %zu tokens to %s\n", n, a.save_base.c_str());
  return 0;
}

}  // namespace

StatusOr<std::vector<int32_t>> ReadTextTokens(const std::string& file, const std::string& ids,
                                              const std::string& tokenizer_dir) {
  if (file.empty() == ids.empty()) return InvalidArgument("give the text with -f FILE or --ids LIST (one of them)");
  if (!ids.empty()) return ParseIdList("--ids", ids);
  std::stringstream ss;
  if (file == "-") {
    ss << std::cin.rdbuf();
  } else {
    std::ifstream in(file, std::ios::binary);
    if (!in) return NotFound(file, ": cannot read the text file");
    ss << in.rdbuf();
  }
  auto tokenizer = Tokenizer::Load(tokenizer_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  return (*tokenizer)->Encode(ss.str());
}

void AddPerplexityCommand(CLI::App& app, int* rc) {
  auto* cmd = app.add_subcommand(
      "perplexity",
      "Score a text: perplexity and top-1 accuracy over sliding windows; KL divergence from a base model's saved "
      "log-probabilities");
  auto a = std::make_shared<PerplexityArgs>();
  cmd->add_option("-m,--model", a->model, "model folder")->required();
  cmd->add_option("-f,--file", a->file, "text file to score, - for stdin (tokenized as is: no chat template, no special tokens)");
  cmd->add_option("--ids", a->ids, "token ids to score instead: comma-separated, or @FILE");
  cmd->add_option("--tokenizer", a->tokenizer, "folder with tokenizer.json, if not the model folder");
  cmd->add_option("-c,--context", a->context, "tokens per window (default: 2048 or the model's context if smaller)");
  cmd->add_option("--stride", a->stride,
                  "tokens between window starts (default: half the context); each window scores the tokens past the "
                  "previous one's end, so each has at least context - stride tokens before it");
  cmd->add_option("--max-tokens", a->max_tokens, "score only the first N tokens of the text (0 = all)")->default_val(0);
  cmd->add_option("--per-token", a->per_token, "write one JSON line per scored token: index, id, nll, top1 (and kl)");
  cmd->add_option("--save-base", a->save_base,
                  "save every scored token's log-probabilities (vocab x 4 bytes each) as the base for --kl-base");
  cmd->add_option("--kl-base", a->kl_base,
                  "compare with a base saved by --save-base on the same tokens, context and stride: KL divergence, "
                  "same top-1, perplexity ratio");
  cmd->add_flag("--force", a->force, "overwrite the --save-base file");
  cmd->add_flag("--json", a->json, "one JSON object on stdout instead of the summary lines");
  AddEngineOptions(cmd, &a->engine_args);
  cmd->callback([a, rc] { *rc = RunPerplexity(*a); });
}

}  // namespace m3::cli
