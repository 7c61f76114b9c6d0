#include "ops/cpu_backend.h"

#include <atomic>
#include <cmath>
#include <cstring>

#include "ops/convert.h"
#include "ops/workspace.h"
#include "platform/parallel.h"

namespace m3 {

Status NonFiniteError(const CheckSite& at, int64_t position, const char* value) {
  const std::string where = at.layer < 0 ? std::string(at.what) : Str("layer ", at.layer, "'s ", at.what);
  return Corrupt(where, " gave a non-finite value", value ? Str(" (", value, ")") : std::string(), " at position ",
                 position,
                 ": the model's weights are damaged or overflow fp32 (`m3 inspect --verify` finds a damaged tensor)");
}

namespace {

// fn(t0, t1) over ranges of token rows [0, n): split over the threads for a prompt, and on the
// calling thread alone for a decode step. For the per-token steps between the matmuls, which
// would otherwise leave the other threads waiting.
template <class Fn>
void ForTokenRows(const OpContext& tc, size_t n, Fn&& fn) {
  constexpr size_t kMinRowsPerThread = 16;
  ParallelFor(tc, n, kMinRowsPerThread, [&](size_t t0, size_t t1, int) { fn(t0, t1); });
}

// Cache rows of a pass, split over the threads (each row is its own place in a page reserved
// before the pass).
template <class Pages>
void StoreRows(const OpContext& tc, Pages& dst, size_t row0, const float* src, size_t n, size_t width) {
  ForTokenRows(tc, n, [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) dst.Write(row0 + t, src + t * width);
  });
}

// The backend's own activation slots (after the model's).
enum CpuSlot : size_t { kKeys = BackendPass::kBackendSlots, kValues, kIndexKeys, kBlockOut };

class CpuPass final : public BackendPass {
 public:
  CpuPass(const PassShape& shape, const OpContext& tc, std::span<const PassSegment> segments)
      : shape_(shape), workspace_(tc.workspace), segments_(segments.begin(), segments.end()) {
    tc_ = tc;
    tc_.workspace = workspace_.get();  // a pass without a workspace brings its own
    for (const PassSegment& s : segments_) {
      s.cache->Reserve(s.cache->length() + s.n);
      rows_ += s.n;
    }
  }

  StatusOr<float*> Floats(size_t slot, size_t floats) override { return Buffer(slot, floats); }

  Status Embed(const simd::WeightRef& table, const int32_t* ids, size_t n, float* h, CheckSite check) override {
    const size_t H = shape_.hidden;
    ForTokenRows(tc_, n, [&](size_t t0, size_t t1) { m3::GatherRows(table, ids + t0, t1 - t0, h + t0 * H); });
    return CheckFinite(h, n, H, check);
  }

  // NaN or inf anywhere in a row is reported where it first shows instead of flowing on into
  // garbage logits. The kernels keep such values non-finite (quantizers give NaN scales, the
  // router NaN weights), so one look at each block's output catches every source in it.
  Status CheckFinite(const float* x, size_t rows, size_t width, CheckSite check) override {
    if (!check.what) return Status::Ok();
    // Split over the threads in pieces of at least 32K values (a prompt's hidden states or a row
    // of logits are a pass over megabytes); the first non-finite value is the smallest index found.
    std::atomic<size_t> first{rows * width};
    ParallelFor(tc_, rows * width, size_t{1} << 15, [&](size_t b, size_t e, int) {
      const size_t rel = FindNonFinite(x + b, e - b);
      if (rel == e - b) return;
      size_t seen = first.load();
      while (b + rel < seen && !first.compare_exchange_weak(seen, b + rel)) {
      }
    });
    const size_t at = first.load();
    if (at == rows * width) return Status::Ok();
    const char* value = std::isnan(x[at]) ? "NaN" : x[at] > 0 ? "+inf" : "-inf";
    return NonFiniteError(check, check.positions[at / width], value);
  }

  void Norm(const float* x, size_t rows, const std::vector<float>& scale, float* y) override {
    const size_t H = shape_.hidden;
    ForTokenRows(tc_, rows, [&](size_t t0, size_t t1) {
      RmsNormRows(x + t0 * H, H, t1 - t0, H, scale.data(), shape_.eps, y + t0 * H, H);
    });
  }

  void GatherRows(const float* src, size_t width, std::span<const size_t> rows, float* dst) override {
    for (size_t i = 0; i < rows.size(); ++i)
      if (dst + i * width != src + rows[i] * width)
        std::memcpy(dst + i * width, src + rows[i] * width, width * sizeof(float));
  }

  void Project(const float* x, size_t n, std::span<const MatMulTarget> targets) override {
    MatMulSameInput(tc_, targets, x, targets.front().w->cols, n);
  }

