#include "platform/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>
#include <cerrno>
#include <cstring>

namespace m3 {

StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound(path, ": no such file");
    return IoError(path, ": cannot open: ", std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return IoError(path, ": cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return IoError(path, ": not a regular file");
  }
  std::unique_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return IoError(path, ": mmap failed: ", std::strerror(err));
    }
    file->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return file;
}

namespace {
// [p, p + bytes) rounded out to whole pages.
std::pair<uint8_t*, size_t> PageRange(const void* p, size_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  return {reinterpret_cast<uint8_t*>(begin), static_cast<size_t>(end - begin)};
}
}  // namespace

bool IsResident(const void* p, size_t bytes) {
  if (!p || bytes == 0) return true;
  const auto [begin, len] = PageRange(p, bytes);
  // In pieces of 4096 pages (16 MiB) through a buffer on the stack.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  unsigned char resident[4096];
  for (size_t at = 0; at < len; at += sizeof(resident) * page) {
    const size_t n = std::min(len - at, sizeof(resident) * page);
    if (::mincore(begin + at, n, resident) != 0 ||
        !std::all_of(resident, resident + (n + page - 1) / page, [](unsigned char c) { return (c & 1) != 0; }))
      return false;
  }
  return true;
}

void AdviseWillNeed(const void* p, size_t bytes) {
  // madvise walks the page cache page by page even when every page is resident (~20 ns a page:
  // ~0.13 ms per 28 MiB expert, a few % of a decode step); mincore reads this process's page
  // tables (~15 us per 28 MiB mapped). So a range that is all resident is not advised.
  if (!p || bytes == 0 || IsResident(p, bytes)) return;
  const auto [begin, len] = PageRange(p, bytes);
  ::madvise(begin, len, MADV_WILLNEED);
}

Status LockInMemory(const void* p, size_t bytes) {
  if (!p || bytes == 0) return Status::Ok();
  const auto [begin, len] = PageRange(p, bytes);
  if (::mlock(begin, len) == 0) return Status::Ok();
  const int err = errno;
  if (err == ENOMEM || err == EPERM)
    return IoError("mlock of ", len, " bytes failed: ", std::strerror(err),
                   " (the locked-memory limit is too low: raise it with `ulimit -l unlimited` or "
                   "LimitMEMLOCK=infinity, or run without --mlock-dense)");
  return IoError("mlock of ", len, " bytes failed: ", std::strerror(err));
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void MappedFile::WillNeed(size_t offset, size_t len) const {
  if (!data_ || offset >= size_) return;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  size_t begin = offset / page * page;
  size_t end = std::min(size_, offset + len);
  ::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_WILLNEED);
}

void MappedFile::DontNeed(size_t offset, size_t len) const {
  if (!data_ || offset >= size_ || len == 0) return;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t begin = offset / page * page;
  const size_t end = std::min(size_, offset + len);
  ::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_DONTNEED);
}

}  // namespace m3
