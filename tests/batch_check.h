// Decodes prompts together (Session::DecodeBatch) and each alone, greedily following the lone
// sequences, and counts the steps whose batched logits differ in any bit from the lone ones.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "runtime/engine.h"
#include "test_util.h"

namespace m3::test {

inline size_t BatchedStepsDifferingFromAlone(const Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                             int steps) {
  const size_t vocab = engine.model().config().vocab_size;
  auto argmax = [](const std::vector<float>& x) {
    return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
  };
  std::vector<std::unique_ptr<Session>> batched, alone;
  std::vector<Session*> sessions;
  std::vector<int32_t> next;
  std::vector<float> logits, own;
  for (const auto& p : prompts) {
    batched.push_back(std::make_unique<Session>(engine));
    alone.push_back(std::make_unique<Session>(engine));
    sessions.push_back(batched.back().get());
    REQUIRE(batched.back()->Eval(p, LogitsMode::kNone, nullptr).ok());
    REQUIRE(alone.back()->Eval(p, LogitsMode::kLastRow, &own).ok());
    next.push_back(argmax(own));
  }
  size_t differing = 0;
  for (int step = 0; step < steps; ++step) {
    REQUIRE(Session::DecodeBatch(sessions, next, &logits).ok());
    for (size_t i = 0; i < prompts.size(); ++i) {
      REQUIRE(alone[i]->Eval({&next[i], 1}, LogitsMode::kLastRow, &own).ok());
      differing += !std::equal(own.begin(), own.end(), logits.begin() + static_cast<std::ptrdiff_t>(i * vocab));
      next[i] = argmax(own);
    }
  }
  return differing;
}

}  // namespace m3::test
