#include "runtime/prefill_chunk.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/status.h"
#include "model/model.h"
#include "ops/context.h"
#include "ops/matmul.h"
#include "platform/parallel.h"

namespace m3 {
namespace {

// A matrix's stored bytes (codes and scales), as the kernels read them.
double StoredBytes(const simd::WeightRef& w) {
  if (!w.data) return 0;
  const simd::StoredSpan span = simd::RowTileSpan(w, 0, (w.rows + simd::kTileRows - 1) / simd::kTileRows);
  return static_cast<double>(span.data_bytes + span.scale_bytes);
}
double Params(const simd::WeightRef& w) { return w.data ? static_cast<double>(w.rows * w.cols) : 0; }

volatile uint64_t g_read_sink;  // keeps the probe's reads

// Three significant digits.
std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

ChunkChoice ChoosePrefillChunk(const ChunkInputs& in, size_t default_chunk) {
  ChunkChoice c;
  c.tokens = default_chunk;
  const bool rates = in.read_gbps > 0 && in.compute_gops > 0 && in.ops_per_token > 0 && in.pass_weight_bytes > 0;
  if (rates) {
    c.read_floor_s = in.pass_weight_bytes / (in.read_gbps * 1e9);
    const double per_token_s = in.ops_per_token / (in.compute_gops * 1e9);
    const double want = std::ceil(c.read_floor_s / (kMaxReadShare * per_token_s));
    const double steps = std::ceil(want / static_cast<double>(kPrefillChunkStep));
    c.tokens = std::clamp(static_cast<size_t>(std::min(steps, 1e6)) * kPrefillChunkStep, default_chunk,
                          std::max(default_chunk, kMaxPrefillChunk));
  }
  std::string capped;
  if (in.memory_available > 0 && in.activation_bytes_per_token > 0) {
    const double fit = kMaxActivationShare * static_cast<double>(in.memory_available) / in.activation_bytes_per_token;
    const size_t most = std::max(kPrefillChunkStep, static_cast<size_t>(fit) / kPrefillChunkStep * kPrefillChunkStep);
    if (most < c.tokens) {
      c.tokens = most;
      capped = Str(", capped by memory (", Num(kMaxActivationShare * 100), "% of ",
                   Num(static_cast<double>(in.memory_available) / 1e9), " GB for the activations)");
    }
  }
  if (rates) {
    c.compute_s = static_cast<double>(c.tokens) * in.ops_per_token / (in.compute_gops * 1e9);
    c.why = Str(c.tokens, " tokens: reading ", Num(in.pass_weight_bytes / 1e9), " GB of weights at ",
                Num(in.read_gbps), " GB/s takes ", Num(c.read_floor_s), " s a pass, ", Num(c.read_floor_s / c.compute_s),
                " of its compute (", Num(c.compute_s), " s at ", Num(in.compute_gops), " GOP/s)", capped);
  } else {
    c.why = Str(c.tokens, " tokens (the default: this machine's rates are unknown)", capped);
  }
  return c;
}

ChunkInputs ModelChunkInputs(const Model& model) {
  const ModelConfig& cfg = model.config();
  const ModelWeights& w = model.weights();
  ChunkInputs in;
  double params = 0;  // per token, in the layers
  // A matrix every token of a pass reads.
  auto per_token = [&](const simd::WeightRef& m) {
    in.pass_weight_bytes += StoredBytes(m);
    params += Params(m);
  };
  for (const LayerWeights& L : w.layers) {
    const AttentionWeights& a = L.attn;
    for (const simd::WeightRef* m : {&a.q, &a.k, &a.v, &a.o, &a.index_q, &a.index_k}) per_token(*m);
    if (!L.is_moe) {
      for (const simd::WeightRef* m : {&L.mlp.gate, &L.mlp.up, &L.mlp.down}) per_token(*m);
      continue;
    }
    const MoeWeights& moe = L.moe;
    per_token(moe.router);
    if (moe.has_shared)
      for (const simd::WeightRef* m : {&moe.shared.gate, &moe.shared.up, &moe.shared.down}) per_token(*m);
    for (const MlpWeights& e : moe.experts)  // a long prompt's pass reads them all
      for (const simd::WeightRef* m : {&e.gate, &e.up, &e.down}) in.pass_weight_bytes += StoredBytes(*m);
    if (!moe.experts.empty()) {
      const MlpWeights& e = moe.experts.front();  // all experts of a layer have one shape
      params += cfg.experts_per_token * (Params(e.gate) + Params(e.up) + Params(e.down));
    }
  }
  in.ops_per_token = 2 * params;
  // A pass's fp32 rows per token: the residual stream and its normed copy with a few more of the
  // hidden width, q/k/v and attention's output, each routed expert's and the shared expert's
  // gate, up and product (an overestimate: buffers are reused between phases).
  const double q = static_cast<double>(cfg.num_heads) * cfg.head_dim;
  const double kv = 2.0 * cfg.num_kv_heads * cfg.head_dim;
  const double experts = 3.0 * (cfg.experts_per_token * cfg.moe_intermediate_size + cfg.shared_intermediate_size +
                                cfg.dense_intermediate_size);
  in.activation_bytes_per_token = 4.0 * (8.0 * cfg.hidden_size + 2.0 * q + kv + experts);
  return in;
}

void ProbeChunkRates(const ThreadConfig& threads, const Kernels& kernels, ChunkInputs* in) {
  using Clock = std::chrono::steady_clock;
  // Read bandwidth: a 256 MiB buffer (larger than the L3 of one socket), touched, then summed by
  // every thread; the best of 3.
  {
    constexpr size_t kWords = (size_t{256} << 20) / sizeof(uint64_t);
    AlignedBuffer<uint64_t> buf(kWords);
    ParallelFor(threads, kWords, 1 << 16, [&](size_t b, size_t e, int) {
      uint64_t* p = buf.data();
      for (size_t i = b; i < e; ++i) p[i] = i;
    });
    std::vector<uint64_t> sums(static_cast<size_t>(std::max(threads.threads, 1)) * 8);
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      ParallelFor(threads, kWords / 4, 1 << 14, [&](size_t b, size_t e, int t) {
        const uint64_t* p = buf.data();
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (size_t i = b; i < e; ++i) s0 += p[4 * i], s1 += p[4 * i + 1], s2 += p[4 * i + 2], s3 += p[4 * i + 3];
        sums[static_cast<size_t>(t) * 8] += s0 + s1 + s2 + s3;  // a slot per cache line
      });
      const double s = Seconds(t0, Clock::now());
      if (s > 0) best = std::max(best, static_cast<double>(kWords * sizeof(uint64_t)) / s / 1e9);
    }
    uint64_t total = 0;
    for (const uint64_t v : sums) total += v;
    g_read_sink = total;
    in->read_gbps = best;
  }
  OpContext tc(threads, &kernels);
  in->compute_gops = MeasurePromptMatMulGops(tc);
}

}  // namespace m3
