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
  M3_ERR_INTERNAL = 8,
  M3_ERR_UNAVAILABLE = 9 /* transient: the same call may succeed later */
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

typedef enum m3_gpu_mode {
  M3_GPU_NONE = 0, /* everything on the CPU */
  M3_GPU_DENSE = 1 /* the dense part (attention, indexer, shared experts, dense MLPs, lm_head) on a GPU,
                      the routed experts on the CPU; needs a build with CUDA */
} m3_gpu_mode;

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
  /* Read only when struct_size covers both: the GPU offload (M3_GPU_DENSE keeps the caches in GPU
   * memory in f32, so kv_cache and index_cache must then be M3_CACHE_F32). */
  int32_t gpu_mode;   /* m3_gpu_mode; default M3_GPU_NONE */
  int32_t gpu_device; /* which CUDA GPU (0 = the first) */
} m3_engine_options;

void m3_engine_options_init(m3_engine_options* options);

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char* m3_last_error(void);

/* Loads a HuggingFace MiniMax-M3 checkpoint folder. options may be NULL. */
m3_status m3_engine_open(const char* model_dir, const m3_engine_options* options, m3_engine** out_engine);
void m3_engine_free(m3_engine* engine);
int32_t m3_engine_vocab_size(const m3_engine* engine);
/* The kernels this CPU runs by default, in words, e.g. "auto: q8/q4 avx512-vnni, bf16 avx512-bf16,
   fp32 AVX3_ZEN4". */
const char* m3_simd_target(void);

/* A sequence: caches (of the types in the engine's options) and position. The engine must outlive
 * its sessions. */
m3_status m3_session_new(m3_engine* engine, m3_session** out_session);
void m3_session_free(m3_session* session);
/* Appends n tokens and, if logits != NULL, writes the last token's logits [vocab_size]. A long
 * prompt runs in forward passes of at most 2048 tokens. M3_ERR_OUT_OF_MEMORY, with a message saying
 * what the caches need and what is available, when the context would not fit in memory;
 * M3_ERR_CORRUPT, naming the layer, block and position, when a NaN or inf shows in the hidden
 * state or the logits (damaged weights); on any error the session is as it was. */
m3_status m3_session_eval(m3_session* session, const int32_t* ids, size_t n, float* logits);
/* One decode step of n sessions of one engine in a single forward pass (continuous batching: each
 * weight is read once for all of them): ids[i] is appended to sessions[i], and if logits != NULL
 * its logits go to logits[i * vocab_size ...]. Each session's logits equal its own
 * m3_session_eval's up to float rounding. The sessions must be distinct; each is checked as
 * m3_session_eval checks it (the message names the session's index), and on any error none of them
 * changes. */
m3_status m3_decode_batch(m3_session* const* sessions, const int32_t* ids, size_t n, float* logits);
/* Scoring (perplexity, the log-likelihood of a continuation): appends ids[0 .. n-1) to the session
 * and writes log_probs[i] = log P(ids[i + 1] | the session's earlier tokens, ids[0 .. i]) for i in
 * [0, n - 1), in nats, and if is_top1 != NULL is_top1[i] = 1 where ids[i + 1] is the most likely
 * token (else 0). The last id is only a target, not appended. So with a context c and a
 * continuation x: m3_session_eval(c without its last token), then m3_session_score(the last token
 * of c followed by x). Every row that predicts a given id goes through the LM head, in forward
 * passes of at most 512 tokens. n < 2 scores nothing. An id outside the vocabulary is
 * M3_ERR_INVALID_ARGUMENT; on any error the session is as it was. */
m3_status m3_session_score(m3_session* session, const int32_t* ids, size_t n, double* log_probs, int32_t* is_top1);
size_t m3_session_position(const m3_session* session);
/* Forgets every position >= position. */
m3_status m3_session_rewind(m3_session* session, size_t position);

/* ---------------------------------------------------------------------------------------------
 * Generation: sampling over a session.
 * --------------------------------------------------------------------------------------------- */

