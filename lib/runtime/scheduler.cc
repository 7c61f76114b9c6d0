#include "runtime/scheduler.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <stdexcept>
#include <utility>

#include "base/bytes.h"
#include "platform/memory.h"
#include "ops/sampling.h"

namespace m3 {

struct Scheduler::Job {
  ScheduledRequest request;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<TurnGeneration> generation;
  size_t slot = 0;
  size_t largest_batch = 0;
  bool ended = false;
};

Scheduler::Scheduler(const Engine& engine, const Tokenizer& tokenizer, const SchedulerOptions& options)
    : tokenizer_(tokenizer), options_(options) {
  // Caches grow as contexts do: an idle slot costs only what its conversation holds.
  for (size_t i = 0; i < std::max<size_t>(1, options.slots); ++i)
    slots_.push_back({std::make_unique<Session>(engine, options.session)});
  // With the dense part offloaded the rows live on the device: nothing in host pages to share.
  if (options.prefix_cache && !engine.offload()) {
    const KvCache& cache = slots_.front().session->cache();
    prefix_ = std::make_unique<PrefixCache>(cache.page_rows(), cache.options());
    for (Slot& slot : slots_)
      if (Status st = slot.session->set_prefix_cache(prefix_.get()); !st.ok()) throw std::logic_error(st.ToString());
    if (!options.cache_budget) {
      // Idle slots keep at most a context each; the store could keep every prompt it saw.
      prefix_limit_ = options.prefix_cache_limit;
      if (!prefix_limit_)
        if (const std::optional<uint64_t> available = AvailableMemoryBytes()) prefix_limit_ = *available / 4;
    }
  }
}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Submit(ScheduledRequest request) {
  auto job = std::make_unique<Job>();
  job->request = std::move(request);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
    queued_ = queue_.size();
  }
  wake_.notify_one();
}

void Scheduler::Start() {
  thread_ = std::thread([this] {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || !queue_.empty() || !active_.empty(); });
        if (stop_) break;
      }
      if (Admit()) Step();
    }
    EndAll(Status(StatusCode::kInternal, "the server is stopping"));
  });
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
  EndAll(Status(StatusCode::kInternal, "the scheduler stopped"));
}

void Scheduler::RunUntilIdle() {
  while (Admit()) Step();
}

bool Scheduler::Admit() {
  std::vector<std::unique_ptr<Job>> admitted, cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Requests cancelled while they waited (their clients left) end here, without a step.
    for (auto it = queue_.begin(); it != queue_.end();)
      if ((*it)->request.cancelled && (*it)->request.cancelled->load()) {
        cancelled.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    while (!queue_.empty() && active_.size() + admitted.size() < slots_.size()) {
      admitted.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    queued_ = queue_.size();
  }
  for (auto& job : cancelled) End(*job, Status::Ok());
  for (auto& job : admitted)
    if (Begin(*job)) active_.push_back(std::move(job));
  active_count_ = active_.size();
  return !active_.empty();
}

void Scheduler::DropQueued(const Status& status) {
  std::deque<std::unique_ptr<Job>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(queue_);
    queued_ = 0;
  }
  for (auto& job : dropped) End(*job, status);  // no generation: touches the job alone
}

void Scheduler::EndAll(const Status& status) {
  std::deque<std::unique_ptr<Job>> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting.swap(queue_);
    queued_ = 0;
  }
  for (auto& job : active_) End(*job, status);
  active_.clear();
  active_count_ = 0;
  for (auto& job : waiting) End(*job, status);
}

// The free slot for `prompt`. First one whose conversation the prompt continues: it shares the
// slot's last prompt but for its last few tokens (the generation prompt, e.g. "<mm:think>",
// renders differently once the reply is part of the history); the longest such. Else an unused
// slot, else the least recently used. A conversation that shares only the system prompt and
// differs in its last user message (>= 6 tokens from the end with M3's template, "Hi" included)
// does not continue it: it would evict that conversation's cache.
size_t Scheduler::PickSlot(const std::vector<int32_t>& prompt) {
  constexpr size_t kRenderSlack = 3;
  Slot* pick = nullptr;
  size_t pick_shared = 0;
  for (Slot& slot : slots_) {
    if (slot.busy) continue;
    const auto& cached = slot.session->tokens();
    const size_t shared = static_cast<size_t>(
        std::mismatch(cached.begin(), cached.end(), prompt.begin(), prompt.end()).first - cached.begin());
    if (slot.prompt_tokens > 0 && shared + kRenderSlack >= slot.prompt_tokens && shared > pick_shared) {
      pick = &slot;
      pick_shared = shared;
    }
  }
  for (Slot& slot : slots_)
    if (!pick && !slot.busy && slot.prompt_tokens == 0) pick = &slot;
  if (!pick)  // Admit takes a request only while a slot is free
    for (Slot& slot : slots_)
      if (!slot.busy && (!pick || slot.last_used < pick->last_used)) pick = &slot;
  pick->last_used = ++clock_;
  pick->prompt_tokens = prompt.size();
  pick->busy = true;
  return static_cast<size_t>(pick - slots_.data());
}

