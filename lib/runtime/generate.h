// The generate loop: prefill the new prompt tokens, then sample token by token until a stop id,
// the token budget, the context limit or the caller says stop.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "ops/sampling.h"
#include "runtime/engine.h"

namespace m3 {

// Speculative decoding by prompt lookup: each step guesses the tokens that followed the latest
// earlier occurrence of the sequence's last n tokens (n from max_ngram down to min_ngram) and
// verifies them in the same forward pass as the sampled token (one weight read for all of them).
// A step guesses at most one more token than the previous step confirmed, so guesses that keep
// failing cost one extra row per step. Greedy output is the one without it; sampling keeps its
// distribution (Sampler's draft).
inline constexpr int kMaxLookupDraft = 32;
struct LookupOptions {
  int max_draft = 0;  // tokens guessed per step, 0..kMaxLookupDraft; 0: off
  int max_ngram = 4;
  int min_ngram = 2;
};

// Checks ranges; the message names the offending option.
Status ValidateLookupOptions(const LookupOptions& o);

// The guess for the sequence `context` followed by `next`: up to max_tokens tokens that followed
// the latest earlier occurrence of its last n tokens, for the largest n in [min_ngram, max_ngram]
// that has one; empty when none does.
std::vector<int32_t> LookupDraft(std::span<const int32_t> context, int32_t next, const LookupOptions& options,
                                 size_t max_tokens);

struct GenerateOptions {
  int max_tokens = 256;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (not passed on)
  LookupOptions lookup;
};

struct GenerateStats {
  size_t prompt_tokens = 0;     // prompt length in all
  size_t reused_tokens = 0;     // served from the session's cache
  double prefill_seconds = 0;
  size_t generated_tokens = 0;  // sampled tokens, the stop token included
  double decode_seconds = 0;    // time after the first token
  std::string stop_reason;      // "stop", "length", "context" or "caller"
  std::string stop_string;      // a turn's stop string that ended it (TurnGeneration), else empty
  size_t drafted_tokens = 0;    // prompt lookup: tokens guessed and verified
  size_t accepted_tokens = 0;   // of those, the ones generated (each saved a forward pass)
  double prefill_tok_s() const;
  double decode_tok_s() const;
};

// One generation as steps, so that a server can advance many at once. Begin takes the prompt
// and leaves what the session has not cached pending; the caller runs it, in one pass or in
// chunks (Evaluated), then each Next samples from the latest logits and says whether another
// pass is wanted: over the sampled token and, with prompt lookup, the tokens guessed after it,
// whose logits rows (logit_rows) the following Next verifies. Passes run for this generation
// alone (Session::Eval; Start does all of it for a lone generation) or for several together
// (BatchStep below), writing logits().
class Generation {
 public:
  // on_token(id) sees every generated id except a stop id; returning false stops generation.
  Generation(Session& session, const GenerateOptions& options, Sampler& sampler,
             std::function<bool(int32_t)> on_token);
  // Checks `prompt` (the whole conversation so far) and keeps the session's cached prefix of it;
  // the rest (at least its last token) is pending.
  Status Begin(std::span<const int32_t> prompt);
  // Before Begin: every prompt token but the first goes to on_row(index, id, logits) with the row
  // of logits that predicts it, in order, as its pass is evaluated. The session's cached prefix is
  // then not reused (its rows were never kept), and prompt passes give every row.
  void ScorePrompt(std::function<void(size_t index, int32_t id, std::span<const float> logits)> on_row) {
    on_prompt_row_ = std::move(on_row);
  }
  // Constrained decoding: before each token is sampled, mask(logits, tokens_left) sets the logits
  // of the tokens that may not come next to -infinity (at least one stays finite); tokens_left is
  // how many tokens the generation may still emit, this one included (the token budget and the
  // context). Log-probabilities are then those of the masked distribution.
  void MaskLogits(std::function<void(std::span<float> logits, size_t tokens_left)> mask) { mask_ = std::move(mask); }
  // Begin, then the whole pending prompt in one Step.
  Status Start(std::span<const int32_t> prompt);
  // One pass of this generation alone (Session::Eval) over `ids`, a chunk of the pending prompt
  // or the step Next gave, then Evaluated. A step whose guesses do not fit in memory runs again
  // without them.
  Status Step(std::span<const int32_t> ids, ForwardObserver* observer = nullptr);
  // Next and Step until the generation ends.
  Status Run(ForwardObserver* observer = nullptr);
  // Prompt tokens not yet evaluated; empty once the prompt is done.
  std::span<const int32_t> pending() const {
    return std::span<const int32_t>(prompt_).subspan(std::min(evaluated_, prompt_.size()));
  }
  // Rows of logits the pass over `ids` (a chunk of the pending prompt, or the step Next gave)
  // must give: its last one for a prompt chunk (every one when the prompt is scored), every one
  // for a step.
  size_t logit_rows(std::span<const int32_t> ids) const {
    return pending().empty() || on_prompt_row_ ? ids.size() : 1;
  }
  // The first n pending tokens (n > 0), or the step Next gave, went through a forward pass and
  // logits() holds its logit_rows rows.
  void Evaluated(size_t n);
  // Once nothing is pending: samples from the latest logits, each row in turn while it confirms
  // the guess of the step before, and passes the tokens on; true with *step set to the tokens to
  // evaluate next (the sampled one, then any guesses), false when the generation has ended
  // (stats().stop_reason says why). Until Evaluated says it was, Next gives the same sampled token
  // again, without its guesses and without sampling (a pass that failed, e.g. for memory, can be
  // retried).
  bool Next(std::span<const int32_t>* step);
  // Ends the generation now, as on_token returning false would (stop reason "caller").
  void Cancel();
  bool done() const { return done_; }
  // Inside on_token: the row of logits the token was sampled from.
  std::span<const float> token_logits() const {
    const size_t vocab = logits_.size() / (step_.empty() ? 1 : step_.size());
    return std::span<const float>(logits_).subspan(emit_row_ * vocab, vocab);
  }
  std::vector<float>& logits() { return logits_; }
  Session& session() { return session_; }
  // Timing ends at the first call after the end.
  const GenerateStats& stats();

