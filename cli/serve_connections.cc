#include "cli/serve_connections.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace m3::cli {
namespace {

constexpr int kRequestsPerConnection = 100;

// poll() for `events` up to `ms` (restarted when a signal interrupts it): its revents, 0 on timeout.
short Wait(int fd, short events, int ms) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int n = poll(&p, 1, ms);
    if (n > 0) return p.revents;
    if (n == 0 || errno != EINTR) return 0;
  }
}

// Whether the peer of `fd` has closed the connection (or it broke); pipelined bytes do not count.
bool PeerClosed(int fd) {
  const short revents = Wait(fd, POLLIN, 0);
  if (revents & (POLLERR | POLLHUP | POLLNVAL)) return true;
  if (!(revents & POLLIN)) return false;
  char byte;  // readable: more bytes, or the end of the stream
  const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

void AddressOf(const sockaddr_storage& a, std::string& ip, int& port) {
  char text[INET6_ADDRSTRLEN] = "";
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
    port = ntohs(v4->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
    port = ntohs(v6->sin6_port);
  }
  ip = text;
}

// The framing of a request head: one Content-Length of digits, or Transfer-Encoding: chunked,
// not both (a body whose end two readers would find in different places). 0, or 400 with `why`.
int CheckFraming(std::string_view head, std::string* why) {
  int lengths = 0;
  bool chunked = false;
  size_t at = head.find('\n');  // past the request line
  while (at != std::string_view::npos && at + 1 < head.size()) {
    const size_t next = head.find('\n', at + 1);
    std::string_view line = head.substr(at + 1, next == std::string_view::npos ? std::string_view::npos : next - at - 1);
    at = next;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;  // httplib refuses it
    std::string name(line.substr(0, colon));
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
    while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
    if (name == "content-length") {
      ++lengths;
      const bool digits = !value.empty() && value.size() <= 19 &&
                          std::all_of(value.begin(), value.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      if (!digits) {
        *why = Str("Content-Length '", std::string(value.substr(0, 40)), "' is not a byte count");
        return 400;
      }
    } else if (name == "transfer-encoding") {
      std::string v(value);
      for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      if (v != "chunked") {
        *why = Str("Transfer-Encoding '", std::string(value.substr(0, 40)), "' is not supported (only chunked)");
        return 400;
      }
      chunked = true;
    }
  }
  if (lengths > 1 || (lengths == 1 && chunked)) {
    *why = lengths > 1 ? "more than one Content-Length" : "both Content-Length and Transfer-Encoding";
    return 400;
  }
  return 0;
}

// A whole reply that closes the connection, for a request httplib never saw.
void SendAndClose(int fd, int status, const std::string& message, const std::string& retry_after = "") {
  const char* reason = status == 431 ? "Request Header Fields Too Large"
                       : status == 503 ? "Service Unavailable"
                                       : "Bad Request";
  const char* type = status == 503 ? "server_error" : "invalid_request_error";
  const std::string body = Str(R"({"error":{"message":)", nlohmann::json(message).dump(), R"(,"type":")", type,
                               R"(","param":null,"code":null}})");
  const std::string reply = Str("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: application/json\r\n",
                                retry_after.empty() ? "" : "Retry-After: " + retry_after + "\r\n",
                                "Connection: close\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  [[maybe_unused]] const ssize_t n = send(fd, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace

// httplib's view of one connection: buffered reads (its request parser reads a byte at a time)
// and writes that each wait at most io_seconds for progress.
class GuardedServer::Stream final : public httplib::Stream {
 public:
  Stream(Connection& c, int io_ms) : c_(c), io_ms_(io_ms) {}

  bool is_readable() const override { return pos_ < end_ || (Wait(c_.fd, POLLIN, io_ms_) & (POLLIN | POLLHUP)); }
  bool is_writable() const override { return (Wait(c_.fd, POLLOUT, io_ms_) & POLLOUT) && !PeerClosed(c_.fd); }
  // Bytes received and not yet read: a pipelined request.
  bool buffered() const { return pos_ < end_; }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ == end_) {
      pos_ = end_ = 0;
      const ssize_t n = Receive(kChunk);
      if (n <= 0) return n;
    }
    const size_t n = std::min(size, end_ - pos_);
    std::memcpy(ptr, buffer_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    c_.phase = Phase::kWorking;  // the answer has begun: the read deadline is over
    if (!(Wait(c_.fd, POLLOUT, io_ms_) & POLLOUT)) return -1;
    ssize_t n;
    do n = send(c_.fd, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }

  // Reads until the buffer holds a whole request head (up to its empty line), within the limits;
  // checks its framing. 0: ready for httplib; else the status to answer (431, 400) with `why`;
  // -1: the connection ended first.
  int ReadHead(const ConnectionLimits& limits, std::string* why) {
    if (pos_ > 0) {  // keep what is unread at the front
      std::memmove(buffer_.data(), buffer_.data() + pos_, end_ - pos_);
      end_ -= pos_;
      pos_ = 0;
    }
    size_t scanned = 0, lines = 0;
    for (;;) {
      // Lines end with '\n' (httplib also takes a bare '\n'); the head ends at an empty one.
      while (scanned < end_) {
        const char* start = buffer_.data() + scanned;
        const void* nl = std::memchr(start, '\n', end_ - scanned);
        if (!nl) break;
        const size_t len = static_cast<const char*>(nl) - start;
        scanned += len + 1;
        if (len == 0 || (len == 1 && start[0] == '\r')) {
          if (lines == 0) continue;  // blank lines before a request line are skipped (RFC 9112 2.2)
          return CheckFraming(std::string_view(buffer_.data(), scanned), why);
        }
        if (++lines > limits.max_header_lines) {
          *why = Str("the request has more than ", limits.max_header_lines - 1, " header lines");
          return 431;
        }
      }
      if (end_ >= limits.max_head_bytes) {
        *why = Str("the request's headers are larger than ", limits.max_head_bytes >> 10, " KiB");
        return 431;
      }
      if (Receive(std::min(kChunk, limits.max_head_bytes - end_)) <= 0) return -1;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getpeername(c_.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) AddressOf(a, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getsockname(c_.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) AddressOf(a, ip, port);
  }
  socket_t socket() const override { return c_.fd; }

 private:
  static constexpr size_t kChunk = 4096;

  // Appends up to `most` received bytes at end_; recv's result (0: closed, -1: error or timeout).
  ssize_t Receive(size_t most) {
    if (!(Wait(c_.fd, POLLIN, io_ms_) & (POLLIN | POLLHUP | POLLERR))) return -1;
    if (buffer_.size() < end_ + most) buffer_.resize(end_ + most);
    ssize_t n;
    do n = recv(c_.fd, buffer_.data() + end_, most, 0);
    while (n < 0 && errno == EINTR);
    if (n > 0) end_ += static_cast<size_t>(n);
    return n;
  }

  Connection& c_;
  const int io_ms_;
  std::vector<char> buffer_;
  size_t pos_ = 0, end_ = 0;
};

// httplib's task queue: a thread per accepted connection (they spend their lives blocked on
// the network or on a reply being generated); shutdown waits for all of them.
class GuardedServer::ThreadPerConnection final : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++running_;
    }
    std::thread([this, fn = std::move(fn)] {
      fn();
      std::lock_guard<std::mutex> lock(mu_);
      if (--running_ == 0) done_.notify_all();
    }).detach();
  }
  void shutdown() override {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return running_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable done_;
  size_t running_ = 0;
};

GuardedServer::GuardedServer(const ConnectionLimits& limits) : limits_(limits) {
  new_task_queue = [] { return new ThreadPerConnection; };
  // What the Keep-Alive response header announces; Serve enforces them.
  set_keep_alive_timeout(limits.keep_alive_seconds);
  set_keep_alive_max_count(kRequestsPerConnection);
  watchdog_ = std::thread([this] { Watch(); });
}

GuardedServer::~GuardedServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  watchdog_.join();
}

