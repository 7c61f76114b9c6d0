// The MiniMax-M3 text backbone: config + bound weights + the forward pass.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"
#include "format/pack_file.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "ops/kv_cache.h"
#include "model/weights.h"
#include "offload/dense_offload.h"
#include "ops/backend.h"
#include "ops/attention.h"
#include "ops/moe.h"
#include "ops/norm_rope.h"
#include "platform/numa.h"
#include "platform/parallel.h"

namespace m3 {

enum class LogitsMode { kNone, kLastRow, kAllRows };

// Optional hooks into a forward pass (inspection and tests).
// What a forward pass does, as it goes. An observer that sees rows (the default: selections and
// routing of every row) makes the pass compute the last layer's rows that give no logits too,
// which without one need only their keys and values; one that only times the layers says so.
class ForwardObserver {
 public:
  virtual ~ForwardObserver() = default;
  virtual bool SeesEveryRow() const { return true; }
  // Layer `layer`'s attention block is done (its MLP or MoE block follows).
  virtual void OnAttentionEnd(int layer) {}
  // Layer `layer` is done (its rows' residual stream complete), `rows` of them.
  virtual void OnLayerEnd(int layer, size_t rows) {}
  // Blocks chosen for queries at positions pos0..pos0+n-1 of a sparse layer.
  virtual void OnBlockSelection(int layer, int64_t pos0, const BlockSelection& selection) {}
  // Experts chosen: ids [n, top_k].
  virtual void OnRouting(int layer, int64_t pos0, size_t n, int top_k, const int32_t* ids) {}
  // Sees the input of every matmul of the pass on the CPU (OpContext::matmul_observer), or null.
  virtual MatMulObserver* matmul_observer() { return nullptr; }
};

// Keeps every block selection: layers[layer][position][index head] = ascending block ids.
struct SelectionRecorder : ForwardObserver {
  std::map<int, std::vector<std::vector<std::vector<int32_t>>>> layers;
  void OnBlockSelection(int layer, int64_t pos0, const BlockSelection& sel) override {
    auto& rows = layers[layer];
    const size_t n = sel.counts.size() / static_cast<size_t>(sel.num_index_heads);
    rows.resize(static_cast<size_t>(pos0) + n);
    for (size_t t = 0; t < n; ++t) {
      auto& row = rows[static_cast<size_t>(pos0) + t];
      row.clear();
      for (int h = 0; h < sel.num_index_heads; ++h)
        row.emplace_back(sel.Blocks(t, h), sel.Blocks(t, h) + sel.Count(t, h));
    }
  }
};

// How Model::Load binds the weights.
struct ModelLoadOptions {
  // Expert parallelism (lib/cluster): keep only slice `expert_part.index` of `expert_part.count` of
  // every MoE layer's routed and shared experts (MoePart), as views of the mapping, so that this
  // process never reads the rest. {0, 1}: every expert whole.
  MoePart expert_part;
};

class Model {
 public:
  // Opens a model folder: a packed one (model.m3w from `m3 pack`, used when present) or a
  // HuggingFace checkpoint; validates config and every tensor before returning.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir, const ModelLoadOptions& options = {});

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  const WeightStats& stats() const { return stats_; }
  const Rope& rope() const { return *rope_; }
  // Exactly one of these is set: the HuggingFace checkpoint or the packed file the weights map.
  const Checkpoint* checkpoint() const { return checkpoint_.get(); }
  const PackFile* pack() const { return pack_.get(); }

  // Runs tokens ids[0..n) at positions cache->length() + t and appends them to the cache (one
  // matrix-matrix pass for a prompt, n = 1 for decode). Logits: [n, vocab] (kAllRows) or
  // [1, vocab] for the last token (kLastRow). Ids and context are checked by the caller (Session).
  // A NaN or inf in a block's output (damaged weights, fp32 overflow) is a kCorrupt error naming
  // the layer, block and position; the cache then holds rows past its length that the next call
  // overwrites (its length is unchanged).
  Status Forward(const OpContext& tc, const int32_t* ids, size_t n, KvCache* cache, LogitsMode mode,
                 float* logits, ForwardObserver* observer = nullptr) const;

