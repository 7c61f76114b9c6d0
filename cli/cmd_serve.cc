// m3 serve: an OpenAI-compatible HTTP server (cpp-httplib) over one engine and --slots sessions.
// Requests run one at a time (the engine uses every core). Each goes to the session whose cached
// tokens share the longest prefix with its prompt (else the least recently used one) and reuses
// that prefix, so clients that resend growing conversations pay only for their new tokens.
// Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions
// (both with "stream": true as server-sent events).
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "runtime/chat.h"
#include "runtime/openai.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;
constexpr auto kReplaceInvalidUtf8 = nlohmann::json::error_handler_t::replace;

struct ServeArgs {
  std::string model, tokenizer, host = "127.0.0.1", name;
  int port = 8080;
  int slots = 1;
  size_t context = 0;
  EngineArgs engine_args;
  openai::Defaults defaults;
};

std::string Dump(const ojson& j) { return j.dump(-1, ' ', false, kReplaceInvalidUtf8); }

// The model, its text layer and the sessions; `mu` serializes the requests that use them.
struct Server {
  struct Slot {
    std::unique_ptr<Session> session;
    uint64_t last_used = 0;
    size_t prompt_tokens = 0;  // of its last request
  };
  ServeArgs args;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ChatText> text;
  std::vector<Slot> slots;
  uint64_t clock = 0;  // under mu
  std::mutex mu;
  std::atomic<uint64_t> next_id{0};

  // The session for `prompt` (under mu). First a slot whose conversation the prompt continues: it
  // shares the slot's last prompt but for its last few tokens (the generation prompt, e.g.
  // "<mm:think>", renders differently once the reply is part of the history); the longest such.
  // Else an unused slot, else the least recently used. A conversation that shares only the system
  // prompt and differs in its last user message (>= 6 tokens from the end with this template,
  // "Hi" included) does not continue it: it would evict that conversation's cache.
  Session& PickSession(const std::vector<int32_t>& prompt) {
    constexpr size_t kRenderSlack = 3;
    Slot* pick = nullptr;
    size_t pick_shared = 0;
    for (Slot& slot : slots) {
      const auto& cached = slot.session->tokens();
      const size_t shared = static_cast<size_t>(
          std::mismatch(cached.begin(), cached.end(), prompt.begin(), prompt.end()).first - cached.begin());
      if (slot.prompt_tokens > 0 && shared + kRenderSlack >= slot.prompt_tokens && shared > pick_shared) {
        pick = &slot;
        pick_shared = shared;
      }
    }
    auto unused = std::find_if(slots.begin(), slots.end(), [](const Slot& s) { return s.prompt_tokens == 0; });
    if (!pick && unused != slots.end()) pick = &*unused;
    if (!pick)
      pick = &*std::min_element(slots.begin(), slots.end(),
                                [](const Slot& x, const Slot& y) { return x.last_used < y.last_used; });
    pick->last_used = ++clock;
    pick->prompt_tokens = prompt.size();
    return *pick->session;
  }

