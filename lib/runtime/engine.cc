#include "runtime/engine.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <optional>

#include "base/bytes.h"
#include "offload/host_device.h"
#include "platform/memory.h"

namespace m3 {

namespace {

// Whether the engine splits the routed experts over the ranks of options.group (this process being
// rank 0), once the expert-parallel options are checked.
StatusOr<bool> SplitsExperts(const EngineOptions& options) {
  const MoePart& part = options.expert_part;
  const bool gpu = !options.gpu.empty() && options.gpu != "none";
  if (options.dist != "auto" && !options.dist.empty() && options.dist != "none" && options.dist != "mpi")
    return InvalidArgument("--dist takes auto, mpi or none, got '", options.dist, "'");
  if (part.count > 1) {
    if (gpu || options.mlock_dense)
      return InvalidArgument("an expert part runs no dense part: no --gpu, no --mlock-dense");
    return false;
  }
  const bool split = options.dist != "none" && options.group && options.group->size() > 1;
  if (options.dist == "mpi" && !split)
    return InvalidArgument("--dist mpi: this process was not started by mpirun with two or more ranks "
                           "(mpirun -np N m3 ...; docs/DIST.md)");
  if (split && options.group->rank() != 0)
    return Internal("rank ", options.group->rank(), " opens only its expert part: rank 0 runs the command");
  if (split && gpu) return Unsupported("--gpu dense and expert parallelism over MPI do not combine: choose one");
  return split;
}

}  // namespace

int EngineThreads(const EngineOptions& options) {
  const bool ranks =
      options.group && options.group->size() > 1 && (options.dist != "none" || options.expert_part.count > 1);
  return ranks ? cluster::RankThreads(*options.group, options.threads) : ResolveThreadCount(options.threads);
}

StatusOr<std::unique_ptr<Engine>> Engine::Open(const std::string& model_dir, const EngineOptions& options) {
  if (options.threads < 0) return InvalidArgument("threads must be >= 0 (0 = all cores), got ", options.threads);
  std::unique_ptr<Engine> e(new Engine());
  M3_ASSIGN_OR_RETURN(e->kernels_, Kernels::Select(options.kernels));
  M3_ASSIGN_OR_RETURN(const bool distributed, SplitsExperts(options));
  e->expert_part_ = options.expert_part;
  ModelLoadOptions load{.expert_part = options.expert_part};
  if (distributed) {
    // The followers open their parts while this rank opens its own: slice 0 of the experts.
    M3_ASSIGN_OR_RETURN(e->dist_,
                        cluster::ExpertParallel::Start(
                            *options.group, {model_dir, options.threads, NumaModeName(options.numa), options.kernels}));
    load.expert_part = MoePart{0, options.group->size()};
  }
  M3_ASSIGN_OR_RETURN(e->model_, Model::Load(model_dir, load));
  e->threads_.threads = EngineThreads(options);
  if (e->dist_) M3_RETURN_IF_ERROR(e->dist_->Connect(*e->model_));  // every follower opened the same model
  M3_ASSIGN_OR_RETURN(e->placement_, e->model_->Place(options.numa, e->threads_.threads,
                                                      /*dense=*/!e->is_expert_part(), options.simulated_numa_nodes));
  if (e->dist_) e->placement_ += "; " + e->dist_->Describe();
  if (options.mlock_dense) {
    M3_ASSIGN_OR_RETURN(const uint64_t locked, e->model_->LockDenseWeights());
    e->placement_ += ", " + std::to_string(locked >> 20) + " MiB of dense weights locked";
  }
  if (!options.gpu.empty() && options.gpu != "none") {
    if (options.gpu != "dense") return InvalidArgument("--gpu takes dense or none, got '", options.gpu, "'");
    std::unique_ptr<Device> device;
    if (options.gpu_device == "host") {
      device = MakeHostDevice();
    } else if (options.gpu_device == "cuda") {
      M3_ASSIGN_OR_RETURN(device, OpenGpuDevice(options.gpu_ordinal));
    } else {
      return InvalidArgument("the offload device is cuda or host, got '", options.gpu_device, "'");
    }
    const uint64_t max_pos = static_cast<uint64_t>(e->model_->config().max_position_embeddings);
    const uint64_t context = options.gpu_context ? options.gpu_context : std::min<uint64_t>(8192, max_pos);
    M3_ASSIGN_OR_RETURN(e->offload_, e->model_->OffloadDensePart(std::move(device), context));
    e->placement_ += ", dense part on " + e->offload_->device().Describe();
  }
  e->cpu_ = std::make_unique<CpuBackend>(e->model_->pass_shape());
  if (options.verify_weights && e->model_->pack())
    e->verify_ = BackgroundVerify::Start(*e->model_->pack(), BackgroundVerify::StampFolder());
  return e;
}

Status Engine::Forward(const OpContext& tc, std::span<const Model::Segment> segments, LogitsMode mode,
                       float* logits, ForwardObserver* observer) const {
  if (verify_) M3_RETURN_IF_ERROR(verify_->status());
  OpContext ctx = tc;
  ctx.moe_runner = dist_.get();
  Backend& backend = offload_ ? static_cast<Backend&>(*offload_) : *cpu_;
  return model_->ForwardBatch(ctx, backend, segments, mode, logits, observer);
}

Session::Session(const Engine& engine, const SessionOptions& options)
    : engine_(engine),
      cache_(CacheShapeOf(engine.model().config()), options.cache),
      workspace_(std::make_unique<Workspace>()),
      max_context_(options.max_context ? options.max_context
                                       : static_cast<size_t>(engine.model().config().max_position_embeddings)),
      prefill_chunk_(options.prefill_chunk ? options.prefill_chunk : kDefaultPrefillChunk),
      chunk_given_(options.prefill_chunk != 0),
      memory_budget_(options.memory_budget_bytes) {}

size_t Session::ChunkFor(size_t tokens) const {
  if (chunk_given_ || tokens <= prefill_chunk_) return prefill_chunk_;
  return engine_.PromptChunk().tokens;
}

const ChunkChoice& Engine::PromptChunk() const {
  std::call_once(prompt_chunk_once_, [&] {
    ChunkInputs in = ModelChunkInputs(*model_);
    ProbeChunkRates(threads_, kernels_, &in);
    in.memory_available = AvailableMemoryBytes().value_or(0);
    prompt_chunk_ = ChoosePrefillChunk(in, kDefaultPrefillChunk);
  });
  return prompt_chunk_;
}

OpContext Session::Context() const {
  OpContext tc(engine_.threads(), &engine_.kernels(), workspace_.get());
  tc.moe_runner = engine_.moe_runner();
  return tc;
}

namespace {

// The smaller storage types than `t`, as a hint: "bf16 or int8".
std::string SmallerTypes(CacheType t) {
  return t == CacheType::kF32 ? "bf16 or int8" : t == CacheType::kBF16 ? "int8" : "";
}

}  // namespace

Status Session::CheckContextFits(size_t tokens) const {
  if (engine_.offload()) return Status::Ok();  // GPU caches: their allocation says when the GPU is full
  // Shared pages a write copies first are new pages too.
  const uint64_t need = cache_.BytesFor(tokens) + cache_.CopyBytesFor(tokens), held = cache_.bytes();
  if (need <= held) return Status::Ok();  // no new page
  uint64_t can_have = memory_budget_;
  if (!memory_budget_) {
    const std::optional<uint64_t> available = AvailableMemoryBytes();
    if (!available) return Status::Ok();  // unknown (not Linux): the allocation will tell
    can_have = *available + held;
  }
  if (need <= can_have) return Status::Ok();
  const CacheOptions& o = cache_.options();
  const bool index_keys = engine_.model().config().any_sparse();
  std::string types = Str(CacheTypeName(o.kv), " K/V");
  if (index_keys) types += Str(", ", CacheTypeName(o.index_keys), " index keys");
  std::string hint;
  if (o.kv != CacheType::kInt8) hint = "--kv-cache " + SmallerTypes(o.kv);
  if (index_keys && o.index_keys != CacheType::kInt8)
    hint += (hint.empty() ? "" : " and ") + std::string("--index-cache ") + SmallerTypes(o.index_keys);
  return Status(StatusCode::kOutOfMemory,
                Str("a context of ", tokens, " tokens needs ", FormatBytes(need), " of KV cache (", types, "); ",
                    FormatBytes(can_have), memory_budget_ ? " is the memory budget" : " is available",
                    ": use ", hint.empty() ? "" : hint + ", or ", "a shorter context"));
}

Status Session::CheckAppend(std::span<const int32_t> ids) const {
  if (engine_.is_expert_part())
    return Internal("an engine of an expert part computes rank 0's MoE blocks and runs no pass of its own");
  const ModelConfig& c = engine_.model().config();
  if (ids.empty()) return InvalidArgument("no tokens to evaluate");
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab_size)
      return InvalidArgument("token id ", ids[i], " at index ", i, " is outside the vocabulary [0, ", c.vocab_size, ")");
  if (position() + ids.size() > max_context_)
    return OutOfRange(position(), " cached + ", ids.size(), " new tokens exceed the context limit of ", max_context_,
                      " tokens");
  return CheckContextFits(position() + ids.size());
}

