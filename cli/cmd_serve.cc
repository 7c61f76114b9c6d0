// m3 serve: an OpenAI- and Anthropic-compatible HTTP server (cpp-httplib) over one engine. This
// file holds the command: its options, loading the model, listening, and the drain on SIGTERM or
// SIGINT. The server's parts are in cli/serve_*.cc (cli/serve.h lists them); requests are parsed
// and rendered by the runtime (runtime/reply.h) on their HTTP threads, so that a bad one gets its
// 400 before any work, and run by the scheduler of lib/runtime/scheduler.h: up to --slots at once,
// batched into one forward pass per step, each in the session that holds the longest cached
// prefix of its conversation.
// Endpoints: GET /health, GET /metrics, GET /v1/models, POST /v1/chat/completions,
// POST /v1/completions (both with "stream": true as server-sent events, "n" choices each),
// POST /tokenize, POST /detokenize, and Anthropic's Messages API: POST /v1/messages (streamed as
// its events), POST /v1/messages/count_tokens.
#include <httplib.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/serve.h"
#include "cli/serve_connections.h"
#include "cli/serve_http.h"
#include "cluster/group.h"
#include "runtime/chat.h"
#include "runtime/scheduler.h"

namespace m3::cli {

std::string Server::NewId() {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%08llx%06x%llx", static_cast<unsigned long long>(std::time(nullptr)),
                static_cast<unsigned>(id_nonce), static_cast<unsigned long long>(next_id++));
  return buf;
}

