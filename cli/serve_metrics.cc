#include "cli/serve_metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "base/status.h"
#include "cli/serve.h"

namespace m3::cli {
namespace {

// A number in the exposition format: integers exactly (a counter past 1e6 keeps its digits),
// others with 9 significant digits.
std::string PromNumber(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[40];
  if (v == std::floor(v) && std::abs(v) < 9e15)
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else
    std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void Metric(std::string* out, const char* name, const char* type, const char* help, double value) {
  *out += Str("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n", name, " ", PromNumber(value), "\n");
}

double Count(const std::atomic<uint64_t>& n) { return static_cast<double>(n.load()); }

// The state of the scheduler, the prefix store and the connections now.
void StateText(Server& server, std::string* out) {
  const PrefixCacheStats prefix_cache = server.scheduler->prefix_stats();
  Metric(out, "m3_prefix_cache_bytes", "gauge", "cache pages of shared prompt prefixes the store holds",
         static_cast<double>(prefix_cache.bytes));
  Metric(out, "m3_prefix_cache_hits_total", "counter", "requests that adopted a stored prefix",
         static_cast<double>(prefix_cache.hits));
  Metric(out, "m3_prefix_cache_lookups_total", "counter", "requests that looked up a stored prefix",
         static_cast<double>(prefix_cache.lookups));
  const double prompt_tokens = Count(server.metrics.prompt_tokens);
  Metric(out, "m3_prompt_cache_hit_ratio", "gauge", "prompt tokens found cached / prompt tokens, since start",
         prompt_tokens > 0 ? std::min(1.0, Count(server.metrics.cached_tokens) / prompt_tokens) : 0.0);
  Metric(out, "m3_cache_bytes", "gauge", "bytes the slots' KV and index-key caches hold (each page once)",
         static_cast<double>(server.scheduler->cache_bytes()));
  Metric(out, "m3_requests_queued", "gauge", "choices waiting for a slot",
         static_cast<double>(server.scheduler->queued()));
  Metric(out, "m3_requests_generating", "gauge", "choices generating", static_cast<double>(server.scheduler->active()));
  Metric(out, "m3_slots", "gauge", "sessions (the most choices generating at once)", server.args.slots);
  Metric(out, "m3_queue_limit", "gauge", "choices that may wait for a slot before 429",
         static_cast<double>(server.args.max_queue));
  const ConnectionCounts conn = server.http ? server.http->counts() : ConnectionCounts();
  Metric(out, "m3_connections_open", "gauge", "open HTTP connections", static_cast<double>(conn.open));
  Metric(out, "m3_connections_accepted_total", "counter", "HTTP connections accepted",
         static_cast<double>(conn.accepted));
  Metric(out, "m3_connections_timed_out_total", "counter", "connections closed for sending a request too slowly",
         static_cast<double>(conn.timed_out));
  Metric(out, "m3_connections_evicted_total", "counter", "idle or reading connections closed to make room",
         static_cast<double>(conn.evicted));
  Metric(out, "m3_connections_refused_total", "counter", "connections refused: all open ones were generating",
         static_cast<double>(conn.refused));
  Metric(out, "m3_connections_bad_head_total", "counter",
         "connections closed with a 431 or 400 for a request head past the limits or malformed",
         static_cast<double>(conn.bad_heads));
  Metric(out, "m3_draining", "gauge", "1 once SIGTERM or SIGINT asked the server to stop", server.draining ? 1 : 0);
}

}  // namespace

void Histogram::Observe(double v, uint64_t times) {
  counts[static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin())] += times;
  sum += v * static_cast<double>(times);
  count += times;
}

std::string Histogram::Text(const char* name, const char* help) const {
  std::string out = Str("# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t below = 0;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    below += counts[i];
    out += Str(name, "_bucket{le=\"", i < bounds.size() ? PromNumber(bounds[i]) : "+Inf", "\"} ", below, "\n");
  }
  return out + Str(name, "_sum ", PromNumber(sum), "\n", name, "_count ", count, "\n");
}

void ServeMetrics::Answered(const std::string& route, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++responses_[{route, status}];
}

void ServeMetrics::ChoiceEnded(int code, const GenerateStats& st, double seconds) {
  cached_tokens += st.reused_tokens;
  generated_tokens += st.generated_tokens;
  if (code == 499) return;  // its client left: neither a success nor a failure
  if (code != 200) {
    ++failed;
    return;
  }
  prompt_tokens += st.prompt_tokens;
  std::lock_guard<std::mutex> lock(mu_);
  prompt_length_.Observe(static_cast<double>(st.prompt_tokens));
  auto recent = [](double* avg, double v) { *avg = *avg == 0 ? v : 0.8 * *avg + 0.2 * v; };
  if (st.prompt_tokens > st.reused_tokens && st.prefill_seconds > 0) recent(&prefill_rate_, st.prefill_tok_s());
  if (st.generated_tokens == 0) return;
  // The first token came when decoding began (its sampling ends the prefill); the others are
  // counted at their mean gap.
  time_to_first_token_.Observe(std::max(0.0, seconds - st.decode_seconds));
  if (st.generated_tokens > 1) {
    inter_token_.Observe(st.decode_seconds / static_cast<double>(st.generated_tokens - 1), st.generated_tokens - 1);
    if (st.decode_seconds > 0) recent(&decode_rate_, st.decode_tok_s());
  }
}

void ServeMetrics::RequestEnded(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  request_duration_.Observe(seconds);
}

std::string ServeMetrics::Text(Server& server) {
  std::string out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out += "# HELP m3_requests_total HTTP requests answered, by route and status\n# TYPE m3_requests_total counter\n";
    for (const auto& [key, n] : responses_)
      out += Str("m3_requests_total{endpoint=\"", key.first, "\",status=\"", key.second, "\"} ", n, "\n");
    out += time_to_first_token_.Text("m3_time_to_first_token_seconds",
                                     "from a request's arrival to its choice's first token");
    out += inter_token_.Text("m3_inter_token_latency_seconds",
                             "time per output token after the first (each choice's mean, once per token)");
    out += request_duration_.Text("m3_request_duration_seconds",
                                  "from a completion request's arrival to its last choice's end");
    out += prompt_length_.Text("m3_prompt_tokens", "prompt length of each choice that ended well");
    Metric(&out, "m3_prefill_tokens_per_second", "gauge", "prompt tokens per second of recent choices (moving average)",
           prefill_rate_);
    Metric(&out, "m3_decode_tokens_per_second", "gauge",
           "generated tokens per second of recent choices (moving average)", decode_rate_);
  }
  Metric(&out, "m3_requests_accepted_total", "counter", "completion requests accepted", Count(requests));
  Metric(&out, "m3_requests_failed_total", "counter", "choices that ended in an error", Count(failed));
  Metric(&out, "m3_requests_rejected_total", "counter", "requests refused with 429: the queue was full",
         Count(rejected));
  Metric(&out, "m3_requests_cancelled_total", "counter", "requests whose client closed the connection",
         Count(cancelled));
  Metric(&out, "m3_prompt_tokens_total", "counter", "prompt tokens of completed choices", Count(prompt_tokens));
  Metric(&out, "m3_prompt_tokens_cached_total", "counter", "prompt tokens found in a slot's cache",
         Count(cached_tokens));
  Metric(&out, "m3_generated_tokens_total", "counter", "tokens generated", Count(generated_tokens));
  StateText(server, &out);
  return out;
}

void AddMetricsRoute(GuardedServer& http, const std::shared_ptr<Server>& server) {
  http.Get("/metrics", [server](const httplib::Request&, httplib::Response& res) {
    res.set_content(server->metrics.Text(*server), "text/plain; version=0.0.4");
  });
}

}  // namespace m3::cli
