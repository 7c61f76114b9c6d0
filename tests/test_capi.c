/* The C API from plain C: open a golden model, evaluate, check errors; generate; the tokenizer and a
 * chat turn on a tiny model with the real vocabulary. Exits non-zero on failure.
 * Usage: test_capi_c GOLDEN_CASE_DIR TOKENIZER_DIR REAL_VOCAB_MODEL_DIR */
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

enum { kSteps = 6 };
struct Ids {
  int32_t ids[kSteps];
  int n;
};

static int CollectId(int32_t id, void* user) {
  struct Ids* got = user;
  if (got->n < kSteps) got->ids[got->n++] = id;
  return 0;
}

struct Text {
  char reasoning[4096];
  size_t reasoning_len;
  int parts;
};

static int CollectText(m3_chat_part part, const char* text, size_t len, void* user) {
  struct Text* t = user;
  t->parts++;
  if (part == M3_PART_REASONING && t->reasoning_len + len < sizeof(t->reasoning)) {
    memcpy(t->reasoning + t->reasoning_len, text, len);
    t->reasoning_len += len;
  }
  return 0;
}

/* Greedy ids from m3_session_generate equal an m3_session_eval + argmax loop. */
static int CheckGenerate(m3_engine* engine, int32_t vocab) {
  const int32_t prompt[] = {110, 454, 294, 36, 7};
  m3_session* a = NULL;
  m3_session* b = NULL;
  EXPECT(m3_session_new(engine, &a) == M3_OK && m3_session_new(engine, &b) == M3_OK);
  m3_generate_options o;
  m3_generate_options_init(&o);
  EXPECT(o.max_tokens == 512 && o.temperature == 1.0f && o.top_k == 40);
  o.temperature = 0.0f;
  o.max_tokens = kSteps;
  struct Ids got = {{0}, 0};
  m3_generate_stats st;
  memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  EXPECT(m3_session_generate(a, prompt, 5, &o, CollectId, &got, &st) == M3_OK);
  EXPECT(got.n == kSteps && st.generated_tokens == kSteps && st.stop_reason == M3_STOP_LENGTH);

  float* logits = malloc(sizeof(float) * (size_t)vocab);
  EXPECT(m3_session_eval(b, prompt, 5, logits) == M3_OK);
  for (int i = 0; i < kSteps; ++i) {
    int32_t best = 0;
    for (int32_t v = 1; v < vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    EXPECT(best == got.ids[i]);
    if (i + 1 < kSteps) EXPECT(m3_session_eval(b, &best, 1, logits) == M3_OK);
  }
  free(logits);

  /* Prompt lookup: the same greedy ids, and the stats say what it guessed (whether this tiny
   * model's ids repeat enough to guess is up to it; tests/test_golden.cc checks guesses). A caller
   * built before lookup_tokens existed (a smaller struct_size) gets it off; a negative count is
   * refused. */
  m3_session* c = NULL;
  EXPECT(m3_session_new(engine, &c) == M3_OK);
  const int32_t repeating[] = {110, 454, 294, 110, 454, 294, 110, 454};
  struct Ids plain = {{0}, 0}, guessed = {{0}, 0}, old_layout = {{0}, 0};
  EXPECT(m3_session_generate(a, repeating, 8, &o, CollectId, &plain, &st) == M3_OK);
  o.lookup_tokens = 4;
  memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  st.drafted_tokens = st.accepted_tokens = 12345;
  EXPECT(m3_session_generate(c, repeating, 8, &o, CollectId, &guessed, &st) == M3_OK);
  EXPECT(guessed.n == plain.n && memcmp(guessed.ids, plain.ids, sizeof(int32_t) * (size_t)plain.n) == 0);
  EXPECT(st.drafted_tokens != 12345 && st.accepted_tokens <= st.drafted_tokens);
  o.struct_size = offsetof(m3_generate_options, lookup_tokens);
  st.struct_size = offsetof(m3_generate_stats, drafted_tokens);
  st.drafted_tokens = 12345;
  EXPECT(m3_session_generate(c, repeating, 8, &o, CollectId, &old_layout, &st) == M3_OK);
  EXPECT(old_layout.n == plain.n && st.drafted_tokens == 12345);
  o.struct_size = sizeof(o);
  o.lookup_tokens = -1;
  EXPECT(m3_session_generate(c, repeating, 8, &o, CollectId, &old_layout, NULL) == M3_ERR_INVALID_ARGUMENT);
  o.lookup_tokens = 0;
  /* frequency_penalty: out of -2..2 is refused; a caller built before it existed gets it off
   * (a penalty of 2 would be refused, as the struct below claims not to have the field). */
  o.frequency_penalty = 2.5f;
  EXPECT(m3_session_generate(c, repeating, 8, &o, CollectId, &old_layout, NULL) == M3_ERR_INVALID_ARGUMENT);
  o.struct_size = offsetof(m3_generate_options, frequency_penalty);
  old_layout.n = 0;
  EXPECT(m3_session_generate(c, repeating, 8, &o, CollectId, &old_layout, NULL) == M3_OK);
  o.struct_size = sizeof(o);
  o.frequency_penalty = 0.0f;
  m3_session_free(c);
  m3_session_free(a);
  m3_session_free(b);
  return 0;
}

/* The tokenizer: encode, decode, the size protocol, special tokens. */
static int CheckTokenizer(const char* dir) {
  m3_tokenizer* tok = NULL;
  EXPECT(m3_tokenizer_open("/nonexistent/tokenizer", &tok) == M3_ERR_NOT_FOUND && tok == NULL);
  EXPECT(m3_tokenizer_open(dir, &tok) == M3_OK);
  EXPECT(m3_tokenizer_vocab_size(tok) == 200061);
  EXPECT(m3_tokenizer_token_id(tok, "]~b]") >= 0);
  const char* text = "Hello world";
  int32_t ids[33];
  size_t n = 0;
  EXPECT(m3_tokenize(tok, text, strlen(text), ids, 33, &n) == M3_OK);
  EXPECT(n == 2 && ids[0] == 19739 && ids[1] == 2035); /* golden prose-000 */
  char out[64];
  size_t len = 0;
  EXPECT(m3_detokenize(tok, ids, n, 0, out, sizeof(out), &len) == M3_OK);
  EXPECT(len == strlen(text) && strcmp(out, text) == 0);
  EXPECT(m3_detokenize(tok, ids, n, 0, out, 3, &len) == M3_ERR_OUT_OF_RANGE && len == strlen(text));
  const char* request = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
                        "\"options\": {\"add_generation_prompt\": true}}";
  EXPECT(m3_chat_render(tok, request, NULL, 0, &len) == M3_ERR_OUT_OF_RANGE);
  char* rendered = malloc(len + 1);
  EXPECT(m3_chat_render(tok, request, rendered, len + 1, &len) == M3_OK);
  EXPECT(strlen(rendered) == len && strstr(rendered, "]~b]ai\n") != NULL);
  free(rendered);
  m3_tokenizer_free(tok);
  return 0;
}

/* One chat turn with thinking enabled: the pieces arrive through the callback and add up to the
 * returned assistant message's text. */
static int StopAtFirstPart(m3_chat_part part, const char* text, size_t len, void* user) {
  (void)part, (void)text, (void)len;
  ++*(int*)user;
  return 1;
}

static int CheckChat(const char* model_dir) {
  m3_engine* engine = NULL;
  m3_tokenizer* tok = NULL;
  m3_session* session = NULL;
  m3_engine_options eo;
  m3_engine_options_init(&eo);
  eo.threads = 2;
  EXPECT(m3_engine_open(model_dir, &eo, &engine) == M3_OK);
  EXPECT(m3_tokenizer_open(model_dir, &tok) == M3_OK);
  EXPECT(m3_session_new(engine, &session) == M3_OK);
  m3_generate_options o;
  m3_generate_options_init(&o);
  o.max_tokens = 16;
  o.seed = 3;
  struct Text text;
  memset(&text, 0, sizeof(text));
  const char* message = NULL;
  m3_generate_stats st;
  memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  const char* request = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello! Who are you?\"}], "
                        "\"options\": {\"thinking_mode\": \"enabled\"}}";
  EXPECT(m3_session_chat(session, tok, request, &o, CollectText, &text, &message, &st) == M3_OK);
  EXPECT(message != NULL && strstr(message, "\"role\":\"assistant\"") != NULL);
  EXPECT(text.parts > 0 && text.reasoning_len > 0);
  text.reasoning[text.reasoning_len] = '\0';
  EXPECT(strstr(message, "\"reasoning_content\"") != NULL);
  EXPECT(st.generated_tokens > 0 && st.generated_tokens <= 16 && st.prompt_tokens > 100);
  printf("capi: chat turn of %zu tokens after a %zu-token prompt: %zu bytes of reasoning\n", st.generated_tokens,
         st.prompt_tokens, text.reasoning_len);
  /* A callback that asks to stop is not called again, and the turn ends there. */
  int calls = 0;
  EXPECT(m3_session_chat(session, tok, request, &o, StopAtFirstPart, &calls, &message, &st) == M3_OK);
  EXPECT(calls == 1 && st.stop_reason == M3_STOP_CALLER);
  EXPECT(m3_session_chat(session, tok, "{\"messages\": 1}", &o, NULL, NULL, &message, NULL) ==
         M3_ERR_INVALID_ARGUMENT);
  EXPECT(message == NULL && strstr(m3_last_error(), "messages") != NULL);
  m3_session_free(session);
  m3_tokenizer_free(tok);
  m3_engine_free(engine);
  return 0;
}

/* m3_decode_batch: two sessions in one step give the logits of each alone; a bad batch changes
 * no session. */
static int CheckDecodeBatch(m3_engine* engine, int32_t vocab) {
  const int32_t prompt_a[] = {110, 454, 294, 36, 7}, prompt_b[] = {5, 17, 401};
  m3_session *a = NULL, *b = NULL, *alone_a = NULL, *alone_b = NULL;
  EXPECT(m3_session_new(engine, &a) == M3_OK && m3_session_new(engine, &b) == M3_OK);
  EXPECT(m3_session_new(engine, &alone_a) == M3_OK && m3_session_new(engine, &alone_b) == M3_OK);
  EXPECT(m3_session_eval(a, prompt_a, 5, NULL) == M3_OK && m3_session_eval(alone_a, prompt_a, 5, NULL) == M3_OK);
  EXPECT(m3_session_eval(b, prompt_b, 3, NULL) == M3_OK && m3_session_eval(alone_b, prompt_b, 3, NULL) == M3_OK);
  float* batch = malloc(sizeof(float) * 2 * (size_t)vocab);
  float* one = malloc(sizeof(float) * (size_t)vocab);
  m3_session* both[] = {a, b};
  const int32_t next[] = {42, 9};
  EXPECT(m3_decode_batch(both, next, 2, batch) == M3_OK);
  EXPECT(m3_session_position(a) == 6 && m3_session_position(b) == 4);
  EXPECT(m3_session_eval(alone_a, &next[0], 1, one) == M3_OK);
  for (int32_t v = 0; v < vocab; ++v) EXPECT(fabsf(batch[v] - one[v]) <= 1e-5f * (1.0f + fabsf(one[v])));
  EXPECT(m3_session_eval(alone_b, &next[1], 1, one) == M3_OK);
  for (int32_t v = 0; v < vocab; ++v) EXPECT(fabsf(batch[vocab + v] - one[v]) <= 1e-5f * (1.0f + fabsf(one[v])));
  m3_session* twice[] = {a, a};
  EXPECT(m3_decode_batch(twice, next, 2, batch) == M3_ERR_INVALID_ARGUMENT);
  const int32_t bad[] = {3, -1};
  EXPECT(m3_decode_batch(both, bad, 2, batch) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(m3_last_error(), "session 1") != NULL);
  EXPECT(m3_decode_batch(both, next, 0, batch) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(m3_session_position(a) == 6 && m3_session_position(b) == 4);
  EXPECT(m3_decode_batch(both, next, 2, NULL) == M3_OK);
  EXPECT(m3_session_position(a) == 7 && m3_session_position(b) == 5);
  free(batch);
  free(one);
  m3_session_free(a);
  m3_session_free(b);
  m3_session_free(alone_a);
  m3_session_free(alone_b);
  return 0;
}

/* log softmax(logits)[id] in double. */
static double LogProb(const float* logits, int32_t vocab, int32_t id) {
  double m = logits[0], z = 0;
  for (int32_t v = 1; v < vocab; ++v) m = fmax(m, logits[v]);
  for (int32_t v = 0; v < vocab; ++v) z += exp((double)logits[v] - m);
  return (double)logits[id] - m - log(z);
}

/* m3_session_score: every token's log-probability equals the one from m3_session_eval's last row
 * after its prefix; a continuation after a context scores the same; bad input changes nothing. */
static int CheckScore(m3_engine* engine, int32_t vocab) {
  enum { kN = 7 };
  const int32_t seq[kN] = {110, 454, 294, 36, 7, 454, 12};
  double lp[kN - 1], cont[kN - 1];
  int32_t top1[kN - 1];
  m3_session* s = NULL;
  m3_session* r = NULL;
  EXPECT(m3_session_new(engine, &s) == M3_OK && m3_session_new(engine, &r) == M3_OK);
  EXPECT(m3_session_score(s, seq, kN, lp, top1) == M3_OK);
  EXPECT(m3_session_position(s) == kN - 1); /* the last id is only a target */
  float* logits = malloc(sizeof(float) * (size_t)vocab);
  for (int i = 0; i + 1 < kN; ++i) {
    EXPECT(m3_session_eval(r, seq + i, 1, logits) == M3_OK);
    EXPECT(fabs(lp[i] - LogProb(logits, vocab, seq[i + 1])) < 1e-4 * (1 + fabs(lp[i])));
    EXPECT(lp[i] < 0);
    int32_t best = 0;
    for (int32_t v = 1; v < vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    EXPECT(top1[i] == (best == seq[i + 1]));
  }
  free(logits);
  /* A context of 3 tokens, then the continuation: the eval takes the context without its last token. */
  EXPECT(m3_session_rewind(s, 0) == M3_OK);
  EXPECT(m3_session_eval(s, seq, 2, NULL) == M3_OK);
  EXPECT(m3_session_score(s, seq + 2, kN - 2, cont, NULL) == M3_OK);
  for (int j = 0; j + 3 < kN; ++j) EXPECT(fabs(cont[j] - lp[2 + j]) < 1e-5 * (1 + fabs(lp[2 + j])));
  EXPECT(m3_session_position(s) == kN - 1);
  /* Bad input: an out-of-vocabulary target, no output buffer; one id scores nothing. */
  const int32_t bad[] = {110, 454, vocab};
  EXPECT(m3_session_score(s, bad, 3, lp, NULL) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(m3_last_error(), "outside the vocabulary") != NULL);
  EXPECT(m3_session_score(s, seq, 3, NULL, NULL) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(m3_session_score(s, seq, 1, NULL, NULL) == M3_OK);
  EXPECT(m3_session_position(s) == kN - 1);
  m3_session_free(s);
  m3_session_free(r);
  return 0;
}

int main(int argc, char** argv) {
  EXPECT(argc == 4);
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
  /* The GPU offload: a bad mode, or one with caches it cannot hold, is refused by name; a build
   * or machine without a GPU says so (where there is one, the engine opens and evaluates). */
  m3_engine_options_init(&opts);
  EXPECT(opts.gpu_mode == M3_GPU_NONE && opts.gpu_device == 0);
  opts.gpu_mode = 9;
  EXPECT(m3_engine_open(argv[1], &opts, &engine) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(m3_last_error(), "gpu_mode") != NULL);
  opts.gpu_mode = M3_GPU_DENSE;
  opts.kv_cache = M3_CACHE_BF16;
  EXPECT(m3_engine_open(argv[1], &opts, &engine) == M3_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(m3_last_error(), "M3_CACHE_F32") != NULL);
  opts.kv_cache = M3_CACHE_F32;
  const m3_status gpu_status = m3_engine_open(argv[1], &opts, &engine);
  if (gpu_status == M3_OK) {
    m3_session* gpu_session = NULL;
    EXPECT(m3_session_new(engine, &gpu_session) == M3_OK);
    float* gpu_logits = malloc(sizeof(float) * (size_t)m3_engine_vocab_size(engine));
    const int32_t gpu_prompt[] = {110, 454, 294, 36};
    EXPECT(m3_session_eval(gpu_session, gpu_prompt, 4, gpu_logits) == M3_OK);
    EXPECT(isfinite(gpu_logits[0]));
    free(gpu_logits);
    m3_session_free(gpu_session);
    m3_engine_free(engine);
    engine = NULL;
  } else {
    EXPECT(gpu_status == M3_ERR_UNSUPPORTED || gpu_status == M3_ERR_NOT_FOUND);
    EXPECT(strstr(m3_last_error(), "CUDA") != NULL);
    EXPECT(engine == NULL);
  }
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

  EXPECT(CheckGenerate(engine, vocab) == 0);
  EXPECT(CheckDecodeBatch(engine, vocab) == 0);
  EXPECT(CheckScore(engine, vocab) == 0);

  free(logits);
  m3_session_free(session);
  m3_engine_free(engine);
  EXPECT(CheckTokenizer(argv[2]) == 0);
  EXPECT(CheckChat(argv[3]) == 0);
  printf("capi: ok\n");
  return 0;
}
