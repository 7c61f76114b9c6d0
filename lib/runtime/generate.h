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

struct GenerateOptions {
  int max_tokens = 256;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (not passed on)
};

struct GenerateStats {
  size_t prompt_tokens = 0;     // prompt length in all
  size_t reused_tokens = 0;     // served from the session's cache
  double prefill_seconds = 0;
  size_t generated_tokens = 0;  // sampled tokens, the stop token included
  double decode_seconds = 0;    // time after the first token
  std::string stop_reason;      // "stop", "length", "context" or "caller"
  double prefill_tok_s() const;
  double decode_tok_s() const;
};

// One generation as steps, so that a server can advance many at once. Begin takes the prompt
// and leaves what the session has not cached pending; the caller runs it, in one pass or in
// chunks (Evaluated), then each Next samples a token from the latest logits and says whether
// another pass is wanted. Passes run for this generation alone (Session::Eval; Start does all
// of it for a lone generation) or for several together (BatchStep below), writing logits().
class Generation {
 public:
  // on_token(id) sees every generated id except a stop id; returning false stops generation.
  Generation(Session& session, const GenerateOptions& options, Sampler& sampler,
             std::function<bool(int32_t)> on_token);
  // Checks `prompt` (the whole conversation so far) and keeps the session's cached prefix of it;
  // the rest (at least its last token) is pending.
  Status Begin(std::span<const int32_t> prompt);
  // Begin, then the whole pending prompt in one Session::Eval.
  Status Start(std::span<const int32_t> prompt);
  // Prompt tokens not yet evaluated; empty once the prompt is done.
  std::span<const int32_t> pending() const {
    return std::span<const int32_t>(prompt_).subspan(std::min(evaluated_, prompt_.size()));
  }
  // The first n pending tokens (n > 0), or the token Next gave, went through a forward pass and
  // logits() holds the last one's.
  void Evaluated(size_t n);
  // Once nothing is pending: samples the next token and passes it on; true with *next set when it
  // is to be evaluated, false when the generation has ended (stats().stop_reason says why). Until
  // Evaluated says it was, Next gives that token again without sampling (a pass that failed, e.g.
  // for memory, can be retried).
  bool Next(int32_t* next);
  // Ends the generation now, as on_token returning false would (stop reason "caller").
  void Cancel();
  bool done() const { return done_; }
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
  std::vector<int32_t> prompt_;  // the part Begin did not find cached
  size_t evaluated_ = 0;         // of prompt_
  int32_t unevaluated_ = -1;     // the token Next gave, until Evaluated
  std::vector<float> logits_;
  GenerateStats stats_;
  Clock::time_point prefill_start_, decode_start_;
  bool done_ = false, timed_ = false;
};

// One forward pass for several generations: gens[i] runs ids[i], a chunk of its pending prompt
// or the token Next gave it (Session::EvalBatch), and is told so (Evaluated). When the batched
// pass fails, each runs alone, so that one sequence's error (its context, memory, a non-finite
// value) is its own: returns each one's status.
std::vector<Status> BatchStep(std::span<Generation* const> gens, std::span<const std::span<const int32_t>> ids);

// Runs `prompt` (the whole conversation so far: the session's cached prefix is reused) and
// samples continuations. on_token(id) sees every generated id except a stop id; returning false
// stops generation.
Status Generate(Session& session, std::span<const int32_t> prompt, const GenerateOptions& options, Sampler& sampler,
                const std::function<bool(int32_t)>& on_token, GenerateStats* stats);

}  // namespace m3
