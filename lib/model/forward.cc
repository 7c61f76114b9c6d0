// The MiniMax-M3 forward pass (docs/MODEL.md §3), step by step: the only layer loop. Each step
// runs on a backend (ops/backend.h): the CPU's operators, or an accelerator with the routed
// experts on the CPU (lib/offload). Kernel detail lives there and in simd/.
//
//   h = E[ids]
//   for each layer: h += Attn(RMSNorm(h)); h += (MoE or MLP)(RMSNorm(h))
//   logits = RMSNorm(h) . lm_head^T
#include <algorithm>
#include <memory>

#include "model/model.h"
#include "ops/cpu_backend.h"

namespace m3 {

namespace {

// A forward pass's activations, in numbered buffers of the backend (the session's workspace on
// the CPU): reused by every later pass. Every buffer is written in full before it is read.
enum ActivationSlot : size_t {
  kResidual,  // h: the residual stream
  kNormed,    // x: a block's normed input
  kQueries,   // attention: q, indexer q, attention output, the query rows' inputs
  kIndexQueries,
  kCore,
  kQueryInputs,
};

// The rows of a pass over `segments`, in segment order: each row's token and position (from its
// cache's length), and the rows that give logits in kLastRow (each segment's last logit_rows).
// Refuses an empty pass, a segment without tokens or with more logit rows than tokens, and two
// segments on one cache.
struct PassRows {
  std::vector<int32_t> ids;
  std::vector<int64_t> positions;
  std::vector<size_t> logit_rows;
  std::vector<PassSegment> segments;
};

StatusOr<PassRows> LayOutPass(std::span<const Model::Segment> segments) {
  if (segments.empty()) return InvalidArgument("a forward pass needs at least one sequence");
  PassRows p;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Model::Segment& s = segments[i];
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
    p.segments.push_back({s.cache, s.n});
  }
  return p;
}

}  // namespace

PassShape Model::pass_shape() const {
  const ModelConfig& c = config_;
  PassShape s;
  s.hidden = static_cast<size_t>(c.hidden_size);
  s.heads = static_cast<size_t>(c.num_heads);
  s.kv_heads = static_cast<size_t>(c.num_kv_heads);
  s.head_dim = static_cast<size_t>(c.head_dim);
  s.vocab = static_cast<size_t>(c.vocab_size);
  s.experts = c.any_moe() ? static_cast<size_t>(c.num_experts) : 0;
  s.max_intermediate = static_cast<size_t>(std::max(c.dense_intermediate_size, c.shared_intermediate_size));
  s.any_sparse = c.any_sparse();
  s.sparse = c.sparse;
  s.eps = c.rms_norm_eps;
  s.rope = rope_.get();
  return s;
}