// A free slot and the job's generation; false (and the job ended) on error. Its prompt runs in
// the following steps.
bool Scheduler::Begin(Job& job) {
  try {
    job.slot = PickSlot(job.request.prompt);
    job.sampler = std::make_unique<Sampler>(job.request.sampling);
    job.generation = std::make_unique<TurnGeneration>(
        *slots_[job.slot].session, tokenizer_, job.request.turn, *job.sampler,
        [&job](const TurnDelta& d) { return !job.request.on_delta || job.request.on_delta(d); });
    if (Status st = job.generation->generation().Begin(job.request.prompt); !st.ok()) {
      End(job, st);
      return false;
    }
  } catch (const std::exception& e) {
    End(job, Status(StatusCode::kInternal, e.what()));
    return false;
  }
  return true;
}

void Scheduler::Step() {
  cache_bytes_ = HeldBytes();  // for cache_bytes(), read from any thread
  try {
    size_t budget = slots_.front().session->prefill_chunk();
    std::vector<Generation*> gens;
    std::vector<std::span<const int32_t>> ids;
    std::vector<Job*> stepped;
    std::vector<std::pair<Job*, Status>> ended;
    for (size_t i = 0; i < active_.size(); ++i) {
      Job* job = active_[i].get();
      Generation& g = job->generation->generation();
      if (job->request.cancelled && job->request.cancelled->load()) g.Cancel();
      if (g.done()) {
        ended.emplace_back(job, Status::Ok());
      } else if (!g.pending().empty()) {
        if (budget == 0) continue;  // its turn comes in a later step
        const std::span<const int32_t> chunk = g.pending().first(std::min(budget, g.pending().size()));
        budget -= chunk.size();
        gens.push_back(&g);
        ids.push_back(chunk);
        stepped.push_back(job);
      } else if (std::span<const int32_t> step; g.Next(&step)) {
        gens.push_back(&g);
        ids.push_back(step);
        stepped.push_back(job);
      } else {
        ended.emplace_back(job, Status::Ok());
      }
    }
    if (!gens.empty()) {
      for (Job* job : stepped)  // decoding ones: the sequences their token's pass ran with
        if (job->generation->generation().pending().empty())
          job->largest_batch = std::max(job->largest_batch, gens.size());
      ShareCacheBudget(stepped);
      std::vector<bool> prompt_chunk(stepped.size());
      for (size_t i = 0; i < stepped.size(); ++i) prompt_chunk[i] = !gens[i]->pending().empty();
      const std::vector<Status> st = BatchStep(gens, ids);
      for (size_t i = 0; i < gens.size(); ++i) {
        Session& session = *slots_[stepped[i]->slot].session;
        // Out of memory: pages only the prefix store holds go first, then the caches of idle
        // conversations; the step is retried next time (a failed pass changes nothing, and Next
        // gives the same step again).
        if (st[i].code() == StatusCode::kOutOfMemory && ReleaseCacheMemory(NeededBytes(session, ids[i].size())))
          continue;
        if (!st[i].ok()) {
          ended.emplace_back(stepped[i], Classify(*stepped[i], ids[i].size(), st[i]));
        } else if (prompt_chunk[i]) {  // the prompt's pages so far, for the requests to come
          session.PublishPrefix(std::min(session.position(), stepped[i]->request.prompt.size()));
        }
      }
      const bool published = std::find(prompt_chunk.begin(), prompt_chunk.end(), true) != prompt_chunk.end();
      if (published && prefix_limit_ && prefix_->stats().bytes > prefix_limit_)
        prefix_->EvictUnshared(prefix_->stats().bytes - prefix_limit_);
    }
    for (auto& [job, st] : ended) End(*job, st);
  } catch (const std::exception& e) {  // e.g. out of memory in a sampler: those requests end
    for (auto& job : active_) End(*job, Internal("decode step: ", e.what()));
  }
  std::erase_if(active_, [](const std::unique_ptr<Job>& j) { return j->ended; });
  active_count_ = active_.size();
}

