#include "model/pack_target.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2 (glibc 2.28)
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <system_error>
#include <utility>

#include "format/pack_file.h"
#include "model/packer.h"

namespace m3 {
namespace fs = std::filesystem;

bool IsPackFolderFile(const std::string& name) {
  if (name == kPackFileName || name == std::string(kPackFileName) + ".partial") return true;  // .partial: older m3
  for (const char* side : kPackSideFiles)
    if (name == side) return true;
  return false;
}

Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError(dir, ": cannot open folder to sync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return IoError(dir, ": fsync of the folder failed");
  return Status::Ok();
}

StatusOr<PackTarget> PackTarget::Open(const std::string& output_dir, bool force) {
  if (output_dir.empty()) return InvalidArgument("pack: no output folder given");
  std::error_code ec;
  fs::path target = fs::absolute(output_dir, ec).lexically_normal();
  if (ec) return IoError(output_dir, ": ", ec.message());
  if (target.filename().empty()) target = target.parent_path();  // "out/"
  if (target == target.root_path()) return InvalidArgument(output_dir, ": cannot pack into the root folder");
  const fs::path parent = target.parent_path();
  const std::string name = target.filename().string();

  if (fs::exists(target, ec)) {
    if (!fs::is_directory(target, ec)) return InvalidArgument(output_dir, ": exists and is not a folder");
    bool has_pack = false;
    for (const auto& e : fs::directory_iterator(target, ec)) {
      const std::string entry = e.path().filename().string();
      if (!IsPackFolderFile(entry))
        return InvalidArgument(output_dir, ": holds '", entry,
                               "', which is not a file of a pack (a checkpoint, or files of your own); `m3 pack` "
                               "replaces the whole folder, so give it a new or empty folder");
      has_pack = has_pack || entry == kPackFileName;
    }
    if (ec) return IoError(output_dir, ": cannot list the folder: ", ec.message());
    if (has_pack && !force)
      return InvalidArgument(output_dir, ": already holds ", kPackFileName, " (use --force to replace it)");
  }
  fs::create_directories(parent, ec);
  if (ec) return IoError(parent.string(), ": cannot create the folder: ", ec.message());

  PackTarget t;
  t.target_ = target;
  t.staging_ = parent / ("." + name + ".m3pack-partial");
  // The lock stays beside the folder (an empty hidden file): removing it could let a pack that
  // opened it before the removal run beside one that made a new one.
  const fs::path lock = parent / ("." + name + ".m3pack-lock");
  t.lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (t.lock_fd_ < 0) return IoError(lock.string(), ": cannot create the pack's lock file: ", std::strerror(errno));
  if (::flock(t.lock_fd_, LOCK_EX | LOCK_NB) != 0)
    return Status(StatusCode::kUnavailable, Str(output_dir, ": another `m3 pack` is writing this folder now"));
  // What a killed pack left (the lock is ours: nobody else writes it).
  fs::remove_all(t.staging_, ec);
  if (ec) return IoError(t.staging_.string(), ": cannot remove a killed pack's leftovers: ", ec.message());
  fs::create_directory(t.staging_, ec);
  if (ec) return IoError(t.staging_.string(), ": cannot create the staging folder: ", ec.message());
  return t;
}

PackTarget::PackTarget(PackTarget&& o) noexcept
    : target_(std::move(o.target_)), staging_(std::move(o.staging_)), lock_fd_(o.lock_fd_), committed_(o.committed_) {
  o.lock_fd_ = -1;
  o.committed_ = true;  // the moved-from one cleans nothing
}

PackTarget::~PackTarget() {
  if (!committed_ && !staging_.empty()) {
    std::error_code ec;
    fs::remove_all(staging_, ec);
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
}

Status PackTarget::Commit() {
  M3_RETURN_IF_ERROR(SyncDirectory(staging_.string()));
  std::error_code ec;
  const std::string parent = target_.parent_path().string();
  if (!fs::exists(target_, ec)) {
    fs::rename(staging_, target_, ec);
    if (ec) return IoError(target_.string(), ": cannot put the finished pack in place: ", ec.message());
  } else if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) == 0) {
    // One step: the new pack is in place and the old one is where the staging folder was.
    fs::remove_all(staging_, ec);
  } else {
    // A file system without the exchange: the old folder aside, the new one in, the old removed.
    // A crash between the renames leaves both beside the target, whole.
    const fs::path old = target_.parent_path() / ("." + target_.filename().string() + ".m3pack-old");
    fs::remove_all(old, ec);
    fs::rename(target_, old, ec);
    if (ec) return IoError(target_.string(), ": cannot move the old pack aside: ", ec.message());
    fs::rename(staging_, target_, ec);
    if (ec) {
      std::error_code back;
      fs::rename(old, target_, back);
      return IoError(target_.string(), ": cannot put the finished pack in place: ", ec.message());
    }
    fs::remove_all(old, ec);
  }
  committed_ = true;
  return SyncDirectory(parent);
}

}  // namespace m3
