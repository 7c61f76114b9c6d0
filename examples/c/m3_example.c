/* An application of the installed m3, in C: greedy tokens of a model from prompt ids, then one
 * streamed chat turn on a model folder with a tokenizer and chat template.
 *
 *   cc m3_example.c $(pkg-config --cflags --libs m3) -o m3_example
 *   ./m3_example MODEL_DIR IDS [STEPS]      e.g. ./m3_example golden/s1_fp32_basic 1,2,3 8
 *   ./m3_example --chat MODEL_DIR "Hello"   prints the reply as it comes, then the message JSON
 *
 * The greedy mode prints the argmax after the prompt and after each of STEPS decode steps, as
 * space-separated ids (a golden case's greedy_ids). Exits 1 with m3's message on any error. */
#include <m3/m3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int Fail(const char* what) {
  fprintf(stderr, "m3_example: %s: %s\n", what, m3_last_error());
  return 1;
}

static int32_t Argmax(const float* logits, int32_t vocab) {
  int32_t best = 0;
  for (int32_t v = 1; v < vocab; ++v)
    if (logits[v] > logits[best]) best = v;
  return best;
}

static int Greedy(const char* model_dir, const char* ids_text, int steps) {
  int32_t ids[4096];
  size_t n = 0;
  for (const char* p = ids_text; *p && n < sizeof(ids) / sizeof(ids[0]);) {
    char* end = NULL;
    long v = strtol(p, &end, 10);
    if (end == p) {
      fprintf(stderr, "m3_example: bad id list: %s\n", ids_text);
      return 1;
    }
    ids[n++] = (int32_t)v;
    p = *end == ',' ? end + 1 : end;
  }
  m3_engine* engine = NULL;
  m3_session* session = NULL;
  if (m3_engine_open(model_dir, NULL, &engine) != M3_OK) return Fail("open");
  int rc = 0;
  float* logits = NULL;
  if (m3_session_new(engine, &session) != M3_OK) {
    rc = Fail("session");
    goto done;
  }
  const int32_t vocab = m3_engine_vocab_size(engine);
  logits = malloc(sizeof(float) * (size_t)vocab);
  if (!logits || m3_session_eval(session, ids, n, logits) != M3_OK) {
    rc = Fail("prefill");
    goto done;
  }
  for (int step = 0; step <= steps; ++step) {
    int32_t next = Argmax(logits, vocab);
    printf(step ? " %d" : "%d", next);
    if (step < steps && m3_session_eval(session, &next, 1, logits) != M3_OK) {
      rc = Fail("decode");
      goto done;
    }
  }
  printf("\n");
done:
  free(logits);
  m3_session_free(session);
  m3_engine_free(engine);
  return rc;
}

static int PrintPart(m3_chat_part part, const char* text, size_t len, void* user) {
  (void)user;
  (void)part; /* reasoning, content or a tool call: all streamed to stderr as they come */
  fprintf(stderr, "%.*s", (int)len, text);
  return 0;
}

static int Chat(const char* model_dir, const char* user_text) {
  /* The request is JSON: the user's text escaped for a JSON string. */
  size_t len = strlen(user_text);
  char* escaped = malloc(6 * len + 1);
  char* request = malloc(6 * len + 256);
  if (!escaped || !request) return 1;
  char* o = escaped;
  for (const unsigned char* p = (const unsigned char*)user_text; *p; ++p) {
    if (*p == '"' || *p == '\\') *o++ = '\\', *o++ = (char)*p;
    else if (*p < 0x20) o += sprintf(o, "\\u%04x", *p);
    else *o++ = (char)*p;
  }
  *o = 0;
  sprintf(request, "{\"messages\": [{\"role\": \"user\", \"content\": \"%s\"}], \"options\": {\"thinking_mode\": \"disabled\"}}",
          escaped);
  m3_engine* engine = NULL;
  m3_session* session = NULL;
  m3_tokenizer* tokenizer = NULL;
  int rc = 0;
  if (m3_engine_open(model_dir, NULL, &engine) != M3_OK || m3_tokenizer_open(model_dir, &tokenizer) != M3_OK ||
      m3_session_new(engine, &session) != M3_OK) {
    rc = Fail("open");
  } else {
    m3_generate_options options;
    m3_generate_options_init(&options);
    options.max_tokens = 16;
    options.seed = 7;
    const char* message = NULL;
    if (m3_session_chat(session, tokenizer, request, &options, PrintPart, NULL, &message, NULL) != M3_OK)
      rc = Fail("chat");
    else
      printf("%s\n", message);
  }
  m3_session_free(session);
  m3_tokenizer_free(tokenizer);
  m3_engine_free(engine);
  free(escaped);
  free(request);
  return rc;
}

int main(int argc, char** argv) {
  if (argc == 4 && strcmp(argv[1], "--chat") == 0) return Chat(argv[2], argv[3]);
  if (argc == 3 || argc == 4) return Greedy(argv[1], argv[2], argc == 4 ? atoi(argv[3]) : 0);
  fprintf(stderr, "usage: %s MODEL_DIR IDS [STEPS] | --chat MODEL_DIR TEXT\n", argv[0]);
  return 2;
}