  Status NormRope(std::span<const NormRopeJob> jobs, size_t n, const int64_t* positions) override {
    for (const NormRopeJob& j : jobs) {
      ForTokenRows(tc_, n, [&](size_t t0, size_t t1) {
        float* rows = j.x + t0 * j.heads * j.dim;
        if (j.norm && !j.norm->empty())
          RmsNormRows(rows, j.dim, (t1 - t0) * j.heads, j.dim, j.norm->data(), shape_.eps, rows, j.dim);
        for (size_t t = t0; t < t1; ++t) shape_.rope->Apply(j.x + t * j.heads * j.dim, j.heads, j.dim, positions[t]);
      });
    }
    // The checks after all the jobs, as the pass always did (the indexer's only choose blocks:
    // a NaN there would change the choice, not the values).
    for (const NormRopeJob& j : jobs) M3_RETURN_IF_ERROR(CheckFinite(j.x, n, j.heads * j.dim, j.check));
    return Status::Ok();
  }

  StatusOr<KeyValueRows> KeyValueTargets(int, bool sparse) override {
    const size_t kv = shape_.kv_heads * shape_.head_dim;
    return KeyValueRows{Buffer(kKeys, rows_ * kv), Buffer(kValues, rows_ * kv),
                        sparse ? Buffer(kIndexKeys, rows_ * static_cast<size_t>(shape_.sparse.index_dim)) : nullptr};
  }

  void StoreKeyValues(int layer, const KeyValueRows& kv) override {
    const size_t width = shape_.kv_heads * shape_.head_dim, Di = shape_.sparse.index_dim;
    size_t row = 0;
    for (const PassSegment& s : segments_) {
      KvCache& cache = *s.cache;
      const size_t pos0 = cache.length();
      StoreRows(tc_, cache.k(layer), pos0, kv.k + row * width, s.n, width);
      StoreRows(tc_, cache.v(layer), pos0, kv.v + row * width, s.n, width);
      if (kv.index_k) StoreRows(tc_, cache.index_k(layer), pos0, kv.index_k + row * Di, s.n, Di);
      row += s.n;
    }
  }

  Status SelectBlocks(int layer, size_t segment, const float* iq, int64_t pos0, size_t n,
                      BlockSelection* out) override {
    // Lightning indexer: index q per index head, ONE shared index key head; selection only.
    m3::SelectBlocks(tc_, shape_.sparse, iq, segments_[segment].cache->index_k(layer), pos0, n, out);
    return Status::Ok();
  }

  void Attention(int layer, size_t segment, const float* q, int64_t pos0, size_t n, const BlockSelection* selection,
                 float* out) override {
    AttentionParams ap{static_cast<int>(shape_.heads), static_cast<int>(shape_.kv_heads),
                       static_cast<int>(shape_.head_dim), 1, 1};
    if (selection) {
      ap.num_index_heads = shape_.sparse.num_index_heads;
      ap.block_size = shape_.sparse.block_size;
    }
    KvCache& cache = *segments_[segment].cache;
    m3::Attention(tc_, ap, q, cache.k(layer), cache.v(layer), pos0, n, selection, out);
  }

  void AddMatMul(const simd::WeightRef& w, const float* x, size_t n, float* h) override {
    float* delta = Buffer(kBlockOut, n * shape_.hidden);
    MatMul(tc_, w, x, w.cols, n, delta, shape_.hidden);
    AddRows(delta, n, h);
  }

  void AddMlp(const MlpWeights& w, const SwigluParams& act, const float* x, size_t n, float* h) override {
    float* delta = Buffer(kBlockOut, n * shape_.hidden);
    MlpForward(tc_, w, act, x, n, delta);
    AddRows(delta, n, h);
  }

  Status AddMoe(int layer, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, float* h,
                int32_t* routed_ids) override {
    float* delta = Buffer(kBlockOut, n * shape_.hidden);
    if (tc_.moe_runner) {
      M3_RETURN_IF_ERROR(tc_.moe_runner->Run(tc_, layer, w, p, x, n, delta, routed_ids));
    } else {
      MoeForward(tc_, w, p, x, n, delta, routed_ids);
    }
    AddRows(delta, n, h);
    return Status::Ok();
  }

  Status Logits(const simd::WeightRef& lm_head, const float* x, size_t rows, float* logits,
                CheckSite check) override {
    MatMul(tc_, lm_head, x, shape_.hidden, rows, logits, shape_.vocab);
    return CheckFinite(logits, rows, shape_.vocab, check);
  }

  Status Finish() override { return Status::Ok(); }  // every check ran as its step did

 private:
  float* Buffer(size_t slot, size_t floats) { return tc_.workspace->Floats(slot, floats); }
  // h += delta for n rows.
  void AddRows(const float* delta, size_t n, float* h) {
    const size_t H = shape_.hidden;
    ForTokenRows(tc_, n, [&](size_t t0, size_t t1) { AddInPlace(delta + t0 * H, h + t0 * H, (t1 - t0) * H); });
  }

  const PassShape& shape_;
  const ScopedWorkspace workspace_;
  OpContext tc_;
  std::vector<PassSegment> segments_;
  size_t rows_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<BackendPass>> CpuBackend::BeginPass(const OpContext& tc,
                                                             std::span<const PassSegment> segments) {
  return std::unique_ptr<BackendPass>(new CpuPass(shape_, tc, segments));
}

}  // namespace m3
