// The MiniMax-M3 forward pass (docs/MODEL.md §3), step by step. Kernel detail lives in lib/ops and simd/.
//
//   h = E[ids]
//   for each layer: h += Attn(RMSNorm(h)); h += (MoE or MLP)(RMSNorm(h))
//   logits = RMSNorm(h) . lm_head^T
#include <algorithm>
#include <memory>
#include <atomic>
#include <cmath>
#include <cstring>

#include "base/aligned_buffer.h"
#include "ops/convert.h"
#include "ops/workspace.h"
#include "model/model.h"
#include "ops/matmul.h"
#include "ops/mlp.h"
#include "ops/moe.h"
#include "platform/parallel.h"

namespace m3 {

namespace {

// fn(t0, t1) over ranges of token rows [0, n): split over the threads for a prompt, and on the
// calling thread alone for a decode step. For the per-token steps between the matmuls, which
// would otherwise leave the other threads waiting.
template <class Fn>
void ForTokenRows(const OpContext& tc, size_t n, Fn&& fn) {
  constexpr size_t kMinRowsPerThread = 16;
  ParallelFor(tc, n, kMinRowsPerThread, [&](size_t t0, size_t t1, int) { fn(t0, t1); });
}

// Per-head RMSNorm then RoPE for `heads` vectors of `dim` per token; token t at positions[t].
void NormRope(const OpContext& tc, const Rope& rope, float* x, size_t n, size_t heads, size_t dim,
              const std::vector<float>& norm, float eps, const int64_t* positions) {
  ForTokenRows(tc, n, [&](size_t t0, size_t t1) {
    float* rows = x + t0 * heads * dim;
    if (!norm.empty()) RmsNormRows(rows, dim, (t1 - t0) * heads, dim, norm.data(), eps, rows, dim);
    for (size_t t = t0; t < t1; ++t) rope.Apply(x + t * heads * dim, heads, dim, positions[t]);
  });
}

// out = RMSNorm(x) for n rows of `dim`.
void NormRows(const OpContext& tc, const float* x, size_t n, size_t dim, const std::vector<float>& scale,
              float eps, float* out) {
  ForTokenRows(tc, n, [&](size_t t0, size_t t1) {
    RmsNormRows(x + t0 * dim, dim, t1 - t0, dim, scale.data(), eps, out + t0 * dim, dim);
  });
}

// h += delta for n rows of `dim`.
void AddRows(const OpContext& tc, const float* delta, size_t n, size_t dim, float* h) {
  ForTokenRows(tc, n, [&](size_t t0, size_t t1) { AddInPlace(delta + t0 * dim, h + t0 * dim, (t1 - t0) * dim); });
}

// A forward pass's activations, in numbered buffers of the session's workspace (ops/workspace.h):
// reused by every later pass. Every buffer is written in full before it is read.
enum ActivationSlot : size_t {
  kResidual,    // h: the residual stream
  kNormed,      // x: a block's normed input
  kBlockOut,    // delta: a block's output
  kQueries,     // AttentionBlock: q, k, v, indexer q and k, attention output, the query rows' inputs
  kKeys,
  kValues,
  kIndexQueries,
  kIndexKeys,
  kCore,
  kQueryInputs,
};

float* Activation(const OpContext& tc, ActivationSlot slot, size_t n) { return tc.workspace->Floats(slot, n); }

// Cache rows of a prompt, split over the threads (each row is its own place in a page reserved
// before the pass).
template <class Pages>
void StoreRows(const OpContext& tc, Pages& dst, size_t row0, const float* src, size_t n, size_t width) {
  ForTokenRows(tc, n, [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) dst.Write(row0 + t, src + t * width);
  });
}

// Ok when x [n, width] (row t at positions[t]) is all finite; else the error for `what` (of
// `layer` when >= 0). NaN or inf anywhere in a token's values is reported where it first shows instead
// of flowing on into garbage logits. The kernels keep such values non-finite (quantizers give NaN
// scales, the router NaN weights), so one look at each block's output catches every source in it.
Status CheckFinite(const OpContext& tc, const float* x, size_t n, size_t width, const int64_t* positions,
                   const char* what, int layer) {
  // Split over the threads in pieces of at least 32K values (a prompt's hidden states or a row of
  // logits are a pass over megabytes); the first non-finite value is the smallest index found.
  std::atomic<size_t> first{n * width};
  ParallelFor(tc, n * width, size_t{1} << 15, [&](size_t b, size_t e, int) {
    const size_t rel = FindNonFinite(x + b, e - b);
    if (rel == e - b) return;
    size_t seen = first.load();
    while (b + rel < seen && !first.compare_exchange_weak(seen, b + rel)) {
    }
  });
  const size_t at = first.load();
  if (at == n * width) return Status::Ok();
  const std::string where = layer < 0 ? std::string(what) : Str("layer ", layer, "'s ", what);
  const char* value = std::isnan(x[at]) ? "NaN" : x[at] > 0 ? "+inf" : "-inf";
  return Corrupt(where, " gave a non-finite value (", value, ") at position ", positions[at / width],
                 ": the model's weights are damaged or overflow fp32 (`m3 inspect --verify` finds a damaged tensor)");
}

}  // namespace

