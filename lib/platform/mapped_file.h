// Read-only memory mapping of a whole file. Weights are used in place from the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"

namespace m3 {

// Hints that [p, p + bytes) (rounded out to whole pages) will be read soon: for file mappings the
// kernel starts reading ahead at once. Best effort; a no-op for null or empty ranges and for
// ranges whose every page is resident.
void AdviseWillNeed(const void* p, size_t bytes);

// Whether every page of [p, p + bytes) is in this process's memory now (so reading it touches no
// disk). ~15 us per 28 MiB: it reads the page tables, not the pages.
bool IsResident(const void* p, size_t bytes);

// Locks [p, p + bytes) (rounded out to whole pages) in memory, so that streaming other data
// cannot evict it; the error says how to raise the limit when RLIMIT_MEMLOCK is too low.
Status LockInMemory(const void* p, size_t bytes);

class MappedFile {
 public:
  static StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Hints the kernel that [offset, offset+len) will be read soon (best effort).
  void WillNeed(size_t offset, size_t len) const;
  // Drops [offset, offset+len) (rounded out to whole pages) from this process's resident set;
  // the data stays valid and is read back from the page cache or disk when touched again.
  void DontNeed(size_t offset, size_t len) const;

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace m3
