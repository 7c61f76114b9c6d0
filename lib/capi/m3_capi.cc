// Implements m3.h: converts Status to m3_status and keeps the message per thread. No logic here.
#include "m3/m3.h"

#include <cstddef>
#include <exception>
#include <string>

#include "kernels.h"
#include "runtime/engine.h"

struct m3_engine {
  std::unique_ptr<m3::Engine> engine;
  m3::SessionOptions session_options;  // of the sessions made by m3_session_new
};
struct m3_session {
  std::unique_ptr<m3::Session> session;
};

namespace {
thread_local std::string g_last_error;
thread_local std::string g_target;

m3_status Report(const m3::Status& s) {
  g_last_error = s.ok() ? "" : s.message();
  return static_cast<m3_status>(s.code());
}
m3_status Fail(m3_status code, const char* msg) {
  g_last_error = msg;
  return code;
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
  g_target = m3::simd::ActiveTargetName();
  return g_target.c_str();
}

m3_status m3_session_new(m3_engine* engine, m3_session** out) {
  if (!engine || !out) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_new: engine and out_session are required");
  try {
    *out = new m3_session{std::make_unique<m3::Session>(*engine->engine, engine->session_options)};
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

size_t m3_session_position(const m3_session* session) { return session ? session->session->position() : 0; }

m3_status m3_session_rewind(m3_session* session, size_t position) {
  if (!session) return Fail(M3_ERR_INVALID_ARGUMENT, "m3_session_rewind: session is required");
  return Report(session->session->Rewind(position));
}

}  // extern "C"
