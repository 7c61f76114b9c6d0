// m3 serve: an OpenAI-compatible HTTP server (cpp-httplib) over one engine. Requests are parsed
// and rendered on their HTTP threads (a bad one gets its 400 before any work) and run by the
// scheduler of lib/runtime/scheduler.h: up to --slots at once, batched into one forward pass per
// step, each in the session that holds the longest cached prefix of its conversation.
// Endpoints: GET /health, GET /metrics, GET /v1/models, POST /v1/chat/completions,
// POST /v1/completions (both with "stream": true as server-sent events, "n" choices each),
// POST /tokenize, POST /detokenize, and Anthropic's Messages API: POST /v1/messages (streamed as
// its events), POST /v1/messages/count_tokens. Connections are handled
// by cli/serve_connections.h; SIGTERM or SIGINT drains (Serve).
#include <httplib.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <csignal>
#include <map>
#include <set>
#include <thread>
#include <cctype>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <condition_variable>
#include <ctime>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/serve_connections.h"
#include "cluster/group.h"
#include "base/json_guard.h"
#include "runtime/anthropic.h"
#include "runtime/chat.h"
#include "runtime/openai.h"
#include "runtime/scheduler.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

struct ServeArgs {
  std::string model, tokenizer, host = "127.0.0.1", name;
  int port = 8080;
  int slots = 1;
  size_t context = 0;
  std::string cache_memory;  // --cache-memory: most bytes all slots' caches may hold ("" = no limit)
  EngineArgs engine_args;
  openai::Defaults defaults;
  std::string api_key;                 // --api-key, or M3_API_KEY; "" = none
  std::vector<std::string> allow_host; // --allow-host; empty = the loopback names
  ConnectionLimits limits;
  size_t max_queue = 64;   // requests waiting for a slot; more get 429
  int drain_seconds = 30;  // after SIGTERM, how long generating requests may take to finish
};

// Who may talk to the server (issue 35): a page in the user's browser must not reach it across
// origins (a Host allow-list defeats DNS rebinding; JSON-only bodies need a CORS preflight that
// is never granted), and with a key every route but /health needs "Authorization: Bearer KEY".
struct Access {
  std::string api_key;
  std::vector<std::string> hosts;  // "*": any

  // Equal strings in time that depends on their lengths only, not on where they differ.
  static bool SameKey(const std::string& a, const std::string& b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    for (size_t i = 0; i < std::max(a.size(), b.size()); ++i)
      diff |= static_cast<unsigned char>((i < a.size() ? a[i] : 0) ^ (i < b.size() ? b[i] : 0));
    return diff == 0;
  }
  // The Host header without its port ("[::1]:8080" -> "[::1]").
  static std::string HostName(const std::string& host) {
    if (!host.empty() && host[0] == '[') return host.substr(0, host.find(']') + 1);
    return host.substr(0, host.find(':'));
  }
  bool HostAllowed(const std::string& host) const {
    const std::string name = HostName(host);
    for (const std::string& h : hosts)
      if (h == "*" || h == name) return true;
    return false;
  }
  // Empty: the request may go on; else the refusal (status, message).
  std::optional<std::pair<int, std::string>> Check(const httplib::Request& req) const {
    if (!req.has_header("Host") || !HostAllowed(req.get_header_value("Host")))
      return std::pair{403, "Host '" + req.get_header_value("Host") +
                                "' is not one this server answers to (--allow-host adds names; the "
                                "loopback names are allowed by default)"};
    if (req.path == "/health") return std::nullopt;
    if (!api_key.empty()) {
      const std::string auth = req.get_header_value("Authorization");
      const std::string prefix = "Bearer ";
      const bool bearer = auth.compare(0, prefix.size(), prefix) == 0 && SameKey(auth.substr(prefix.size()), api_key);
      // Anthropic's clients send the key as "x-api-key".
      const bool x_api_key = req.has_header("x-api-key") && SameKey(req.get_header_value("x-api-key"), api_key);
      if (!bearer && !x_api_key)
        return std::pair{401, std::string("a valid API key is needed: send \"Authorization: Bearer <key>\" (or "
                                          "\"x-api-key: <key>\")")};
    }
    if (req.method == "POST") {
      const std::string type = req.get_header_value("Content-Type");
      if (type.substr(0, type.find(';')) != "application/json")
        return std::pair{415, "request bodies must be sent as Content-Type: application/json, got '" + type + "'"};
    }
    return std::nullopt;
  }
};

// The method a route of this server takes ("" for no such route).
std::string AllowedMethod(const std::string& path) {
  if (path == "/v1/chat/completions" || path == "/v1/completions" || path == "/tokenize" || path == "/detokenize" ||
      path == "/v1/messages" || path == "/v1/messages/count_tokens")
    return "POST";
  if (path == "/health" || path == "/metrics" || path == "/v1/models" || path.rfind("/v1/models/", 0) == 0) return "GET";
  return "";
}

// The route label of a request path (/metrics): the routes themselves, one label for a model's
// page, and "other" for any other path (labels stay few whatever clients send).
std::string RouteLabel(const std::string& path) {
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{model}";
  return AllowedMethod(path).empty() ? "other" : path;
}

