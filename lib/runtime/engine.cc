#include "runtime/engine.h"

#include <algorithm>
#include <new>

#include "kernels.h"

namespace m3 {

StatusOr<std::unique_ptr<Engine>> Engine::Open(const std::string& model_dir, const EngineOptions& options) {
  if (options.threads < 0) return InvalidArgument("threads must be >= 0 (0 = all cores), got ", options.threads);
  std::unique_ptr<Engine> e(new Engine());
  M3_ASSIGN_OR_RETURN(e->model_, Model::Load(model_dir));
  e->threads_.threads = options.threads > 0 ? options.threads : DefaultThreadCount();
  e->placement_ = std::string("numa ") + NumaModeName(options.numa);
  if (options.numa != NumaMode::kOff) {
    M3_ASSIGN_OR_RETURN(const Topology topology, DetectTopology());
    // A node without a thread would leave its slices uncomputed: at most one node per thread.
    const int nodes = std::min(static_cast<int>(topology.nodes.size()), e->threads_.threads);
    if (options.numa == NumaMode::kSplit && nodes > 1)
      M3_RETURN_IF_ERROR(e->model_->PlaceOnNodes(topology, nodes, e->threads_.threads));
    M3_RETURN_IF_ERROR(PinThreads(topology, options.numa, e->threads_.threads, nodes));
    e->placement_ += " over " + std::to_string(nodes) + " of " + topology.Describe();
  }
  if (options.mlock_dense) {
    M3_ASSIGN_OR_RETURN(const uint64_t locked, e->model_->LockDenseWeights());
    e->placement_ += ", " + std::to_string(locked >> 20) + " MiB of dense weights locked";
  }
  return e;
}

std::string Engine::simd_target() const { return simd::ActiveTargetName(); }

Session::Session(const Engine& engine, const SessionOptions& options)
    : engine_(engine),
      cache_(engine.model().config(), options.cache),
      max_context_(options.max_context ? options.max_context
                                       : static_cast<size_t>(engine.model().config().max_position_embeddings)) {}

Status Session::Eval(std::span<const int32_t> ids, LogitsMode mode, std::vector<float>* logits,
                     ForwardObserver* observer) {
  const ModelConfig& c = engine_.model().config();
  if (ids.empty()) return InvalidArgument("no tokens to evaluate");
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab_size)
      return InvalidArgument("token id ", ids[i], " at index ", i, " is outside the vocabulary [0, ", c.vocab_size, ")");
  if (position() + ids.size() > max_context_)
    return OutOfRange(position(), " cached + ", ids.size(), " new tokens exceed the context limit of ", max_context_,
                      " tokens");
  const size_t rows = mode == LogitsMode::kAllRows ? ids.size() : (mode == LogitsMode::kLastRow ? 1 : 0);
  const size_t before = position();
  try {
    if (logits) logits->resize(rows * static_cast<size_t>(c.vocab_size));
    engine_.model().Forward(engine_.threads(), ids.data(), ids.size(), &cache_, mode, logits ? logits->data() : nullptr,
                            observer);
  } catch (const std::bad_alloc&) {
    cache_.Truncate(before);
    tokens_.resize(before);
    return Status(StatusCode::kOutOfMemory, Str("out of memory evaluating ", ids.size(), " tokens at position ", before));
  }
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return Status::Ok();
}

Status Session::Rewind(size_t n) {
  if (n > position()) return InvalidArgument("cannot rewind to ", n, ": session holds ", position(), " tokens");
  cache_.Truncate(n);
  tokens_.resize(n);
  return Status::Ok();
}

size_t Session::ReusePrefix(std::span<const int32_t> prompt) {
  size_t keep = 0;
  const size_t limit = std::min(tokens_.size(), prompt.empty() ? 0 : prompt.size() - 1);
  while (keep < limit && tokens_[keep] == prompt[keep]) ++keep;
  cache_.Truncate(keep);
  tokens_.resize(keep);
  return keep;
}

}  // namespace m3
