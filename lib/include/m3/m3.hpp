// Header-only C++ RAII wrappers over m3.h.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "m3/m3.h"

namespace m3api {

class Error : public std::runtime_error {
 public:
  Error(m3_status status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  m3_status status() const { return status_; }

 private:
  m3_status status_;
};

inline void Check(m3_status s) {
  if (s != M3_OK) throw Error(s, m3_last_error());
}

class Engine {
 public:
  explicit Engine(const std::string& model_dir, int threads = 0) : Engine(model_dir, DefaultOptions(threads)) {}
  // options: from DefaultOptions(), then changed (numa_mode, kv_cache, ...).
  Engine(const std::string& model_dir, const m3_engine_options& options) {
    m3_engine* e = nullptr;
    Check(m3_engine_open(model_dir.c_str(), &options, &e));
    engine_.reset(e);
  }
  static m3_engine_options DefaultOptions(int threads = 0) {
    m3_engine_options o;
    m3_engine_options_init(&o);
    o.threads = threads;
    return o;
  }
  m3_engine* get() const { return engine_.get(); }
  int vocab_size() const { return m3_engine_vocab_size(engine_.get()); }

 private:
  struct Free {
    void operator()(m3_engine* e) const { m3_engine_free(e); }
  };
  std::unique_ptr<m3_engine, Free> engine_;
};

class Tokenizer {
 public:
  explicit Tokenizer(const std::string& dir) {
    m3_tokenizer* t = nullptr;
    Check(m3_tokenizer_open(dir.c_str(), &t));
    tokenizer_.reset(t);
  }
  const m3_tokenizer* get() const { return tokenizer_.get(); }
  size_t vocab_size() const { return m3_tokenizer_vocab_size(tokenizer_.get()); }
  int32_t TokenId(const std::string& token) const { return m3_tokenizer_token_id(tokenizer_.get(), token.c_str()); }
  std::vector<int32_t> Encode(std::string_view text) const {
    std::vector<int32_t> ids(3 * text.size());  // always enough (m3.h)
    size_t n = 0;
    Check(m3_tokenize(tokenizer_.get(), text.data(), text.size(), ids.data(), ids.size(), &n));
    ids.resize(n);
    return ids;
  }
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const {
    return Text([&](char* out, size_t cap, size_t* len) {
      return m3_detokenize(tokenizer_.get(), ids.data(), ids.size(), skip_special_tokens, out, cap, len);
    }, 8 * ids.size());
  }
  // request_json: {"messages", "tools"?, "options"?} (m3_chat_render).
  std::string Render(const std::string& request_json) const {
    return Text([&](char* out, size_t cap, size_t* len) {
      return m3_chat_render(tokenizer_.get(), request_json.c_str(), out, cap, len);
    }, 2 * request_json.size() + 4096);
  }

 private:
  // Fills a string of a first guess (most texts fit, so one call), again at the full length the
  // call returned when it did not fit (M3_ERR_OUT_OF_RANGE).
  template <typename F>
  static std::string Text(F&& call, size_t guess) {
    std::string out(guess + 1, '\0');
    size_t len = 0;
    m3_status s = call(out.data(), out.size(), &len);
    if (s == M3_ERR_OUT_OF_RANGE) {
      out.assign(len + 1, '\0');
      s = call(out.data(), out.size(), &len);
    }
    Check(s);
    out.resize(len);
    return out;
  }
  struct Free {
    void operator()(m3_tokenizer* t) const { m3_tokenizer_free(t); }
  };
  std::unique_ptr<m3_tokenizer, Free> tokenizer_;
};

inline m3_generate_options DefaultGenerateOptions() {
  m3_generate_options o;
  m3_generate_options_init(&o);
  return o;
}

class Session {
 public:
  explicit Session(const Engine& engine) : vocab_(engine.vocab_size()) {
    m3_session* s = nullptr;
    Check(m3_session_new(engine.get(), &s));
    session_.reset(s);
  }
  // Appends tokens; returns the last token's logits.
  std::vector<float> Eval(const std::vector<int32_t>& ids) {
    std::vector<float> logits(static_cast<size_t>(vocab_));
    Check(m3_session_eval(session_.get(), ids.data(), ids.size(), logits.data()));
    return logits;
  }
  // Appends ids but the last and returns log P(ids[i + 1] | everything before it), i = 0 .. n-2
  // (m3_session_score).
  std::vector<double> Score(const std::vector<int32_t>& ids) {
    std::vector<double> log_probs(ids.size() > 1 ? ids.size() - 1 : 0);
    Check(m3_session_score(session_.get(), ids.data(), ids.size(), log_probs.data(), nullptr));
    return log_probs;
  }
  m3_session* get() const { return session_.get(); }
  // One decode step of several sessions in one forward pass (m3_decode_batch): ids[i] follows
  // sessions[i]. Returns the logits, [sessions.size() * vocab_size].
  static std::vector<float> DecodeBatch(const std::vector<Session*>& sessions, const std::vector<int32_t>& ids) {
    std::vector<m3_session*> raw;
    for (Session* s : sessions) raw.push_back(s->get());
    std::vector<float> logits(sessions.empty() ? 0 : sessions.size() * static_cast<size_t>(sessions[0]->vocab_));
    if (ids.size() != sessions.size()) throw Error(M3_ERR_INVALID_ARGUMENT, "DecodeBatch: one id per session");
    Check(m3_decode_batch(raw.data(), ids.data(), raw.size(), logits.data()));
    return logits;
  }
  size_t position() const { return m3_session_position(session_.get()); }
  void Rewind(size_t position) { Check(m3_session_rewind(session_.get(), position)); }