bool IsLoopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string Dump(const ojson& j) { return JsonText(j); }

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
  const size_t power = unit.empty() ? 0 : unit.size() == 1 ? units.find(static_cast<char>(std::toupper(unit[0]))) + 1 : 0;
  if (used == 0 || !(v > 0) || (!unit.empty() && power == 0))
    return InvalidArgument("expected a size such as 16G, 512M or 1073741824, got '", text, "'");
  const double bytes = v * std::pow(1024.0, static_cast<double>(power));
  if (bytes < 1 || bytes > 9e18) return InvalidArgument("size out of range: '", text, "'");
  return static_cast<uint64_t>(bytes);
}

// A number in the exposition format: integers exactly (a counter past 1e6 keeps its digits),
// others with 9 significant digits.
std::string PromNumber(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[40];
  if (v == std::floor(v) && std::abs(v) < 9e15) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// A Prometheus histogram: counts at or below each bound (and +Inf), the sum and the count.
struct Histogram {
  std::vector<double> bounds;    // ascending
  std::vector<uint64_t> counts;  // per bucket (not cumulative), the last one past every bound
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  // `times` observations of `v` (a mean per token counted once per token).
  void Observe(double v, uint64_t times = 1) {
    counts[static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin())] += times;
    sum += v * static_cast<double>(times);
    count += times;
  }
  std::string Text(const char* name, const char* help) const {
    std::string out = Str("# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
    uint64_t below = 0;
    for (size_t i = 0; i <= bounds.size(); ++i) {
      below += counts[i];
      out += Str(name, "_bucket{le=\"", i < bounds.size() ? PromNumber(bounds[i]) : "+Inf", "\"} ", below, "\n");
    }
    return out + Str(name, "_sum ", PromNumber(sum), "\n", name, "_count ", count, "\n");
  }
};

// What /metrics reports beyond plain counters: responses by route and status, latency and prompt
// length histograms, recent token rates. Under `mu`.
struct ServeMetrics {
  std::mutex mu;
  std::map<std::pair<std::string, int>, uint64_t> responses;  // (route, HTTP status)
  Histogram time_to_first_token{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram inter_token{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
  Histogram request_duration{{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}};
  Histogram prompt_length{{1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144}};
  double prefill_rate = 0, decode_rate = 0;  // tokens/s of recent choices (a moving average)

  // A choice that ended well, `seconds` after its request came.
  void Choice(const GenerateStats& st, double seconds) {
    std::lock_guard<std::mutex> lock(mu);
    prompt_length.Observe(static_cast<double>(st.prompt_tokens));
    auto recent = [](double* avg, double v) { *avg = *avg == 0 ? v : 0.8 * *avg + 0.2 * v; };
    if (st.prompt_tokens > st.reused_tokens && st.prefill_seconds > 0) recent(&prefill_rate, st.prefill_tok_s());
    if (st.generated_tokens == 0) return;
    // The first token came when decoding began (its sampling ends the prefill); the others are
    // counted at their mean gap.
    time_to_first_token.Observe(std::max(0.0, seconds - st.decode_seconds));
    if (st.generated_tokens > 1) {
      inter_token.Observe(st.decode_seconds / static_cast<double>(st.generated_tokens - 1), st.generated_tokens - 1);
      if (st.decode_seconds > 0) recent(&decode_rate, st.decode_tok_s());
    }
  }
};

// A request seen from its HTTP thread: the scheduler's callbacks hand the deltas and the ends
// over under `mu`.
struct Job {
  bool chat = true;
  std::string id, path;
  bool stream = false, include_usage = false;
  std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
  // Why it was cancelled: its client left (nothing to answer), or the server is shutting down (a 503).
  std::atomic<bool> client_gone{false}, shut_down{false};
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();

  std::mutex mu;
  std::condition_variable cv;
  // n per prompt (a completions request may have several prompts); a stream's deltas are those
  // not yet taken by the HTTP thread.
  std::vector<openai::ChoiceResult> choices;
  std::vector<char> ended;  // of each choice
  size_t finished = 0;      // choices ended
};

// The model, its text layer and the scheduler (lib/runtime/scheduler.h) that runs the requests.
struct Server {
  ServeArgs args;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ChatText> text;
  std::unique_ptr<Scheduler> scheduler;
  std::atomic<uint64_t> next_id{0};
  GuardedServer* http = nullptr;
  std::atomic<bool> draining{false};

  // Choices handed to the scheduler and not ended (a completions request may hold several).
  std::atomic<size_t> in_flight{0};
  // For /metrics: counters since start.
  std::atomic<uint64_t> requests{0}, failed{0}, rejected{0}, cancelled{0}, prompt_tokens{0}, cached_tokens{0},
      generated_tokens{0};
  ServeMetrics metrics;
  std::mutex jobs_mu;
  std::set<std::shared_ptr<Job>> jobs;  // in flight, for a drain to cancel
  double mean_seconds = 0;              // of recent requests (under jobs_mu)

  // Takes room for `n` more choices: false when the queue is full.
  bool Reserve(size_t n) {
    const size_t cap = static_cast<size_t>(args.slots) + args.max_queue;
    size_t cur = in_flight.load();
    do {
      if (cur + n > cap) return false;
    } while (!in_flight.compare_exchange_weak(cur, cur + n));
    return true;
  }
  // When to try again after a 429 or 503: the queue ahead served at the recent pace, 1..300 s.
  int RetryAfterSeconds() {
    std::lock_guard<std::mutex> lock(jobs_mu);
    const double rounds = static_cast<double>(in_flight.load()) / std::max(1, args.slots);
    return static_cast<int>(std::clamp(std::ceil(rounds * std::max(mean_seconds, 0.1)), 1.0, 300.0));
  }
  // Stops every request in flight within a step (a drain's last resort).
  void CancelAll() {
    std::lock_guard<std::mutex> lock(jobs_mu);
    for (const auto& job : jobs) {
      job->shut_down = true;
      *job->cancelled = true;
    }
  }

  // Unique per request (its tool-call ids "call_<id>_..." too): across this process by the counter,
  // across processes (a restart within the same second) by a random part drawn at start.
  const uint32_t id_nonce = std::random_device()() & 0xFFFFFF;
  std::string NewId() {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%08llx%06x%llx", static_cast<unsigned long long>(std::time(nullptr)),
                  static_cast<unsigned>(id_nonce), static_cast<unsigned long long>(next_id++));
    return buf;
  }

  // Hands choice `c` of a prepared request to the scheduler, wired to `job`.
  void Submit(const std::shared_ptr<Job>& job, size_t c, const openai::Request& r, TurnOptions turn) {
    ScheduledRequest sr;
    sr.prompt = job->choices[c].prompt;
    sr.turn = std::move(turn);
    sr.sampling = openai::ChoiceSampling(r, c);  // seed + c % n
    sr.cancelled = job->cancelled;
    sr.on_delta = [job, c](const TurnDelta& d) {
      {
        std::lock_guard<std::mutex> lock(job->mu);
        job->choices[c].deltas.push_back(d);
      }
      job->cv.notify_all();
      return !job->cancelled->load();  // a closed connection stops generation
    };
    sr.on_end = [this, job, c](const Status& status, ParsedOutput out, const GenerateStats& st, size_t largest_batch) {
      // 499: the client closed the connection (nginx's code); the log says so.
      const int code = job->client_gone ? 499 : job->shut_down ? 503 : status.ok() ? 200 : openai::HttpStatus(status);
      Log(job->path.c_str(), code, st, largest_batch);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - job->start).count();
      if (code == 200) {
        prompt_tokens += st.prompt_tokens;
        metrics.Choice(st, seconds);
      } else if (code != 499) {
        ++failed;
      }
      cached_tokens += st.reused_tokens;
      generated_tokens += st.generated_tokens;
      bool last;
      {
        std::lock_guard<std::mutex> lock(job->mu);
        openai::ChoiceResult& choice = job->choices[c];
        choice.status = status;
        choice.output = std::move(out);
        choice.stats = st;
        job->ended[c] = 1;
        last = ++job->finished == job->choices.size();
      }
      if (last) {
        if (!job->client_gone) {
          std::lock_guard<std::mutex> lock(metrics.mu);
          metrics.request_duration.Observe(seconds);
        }
        std::lock_guard<std::mutex> lock(jobs_mu);
        mean_seconds = mean_seconds == 0 ? seconds : 0.8 * mean_seconds + 0.2 * seconds;
        jobs.erase(job);
      }
      --in_flight;
      job->cv.notify_all();
    };
    if (c == 0) {
      std::lock_guard<std::mutex> lock(jobs_mu);
      jobs.insert(job);
    }
    scheduler->Submit(std::move(sr));
  }

  // Marks `job` as left by its client: the scheduler drops or stops it within a step.
  void ClientLeft(Job& job) {
    if (job.client_gone.exchange(true)) return;
    *job.cancelled = true;
    ++cancelled;
    std::fprintf(stderr, "m3 serve: %s %s: the client closed the connection; cancelled\n", job.path.c_str(),
                 job.id.c_str());
  }

  // Prometheus text (exposition format 0.0.4): counters since start and the state now.
  std::string Metrics() {
    const ConnectionCounts conn = http ? http->counts() : ConnectionCounts();
    std::string out;
    auto metric = [&](const char* name, const char* type, const char* help, double value) {
      out += Str("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ", PromNumber(value), "\n");
    };
    {
      std::lock_guard<std::mutex> lock(metrics.mu);
      out += "# HELP m3_requests_total HTTP requests answered, by route and status\n# TYPE m3_requests_total counter\n";
      for (const auto& [key, n] : metrics.responses)
        out += Str("m3_requests_total{endpoint=\"", key.first, "\",status=\"", key.second, "\"} ", n, "\n");
      out += metrics.time_to_first_token.Text("m3_time_to_first_token_seconds",
                                              "from a request's arrival to its choice's first token");
      out += metrics.inter_token.Text("m3_inter_token_latency_seconds",
                                      "time per output token after the first (each choice's mean, once per token)");
      out += metrics.request_duration.Text("m3_request_duration_seconds",
                                           "from a completion request's arrival to its last choice's end");
      out += metrics.prompt_length.Text("m3_prompt_tokens", "prompt length of each choice that ended well");
      metric("m3_prefill_tokens_per_second", "gauge", "prompt tokens per second of recent choices (moving average)",
             metrics.prefill_rate);
      metric("m3_decode_tokens_per_second", "gauge", "generated tokens per second of recent choices (moving average)",
             metrics.decode_rate);
    }
    metric("m3_requests_accepted_total", "counter", "completion requests accepted", static_cast<double>(requests));
    metric("m3_requests_failed_total", "counter", "choices that ended in an error", static_cast<double>(failed));
    metric("m3_requests_rejected_total", "counter", "requests refused with 429: the queue was full",
           static_cast<double>(rejected));
    metric("m3_requests_cancelled_total", "counter", "requests whose client closed the connection",
           static_cast<double>(cancelled));
    metric("m3_prompt_tokens_total", "counter", "prompt tokens of completed choices", static_cast<double>(prompt_tokens));
    metric("m3_prompt_tokens_cached_total", "counter", "prompt tokens found in a slot's cache",
           static_cast<double>(cached_tokens));
    metric("m3_generated_tokens_total", "counter", "tokens generated", static_cast<double>(generated_tokens));
    const PrefixCacheStats prefix_cache = scheduler->prefix_stats();
    metric("m3_prefix_cache_bytes", "gauge", "cache pages of shared prompt prefixes the store holds",
           static_cast<double>(prefix_cache.bytes));
    metric("m3_prefix_cache_hits_total", "counter", "requests that adopted a stored prefix",
           static_cast<double>(prefix_cache.hits));
    metric("m3_prefix_cache_lookups_total", "counter", "requests that looked up a stored prefix",
           static_cast<double>(prefix_cache.lookups));
    metric("m3_prompt_cache_hit_ratio", "gauge", "prompt tokens found cached / prompt tokens, since start",
           prompt_tokens > 0 ? std::min(1.0, static_cast<double>(cached_tokens) / static_cast<double>(prompt_tokens))
                             : 0.0);
    metric("m3_cache_bytes", "gauge", "bytes the slots' KV and index-key caches hold (each page once)",
           static_cast<double>(scheduler->cache_bytes()));
    metric("m3_requests_queued", "gauge", "choices waiting for a slot", static_cast<double>(scheduler->queued()));
    metric("m3_requests_generating", "gauge", "choices generating", static_cast<double>(scheduler->active()));
    metric("m3_slots", "gauge", "sessions (the most choices generating at once)", args.slots);
    metric("m3_queue_limit", "gauge", "choices that may wait for a slot before 429", static_cast<double>(args.max_queue));
    metric("m3_connections_open", "gauge", "open HTTP connections", static_cast<double>(conn.open));
    metric("m3_connections_accepted_total", "counter", "HTTP connections accepted", static_cast<double>(conn.accepted));
    metric("m3_connections_timed_out_total", "counter", "connections closed for sending a request too slowly",
           static_cast<double>(conn.timed_out));
    metric("m3_connections_evicted_total", "counter", "idle or reading connections closed to make room",
           static_cast<double>(conn.evicted));
    metric("m3_connections_refused_total", "counter", "connections refused: all open ones were generating",
           static_cast<double>(conn.refused));
    metric("m3_draining", "gauge", "1 once SIGTERM or SIGINT asked the server to stop", draining ? 1 : 0);
    return out;
  }

  static void Log(const char* path, int status, const GenerateStats& st, size_t largest_batch) {
    std::fprintf(stderr,
                 "m3 serve: %s %d | prompt %zu tokens (%zu cached) at %.1f tok/s | %zu generated at %.1f tok/s, in "
                 "batches of up to %zu%s | %s\n",
                 path, status, st.prompt_tokens, st.reused_tokens, st.prefill_tok_s(), st.generated_tokens,
                 st.decode_tok_s(), largest_batch, LookupSummary(st).c_str(), st.stop_reason.c_str());
  }
};

void SendError(httplib::Response& res, int status, const std::string& message, int retry_after = 0) {
  res.status = status;
  if (retry_after > 0) res.set_header("Retry-After", std::to_string(retry_after));
  res.set_content(Dump(openai::ErrorBody(message, status)), "application/json");
}

// The largest request body, counted as the handler receives it: after chunked transfer coding
// and Content-Encoding (gzip, brotli) are undone. httplib's own limit sees the bytes on the wire
// only, so a 100 KB gzip body could inflate to 100 MB.
constexpr size_t kMaxBodyBytes = size_t{64} << 20;

// A POST body read through the content reader, or nothing once it passes kMaxBodyBytes (the
// reading stops there).
std::optional<std::string> ReadBody(const httplib::ContentReader& reader) {
  std::string body;
  bool over = false;
  reader([&](const char* data, size_t n) {
    if (body.size() + n > kMaxBodyBytes) {
      over = true;
      return false;
    }
    body.append(data, n);
    return true;
  });
  if (over) return std::nullopt;
  return body;
}

// The JSON body of a request that needs no model pass (count_tokens, tokenize, detokenize);
// nullopt: refused (413 or 400 sent).
std::optional<ojson> ReadJsonBody(const httplib::ContentReader& reader, httplib::Response& res) {
  const std::optional<std::string> raw = ReadBody(reader);
  GuardedServer::RequestRead();
  if (!raw) {
    res.set_header("Connection", "close");
    GuardedServer::CloseAfterReply();
    SendError(res, 413, Str("the request body is larger than ", kMaxBodyBytes >> 20, " MiB"));
    return std::nullopt;
  }
  StatusOr<ojson> body = ParseJson<ojson>(*raw, "the request body");
  if (!body.ok()) {
    SendError(res, 400, body.status().message());
    return std::nullopt;
  }
  return std::move(body).value();
}

// An error reply of the Anthropic endpoints in Anthropic's shape (anthropic::ErrorBody): the
// refusals made for every route (SendError, in OpenAI's shape) turned over once they are made.
void MatchErrorShape(const httplib::Request& req, httplib::Response& res) {
  if (res.status < 400 || !anthropic::IsMessagesPath(req.path)) return;
  const StatusOr<ojson> body = ParseJson<ojson>(res.body, "an error reply");
  if (!body.ok() || !body->contains("error") || !(*body)["error"].is_object()) return;
  res.set_content(Dump(anthropic::ErrorBody((*body)["error"].value("message", std::string()), res.status)),
                  "application/json");
}

// POST /v1/messages with "stream": true: Anthropic's events (anthropic::MessageStream) while the
// scheduler makes the deltas of the request's one choice; a failure after the start is an
// `error` event.
void StreamMessages(const std::shared_ptr<Server>& server, const std::shared_ptr<Job>& job, httplib::Response& res) {
  res.set_header("Cache-Control", "no-cache");
  auto stream = std::make_shared<anthropic::MessageStream>(job->id, server->args.name, job->choices[0].prompt.size());
  res.set_chunked_content_provider("text/event-stream", [server, job, stream](size_t, httplib::DataSink& sink) {
    auto send = [&](const std::vector<anthropic::Event>& events) {
      for (const anthropic::Event& e : events) {
        const std::string text = e.Text();
        if (!sink.write(text.data(), text.size())) return false;
      }
      return true;
    };
    openai::ChoiceResult& choice = job->choices[0];
    bool client_gone = !send(stream->Start());
    bool ended = false;
    while (!ended && !client_gone) {
      std::vector<TurnDelta> deltas;
      {
        std::unique_lock<std::mutex> lock(job->mu);
        // Polled while it waits (queued, or a long prompt): a client that hangs up cancels it.
        if (!job->cv.wait_for(lock, std::chrono::milliseconds(100),
                              [&] { return job->finished > 0 || !choice.deltas.empty(); })) {
          client_gone = GuardedServer::ClientGone();
          continue;
        }
        deltas.swap(choice.deltas);
        ended = job->finished > 0;  // its last deltas came before its end
      }
      for (const TurnDelta& d : deltas)
        if ((client_gone = !send(stream->Next(d)))) break;
    }
    if (client_gone) {
      server->ClientLeft(*job);  // the scheduler stops it at its next step
      return false;
    }
    if (job->shut_down)
      send({anthropic::ErrorEvent("the server is shutting down: the reply was stopped before it was complete", 503)});
    else if (!choice.status.ok())
      send({anthropic::ErrorEvent(choice.status.message(), openai::HttpStatus(choice.status))});
    else
      send(stream->Finish(choice.stats, choice.output));
    sink.done();
    return true;
  });
}

// POST /v1/messages/count_tokens: the length of the prompt the template renders; no model pass.
void HandleCountTokens(const std::shared_ptr<Server>& server, const httplib::ContentReader& reader,
                       httplib::Response& res) {
  const std::optional<ojson> body = ReadJsonBody(reader, res);
  if (!body) return;
  const auto r = anthropic::ParseMessagesRequest(*body, server->args.defaults, /*count_tokens=*/true);
  if (!r.ok()) return SendError(res, 400, r.status().message());
  TurnOptions turn;
  const auto ids = openai::TurnInputs(*server->text, *r, "count", SIZE_MAX, &turn);
  if (!ids.ok()) return SendError(res, openai::HttpStatus(ids.status()), ids.status().message());
  res.set_content(Dump(ojson{{"input_tokens", ids->size()}}), "application/json");
}

// POST /v1/chat/completions (chat), /v1/completions and /v1/messages (Anthropic's, a chat request
// with its own reply shapes).
void HandleCompletion(const std::shared_ptr<Server>& server, bool chat, const httplib::Request& req,
                      const httplib::ContentReader& reader, httplib::Response& res) {
  // A body announced past the limit is refused before it is read (the connection then closes:
  // its unread bytes are not skipped).
  const std::string length = req.get_header_value("Content-Length");
  uint64_t announced = 0;
  const bool too_long = std::from_chars(length.data(), length.data() + length.size(), announced).ec ==
                            std::errc::result_out_of_range ||
                        announced > kMaxBodyBytes;
  const std::optional<std::string> raw = too_long ? std::nullopt : ReadBody(reader);
  GuardedServer::RequestRead();  // from here on, the reply takes what time it takes
  if (!raw) {
    res.set_header("Connection", "close");
    GuardedServer::CloseAfterReply();
    return SendError(res, 413, Str("the request body is larger than ", kMaxBodyBytes >> 20,
                                   " MiB (counted after its transfer and content encodings are undone)"));
  }
  if (server->draining) {
    res.set_header("Connection", "close");
    GuardedServer::CloseAfterReply();
    return SendError(res, 503, "the server is shutting down", 1);
  }
  const StatusOr<ojson> parsed_body = ParseJson<ojson>(*raw, "the request body");
  if (!parsed_body.ok()) return SendError(res, 400, parsed_body.status().message());
  const ojson& body = *parsed_body;
  const bool messages = req.path == "/v1/messages";  // Anthropic's API, mapped onto a chat request
  auto parsed = messages ? anthropic::ParseMessagesRequest(body, server->args.defaults)
                : chat   ? openai::ParseChatRequest(body, server->args.defaults)
                         : openai::ParseCompletionRequest(body, server->args.defaults);
  if (!parsed.ok()) return SendError(res, 400, parsed.status().message());
  const openai::Request& r = *parsed;
  res.set_header("X-Seed", std::to_string(r.sampling.seed));  // the request's, or the fresh one it got
  auto job = std::make_shared<Job>();
  job->chat = chat;
  job->stream = r.stream;
  job->include_usage = r.include_usage;
  job->id = (messages ? "msg_" : chat ? "chatcmpl-" : "cmpl-") + server->NewId();
  job->path = req.path;
  // Checked here (the text layer is immutable, any thread may use it), so that even a stream
  // refuses a bad request with a 400 before it starts.
  const size_t n_choices = openai::ChoiceCount(r);  // n of each prompt, prompt-major
  job->choices.resize(n_choices);
  job->ended.assign(n_choices, 0);
  std::vector<TurnOptions> turns(n_choices);
  for (size_t c = 0; c < n_choices; ++c) {
    auto prompt = openai::TurnInputs(*server->text, r, job->id, server->scheduler->max_context(), &turns[c], c);
    if (prompt.ok()) {
      // Permanent: a prompt whose cache can never fit the budget is the client's to change (4xx).
      if (Status fits = server->scheduler->CheckFitsBudget(prompt->size()); !fits.ok()) prompt = fits;
    }
    if (!prompt.ok()) return SendError(res, openai::HttpStatus(prompt.status()), prompt.status().message());
    job->choices[c].prompt = std::move(prompt).value();
    if (messages) turns[c].tool_call_id_prefix = anthropic::kToolUseIdPrefix + job->id + "_";
  }
  if (!server->Reserve(n_choices)) {
    ++server->rejected;
    return SendError(res, 429,
                     Str("the server is busy: ", server->args.slots, " requests generating and ",
                         server->args.max_queue, " waiting (--slots, --max-queue); try again later"),
                     server->RetryAfterSeconds());
  }
  ++server->requests;
  const int64_t created = std::time(nullptr);
  for (size_t c = 0; c < n_choices; ++c) server->Submit(job, c, r, std::move(turns[c]));
  const Tokenizer& tokenizer = server->text->tokenizer();

  if (!job->stream) {
    std::unique_lock<std::mutex> lock(job->mu);
    // Polled while it waits: a client that hangs up cancels its request, queued or generating.
    while (!job->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return job->finished == job->choices.size(); }))
      if (!job->client_gone && GuardedServer::ClientGone()) server->ClientLeft(*job);
    if (job->client_gone) return;  // nobody to answer
    if (job->shut_down)
      return SendError(res, 503, "the server is shutting down: the reply was stopped before it was complete", 1);
    auto response = messages ? anthropic::WholeMessage(job->id, server->args.name, job->choices[0])
                             : openai::WholeResponse(tokenizer, r, job->id, created, server->args.name, job->choices);
    if (!response.ok()) {
      const int status = openai::HttpStatus(response.status());
      return SendError(res, status, response.status().message(), status == 503 ? server->RetryAfterSeconds() : 0);
    }
    res.set_content(Dump(*response), "application/json");
    return;
  }

  if (messages) return StreamMessages(server, job, res);
  // Streamed: the deltas of every choice as server-sent events while the scheduler makes them,
  // each chunk naming its choice ("index"), each choice closed by its finish_reason chunk.
  res.set_header("Cache-Control", "no-cache");
  std::vector<std::shared_ptr<openai::ChoicePieces>> pieces;
  for (size_t c = 0; c < n_choices; ++c)
    pieces.push_back(std::make_shared<openai::ChoicePieces>(tokenizer, r, job->choices[c].prompt, c));
  auto request = std::make_shared<openai::Request>(r);
  res.set_chunked_content_provider("text/event-stream", [server, job, created, pieces, request](
                                                            size_t, httplib::DataSink& sink) {
    const std::string& model = server->args.name;
    const std::string& id = job->id;
    const bool chat = job->chat;
    auto send = [&](const ojson& j) {
      const std::string event = "data: " + Dump(j) + "\n\n";
      return sink.write(event.data(), event.size());
    };
    auto send_piece = [&](size_t c, const ojson& piece, const ojson& finish_reason = nullptr) {
      return chat ? send(openai::ChatChunk(id, created, model, piece["delta"], finish_reason, piece["logprobs"], c))
                  : send(openai::CompletionChunk(id, created, model, piece["text"], finish_reason, piece["logprobs"], c));
    };
    const size_t n = job->choices.size();
    bool client_gone = false;
    for (size_t c = 0; c < n && chat && !client_gone; ++c)
      client_gone = !send(openai::ChatChunk(id, created, model, {{"role", "assistant"}, {"content", ""}}, nullptr,
                                            nullptr, c));
    std::vector<char> closed(n, 0);  // finish chunk sent
    size_t open = n;
    const openai::ChoiceResult* failed = nullptr;
    while (open > 0 && !client_gone && !failed && !job->shut_down) {
      std::vector<std::vector<TurnDelta>> deltas(n);
      std::vector<char> ended(n, 0);
      {
        std::unique_lock<std::mutex> lock(job->mu);
        auto ready = [&] {
          for (size_t c = 0; c < n; ++c)
            if (!job->choices[c].deltas.empty() || (job->ended[c] && !closed[c])) return true;
          return false;
        };
        // Polled while it waits (queued, or a long prompt): a client that hangs up cancels it.
        if (!job->cv.wait_for(lock, std::chrono::milliseconds(100), ready)) {
          client_gone = GuardedServer::ClientGone();
          continue;
        }
        for (size_t c = 0; c < n; ++c) {
          deltas[c].swap(job->choices[c].deltas);
          ended[c] = job->ended[c];
        }
      }
      for (size_t c = 0; c < n && !client_gone && !failed; ++c) {
        for (const TurnDelta& d : deltas[c])
          if ((client_gone = !send_piece(c, pieces[c]->Next(d)))) break;
        if (client_gone || !ended[c] || closed[c]) continue;
        const openai::ChoiceResult& choice = job->choices[c];  // ended: no writer any more
        if (job->shut_down) break;
        if (!choice.status.ok()) {
          failed = &choice;
          break;
        }
        if (const ojson last = pieces[c]->Last(); !last.is_null()) send_piece(c, last);
        const std::string reason = openai::FinishReason(choice.stats, choice.output);
        client_gone = !(chat ? send(openai::ChatChunk(id, created, model, ojson::object(), reason, nullptr, c))
                             : send(openai::CompletionChunk(id, created, model, "", reason, nullptr, c)));
        closed[c] = 1;
        --open;
      }
    }
    if (client_gone) {
      server->ClientLeft(*job);  // the scheduler stops it at its next step
      return false;
    }
    if (job->shut_down) {
      send(openai::ErrorBody("the server is shutting down: the reply was stopped before it was complete", 503));
    } else if (failed) {
      *job->cancelled = true;  // one choice failed: the others stop too
      send(openai::ErrorBody(failed->status.message(), openai::HttpStatus(failed->status)));
    } else if (job->include_usage) {
      send(openai::UsageChunk(id, created, model, chat, openai::RequestUsage(*request, job->choices)));
    }
    static const char kDone[] = "data: [DONE]\n\n";
    sink.write(kDone, sizeof(kDone) - 1);
    sink.done();
    return true;
  });
}

