// m3 serve: an OpenAI-compatible HTTP server (cpp-httplib) over one engine and --slots sessions.
// One scheduler thread runs the engine (which uses every core): up to --slots requests generate
// at once, one forward pass per step for all of them (continuous batching: each weight is read
// once per step), with a token for each request that is decoding and chunks of the prompts still
// pending (up to --prefill-chunk tokens a step), so a long new prompt slows the replies under way
// instead of stalling them. Each request goes to the free session whose cached tokens share the
// longest prefix with its prompt (else an unused one, else the least recently used) and reuses
// that prefix, so clients that resend growing conversations pay only for their new tokens.
// Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions
// (both with "stream": true as server-sent events).
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "runtime/chat.h"
#include "runtime/openai.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

struct ServeArgs {
  std::string model, tokenizer, host = "127.0.0.1", name;
  int port = 8080;
  int slots = 1;
  size_t context = 0;
  std::string cache_memory;  // --cache-memory: most bytes all slots' caches may hold ("" = no limit)
  uint64_t cache_budget = 0;  // parsed
  EngineArgs engine_args;
  openai::Defaults defaults;
};

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

// A request between its HTTP thread and the scheduler. The HTTP thread parses and renders it
// (400s go out before any work), the scheduler generates it and hands the deltas and the end
// back under `mu`.
struct Job {
  bool chat = true;
  std::string id, path;
  openai::Request request;
  TurnOptions turn;
  std::vector<int32_t> prompt;
  std::atomic<bool> cancelled{false};  // the client went away: stop at the next step

  std::mutex mu;
  std::condition_variable cv;
  std::vector<TurnDelta> deltas;  // not yet taken by the HTTP thread
  bool finished = false;
  Status status;
  ParsedOutput output;
  GenerateStats stats;

  // The scheduler's own.
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<TurnGeneration> generation;
  size_t slot = 0;
  size_t largest_batch = 0;  // the most sequences one of its decode steps ran with
};

// The model, its text layer, the sessions and the scheduler thread that runs them.
struct Server {
  struct Slot {
    std::unique_ptr<Session> session;
    uint64_t last_used = 0;
    size_t prompt_tokens = 0;  // of its last request
    bool busy = false;         // a request is generating in it
  };
  ServeArgs args;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ChatText> text;
  std::vector<Slot> slots;  // the scheduler's alone once it runs
  uint64_t clock = 0;
  std::atomic<uint64_t> next_id{0};

  std::mutex mu;  // guards queue and stop
  std::condition_variable wake;
  std::deque<std::shared_ptr<Job>> queue;
  bool stop = false;
  std::thread scheduler;

  // A free slot for `prompt`. First one whose conversation the prompt continues: it shares the
  // slot's last prompt but for its last few tokens (the generation prompt, e.g. "<mm:think>",
  // renders differently once the reply is part of the history); the longest such. Else an unused
  // slot, else the least recently used. A conversation that shares only the system prompt and
  // differs in its last user message (>= 6 tokens from the end with this template, "Hi"
  // included) does not continue it: it would evict that conversation's cache.
  size_t PickSlot(const std::vector<int32_t>& prompt) {
    constexpr size_t kRenderSlack = 3;
    Slot* pick = nullptr;
    size_t pick_shared = 0;
    for (Slot& slot : slots) {
      if (slot.busy) continue;
      const auto& cached = slot.session->tokens();
      const size_t shared = static_cast<size_t>(
          std::mismatch(cached.begin(), cached.end(), prompt.begin(), prompt.end()).first - cached.begin());
      if (slot.prompt_tokens > 0 && shared + kRenderSlack >= slot.prompt_tokens && shared > pick_shared) {
        pick = &slot;
        pick_shared = shared;
      }
    }
    for (Slot& slot : slots)
      if (!pick && !slot.busy && slot.prompt_tokens == 0) pick = &slot;
    if (!pick)  // the scheduler admits a request only while a slot is free
      for (Slot& slot : slots)
        if (!slot.busy && (!pick || slot.last_used < pick->last_used)) pick = &slot;
    pick->last_used = ++clock;
    pick->prompt_tokens = prompt.size();
    pick->busy = true;
    return static_cast<size_t>(pick - slots.data());
  }

