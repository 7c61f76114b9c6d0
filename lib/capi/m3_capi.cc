// Implements m3.h: converts Status to m3_status and keeps the message per thread. No logic here.
#include "m3/m3.h"
#include "base/json_guard.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "ops/context.h"
#include "runtime/chat.h"
#include "runtime/engine.h"
#include "runtime/perplexity.h"
#include "runtime/scheduler.h"

struct m3_engine {
  std::unique_ptr<m3::Engine> engine;
  m3::SessionOptions session_options;  // of the sessions made by m3_session_new
};
struct m3_session {
  std::unique_ptr<m3::Session> session;
  std::string message_json;  // the last m3_session_chat's assistant message
};
struct m3_tokenizer {
  std::unique_ptr<m3::ChatText> text;
};
struct m3_scheduler {
  std::unique_ptr<m3::Scheduler> scheduler;
  const m3_tokenizer* tokenizer;
  std::atomic<bool> started{false};  // m3_scheduler_start: its own thread steps
};

namespace {
// The C API's one exception to "no hidden state": m3_last_error() is per calling thread (as errno).
thread_local std::string g_last_error;

m3_status Report(const m3::Status& s) {
  g_last_error = s.ok() ? "" : s.message();
  return static_cast<m3_status>(s.code());
}
m3_status Fail(m3_status code, const char* msg) {
  g_last_error = msg;
  return code;
}
// Runs `body` (returning m3_status), turning exceptions into status codes: none crosses the C ABI.
template <typename F>
m3_status Guard(F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(M3_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& ex) {
    return Fail(M3_ERR_INTERNAL, ex.what());
  }
}

// The variable-size output protocol of m3.h: the full length always, the first `capacity`
// elements, a NUL after text when there is room, and M3_ERR_OUT_OF_RANGE when not all fit.
template <typename T>
m3_status WriteOut(const char* fn, const T* data, size_t n, T* out, size_t capacity, size_t* length, bool text) {
  if (length) *length = n;
  if (out) std::copy_n(data, std::min(n, capacity), out);
  if (n > capacity)
    return Fail(M3_ERR_OUT_OF_RANGE, (std::string(fn) + ": the output needs " + std::to_string(n) +
                                      (text ? " bytes" : " ids") + ", more than the capacity of " +
                                      std::to_string(capacity))
                                         .c_str());
  if (text && out && n < capacity) out[n] = T{};
  return Report(m3::Status::Ok());
}

// Options (NULL: the defaults) as the sampler's and the generate loop's. The first layout ended
// at n_stop_ids, so a smaller struct_size is an error; later fields are read only when struct_size
// covers them (lookup_tokens, frequency_penalty).
m3::Status ReadGenerateOptions(const m3_generate_options* o, m3::SamplingParams* sp, m3::GenerateOptions* go) {
  m3_generate_options d;
  m3_generate_options_init(&d);
  if (o) {
    constexpr size_t kFirstLayout = offsetof(m3_generate_options, n_stop_ids) + sizeof(size_t);
    if (o->struct_size < kFirstLayout)
      return m3::InvalidArgument("options.struct_size too small (call m3_generate_options_init)");
    std::memcpy(&d, o, std::min(o->struct_size, sizeof(d)));
    d.struct_size = sizeof(d);
  }
  if (d.n_stop_ids && !d.stop_ids)
    return m3::InvalidArgument("options.stop_ids is NULL but n_stop_ids is ", d.n_stop_ids);
  *sp = m3::SamplingParams{.temperature = d.temperature, .top_k = d.top_k, .top_p = d.top_p, .min_p = d.min_p,
                           .repetition_penalty = d.repetition_penalty, .presence_penalty = d.presence_penalty,
                           .frequency_penalty = d.frequency_penalty, .seed = d.seed};
  M3_RETURN_IF_ERROR(m3::ValidateSamplingParams(*sp));
  go->max_tokens = d.max_tokens;
  go->stop_ids.assign(d.stop_ids, d.stop_ids + d.n_stop_ids);
  go->lookup.max_draft = d.lookup_tokens;
  return m3::ValidateLookupOptions(go->lookup);
}

// A stats struct must say its size (0 is a caller that forgot: refused before any work).
bool StatsSizeOk(const m3_generate_stats* stats) {
  return !stats || stats->struct_size >= offsetof(m3_generate_stats, prompt_tokens);
}

void WriteStats(const m3::GenerateStats& st, m3_generate_stats* out) {
  if (!out) return;
  m3_generate_stats s{};
  s.struct_size = out->struct_size;
  s.prompt_tokens = st.prompt_tokens;
  s.reused_tokens = st.reused_tokens;
  s.generated_tokens = st.generated_tokens;
  s.prefill_seconds = st.prefill_seconds;
  s.decode_seconds = st.decode_seconds;
  s.drafted_tokens = st.drafted_tokens;
  s.accepted_tokens = st.accepted_tokens;
  s.stop_reason = st.stop_reason == "stop"      ? M3_STOP_ID
                  : st.stop_reason == "context" ? M3_STOP_CONTEXT
                  : st.stop_reason == "caller"  ? M3_STOP_CALLER
                                                : M3_STOP_LENGTH;
  std::memcpy(out, &s, std::min(out->struct_size, sizeof(s)));
}

using ojson = nlohmann::ordered_json;

// A chat request's parts: messages, tools and options, or a raw prompt.
struct ChatRequest {
  ojson messages, tools, options;
  std::optional<std::string> prompt;
  std::vector<std::string> stop;
};

m3::StatusOr<ChatRequest> ParseChatRequest(const char* request_json, bool allow_prompt) {
  M3_ASSIGN_OR_RETURN(ojson req, m3::ParseJson<ojson>(request_json, "the request"));
  if (!req.is_object()) return m3::InvalidArgument("the request must be a JSON object");
  ChatRequest out;
  if (allow_prompt && req.contains("stop")) {
    M3_ASSIGN_OR_RETURN(out.stop, m3::ParseStopStrings(req["stop"]));
  }
  if (allow_prompt && req.contains("prompt")) {
    if (!req["prompt"].is_string()) return m3::InvalidArgument("\"prompt\" must be a string");
    if (req.contains("messages")) return m3::InvalidArgument("the request has both \"prompt\" and \"messages\"");
    out.prompt = req["prompt"].get<std::string>();
    return out;
  }
  if (!req.contains("messages") || !req["messages"].is_array())
    return m3::InvalidArgument(allow_prompt ? "the request needs a \"messages\" array or a \"prompt\" string"
                                            : "the request needs a \"messages\" array");
  out.messages = req["messages"];
  out.tools = req.contains("tools") ? req["tools"] : ojson(nullptr);
  if (!out.tools.is_null() && !out.tools.is_array()) return m3::InvalidArgument("\"tools\" must be an array");
  out.options = req.contains("options") ? req["options"] : ojson::object();
  if (!out.options.is_object()) return m3::InvalidArgument("\"options\" must be an object");
  return out;
}

m3_status Prefixed(const char* fn, const m3::Status& s) {
  return Report(m3::Status(s.code(), std::string(fn) + ": " + s.message()));
}

// A chat request as m3_session_chat and m3_scheduler_submit take it, ready to generate.
struct ChatInputs {
  std::vector<int32_t> prompt;
  m3::TurnOptions turn;
  m3::SamplingParams sampling;
  bool template_error = false;  // the template refused the conversation (its own message)
};

m3::Status PrepareChat(const m3_tokenizer& tokenizer, const char* request_json, const m3_generate_options* options,
                       ChatInputs* in) {
  M3_ASSIGN_OR_RETURN(ChatRequest req, ParseChatRequest(request_json, /*allow_prompt=*/true));
  M3_RETURN_IF_ERROR(ReadGenerateOptions(options, &in->sampling, &in->turn.generate));
  in->turn.stop_strings = req.stop;
  const m3::ChatText& text = *tokenizer.text;
  for (const int32_t id : text.stop_ids()) in->turn.generate.stop_ids.push_back(id);
  if (req.prompt) {
    in->turn.raw = true;
    in->prompt = text.tokenizer().Encode(*req.prompt);
  } else {
    auto ids = text.TurnPrompt(req.messages, req.tools, req.options, &in->turn);
    if (!ids.ok()) {
      in->template_error = true;
      return ids.status();
    }
    in->prompt = std::move(ids).value();
  }
  if (in->prompt.empty()) return m3::InvalidArgument("the prompt is empty");
  return m3::Status::Ok();
}

// The pieces of a turn to a C chat callback (may be NULL); false when it asks to stop.
std::function<bool(const m3::TurnDelta&)> ChatParts(m3_chat_callback callback, void* user_data) {
  return [callback, user_data](const m3::TurnDelta& d) {
    if (!callback) return true;
    auto send = [&](m3_chat_part part, const std::string& text) {
      return text.empty() || callback(part, text.data(), text.size(), user_data) == 0;
    };
    // Once the callback asks to stop, it is called no more (not even for this step's later parts).
    if (!send(M3_PART_REASONING, d.reasoning) || !send(M3_PART_CONTENT, d.content)) return false;
    for (const m3::ToolCall& call : d.tool_calls)
      if (!send(M3_PART_TOOL_CALL, m3::JsonText(m3::ToolCallJson(call)))) return false;
    return true;
  };
}

bool ToCacheType(int32_t value, m3::CacheType* out) {
  switch (value) {
    case M3_CACHE_F32: *out = m3::CacheType::kF32; return true;
    case M3_CACHE_BF16: *out = m3::CacheType::kBF16; return true;
    case M3_CACHE_INT8: *out = m3::CacheType::kInt8; return true;
    default: return false;
  }
}
}  // namespace

