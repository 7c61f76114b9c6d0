#include "ops/moe.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>

#include "base/aligned_buffer.h"
#include "simd/kernels.h"
#include "ops/matmul.h"
#include "ops/scratch.h"
#include "ops/workspace.h"
#include "simd/kernel_table.h"
#include "platform/mapped_file.h"

namespace m3 {

void RouteToken(const float* logits, const std::vector<float>& bias, const MoeParams& p, int32_t* ids,
                float* weights) {
  const size_t e = bias.size();
  std::vector<float> score(e), choice(e);
  bool any_nan = false;
  for (size_t i = 0; i < e; ++i) {
    score[i] = 1.0f / (1.0f + std::exp(-logits[i]));
    choice[i] = p.use_bias ? score[i] + bias[i] : score[i];
    if (std::isnan(choice[i])) {
      choice[i] = -INFINITY;  // sortable
      any_nan = true;
    }
  }
  std::vector<int32_t> order(e);
  std::iota(order.begin(), order.end(), 0);
  // Highest biased score first; ties go to the lower expert id (docs/MODEL.md §3.8).
  std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), [&](int32_t a, int32_t b) {
    return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
  });
  float sum = 0;
  for (int k = 0; k < p.top_k; ++k) sum += score[order[k]];
  for (int k = 0; k < p.top_k; ++k) {
    ids[k] = order[k];
    weights[k] = score[order[k]] / sum * p.routed_scaling;  // unbiased sigmoid, renormalized
    // A NaN score (damaged router weights or bias) makes the token's output NaN, which the
    // model's check after the block reports, instead of quietly never routing to that expert.
    if (any_nan) weights[k] = NAN;
  }
}