namespace {

// Runs `work` (returning Status); when it fails or throws, `undo` first puts the sessions back as
// they were. Out of memory is an error "out of memory <what>", never an exception to the caller.
template <class Work, class Undo>
Status Undoable(const std::string& what, Work&& work, Undo&& undo) {
  try {
    Status st = work();
    if (!st.ok()) undo();
    return st;
  } catch (const std::bad_alloc&) {
    undo();
    return Status(StatusCode::kOutOfMemory, "out of memory " + what);
  } catch (...) {
    undo();
    throw;
  }
}

}  // namespace

Status Session::Eval(std::span<const int32_t> ids, LogitsMode mode, std::vector<float>* logits,
                     ForwardObserver* observer) {
  const ModelConfig& c = engine_.model().config();
  M3_RETURN_IF_ERROR(CheckAppend(ids));
  if (!logits) mode = LogitsMode::kNone;
  const size_t vocab = static_cast<size_t>(c.vocab_size);
  const size_t rows = mode == LogitsMode::kAllRows ? ids.size() : (mode == LogitsMode::kLastRow ? 1 : 0);
  const size_t before = position();
  M3_RETURN_IF_ERROR(Undoable(
      Str("evaluating ", ids.size(), " tokens at position ", before),
      [&] {
        if (logits) logits->resize(rows * vocab);
        if (!engine_.offload()) cache_.Reserve(before + ids.size());  // the whole context before any work
        // Chunks of the prompt in order: each appends its positions to the cache, which the next
        // attends to, so the result is the one of a single pass up to float rounding.
        const size_t chunk = ChunkFor(ids.size());
        for (size_t i = 0; i < ids.size(); i += chunk) {
          const size_t n = std::min(chunk, ids.size() - i);
          const bool last = i + n == ids.size();
          const LogitsMode chunk_mode = mode == LogitsMode::kAllRows || last ? mode : LogitsMode::kNone;
          float* out = mode == LogitsMode::kAllRows ? logits->data() + i * vocab : logits ? logits->data() : nullptr;
          const Model::Segment one{ids.data() + i, n, &cache_};
          M3_RETURN_IF_ERROR(engine_.Forward(Context(), {&one, 1}, chunk_mode, out, observer));
        }
        return Status::Ok();
      },
      [&] {  // a failed call leaves the session as it was
        cache_.Truncate(before);
        tokens_.resize(before);
      }));
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return Status::Ok();
}

