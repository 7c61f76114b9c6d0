// Engine (immutable: model weights, thread configuration) and Session (one sequence's caches and
// position). Sessions check every request before it reaches the model.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "cluster/expert_parallel.h"
#include "model/background_verify.h"
#include "model/model.h"
#include "offload/dense_offload.h"
#include "ops/context.h"
#include "ops/cpu_backend.h"
#include "ops/moe_numa.h"
#include "ops/workspace.h"
#include "runtime/prefill_chunk.h"
#include "runtime/prefix_cache.h"

namespace m3 {

struct EngineOptions {
  int threads = 0;                 // 0: all cores; more than the CPUs: capped (ResolveThreadCount)
  NumaMode numa = NumaMode::kOff;  // ops/moe_numa.h
  bool mlock_dense = false;        // lock all weights but the routed experts in memory
  // A packed model's tensor hashes checked in the background on the file's first load on this
  // machine (model/background_verify.h); a damaged tensor then fails every pass by name.
  bool verify_weights = true;
  // The kernels, chosen here once: "" or "auto" for this CPU's best, or one implementation by
  // name (Kernels::Names(): "ref", "avx2", "avx512-vnni", ...) to compare them.
  std::string kernels = "auto";
  // "dense": the dense part of every pass on an accelerator, the routed experts on the CPU
  // (lib/offload, issue 34); "" or "none": all on the CPU.
  std::string gpu = "";
  // The accelerator of --gpu dense: "cuda" (GPU `gpu_ordinal`), or "host", the reference device
  // that runs the same offloaded pass on the CPU (tests; slow).
  std::string gpu_device = "cuda";
  int gpu_ordinal = 0;
  // Tokens of cache the dense part must leave room for on the device when it loads (0: 8192 or
  // the model's maximum if smaller); the caches grow as sessions need and fail clearly when full.
  size_t gpu_context = 0;
  // Expert parallelism (lib/cluster, docs/DIST.md): the MPI job this process belongs to, joined by
  // the program (cluster::Group::JoinIfLaunched); not owned, outlives the engine. Null: alone.
  cluster::Group* group = nullptr;
  // When this process is rank 0 of a group of two or more: "auto" or "" splits the routed experts
  // over the ranks; "mpi" requires that (an error without such a group); "none" runs alone even then.
  std::string dist = "auto";
  // A follower rank's engine (cluster::RunFollower): keeps only slice `index` of `count` of every MoE
  // layer's experts, as views of the mapping (ModelLoadOptions::expert_part), places only those
  // slices (--numa) and runs no pass of its own: rank 0 sends it the MoE blocks to compute. Not
  // with `gpu` or `mlock_dense`. {0, 1}: the whole model.
  MoePart expert_part{};
  // --numa on a simulated topology of this many nodes made of this process's CPUs (the m3 program's
  // M3_FAKE_NUMA; tests); 0: the machine's (platform/numa.h DetectTopology).
  int simulated_numa_nodes = 0;
};

// Threads an engine opened with `options` runs (-t, or under mpirun this node's CPUs shared by its ranks).
int EngineThreads(const EngineOptions& options);

class Engine {
 public:
  static StatusOr<std::unique_ptr<Engine>> Open(const std::string& model_dir, const EngineOptions& options);
  const Model& model() const { return *model_; }
  const ThreadConfig& threads() const { return threads_; }
  const Kernels& kernels() const { return kernels_; }
  // The kernels in words, e.g. "auto: q8/q4 avx512-vnni, bf16 avx512-bf16, fp32 AVX3_ZEN4".
  std::string simd_target() const { return kernels_.Describe(); }
  // How the weights were placed: NUMA mode and topology, bytes locked ("numa off" when off).
  const std::string& placement() const { return placement_; }
  // The offloaded dense part (--gpu dense), or null.
  DenseOffload* offload() const { return offload_.get(); }
  // The expert-parallel ranks (--dist mpi), or null.
  const cluster::ExpertParallel* expert_parallel() const { return dist_.get(); }
  cluster::ExpertParallel* expert_parallel() { return dist_.get(); }
  // What runs the MoE blocks of this engine's passes (OpContext::moe_runner): the expert-parallel
  // ranks, or null (MoeForward in this process).
  const MoeRunner* moe_runner() const { return dist_.get(); }
  // Slice r of N of the experts (EngineOptions::expert_part): a follower's engine, which runs no pass.
  bool is_expert_part() const { return expert_part_.count > 1; }
  // The background check of the weights (EngineOptions::verify_weights), or null: none runs
  // (a checkpoint, a file verified before, or off).
  const BackgroundVerify* weights_check() const { return verify_.get(); }
  // The chunk of long prompts for sessions that were not given one (runtime/prefill_chunk.h):
  // this machine's rates are probed at the first call (~0.1-0.3 s), which a prompt longer than
  // kDefaultPrefillChunk makes.
  const ChunkChoice& PromptChunk() const;
  // One forward pass (Model::ForwardBatch) on the engine's backend: the offloaded dense part
  // when there is one, else the CPU. A tensor the background check found damaged fails it.
  Status Forward(const OpContext& tc, std::span<const Model::Segment> segments, LogitsMode mode, float* logits,
                 ForwardObserver* observer) const;

