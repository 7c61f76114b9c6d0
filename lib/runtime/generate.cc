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

Status ValidateLookupOptions(const LookupOptions& o) {
  // Each guess adds a row of logits to the step (800 KB at M3's vocabulary), and long guesses
  // rarely all hold: a cap keeps a step's memory small.
  if (o.max_draft < 0 || o.max_draft > kMaxLookupDraft)
    return InvalidArgument("lookup draft tokens must be 0..", kMaxLookupDraft, ", got ", o.max_draft);
  if (o.min_ngram < 1) return InvalidArgument("lookup min n-gram must be >= 1, got ", o.min_ngram);
  if (o.max_ngram < o.min_ngram)
    return InvalidArgument("lookup max n-gram (", o.max_ngram, ") must be >= its min n-gram (", o.min_ngram, ")");
  return Status::Ok();
}

std::vector<int32_t> LookupDraft(std::span<const int32_t> context, int32_t next, const LookupOptions& options,
                                 size_t max_tokens) {
  // The sequence s = context, next, of L tokens; its suffix of n tokens ends with `next`. One
  // pass from the end: each earlier `next` (at i < L - 1) matches the suffix over m tokens, and
  // latest[n] is where the latest match of n or more ends (a context of a million tokens without
  // a match: 0.29 ms per step on Zen 4, against 3.5 with a backward scan per n).
  const size_t L = context.size() + 1;
  const size_t lo = static_cast<size_t>(std::max(options.min_ngram, 1));
  const size_t hi = std::min(static_cast<size_t>(std::max(options.max_ngram, 0)), L - 1);
  if (max_tokens == 0 || hi < lo) return {};
  auto at = [&](size_t i) { return i < context.size() ? context[i] : next; };
  std::vector<size_t> latest(hi + 1, SIZE_MAX);  // by n: the end (last index) of that match
  for (size_t i = context.size(); i-- > 0;) {
    if (context[i] != next) continue;
    size_t m = 1;  // s[i - m + 1 .. i] == s[L - m .. L - 1]
    while (m < hi && m <= i && at(i - m) == at(L - 1 - m)) ++m;
    for (size_t n = lo; n <= m; ++n)
      if (latest[n] == SIZE_MAX) latest[n] = i;
    if (m == hi) break;  // the longest match there can be, and the latest of it
  }
  for (size_t n = hi; n >= lo; --n) {
    if (latest[n] == SIZE_MAX) continue;
    std::vector<int32_t> draft;
    for (size_t k = latest[n] + 1; k < L && draft.size() < max_tokens; ++k) draft.push_back(at(k));
    return draft;
  }
  return {};
}

Generation::Generation(Session& session, const GenerateOptions& options, Sampler& sampler,
                       std::function<bool(int32_t)> on_token)
    : session_(session), options_(options), sampler_(sampler), on_token_(std::move(on_token)) {}

Status Generation::Begin(std::span<const int32_t> prompt) {
  if (prompt.empty()) return InvalidArgument("empty prompt");
  if (options_.max_tokens < 0) return InvalidArgument("max_tokens must be >= 0, got ", options_.max_tokens);
  M3_RETURN_IF_ERROR(ValidateLookupOptions(options_.lookup));
  stats_ = GenerateStats();
  stats_.prompt_tokens = prompt.size();
  if (prompt.size() > session_.max_context())
    return OutOfRange("the prompt has ", prompt.size(), " tokens but the context limit is ", session_.max_context());
  // A scored prompt runs whole: the rows of a cached prefix were never kept.
  stats_.reused_tokens = session_.ReusePrefix(on_prompt_row_ ? prompt.first(0) : prompt);
  prompt_.assign(prompt.begin() + static_cast<std::ptrdiff_t>(stats_.reused_tokens), prompt.end());
  evaluated_ = 0;
  step_.clear();
  step_evaluated_ = false;
  guess_limit_ = static_cast<size_t>(options_.lookup.max_draft);
  stats_.stop_reason = "length";
  prefill_start_ = Clock::now();
  return Status::Ok();
}

Status Generation::Start(std::span<const int32_t> prompt) {
  M3_RETURN_IF_ERROR(Begin(prompt));
  return Step(pending());
}

Status Generation::Step(std::span<const int32_t> ids, ForwardObserver* observer) {
  const LogitsMode mode = logit_rows(ids) > 1 ? LogitsMode::kAllRows : LogitsMode::kLastRow;
  Status st = session_.Eval(ids, mode, &logits_, observer);
  if (st.code() == StatusCode::kOutOfMemory && pending().empty() && ids.size() > 1) {
    // Guesses are optional, and their positions may be what did not fit: the sampled token alone.
    DropGuesses();
    ids = ids.first(1);
    st = session_.Eval(ids, LogitsMode::kLastRow, &logits_, observer);
  }
  M3_RETURN_IF_ERROR(st);
  Evaluated(ids.size());
  return Status::Ok();
}

void Generation::DropGuesses() {
  if (step_.size() <= 1) return;
  stats_.drafted_tokens -= step_.size() - 1;
  step_.resize(1);
}

Status Generation::Run(ForwardObserver* observer) {
  for (std::span<const int32_t> step; Next(&step);) M3_RETURN_IF_ERROR(Step(step, observer));
  return Status::Ok();
}