  std::string NewId() {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%08llx%04llx", static_cast<unsigned long long>(std::time(nullptr)),
                  static_cast<unsigned long long>(next_id++ & 0xFFFF));
    return buf;
  }

  // The turn's prompt ids and options for a parsed request (any thread: the text layer is
  // immutable).
  StatusOr<std::vector<int32_t>> Prepare(const openai::Request& r, const std::string& id, TurnOptions* turn) const {
    turn->raw = !r.chat;
    turn->generate = GenerateOptions{r.max_tokens, text->stop_ids()};
    turn->tool_call_id_prefix = "call_" + id + "_";
    turn->stop_strings = r.stop;
    std::vector<int32_t> ids;
    if (r.chat) {
      M3_ASSIGN_OR_RETURN(ids, text->TurnPrompt(r.messages, r.tools, r.template_options, turn));
    } else {
      ids = text->tokenizer().Encode(r.prompt);
    }
    // Here as well as in Generate, so that a stream refuses it with a 400 before it starts.
    const size_t limit = slots.front().session->max_context();
    if (ids.size() > limit) return OutOfRange("the prompt has ", ids.size(), " tokens but the context limit is ", limit);
    return ids;
  }

  void Submit(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(job));
    }
    wake.notify_one();
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    wake.notify_one();
    if (scheduler.joinable()) scheduler.join();
  }

  // The scheduler: admit queued requests while slots are free, then one step (Step) for every
  // active request together; repeat.
  void Schedule() {
    std::vector<std::shared_ptr<Job>> active;
    for (;;) {
      std::vector<std::shared_ptr<Job>> admitted;
      {
        std::unique_lock<std::mutex> lock(mu);
        wake.wait(lock, [&] { return stop || !queue.empty() || !active.empty(); });
        if (stop) break;
        while (!queue.empty() && active.size() + admitted.size() < slots.size()) {
          admitted.push_back(std::move(queue.front()));
          queue.pop_front();
        }
      }
      for (auto& job : admitted)
        if (Begin(*job)) active.push_back(std::move(job));
      try {
        Step(active);
      } catch (const std::exception& e) {  // e.g. out of memory in a sampler: those requests end
        for (auto& job : active)
          if (!job->finished) End(*job, Status(StatusCode::kInternal, Str("decode step: ", e.what())));
        active.clear();
      }
    }
    std::deque<std::shared_ptr<Job>> waiting;
    {
      std::lock_guard<std::mutex> lock(mu);
      waiting.swap(queue);
    }
    const Status stopping(StatusCode::kInternal, "the server is stopping");
    for (auto& job : active) End(*job, stopping);
    for (auto& job : waiting) End(*job, stopping);
  }

  // Gives a job a free slot and its generation; false (and the job ended) on error. Its prompt
  // runs in the following steps.
  bool Begin(Job& job) {
    try {
      job.slot = PickSlot(job.prompt);
      job.sampler = std::make_unique<Sampler>(job.request.sampling);
      job.generation = std::make_unique<TurnGeneration>(
          *slots[job.slot].session, text->tokenizer(), job.turn, *job.sampler, [&job](const TurnDelta& d) {
            {
              std::lock_guard<std::mutex> lock(job.mu);
              job.deltas.push_back(d);
            }
            job.cv.notify_all();
            return !job.cancelled.load();  // a closed connection stops generation
          });
      if (Status st = job.generation->generation().Begin(job.prompt); !st.ok()) {
        End(job, st);
        return false;
      }
    } catch (const std::exception& e) {
      End(job, Status(StatusCode::kInternal, Str("request ", job.id, ": ", e.what())));
      return false;
    }
    return true;
  }

  // One forward pass for the active jobs: a token for each that is decoding, and chunks of the
  // prompts still pending, in order of arrival, up to one prefill chunk of tokens in all. So a
  // long new prompt delays the replies under way by a chunk per token instead of stalling them
  // until it is done, and their tokens share the chunk's weight reads.
  void Step(std::vector<std::shared_ptr<Job>>& active) {
    size_t budget = slots.front().session->prefill_chunk();
    std::vector<int32_t> decode_ids(active.size());
    std::vector<Generation*> gens;
    std::vector<std::span<const int32_t>> ids;
    std::vector<Job*> stepped;
    std::vector<std::pair<Job*, Status>> ended;
    for (size_t i = 0; i < active.size(); ++i) {
      Job* job = active[i].get();
      Generation& g = job->generation->generation();
      if (job->cancelled) g.Cancel();
      if (g.done()) {
        ended.emplace_back(job, Status::Ok());
      } else if (!g.pending().empty()) {
        if (budget == 0) continue;  // its turn comes in a later step
        const std::span<const int32_t> chunk = g.pending().first(std::min(budget, g.pending().size()));
        budget -= chunk.size();
        gens.push_back(&g);
        ids.push_back(chunk);
        stepped.push_back(job);
      } else if (g.Next(&decode_ids[i])) {
        gens.push_back(&g);
        ids.push_back({&decode_ids[i], 1});
        stepped.push_back(job);
      } else {
        ended.emplace_back(job, Status::Ok());
      }
    }
    if (!gens.empty()) {
      for (Job* job : stepped)  // decoding ones: the sequences their token's pass ran with
        if (job->generation->generation().pending().empty())
          job->largest_batch = std::max(job->largest_batch, gens.size());
      ShareCacheBudget(stepped);
      const std::vector<Status> st = BatchStep(gens, ids);
      for (size_t i = 0; i < gens.size(); ++i) {
        // Out of memory: the caches of idle conversations go first; the step is retried next time
        // (a failed pass changes nothing, and Next gives the same token again).
        if (st[i].code() == StatusCode::kOutOfMemory && ReleaseIdleSlot()) continue;
        if (!st[i].ok()) ended.emplace_back(stepped[i], st[i]);
      }
    }
    for (auto& [job, st] : ended) End(*job, st);
    std::erase_if(active, [](const std::shared_ptr<Job>& j) { return j->finished; });
  }

  // --cache-memory: each stepped session may hold what the other slots leave of the budget.
  void ShareCacheBudget(const std::vector<Job*>& stepped) {
    if (!args.cache_budget) return;
    uint64_t held = 0;
    for (const Slot& slot : slots) held += slot.session->cache().bytes();
    for (Job* job : stepped) {
      Session& s = *slots[job->slot].session;
      const uint64_t others = held - s.cache().bytes();
      s.set_memory_budget(std::max<uint64_t>(1, args.cache_budget > others ? args.cache_budget - others : 1));
    }
  }

  // Frees the caches of the least recently used idle slot that holds any; false when none does.
  bool ReleaseIdleSlot() {
    Slot* victim = nullptr;
    for (Slot& slot : slots)
      if (!slot.busy && slot.session->cache().bytes() > 0 && (!victim || slot.last_used < victim->last_used))
        victim = &slot;
    if (!victim) return false;
    std::fprintf(stderr, "m3 serve: out of cache memory: released an idle conversation of %zu tokens\n",
                 victim->session->position());
    victim->session->Release();
    victim->prompt_tokens = 0;
    return true;
  }

  // Ends a job: frees its slot, finishes its turn (the held text goes out as deltas) and wakes
  // its HTTP thread.
  void End(Job& job, const Status& status) {
    ParsedOutput out;
    GenerateStats st;
    if (job.generation) {
      out = job.generation->Finish(&st);
      slots[job.slot].busy = false;
    }
    Log(job.path.c_str(), status.ok() ? 200 : openai::HttpStatus(status), st, job.largest_batch);
    {
      std::lock_guard<std::mutex> lock(job.mu);
      job.status = status;
      job.output = std::move(out);
      job.stats = st;
      job.finished = true;
    }
    job.cv.notify_all();
  }

  void Log(const char* path, int status, const GenerateStats& st, size_t largest_batch) {
    std::fprintf(stderr,
                 "m3 serve: %s %d | prompt %zu tokens (%zu cached) at %.1f tok/s | %zu generated at %.1f tok/s, in "
                 "batches of up to %zu | %s\n",
                 path, status, st.prompt_tokens, st.reused_tokens, st.prefill_tok_s(), st.generated_tokens,
                 st.decode_tok_s(), largest_batch, st.stop_reason.c_str());
  }
};