 private:
  Engine() = default;
  std::unique_ptr<Model> model_;
  ThreadConfig threads_;
  Kernels kernels_;
  std::string placement_;
  std::unique_ptr<CpuBackend> cpu_;
  std::unique_ptr<DenseOffload> offload_;
  std::unique_ptr<cluster::ExpertParallel> dist_;  // before model_ goes: the followers close their part
  std::unique_ptr<BackgroundVerify> verify_;       // before model_ goes: it reads the mapping
  MoePart expert_part_;
  mutable std::once_flag prompt_chunk_once_;
  mutable ChunkChoice prompt_chunk_;
};

struct SessionOptions {
  size_t max_context = 0;  // 0: max_position_embeddings of the model
  CacheOptions cache;      // storage types of the KV and index-key caches
  // Most tokens per forward pass of a prompt. 0: chosen for the model and machine (Engine::
  // PromptChunk) for prompts longer than kDefaultPrefillChunk, which shorter ones take whole.
  // The activations of a pass grow with its tokens (hidden states, q/k/v, MoE buffers), the cache
  // with the whole context.
  size_t prefill_chunk = 0;
  // Most bytes the caches may hold (0: what this process can still get, see CheckContextFits).
  uint64_t memory_budget_bytes = 0;
};

// 2048 tokens: a routed expert sees ~64 of them (top-4 of 128) instead of ~16 with 512, which its
// int8 GEMM runs more efficiently, and a pass's fixed costs (barriers, small serial steps) are
// shared by 4x the tokens: a 2048-token prompt of the 1-layer bench model 4% faster (2 threads,
// Zen 5). Its activations take ~0.75 GB with M3's shapes (512: ~0.19 GB).
inline constexpr size_t kDefaultPrefillChunk = 2048;
// Passes that return every row's logits (scoring) hold a row of logits per token: at most this
// many tokens a pass unless prefill_chunk is smaller (512 rows of M3's vocabulary: 410 MB).
inline constexpr size_t kScoreChunk = 512;

class Session {
 public:
  Session(const Engine& engine, const SessionOptions& options = {});

