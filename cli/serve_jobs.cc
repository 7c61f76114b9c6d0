#include "cli/serve_jobs.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cli/commands.h"

namespace m3::cli {
namespace {

void Log(const std::string& path, int status, const GenerateStats& st, size_t largest_batch) {
  std::fprintf(stderr,
               "m3 serve: %s %d | prompt %zu tokens (%zu cached) at %.1f tok/s | %zu generated at %.1f tok/s, in "
               "batches of up to %zu%s | %s\n",
               path.c_str(), status, st.prompt_tokens, st.reused_tokens, st.prefill_tok_s(), st.generated_tokens,
               st.decode_tok_s(), largest_batch, LookupSummary(st).c_str(), st.stop_reason.c_str());
}

}  // namespace

bool JobQueue::Reserve(size_t n) {
  const size_t cap = slots_ + max_queue_;
  size_t cur = in_flight_.load();
  do {
    if (cur + n > cap) return false;
  } while (!in_flight_.compare_exchange_weak(cur, cur + n));
  return true;
}

Admission::~Admission() {
  if (queue_) queue_->in_flight_ -= choices_;
}

std::optional<Admission> JobQueue::Admit(size_t choices) {
  if (!Reserve(choices)) {
    ++metrics_.rejected;
    return std::nullopt;
  }
  return Admission(this, choices);
}

std::shared_ptr<Job> JobQueue::Start(std::shared_ptr<Reply> reply, const std::string& path, Admission admitted) {
  admitted.queue_ = nullptr;  // the choices' ends give the room back (ChoiceEnded)
  ++metrics_.requests;
  auto job = std::make_shared<Job>();
  job->reply = std::move(reply);
  job->path = path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.insert(job);
  }
  job->reply->Submit([this, job](const Status& status, const GenerateStats& st, size_t largest_batch, bool last) {
    ChoiceEnded(job, status, st, largest_batch, last);
  });
  return job;
}

void JobQueue::ChoiceEnded(const std::shared_ptr<Job>& job, const Status& status, const GenerateStats& st,
                           size_t largest_batch, bool last) {
  // 499: the client closed the connection (nginx's code); the log says so.
  const int code = job->client_gone ? 499 : job->shut_down ? 503 : status.ok() ? 200 : HttpStatus(status);
  Log(job->path, code, st, largest_batch);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - job->start).count();
  metrics_.ChoiceEnded(code, st, seconds);
  if (last) {
    if (!job->client_gone) metrics_.RequestEnded(seconds);
    std::lock_guard<std::mutex> lock(mu_);
    mean_seconds_ = mean_seconds_ == 0 ? seconds : 0.8 * mean_seconds_ + 0.2 * seconds;
    jobs_.erase(job);
  }
  --in_flight_;
}

int JobQueue::RetryAfterSeconds() {
  std::lock_guard<std::mutex> lock(mu_);
  const double rounds = static_cast<double>(in_flight_.load()) / static_cast<double>(std::max<size_t>(1, slots_));
  return static_cast<int>(std::clamp(std::ceil(rounds * std::max(mean_seconds_, 0.1)), 1.0, 300.0));
}

void JobQueue::ClientLeft(Job& job) {
  if (job.client_gone.exchange(true)) return;
  job.reply->Cancel();
  ++metrics_.cancelled;
  std::fprintf(stderr, "m3 serve: %s %s: the client closed the connection; cancelled\n", job.path.c_str(),
               job.reply->id().c_str());
}

void JobQueue::CancelAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& job : jobs_) {
    job->shut_down = true;
    job->reply->Stop(
        Status(StatusCode::kUnavailable, "the server is shutting down: the reply was stopped before it was complete"));
  }
}

}  // namespace m3::cli
