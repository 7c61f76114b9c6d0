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
  // Intermediate widths from down's columns: a part's slices have fewer gate rows.
  const size_t routed_inter = w.experts.empty() ? 0 : w.experts[0].down.cols;
  const size_t shared_inter = has_shared ? w.shared.down.cols : 0;
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
    const size_t inter = mw.down.cols;
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

// Copies (pack) or places back (!pack) columns cols(i) of the rows of blocks i = 0..blocks-1
// (rows(i) rows of ld(i) floats at base(i)) to or from the contiguous `flat`.
template <class Blocks>
size_t MoveColumns(size_t blocks, Blocks&& block, float* flat, bool pack) {
  size_t at = 0;
  for (size_t i = 0; i < blocks; ++i) {
    const auto [base, rows, ld, c0, c1] = block(i);
    for (size_t r = 0; r < rows; ++r, at += c1 - c0) {
      float* row = base + r * ld + c0;
      if (pack) std::memcpy(flat + at, row, (c1 - c0) * sizeof(float));
      else std::memcpy(row, flat + at, (c1 - c0) * sizeof(float));
    }
  }
  return at;
}

struct ColumnBlock {
  float* base;
  size_t rows, ld, c0, c1;
};

// The block: (A) inputs, (B) gate and up, (C) SwiGLU, (D) down, (E) the weighted sum into `out`,
// with a barrier between phases and none per expert: one parallel region for one process, two
// around the exchanges for a part (w.part), which computes its slices' columns in B, D and E.
Status Run(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, float* out,
           bool with_shared, const MoePlan& plan, MoeScratch& s, Workspace& ws, MoeExchange* exchange) {
  const bool has_shared = with_shared && w.has_shared;
  const size_t hidden = w.router.cols, k = static_cast<size_t>(p.top_k);
  const MoeSplit* split = plan.split;
  const MoePart part = exchange ? w.part : MoePart{};
  const bool parted = part.count > 1;
  // Where this process's rows of a job's gate/up and of every down start (in row tiles), and the
  // columns of its activations and of the output they give.
  auto act_tile0 = [&](const ExpertJob& J) { return PartTiles(J.w->down.cols, part).first; };
  const size_t out_tile0 = PartTiles(hidden, part).first;
  const size_t out_c0 = PartColumns(hidden, part).first, out_c1 = PartColumns(hidden, part).second;
  if (has_shared) s.jobs[0].y = out;  // the shared expert writes the output itself
  std::atomic<uint64_t> gate_up_cursor{0}, down_cursor{0};

  // (A) Quantize every token for the shared expert and the routed source; then gather each
  // routed expert's rows: int8 rows from the source, or fp32 rows quantized for its weights.
  // (B) Gate and up row tiles: units [0, T) are gate tiles, [T, 2T) up tiles.
  auto inputs_gate_up = [&](int tid, int nt, auto& barrier) {
    Workspace::PerThread& per_thread = ws.thread(tid);
    for (size_t i = static_cast<size_t>(tid); i < plan.advised.size(); i += static_cast<size_t>(nt))
      for (const MemoryRange& r : w.expert_memory[plan.advised[i]]) AdviseWillNeed(r.data, r.bytes);
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
    auto gate_up = [&](const MlpWeights& mw, size_t tile0, const ExpertJob& J, size_t b, size_t e) {
      const size_t tiles = MatMulRowTiles(mw.gate), inter = J.w->down.cols, r0 = tile0 * kMatMulRowTile;
      if (b < tiles) J.gate_up_in.Multiply(mw.gate, b, std::min(e, tiles), J.g + r0, inter, per_thread);
      if (e > tiles) J.gate_up_in.Multiply(mw.up, std::max(b, tiles) - tiles, e - tiles, J.u + r0, inter, per_thread);
    };
    if (split) {
      ForEachShare(plan.node_gate_up[static_cast<size_t>(node)], plan.per_row, tid - node_first, node_end - node_first,
                   [&](size_t i, size_t b, size_t e) {
                     const ExpertSlice& sl = split->slices[static_cast<size_t>(node)][s.jobs[i].expert];
                     gate_up(sl.local, act_tile0(s.jobs[i]) + sl.gate_up_tile0, s.jobs[i], b, e);
                   });
    } else {  // tiles handed out while the threads run: a thread slowed by its memory takes fewer
      ForEachDynamicShare(plan.gate_up_tiles, plan.per_row, nt, gate_up_cursor, [&](size_t i, size_t b, size_t e) {
        gate_up(*s.jobs[i].w, act_tile0(s.jobs[i]), s.jobs[i], b, e);
      });
    }
    barrier();
  };
  // (C) SwiGLU (a part: of its own columns, before the exchange), then quantize for down.
  auto swiglu = [&](int tid, int nt) {
    ForEachShare(plan.rows, plan.one, tid, nt, [&](size_t i, size_t b, size_t e) {
      ExpertJob& J = s.jobs[i];
      const size_t inter = J.w->down.cols;
      if (!parted) {
        SwigluOai(J.g + b * inter, J.u + b * inter, (e - b) * inter, p.act);
        J.down_in.PrepareRows(b, e);
        return;
      }
      const auto [c0, c1] = PartColumns(inter, part);
      for (size_t r = b; r < e; ++r) SwigluOai(J.g + r * inter + c0, J.u + r * inter + c0, c1 - c0, p.act);
    });
  };
  // (D) Down row tiles: the shared expert writes `out`, routed experts their rows of y.
  // (E) out[t] += w_s * y[row of (t, s)] in slot order (a part: its columns).
  auto down_combine = [&](int tid, int nt, auto& barrier) {
    Workspace::PerThread& per_thread = ws.thread(tid);
    const int node = NodeOfThread(tid, nt, plan.nodes);
    const auto [node_first, node_end] = NodeThreads(node, nt, plan.nodes);
    if (split) {
      ForEachShare(plan.node_down[static_cast<size_t>(node)], plan.per_row, tid - node_first, node_end - node_first,
                   [&](size_t i, size_t b, size_t e) {
                     const ExpertJob& J = s.jobs[i];
                     const ExpertSlice& sl = split->slices[static_cast<size_t>(node)][J.expert];
                     J.down_in.Multiply(sl.local.down, b, e, J.y + (out_tile0 + sl.down_tile0) * kMatMulRowTile, hidden,
                                        per_thread);
                   });
    } else {
      ForEachDynamicShare(plan.down_tiles, plan.per_row, nt, down_cursor, [&](size_t i, size_t b, size_t e) {
        const ExpertJob& J = s.jobs[i];
        J.down_in.Multiply(J.w->down, b, e, J.y + out_tile0 * kMatMulRowTile, hidden, per_thread);
      });
    }
    barrier();
    ForEachShare(plan.tokens, plan.token_cost, tid, nt, [&](size_t, size_t b, size_t e) {
      for (size_t t = b; t < e; ++t) {
        float* o = out + t * hidden + out_c0;
        if (!has_shared) std::fill_n(o, out_c1 - out_c0, 0.0f);
        for (size_t slot = 0; slot < k; ++slot)
          simd::Axpy(s.weights[t * k + slot],
                     s.y.data() + static_cast<size_t>(s.slot_row[t * k + slot]) * hidden + out_c0, o, out_c1 - out_c0);
      }
    });
  };

  if (!parted) {
    ParallelRegion(tc, [&](int tid, int nt, auto barrier) {
      inputs_gate_up(tid, nt, barrier);
      swiglu(tid, nt);
      barrier();
      down_combine(tid, nt, barrier);
    });
    if (tc.matmul_observer)
      for (const ExpertJob& J : s.jobs) {  // gate and up read the job's tokens of x, down its activations
        tc.matmul_observer->OnMatMulInput(J.w->gate, x, hidden, J.m, J.tokens);
        tc.matmul_observer->OnMatMulInput(J.w->up, x, hidden, J.m, J.tokens);
        tc.matmul_observer->OnMatMulInput(J.w->down, J.g, J.w->down.cols, J.m, nullptr);
      }
    return Status::Ok();
  }
  // A part: its activation columns to every process, whole rows back.
  ParallelRegion(tc, [&](int tid, int nt, auto barrier) {
    inputs_gate_up(tid, nt, barrier);
    swiglu(tid, nt);
  });
  auto activations = [&](const MoePart& of) {
    return [&, of](size_t i) {
      const ExpertJob& J = s.jobs[i];
      const auto [c0, c1] = PartColumns(J.w->down.cols, of);
      return ColumnBlock{J.g, J.m, J.w->down.cols, c0, c1};
    };
  };
  const size_t count = static_cast<size_t>(part.count), jobs = s.jobs.size();
  std::vector<size_t> counts(count);
  for (size_t q = 0; q < count; ++q)
    for (size_t i = 0; i < jobs; ++i) {
      const auto [c0, c1] = PartColumns(s.jobs[i].w->down.cols, MoePart{static_cast<int>(q), part.count});
      counts[q] += s.jobs[i].m * (c1 - c0);
    }
  size_t total = 0;
  for (size_t c : counts) total += c;
  s.sent.EnsureSize(std::max(counts[static_cast<size_t>(part.index)], size_t{1}));
  s.received.EnsureSize(std::max(total, size_t{1}));
  MoveColumns(jobs, activations(part), s.sent.data(), true);
  M3_RETURN_IF_ERROR(exchange->AllGather(s.sent.data(), counts, s.received.data()));
  for (size_t q = 0, at = 0; q < count; at += counts[q++])
    if (q != static_cast<size_t>(part.index))
      MoveColumns(jobs, activations(MoePart{static_cast<int>(q), part.count}), s.received.data() + at, false);
  ParallelRegion(tc, [&](int tid, int nt, auto barrier) {
    ForEachShare(plan.rows, plan.one, tid, nt, [&](size_t i, size_t b, size_t e) { s.jobs[i].down_in.PrepareRows(b, e); });
    barrier();
    down_combine(tid, nt, barrier);
  });
  // Its output columns to process 0.
  auto output = [&](const MoePart& of) {
    return [&, of](size_t) {
      const auto [c0, c1] = PartColumns(hidden, of);
      return ColumnBlock{out, n, hidden, c0, c1};
    };
  };
  total = 0;
  for (size_t q = 0; q < count; ++q) {
    const auto [c0, c1] = PartColumns(hidden, MoePart{static_cast<int>(q), part.count});
    counts[q] = n * (c1 - c0);
    total += counts[q];
  }
  s.sent.EnsureSize(std::max(counts[static_cast<size_t>(part.index)], size_t{1}));
  s.received.EnsureSize(std::max(total, size_t{1}));
  MoveColumns(1, output(part), s.sent.data(), true);
  M3_RETURN_IF_ERROR(exchange->Gather(s.sent.data(), counts, s.received.data()));
  if (part.index == 0)
    for (size_t q = 1, at = counts[0]; q < count; at += counts[q++])
      MoveColumns(1, output(MoePart{static_cast<int>(q), part.count}), s.received.data() + at, false);
  return Status::Ok();
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
  (void)Run(tc, w, p, x, n, out, true, plan, s, *ws, nullptr);  // cannot fail without an exchange
}