namespace {

// "16G", "512M", "1.5G", "4096" (bytes; K, M, G, T are powers of 1024, an optional "B" or "iB"
// after them).
StatusOr<uint64_t> ParseByteSize(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  for (const char* suffix : {"iB", "B"})
    if (unit.size() > std::strlen(suffix) - 1 && unit.ends_with(suffix)) {
      unit.erase(unit.size() - std::strlen(suffix));
      break;
    }
  const std::string units = "KMGT";
  const size_t power = unit.empty()       ? 0
                       : unit.size() == 1 ? units.find(static_cast<char>(std::toupper(unit[0]))) + 1
                                          : 0;
  if (used == 0 || !(v > 0) || (!unit.empty() && power == 0))
    return InvalidArgument("expected a size such as 16G, 512M or 1073741824, got '", text, "'");
  const double bytes = v * std::pow(1024.0, static_cast<double>(power));
  if (bytes < 1 || bytes > 9e18) return InvalidArgument("size out of range: '", text, "'");
  return static_cast<uint64_t>(bytes);
}

// The options' ranges, before anything is loaded.
Status CheckArgs(const ServeArgs& a) {
  if (a.port < 0 || a.port > 65535) return InvalidArgument("--port must be 0..65535, got ", a.port);
  M3_RETURN_IF_ERROR(ValidateSamplingParams(a.defaults.sampling));
  M3_RETURN_IF_ERROR(ValidateLookupOptions(a.defaults.lookup));
  if (a.defaults.max_tokens < 1) return InvalidArgument("--max-tokens must be at least 1");
  if (a.slots < 1 || a.slots > 256) return InvalidArgument("--slots must be 1..256, got ", a.slots);
  if (a.max_queue > 100000) return InvalidArgument("--max-queue must be 0..100000, got ", a.max_queue);
  if (a.limits.max_connections < 1 || a.limits.max_connections > 100000)
    return InvalidArgument("--max-connections must be 1..100000, got ", a.limits.max_connections);
  if (a.limits.read_request_seconds < 1 || a.limits.read_request_seconds > 3600)
    return InvalidArgument("--read-timeout must be 1..3600 seconds, got ", a.limits.read_request_seconds);
  if (a.drain_seconds < 0 || a.drain_seconds > 86400)
    return InvalidArgument("--drain-timeout must be 0..86400 seconds, got ", a.drain_seconds);
  return Status::Ok();
}

// The text layer, the engine and the scheduler of `server` (not started).
Status Load(Server& server) {
  const ServeArgs& a = server.args;
  SchedulerOptions scheduling;
  scheduling.slots = static_cast<size_t>(a.slots);
  scheduling.log = [](const std::string& note) { std::fprintf(stderr, "m3 serve: %s\n", note.c_str()); };
  if (!a.cache_memory.empty()) {
    auto bytes = ParseByteSize(a.cache_memory);
    if (!bytes.ok()) return Status(bytes.status().code(), "--cache-memory: " + bytes.status().message());
    scheduling.cache_budget = *bytes;
  }
  M3_ASSIGN_OR_RETURN(const EngineOptions engine_options, a.engine_args.Options());
  scheduling.session.max_context = a.context;
  M3_RETURN_IF_ERROR(a.engine_args.Configure(&scheduling.session));
  M3_ASSIGN_OR_RETURN(server.text, ChatText::Load(a.tokenizer.empty() ? a.model : a.tokenizer,
                                                  /*require_template=*/false));
  if (!server.text->has_template())
    std::fprintf(stderr, "m3 serve: no chat template in the folder: /v1/chat/completions will refuse requests\n");
  M3_ASSIGN_OR_RETURN(server.engine, Engine::Open(a.model, engine_options));
  server.scheduler = std::make_unique<Scheduler>(*server.engine, server.text->tokenizer(), scheduling);
  if (server.args.name.empty())
    server.args.name = std::filesystem::path(a.model).lexically_normal().filename().string();
  if (server.args.name.empty()) server.args.name = "m3";
  return Status::Ok();
}

// The API key (--api-key, else M3_API_KEY), and what a server reachable beyond loopback should say.
void SetUpAccess(ServeArgs& a) {
  if (a.api_key.empty())
    if (const char* env = std::getenv("M3_API_KEY")) a.api_key = env;
  if (IsLoopback(a.host)) return;
  if (a.api_key.empty())
    std::fprintf(stderr,
                 "m3 serve: warning: listening on %s, beyond loopback, with no API key: anyone who can "
                 "reach this port can use the model (--api-key or M3_API_KEY)\n",
                 a.host.c_str());
  if (a.allow_host.empty())
    std::fprintf(stderr,
                 "m3 serve: note: only requests to the loopback names are answered until --allow-host "
                 "names the ones clients use (or '*')\n");
}

// Waits for SIGTERM or SIGINT (until `done`). Before the server listens (the model loading), the
// process just ends. Then it drains: new requests get 503, queued ones end with 503 at once,
// generating ones may finish for --drain-timeout seconds (a second signal cuts that short), and
// are then stopped (a 503 or an error event); then the server stops listening.
void Drain(Server& server, GuardedServer& http, const sigset_t& signals, const std::atomic<bool>& listening,
           const std::atomic<bool>& done) {
  const timespec slice{0, 100'000'000};
  auto wait_signal = [&] { return sigtimedwait(&signals, nullptr, &slice) > 0; };
  while (!done && !wait_signal()) {
  }
  if (done) return;
  if (!listening) {
    std::fprintf(stderr, "m3 serve: stopped before it listened\n");
    std::_Exit(0);  // nothing to drain; the model's mapping goes with the process
  }
  server.draining = true;
  const size_t generating = server.scheduler->active();
  std::fprintf(stderr,
               "m3 serve: stopping: new requests get 503; %zu queued ones end now; %zu generating ones may finish "
               "within %d s (a second signal stops them now)\n",
               server.scheduler->queued(), generating, server.args.drain_seconds);
  server.scheduler->DropQueued(Status(StatusCode::kUnavailable, "the server is shutting down"));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(server.args.drain_seconds);
  bool again = false;
  while (server.jobs->in_flight() > 0 && std::chrono::steady_clock::now() < deadline && !(again = wait_signal())) {
  }
  if (server.jobs->in_flight() > 0) {
    std::fprintf(stderr, "m3 serve: stopping %zu requests still generating%s\n", server.jobs->in_flight(),
                 again ? " (second signal)" : " (--drain-timeout)");
    server.jobs->CancelAll();  // each ends at the scheduler's next step
    const auto last = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (server.jobs->in_flight() > 0 && std::chrono::steady_clock::now() < last)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Idle connections close now; those in a handler write their last bytes, and listen() returns
  // once they have. Again until it has: a signal may come just before listen() began.
  while (!done) {
    http.StopListening();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// A thread per connection gives glibc an arena per thread, and its dynamic mmap threshold rises
// to 32 MiB once a large block is freed: from then on the transient buffers of hostile requests
// (a gzip body up to its limit, a grammar up to the compiler's) land in those arenas, which keep
// the pages. The soak's RSS grew 90 MiB over 960 requests that way and plateaued near +80 MiB
// (the same run under MALLOC_ARENA_MAX=1 stayed flat). A fixed threshold sends every block of
// 4 MiB or more to mmap, back to the system on free; the engine allocates no such block per
// token (strace of a decode), so it costs nothing. MALLOC_MMAP_THRESHOLD_ in the environment wins.
void KeepTransientBuffersOffTheHeap() {
#if defined(__GLIBC__)
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) mallopt(M_MMAP_THRESHOLD, 4 << 20);
#endif
}

int Serve(const ServeArgs& a) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "m3 serve: %s\n", s.ToString().c_str());
    return 1;
  };
  if (Status s = CheckArgs(a); !s.ok()) return fail(s);
  KeepTransientBuffersOffTheHeap();
  auto server = std::make_shared<Server>();
  server->args = a;
  server->jobs = std::make_unique<JobQueue>(static_cast<size_t>(a.slots), a.max_queue, server->metrics);
  // SIGTERM and SIGINT are taken by a thread of their own (Drain); blocked here, before any
  // other thread exists, so that every thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  GuardedServer http(a.limits);
  server->http = &http;
  std::atomic<bool> listening{false}, done{false};
  std::thread drain([&] { Drain(*server, http, stop_signals, listening, done); });
  struct JoinAtExit {  // on every return below
    std::atomic<bool>& done;
    std::thread& thread;
    ~JoinAtExit() {
      done = true;
      thread.join();
    }
  } join_drain{done, drain};
  if (Status s = Load(*server); !s.ok()) return fail(s);
  const size_t max_context = server->scheduler->max_context();

