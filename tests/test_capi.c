/* The C API from plain C: open a golden model, evaluate, check errors. Exits non-zero on failure. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "m3/m3.h"

#define EXPECT(cond)                                              \
  do {                                                            \
    if (!(cond)) {                                                \
      fprintf(stderr, "%s:%d: failed: %s (%s)\n", __FILE__, __LINE__, #cond, m3_last_error()); \
      return 1;                                                   \
    }                                                             \
  } while (0)

int main(int argc, char** argv) {
  EXPECT(argc == 2);
  m3_engine* engine = NULL;
  EXPECT(m3_engine_open("/nonexistent/model", NULL, &engine) == M3_ERR_NOT_FOUND);
  EXPECT(engine == NULL);
  EXPECT(strstr(m3_last_error(), "/nonexistent/model") != NULL);

  m3_engine_options opts;
  m3_engine_options_init(&opts);
  EXPECT(opts.numa_mode == M3_NUMA_OFF && opts.mlock_dense == 0);
  EXPECT(opts.kv_cache == M3_CACHE_F32 && opts.index_cache == M3_CACHE_F32);
  opts.kv_cache = 3;
  EXPECT(m3_engine_open(argv[1], &opts, &engine) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(m3_last_error(), "kv_cache") != NULL);
  opts.kv_cache = M3_CACHE_BF16;
  opts.index_cache = -1;
  EXPECT(m3_engine_open(argv[1], &opts, &engine) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(m3_last_error(), "index_cache") != NULL);
  /* A caller built against the layout before the cache fields: they (and the padding where
   * kv_cache now lies) are not read. */
  opts.struct_size = offsetof(m3_engine_options, mlock_dense) + sizeof(int32_t) + 4;
  EXPECT(opts.struct_size <= offsetof(m3_engine_options, index_cache));
  EXPECT(m3_engine_open(argv[1], &opts, &engine) == M3_OK);
  m3_engine_free(engine);
  engine = NULL;
  m3_engine_options_init(&opts);
  opts.numa_mode = 7;
  EXPECT(m3_engine_open(argv[1], &opts, &engine) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(m3_last_error(), "numa_mode") != NULL);
  opts.numa_mode = M3_NUMA_DISTRIBUTE;
  opts.threads = 2;
  EXPECT(m3_engine_open(argv[1], &opts, &engine) == M3_OK);
  EXPECT(strlen(m3_simd_target()) > 0);
  const int32_t vocab = m3_engine_vocab_size(engine);
  EXPECT(vocab > 0);

  m3_session* session = NULL;
  EXPECT(m3_session_new(engine, &session) == M3_OK);
  float* logits = malloc(sizeof(float) * (size_t)vocab);
  const int32_t prompt[] = {110, 454, 294, 36};
  EXPECT(m3_session_eval(session, prompt, 4, logits) == M3_OK);
  EXPECT(m3_session_position(session) == 4);
  int finite = 1;
  for (int32_t i = 0; i < vocab; ++i) finite &= isfinite(logits[i]) != 0;
  EXPECT(finite);

  const int32_t bad[] = {vocab};
  EXPECT(m3_session_eval(session, bad, 1, logits) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(m3_session_position(session) == 4);
  EXPECT(m3_session_rewind(session, 2) == M3_OK);
  EXPECT(m3_session_position(session) == 2);
  EXPECT(m3_session_rewind(session, 9) == M3_ERR_INVALID_ARGUMENT);

  /* Sessions of an engine with bf16 K/V and int8 index keys: close to the f32 logits. */
  m3_engine* small = NULL;
  m3_session* small_session = NULL;
  opts.kv_cache = M3_CACHE_BF16;
  opts.index_cache = M3_CACHE_INT8;
  EXPECT(m3_engine_open(argv[1], &opts, &small) == M3_OK);
  EXPECT(m3_session_new(small, &small_session) == M3_OK);
  float* small_logits = malloc(sizeof(float) * (size_t)vocab);
  EXPECT(m3_session_eval(session, prompt + 2, 2, logits) == M3_OK);
  EXPECT(m3_session_eval(small_session, prompt, 4, small_logits) == M3_OK);
  float worst = 0, largest = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    worst = fmaxf(worst, fabsf(small_logits[i] - logits[i]));
    largest = fmaxf(largest, fabsf(logits[i]));
  }
  printf("capi: bf16 K/V + int8 index keys: worst |logit diff| %g (largest |logit| %g)\n", worst, largest);
  EXPECT(worst > 0 && worst < 0.02f * (1 + largest));
  free(small_logits);
  m3_session_free(small_session);
  m3_engine_free(small);

  free(logits);
  m3_session_free(session);
  m3_engine_free(engine);
  printf("capi: ok\n");
  return 0;
}