  std::string NewId() {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%08llx%04llx", static_cast<unsigned long long>(std::time(nullptr)),
                  static_cast<unsigned long long>(next_id++ & 0xFFFF));
    return buf;
  }

  // The turn's prompt ids and options for a parsed request.
  StatusOr<std::vector<int32_t>> Prepare(const openai::Request& r, const std::string& id, TurnOptions* turn) {
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

  void Log(const char* path, int status, const GenerateStats& st) {
    std::fprintf(stderr, "m3 serve: %s %d | prompt %zu tokens (%zu cached) at %.1f tok/s | %zu generated at %.1f tok/s | %s\n",
                 path, status, st.prompt_tokens, st.reused_tokens, st.prefill_tok_s(), st.generated_tokens,
                 st.decode_tok_s(), st.stop_reason.c_str());
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
  const auto r = std::make_shared<openai::Request>(std::move(parsed).value());
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + server->NewId();
  const int64_t created = std::time(nullptr);
  const std::string& model = server->args.name;
  const char* path = chat ? "/v1/chat/completions" : "/v1/completions";

  if (!r->stream) {
    std::lock_guard<std::mutex> lock(server->mu);
    TurnOptions turn;
    auto prompt = server->Prepare(*r, id, &turn);
    if (!prompt.ok()) return SendError(res, openai::HttpStatus(prompt.status()), prompt.status().message());
    Sampler sampler(r->sampling);
    GenerateStats st;
    auto out = GenerateTurn(server->PickSession(*prompt), server->text->tokenizer(), *prompt, turn, sampler,
                            [](const TurnDelta&) { return true; }, &st);
    if (!out.ok()) return SendError(res, openai::HttpStatus(out.status()), out.status().message());
    server->Log(path, 200, st);
    res.set_content(Dump(chat ? openai::ChatResponse(id, created, model, *out, st)
                              : openai::CompletionResponse(id, created, model, out->content, st)),
                    "application/json");
    return;
  }

  // Streamed: checked and rendered before the 200 goes out, so that a bad request is still a 400.
  auto turn = std::make_shared<TurnOptions>();
  auto lock = std::make_shared<std::unique_lock<std::mutex>>(server->mu);
  auto prompt = server->Prepare(*r, id, turn.get());
  if (!prompt.ok()) return SendError(res, openai::HttpStatus(prompt.status()), prompt.status().message());
  auto ids = std::make_shared<std::vector<int32_t>>(std::move(prompt).value());
  Session* session = &server->PickSession(*ids);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [server, session, r, turn, lock, ids, id, created, chat, path](size_t, httplib::DataSink& sink) {
        const std::string& model = server->args.name;
        auto send = [&](const ojson& j) {
          const std::string event = "data: " + Dump(j) + "\n\n";
          return sink.write(event.data(), event.size());
        };
        size_t tool_index = 0;
        bool client_gone = false;
        if (chat) client_gone = !send(openai::ChatChunk(id, created, model, {{"role", "assistant"}, {"content", ""}}));
        Sampler sampler(r->sampling);
        GenerateStats st;
        auto on_delta = [&](const TurnDelta& d) {
          if (client_gone) return false;
          client_gone = !(chat ? send(openai::ChatChunk(id, created, model, openai::ChatDelta(d, &tool_index)))
                               : send(openai::CompletionChunk(id, created, model, d.content)));
          return !client_gone;  // a closed connection stops generation
        };
        auto out = GenerateTurn(*session, server->text->tokenizer(), *ids, *turn, sampler, on_delta, &st);
        if (!out.ok()) {
          send(openai::ErrorBody(out.status().message(), openai::HttpStatus(out.status())));
        } else if (!client_gone) {
          const std::string reason = openai::FinishReason(st, *out);
          send(chat ? openai::ChatChunk(id, created, model, ojson::object(), reason)
                    : openai::CompletionChunk(id, created, model, "", reason));
          if (r->include_usage) send(openai::UsageChunk(id, created, model, chat, st));
        }
        server->Log(path, out.ok() ? 200 : openai::HttpStatus(out.status()), st);
        lock->unlock();
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
    server->slots.push_back({std::make_unique<Session>(*server->engine, session_options), 0, 0});
  const size_t max_context = server->slots.front().session->max_context();
  if (server->args.name.empty())
    server->args.name = std::filesystem::path(a.model).lexically_normal().filename().string();
  if (server->args.name.empty()) server->args.name = "m3";

  httplib::Server http;
  http.set_payload_max_length(64 << 20);
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
  if (port < 0) return fail(IoError("cannot listen on ", a.host, ":", a.port));
  // The one line a script waits for (stdout, flushed): where the server is.
  std::printf("m3 serve: %s on http://%s:%d (model \"%s\", context %zu tokens, %d slots)\n",
              server->engine->simd_target().c_str(), a.host.c_str(), port, server->args.name.c_str(), max_context,
              a.slots);
  std::fflush(stdout);
  if (!http.listen_after_bind()) return fail(IoError("the server on ", a.host, ":", port, " stopped"));
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
                  "sessions kept, each with the cache of one conversation: a request goes to the one sharing the "
                  "longest prefix with it (each holds the memory of its context)")
      ->default_val(1);
  cmd->add_option("-n,--max-tokens", a->defaults.max_tokens, "tokens per reply when a request gives no max_tokens")
      ->default_val(512);
  AddSamplingOptions(cmd, &a->defaults.sampling);
  cmd->callback([a, rc] { *rc = Serve(*a); });
}

}  // namespace m3::cli
