// The generate loop: prefill the new prompt tokens, then sample token by token until a stop id,
// the token budget, the context limit or the caller says stop.
#pragma once

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

// Runs `prompt` (the whole conversation so far: the session's cached prefix is reused) and
// samples continuations. on_token(id) sees every generated id except a stop id; returning false
// stops generation.
Status Generate(Session& session, std::span<const int32_t> prompt, const GenerateOptions& options, Sampler& sampler,
                const std::function<bool(int32_t)>& on_token, GenerateStats* stats);

}  // namespace m3
