// What GET /metrics of `m3 serve` reports (Prometheus text, exposition format 0.0.4): counters
// since start, latency and prompt length histograms, recent token rates, and the state of the
// scheduler and of the connections at the time of asking.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/generate.h"

namespace m3::cli {

struct Server;

// A Prometheus histogram: counts at or below each bound (and +Inf), the sum and the count.
struct Histogram {
  std::vector<double> bounds;    // ascending
  std::vector<uint64_t> counts;  // per bucket (not cumulative), the last one past every bound
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  // `times` observations of `v` (a mean per token counted once per token).
  void Observe(double v, uint64_t times = 1);
  std::string Text(const char* name, const char* help) const;
};

class ServeMetrics {
 public:
  // Counters of completion requests and their choices.
  std::atomic<uint64_t> requests{0}, failed{0}, rejected{0}, cancelled{0}, prompt_tokens{0}, cached_tokens{0},
      generated_tokens{0};

  // An HTTP reply (the server's logger), under its route's label (RouteLabel).
  void Answered(const std::string& route, int status);
  // A choice that ended with HTTP status `code` (499: its client left), `seconds` after its
  // request came.
  void ChoiceEnded(int code, const GenerateStats& st, double seconds);
  // A completion request whose last choice ended `seconds` after it came, its client still there.
  void RequestEnded(double seconds);
  // Prometheus text of `server`.
  std::string Text(Server& server);

 private:
  std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> responses_;  // (route, HTTP status)
  Histogram time_to_first_token_{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram inter_token_{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
  Histogram request_duration_{{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}};
  Histogram prompt_length_{{1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144}};
  double prefill_rate_ = 0, decode_rate_ = 0;  // tokens/s of recent choices (a moving average)
};

}  // namespace m3::cli
