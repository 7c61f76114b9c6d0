#include "cli/serve_connections.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

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

}  // namespace

// httplib's view of one connection: buffered reads (its request parser reads a byte at a time)
// and writes that each wait at most io_seconds for progress.
class GuardedServer::Stream final : public httplib::Stream {
 public:
  Stream(Connection& c, int io_ms) : c_(c), io_ms_(io_ms) {}

  bool is_readable() const override { return pos_ < end_ || (Wait(c_.fd, POLLIN, io_ms_) & (POLLIN | POLLHUP)); }
  bool is_writable() const override { return (Wait(c_.fd, POLLOUT, io_ms_) & POLLOUT) && !PeerClosed(c_.fd); }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ == end_) {
      if (!(Wait(c_.fd, POLLIN, io_ms_) & (POLLIN | POLLHUP | POLLERR))) return -1;
      ssize_t n;
      do n = recv(c_.fd, buffer_, sizeof buffer_, 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      pos_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, end_ - pos_);
    std::memcpy(ptr, buffer_ + pos_, n);
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
  Connection& c_;
  const int io_ms_;
  char buffer_[4096];
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
  if (admitted) {
    Serve(c);
  } else {
    static const std::string kBody =
        R"({"error":{"message":"too many connections: every one is generating, try again","type":"server_error",)"
        R"("param":null,"code":null}})";
    static const std::string kBusy =
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        "Connection: close\r\nContent-Length: " + std::to_string(kBody.size()) + "\r\n\r\n" + kBody;
    [[maybe_unused]] const ssize_t n = send(sock, kBusy.data(), kBusy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
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
    bool readable = false;
    while (!readable && svr_sock_ != INVALID_SOCKET && NowMs() < wait_until)
      readable = Wait(c.fd, POLLIN, 100) != 0;
    if (!readable || svr_sock_ == INVALID_SOCKET) return;
    c.since_ms = NowMs();
    c.phase = Phase::kReading;
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
