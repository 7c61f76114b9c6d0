// Where `m3 pack` writes, as one transaction: everything goes into a fresh staging folder beside
// the output folder and is put in place only once complete (the old pack stays intact until
// then), under a lock against another pack of the same folder. A folder that holds anything but
// a pack (a checkpoint, other files) is never written into; a pack only with --force.
#pragma once

#include <filesystem>
#include <string>

#include "base/status.h"

namespace m3 {

class PackTarget {
 public:
  // Checks the output folder, takes the lock and makes an empty staging folder (removing one that
  // a killed pack left behind).
  static StatusOr<PackTarget> Open(const std::string& output_dir, bool force);
  PackTarget(PackTarget&& other) noexcept;
  PackTarget& operator=(PackTarget&&) = delete;
  ~PackTarget();  // unless committed, removes the staging folder; releases the lock

  // The folder to write every file into.
  const std::filesystem::path& staging() const { return staging_; }
  // Synced, put in place of the output folder in one step (the old one, if any, then removed).
  Status Commit();

 private:
  PackTarget() = default;
  std::filesystem::path target_, staging_;
  int lock_fd_ = -1;
  bool committed_ = false;
};

// Every file of a pack's folder: model.m3w and the side files copied from the checkpoint.
bool IsPackFolderFile(const std::string& name);
// fsync of a folder, so that the names in it survive a crash.
Status SyncDirectory(const std::string& dir);

}  // namespace m3
