// Continuous batching over a pool of sessions (`m3 serve`, `m3 batch`). Requests wait in a queue
// until a session is free; then every step runs one forward pass for all active requests
// (BatchStep): a token for each that is decoding, and chunks of the prompts still pending, oldest
// first, up to one prefill chunk of tokens a step, so that a long new prompt slows the replies
// under way instead of stalling them. Each weight is read once per step for all of them.
//
// A request goes to the free session whose last prompt it continues (so a client resending a
// growing conversation pays only for its new tokens), else to an unused one, else to the least
// recently used. With a cache budget, the caches of idle sessions are released (least recently
// used first) before a request is refused for memory, and its step is retried.
//
// Prefix sharing (runtime/prefix_cache.h): once a prompt's pass ran, the whole pages of its cache
// go to a store the sessions share; a later request whose prompt begins with more of a stored
// prefix than its session holds adopts those pages (copy-on-write, no compute) and prefills only
// the rest: every conversation with one long system prompt prefills it once. The budget counts
// each page once however many sessions and the store hold it; what the store alone holds is freed
// (least recently used first) before idle sessions' caches. Off with an offloading engine.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/chat.h"
#include "runtime/engine.h"
#include "runtime/prefix_cache.h"

namespace m3 {

struct SchedulerOptions {
  size_t slots = 1;          // sessions, and the most requests generating at once
  SessionOptions session;    // of every slot
  uint64_t cache_budget = 0;  // most bytes all slots' caches hold together (0: what the process can get)
  std::function<void(const std::string&)> log;  // notes such as a released cache (may be empty)
  bool prefix_cache = true;  // share prompt prefixes' pages between the slots (when not offloading)
  // Without a cache budget: most bytes of pages the prefix store holds, beyond which the pages it
  // alone holds are evicted after a prompt's pass (0: a quarter of the memory available when the
  // scheduler starts). With a budget, the budget bounds it.
  uint64_t prefix_cache_limit = 0;
};

struct ScheduledRequest {
  std::vector<int32_t> prompt;  // the whole conversation's ids
  TurnOptions turn;
  SamplingParams sampling;
  // On the scheduler's thread: every non-empty piece of the turn as it is decoded; false stops it.
  std::function<bool(const TurnDelta&)> on_delta;
  // On the scheduler's thread, once: the status (on error, what was generated before it), the
  // turn, its stats, and the most sequences one of its decode passes ran with.
  std::function<void(const Status&, ParsedOutput, const GenerateStats&, size_t largest_batch)> on_end;
  // Optional: set from any thread to stop the request at its next step (stop reason "caller"); a
  // request still queued then ends without running (its stats empty but for that reason).
  std::shared_ptr<std::atomic<bool>> cancelled;
};

class Scheduler {
 public:
  Scheduler(const Engine& engine, const Tokenizer& tokenizer, const SchedulerOptions& options);
  ~Scheduler();  // Stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  size_t max_context() const { return slots_.front().session->max_context(); }
  // From any thread. A prompt past the context limit ends with OutOfRange at its first step.
  void Submit(ScheduledRequest request);
  // Runs steps on a thread of its own until Stop.
  void Start();
  // Ends that thread; requests not ended yet end with an error.
  void Stop();
  // Runs steps on the calling thread until no request is queued or generating (without Start).
  void RunUntilIdle();
  // From any thread: ends every request still waiting for a slot with `status` (a server that
  // drains before it exits); those generating go on.
  void DropQueued(const Status& status);
  // From any thread: OutOfRange when a context of `tokens` needs more cache memory than the
  // whole budget, so that no wait would ever let it run (memory others hold is transient).
  Status CheckFitsBudget(size_t tokens) const;
  // From any thread: requests waiting for a slot, and those generating.
  size_t queued() const { return queued_; }
  size_t active() const { return active_count_; }
  // From any thread: the prefix store's size and counters (all 0 when it is off).
  PrefixCacheStats prefix_stats() const { return prefix_ ? prefix_->stats() : PrefixCacheStats{}; }
  // From any thread: bytes the slots' caches and the prefix store hold (each page once), as of the
  // latest step.
  uint64_t cache_bytes() const { return cache_bytes_; }

 private:
  struct Job;
  struct Slot {
    std::unique_ptr<Session> session;
    uint64_t last_used = 0;
    size_t prompt_tokens = 0;  // of its last request
    bool busy = false;
  };

  // Takes queued requests while slots are free; false when nothing is queued or active.
  bool Admit();
  void Step();
  bool Begin(Job& job);
  void End(Job& job, const Status& status);
  size_t PickSlot(const std::vector<int32_t>& prompt);
  void ShareCacheBudget(const std::vector<Job*>& stepped);
  uint64_t HeldBytes() const;
  uint64_t NeededBytes(const Session& s, size_t tokens) const;
  Status Classify(const Job& job, size_t step_tokens, const Status& st) const;
  // Frees cache memory after a pass found too little: pages only the prefix store holds (at least
  // `want` bytes of them if it has them), else the caches of the least recently used idle slot.
  // False when neither holds any.
  bool ReleaseCacheMemory(uint64_t want);
  void EndAll(const Status& status);

  const Tokenizer& tokenizer_;
  SchedulerOptions options_;
  std::unique_ptr<PrefixCache> prefix_;  // null when off; outlives the slots' sessions
  uint64_t prefix_limit_ = 0;            // without a budget: SchedulerOptions::prefix_cache_limit
  std::vector<Slot> slots_;  // the stepping thread's alone
  uint64_t clock_ = 0;
  std::vector<std::unique_ptr<Job>> active_;

  std::mutex mu_;  // guards queue_ and stop_
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Job>> queue_;
  bool stop_ = false;
  std::atomic<size_t> queued_{0}, active_count_{0};
  std::atomic<uint64_t> cache_bytes_{0};  // HeldBytes() at the latest step
  std::thread thread_;
};

}  // namespace m3