Status Session::EvalBatch(std::span<Session* const> sessions, std::span<const std::span<const int32_t>> ids,
                          std::vector<float>* logits, ForwardObserver* observer, std::span<const size_t> logit_rows) {
  if (sessions.empty()) return InvalidArgument("no sessions to evaluate");
  if (ids.size() != sessions.size())
    return InvalidArgument(sessions.size(), " sessions but ", ids.size(), " lists of token ids: one each");
  if (!logit_rows.empty() && logit_rows.size() != sessions.size())
    return InvalidArgument(sessions.size(), " sessions but ", logit_rows.size(), " logit row counts: one each");
  size_t total_rows = 0;
  const Engine& engine = sessions.front()->engine_;
  std::vector<Model::Segment> segments;
  for (size_t i = 0; i < sessions.size(); ++i) {
    Session& s = *sessions[i];
    if (&s.engine_ != &engine) return InvalidArgument("session ", i, " belongs to another engine");
    for (size_t j = 0; j < i; ++j)
      if (sessions[j] == &s) return InvalidArgument("session ", i, " is session ", j, " again");
    if (Status st = s.CheckAppend(ids[i]); !st.ok()) return Status(st.code(), Str("session ", i, ": ", st.message()));
    const size_t rows = logit_rows.empty() ? 1 : logit_rows[i];
    if (rows < 1 || rows > ids[i].size())
      return InvalidArgument("session ", i, ": ", rows, " logit rows asked of its ", ids[i].size(), " tokens");
    segments.push_back({ids[i].data(), ids[i].size(), &s.cache_, rows});
    total_rows += rows;
  }
  M3_RETURN_IF_ERROR(Undoable(
      Str("evaluating ", sessions.size(), " sessions"),
      [&] {
        if (logits) logits->resize(total_rows * static_cast<size_t>(engine.model().config().vocab_size));
        return engine.Forward(sessions.front()->Context(), segments, logits ? LogitsMode::kLastRow : LogitsMode::kNone,
                              logits ? logits->data() : nullptr, observer);
      },
      [&] {
        for (Session* s : sessions) s->cache_.Truncate(s->tokens_.size());
      }));
  for (size_t i = 0; i < sessions.size(); ++i)
    sessions[i]->tokens_.insert(sessions[i]->tokens_.end(), ids[i].begin(), ids[i].end());
  return Status::Ok();
}