  // Samples a continuation of `prompt` (the whole sequence so far); on_token returning false
  // stops. Returns the sampled ids, a stop id not included.
  std::vector<int32_t> Generate(const std::vector<int32_t>& prompt,
                                const m3_generate_options& options = DefaultGenerateOptions(),
                                const std::function<bool(int32_t)>& on_token = nullptr) {
    struct Ctx {
      std::vector<int32_t> ids;
      const std::function<bool(int32_t)>* on_token;
      std::exception_ptr error;
    } ctx{{}, &on_token, nullptr};
    Check(m3_session_generate(session_.get(), prompt.data(), prompt.size(), &options,
                              [](int32_t id, void* user) -> int {
                                auto* c = static_cast<Ctx*>(user);
                                c->ids.push_back(id);
                                return Call(c, [&] { return !*c->on_token || (*c->on_token)(id); });
                              },
                              &ctx, nullptr));
    if (ctx.error) std::rethrow_exception(ctx.error);
    return ctx.ids;
  }

  // One assistant turn of a chat request (m3_session_chat); on_part(part, text) returning false
  // stops. Returns the assistant message as JSON.
  std::string Chat(const Tokenizer& tokenizer, const std::string& request_json,
                   const m3_generate_options& options = DefaultGenerateOptions(),
                   const std::function<bool(m3_chat_part, std::string_view)>& on_part = nullptr) {
    struct Ctx {
      const std::function<bool(m3_chat_part, std::string_view)>* on_part;
      std::exception_ptr error;
    } ctx{&on_part, nullptr};
    const char* message = nullptr;
    Check(m3_session_chat(session_.get(), tokenizer.get(), request_json.c_str(), &options,
                          [](m3_chat_part part, const char* text, size_t len, void* user) -> int {
                            auto* c = static_cast<Ctx*>(user);
                            return Call(c, [&] { return !*c->on_part || (*c->on_part)(part, {text, len}); });
                          },
                          &ctx, &message, nullptr));
    if (ctx.error) std::rethrow_exception(ctx.error);
    return message;
  }

 private:
  // Runs a C++ callback inside a C callback: an exception stops generation and is rethrown
  // after the C call returns, instead of unwinding through it.
  template <typename C, typename F>
  static int Call(C* c, F&& f) {
    if (c->error) return 1;
    try {
      return f() ? 0 : 1;
    } catch (...) {
      c->error = std::current_exception();
      return 1;
    }
  }
  struct Free {
    void operator()(m3_session* s) const { m3_session_free(s); }
  };
  int vocab_;
  std::unique_ptr<m3_session, Free> session_;
};

// Continuous batching over `slots` sessions (m3_scheduler): Submit requests (from any thread),
// then Run steps them all together until every one has ended. An exception thrown in a callback
// stops that request and comes out of Run.
class Scheduler {
 public:
  struct Result {
    m3_status status;
    std::string text;  // the assistant message JSON, or the error message
    m3_generate_stats stats;
  };
  Scheduler(const Engine& engine, const Tokenizer& tokenizer, size_t slots) {
    m3_scheduler* s = nullptr;
    Check(m3_scheduler_new(engine.get(), tokenizer.get(), slots, &s));
    scheduler_.reset(s);
  }
  void Submit(const std::string& request_json, const m3_generate_options& options = DefaultGenerateOptions(),
              std::function<bool(m3_chat_part, std::string_view)> on_part = nullptr,
              std::function<void(const Result&)> on_end = nullptr) {
    auto* r = new Request{std::move(on_part), std::move(on_end), this};
    const m3_status s = m3_scheduler_submit(
        scheduler_.get(), request_json.c_str(), &options,
        [](m3_chat_part part, const char* text, size_t len, void* user) -> int {
          auto* req = static_cast<Request*>(user);
          return req->owner->Guarded([&] { return !req->on_part || req->on_part(part, {text, len}); }) ? 0 : 1;
        },
        [](m3_status status, const char* text, const m3_generate_stats* stats, void* user) {
          std::unique_ptr<Request> req(static_cast<Request*>(user));  // the last call for it
          req->owner->Guarded([&] {
            if (req->on_end) req->on_end(Result{status, text, *stats});
            return true;
          });
        },
        r);
    if (s != M3_OK) delete r;
    Check(s);
  }
  void Run() {
    Check(m3_scheduler_run(scheduler_.get()));
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  struct Request {
    std::function<bool(m3_chat_part, std::string_view)> on_part;
    std::function<void(const Result&)> on_end;
    Scheduler* owner;
  };
  template <typename F>
  bool Guarded(F&& f) {
    try {
      return f();
    } catch (...) {
      if (!error_) error_ = std::current_exception();
      return false;
    }
  }
  struct Free {
    void operator()(m3_scheduler* s) const { m3_scheduler_free(s); }
  };
  std::exception_ptr error_;
  std::unique_ptr<m3_scheduler, Free> scheduler_;
};

}  // namespace m3api