 private:
  using Clock = std::chrono::steady_clock;
  Session& session_;
  GenerateOptions options_;
  Sampler& sampler_;
  std::function<bool(int32_t)> on_token_;
  std::function<void(size_t, int32_t, std::span<const float>)> on_prompt_row_;  // ScorePrompt
  std::function<void(std::span<float>, size_t)> mask_;                          // MaskLogits
  // Passes on one sampled token; false when it ends the generation.
  bool Emit(int32_t id);
  // Forgets the positions from n on (guesses the sampling did not confirm).
  void KeepPositions(size_t n);
  // The step becomes its sampled token alone.
  void DropGuesses();

  std::vector<int32_t> prompt_;  // the part Begin did not find cached
  size_t evaluated_ = 0;         // of prompt_
  std::vector<int32_t> step_;    // the tokens Next gave: the sampled one, then the guesses
  bool step_evaluated_ = false;
  size_t guess_limit_ = 0;       // most guesses of the next step
  size_t emit_row_ = 0;          // of logits_, while on_token runs
  std::vector<float> logits_;
  GenerateStats stats_;
  Clock::time_point prefill_start_, decode_start_;
  bool done_ = false, timed_ = false;
};

// One forward pass for several generations: gens[i] runs ids[i], a chunk of its pending prompt
// or the step Next gave it (Session::EvalBatch), and is told so (Evaluated). When the batched
// pass fails, each runs alone, so that one sequence's error (its context, memory, a non-finite
// value) is its own: returns each one's status.
std::vector<Status> BatchStep(std::span<Generation* const> gens, std::span<const std::span<const int32_t>> ids);

// Runs `prompt` (the whole conversation so far: the session's cached prefix is reused) and
// samples continuations. on_token(id) sees every generated id except a stop id; returning false
// stops generation.
Status Generate(Session& session, std::span<const int32_t> prompt, const GenerateOptions& options, Sampler& sampler,
                const std::function<bool(int32_t)>& on_token, GenerateStats* stats);

}  // namespace m3