Status Model::AttentionBlock(BackendPass& pass, int layer, const float* x, std::span<const Segment> segments,
                             const int64_t* positions, float* h, ForwardObserver* observer,
                             std::span<const size_t> queries, const int64_t* query_positions) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = weights_.layers[layer].attn;
  const size_t H = c.hidden_size, Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  size_t n = 0;
  for (const Segment& s : segments) n += s.n;
  // The query rows: every row, or each segment's last queries[i] rows (their global rows).
  const bool every_row = queries.empty();
  std::vector<size_t> query_row;
  if (!every_row) {
    size_t row = 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      for (size_t t = segments[i].n - queries[i]; t < segments[i].n; ++t) query_row.push_back(row + t);
      row += segments[i].n;
    }
  }
  const size_t nq = every_row ? n : query_row.size();
  const int64_t* qpos = every_row ? positions : query_positions;

  // Projections, per-head norm (before RoPE), RoPE; K and V go to the cache.
  // The lightning indexer's projections (sparse layers) read the same x: one quantization and
  // one parallel region for all five (the queries' two on the query rows alone when those are fewer).
  const SparseAttentionConfig& sc = c.sparse;
  const size_t Hi = w.sparse ? sc.num_index_heads : 0, Di = w.sparse ? sc.index_dim : 0;
  M3_ASSIGN_OR_RETURN(float* q, pass.Floats(kQueries, nq * Hq * D));
  M3_ASSIGN_OR_RETURN(float* iq, pass.Floats(kIndexQueries, nq * Hi * Di));
  M3_ASSIGN_OR_RETURN(const KeyValueRows kv, pass.KeyValueTargets(layer, w.sparse));
  if (every_row) {
    const MatMulTarget projections[] = {{&w.q, q, Hq * D},
                                        {&w.k, kv.k, Hkv * D},
                                        {&w.v, kv.v, Hkv * D},
                                        {&w.index_q, iq, Hi * Di},
                                        {&w.index_k, kv.index_k, Di}};
    pass.Project(x, n, std::span<const MatMulTarget>(projections, w.sparse ? 5 : 3));
  } else {
    const MatMulTarget keys[] = {{&w.k, kv.k, Hkv * D}, {&w.v, kv.v, Hkv * D}, {&w.index_k, kv.index_k, Di}};
    pass.Project(x, n, std::span<const MatMulTarget>(keys, w.sparse ? 3 : 2));
    if (nq > 0) {
      M3_ASSIGN_OR_RETURN(float* xq, pass.Floats(kQueryInputs, nq * H));
      pass.GatherRows(x, H, query_row, xq);
      const MatMulTarget query[] = {{&w.q, q, Hq * D}, {&w.index_q, iq, Hi * Di}};
      pass.Project(xq, nq, std::span<const MatMulTarget>(query, w.sparse ? 2 : 1));
    }
  }
  // The indexer's results are checked apart: a NaN there would change the choice of blocks,
  // not the values. One call for all four where the queries are every row.
  const CheckSite iq_check{"indexer queries", layer, qpos}, ik_check{"indexer keys", layer, positions};
  if (every_row) {
    const NormRopeJob jobs[] = {{q, Hq, D, &w.q_norm, {}},
                                {kv.k, Hkv, D, &w.k_norm, {}},
                                {iq, Hi, Di, &w.index_q_norm, iq_check},
                                {kv.index_k, 1, Di, &w.index_k_norm, ik_check}};
    M3_RETURN_IF_ERROR(pass.NormRope(std::span<const NormRopeJob>(jobs, w.sparse ? 4 : 2), n, positions));
  } else {
    const NormRopeJob query_jobs[] = {{q, Hq, D, &w.q_norm, {}}, {iq, Hi, Di, &w.index_q_norm, iq_check}};
    const NormRopeJob key_jobs[] = {{kv.k, Hkv, D, &w.k_norm, {}}, {kv.index_k, 1, Di, &w.index_k_norm, ik_check}};
    M3_RETURN_IF_ERROR(pass.NormRope(std::span<const NormRopeJob>(query_jobs, w.sparse ? 2 : 1), nq, qpos));
    M3_RETURN_IF_ERROR(pass.NormRope(std::span<const NormRopeJob>(key_jobs, w.sparse ? 2 : 1), n, positions));
  }
  pass.StoreKeyValues(layer, kv);

  // Per sequence: its query rows' block selection and attention.
  M3_ASSIGN_OR_RETURN(float* core, pass.Floats(kCore, nq * Hq * D));
  size_t row = 0, qi = 0;  // the segment's first row, and its first query row
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    const size_t seg_q = every_row ? s.n : queries[i];
    if (seg_q > 0) {
      const int64_t q_pos0 = positions[row + s.n - seg_q];
      BlockSelection selection;
      if (w.sparse) {
        M3_RETURN_IF_ERROR(pass.SelectBlocks(layer, i, iq + qi * Hi * Di, q_pos0, seg_q, &selection));
        if (observer) observer->OnBlockSelection(layer, q_pos0, selection);
      }
      pass.Attention(layer, i, q + qi * Hq * D, q_pos0, seg_q, w.sparse ? &selection : nullptr, core + qi * Hq * D);
    }
    row += s.n;
    qi += seg_q;
  }
  if (nq > 0) pass.AddMatMul(w.o, core, nq, h);
  return Status::Ok();
}

Status Model::Forward(const OpContext& tc, const int32_t* ids, size_t n, KvCache* cache, LogitsMode mode,
                      float* logits, ForwardObserver* observer) const {
  const Segment one{ids, n, cache};
  return ForwardBatch(tc, {&one, 1}, mode, logits, observer);
}

Status Model::ForwardBatch(const OpContext& tc, std::span<const Segment> segments, LogitsMode mode, float* logits,
                           ForwardObserver* observer) const {
  CpuBackend cpu(pass_shape());
  return ForwardBatch(tc, cpu, segments, mode, logits, observer);
}