namespace {

// The block for routes chosen elsewhere (ids and weights [n, top_k]).
Status RunRouted(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                 const int32_t* ids, const float* weights, bool with_shared, MoeExchange* exchange, float* out) {
  if (n == 0) return Status::Ok();
  ScopedWorkspace ws(tc.workspace);
  ws->ReserveThreads(tc.threads);
  MoeScratch& s = ws->moe();
  const size_t k = static_cast<size_t>(p.top_k);
  s.ids.assign(ids, ids + n * k);
  s.weights.assign(weights, weights + n * k);
  const MoePlan plan = Plan(tc, w, x, n, k, with_shared, s);
  return Run(tc, w, p, x, n, out, with_shared, plan, s, *ws, exchange);
}

}  // namespace

void MoeRoutedForward(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                      const int32_t* ids, const float* weights, float* out) {
  (void)RunRouted(tc, w, p, x, n, ids, weights, false, nullptr, out);  // cannot fail without an exchange
}

void MoeRoute(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, int32_t* ids,
              float* weights) {
  if (n == 0) return;
  ScopedWorkspace ws(tc.workspace);
  ws->ReserveThreads(tc.threads);
  MoeScratch& s = ws->moe();
  Route(tc, w, p, x, n, s);
  std::copy(s.ids.begin(), s.ids.end(), ids);
  std::copy(s.weights.begin(), s.weights.end(), weights);
}