  // Runs `ids` after the tokens already in the session, in forward passes of at most
  // prefill_chunk tokens. Logits are [n, vocab] (kAllRows) or [vocab] (kLastRow); none when
  // `logits` is null. On error (a bad id, the context limit, memory) nothing is appended and the
  // session is as it was.
  Status Eval(std::span<const int32_t> ids, LogitsMode mode, std::vector<float>* logits,
              ForwardObserver* observer = nullptr);
  // One forward pass over several sessions of one engine (continuous batching: each weight is read
  // once for all of them): ids[i] (one token or more, e.g. a prompt chunk) runs after sessions[i]'s
  // tokens. Logits are [sessions, vocab], each session's last token's, or with `logit_rows` (one
  // per session, 1..ids[i].size()) each session's last logit_rows[i] tokens' in order (none when
  // `logits` is null). Each session is checked as Eval checks it; on error nothing is appended to
  // any of them. The caller keeps each chunk within its prefill_chunk (one pass holds all rows).
  static Status EvalBatch(std::span<Session* const> sessions, std::span<const std::span<const int32_t>> ids,
                          std::vector<float>* logits, ForwardObserver* observer = nullptr,
                          std::span<const size_t> logit_rows = {});
  // EvalBatch of one token per session: a decode step of all of them.
  static Status DecodeBatch(std::span<Session* const> sessions, std::span<const int32_t> ids,
                            std::vector<float>* logits, ForwardObserver* observer = nullptr);
  // Whether the caches of a context of `tokens` positions fit in memory: OutOfMemory, with what
  // they need, what can be had and what to change, when they need more than the memory budget
  // or, without one, than the memory this process can still get (lib/platform/memory.h) plus
  // what the caches already hold. Cheap when the caches need no new page.
  Status CheckContextFits(size_t tokens) const;
  size_t position() const { return cache_.length(); }
  size_t max_context() const { return max_context_; }
  size_t prefill_chunk() const { return prefill_chunk_; }
  // The tokens per pass of a prompt of `tokens` (Eval's chunks): the given prefill_chunk, else
  // the engine's PromptChunk for prompts longer than kDefaultPrefillChunk.
  size_t ChunkFor(size_t tokens) const;
  // Forgets positions >= n (n <= position()).
  Status Rewind(size_t n);
  // Forgets every position and gives the caches' memory back (Rewind keeps it for reuse).
  void Release();
  // Most bytes the caches may hold from now on (0: what the process can still get), e.g. a
  // server's share of a budget for all its sessions.
  void set_memory_budget(uint64_t bytes) { memory_budget_ = bytes; }
  // Keeps the longest cached prefix shared with `prompt`, leaving at least one prompt token to
  // evaluate (its logits are needed), and returns how many tokens were kept. With a prefix store
  // (set_prefix_cache) whose whole pages hold a longer prefix, the session adopts those pages
  // instead (no compute) and counts the lookup there.
  size_t ReusePrefix(std::span<const int32_t> prompt);
  // Shares whole pages of prompt prefixes with the other sessions of `store` (or none: null): its
  // pages are counted in the store's account from now on. Must be set before the session holds
  // any position. Not with an offloading engine: its rows live on the device (DeviceCache), the
  // host pages are never written, so there is nothing to share.
  Status set_prefix_cache(PrefixCache* store);
  // Stores the whole pages of this session's first n tokens (n <= position()) in its prefix store.
  void PublishPrefix(size_t n);
  const std::vector<int32_t>& tokens() const { return tokens_; }  // ids at positions 0..position()-1
  const KvCache& cache() const { return cache_; }
  const Engine& engine() const { return engine_; }

 private:
  // Whether `ids` may follow the session's tokens: ids in the vocabulary, the context limit, memory.
  Status CheckAppend(std::span<const int32_t> ids) const;

  // The context of this session's forward passes: its engine's threads, kernels and MoE runner,
  // its workspace.
  OpContext Context() const;

  const Engine& engine_;
  KvCache cache_;
  std::unique_ptr<Workspace> workspace_;  // activations and operator scratch, reused pass to pass
  std::vector<int32_t> tokens_;
  size_t max_context_;
  size_t prefill_chunk_;
  bool chunk_given_;  // SessionOptions::prefill_chunk was set
  uint64_t memory_budget_;
  PrefixCache* prefix_cache_ = nullptr;
};

}  // namespace m3
