// What a forward pass asks of the hardware it runs on. The model's one layer loop
// (model/forward.cc) is a sequence of these steps; a backend decides where each runs and where
// the activations and caches live. CpuBackend (ops/cpu_backend.h) runs every step with the
// threaded operators of this layer; DenseOffload (offload/dense_offload.h) runs the dense part
// on an accelerator with its own copies of the weights and caches, and the routed experts here.
//
// Weights are named by the model's own references (a simd::WeightRef, a norm's vector): a
// backend that keeps copies elsewhere finds its copy by that reference. Activations are the
// backend's buffers (Floats): the model only passes their pointers back to it. A step that
// checks values for NaN and inf (CheckSite) reports a bad value at once or, on a backend that
// runs ahead of the host, from Finish(); either way the error names where it first showed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/status.h"
#include "ops/attention.h"
#include "ops/context.h"
#include "ops/kv_cache.h"
#include "ops/matmul.h"
#include "ops/mlp.h"
#include "ops/moe.h"
#include "ops/norm_rope.h"

namespace m3 {

// The sizes of a model's passes.
struct PassShape {
  size_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  size_t experts = 0;           // router outputs of a MoE layer (0: no MoE layer)
  size_t max_intermediate = 0;  // the widest dense MLP or shared expert
  bool any_sparse = false;
  SparseParams sparse;  // index heads and width, block size, top-k (when any_sparse)
  float eps = 1e-6f;    // of every RMSNorm
  const Rope* rope = nullptr;
};

// Where a check for NaN and inf looks, for the error it gives: "layer 3's MoE block" (layer >=
// 0) or "the token embedding" (layer < 0); row r of the checked values is at positions[r],
// which stays valid until the pass ends. No `what`: no check.
struct CheckSite {
  const char* what = nullptr;
  int layer = -1;
  const int64_t* positions = nullptr;
};
// The error of a non-finite `value` ("NaN", "+inf") at `position` where `at` looked.
Status NonFiniteError(const CheckSite& at, int64_t position, const char* value);

// One sequence of a pass: n rows at its cache's positions length() .. length() + n - 1.
struct PassSegment {
  KvCache* cache;
  size_t n;
};

// A per-head RMSNorm (no norm: null) then RoPE of `heads` vectors of `dim` per row, in place.
struct NormRopeJob {
  float* x;
  size_t heads, dim;
  const std::vector<float>* norm;
  CheckSite check;  // of the result
};

// Where a layer's projections put the pass's keys, values and index keys ([rows][width] each).
struct KeyValueRows {
  float* k = nullptr;
  float* v = nullptr;
  float* index_k = nullptr;  // sparse layers
};

// One forward pass: its steps in the order the model calls them. Rows are the pass's rows
// (every segment's, in order) unless a step says otherwise.
class BackendPass {
 public:
  virtual ~BackendPass() = default;
  // A numbered activation buffer of at least `floats` values, valid until the slot is asked
  // for again with more or the pass ends (slots below kBackendSlots are the model's). An error
  // where the backend's memory is full.
  static constexpr size_t kBackendSlots = 16;
  virtual StatusOr<float*> Floats(size_t slot, size_t floats) = 0;

  // h[t] = row ids[t] of the embedding table, checked.
  virtual Status Embed(const simd::WeightRef& table, const int32_t* ids, size_t n, float* h, CheckSite check) = 0;
  // Checks rows x [rows][width].
  virtual Status CheckFinite(const float* x, size_t rows, size_t width, CheckSite check) = 0;
  // y = RMSNorm(x) with `scale`, rows of the hidden size.
  virtual void Norm(const float* x, size_t rows, const std::vector<float>& scale, float* y) = 0;
  // dst row i = src row rows[i] (width floats); dst may be src when rows[i] >= i for every i.
  virtual void GatherRows(const float* src, size_t width, std::span<const size_t> rows, float* dst) = 0;

  // Several matmuls of one input x [n][cols] (MatMulSameInput).
  virtual void Project(const float* x, size_t n, std::span<const MatMulTarget> targets) = 0;
  // NormRope of n rows, row t at positions[t].
  virtual Status NormRope(std::span<const NormRopeJob> jobs, size_t n, const int64_t* positions) = 0;
  // Attention over the caches: where `layer`'s projections write the pass's keys, values and
  // index keys, and then their rows stored in each segment's cache.
  virtual StatusOr<KeyValueRows> KeyValueTargets(int layer, bool sparse) = 0;
  virtual void StoreKeyValues(int layer, const KeyValueRows& rows) = 0;
  // The lightning indexer's blocks for n queries of `segment` at positions pos0.. (iq [n][Hi][Di]).
  virtual Status SelectBlocks(int layer, size_t segment, const float* iq, int64_t pos0, size_t n,
                              BlockSelection* out) = 0;
  // out [n][heads * head_dim]: attention of n queries of `segment` at positions pos0.. over its
  // cache, dense, or over the blocks of `selection`.
  virtual void Attention(int layer, size_t segment, const float* q, int64_t pos0, size_t n,
                         const BlockSelection* selection, float* out) = 0;

  // The residual stream h [n][hidden] takes a block's output: h += x W^T (the attention's output
  // projection), h += MLP(x), h += MoE(x) (routed_ids [n][top_k]: the experts chosen).
  virtual void AddMatMul(const simd::WeightRef& w, const float* x, size_t n, float* h) = 0;
  virtual void AddMlp(const MlpWeights& w, const SwigluParams& act, const float* x, size_t n, float* h) = 0;
  virtual Status AddMoe(int layer, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, float* h,
                        int32_t* routed_ids) = 0;

  // logits [rows][vocab], in host memory, = x W^T, checked.
  virtual Status Logits(const simd::WeightRef& lm_head, const float* x, size_t rows, float* logits,
                        CheckSite check) = 0;
  // Waits for every step, and gives the first failed check of those not yet reported.
  virtual Status Finish() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // The pass of `segments` (distinct caches), one at a time per backend.
  virtual StatusOr<std::unique_ptr<BackendPass>> BeginPass(const OpContext& tc,
                                                           std::span<const PassSegment> segments) = 0;
};

}  // namespace m3