void SendError(httplib::Response& res, int status, const std::string& message) {
  res.status = status;
  res.set_content(Dump(openai::ErrorBody(message, status)), "application/json");
}

// POST /v1/chat/completions (chat) and /v1/completions.
void HandleCompletion(const std::shared_ptr<Server>& server, bool chat, const httplib::Request& req,
                      httplib::Response& res) {
  const ojson body = ojson::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return SendError(res, 400, "the request body is not valid JSON");
  auto parsed = chat ? openai::ParseChatRequest(body, server->args.defaults)
                     : openai::ParseCompletionRequest(body, server->args.defaults);
  if (!parsed.ok()) return SendError(res, 400, parsed.status().message());
  auto job = std::make_shared<Job>();
  job->chat = chat;
  job->request = std::move(parsed).value();
  job->id = (chat ? "chatcmpl-" : "cmpl-") + server->NewId();
  job->path = chat ? "/v1/chat/completions" : "/v1/completions";
  auto prompt = server->Prepare(job->request, job->id, &job->turn);
  if (!prompt.ok()) return SendError(res, openai::HttpStatus(prompt.status()), prompt.status().message());
  job->prompt = std::move(prompt).value();
  const int64_t created = std::time(nullptr);
  server->Submit(job);

  if (!job->request.stream) {
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->finished; });
    if (!job->status.ok()) return SendError(res, openai::HttpStatus(job->status), job->status.message());
    const std::string& model = server->args.name;
    res.set_content(Dump(chat ? openai::ChatResponse(job->id, created, model, job->output, job->stats)
                              : openai::CompletionResponse(job->id, created, model, job->output.content, job->stats)),
                    "application/json");
    return;
  }

  // Streamed: the deltas as server-sent events while the scheduler makes them.
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", [server, job, created](size_t, httplib::DataSink& sink) {
    const std::string& model = server->args.name;
    const std::string& id = job->id;
    const bool chat = job->chat;
    auto send = [&](const ojson& j) {
      const std::string event = "data: " + Dump(j) + "\n\n";
      return sink.write(event.data(), event.size());
    };
    size_t tool_index = 0;
    bool client_gone = chat && !send(openai::ChatChunk(id, created, model, {{"role", "assistant"}, {"content", ""}}));
    bool finished = false;
    while (!finished && !client_gone) {
      std::vector<TurnDelta> deltas;
      {
        std::unique_lock<std::mutex> lock(job->mu);
        job->cv.wait(lock, [&] { return job->finished || !job->deltas.empty(); });
        deltas.swap(job->deltas);
        finished = job->finished;
      }
      for (const TurnDelta& d : deltas) {
        client_gone = !(chat ? send(openai::ChatChunk(id, created, model, openai::ChatDelta(d, &tool_index)))
                             : send(openai::CompletionChunk(id, created, model, d.content)));
        if (client_gone) break;
      }
    }
    if (client_gone) {
      job->cancelled = true;  // the scheduler stops it at its next step
      return false;
    }
    if (!job->status.ok()) {
      send(openai::ErrorBody(job->status.message(), openai::HttpStatus(job->status)));
    } else {
      const std::string reason = openai::FinishReason(job->stats, job->output);
      send(chat ? openai::ChatChunk(id, created, model, ojson::object(), reason)
                : openai::CompletionChunk(id, created, model, "", reason));
      if (job->request.include_usage) send(openai::UsageChunk(id, created, model, chat, job->stats));
    }
    static const char kDone[] = "data: [DONE]\n\n";
    sink.write(kDone, sizeof(kDone) - 1);
    sink.done();
    return true;
  });
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
  if (a.defaults.max_tokens < 1) return fail(InvalidArgument("--max-tokens must be at least 1"));
  if (a.slots < 1 || a.slots > 256) return fail(InvalidArgument("--slots must be 1..256, got ", a.slots));
  if (!a.cache_memory.empty()) {
    auto bytes = ParseByteSize(a.cache_memory);
    if (!bytes.ok()) return fail(Status(bytes.status().code(), "--cache-memory: " + bytes.status().message()));
    server->args.cache_budget = *bytes;
  }
  auto engine_options = a.engine_args.Options();
  if (!engine_options.ok()) return fail(engine_options.status());
  SessionOptions session_options;
  session_options.max_context = a.context;
  if (Status s = a.engine_args.Configure(&session_options); !s.ok()) return fail(s);
  auto text = ChatText::Load(a.tokenizer.empty() ? a.model : a.tokenizer, /*require_template=*/false);
  if (!text.ok()) return fail(text.status());
  server->text = std::move(text).value();
  if (!server->text->has_template())
    std::fprintf(stderr, "m3 serve: no chat template in the folder: /v1/chat/completions will refuse requests\n");
  auto engine = Engine::Open(a.model, *engine_options);
  if (!engine.ok()) return fail(engine.status());
  server->engine = std::move(engine).value();
  // Caches grow as contexts do: an idle slot costs only what its conversation holds.
  for (int i = 0; i < a.slots; ++i)
    server->slots.push_back({std::make_unique<Session>(*server->engine, session_options), 0, 0, false});
  const size_t max_context = server->slots.front().session->max_context();
  if (server->args.name.empty())
    server->args.name = std::filesystem::path(a.model).lexically_normal().filename().string();
  if (server->args.name.empty()) server->args.name = "m3";

  server->scheduler = std::thread([server] { server->Schedule(); });

  httplib::Server http;
  http.set_payload_max_length(64 << 20);
  // A thread per request in flight (each streams or waits for its reply), plus a few for the rest.
  const size_t http_threads = static_cast<size_t>(a.slots) + 8;
  http.new_task_queue = [http_threads] { return new httplib::ThreadPool(http_threads); };
  http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  http.Get("/v1/models", [server](const httplib::Request&, httplib::Response& res) {
    const ojson models = {{"object", "list"},
                          {"data",
                           {{{"id", server->args.name},
                             {"object", "model"},
                             {"created", 0},
                             {"owned_by", "m3"},
                             {"max_model_len", server->slots.front().session->max_context()}}}}};
    res.set_content(Dump(models), "application/json");
  });
  http.Post("/v1/chat/completions", [server](const httplib::Request& req, httplib::Response& res) {
    HandleCompletion(server, true, req, res);
  });
  http.Post("/v1/completions", [server](const httplib::Request& req, httplib::Response& res) {
    HandleCompletion(server, false, req, res);
  });
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler's own error
    const std::string what = res.status == 404 ? "no such endpoint: " + req.method + " " + req.path
                                               : "HTTP " + std::to_string(res.status);
    res.set_content(Dump(openai::ErrorBody(what, res.status)), "application/json");
  });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(Dump(openai::ErrorBody(what, 500)), "application/json");
  });

  const int port = a.port == 0 ? http.bind_to_any_port(a.host) : (http.bind_to_port(a.host, a.port) ? a.port : -1);
  if (port < 0) {
    server->Stop();
    return fail(IoError("cannot listen on ", a.host, ":", a.port));
  }
  // The one line a script waits for (stdout, flushed): where the server is.
  std::printf("m3 serve: %s on http://%s:%d (model \"%s\", context %zu tokens, %d slots)\n",
              server->engine->simd_target().c_str(), a.host.c_str(), port, server->args.name.c_str(), max_context,
              a.slots);
  std::fflush(stdout);
  const bool listened = http.listen_after_bind();
  server->Stop();
  if (!listened) return fail(IoError("the server on ", a.host, ":", port, " stopped"));
  return 0;
}

}  // namespace

void AddServeCommand(CLI::App& app, int* rc) {
  auto a = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions "
                                          "(streaming or not), /v1/models, /health");
  cmd->add_option("-m,--model", a->model, "model folder (with tokenizer.json and chat_template.jinja)")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "folder with the tokenizer files, if not the model folder");
  cmd->add_option("--host", a->host, "address to listen on")->default_val("127.0.0.1");
  cmd->add_option("--port", a->port, "port (0: any free one, printed at start)")->default_val(8080);
  cmd->add_option("--name", a->name, "model id reported to clients (default: the model folder's name)");
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
  AddSamplingOptions(cmd, &a->defaults.sampling);
  cmd->callback([a, rc] { *rc = Serve(*a); });
}

}  // namespace m3::cli