Status Model::AttentionBlock(const OpContext& tc, int layer, const float* x, std::span<const Segment> segments,
                             const int64_t* positions, float* out, ForwardObserver* observer,
                             std::span<const size_t> queries) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = weights_.layers[layer].attn;
  const size_t H = c.hidden_size, Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  size_t n = 0;
  for (const Segment& s : segments) n += s.n;
  // The query rows: every row, or each segment's last queries[i] rows (their global row, and
  // their positions in the same order).
  const bool every_row = queries.empty();
  std::vector<size_t> query_row;
  std::vector<int64_t> query_pos;
  if (!every_row) {
    size_t row = 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      for (size_t t = segments[i].n - queries[i]; t < segments[i].n; ++t) {
        query_row.push_back(row + t);
        query_pos.push_back(positions[row + t]);
      }
      row += segments[i].n;
    }
  }
  const size_t nq = every_row ? n : query_row.size();
  const int64_t* qpos = every_row ? positions : query_pos.data();

  // Projections, per-head norm (before RoPE), RoPE; K and V go to the cache.
  // The lightning indexer's projections (sparse layers) read the same x: one quantization and
  // one parallel region for all five (the queries' two on the query rows alone when those are fewer).
  const SparseAttentionConfig& sc = c.sparse;
  const size_t Hi = w.sparse ? sc.num_index_heads : 0, Di = w.sparse ? sc.index_dim : 0;
  float* q = Activation(tc, kQueries, nq * Hq * D);
  float* k = Activation(tc, kKeys, n * Hkv * D);
  float* v = Activation(tc, kValues, n * Hkv * D);
  float* iq = Activation(tc, kIndexQueries, nq * Hi * Di);
  float* ik = Activation(tc, kIndexKeys, n * Di);
  if (every_row) {
    const MatMulTarget projections[] = {
        {&w.q, q, Hq * D}, {&w.k, k, Hkv * D}, {&w.v, v, Hkv * D}, {&w.index_q, iq, Hi * Di}, {&w.index_k, ik, Di}};
    MatMulSameInput(tc, std::span<const MatMulTarget>(projections, w.sparse ? 5 : 3), x, H, n);
  } else {
    const MatMulTarget keys[] = {{&w.k, k, Hkv * D}, {&w.v, v, Hkv * D}, {&w.index_k, ik, Di}};
    MatMulSameInput(tc, std::span<const MatMulTarget>(keys, w.sparse ? 3 : 2), x, H, n);
    if (nq > 0) {
      float* xq = Activation(tc, kQueryInputs, nq * H);
      for (size_t i = 0; i < nq; ++i) std::memcpy(xq + i * H, x + query_row[i] * H, H * sizeof(float));
      const MatMulTarget query[] = {{&w.q, q, Hq * D}, {&w.index_q, iq, Hi * Di}};
      MatMulSameInput(tc, std::span<const MatMulTarget>(query, w.sparse ? 2 : 1), xq, H, nq);
    }
  }
  NormRope(tc, *rope_, q, nq, Hq, D, w.q_norm, c.rms_norm_eps, qpos);
  NormRope(tc, *rope_, k, n, Hkv, D, w.k_norm, c.rms_norm_eps, positions);
  if (w.sparse) {
    NormRope(tc, *rope_, iq, nq, Hi, Di, w.index_q_norm, c.rms_norm_eps, qpos);
    NormRope(tc, *rope_, ik, n, 1, Di, w.index_k_norm, c.rms_norm_eps, positions);
    // The indexer only chooses blocks: a NaN here would change the choice, not the values.
    M3_RETURN_IF_ERROR(CheckFinite(tc, iq, nq, Hi * Di, qpos, "indexer queries", layer));
    M3_RETURN_IF_ERROR(CheckFinite(tc, ik, n, Di, positions, "indexer keys", layer));
  }

  // Per sequence: its cache rows, then its query rows' block selection and attention.
  float* core = Activation(tc, kCore, nq * Hq * D);
  size_t row = 0, qi = 0;  // the segment's first row, and its first query row
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    KvCache* cache = s.cache;
    const int64_t pos0 = positions[row];
    StoreRows(tc, cache->k(layer), static_cast<size_t>(pos0), k + row * Hkv * D, s.n, Hkv * D);
    StoreRows(tc, cache->v(layer), static_cast<size_t>(pos0), v + row * Hkv * D, s.n, Hkv * D);
    if (w.sparse) StoreRows(tc, cache->index_k(layer), static_cast<size_t>(pos0), ik + row * Di, s.n, Di);
    const size_t seg_q = every_row ? s.n : queries[i];
    if (seg_q > 0) {
      const int64_t q_pos0 = positions[row + s.n - seg_q];
      AttentionParams ap{c.num_heads, c.num_kv_heads, c.head_dim, 1, 1};
      BlockSelection selection;
      const BlockSelection* sel = nullptr;
      if (w.sparse) {
        // Lightning indexer: index q per index head, ONE shared index key head; selection only.
        SelectBlocks(tc, sc, iq + qi * Hi * Di, cache->index_k(layer), q_pos0, seg_q, &selection);
        if (observer) observer->OnBlockSelection(layer, q_pos0, selection);
        sel = &selection;
        ap.num_index_heads = sc.num_index_heads;
        ap.block_size = sc.block_size;
      }
      Attention(tc, ap, q + qi * Hq * D, cache->k(layer), cache->v(layer), q_pos0, seg_q, sel, core + qi * Hq * D);
    }
    row += s.n;
    qi += seg_q;
  }
  if (nq > 0) MatMul(tc, w.o, core, Hq * D, nq, out, H);
  return Status::Ok();
}

