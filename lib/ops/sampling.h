// Next-token sampling: penalties, then greedy or temperature / top-k / top-p / min-p sampling.
// Deterministic for a given seed: the random stream is a fixed 64-bit Mersenne Twister and the
// uniform draw uses its top 53 bits (not std::uniform_real_distribution, whose output is
// implementation-defined).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace m3 {

struct SamplingParams {
  float temperature = 1.0f;        // 0: greedy (argmax; ties -> lower id)
  int top_k = 0;                   // 0: off
  float top_p = 1.0f;              // 1: off; keep the smallest set with cumulative prob >= top_p
  float min_p = 0.0f;              // 0: off; keep tokens with prob >= min_p * max prob
  float repetition_penalty = 1.0f; // 1: off; seen tokens: logit > 0 ? logit / r : logit * r
  // 0: off; tokens seen in the prompt or the output (all of `history`): logit -= presence_penalty.
  // OpenAI and vLLM count the output alone; this one has counted the prompt too since it came.
  float presence_penalty = 0.0f;
  // 0: off; -2..2 (OpenAI's range); as OpenAI and vLLM: logit -= frequency_penalty * (times the
  // token occurs in the output so far: the history after its prompt).
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
};

// Checks ranges; the message names the offending option.
Status ValidateSamplingParams(const SamplingParams& p);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Picks the next token from `logits` [vocab]; `history` (prompt and generated ids) drives the
  // penalties, its first `prompt_tokens` ids being the prompt (frequency_penalty counts the ids
  // after them). Ids in history outside the vocabulary are ignored.
  // `draft` (>= 0): a token guessed ahead (speculative decoding). Sampling returns it with its
  // probability p and otherwise draws from the distribution without it, so the result follows
  // the same distribution as without a draft (one uniform draw either way); greedy ignores it.
  int32_t Sample(std::span<const float> logits, std::span<const int32_t> history, int32_t draft = -1,
                 size_t prompt_tokens = 0);
  const SamplingParams& params() const { return params_; }

 private:
  double Uniform();  // [0, 1)
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> work_;
  std::vector<float> weights_;  // softmax weights of the whole vocabulary (no top-k)
  std::vector<int32_t> order_;
};

}  // namespace m3
