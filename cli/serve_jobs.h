// The completion requests in flight of `m3 serve`, as the HTTP side sees them: admitted while the
// queue has room for their choices (else 429), each choice's end logged and counted, cancelled
// when their client leaves or the server drains. The runtime's Reply (runtime/reply.h) runs them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "cli/serve_metrics.h"
#include "runtime/reply.h"

namespace m3::cli {

// A request in flight: its reply, and why it was cancelled.
struct Job {
  std::shared_ptr<Reply> reply;
  std::string path;
  // Its client left (nothing to answer), or the server is shutting down (a 503).
  std::atomic<bool> client_gone{false}, shut_down{false};
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};

class JobQueue;

// Room in the queue held for a request's choices while it is built (its constraint compiled, its
// prompts rendered): given back when dropped, unless Start took it.
class Admission {
 public:
  Admission(Admission&& o) noexcept : queue_(o.queue_), choices_(o.choices_) { o.queue_ = nullptr; }
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;
  Admission& operator=(Admission&&) = delete;
  ~Admission();

 private:
  friend class JobQueue;
  Admission(JobQueue* queue, size_t choices) : queue_(queue), choices_(choices) {}
  JobQueue* queue_;
  size_t choices_;
};

class JobQueue {
 public:
  JobQueue(size_t slots, size_t max_queue, ServeMetrics& metrics)
      : slots_(slots), max_queue_(max_queue), metrics_(metrics) {}

  // Room for `choices` if the queue has it, before the request costs anything; none when it
  // has not (counted as rejected: a 429).
  std::optional<Admission> Admit(size_t choices);
  // Hands the choices of `reply` (built) to the scheduler in the room `admitted` holds.
  std::shared_ptr<Job> Start(std::shared_ptr<Reply> reply, const std::string& path, Admission admitted);
  // When to try again after a 429 or 503: the queue ahead served at the recent pace, 1..300 s.
  int RetryAfterSeconds();
  // Marks `job` as left by its client: the scheduler drops or stops it within a step.
  void ClientLeft(Job& job);
  // Stops every request in flight within a step, each ending with a 503 (a drain's last resort).
  void CancelAll();
  // Choices handed to the scheduler and not ended.
  size_t in_flight() const { return in_flight_; }

 private:
  friend class Admission;
  bool Reserve(size_t n);
  void ChoiceEnded(const std::shared_ptr<Job>& job, const Status& status, const GenerateStats& st, size_t largest_batch,
                   bool last);

  const size_t slots_, max_queue_;
  ServeMetrics& metrics_;
  std::atomic<size_t> in_flight_{0};
  std::mutex mu_;
  std::set<std::shared_ptr<Job>> jobs_;  // in flight, for a drain to cancel
  double mean_seconds_ = 0;              // of recent requests
};

}  // namespace m3::cli
