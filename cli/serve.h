// `m3 serve`: an OpenAI- and Anthropic-compatible HTTP server over one engine (cli/cmd_serve.cc
// starts it). What its parts share: the command's settings and the Server every route reaches.
// The parts, one concern each:
//   serve_connections  a thread per connection, read deadlines, eviction, hang-up checks
//   serve_http         who may talk to the server, error replies, request bodies, /health
//   serve_replies      a completion request: prepared by the runtime (runtime/reply.h), admitted,
//                      written whole or as a stream as the scheduler makes it
//   serve_jobs         the requests in flight: admission (429), accounting, cancellation
//   serve_metrics      GET /metrics
//   serve_openai       OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/models,
//                      /tokenize, /detokenize
//   serve_anthropic    Anthropic's routes: /v1/messages, /v1/messages/count_tokens
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/serve_connections.h"
#include "cli/serve_jobs.h"
#include "cli/serve_metrics.h"
#include "runtime/chat.h"
#include "runtime/engine.h"
#include "runtime/reply.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace m3::cli {

struct ServeArgs {
  std::string model, tokenizer, host = "127.0.0.1", name;
  int port = 8080;
  int slots = 1;
  size_t context = 0;
  std::string cache_memory;  // --cache-memory: most bytes all slots' caches may hold ("" = no limit)
  EngineArgs engine_args;
  RequestDefaults defaults;
  std::string api_key;                  // --api-key, or M3_API_KEY; "" = none
  std::vector<std::string> allow_host;  // --allow-host; empty = the loopback names
  ConnectionLimits limits;
  size_t max_queue = 64;   // requests waiting for a slot; more get 429
  int drain_seconds = 30;  // after SIGTERM, how long generating requests may take to finish
};

// The model, its text layer, the scheduler that runs the requests (lib/runtime/scheduler.h), the
// requests in flight and the metrics.
// The order matters: the scheduler goes first, as its requests' ends reach the job queue and the
// metrics, and before the engine and the text layer it runs on.
struct Server {
  ServeArgs args;
  ServeMetrics metrics;
  std::unique_ptr<JobQueue> jobs;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ChatText> text;
  std::unique_ptr<Scheduler> scheduler;
  GuardedServer* http = nullptr;
  std::atomic<bool> draining{false};

  ReplyContext replies() { return {*text, *scheduler, args.defaults, args.name}; }
  // Unique per request (its tool-call ids too): across this process by the counter, across
  // processes (a restart within the same second) by a random part drawn at start.
  std::string NewId();
  std::atomic<uint64_t> next_id{0};
  const uint32_t id_nonce = std::random_device()() & 0xFFFFFF;
};

// The routes of each part (serve_http.cc, serve_metrics.cc, serve_openai.cc, serve_anthropic.cc),
// each capturing `server`.
void AddHttpGuards(GuardedServer& http, const std::shared_ptr<Server>& server);
void AddMetricsRoute(GuardedServer& http, const std::shared_ptr<Server>& server);
void AddOpenAIRoutes(GuardedServer& http, const std::shared_ptr<Server>& server);
void AddAnthropicRoutes(GuardedServer& http, const std::shared_ptr<Server>& server);

// POST of a completion request of `api` (serve_replies.cc): read, prepared, admitted, answered.
void HandleCompletion(const std::shared_ptr<Server>& server, Api api, const httplib::Request& req,
                      const httplib::ContentReader& reader, httplib::Response& res);

}  // namespace m3::cli