int64_t GuardedServer::NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void GuardedServer::Client::RequestRead() {
  if (c_) c_->phase = Phase::kWorking;
}

void GuardedServer::Client::CloseAfterReply() {
  if (c_) c_->close_after_reply = true;  // read by Serve on the same thread, after the handler
}

bool GuardedServer::Client::Gone() const { return c_ && PeerClosed(c_->fd); }

GuardedServer::Client GuardedServer::ConnectionOf(const httplib::Request& req) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (Connection* c : open_)
    if (c->request == &req) return Client(c);
  return Client(nullptr);
}

ConnectionCounts GuardedServer::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  ConnectionCounts c = counts_;
  c.open = open_.size();
  return c;
}

bool GuardedServer::MakeRoom(const Connection& self) {
  // mu_ held. The one idle or reading longest gives way.
  Connection* victim = nullptr;
  for (Connection* c : open_)
    if (c != &self && !c->closed_by_us && c->phase != Phase::kWorking && (!victim || c->since_ms < victim->since_ms))
      victim = c;
  if (!victim) return false;
  victim->closed_by_us = true;
  ::shutdown(victim->fd, SHUT_RDWR);  // its thread sees the end of the stream and closes it
  ++counts_.evicted;
  return true;
}

bool GuardedServer::process_and_close_socket(socket_t sock) {
  Connection c;
  c.fd = sock;
  c.since_ms = NowMs();
  bool admitted = true;
  std::list<Connection*>::iterator self;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_.accepted;
    self = open_.insert(open_.end(), &c);
    size_t live = 0;
    for (const Connection* o : open_) live += !o->closed_by_us;
    if (live > limits_.max_connections && !MakeRoom(c)) {
      admitted = false;
      ++counts_.refused;
    }
  }
  if (admitted)
    Serve(c);
  else
    SendAndClose(sock, 503, "too many connections: every one is generating, try again", "1");
  {
    // Out of the list before the descriptor is closed: nobody shuts down a number reused since.
    std::lock_guard<std::mutex> lock(mu_);
    open_.erase(self);
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return true;
}