  server->scheduler->Start();
  // A lost rank (docs/DIST.md): the drain of SIGTERM turns requests away with 503 until the
  // job ends (StopJobOnLostRank).
  if (cluster::Group* group = JobGroup())
    StopJobOnLostRank(*group, [](const Status& s) {
      std::fprintf(stderr, "m3 serve: %s\n", s.message().c_str());
      kill(getpid(), SIGTERM);
    });

  SetUpAccess(server->args);
  AddHttpGuards(http, server);
  AddMetricsRoute(http, server);
  AddOpenAIRoutes(http, server);
  AddAnthropicRoutes(http, server);

  const int port = a.port == 0 ? http.bind_to_any_port(a.host) : (http.bind_to_port(a.host, a.port) ? a.port : -1);
  if (port < 0) {
    server->scheduler->Stop();
    return fail(IoError("cannot listen on ", a.host, ":", a.port));
  }
  // The one line a script waits for (stdout, flushed): where the server is.
  std::printf("m3 serve: %s on http://%s:%d (model \"%s\", context %zu tokens, %d slots)\n",
              server->engine->simd_target().c_str(), a.host.c_str(), port, server->args.name.c_str(), max_context,
              a.slots);
  std::fflush(stdout);
  listening = true;
  const bool listened = http.listen_after_bind();
  done = true;
  server->scheduler->Stop();
  if (!listened && !server->draining) return fail(IoError("the server on ", a.host, ":", port, " stopped"));
  return 0;
}

}  // namespace

void AddServeCommand(CLI::App& app, int* rc) {
  auto a = std::make_shared<ServeArgs>();
  auto* cmd =
      app.add_subcommand("serve",
                         "OpenAI- and Anthropic-compatible HTTP server: /v1/chat/completions, "
                         "/v1/completions, /v1/messages (streaming or not), /v1/models, /tokenize, /detokenize, "
                         "/metrics, /health");
  cmd->add_option("-m,--model", a->model, "model folder (with tokenizer.json and chat_template.jinja)")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "folder with the tokenizer files, if not the model folder");
  cmd->add_option("--host", a->host, "address to listen on")->default_val("127.0.0.1");
  cmd->add_option("--port", a->port, "port (0: any free one, printed at start)")->default_val(8080);
  cmd->add_option("--name", a->name, "model id reported to clients (default: the model folder's name)");
  cmd->add_option("--api-key", a->api_key,
                  "require \"Authorization: Bearer KEY\" (or \"x-api-key: KEY\") on every route but /health "
                  "(default: $M3_API_KEY if set)");
  cmd->add_option("--allow-host", a->allow_host,
                  "a Host name clients may use (repeatable; default: localhost, 127.0.0.1, [::1]; '*': any): "
                  "other Host headers get 403, so a web page cannot reach the server by DNS rebinding");
  AddEngineOptions(cmd, &a->engine_args);
  cmd->add_option("-c,--context", a->context, "context limit in tokens (0 = the model's)")->default_val(0);
  cmd->add_option("--slots", a->slots,
                  "sessions kept, each with the cache of one conversation, and the most requests generating at once "
                  "(their decode steps batched); a request goes to the free one sharing the longest prefix with it "
                  "(each holds the memory of its context)")
      ->default_val(1);
  cmd->add_option("--cache-memory", a->cache_memory,
                  "most memory all slots' KV and index-key caches may hold together, e.g. 16G or 512M (default: what "
                  "the process can get); idle conversations' caches are released first when a request needs more");
  cmd->add_option("-n,--max-tokens", a->defaults.max_tokens, "tokens per reply when a request gives no max_tokens")
      ->default_val(512);
  cmd->add_option("--max-queue", a->max_queue, "requests that may wait for a slot; more get 429 with Retry-After")
      ->default_val(64);
  cmd->add_option("--max-connections", a->limits.max_connections,
                  "open connections; past it, the one idle or sending its request the longest is closed to make "
                  "room (one generating never is)")
      ->default_val(1024);
  cmd->add_option("--read-timeout", a->limits.read_request_seconds,
                  "seconds a client has to send a request's headers and body (slower ones are closed)")
      ->default_val(60);
  cmd->add_option("--drain-timeout", a->drain_seconds,
                  "on SIGTERM or SIGINT, seconds the requests generating may take to finish before they are stopped "
                  "(queued ones end at once with 503; a second signal stops all)")
      ->default_val(30);
  AddLiteralContentOption(cmd, &a->defaults.literal_content);
  AddSamplingOptions(cmd, &a->defaults.sampling);
  AddLookupOption(cmd, &a->defaults.lookup);
  cmd->callback([a, rc] { *rc = Serve(*a); });
}

}  // namespace m3::cli
