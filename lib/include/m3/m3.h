/* m3: MiniMax-M3 inference on CPUs. C ABI: opaque handles, status codes, options passed by
 * pointer with a size field so that new fields can be added without breaking callers.
 * Every function is safe to call with the documented inputs; errors never abort the process. */
#ifndef M3_M3_H_
#define M3_M3_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum m3_status {
  M3_OK = 0,
  M3_ERR_INVALID_ARGUMENT = 1,
  M3_ERR_NOT_FOUND = 2,
  M3_ERR_IO = 3,
  M3_ERR_CORRUPT = 4,
  M3_ERR_UNSUPPORTED = 5,
  M3_ERR_OUT_OF_RANGE = 6,
  M3_ERR_OUT_OF_MEMORY = 7,
  M3_ERR_INTERNAL = 8
} m3_status;

typedef struct m3_engine m3_engine;
typedef struct m3_session m3_session;

typedef enum m3_numa_mode {
  M3_NUMA_OFF = 0,        /* threads float */
  M3_NUMA_DISTRIBUTE = 1, /* threads pinned round robin over the nodes */
  M3_NUMA_SPLIT = 2       /* each node computes its slice of every expert from node-local memory */
} m3_numa_mode;

typedef enum m3_cache_type {
  M3_CACHE_F32 = 0,  /* exact */
  M3_CACHE_BF16 = 1, /* half the memory of f32 */
  M3_CACHE_INT8 = 2  /* int8 with one fp32 scale per stored vector: about a quarter */
} m3_cache_type;

typedef struct m3_engine_options {
  size_t struct_size; /* sizeof(m3_engine_options); set by m3_engine_options_init */
  int32_t threads;    /* 0: all cores; more than the process may run on: capped to them */
  /* Fields below were added later; callers built against the first version (struct_size ending
   * after `threads`) get their defaults. */
  int32_t numa_mode;   /* m3_numa_mode; default M3_NUMA_OFF */
  int32_t mlock_dense; /* nonzero: lock all weights but the routed experts in memory */
  /* Storage of the caches of the sessions made by m3_session_new. Read only when struct_size
   * covers both fields (the padding of the previous layout ends where kv_cache starts). */
  int32_t kv_cache;    /* m3_cache_type of the attention K/V cache; default M3_CACHE_F32 */
  int32_t index_cache; /* m3_cache_type of the sparse-attention indexer keys; default M3_CACHE_F32 */
} m3_engine_options;

void m3_engine_options_init(m3_engine_options* options);

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char* m3_last_error(void);

/* Loads a HuggingFace MiniMax-M3 checkpoint folder. options may be NULL. */
m3_status m3_engine_open(const char* model_dir, const m3_engine_options* options, m3_engine** out_engine);
void m3_engine_free(m3_engine* engine);
int32_t m3_engine_vocab_size(const m3_engine* engine);
/* The SIMD target the kernels dispatch to on this CPU, e.g. "AVX3". */
const char* m3_simd_target(void);

/* A sequence: caches (of the types in the engine's options) and position. The engine must outlive
 * its sessions. */
m3_status m3_session_new(m3_engine* engine, m3_session** out_session);
void m3_session_free(m3_session* session);
/* Appends n tokens and, if logits != NULL, writes the last token's logits [vocab_size]. A long
 * prompt runs in forward passes of at most 512 tokens. M3_ERR_OUT_OF_MEMORY, with a message saying
 * what the caches need and what is available, when the context would not fit in memory;
 * M3_ERR_CORRUPT, naming the layer, block and position, when a NaN or inf shows in the hidden
 * state or the logits (damaged weights); on any error the session is as it was. */
m3_status m3_session_eval(m3_session* session, const int32_t* ids, size_t n, float* logits);
size_t m3_session_position(const m3_session* session);
/* Forgets every position >= position. */
m3_status m3_session_rewind(m3_session* session, size_t position);

#ifdef __cplusplus
}
#endif

#endif /* M3_M3_H_ */