namespace {

// The routing of a block's tokens: ids and weights [n, k] in the scratch.
void Route(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, MoeScratch& s) {
  const size_t hidden = w.router.cols, n_exp = w.router.rows, k = static_cast<size_t>(p.top_k);
  s.logits.EnsureSize(n * n_exp);
  MatMul(tc, w.router, x, hidden, n, s.logits.data(), n_exp);
  s.ids.resize(n * k);
  s.weights.resize(n * k);
  // Tokens routed in parallel for a prompt (at 16+ threads a serial loop over 512 tokens of
  // sigmoids and partial sorts is a visible share of the layer); one token on the caller.
  ParallelFor(tc, n, 16, [&](size_t b, size_t e, int) {
    for (size_t t = b; t < e; ++t)
      RouteToken(s.logits.data() + t * n_exp, w.router_bias, p, &s.ids[t * k], &s.weights[t * k]);
  });
}

// What the parallel region does, decided on the caller's thread: the jobs (in the scratch), the
// inputs to prepare first, and each phase's units and their costs.
struct MoePlan {
  std::vector<size_t> advised;          // experts whose memory is advised as needed soon
  std::vector<MatMulInput*> sources;    // inputs of all n tokens, prepared before the routed ones
  const MatMulInput* source = nullptr;  // the tokens quantized once for the routed experts, if any
  std::vector<size_t> rows, routed_rows, gate_up_tiles, down_tiles;
  std::vector<uint64_t> one, per_row;
  std::vector<size_t> tokens, source_rows;
  std::vector<uint64_t> token_cost, source_cost;
  const MoeSplit* split = nullptr;  // NUMA split: node n's threads take node n's row slices
  int nodes = 1;
  std::vector<std::vector<size_t>> node_gate_up, node_down;
};

MoePlan Plan(const OpContext& tc, const MoeWeights& w, const float* x, size_t n, size_t k, bool with_shared,
             MoeScratch& s) {
  const bool has_shared = with_shared && w.has_shared;
  const size_t hidden = w.router.cols, n_exp = w.router.rows;
  const simd::KernelTable& kernels = tc.table();
  MoePlan plan;
  // Rows grouped by expert (token order within each), and where each (token, slot) landed.
  std::vector<size_t> first(n_exp + 1, 0);
  for (int32_t e : s.ids) ++first[static_cast<size_t>(e) + 1];
  std::partial_sum(first.begin(), first.end(), first.begin());
  s.row_tokens.resize(n * k);
  s.slot_row.resize(n * k);
  {
    std::vector<size_t> next(first.begin(), first.end() - 1);
    for (size_t i = 0; i < n * k; ++i) {
      const size_t row = next[static_cast<size_t>(s.ids[i])]++;
      s.row_tokens[row] = static_cast<uint32_t>(i / k);
      s.slot_row[i] = static_cast<uint32_t>(row);
    }
  }
  // The chosen experts' bytes are read soon: one readahead request each (AdviseWillNeed: a
  // residency check, then madvise for a range not all resident), issued by the threads in turn
  // at the start of the region, before any of them faults on them.
  for (size_t e = 0; e < n_exp && e < w.expert_memory.size(); ++e)
    if (first[e + 1] > first[e]) plan.advised.push_back(e);

  // Jobs: the shared expert first, then the chosen experts in id order.
  const size_t routed_inter = w.experts.empty() ? 0 : w.experts[0].gate.rows;
  const size_t shared_inter = has_shared ? w.shared.gate.rows : 0;
  s.y.EnsureSize(n * k * hidden);
  s.g.EnsureSize(n * shared_inter + n * k * routed_inter);
  s.u.EnsureSize(n * shared_inter + n * k * routed_inter);
  size_t jobs = has_shared ? 1 : 0;
  for (size_t e = 0; e < n_exp; ++e) jobs += first[e + 1] > first[e];
  s.jobs.resize(jobs);
  size_t j = 0, inter_used = 0;
  auto add_job = [&](const MlpWeights& mw, size_t expert, size_t m, const uint32_t* tokens, float* gathered,
                     bool from_source, float* y) {
    ExpertJob& J = s.jobs[j++];
    const size_t inter = mw.gate.rows;
    J.w = &mw;
    J.expert = expert;
    J.m = m;
    J.tokens = tokens;
    J.gathered = gathered;
    J.from_source = from_source;
    J.g = s.g.data() + inter_used;
    J.u = s.u.data() + inter_used;
    J.y = y;
    inter_used += m * inter;
    J.gate_up_in.Reset(kernels, mw.gate, from_source ? nullptr : gathered ? gathered : x, hidden, m);
    J.down_in.Reset(kernels, mw.down, J.g, inter, m);
  };
  if (has_shared) add_job(w.shared, n_exp, n, nullptr, nullptr, false, nullptr);
  // Routed inputs: with quantized weights each token is quantized once (the shared expert's
  // input when its weights are quantized alike, else routed_source) and its int8 row copied for
  // every expert it went to: k times fewer quantizations than quantizing gathered fp32 rows per
  // expert, and a copy of a quarter of the bytes. Other formats gather fp32 rows.
  if (has_shared) plan.sources.push_back(&s.jobs[0].gate_up_in);
  const simd::WeightRef* gate = nullptr;  // the first chosen expert's with quantized weights
  for (size_t e = 0; e < n_exp && !gate; ++e)
    if (first[e + 1] > first[e] && simd::IsQuantized(w.experts[e].gate.format)) gate = &w.experts[e].gate;
  if (gate && has_shared && s.jobs[0].gate_up_in.SharesQuantization(*gate)) {
    plan.source = &s.jobs[0].gate_up_in;
  } else if (gate) {
    s.routed_source.Reset(kernels, *gate, x, hidden, n);
    plan.source = &s.routed_source;
    plan.sources.push_back(&s.routed_source);
  }
  std::vector<char> from_source(n_exp);
  size_t fp32_rows = 0;
  for (size_t e = 0; e < n_exp; ++e) {
    from_source[e] = plan.source && plan.source->SharesQuantization(w.experts[e].gate);
    if (!from_source[e]) fp32_rows += first[e + 1] - first[e];
  }
  s.gathered.EnsureSize(fp32_rows * hidden);
  for (size_t e = 0, fp32_used = 0; e < n_exp; ++e) {
    const size_t m = first[e + 1] - first[e];
    if (m == 0) continue;
    float* gathered = from_source[e] ? nullptr : s.gathered.data() + fp32_used * hidden;
    add_job(w.experts[e], e, m, s.row_tokens.data() + first[e], gathered, from_source[e],
            s.y.data() + first[e] * hidden);
    if (!from_source[e]) fp32_used += m;
  }

  // Units and their costs for each phase.
  plan.rows.resize(jobs);
  plan.routed_rows.resize(jobs);
  plan.gate_up_tiles.resize(jobs);
  plan.down_tiles.resize(jobs);
  plan.one.assign(jobs, 1);
  plan.per_row.resize(jobs);
  for (size_t i = 0; i < jobs; ++i) {
    const ExpertJob& J = s.jobs[i];
    plan.rows[i] = J.m;
    plan.routed_rows[i] = J.tokens ? J.m : 0;
    plan.gate_up_tiles[i] = 2 * MatMulRowTiles(J.w->gate);  // gate tiles, then up tiles
    plan.down_tiles[i] = MatMulRowTiles(J.w->down);
    plan.per_row[i] = J.m;  // a tile costs as many rows as the expert has tokens
  }
  plan.tokens = {n};
  plan.token_cost = {1};
  plan.source_rows.assign(plan.sources.size(), n);
  plan.source_cost.assign(plan.sources.size(), 1);
  // NUMA split: node n's threads take node n's row slices (needs a thread per node at least).
  plan.split = w.split && tc.threads >= w.split->nodes ? w.split.get() : nullptr;
  plan.nodes = plan.split ? plan.split->nodes : 1;
  plan.node_gate_up.resize(static_cast<size_t>(plan.nodes));
  plan.node_down.resize(static_cast<size_t>(plan.nodes));
  for (int node = 0; plan.split && node < plan.nodes; ++node)
    for (size_t i = 0; i < jobs; ++i) {
      const ExpertSlice& sl = plan.split->slices[static_cast<size_t>(node)][s.jobs[i].expert];
      plan.node_gate_up[static_cast<size_t>(node)].push_back(2 * MatMulRowTiles(sl.local.gate));
      plan.node_down[static_cast<size_t>(node)].push_back(MatMulRowTiles(sl.local.down));
    }
  return plan;
}

// The block in one parallel region: (A) inputs, (B) gate and up, (C) SwiGLU, (D) down, (E) the
// weighted sum into `out`, with a barrier between phases and none per expert.
void Run(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, float* out,
         bool with_shared, const MoePlan& plan, MoeScratch& s, Workspace& ws) {
  const bool has_shared = with_shared && w.has_shared;
  const size_t hidden = w.router.cols, k = static_cast<size_t>(p.top_k);
  const MoeSplit* split = plan.split;
  if (has_shared) s.jobs[0].y = out;  // the shared expert writes the output itself
  std::atomic<uint64_t> gate_up_cursor{0}, down_cursor{0};
  ParallelRegion(tc, [&](int tid, int nt, auto barrier) {
    AlignedBuffer<float>& decoded = ws.thread(tid).decoded;
    for (size_t i = static_cast<size_t>(tid); i < plan.advised.size(); i += static_cast<size_t>(nt))
      AdviseWillNeed(w.expert_memory[plan.advised[i]].data, w.expert_memory[plan.advised[i]].bytes);
    // (A) Quantize every token for the shared expert and the routed source; then gather each
    // routed expert's rows: int8 rows from the source, or fp32 rows quantized for its weights.
    ForEachShare(plan.source_rows, plan.source_cost, tid, nt,
                 [&](size_t i, size_t b, size_t e) { plan.sources[i]->PrepareRows(b, e); });
    barrier();
    ForEachShare(plan.routed_rows, plan.one, tid, nt, [&](size_t i, size_t b, size_t e) {
      ExpertJob& J = s.jobs[i];
      if (J.from_source) {
        J.gate_up_in.PrepareRowsFrom(*plan.source, J.tokens, b, e);
        return;
      }
      for (size_t r = b; r < e; ++r)
        std::memcpy(J.gathered + r * hidden, x + static_cast<size_t>(J.tokens[r]) * hidden, hidden * sizeof(float));
      J.gate_up_in.PrepareRows(b, e);
    });
    barrier();
    // This thread's node and its place among the node's threads (all threads: one node).
    const int node = NodeOfThread(tid, nt, plan.nodes);
    const auto [node_first, node_end] = NodeThreads(node, nt, plan.nodes);
    const int node_threads = node_end - node_first;
    // (B) Gate and up row tiles: units [0, T) are gate tiles, [T, 2T) up tiles.
    auto gate_up = [&](const MlpWeights& mw, size_t tile0, const ExpertJob& J, size_t b, size_t e) {
      const size_t tiles = MatMulRowTiles(mw.gate), inter = J.w->gate.rows, r0 = tile0 * kMatMulRowTile;
      if (b < tiles) J.gate_up_in.Multiply(mw.gate, b, std::min(e, tiles), J.g + r0, inter, decoded);
      if (e > tiles) J.gate_up_in.Multiply(mw.up, std::max(b, tiles) - tiles, e - tiles, J.u + r0, inter, decoded);
    };
    if (split) {
      ForEachShare(plan.node_gate_up[static_cast<size_t>(node)], plan.per_row, tid - node_first, node_threads,
                   [&](size_t i, size_t b, size_t e) {
                     const ExpertSlice& sl = split->slices[static_cast<size_t>(node)][s.jobs[i].expert];
                     gate_up(sl.local, sl.gate_up_tile0, s.jobs[i], b, e);
                   });
    } else {  // tiles handed out while the threads run: a thread slowed by its memory takes fewer
      ForEachDynamicShare(plan.gate_up_tiles, plan.per_row, nt, gate_up_cursor,
                          [&](size_t i, size_t b, size_t e) { gate_up(*s.jobs[i].w, 0, s.jobs[i], b, e); });
    }
    barrier();
    // (C) SwiGLU, then quantize for the down weights.
    ForEachShare(plan.rows, plan.one, tid, nt, [&](size_t i, size_t b, size_t e) {
      ExpertJob& J = s.jobs[i];
      const size_t inter = J.w->gate.rows;
      SwigluOai(J.g + b * inter, J.u + b * inter, (e - b) * inter, p.act);
      J.down_in.PrepareRows(b, e);
    });
    barrier();
    // (D) Down row tiles: the shared expert writes `out`, routed experts their rows of y.
    if (split) {
      ForEachShare(plan.node_down[static_cast<size_t>(node)], plan.per_row, tid - node_first, node_threads,
                   [&](size_t i, size_t b, size_t e) {
                     const ExpertJob& J = s.jobs[i];
                     const ExpertSlice& sl = split->slices[static_cast<size_t>(node)][J.expert];
                     J.down_in.Multiply(sl.local.down, b, e, J.y + sl.down_tile0 * kMatMulRowTile, hidden, decoded);
                   });
    } else {
      ForEachDynamicShare(plan.down_tiles, plan.per_row, nt, down_cursor, [&](size_t i, size_t b, size_t e) {
        const ExpertJob& J = s.jobs[i];
        J.down_in.Multiply(J.w->down, b, e, J.y, hidden, decoded);
      });
    }
    barrier();
    // (E) out[t] += w_s * y[row of (t, s)] in slot order.
    ForEachShare(plan.tokens, plan.token_cost, tid, nt, [&](size_t, size_t b, size_t e) {
      for (size_t t = b; t < e; ++t) {
        float* o = out + t * hidden;
        if (!has_shared) std::fill_n(o, hidden, 0.0f);
        for (size_t slot = 0; slot < k; ++slot)
          simd::Axpy(s.weights[t * k + slot], s.y.data() + static_cast<size_t>(s.slot_row[t * k + slot]) * hidden, o,
                     hidden);
      }
    });
  });
}

}  // namespace

void MoeForward(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                float* out, int32_t* routed_ids) {
  if (n == 0) return;
  ScopedWorkspace ws(tc.workspace);
  ws->ReserveThreads(tc.threads);
  MoeScratch& s = ws->moe();
  Route(tc, w, p, x, n, s);
  if (routed_ids) std::copy(s.ids.begin(), s.ids.end(), routed_ids);
  const MoePlan plan = Plan(tc, w, x, n, static_cast<size_t>(p.top_k), true, s);
  Run(tc, w, p, x, n, out, true, plan, s, *ws);
}

void MoeRoutedForward(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                      const int32_t* ids, const float* weights, float* out) {
  if (n == 0) return;
  ScopedWorkspace ws(tc.workspace);
  ws->ReserveThreads(tc.threads);
  MoeScratch& s = ws->moe();
  const size_t k = static_cast<size_t>(p.top_k);
  s.ids.assign(ids, ids + n * k);
  s.weights.assign(weights, weights + n * k);
  const MoePlan plan = Plan(tc, w, x, n, k, false, s);
  Run(tc, w, p, x, n, out, false, plan, s, *ws);
}

}  // namespace m3
