// A packed model's tensor hashes checked in the background the first time a machine loads the
// file, where it costs nothing measurable: one thread at the lowest priority (SCHED_IDLE: it
// runs only on cores the engine leaves idle) hashes each tensor once all its bytes are in memory
// anyway (the engine's own reads bring them in), so it never reads the disk, evicts a page or
// competes with a pass for a core. When every tensor has matched, a stamp under the user's cache
// folder ($XDG_CACHE_HOME or ~/.cache, m3/verified/) names the file (PackFile::Identity: its
// directory hash, size, inode and modification time), and later loads of it check nothing.
// A damaged tensor is reported by status(), which the engine's passes return from then on
// (flipped bytes give wrong logits silently otherwise). `m3 inspect --verify` checks all at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "base/status.h"
#include "format/pack_file.h"

namespace m3 {

class BackgroundVerify {
 public:
  // Where stamps are kept: $XDG_CACHE_HOME/m3/verified, else $HOME/.cache/m3/verified ("" when
  // neither is set: every load then verifies).
  static std::string StampFolder();
  // Starts checking `pack` (which must outlive this) unless a stamp in `stamp_folder` says it
  // was verified; null then.
  static std::unique_ptr<BackgroundVerify> Start(const PackFile& pack, const std::string& stamp_folder);
  ~BackgroundVerify();  // stops the thread (within one tensor's hash) and joins it
  BackgroundVerify(const BackgroundVerify&) = delete;
  BackgroundVerify& operator=(const BackgroundVerify&) = delete;

  // Ok unless a tensor was found damaged; then Corrupt naming it, for good.
  Status status() const;
  // Tensors checked so far, of pack.tensors().size(); done() once all were (the stamp is written).
  size_t checked() const { return checked_.load(); }
  bool done() const { return done_.load(); }

 private:
  BackgroundVerify(const PackFile& pack, std::string stamp);
  void Run();

  const PackFile& pack_;
  const std::string stamp_;  // the stamp's path ("" when none is kept)
  std::atomic<size_t> checked_{0};
  std::atomic<bool> done_{false}, damaged_{false};
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  Status damage_;
  std::thread thread_;
};

}  // namespace m3