// POST /tokenize and /detokenize (openai::Tokenize, openai::Detokenize): no model pass.
void HandleTokens(const std::shared_ptr<Server>& server, bool tokenize, const httplib::ContentReader& reader,
                  httplib::Response& res) {
  const std::optional<ojson> body = ReadJsonBody(reader, res);
  if (!body) return;
  const StatusOr<ojson> out =
      tokenize ? openai::Tokenize(*server->text, *body, server->args.defaults, server->scheduler->max_context())
               : openai::Detokenize(server->text->tokenizer(), *body);
  if (!out.ok()) return SendError(res, openai::HttpStatus(out.status()), out.status().message());
  res.set_content(Dump(*out), "application/json");
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
  while (server.in_flight > 0 && std::chrono::steady_clock::now() < deadline && !(again = wait_signal())) {
  }
  if (server.in_flight > 0) {
    std::fprintf(stderr, "m3 serve: stopping %zu requests still generating%s\n", server.in_flight.load(),
                 again ? " (second signal)" : " (--drain-timeout)");
    server.CancelAll();  // each ends at the scheduler's next step
    const auto last = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (server.in_flight > 0 && std::chrono::steady_clock::now() < last)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Idle connections close now; those in a handler write their last bytes, and listen() returns
  // once they have. Again until it has: a signal may come just before listen() began.
  while (!done) {
    http.StopListening();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int Serve(const ServeArgs& a) {
  auto server = std::make_shared<Server>();
  server->args = a;
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "m3 serve: %s\n", s.ToString().c_str());
    return 1;
  };
  if (a.port < 0 || a.port > 65535) return fail(InvalidArgument("--port must be 0..65535, got ", a.port));
  if (Status s = ValidateSamplingParams(a.defaults.sampling); !s.ok()) return fail(s);
  if (Status s = ValidateLookupOptions(a.defaults.lookup); !s.ok()) return fail(s);
  if (a.defaults.max_tokens < 1) return fail(InvalidArgument("--max-tokens must be at least 1"));
  if (a.slots < 1 || a.slots > 256) return fail(InvalidArgument("--slots must be 1..256, got ", a.slots));
  if (a.max_queue > 100000) return fail(InvalidArgument("--max-queue must be 0..100000, got ", a.max_queue));
  if (a.limits.max_connections < 1 || a.limits.max_connections > 100000)
    return fail(InvalidArgument("--max-connections must be 1..100000, got ", a.limits.max_connections));
  if (a.limits.read_request_seconds < 1 || a.limits.read_request_seconds > 3600)
    return fail(InvalidArgument("--read-timeout must be 1..3600 seconds, got ", a.limits.read_request_seconds));
  if (a.drain_seconds < 0 || a.drain_seconds > 86400)
    return fail(InvalidArgument("--drain-timeout must be 0..86400 seconds, got ", a.drain_seconds));
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
  SchedulerOptions scheduling;
  scheduling.slots = static_cast<size_t>(a.slots);
  scheduling.log = [](const std::string& note) { std::fprintf(stderr, "m3 serve: %s\n", note.c_str()); };
  if (!a.cache_memory.empty()) {
    auto bytes = ParseByteSize(a.cache_memory);
    if (!bytes.ok()) return fail(Status(bytes.status().code(), "--cache-memory: " + bytes.status().message()));
    scheduling.cache_budget = *bytes;
  }
  auto engine_options = a.engine_args.Options();
  if (!engine_options.ok()) return fail(engine_options.status());
  scheduling.session.max_context = a.context;
  if (Status s = a.engine_args.Configure(&scheduling.session); !s.ok()) return fail(s);
  auto text = ChatText::Load(a.tokenizer.empty() ? a.model : a.tokenizer, /*require_template=*/false);
  if (!text.ok()) return fail(text.status());
  server->text = std::move(text).value();
  if (!server->text->has_template())
    std::fprintf(stderr, "m3 serve: no chat template in the folder: /v1/chat/completions will refuse requests\n");
  auto engine = Engine::Open(a.model, *engine_options);
  if (!engine.ok()) return fail(engine.status());
  server->engine = std::move(engine).value();
  server->scheduler = std::make_unique<Scheduler>(*server->engine, server->text->tokenizer(), scheduling);
  const size_t max_context = server->scheduler->max_context();
  if (server->args.name.empty())
    server->args.name = std::filesystem::path(a.model).lexically_normal().filename().string();
  if (server->args.name.empty()) server->args.name = "m3";

  server->scheduler->Start();
  // A lost rank (docs/DIST.md): the drain of SIGTERM turns requests away with 503 until the
  // job ends (StopJobOnLostRank).
  if (cluster::Group* group = JobGroup())
    StopJobOnLostRank(*group, [](const Status& s) {
      std::fprintf(stderr, "m3 serve: %s\n", s.message().c_str());
      kill(getpid(), SIGTERM);
    });

  auto access = std::make_shared<Access>();
  access->api_key = a.api_key;
  if (access->api_key.empty())
    if (const char* env = std::getenv("M3_API_KEY")) access->api_key = env;
  access->hosts = a.allow_host.empty() ? std::vector<std::string>{"localhost", "127.0.0.1", "[::1]"} : a.allow_host;
  if (!IsLoopback(a.host)) {
    if (access->api_key.empty())
      std::fprintf(stderr, "m3 serve: warning: listening on %s, beyond loopback, with no API key: anyone who can "
                           "reach this port can use the model (--api-key or M3_API_KEY)\n", a.host.c_str());
    if (a.allow_host.empty())
      std::fprintf(stderr, "m3 serve: note: only requests to the loopback names are answered until --allow-host "
                           "names the ones clients use (or '*')\n");
  }
  // Before routing and before any body is read.
  http.set_pre_routing_handler([access](const httplib::Request& req, httplib::Response& res) {
    const auto refusal = access->Check(req);
    if (!refusal) return httplib::Server::HandlerResponse::Unhandled;
    if (refusal->first == 401) res.set_header("WWW-Authenticate", "Bearer");
    SendError(res, refusal->first, refusal->second);
    MatchErrorShape(req, res);
    return httplib::Server::HandlerResponse::Handled;
  });
  http.set_logger([server](const httplib::Request& req, const httplib::Response& res) {
    std::lock_guard<std::mutex> lock(server->metrics.mu);
    ++server->metrics.responses[{RouteLabel(req.path), res.status}];
  });
  http.set_payload_max_length(kMaxBodyBytes);  // on the wire; ReadBody counts what it decodes to
  http.Get("/health", [server](const httplib::Request&, httplib::Response& res) {
    if (server->draining) return SendError(res, 503, "the server is shutting down", 1);
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  http.Get("/metrics", [server](const httplib::Request&, httplib::Response& res) {
    res.set_content(server->Metrics(), "text/plain; version=0.0.4");
  });
  auto model_object = [server] {
    return ojson{{"id", server->args.name},
                 {"object", "model"},
                 {"created", 0},
                 {"owned_by", "m3"},
                 {"max_model_len", server->scheduler->max_context()}};
  };
  http.Get("/v1/models", [model_object](const httplib::Request&, httplib::Response& res) {
    res.set_content(Dump(ojson{{"object", "list"}, {"data", ojson::array({model_object()})}}), "application/json");
  });
  http.Get(R"(/v1/models/(.+))", [server, model_object](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] != server->args.name)
      return SendError(res, 404, "no model '" + std::string(req.matches[1]) + "': this server has '" +
                                     server->args.name + "'");
    res.set_content(Dump(model_object()), "application/json");
  });
  http.Post("/v1/chat/completions",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCompletion(server, true, req, reader, res);
            });
  http.Post("/v1/completions",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCompletion(server, false, req, reader, res);
            });
  http.Post("/v1/messages",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCompletion(server, true, req, reader, res);
              MatchErrorShape(req, res);
            });
  http.Post("/v1/messages/count_tokens",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCountTokens(server, reader, res);
              MatchErrorShape(req, res);
            });
  http.Post("/tokenize", [server](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& reader) {
    HandleTokens(server, true, reader, res);
  });
  http.Post("/detokenize", [server](const httplib::Request&, httplib::Response& res,
                                    const httplib::ContentReader& reader) { HandleTokens(server, false, reader, res); });
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler's own error
    // A route that exists under another method is a 405 naming the one it takes.
    const std::string allowed = AllowedMethod(req.path);
    if (res.status == 404 && !allowed.empty()) {
      res.status = 405;
      res.set_header("Allow", allowed);
    }
    const std::string what = res.status == 404   ? "no such endpoint: " + req.method + " " + req.path
                             : res.status == 405 ? req.path + " takes " + allowed + ", not " + req.method
                                                 : "HTTP " + std::to_string(res.status);
    res.set_content(Dump(openai::ErrorBody(what, res.status)), "application/json");
    MatchErrorShape(req, res);
  });
  http.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(Dump(openai::ErrorBody(what, 500)), "application/json");
    MatchErrorShape(req, res);
  });

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
  auto* cmd = app.add_subcommand("serve", "OpenAI- and Anthropic-compatible HTTP server: /v1/chat/completions, "
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
  cmd->add_option("--max-queue", a->max_queue,
                  "requests that may wait for a slot; more get 429 with Retry-After")->default_val(64);
  cmd->add_option("--max-connections", a->limits.max_connections,
                  "open connections; past it, the one idle or sending its request the longest is closed to make "
                  "room (one generating never is)")->default_val(1024);
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
