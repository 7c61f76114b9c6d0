// Pieces shared by the quality reports (bench/pack_quality, bench/cache_quality): a golden case's
// tokens, and how far one run's logits are from a reference run's (KL divergence, top-1).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace m3 {

// KL(p || q) of softmax(a) and softmax(b) over n logits, in double (nats, >= 0).
double KlDivergence(const float* a, const float* b, size_t n);
size_t Argmax(const float* x, size_t n);  // ties -> lower index

struct LogitAgreement {
  size_t rows = 0;      // logit rows compared
  double kl_mean = 0;   // mean over rows of KL(p_reference || p_other), nats
  double kl_max = 0;
  double top1 = 0;      // fraction of rows with the same argmax
};
// Compares row r of `other` [rows, vocab] with row r of `reference` (same size).
LogitAgreement CompareLogits(const std::vector<float>& reference, const std::vector<float>& other, size_t vocab);

// The inputs of a golden case folder (tests/data/golden/<name>/case.json).
struct GoldenCase {
  std::string dir, name;          // name: the folder's last component
  std::vector<int32_t> prompt;    // prompt_ids
  int decode_steps = 0;
  std::vector<int32_t> greedy;    // greedy_ids (decode_steps + 1); decode step i feeds greedy[i]
};
StatusOr<GoldenCase> ReadGoldenCase(const std::string& dir);

}  // namespace m3