  // One pass over several sequences (continuous batching): each segment's tokens run at its own
  // cache's positions and attend to that cache alone, while every matmul (projections, MLP, MoE,
  // lm_head) takes all segments' rows at once, so a decode step of B sequences reads each weight
  // once instead of B times. Logits: kLastRow gives each segment's last logit_rows rows (one
  // unless set: a speculative step verifies all of its tokens), in segment order; kAllRows
  // [all tokens, vocab]. Each segment's result equals its own Forward up to the float rounding of
  // matmuls over more rows. The caches must be distinct. An observer sees each segment's block
  // selections at its own positions, and the routing of all rows of the pass at once (pos0 then
  // is the first row's).
  struct Segment {
    const int32_t* ids;
    size_t n;
    KvCache* cache;
    size_t logit_rows = 1;  // kLastRow: 1..n
  };
  Status ForwardBatch(const OpContext& tc, std::span<const Segment> segments, LogitsMode mode, float* logits,
                      ForwardObserver* observer = nullptr) const;

  // The same pass on `backend` (ops/backend.h): the CPU's operators, or an accelerator's
  // (lib/offload). The overload above runs on the CPU.
  Status ForwardBatch(const OpContext& tc, Backend& backend, std::span<const Segment> segments, LogitsMode mode,
                      float* logits, ForwardObserver* observer = nullptr) const;
  // The sizes of this model's passes, for a backend.
  PassShape pass_shape() const;
  // The backend of --gpu dense: every dense weight on `device` (refused, with what it needs,
  // when it does not fit beside caches of `context` tokens). The model must outlive it.
  StatusOr<std::unique_ptr<DenseOffload>> OffloadDensePart(std::unique_ptr<Device> device, uint64_t context) const;

  // Memory placement, before the model is shared (Engine::Open).
  // --numa split: copies each node's row slices of every MoE layer's experts into memory local to
  // it (ops/moe_numa.h), and the dense matrices (attention, indexer, router, dense MLPs, an untied
  // lm_head) once, with each row tile's pages on the node of the pinned thread (of `threads`)
  // that computes it; the mapped originals are dropped from this process.
  // --mlock-dense: locks every weight but the routed experts (and an untied embedding table, of
  // which a token reads one row) in memory, so that streaming experts from disk cannot evict
  // them; returns the bytes locked.
  Status PlaceOnNodes(const Topology& topology, int nodes, int threads);
  // The NUMA placement of `mode` for `threads` threads (--numa): PlaceOnNodes (or only the expert
  // slices, without `dense`, for a process that runs no dense part) and the threads pinned, on
  // the machine's topology or, with `simulated_nodes` >= 1, on that many logical nodes made of
  // this process's CPUs (DetectTopology). Returns the placement in words ("numa split over 2 of ...").
  StatusOr<std::string> Place(NumaMode mode, int threads, bool dense, int simulated_nodes = 0);
  StatusOr<uint64_t> LockDenseWeights();
  // The MoE weights of layer `layer` (decoder layers, then MTP layers); null if it has none.
  const MoeWeights* MoeOfLayer(int layer) const;

 private:
  Model() = default;
  Status SplitExperts(const Topology& topology, int nodes);  // the expert part of PlaceOnNodes
  // The attention block of `layer` on the pass's rows (of `segments`, in order; row i at
  // positions[i]): every row's keys and values go to the caches, and h takes the attention output
  // of the query rows: every row (queries empty), or each segment i's last queries[i] rows, in
  // order (h's first rows), at query_positions (valid until the pass ends: checks may read them then).
  Status AttentionBlock(BackendPass& pass, int layer, const float* x, std::span<const Segment> segments,
                        const int64_t* positions, float* h, ForwardObserver* observer,
                        std::span<const size_t> queries = {}, const int64_t* query_positions = nullptr) const;

  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<PackFile> pack_;
  ModelConfig config_;
  ModelWeights weights_;
  WeightStats stats_;
  std::unique_ptr<Rope> rope_;
  std::shared_ptr<NodeBuffer> dense_memory_;  // --numa split: the node-local dense matrices
};

}  // namespace m3