MoeWeights MoePartOf(const MoeWeights& w, const MoePart& part) {
  MoeWeights out = w;
  out.part = part;
  auto slice = [&](MlpWeights& e) {
    const std::pair<size_t, size_t> gate_up = PartTiles(e.gate.rows, part), down = PartTiles(e.down.rows, part);
    e.gate = RowTileView(e.gate, gate_up.first, gate_up.second);
    e.up = RowTileView(e.up, gate_up.first, gate_up.second);
    e.down = RowTileView(e.down, down.first, down.second);
  };
  // Each slice's bytes (data and scales of gate, up and down): what a chosen expert prefetches.
  auto ranges = [](const MlpWeights& e) {
    std::vector<MemoryRange> r;
    for (const simd::WeightRef* m : {&e.gate, &e.up, &e.down}) {
      if (!m->data) continue;
      const simd::StoredSpan span = simd::RowTileSpan(*m, 0, MatMulRowTiles(*m));
      r.push_back({span.data, span.data_bytes});
      if (span.scale_bytes) r.push_back({span.scales, span.scale_bytes});
    }
    return r;
  };
  for (size_t e = 0; e < out.experts.size(); ++e) {
    slice(out.experts[e]);
    if (e < out.expert_memory.size()) out.expert_memory[e] = ranges(out.experts[e]);
  }
  if (out.has_shared) slice(out.shared);
  return out;
}

Status MoePartForward(const OpContext& tc, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
                      const int32_t* ids, const float* weights, MoeExchange& exchange, float* out) {
  return RunRouted(tc, w, p, x, n, ids, weights, true, &exchange, out);
}

}  // namespace m3