Status Session::DecodeBatch(std::span<Session* const> sessions, std::span<const int32_t> ids,
                            std::vector<float>* logits, ForwardObserver* observer) {
  if (ids.size() != sessions.size())
    return InvalidArgument(sessions.size(), " sessions but ", ids.size(), " token ids: one each");
  std::vector<std::span<const int32_t>> one_each;
  for (size_t i = 0; i < ids.size(); ++i) one_each.push_back(ids.subspan(i, 1));
  return EvalBatch(sessions, one_each, logits, observer);
}

Status Session::Rewind(size_t n) {
  if (n > position()) return InvalidArgument("cannot rewind to ", n, ": session holds ", position(), " tokens");
  cache_.Truncate(n);
  tokens_.resize(n);
  return Status::Ok();
}

void Session::Release() {
  cache_.Release();
  tokens_.clear();
  workspace_ = std::make_unique<Workspace>();  // the activations' memory too
}

size_t Session::ReusePrefix(std::span<const int32_t> prompt) {
  size_t keep = 0;
  const size_t limit = std::min(tokens_.size(), prompt.empty() ? 0 : prompt.size() - 1);
  while (keep < limit && tokens_[keep] == prompt[keep]) ++keep;
  cache_.Truncate(keep);
  tokens_.resize(keep);
  if (!prefix_cache_ || prompt.size() <= 1) return keep;
  const std::vector<const std::vector<PageRef>*> pages = prefix_cache_->Lookup(prompt.first(prompt.size() - 1));
  const size_t stored = pages.size() * cache_.page_rows();
  if (stored <= keep) {
    prefix_cache_->CountLookup(0);
    return keep;
  }
  try {
    cache_.AdoptPages(pages);
  } catch (const std::bad_alloc&) {  // a list's bookkeeping: the cache is in no known state
    Release();
    prefix_cache_->CountLookup(0);
    return 0;
  }
  tokens_.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(stored));
  prefix_cache_->CountLookup(stored);
  return stored;
}

Status Session::set_prefix_cache(PrefixCache* store) {
  if (store) {
    if (engine_.offload())
      return Unsupported("prefix sharing needs the caches in host memory; the dense part runs offloaded");
    const CacheOptions& o = cache_.options();
    if (store->page_rows() != cache_.page_rows() || store->options().kv != o.kv ||
        store->options().index_keys != o.index_keys)
      return InvalidArgument("the prefix store keeps pages of ", store->page_rows(), " positions of other storage "
                             "types than this session's caches");
    if (position() > 0 || cache_.bytes() > 0)
      return InvalidArgument("a prefix store is set before the session holds any position");
  }
  prefix_cache_ = store;
  cache_.set_account(store ? store->account() : nullptr);
  return Status::Ok();
}

void Session::PublishPrefix(size_t n) {
  if (prefix_cache_) prefix_cache_->Publish(std::span<const int32_t>(tokens_).first(std::min(n, tokens_.size())), cache_);
}

}  // namespace m3