// Requests on one connection until the client closes it, keep-alive runs out or we close it.
void GuardedServer::Serve(Connection& c) {
  Stream stream(c, limits_.io_seconds * 1000);
  for (int served = 0; svr_sock_ != INVALID_SOCKET; ++served) {
    c.phase = Phase::kIdle;
    c.since_ms = NowMs();
    // Waiting for the next request, in slices, so that a stop is seen within 100 ms.
    const int64_t wait_until = NowMs() + (served == 0 ? limits_.read_request_seconds : limits_.keep_alive_seconds) * 1000;
    bool readable = stream.buffered();  // a pipelined request is already here
    while (!readable && svr_sock_ != INVALID_SOCKET && NowMs() < wait_until)
      readable = Wait(c.fd, POLLIN, 100) != 0;
    if (!readable || svr_sock_ == INVALID_SOCKET) return;
    c.since_ms = NowMs();
    c.phase = Phase::kReading;
    std::string why;
    if (const int refusal = stream.ReadHead(limits_, &why); refusal != 0) {
      if (refusal > 0) {
        SendAndClose(c.fd, refusal, why);
        std::lock_guard<std::mutex> lock(mu_);
        ++counts_.bad_heads;
      }
      return;
    }
    bool connection_closed = false;
    const bool last = served + 1 >= kRequestsPerConnection;
    // The request lives in process_request's frame, its handler and reply included.
    const bool ok = process_request(stream, last, connection_closed, [&c](httplib::Request& req) { c.request = &req; });
    c.request = nullptr;
    if (!ok || connection_closed || last || c.close_after_reply) return;
  }
}

// Closes the connections that trickle a request past the deadline.
void GuardedServer::Watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, std::chrono::milliseconds(250), [&] { return stopping_; })) {
    const int64_t now = NowMs();
    for (Connection* c : open_)
      if (!c->closed_by_us && c->phase == Phase::kReading && now - c->since_ms > limits_.read_request_seconds * 1000) {
        c->closed_by_us = true;
        ::shutdown(c->fd, SHUT_RDWR);
        ++counts_.timed_out;
      }
  }
}

void GuardedServer::StopListening() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Connection* c : open_)
      if (!c->closed_by_us && c->phase != Phase::kWorking) {
        c->closed_by_us = true;
        ::shutdown(c->fd, SHUT_RDWR);
      }
  }
  stop();
}

}  // namespace m3::cli
