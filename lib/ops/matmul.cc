#include "ops/matmul.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include "ops/scratch.h"
#include "ops/workspace.h"
#include "simd/kernel_table.h"
#include "simd/kernels.h"
#include "simd/quant_kernels.h"
#include "simd/weight_pack.h"

namespace m3 {
namespace {
// Tokens per inner step: keeps the activation block in L2 for large prefills.
constexpr size_t kTokenTile = 64;

}  // namespace

void MatMulInput::Reset(const simd::KernelTable& kernels, const simd::WeightRef& w, const float* x, size_t ldx,
                        size_t n_tok) {
  kernels_ = &kernels;
  quantized_ = simd::IsQuantized(w.format);
  cols_ = w.cols;
  x_ = x;
  ldx_ = ldx;
  n_tok_ = n_tok;
  if (!quantized_) return;
  group_ = w.group;
  padded_ = w.padded_cols();
  groups_ = w.groups();
  q8_ = w.format == simd::WeightFormat::kQ8;  // one scale per token and a shift per group
  q_.EnsureSize(n_tok * padded_);
  scale_.EnsureSize(n_tok * (q8_ ? 1 : groups_));
  sum_.EnsureSize(n_tok * groups_);
  if (q8_) shift_.EnsureSize(n_tok * groups_);
}

void MatMulInput::PrepareRows(size_t t0, size_t t1) {
  if (!quantized_ || t0 >= t1) return;
  kernels_->quantize_activations(x_ + t0 * ldx_, ldx_, t1 - t0, cols_, group_, q_.data() + t0 * padded_,
                            scale_.data() + t0 * (q8_ ? 1 : groups_), sum_.data() + t0 * groups_,
                            q8_ ? shift_.data() + t0 * groups_ : nullptr);
}

bool MatMulInput::SharesQuantization(const simd::WeightRef& w) const {
  return quantized_ && simd::IsQuantized(w.format) && q8_ == (w.format == simd::WeightFormat::kQ8) && cols_ == w.cols &&
         group_ == w.group;
}

void MatMulInput::PrepareRowsFrom(const MatMulInput& source, const uint32_t* src_rows, size_t t0, size_t t1) {
  if (!quantized_ || t0 >= t1) return;
  const size_t scales = q8_ ? 1 : groups_;
  for (size_t t = t0; t < t1; ++t) {
    const size_t s = src_rows[t];
    std::memcpy(q_.data() + t * padded_, source.q_.data() + s * padded_, padded_);
    std::memcpy(scale_.data() + t * scales, source.scale_.data() + s * scales, scales * sizeof(float));
    std::memcpy(sum_.data() + t * groups_, source.sum_.data() + s * groups_, groups_ * sizeof(int32_t));
    if (q8_) std::memcpy(shift_.data() + t * groups_, source.shift_.data() + s * groups_, groups_);
  }
}

void MatMulInput::Multiply(const simd::WeightRef& w, size_t tile_begin, size_t tile_end, float* y, size_t ldy,
                           Workspace::PerThread& scratch) const {
  tile_end = std::min(tile_end, MatMulRowTiles(w));
  if (tile_begin >= tile_end || n_tok_ == 0) return;
  if (quantized_) {
    const simd::QuantizedActivations a{q_.data(), scale_.data(), sum_.data(), n_tok_,
                                       padded_,    group_,        q8_ ? shift_.data() : nullptr};
    kernels_->QuantMatMul(w, a, tile_begin, tile_end, y, ldy, *scratch.kernels);
    return;
  }
  if (w.format == simd::WeightFormat::kBF16Tiled) {
    kernels_->bf16_tiled_matmul(w, x_, ldx_, n_tok_, tile_begin, tile_end, y, ldy, *scratch.kernels);
    return;
  }
  AlignedBuffer<float>& decoded = scratch.decoded;
  const size_t k = w.cols;
  if (w.format != simd::WeightFormat::kF32) decoded.EnsureSize(kMatMulRowTile * k);
  for (size_t tile = tile_begin; tile < tile_end; ++tile) {
    const size_t r0 = tile * kMatMulRowTile;
    const size_t nr = std::min(kMatMulRowTile, w.rows - r0);
    const float* a;
    if (w.format == simd::WeightFormat::kF32) {
      a = static_cast<const float*>(w.data) + r0 * k;
    } else {
      simd::DecodeRows(w, r0, nr, decoded.data());
      a = decoded.data();
    }
    for (size_t t0 = 0; t0 < n_tok_; t0 += kTokenTile) {
      const size_t nt = std::min(kTokenTile, n_tok_ - t0);
      kernels_->matmul_f32(a, k, nr, x_ + t0 * ldx_, ldx_, nt, k, y + t0 * ldy + r0, ldy);
    }
  }
}

void MatMul(const OpContext& tc, const simd::WeightRef& w, const float* x, size_t ldx, size_t n_tok,
            float* y, size_t ldy) {
  const MatMulTarget target{&w, y, ldy};
  MatMulSameInput(tc, std::span<const MatMulTarget>(&target, 1), x, ldx, n_tok);
}

void MatMulSameInput(const OpContext& tc, std::span<const MatMulTarget> targets, const float* x, size_t ldx,
                     size_t n_tok) {
  if (targets.empty() || n_tok == 0) return;
  ScopedWorkspace scoped(tc.workspace);
  Workspace& ws = *scoped;
  ws.ReserveThreads(tc.threads);
  MatMulScratch& sc = ws.matmul();
  const simd::KernelTable& kernels = tc.table();
  std::vector<MatMulInput>& inputs = sc.inputs;
  if (inputs.size() < targets.size()) inputs.resize(targets.size());
  sc.input_of.resize(targets.size());
  size_t used = 0;  // a quantized input serves every weight quantized alike
  for (size_t i = 0; i < targets.size(); ++i) {
    const simd::WeightRef& w = *targets[i].w;
    size_t j = 0;
    while (j < used && !inputs[j].SharesQuantization(w)) ++j;
    if (j == used) inputs[used++].Reset(kernels, w, x, ldx, n_tok);
    sc.input_of[i] = j;
  }
  sc.prepare_rows.assign(used, n_tok);
  sc.tiles.resize(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) sc.tiles[i] = MatMulRowTiles(*targets[i].w);
  sc.ones.assign(targets.size(), 1);  // unit costs (ForEachShare reads as many as it has units)
  std::atomic<uint64_t> cursor{0};
  ParallelRegion(tc, [&](int tid, int nt, auto barrier) {
    Workspace::PerThread& thread = ws.thread(tid);
    ForEachShare(sc.prepare_rows, sc.ones, tid, nt,
                 [&](size_t j, size_t t0, size_t t1) { inputs[j].PrepareRows(t0, t1); });
    barrier();
    // Row tiles handed out while the threads run: a thread slowed by its memory takes fewer.
    ForEachDynamicShare(sc.tiles, sc.ones, nt, cursor, [&](size_t i, size_t tile_begin, size_t tile_end) {
      inputs[sc.input_of[i]].Multiply(*targets[i].w, tile_begin, tile_end, targets[i].y, targets[i].ldy, thread);
    });
  });
  if (tc.matmul_observer)
    for (const MatMulTarget& t : targets) tc.matmul_observer->OnMatMulInput(*t.w, x, ldx, n_tok, nullptr);
}

double MeasurePromptMatMulGops(const OpContext& tc) {
  const size_t cols = 6144, tokens = 128;
  const size_t rows = simd::kTileRows * static_cast<size_t>(std::max(32, 4 * tc.threads));
  simd::WeightRef w = simd::TiledShape(simd::WeightFormat::kQ4, rows, cols);
  std::vector<float> values(std::max(rows, tokens) * cols);
  uint32_t s = 0x9E3779B9u;
  for (float& v : values) {  // deterministic values in [-1, 1)
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(s >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  std::vector<uint8_t> codes(w.row_tiles() * w.tile_bytes()), scales(w.row_tiles() * w.tile_scale_bytes());
  if (!simd::PackRowTiles(w, values.data(), 0, w.row_tiles(), codes.data(), scales.data())) return 0;
  w.data = codes.data();
  w.scales = scales.data();
  AlignedBuffer<float> y(tokens * rows);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    MatMul(tc, w, values.data(), cols, tokens, y.data(), rows);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sec > 0) best = std::max(best, 2.0 * static_cast<double>(rows * cols * tokens) / sec / 1e9);
  }
  return best;
}

void GatherRows(const simd::WeightRef& w, const int32_t* ids, size_t n, float* out) {
  for (size_t t = 0; t < n; ++t) simd::DecodeRows(w, static_cast<size_t>(ids[t]), 1, out + t * w.cols);
}

}  // namespace m3
