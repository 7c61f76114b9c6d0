// Header-only C++ RAII wrappers over m3.h.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
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
  size_t position() const { return m3_session_position(session_.get()); }
  void Rewind(size_t position) { Check(m3_session_rewind(session_.get(), position)); }

 private:
  struct Free {
    void operator()(m3_session* s) const { m3_session_free(s); }
  };
  int vocab_;
  std::unique_ptr<m3_session, Free> session_;
};

}  // namespace m3api
