// The connections of `m3 serve` (issue 35). cpp-httplib's own loop gives each connection a
// thread of a fixed pool and waits as long as a client keeps trickling bytes, so a dozen slow
// clients left /health unanswered. Here:
// - every connection has a thread of its own: /health and /metrics never queue behind slow or
//   generating requests;
// - a request's headers and body must arrive within a deadline (a connection trickling them is
//   closed), and a connection waits for its next request for a few seconds only;
// - past the connection limit, the connection that has been idle or reading longest is closed
//   to make room (a generating one is never chosen): a new client always gets through;
// - a handler can ask whether its client has hung up, so that work follows the client: it finds
//   the connection its request came on with ConnectionOf;
// - a request's head is read whole within a byte and line limit before httplib parses it (httplib
//   0.11 reads a whole line before its own check and has no total cap), its framing checked
//   (Content-Length digits only, Transfer-Encoding chunked only, not both): 431 or 400 at once;
// - pipelined requests (sent before the previous reply) are answered in order.
#pragma once

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <thread>

namespace m3::cli {

struct ConnectionLimits {
  size_t max_connections = 1024;
  int read_request_seconds = 60;  // the headers and body of one request, from its first byte
  int keep_alive_seconds = 5;     // waiting for the next request on an open connection
  int io_seconds = 30;            // one read or write that makes no progress
  // A request's head (request line and headers), read whole before anything parses it or checks
  // the API key: past these it is answered 431 and the connection closed.
  size_t max_head_bytes = 64 << 10;
  size_t max_header_lines = 128;
};

struct ConnectionCounts {
  size_t open = 0;
  uint64_t accepted = 0;
  uint64_t timed_out = 0;  // closed for trickling a request past the deadline
  uint64_t evicted = 0;    // closed to make room for a new one
  uint64_t refused = 0;    // new ones turned away: every open one was busy generating
  uint64_t bad_heads = 0;  // closed with a 431 or 400 for a request head past the limits or malformed
};

class GuardedServer : public httplib::Server {
  struct Connection;

 public:
  // The connection a request came on, as its handler sees it (ConnectionOf). Valid while the
  // handler and the reply it sets run; one of a request this server did not read does nothing.
  class Client {
   public:
    // Its request's headers and body are read: the read deadline stops.
    void RequestRead();
    // Its client closed the connection (or the connection broke).
    bool Gone() const;
    // The connection closes once the reply is sent (e.g. a body left unread).
    void CloseAfterReply();

   private:
    friend class GuardedServer;
    explicit Client(Connection* c) : c_(c) {}
    Connection* c_;
  };

  explicit GuardedServer(const ConnectionLimits& limits);
  ~GuardedServer() override;

  // From a handler: the connection `req` came on.
  Client ConnectionOf(const httplib::Request& req) const;
  ConnectionCounts counts() const;
  // Closes every connection that is not in a handler (waiting for a request, or sending one),
  // then stops listening; handlers under way finish. For a drain before exit.
  void StopListening();

 private:
  enum class Phase : int { kIdle, kReading, kWorking };
  struct Connection {
    int fd = -1;
    std::atomic<Phase> phase{Phase::kIdle};
    std::atomic<int64_t> since_ms{0};  // when the phase began
    bool closed_by_us = false;         // under mu_
    bool close_after_reply = false;    // its own thread's
    std::atomic<const httplib::Request*> request{nullptr};  // the one being served (ConnectionOf)
  };
  class Stream;
  class ThreadPerConnection;

  bool process_and_close_socket(socket_t sock) override;
  void Serve(Connection& c);
  // Makes room for one more connection; false when none can give way.
  bool MakeRoom(const Connection& self);
  void Watch();
  static int64_t NowMs();

  const ConnectionLimits limits_;
  mutable std::mutex mu_;
  std::list<Connection*> open_;
  ConnectionCounts counts_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread watchdog_;
};

}  // namespace m3::cli