void Generation::Evaluated(size_t n) {
  if (pending().empty()) {  // a decode step
    step_evaluated_ = true;
    return;
  }
  if (on_prompt_row_) {  // every row: row j predicts the token after pending()[j]
    const size_t vocab = logits_.size() / n;
    for (size_t j = 0; j < n; ++j) {
      const size_t target = evaluated_ + j + 1;  // the whole prompt runs (nothing reused)
      if (target < prompt_.size())
        on_prompt_row_(target, prompt_[target], std::span<const float>(logits_).subspan(j * vocab, vocab));
    }
    if (evaluated_ + n == prompt_.size())  // Next samples from the last row alone
      logits_.erase(logits_.begin(), logits_.end() - static_cast<std::ptrdiff_t>(vocab));
  }
  evaluated_ += n;
  if (!pending().empty()) return;
  decode_start_ = Clock::now();
  stats_.prefill_seconds = std::chrono::duration<double>(decode_start_ - prefill_start_).count();
  done_ = options_.max_tokens == 0;
}

bool Generation::Emit(int32_t id) {
  ++stats_.generated_tokens;
  if (std::find(options_.stop_ids.begin(), options_.stop_ids.end(), id) != options_.stop_ids.end()) {
    stats_.stop_reason = "stop";
    return false;
  }
  if (!on_token_(id)) {
    stats_.stop_reason = "caller";
    return false;
  }
  return stats_.generated_tokens < static_cast<size_t>(options_.max_tokens);
}

void Generation::KeepPositions(size_t n) {
  if (n < session_.position()) (void)session_.Rewind(n);
}

bool Generation::Next(std::span<const int32_t>* step) {
  if (done_ || !pending().empty()) return false;
  if (!step_.empty() && !step_evaluated_) {  // a failed pass, retried without guesses (see Step)
    DropGuesses();
    *step = step_;
    return true;
  }
  done_ = true;  // unless it goes on below
  // The latest pass's rows: the prompt's last one, or one per token of the step, whose row r
  // gives the token after step_[r] and so confirms (or not) the guess step_[r + 1].
  const size_t rows = step_.empty() ? 1 : step_.size();
  const size_t vocab = logits_.size() / rows;
  const size_t first = session_.position() - rows;  // position of row 0's token
  int32_t id = -1;
  size_t confirmed_guesses = 0;
  for (size_t r = 0; r < rows; ++r) {
    const int32_t guess = r + 1 < rows ? step_[r + 1] : -1;
    const std::span<const int32_t> history(session_.tokens().data(), first + r + 1);
    const std::span<float> row = std::span<float>(logits_).subspan(r * vocab, vocab);
    if (mask_) {
      // This token has position first + r + 1; the last one a generation emits has position
      // max_context (it is never evaluated).
      const size_t context_left = session_.max_context() + 1 - std::min(session_.max_context(), first + r + 1);
      mask_(row, std::min(static_cast<size_t>(options_.max_tokens) - stats_.generated_tokens, context_left));
    }
    id = sampler_.Sample(row, history, guess, stats_.prompt_tokens);  // frequency_penalty: the output only
    const bool confirmed = guess >= 0 && id == guess;
    emit_row_ = r;
    if (!Emit(id)) {
      KeepPositions(first + r + 1);  // as without guesses: the last token is not evaluated
      step_.clear();
      return false;
    }
    if (!confirmed) {
      KeepPositions(first + r + 1);
      break;
    }
    ++stats_.accepted_tokens;
    ++confirmed_guesses;
  }
  // The next step guesses one more token than this one confirmed (up to max_draft): after a
  // refusal a single guess, which costs little, until guesses hold again.
  if (rows > 1) guess_limit_ = std::min(static_cast<size_t>(options_.lookup.max_draft), confirmed_guesses + 1);
  if (session_.position() + 1 > session_.max_context()) {
    stats_.stop_reason = "context";
    step_.clear();
    return false;
  }
  // Guesses only where they fit: the context, and the tokens to generate after the one each
  // row samples (k guesses give k + 1 rows, so k + 1 more tokens at most).
  size_t room = std::min(session_.max_context() - session_.position() - 1,
                         static_cast<size_t>(options_.max_tokens) - stats_.generated_tokens - 1);
  room = std::min(room, guess_limit_);
  step_ = {id};
  if (room > 0) {
    const std::vector<int32_t> guess = LookupDraft(session_.tokens(), id, options_.lookup, room);
    step_.insert(step_.end(), guess.begin(), guess.end());
    stats_.drafted_tokens += guess.size();
  }
  step_evaluated_ = false;
  *step = step_;
  done_ = false;
  return true;
}

void Generation::Cancel() {
  if (done_) return;
  done_ = true;
  // An evaluated step's guesses were never confirmed: the cache keeps its sampled token only.
  if (step_evaluated_ && step_.size() > 1) KeepPositions(session_.position() - (step_.size() - 1));
  step_.clear();
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
  auto alone = [&](size_t i) { result[i] = gens[i]->Step(ids[i]); };
  if (gens.size() == 1) {
    alone(0);
    return result;
  }
  std::vector<Session*> sessions;
  std::vector<size_t> rows;
  for (size_t i = 0; i < gens.size(); ++i) {
    sessions.push_back(&gens[i]->session());
    rows.push_back(gens[i]->logit_rows(ids[i]));
  }
  std::vector<float> logits;
  if (Session::EvalBatch(sessions, ids, &logits, nullptr, rows).ok()) {
    size_t total = 0;
    for (size_t r : rows) total += r;
    const size_t vocab = logits.size() / total;
    auto row = logits.begin();
    for (size_t i = 0; i < gens.size(); ++i) {
      gens[i]->logits().assign(row, row + static_cast<std::ptrdiff_t>(rows[i] * vocab));
      row += static_cast<std::ptrdiff_t>(rows[i] * vocab);
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
  M3_RETURN_IF_ERROR(g.Run());
  if (stats) *stats = g.stats();
  return Status::Ok();
}

}  // namespace m3