Status Model::Forward(const OpContext& tc, const int32_t* ids, size_t n, KvCache* cache, LogitsMode mode,
                      float* logits, ForwardObserver* observer) const {
  const Segment one{ids, n, cache};
  return ForwardBatch(tc, {&one, 1}, mode, logits, observer);
}

StatusOr<Model::PassRows> Model::LayOutPass(std::span<const Segment> segments) {
  if (segments.empty()) return InvalidArgument("a forward pass needs at least one sequence");
  PassRows p;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.n == 0) return InvalidArgument("sequence ", i, " of a forward pass has no tokens");
    if (s.logit_rows < 1 || s.logit_rows > s.n)
      return InvalidArgument("sequence ", i, " of a forward pass asks for ", s.logit_rows, " logit rows of its ", s.n,
                             " tokens");
    for (size_t j = 0; j < i; ++j)
      if (segments[j].cache == s.cache) return InvalidArgument("sequences ", j, " and ", i, " share one KV cache");
    const int64_t pos0 = static_cast<int64_t>(s.cache->length());
    for (size_t t = 0; t < s.n; ++t) p.positions.push_back(pos0 + static_cast<int64_t>(t));
    p.ids.insert(p.ids.end(), s.ids, s.ids + s.n);
    for (size_t r = p.ids.size() - s.logit_rows; r < p.ids.size(); ++r) p.logit_rows.push_back(r);
  }
  return p;
}