typedef struct m3_generate_options {
  size_t struct_size;       /* sizeof(m3_generate_options); set by m3_generate_options_init */
  int32_t max_tokens;       /* most tokens to sample (default 512) */
  /* Sampling (defaults: the recommended settings of docs/MODEL.md §6.5). */
  float temperature;        /* default 1.0; 0: greedy (ties to the lower id) */
  int32_t top_k;            /* default 40; 0: off */
  float top_p;              /* default 0.95; 1: off */
  float min_p;              /* default 0: off */
  float repetition_penalty; /* default 1: off */
  float presence_penalty;   /* default 0: off */
  uint64_t seed;            /* default 0; the same seed gives the same tokens */
  /* Ids that end generation; the stop id is counted but not passed on. m3_session_chat adds
   * the end-of-turn ids of the tokenizer to these. */
  const int32_t* stop_ids;
  size_t n_stop_ids;
  /* Speculative decoding by prompt lookup: up to this many tokens guessed per step from an
   * earlier occurrence of the latest 2-4 tokens and verified in the same forward pass (greedy
   * output unchanged, sampling keeps its distribution). Default 0: off. Added after n_stop_ids:
   * read only when struct_size covers it. */
  int32_t lookup_tokens;
  /* Default 0: off; -2..2: logit -= frequency_penalty x the token's count in the output so far
   * (OpenAI's). Added after lookup_tokens: read only when struct_size covers it. */
  float frequency_penalty;
} m3_generate_options;

void m3_generate_options_init(m3_generate_options* options);

typedef enum m3_stop_reason {
  M3_STOP_ID = 0,      /* sampled a stop id */
  M3_STOP_LENGTH = 1,  /* max_tokens */
  M3_STOP_CONTEXT = 2, /* the session's context is full */
  M3_STOP_CALLER = 3   /* the callback asked to stop */
} m3_stop_reason;

typedef struct m3_generate_stats {
  size_t struct_size;       /* the caller sets sizeof(m3_generate_stats); fields beyond it are not written */
  size_t prompt_tokens;     /* the prompt's length */
  size_t reused_tokens;     /* of those, served from the session's cache */
  size_t generated_tokens;  /* sampled tokens, a stop id included */
  double prefill_seconds;
  double decode_seconds;    /* after the first sampled token */
  int32_t stop_reason;      /* m3_stop_reason */
  size_t drafted_tokens;    /* prompt lookup: tokens guessed (written when struct_size covers it) */
  size_t accepted_tokens;   /* of those, the ones generated */
} m3_generate_stats;

/* Called with every sampled id but a stop id; return nonzero to stop. */
typedef int (*m3_token_callback)(int32_t id, void* user_data);

/* Samples a continuation of `prompt`, which is the whole sequence so far: the session keeps the
 * longest prefix it already holds and evaluates only the rest (a multi-turn conversation pays
 * only for its new tokens). callback may be NULL; stats may be NULL. The session ends holding
 * the prompt and the sampled ids that were evaluated. */
m3_status m3_session_generate(m3_session* session, const int32_t* prompt, size_t n,
                              const m3_generate_options* options, m3_token_callback callback, void* user_data,
                              m3_generate_stats* stats);

/* ---------------------------------------------------------------------------------------------
 * Text: the tokenizer and chat template of a folder, and chat turns.
 *
 * Functions that write a variable amount take a capacity and set *length to the full amount
 * they have; when it does not fit they write the first `capacity` elements and return
 * M3_ERR_OUT_OF_RANGE (a NULL buffer with capacity 0 asks for the size). Text is UTF-8 and is
 * NUL-terminated when capacity > length. A tokenizer is immutable: threads may share one.
 * --------------------------------------------------------------------------------------------- */

typedef struct m3_tokenizer m3_tokenizer;

/* Loads tokenizer.json and the chat template (chat_template.jinja, else the chat_template of
 * tokenizer_config.json) of a folder: a HuggingFace model folder, or a packed one (m3 pack copies
 * them). A folder without a template loads; chat calls on it then fail with M3_ERR_NOT_FOUND. */
m3_status m3_tokenizer_open(const char* dir, m3_tokenizer** out_tokenizer);
void m3_tokenizer_free(m3_tokenizer* tokenizer);
size_t m3_tokenizer_vocab_size(const m3_tokenizer* tokenizer);
/* The id of a token given as its string (e.g. "]~b]" or "<mm:think>"), or -1. */
int32_t m3_tokenizer_token_id(const m3_tokenizer* tokenizer, const char* token);

/* Encodes text_len bytes of text (special-token strings become their ids, as HuggingFace does).
 * Every id covers at least one byte of the NFC-normalized text, which Unicode bounds at 3x the
 * input: capacity 3 * text_len always suffices. */
m3_status m3_tokenize(const m3_tokenizer* tokenizer, const char* text, size_t text_len, int32_t* ids,
                      size_t capacity, size_t* n_ids);
/* Decodes ids; with skip_special_tokens nonzero, special tokens are left out. */
m3_status m3_detokenize(const m3_tokenizer* tokenizer, const int32_t* ids, size_t n, int skip_special_tokens,
                        char* text, size_t capacity, size_t* text_len);