extern "C" {

void m3_engine_options_init(m3_engine_options* o) {
  if (!o) return;
  o->struct_size = sizeof(*o);
  o->threads = 0;
  o->numa_mode = M3_NUMA_OFF;
  o->mlock_dense = 0;
  o->kv_cache = M3_CACHE_F32;
  o->index_cache = M3_CACHE_F32;
  o->gpu_mode = M3_GPU_NONE;
  o->gpu_device = 0;
}

const char* m3_last_error(void) { return g_last_error.c_str(); }

m3_status m3_engine_open(const char* model_dir, const m3_engine_options* options, m3_engine** out) {
  if (!model_dir || !out) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_engine_open: model_dir and out_engine are required");
  *out = nullptr;
  m3::EngineOptions eo;
  m3::SessionOptions so;
  if (options) {
    if (options->struct_size < sizeof(size_t) + sizeof(int32_t))
      return Fail(M3_ERR_INVALID_ARGUMENT, "m3_engine_open: options.struct_size too small (call m3_engine_options_init)");
    eo.threads = options->threads;
    if (options->struct_size >= offsetof(m3_engine_options, mlock_dense) + sizeof(int32_t)) {
      switch (options->numa_mode) {
        case M3_NUMA_OFF: eo.numa = m3::NumaMode::kOff; break;
        case M3_NUMA_DISTRIBUTE: eo.numa = m3::NumaMode::kDistribute; break;
        case M3_NUMA_SPLIT: eo.numa = m3::NumaMode::kSplit; break;
        default:
          return Fail(M3_ERR_INVALID_ARGUMENT, "m3_engine_open: options.numa_mode must be M3_NUMA_OFF, "
                                               "M3_NUMA_DISTRIBUTE or M3_NUMA_SPLIT");
      }
      eo.mlock_dense = options->mlock_dense != 0;
    }
    if (options->struct_size >= offsetof(m3_engine_options, index_cache) + sizeof(int32_t)) {
      if (!ToCacheType(options->kv_cache, &so.cache.kv))
        return Fail(M3_ERR_INVALID_ARGUMENT, "m3_engine_open: options.kv_cache must be M3_CACHE_F32, M3_CACHE_BF16 "
                                             "or M3_CACHE_INT8");
      if (!ToCacheType(options->index_cache, &so.cache.index_keys))
        return Fail(M3_ERR_INVALID_ARGUMENT, "m3_engine_open: options.index_cache must be M3_CACHE_F32, "
                                             "M3_CACHE_BF16 or M3_CACHE_INT8");
    }
    if (options->struct_size >= offsetof(m3_engine_options, gpu_device) + sizeof(int32_t)) {
      if (options->gpu_mode != M3_GPU_NONE && options->gpu_mode != M3_GPU_DENSE)
        return Fail(M3_ERR_INVALID_ARGUMENT, "m3_engine_open: options.gpu_mode must be M3_GPU_NONE or M3_GPU_DENSE");
      if (options->gpu_mode == M3_GPU_DENSE) {
        if (so.cache.kv != m3::CacheType::kF32 || so.cache.index_keys != m3::CacheType::kF32)
          return Fail(M3_ERR_INVALID_ARGUMENT, "m3_engine_open: M3_GPU_DENSE keeps the caches on the GPU in f32: "
                                               "kv_cache and index_cache must be M3_CACHE_F32");
        eo.gpu = "dense";
        eo.gpu_ordinal = options->gpu_device;
      }
    }
  }
  try {
    auto e = m3::Engine::Open(model_dir, eo);
    if (!e.ok()) return Report(e.status());
    *out = new m3_engine{std::move(e).value(), so};
    return Report(m3::Status::Ok());
  } catch (const std::bad_alloc&) {
    return Fail(M3_ERR_OUT_OF_MEMORY, "out of memory loading the model");
  } catch (const std::exception& ex) {
    return Fail(M3_ERR_INTERNAL, ex.what());
  }
}

void m3_engine_free(m3_engine* engine) { delete engine; }

int32_t m3_engine_vocab_size(const m3_engine* engine) {
  return engine ? engine->engine->model().config().vocab_size : 0;
}

const char* m3_simd_target(void) {
  static const std::string described = m3::Kernels().Describe();  // this CPU's best, fixed per process
  return described.c_str();
}

m3_status m3_session_new(m3_engine* engine, m3_session** out) {
  if (!engine || !out) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_new: engine and out_session are required");
  try {
    *out = new m3_session{std::make_unique<m3::Session>(*engine->engine, engine->session_options), {}};
  } catch (const std::bad_alloc&) {
    return Fail(M3_ERR_OUT_OF_MEMORY, "out of memory making a session");
  }
  return Report(m3::Status::Ok());
}

void m3_session_free(m3_session* session) { delete session; }

m3_status m3_session_eval(m3_session* session, const int32_t* ids, size_t n, float* logits) {
  if (!session || (!ids && n)) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_eval: session and ids are required");
  try {
    std::vector<float> out;
    m3::Status s = session->session->Eval({ids, n}, logits ? m3::LogitsMode::kLastRow : m3::LogitsMode::kNone,
                                          logits ? &out : nullptr);
    if (s.ok() && logits) std::copy(out.begin(), out.end(), logits);
    return Report(s);
  } catch (const std::bad_alloc&) {
    return Fail(M3_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& ex) {
    return Fail(M3_ERR_INTERNAL, ex.what());
  }
}

m3_status m3_session_score(m3_session* session, const int32_t* ids, size_t n, double* log_probs, int32_t* is_top1) {
  if (!session || (n && !ids) || (n > 1 && !log_probs))
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_score: session, ids and log_probs are required");
  return Guard([&] {
    return Report(m3::ScoreContinuation(*session->session, {ids, n}, [&](size_t i, std::span<const float> logits) {
      const size_t id = static_cast<size_t>(ids[i]);
      log_probs[i - 1] = static_cast<double>(logits[id]) - m3::LogSumExp(logits);
      if (is_top1)  // ties go to the lower id, as greedy sampling's
        is_top1[i - 1] = static_cast<size_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()) == id;
      return true;
    }));
  });
}

m3_status m3_decode_batch(m3_session* const* sessions, const int32_t* ids, size_t n, float* logits) {
  if (!sessions || !ids || n == 0)
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_decode_batch: sessions and ids of at least one session are required");
  return Guard([&] {
    std::vector<m3::Session*> batch;
    for (size_t i = 0; i < n; ++i) {
      if (!sessions[i]) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_decode_batch: a session is NULL");
      batch.push_back(sessions[i]->session.get());
    }
    std::vector<float> out;
    m3::Status s = m3::Session::DecodeBatch(batch, {ids, n}, &out);
    if (s.ok() && logits) std::copy(out.begin(), out.end(), logits);
    return Report(s);
  });
}

size_t m3_session_position(const m3_session* session) { return session ? session->session->position() : 0; }

m3_status m3_session_rewind(m3_session* session, size_t position) {
  if (!session) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_rewind: session is required");
  return Report(session->session->Rewind(position));
}

void m3_generate_options_init(m3_generate_options* o) {
  if (!o) return;
  *o = m3_generate_options{};
  o->struct_size = sizeof(*o);
  o->max_tokens = 512;
  o->temperature = 1.0f;  // docs/MODEL.md §6.5
  o->top_k = 40;
  o->top_p = 0.95f;
  o->repetition_penalty = 1.0f;
}

m3_status m3_session_generate(m3_session* session, const int32_t* prompt, size_t n, const m3_generate_options* options,
                              m3_token_callback callback, void* user_data, m3_generate_stats* stats) {
  if (!session || !prompt || n == 0)
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_generate: session and a non-empty prompt are required");
  if (!StatsSizeOk(stats))
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_generate: stats->struct_size must be sizeof(m3_generate_stats)");
  return Guard([&] {
    m3::SamplingParams sp;
    m3::GenerateOptions go;
    if (m3::Status s = ReadGenerateOptions(options, &sp, &go); !s.ok())
      return Report(m3::Status(s.code(), "m3_session_generate: " + s.message()));
    m3::Sampler sampler(sp);
    m3::GenerateStats st;
    const m3::Status s = m3::Generate(*session->session, {prompt, n}, go, sampler,
                                      [&](int32_t id) { return !callback || callback(id, user_data) == 0; }, &st);
    if (s.ok()) WriteStats(st, stats);
    return Report(s);
  });
}

m3_status m3_tokenizer_open(const char* dir, m3_tokenizer** out) {
  if (!dir || !out) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_tokenizer_open: dir and out_tokenizer are required");
  *out = nullptr;
  return Guard([&] {
    auto text = m3::ChatText::Load(dir, /*require_template=*/false);
    if (!text.ok()) return Report(text.status());
    *out = new m3_tokenizer{std::move(text).value()};
    return Report(m3::Status::Ok());
  });
}

void m3_tokenizer_free(m3_tokenizer* tokenizer) { delete tokenizer; }

size_t m3_tokenizer_vocab_size(const m3_tokenizer* tokenizer) {
  return tokenizer ? tokenizer->text->tokenizer().vocab_size() : 0;
}

int32_t m3_tokenizer_token_id(const m3_tokenizer* tokenizer, const char* token) {
  return tokenizer && token ? tokenizer->text->tokenizer().TokenId(token) : -1;
}

m3_status m3_tokenize(const m3_tokenizer* tokenizer, const char* text, size_t text_len, int32_t* ids, size_t capacity,
                      size_t* n_ids) {
  if (!tokenizer || (!text && text_len) || (!ids && capacity))
    return Fail(M3_ERR_INVALID_ARGUMENT,
                "m3_tokenize: tokenizer, text and an ids buffer of the given capacity are required");
  return Guard([&] {
    const std::vector<int32_t> out = tokenizer->text->tokenizer().Encode({text ? text : "", text_len});
    return WriteOut("m3_tokenize", out.data(), out.size(), ids, capacity, n_ids, false);
  });
}

m3_status m3_detokenize(const m3_tokenizer* tokenizer, const int32_t* ids, size_t n, int skip_special_tokens,
                        char* text, size_t capacity, size_t* text_len) {
  if (!tokenizer || (!ids && n) || (!text && capacity))
    return Fail(M3_ERR_INVALID_ARGUMENT,
                "m3_detokenize: tokenizer, ids and a text buffer of the given capacity are required");
  return Guard([&] {
    const std::string out = tokenizer->text->tokenizer().Decode({ids, n}, skip_special_tokens != 0);
    return WriteOut("m3_detokenize", out.data(), out.size(), text, capacity, text_len, true);
  });
}


m3_status m3_chat_render(const m3_tokenizer* tokenizer, const char* request_json, char* text, size_t capacity,
                         size_t* text_len) {
  if (!tokenizer || !request_json || (!text && capacity))
    return Fail(M3_ERR_INVALID_ARGUMENT,
                "m3_chat_render: tokenizer, request_json and a text buffer of the given capacity are required");
  return Guard([&] {
    auto req = ParseChatRequest(request_json, /*allow_prompt=*/false);
    if (!req.ok()) return Prefixed("m3_chat_render", req.status());
    auto rendered = tokenizer->text->Render(req->messages, req->tools, req->options);
    if (!rendered.ok()) return Report(rendered.status());  // the template's own message, unprefixed
    return WriteOut("m3_chat_render", rendered->data(), rendered->size(), text, capacity, text_len, true);
  });
}

m3_status m3_session_chat(m3_session* session, const m3_tokenizer* tokenizer, const char* request_json,
                          const m3_generate_options* options, m3_chat_callback callback, void* user_data,
                          const char** message_json, m3_generate_stats* stats) {
  if (message_json) *message_json = nullptr;
  if (!session || !tokenizer || !request_json)
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_chat: session, tokenizer and request_json are required");
  if (!StatsSizeOk(stats))
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_chat: stats->struct_size must be sizeof(m3_generate_stats)");
  return Guard([&] {
    ChatInputs in;
    if (m3::Status s = PrepareChat(*tokenizer, request_json, options, &in); !s.ok())
      return s.code() == m3::StatusCode::kInvalidArgument && !in.template_error ? Prefixed("m3_session_chat", s)
                                                                                : Report(s);
    m3::Sampler sampler(in.sampling);
    m3::GenerateStats st;
    auto out = m3::GenerateTurn(*session->session, tokenizer->text->tokenizer(), in.prompt, in.turn, sampler,
                                ChatParts(callback, user_data), &st);
    if (!out.ok()) return Report(out.status());
    session->message_json = m3::JsonText(m3::AssistantMessage(*out));
    if (message_json) *message_json = session->message_json.c_str();
    WriteStats(st, stats);
    return Report(m3::Status::Ok());
  });
}

m3_status m3_scheduler_new(m3_engine* engine, const m3_tokenizer* tokenizer, size_t slots, m3_scheduler** out) {
  if (out) *out = nullptr;
  if (!engine || !tokenizer || !out)
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_scheduler_new: engine, tokenizer and out_scheduler are required");
  if (slots < 1 || slots > 256) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_scheduler_new: slots must be 1..256");
  return Guard([&] {
    m3::SchedulerOptions o;
    o.slots = slots;
    o.session = engine->session_options;
    auto made = std::make_unique<m3_scheduler>();  // nothing leaks if the scheduler throws
    made->scheduler = std::make_unique<m3::Scheduler>(*engine->engine, tokenizer->text->tokenizer(), o);
    made->tokenizer = tokenizer;
    *out = made.release();
    return Report(m3::Status::Ok());
  });
}

void m3_scheduler_free(m3_scheduler* scheduler) { delete scheduler; }

m3_status m3_scheduler_submit(m3_scheduler* scheduler, const char* request_json, const m3_generate_options* options,
                              m3_chat_callback on_part, m3_request_end_callback on_end, void* user_data) {
  if (!scheduler || !request_json)
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_scheduler_submit: scheduler and request_json are required");
  return Guard([&] {
    ChatInputs in;
    if (m3::Status s = PrepareChat(*scheduler->tokenizer, request_json, options, &in); !s.ok())
      return s.code() == m3::StatusCode::kInvalidArgument && !in.template_error ? Prefixed("m3_scheduler_submit", s)
                                                                                : Report(s);
    m3::ScheduledRequest r;
    r.prompt = std::move(in.prompt);
    r.turn = std::move(in.turn);
    r.sampling = in.sampling;
    r.on_delta = ChatParts(on_part, user_data);
    r.on_end = [on_end, user_data](const m3::Status& status, m3::ParsedOutput out, const m3::GenerateStats& st,
                                   size_t) {
      if (!on_end) return;
      m3_generate_stats stats{};
      stats.struct_size = sizeof(stats);
      WriteStats(st, &stats);
      const std::string text = status.ok() ? m3::JsonText(m3::AssistantMessage(out)) : status.message();
      on_end(static_cast<m3_status>(status.code()), text.c_str(), &stats, user_data);
    };
    scheduler->scheduler->Submit(std::move(r));
    return Report(m3::Status::Ok());
  });
}

m3_status m3_scheduler_run(m3_scheduler* scheduler) {
  if (!scheduler) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_scheduler_run: scheduler is required");
  if (scheduler->started)
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_scheduler_run: the scheduler runs on its own thread (m3_scheduler_start)");
  return Guard([&] {
    scheduler->scheduler->RunUntilIdle();
    return Report(m3::Status::Ok());
  });
}

m3_status m3_scheduler_start(m3_scheduler* scheduler) {
  if (!scheduler) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_scheduler_start: scheduler is required");
  if (scheduler->started.exchange(true))
    return Fail(M3_ERR_INVALID_ARGUMENT, "m3_scheduler_start: the scheduler is already started");
  return Guard([&] {
    scheduler->scheduler->Start();
    return Report(m3::Status::Ok());
  });
}

}  // extern "C"
