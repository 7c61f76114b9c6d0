// Scoring a token sequence with the model (m3 perplexity): the log-likelihood of every token
// given the ones before it, over windows of a context length slid by a stride (the HuggingFace
// "strided perplexity"), and how far the model's next-token distributions are from a base model's
// (KL divergence), through a file of the base model's log-probabilities.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/hash.h"
#include "base/status.h"
#include "runtime/engine.h"

namespace m3 {

// One window: the tokens [begin, end) run from position 0 of a fresh context, and the tokens
// [first_target, end) are scored, each from the logits row of the token before it.
struct ScoreWindow {
  size_t begin = 0, end = 0, first_target = 0;
};

// Windows of `context` tokens starting every `stride` tokens until one reaches the end. The first
// scores from token 1; each later one the tokens after the previous window's end, so every token
// but the first is scored once (with stride == context, also not the first of each window) and
// has at least min(its index, context - stride) tokens before it in its window.
// InvalidArgument unless 2 <= context, 1 <= stride <= context and n_tokens >= 2.
StatusOr<std::vector<ScoreWindow>> PlanScoreWindows(size_t n_tokens, size_t context, size_t stride);

// Appends ids[0 .. n-1) to the session's tokens and calls on_token(i, logits) for i = 1 .. n-1 in
// order: `logits` is the vocabulary row that predicts ids[i] from everything before it (the last
// id is only a target: not appended). Rows in forward passes of at most the session's prefill
// chunk. InvalidArgument for an id outside the vocabulary; on an error the session is as it was.
// When on_token returns false it stops there, the session holding the tokens evaluated so far.
Status ScoreContinuation(Session& session, std::span<const int32_t> ids,
                         const std::function<bool(size_t i, std::span<const float> logits)>& on_token);

// Runs each window through `session` (rewound to empty first) and calls on_token(index, logits)
// for every scored token in order: `logits` is the vocabulary row that predicts ids[index]. Tokens
// before a window's scored part run without logits; the rest in forward passes of at most the
// session's prefill chunk. InvalidArgument for an id outside the vocabulary. on_window(w) follows window w's last token. Stops at the first error,
// or without one when a callback returns false.
Status ScoreTokens(Session& session, std::span<const int32_t> ids, std::span<const ScoreWindow> windows,
                   const std::function<bool(size_t index, std::span<const float> logits)>& on_token,
                   const std::function<bool(size_t window)>& on_window = {});

// log(sum_i exp(x_i)), in double.
double LogSumExp(std::span<const float> logits);
// log softmax(logits) rounded to float, into out (resized).
void LogSoftmax(std::span<const float> logits, std::vector<float>* out);
// KL(p || q) in nats from log-probabilities (log_p of the reference), >= 0.
double KlDivergence(std::span<const float> log_p, std::span<const float> log_q);

// A token's log-probability under a row of logits (the model's own distribution: before any
// sampling penalty, temperature or filter), with the row's most likely tokens.
struct TokenLogprob {
  int32_t id = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // (id, log-probability), most likely first, ties to the lower id
};
// `id`'s entry in `logits` with its top_n most likely tokens (fewer when the row is shorter).
// `id` must index the row.
TokenLogprob ScoreToken(std::span<const float> logits, int32_t id, size_t top_n);

// Mean and its standard error of a stream of values.
class MeanEstimate {
 public:
  void Add(double x) {
    ++n_;
    sum_ += x;
    sum_sq_ += x * x;
  }
  size_t count() const { return n_; }
  double mean() const { return n_ ? sum_ / static_cast<double>(n_) : 0.0; }
  // Standard error of the mean (sample variance / n); 0 for fewer than 2 values.
  double standard_error() const;

 private:
  size_t n_ = 0;
  double sum_ = 0, sum_sq_ = 0;
};

// What a log-probability file was computed on; a model is only compared with a base over the same.
struct LogProbFileInfo {
  uint64_t vocab = 0;         // log-probabilities per scored token
  uint64_t scored = 0;        // scored tokens (rows)
  uint64_t n_ids = 0;         // tokens of the scored sequence
  uint64_t ids_hash = 0;      // Hash64 of those ids (int32 little-endian)
  uint64_t context = 0, stride = 0;
};
// InvalidArgument naming the first field in which `file` (read from `path`) differs from `run`.
Status CheckSameScoring(const LogProbFileInfo& file, const LogProbFileInfo& run, const std::string& path);

// Writes one row of log-probabilities per scored token, in order: a 128-byte header (magic
// "M3LOGPRB", version, LogProbFileInfo, XXH64 of the rows), then the rows as little-endian
// float32. The rows go to PATH.tmp, renamed to PATH only by Finish once all are written, so an
// interrupted run never leaves a file that looks complete.
class LogProbFileWriter {
 public:
  static StatusOr<std::unique_ptr<LogProbFileWriter>> Create(const std::string& path, const LogProbFileInfo& info);
  ~LogProbFileWriter();  // without Finish: removes PATH.tmp
  Status Append(std::span<const float> log_probs);
  Status Finish();

 private:
  LogProbFileWriter() = default;
  std::string path_, tmp_;
  LogProbFileInfo info_;
  std::FILE* f_ = nullptr;
  uint64_t rows_ = 0;
  Hasher64 hash_;
};

// Reads such a file row by row: Open checks the header and the size; the last Next checks the
// rows' hash (Corrupt on a mismatch).
class LogProbFileReader {
 public:
  static StatusOr<std::unique_ptr<LogProbFileReader>> Open(const std::string& path);
  ~LogProbFileReader();
  const LogProbFileInfo& info() const { return info_; }
  Status Next(std::vector<float>* row);

 private:
  LogProbFileReader() = default;
  std::string path_;
  LogProbFileInfo info_;
  uint64_t expected_hash_ = 0, rows_ = 0;
  std::FILE* f_ = nullptr;
  Hasher64 hash_;
};

}  // namespace m3