Status Model::ForwardBatch(const OpContext& ctx, std::span<const Segment> segments, LogitsMode mode, float* logits,
                           ForwardObserver* observer) const {
  const ModelConfig& c = config_;
  const size_t H = c.hidden_size;
  M3_ASSIGN_OR_RETURN(PassRows rows_of_pass, LayOutPass(segments));
  std::vector<int64_t>& positions = rows_of_pass.positions;
  const std::vector<int32_t>& ids = rows_of_pass.ids;
  const std::vector<size_t>& logit_rows = rows_of_pass.logit_rows;  // kLastRow: each segment's last logit_rows rows
  for (const Segment& s : segments) s.cache->Reserve(s.cache->length() + s.n);
  const size_t n = ids.size();
  const int64_t* pos = positions.data();

  const ScopedWorkspace workspace(ctx.workspace);  // a pass without a workspace brings its own
  OpContext tc = ctx;
  tc.workspace = workspace.get();
  float* h = Activation(tc, kResidual, n * H);
  float* x = Activation(tc, kNormed, n * H);
  float* delta = Activation(tc, kBlockOut, n * H);
  // No embedding scale (docs/MODEL.md §3.1).
  ForTokenRows(tc, n, [&](size_t t0, size_t t1) { GatherRows(weights_.embed, ids.data() + t0, t1 - t0, h + t0 * H); });
  M3_RETURN_IF_ERROR(CheckFinite(tc, h, n, H, pos, "the token embedding", -1));
  const MoeParams moe_params{c.experts_per_token, c.routed_scaling_factor, c.use_routing_bias,
                             {c.swiglu_alpha, c.swiglu_limit, c.swiglu_beta}};
  std::vector<int32_t> routed;
  // The last layer of a pass whose logits come from some rows only (kLastRow: each segment's
  // last rows; kNone, a prompt's earlier chunks: none) computes the other rows' keys and values
  // for the cache and nothing else: their queries, attention, MoE and residual would never be
  // read. That is one layer in 60 of a prompt's work. The rows that go on are moved to the front
  // of h first (each from a row at or after its own), in logit order. Observers see every row of
  // every layer, so a pass with one runs in full.
  const bool trim_last = mode != LogitsMode::kAllRows && (!observer || !observer->SeesEveryRow()) &&
                         (mode == LogitsMode::kNone || logit_rows.size() < n);
  size_t rows = n;  // rows of h that go on
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = weights_.layers[l];
    NormRows(tc, h, rows, H, L.input_norm, c.rms_norm_eps, x);
    if (trim_last && l == c.num_layers - 1) {
      std::vector<size_t> queries(segments.size(), 0);
      if (mode == LogitsMode::kLastRow)
        for (size_t i = 0; i < segments.size(); ++i) queries[i] = segments[i].logit_rows;
      M3_RETURN_IF_ERROR(AttentionBlock(tc, l, x, segments, pos, delta, nullptr, queries));
      rows = mode == LogitsMode::kLastRow ? logit_rows.size() : 0;
      for (size_t i = 0; i < rows; ++i) {
        if (logit_rows[i] != i) std::memcpy(h + i * H, h + logit_rows[i] * H, H * sizeof(float));
        positions[i] = positions[logit_rows[i]];
      }
      if (rows == 0) {
        if (observer) observer->OnLayerEnd(l, 0);
        break;
      }
    } else {
      M3_RETURN_IF_ERROR(AttentionBlock(tc, l, x, segments, pos, delta, observer));
    }
    AddRows(tc, delta, rows, H, h);
    M3_RETURN_IF_ERROR(CheckFinite(tc, h, rows, H, pos, "attention", l));

    NormRows(tc, h, rows, H, L.post_norm, c.rms_norm_eps, x);
    if (L.is_moe) {
      routed.resize(rows * c.experts_per_token);
      if (tc.moe_runner) {
        M3_RETURN_IF_ERROR(tc.moe_runner->Run(tc, l, L.moe, moe_params, x, rows, delta, routed.data()));
      } else {
        MoeForward(tc, L.moe, moe_params, x, rows, delta, routed.data());
      }
      if (observer) observer->OnRouting(l, pos[0], rows, c.experts_per_token, routed.data());
    } else {
      MlpForward(tc, L.mlp, moe_params.act, x, rows, delta);
    }
    AddRows(tc, delta, rows, H, h);
    M3_RETURN_IF_ERROR(CheckFinite(tc, h, rows, H, pos, L.is_moe ? "MoE block" : "MLP", l));
    if (observer) observer->OnLayerEnd(l, rows);
  }

  if (mode != LogitsMode::kNone) {
    // The rows that give logits, gathered in order (each from a row at or after its own, so
    // in place; the trimmed last layer has done it), then one lm_head matmul.
    if (mode == LogitsMode::kLastRow && rows == n) {
      rows = logit_rows.size();
      for (size_t i = 0; i < rows; ++i)
        if (logit_rows[i] != i) std::memcpy(h + i * H, h + logit_rows[i] * H, H * sizeof(float));
      for (size_t i = 0; i < rows; ++i) positions[i] = positions[logit_rows[i]];
    }
    NormRows(tc, h, rows, H, weights_.final_norm, c.rms_norm_eps, x);
    MatMul(tc, weights_.lm_head, x, H, rows, logits, c.vocab_size);
    M3_RETURN_IF_ERROR(CheckFinite(tc, logits, rows, c.vocab_size, pos, "the final norm and lm_head", -1));
  }
  for (const Segment& s : segments) s.cache->SetLength(s.cache->length() + s.n);
  return Status::Ok();
}

}  // namespace m3