/* Renders a chat request through the template, exactly as HuggingFace's apply_chat_template:
 * request_json is {"messages": [...], "tools": [...] (optional), "options": {...} (optional:
 * template variables such as "add_generation_prompt" and "thinking_mode")}, messages in the
 * OpenAI shape with tool-call arguments as objects. A conversation the template refuses gives
 * M3_ERR_INVALID_ARGUMENT with the template's message. */
m3_status m3_chat_render(const m3_tokenizer* tokenizer, const char* request_json, char* text, size_t capacity,
                         size_t* text_len);

typedef enum m3_chat_part {
  M3_PART_REASONING = 0, /* text inside <mm:think> ... </mm:think> */
  M3_PART_CONTENT = 1,   /* the answer's text */
  M3_PART_TOOL_CALL = 2  /* one whole tool call as JSON: {"id", "type": "function", "function":
                          * {"name", "arguments": {...}}} */
} m3_chat_part;

/* Called with each piece of a turn as it is decoded: len bytes of UTF-8 (whole characters; not
 * NUL-terminated). Return nonzero to stop generating: it is then not called again. */
typedef int (*m3_chat_callback)(m3_chat_part part, const char* text, size_t len, void* user_data);

/* One assistant turn. request_json is m3_chat_render's request (add_generation_prompt is set);
 * "tools" also types the tool-call arguments. Or {"prompt": "text"}: a plain completion of the
 * text, all of it content. Either may have "stop": a string or an array of strings; the turn
 * ends at the first of them in the decoded text, which is cut before it (M3_STOP_ID). The rendered prompt is the whole conversation: the session reuses the
 * prefix it holds from the previous turn. The output is split per docs/MODEL.md §6 into reasoning,
 * content and tool calls, streamed to callback (may be NULL), and returned as the assistant
 * message to append to "messages" ({"role": "assistant", "content", "reasoning_content"?,
 * "tool_calls"?}) in *message_json (may be NULL), owned by the session and valid until its next
 * chat call or m3_session_free. options may be NULL (the defaults); stats may be NULL. */
m3_status m3_session_chat(m3_session* session, const m3_tokenizer* tokenizer, const char* request_json,
                          const m3_generate_options* options, m3_chat_callback callback, void* user_data,
                          const char** message_json, m3_generate_stats* stats);

/* ---------------------------------------------------------------------------------------------
 * Continuous batching, as `m3 serve` and `m3 batch` run requests: queued chat requests wait until
 * one of `slots` sessions is free, then every step runs one forward pass for all running ones (a
 * token for each that is decoding, chunks of pending prompts), so each weight is read once per
 * step for all of them. A request goes to the free session holding the longest cached prefix of
 * its conversation. The engine and tokenizer must outlive the scheduler. */
typedef struct m3_scheduler m3_scheduler;
m3_status m3_scheduler_new(m3_engine* engine, const m3_tokenizer* tokenizer, size_t slots,
                           m3_scheduler** out_scheduler);
/* Requests not ended yet end with M3_ERR_INTERNAL (their end callback is called). Not while
 * m3_scheduler_run runs on another thread. */
void m3_scheduler_free(m3_scheduler* scheduler);
/* The end of a request, once: status M3_OK with the assistant message JSON (as m3_session_chat
 * returns it), or an error code with its message; text and stats are valid during the call. */
typedef void (*m3_request_end_callback)(m3_status status, const char* text, const m3_generate_stats* stats,
                                        void* user_data);
/* Queues a request: request_json and options as m3_session_chat takes them. Its parts go to
 * on_part as they are decoded (nonzero stops it), then on_end is called; both from the thread in
 * m3_scheduler_run, and either may be NULL. A malformed request or bad options are an error here,
 * with no callback. Thread-safe. */
m3_status m3_scheduler_submit(m3_scheduler* scheduler, const char* request_json, const m3_generate_options* options,
                              m3_chat_callback on_part, m3_request_end_callback on_end, void* user_data);
/* Runs steps on the calling thread until every queued request has ended. */
m3_status m3_scheduler_run(m3_scheduler* scheduler);
/* Or: runs steps on a thread of its own, as `m3 serve` does, from now until m3_scheduler_free;
 * the callbacks then come from that thread, and m3_scheduler_run is refused. */
m3_status m3_scheduler_start(m3_scheduler* scheduler);

#ifdef __cplusplus
}
#endif

#endif /* M3_M3_H_ */