Status Model::ForwardBatch(const OpContext& tc, Backend& backend, std::span<const Segment> segments, LogitsMode mode,
                           float* logits, ForwardObserver* observer) const {
  const ModelConfig& c = config_;
  const size_t H = c.hidden_size;
  M3_ASSIGN_OR_RETURN(const PassRows pass_rows, LayOutPass(segments));
  const std::vector<int64_t>& positions = pass_rows.positions;
  const std::vector<size_t>& logit_rows = pass_rows.logit_rows;  // kLastRow: each segment's last logit_rows rows
  const size_t n = pass_rows.ids.size();
  OpContext pass_tc = tc;
  if (observer && observer->matmul_observer()) pass_tc.matmul_observer = observer->matmul_observer();
  M3_ASSIGN_OR_RETURN(const std::unique_ptr<BackendPass> pass, backend.BeginPass(pass_tc, pass_rows.segments));

  M3_ASSIGN_OR_RETURN(float* h, pass->Floats(kResidual, n * H));
  M3_ASSIGN_OR_RETURN(float* x, pass->Floats(kNormed, n * H));
  // No embedding scale (docs/MODEL.md §3.1).
  M3_RETURN_IF_ERROR(pass->Embed(weights_.embed, pass_rows.ids.data(), n, h, {"the token embedding", -1, positions.data()}));
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
  // The rows of h that go on, and their positions (from the trimmed layer on: the logit rows').
  size_t rows = n;
  std::vector<int64_t> out_positions;
  const int64_t* pos = positions.data();
  auto keep_logit_rows = [&] {
    rows = mode == LogitsMode::kLastRow ? logit_rows.size() : 0;
    const std::span<const size_t> kept(logit_rows.data(), rows);
    pass->GatherRows(h, H, kept, h);
    for (const size_t r : kept) out_positions.push_back(positions[r]);
    pos = out_positions.data();
  };
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = weights_.layers[l];
    pass->Norm(h, rows, L.input_norm, x);
    if (trim_last && l == c.num_layers - 1) {
      std::vector<size_t> queries(segments.size(), 0);
      if (mode == LogitsMode::kLastRow)
        for (size_t i = 0; i < segments.size(); ++i) queries[i] = segments[i].logit_rows;
      keep_logit_rows();  // h's rows that attention adds to, and their positions
      M3_RETURN_IF_ERROR(AttentionBlock(*pass, l, x, segments, positions.data(), h, nullptr, queries, pos));
      if (rows == 0) {
        if (observer) observer->OnLayerEnd(l, 0);
        break;
      }
    } else {
      M3_RETURN_IF_ERROR(AttentionBlock(*pass, l, x, segments, positions.data(), h, observer));
    }
    M3_RETURN_IF_ERROR(pass->CheckFinite(h, rows, H, {"attention", l, pos}));
    if (observer) observer->OnAttentionEnd(l);

    pass->Norm(h, rows, L.post_norm, x);
    if (L.is_moe) {
      routed.resize(rows * c.experts_per_token);
      M3_RETURN_IF_ERROR(pass->AddMoe(l, L.moe, moe_params, x, rows, h, routed.data()));
      if (observer) observer->OnRouting(l, pos[0], rows, c.experts_per_token, routed.data());
    } else {
      pass->AddMlp(L.mlp, moe_params.act, x, rows, h);
    }
    M3_RETURN_IF_ERROR(pass->CheckFinite(h, rows, H, {L.is_moe ? "MoE block" : "MLP", l, pos}));
    if (observer) observer->OnLayerEnd(l, rows);
  }

  if (mode != LogitsMode::kNone) {
    // The rows that give logits, gathered in order (each from a row at or after its own, so in
    // place; the trimmed last layer has done it), then one lm_head matmul.
    if (mode == LogitsMode::kLastRow && rows == n) keep_logit_rows();
    pass->Norm(h, rows, weights_.final_norm, x);
    M3_RETURN_IF_ERROR(pass->Logits(weights_.lm_head, x, rows, logits, {"the final norm and lm_head", -1, pos}));
  }
  M3_RETURN_IF_ERROR(pass->Finish());
  for (const Segment& s : segments) s.cache->SetLength(s.cache->length() + s.n);
  return Status::Ok();
}

}  // namespace m3
