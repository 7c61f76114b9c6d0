// Errors are values at the library's boundaries (files, config, API): a code plus a message that
// names the file, tensor, key or field at fault. The library never prints and never exits.
#pragma once

#include <optional>
#include <sstream>
#include <string>
#include <utility>

namespace m3 {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad request or option
  kNotFound = 2,         // missing file, tensor or key
  kIoError = 3,          // read/mmap failure
  kCorrupt = 4,          // malformed file contents
  kUnsupported = 5,      // valid but not implemented (dtype, config feature)
  kOutOfRange = 6,       // context or index past a limit
  kOutOfMemory = 7,
  kInternal = 8,
  kUnavailable = 9,      // transient: the same request may succeed later (a server draining, memory held by others)
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <class T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design
  StatusOr(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

// Builds a message from streamable pieces: Str("tensor ", name, " has ", n, " dims").
template <class... Args>
std::string Str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <class... Args>
Status InvalidArgument(const Args&... args) { return Status(StatusCode::kInvalidArgument, Str(args...)); }
template <class... Args>
Status NotFound(const Args&... args) { return Status(StatusCode::kNotFound, Str(args...)); }
template <class... Args>
Status IoError(const Args&... args) { return Status(StatusCode::kIoError, Str(args...)); }
template <class... Args>
Status Corrupt(const Args&... args) { return Status(StatusCode::kCorrupt, Str(args...)); }
template <class... Args>
Status Unsupported(const Args&... args) { return Status(StatusCode::kUnsupported, Str(args...)); }
template <class... Args>
Status OutOfRange(const Args&... args) { return Status(StatusCode::kOutOfRange, Str(args...)); }
template <class... Args>
Status Internal(const Args&... args) { return Status(StatusCode::kInternal, Str(args...)); }

}  // namespace m3

#define M3_CONCAT_INNER(a, b) a##b
#define M3_CONCAT(a, b) M3_CONCAT_INNER(a, b)

#define M3_RETURN_IF_ERROR(expr)          \
  do {                                    \
    ::m3::Status m3_status_ = (expr);     \
    if (!m3_status_.ok()) return m3_status_; \
  } while (0)

#define M3_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

#define M3_ASSIGN_OR_RETURN(lhs, expr) \
  M3_ASSIGN_OR_RETURN_IMPL(M3_CONCAT(m3_statusor_, __LINE__), lhs, expr)
