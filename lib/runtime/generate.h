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

// One generation as steps, so that a server can advance many at once: Start runs the prompt,
// then each Next samples a token from the latest logits and says whether another forward pass
// is wanted, which the caller runs for this generation alone (Session::Eval) or for several
// together (DecodeBatch below), writing its logits to logits().
class Generation {
 public:
  // on_token(id) sees every generated id except a stop id; returning false stops generation.
  Generation(Session& session, const GenerateOptions& options, Sampler& sampler,
             std::function<bool(int32_t)> on_token);
  // Runs `prompt` (the whole conversation so far: the session's cached prefix is reused).
  Status Start(std::span<const int32_t> prompt);
  // Samples the next token and passes it on; true with *next set when it is to be evaluated,
  // false when the generation has ended (stats().stop_reason says why).
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
  std::vector<float> logits_;
  GenerateStats stats_;
  Clock::time_point decode_start_;
  bool done_ = false, timed_ = false;
};

// One decode step of every generation in `gens` (each wanting the token Next gave it, in `ids`)
// in one forward pass. When the batched pass fails, each runs alone, so that one sequence's
// error (its context, memory, a non-finite value) is its own: returns each one's status.
std::vector<Status> DecodeStep(std::span<Generation* const> gens, std::span<const int32_t> ids);

// Runs `prompt` (the whole conversation so far: the session's cached prefix is reused) and
// samples continuations. on_token(id) sees every generated id except a stop id; returning false
// stops generation.
Status Generate(Session& session, std::span<const int32_t> prompt, const GenerateOptions& options, Sampler& sampler,
                const std::function<bool(int32_t)>& on_token, GenerateStats* stats);

}  // namespace m3