// Out of cache memory with no idle cache left to release: permanent (a 4xx, not worth a retry)
// when the request's context needs more than the whole budget even alone, else transient (the
// memory other requests hold now comes back when they end).
Status Scheduler::Classify(const Job& job, size_t step_tokens, const Status& st) const {
  if (st.code() != StatusCode::kOutOfMemory || !options_.cache_budget) return st;
  const Session& s = *slots_[job.slot].session;
  M3_RETURN_IF_ERROR(CheckFitsBudget(s.position() + step_tokens));
  return Status(StatusCode::kUnavailable, st.message() + "; other requests hold the rest of the cache memory now");
}

Status Scheduler::CheckFitsBudget(size_t tokens) const {
  if (!options_.cache_budget) return Status::Ok();
  const uint64_t need = slots_.front().session->cache().BytesFor(tokens);
  if (need <= options_.cache_budget) return Status::Ok();
  return OutOfRange("a context of ", tokens, " tokens needs ", FormatBytes(need), " of KV cache, more than all ",
                    FormatBytes(options_.cache_budget), " that the slots may hold together (the cache memory "
                    "budget): this request can never run; make it shorter");
}

// Bytes of all the slots' caches and the prefix store, each page once.
uint64_t Scheduler::HeldBytes() const {
  if (prefix_) return prefix_->account()->bytes.load();
  uint64_t held = 0;
  for (const Slot& slot : slots_) held += slot.session->cache().bytes();
  return held;
}

// What a pass of `tokens` more in `s` found missing: beyond the budget, or its new pages.
uint64_t Scheduler::NeededBytes(const Session& s, size_t tokens) const {
  const KvCache& c = s.cache();
  const size_t n = s.position() + tokens;
  const uint64_t need = c.BytesFor(n) + c.CopyBytesFor(n), fresh = need > c.bytes() ? need - c.bytes() : 0;
  if (!options_.cache_budget) return std::max<uint64_t>(fresh, 1);
  const uint64_t total = HeldBytes() + fresh;
  return total > options_.cache_budget ? total - options_.cache_budget : 1;
}

// With a cache budget, each stepped session may hold what the other slots and the prefix store
// leave of it. Its pages the others share count as its own: a page it adds is what counts.
void Scheduler::ShareCacheBudget(const std::vector<Job*>& stepped) {
  if (!options_.cache_budget) return;
  const uint64_t held = HeldBytes();
  for (Job* job : stepped) {
    Session& s = *slots_[job->slot].session;
    const uint64_t others = held - std::min<uint64_t>(held, s.cache().bytes());
    s.set_memory_budget(options_.cache_budget > others ? options_.cache_budget - others : 1);
  }
}

bool Scheduler::ReleaseCacheMemory(uint64_t want) {
  if (prefix_) {
    if (const uint64_t freed = prefix_->EvictUnshared(want); freed > 0) {
      if (options_.log) options_.log(Str("out of cache memory: evicted ", FormatBytes(freed), " of stored prefixes"));
      return true;
    }
  }
  Slot* victim = nullptr;
  for (Slot& slot : slots_)
    if (!slot.busy && slot.session->cache().bytes() > 0 && (!victim || slot.last_used < victim->last_used))
      victim = &slot;
  if (!victim) return false;
  if (options_.log)
    options_.log(Str("out of cache memory: released an idle conversation of ", victim->session->position(), " tokens"));
  victim->session->Release();  // the pages the prefix store shares stay with it
  victim->prompt_tokens = 0;
  return true;
}

// Ends a job once: frees its slot, finishes its turn (the held text goes out as deltas) and
// reports it.
void Scheduler::End(Job& job, const Status& status) {
  if (job.ended) return;
  job.ended = true;
  ParsedOutput out;
  GenerateStats st;
  if (job.generation) {
    out = job.generation->Finish(&st);
    slots_[job.slot].busy = false;
  } else if (job.request.cancelled && job.request.cancelled->load()) {
    st.stop_reason = "caller";  // cancelled while it waited
  }
  if (job.request.on_end) job.request.on_end(status, std::move(out), st, job.largest_batch);
}

}  // namespace m3
