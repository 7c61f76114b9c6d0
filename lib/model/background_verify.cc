#include "model/background_verify.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <vector>

namespace m3 {
namespace {

// The calling thread at the lowest priority there is: SCHED_IDLE where the kernel allows it,
// else nice 19 (Linux sets both per thread).
void LowestPriority() {
#ifdef SCHED_IDLE
  sched_param p{};
  if (::sched_setscheduler(0, SCHED_IDLE, &p) == 0) return;
#endif
  ::setpriority(PRIO_PROCESS, 0, 19);
}

}  // namespace

std::string BackgroundVerify::StampFolder() {
  namespace fs = std::filesystem;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return (fs::path(xdg) / "m3" / "verified").string();
  if (const char* home = std::getenv("HOME"); home && *home)
    return (fs::path(home) / ".cache" / "m3" / "verified").string();
  return "";
}

std::unique_ptr<BackgroundVerify> BackgroundVerify::Start(const PackFile& pack, const std::string& stamp_folder) {
  std::string stamp;
  if (!stamp_folder.empty()) {
    const std::string id = pack.Identity();
    if (!id.empty()) stamp = (std::filesystem::path(stamp_folder) / id).string();
    std::error_code ec;
    if (!stamp.empty() && std::filesystem::exists(stamp, ec)) return nullptr;  // verified on an earlier load
  }
  return std::unique_ptr<BackgroundVerify>(new BackgroundVerify(pack, std::move(stamp)));
}

BackgroundVerify::BackgroundVerify(const PackFile& pack, std::string stamp)
    : pack_(pack), stamp_(std::move(stamp)), thread_([this] { Run(); }) {}

BackgroundVerify::~BackgroundVerify() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

Status BackgroundVerify::status() const {
  if (!damaged_.load(std::memory_order_acquire)) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  return damage_;
}

void BackgroundVerify::Run() {
  LowestPriority();
  std::vector<size_t> pending(pack_.tensors().size());
  std::iota(pending.begin(), pending.end(), size_t{0});
  // Sweeps over what is not checked yet: every tensor whose bytes are all resident is hashed.
  // The wait between sweeps doubles while nothing new is resident (0.25 s .. 30 s), so an idle
  // server costs a page-table walk now and then.
  auto wait = std::chrono::milliseconds(250);
  while (!pending.empty()) {
    size_t kept = 0;
    for (size_t i : pending) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
      }
      if (!pack_.TensorResident(i)) {
        pending[kept++] = i;
        continue;
      }
      if (Status s = pack_.VerifyTensor(i); !s.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        damage_ = s;
        damaged_.store(true, std::memory_order_release);
        return;
      }
      ++checked_;
    }
    wait = kept < pending.size() ? std::chrono::milliseconds(250) : std::min(wait * 2, std::chrono::milliseconds(30000));
    pending.resize(kept);
    if (pending.empty()) break;
    std::unique_lock<std::mutex> lock(mu_);
    if (wake_.wait_for(lock, wait, [this] { return stop_; })) return;
  }
  done_ = true;
  if (stamp_.empty()) return;
  // Best effort: without a stamp the next load verifies again.
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(stamp_).parent_path(), ec);
  std::ofstream(stamp_) << pack_.path() << "\n";
}

}  // namespace m3
