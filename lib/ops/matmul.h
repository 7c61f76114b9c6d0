// y = x . W^T for a weight in any stored format, threaded over output rows.
//
// Shapes: x [n_tok, W.cols] (row stride ldx), y [n_tok, W.rows] (row stride ldy).
// Each row tile of W is decoded once to fp32 (never for F32 weights, which are read in place)
// and multiplied against every token, so weights are read once per call.
#pragma once

#include <cstddef>
#include <span>

#include "base/aligned_buffer.h"
#include "ops/context.h"
#include "ops/workspace.h"
#include "platform/parallel.h"
#include "simd/weight_format.h"

namespace m3 {

// The rate in GOP/s of what a long prompt's passes mostly run: a q4 matmul of a routed expert's
// width (6144 inputs, 4 row tiles per thread) for 128 tokens, on tc's threads and kernels; the
// best of 3 calls (~10-50 ms in all). Sizes the prompt chunk (runtime/prefill_chunk.h).
double MeasurePromptMatMulGops(const OpContext& tc);

void MatMul(const OpContext& tc, const simd::WeightRef& w, const float* x, size_t ldx, size_t n_tok,
            float* y, size_t ldy);

// One output of MatMulSameInput: y = x . W^T with y's row stride ldy.
struct MatMulTarget {
  const simd::WeightRef* w;
  float* y;
  size_t ldy;
};

// Several matmuls of one input (the attention's q/k/v and indexer projections, an MLP's gate and
// up): x is quantized once per distinct quantization among the weights instead of once per
// weight, and all their row tiles are shared among the threads in one parallel region (a small
// weight such as k or v alone leaves threads idle). Same results as MatMul on each.
void MatMulSameInput(const OpContext& tc, std::span<const MatMulTarget> targets, const float* x, size_t ldx,
                     size_t n_tok);

// Rows per row tile for every weight format (the packed tile height; 16 decoded rows of k = 6144
// are 384 KiB, so a decoded tile stays in L2 while the tokens stream past it).
inline constexpr size_t kMatMulRowTile = simd::kTileRows;
inline size_t MatMulRowTiles(const simd::WeightRef& w) { return (w.rows + kMatMulRowTile - 1) / kMatMulRowTile; }

// The input of matmuls split by hand over threads (several matrices in one parallel region, as
// the MoE does): activations prepared once for a weight geometry (int8-quantized for q8/q4
// weights), then any thread multiplies any row-tile range of any weight of that geometry.
class MatMulInput {
 public:
  // x [n_tok, w.cols] (row stride ldx) for weights with w's format, cols and group. Keeps the
  // x pointer; rows are prepared by PrepareRows or PrepareRowsFrom (all of them before any
  // Multiply). x may be null when every row comes from PrepareRowsFrom.
  // Multiplies with `kernels` (kept; they outlive the input's use).
  void Reset(const simd::KernelTable& kernels, const simd::WeightRef& w, const float* x, size_t ldx, size_t n_tok);
  // Prepares tokens [t0, t1); threads may prepare disjoint ranges at once.
  void PrepareRows(size_t t0, size_t t1);
  // Whether w's inputs are quantized exactly as this input's (same format, cols and group), so
  // that rows prepared here serve w too.
  bool SharesQuantization(const simd::WeightRef& w) const;
  // Prepares tokens [t0, t1) as copies of the prepared rows src_rows[t] of `source`, an input
  // that SharesQuantization(w) for this one's w (the MoE quantizes each token once, then gathers
  // its int8 row for every expert it was routed to). Same results as PrepareRows on the rows.
  void PrepareRowsFrom(const MatMulInput& source, const uint32_t* src_rows, size_t t0, size_t t1);
  // y[t * ldy + r] for the rows of row tiles [tile_begin, tile_end) of w and every token, in the
  // calling thread's scratch (Workspace::thread: the kernels' own, and a row tile decoded to fp32
  // for weights stored as bf16, f16 or mxfp8).
  void Multiply(const simd::WeightRef& w, size_t tile_begin, size_t tile_end, float* y, size_t ldy,
                Workspace::PerThread& scratch) const;
  size_t n_tok() const { return n_tok_; }

 private:
  const simd::KernelTable* kernels_ = nullptr;
  bool quantized_ = false, q8_ = false;
  size_t cols_ = 0, group_ = 0, padded_ = 0, groups_ = 0;
  const float* x_ = nullptr;
  size_t ldx_ = 0, n_tok_ = 0;
  AlignedBuffer<int8_t> q_;
  AlignedBuffer<float> scale_;
  AlignedBuffer<int32_t> sum_;
  AlignedBuffer<uint8_t> shift_;  // q8 only
};

// out[t, :] = W[ids[t], :] (embedding lookup, exact).
void GatherRows(const simd::WeightRef& w, const int32_t* ids, size_t n, float* out);

}  // namespace m3
