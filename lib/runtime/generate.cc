#include "runtime/generate.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace m3 {

double GenerateStats::prefill_tok_s() const {
  return prefill_seconds > 0 ? (prompt_tokens - reused_tokens) / prefill_seconds : 0;
}
double GenerateStats::decode_tok_s() const {
  return decode_seconds > 0 && generated_tokens > 1 ? (generated_tokens - 1) / decode_seconds : 0;
}

Generation::Generation(Session& session, const GenerateOptions& options, Sampler& sampler,
                       std::function<bool(int32_t)> on_token)
    : session_(session), options_(options), sampler_(sampler), on_token_(std::move(on_token)) {}

Status Generation::Begin(std::span<const int32_t> prompt) {
  if (prompt.empty()) return InvalidArgument("empty prompt");
  if (options_.max_tokens < 0) return InvalidArgument("max_tokens must be >= 0, got ", options_.max_tokens);
  stats_ = GenerateStats();
  stats_.prompt_tokens = prompt.size();
  if (prompt.size() > session_.max_context())
    return OutOfRange("the prompt has ", prompt.size(), " tokens but the context limit is ", session_.max_context());
  stats_.reused_tokens = session_.ReusePrefix(prompt);
  prompt_.assign(prompt.begin() + static_cast<std::ptrdiff_t>(stats_.reused_tokens), prompt.end());
  evaluated_ = 0;
  stats_.stop_reason = "length";
  prefill_start_ = Clock::now();
  return Status::Ok();
}

Status Generation::Start(std::span<const int32_t> prompt) {
  M3_RETURN_IF_ERROR(Begin(prompt));
  M3_RETURN_IF_ERROR(session_.Eval(pending(), LogitsMode::kLastRow, &logits_));
  Evaluated(pending().size());
  return Status::Ok();
}

void Generation::Evaluated(size_t n) {
  if (pending().empty()) {  // a decode step
    unevaluated_ = -1;
    return;
  }
  evaluated_ += n;
  if (!pending().empty()) return;
  decode_start_ = Clock::now();
  stats_.prefill_seconds = std::chrono::duration<double>(decode_start_ - prefill_start_).count();
  done_ = options_.max_tokens == 0;
}

bool Generation::Next(int32_t* next) {
  if (done_ || !pending().empty()) return false;
  if (unevaluated_ >= 0) {
    *next = unevaluated_;
    return true;
  }
  done_ = true;  // unless it goes on below
  const int32_t id = sampler_.Sample(logits_, session_.tokens());
  ++stats_.generated_tokens;
  if (std::find(options_.stop_ids.begin(), options_.stop_ids.end(), id) != options_.stop_ids.end()) {
    stats_.stop_reason = "stop";
    return false;
  }
  if (!on_token_(id)) {
    stats_.stop_reason = "caller";
    return false;
  }
  if (stats_.generated_tokens == static_cast<size_t>(options_.max_tokens)) return false;
  if (session_.position() + 1 > session_.max_context()) {
    stats_.stop_reason = "context";
    return false;
  }
  *next = unevaluated_ = id;
  done_ = false;
  return true;
}

void Generation::Cancel() {
  if (done_) return;
  done_ = true;
  unevaluated_ = -1;
  stats_.stop_reason = "caller";
}

const GenerateStats& Generation::stats() {
  if (done_ && !timed_) {
    stats_.decode_seconds = std::chrono::duration<double>(Clock::now() - decode_start_).count();
    timed_ = true;
  }
  return stats_;
}

std::vector<Status> BatchStep(std::span<Generation* const> gens, std::span<const std::span<const int32_t>> ids) {
  std::vector<Status> result(gens.size());
  auto alone = [&](size_t i) {
    result[i] = gens[i]->session().Eval(ids[i], LogitsMode::kLastRow, &gens[i]->logits());
    if (result[i].ok()) gens[i]->Evaluated(ids[i].size());
  };
  if (gens.size() == 1) {
    alone(0);
    return result;
  }
  std::vector<Session*> sessions;
  for (Generation* g : gens) sessions.push_back(&g->session());
  std::vector<float> logits;
  if (Session::EvalBatch(sessions, ids, &logits).ok()) {
    const size_t vocab = logits.size() / gens.size();
    for (size_t i = 0; i < gens.size(); ++i) {
      gens[i]->logits().assign(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
      gens[i]->Evaluated(ids[i].size());
    }
    return result;
  }
  for (size_t i = 0; i < gens.size(); ++i) alone(i);
  return result;
}

Status Generate(Session& session, std::span<const int32_t> prompt, const GenerateOptions& options, Sampler& sampler,
                const std::function<bool(int32_t)>& on_token, GenerateStats* stats) {
  Generation g(session, options, sampler, on_token);
  M3_RETURN_IF_ERROR(g.Start(prompt));
  for (int32_t id; g.Next(&id); g.Evaluated(1))
    M3_RETURN_IF_ERROR(session.Eval({&id, 1}, LogitsMode::kLastRow, &g.logits()));
  if (stats) *stats = g.stats();
  return Status::Ok();
}

}  // namespace m3
