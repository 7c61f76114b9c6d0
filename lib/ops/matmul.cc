#include "ops/matmul.h"

#include <algorithm>

#include "base/aligned_buffer.h"
#include "kernels.h"
#include "quant_kernels.h"

namespace m3 {
namespace {
// 16 decoded rows of k=6144 are 384 KiB: the tile stays in L2 while every token streams past it.
constexpr size_t kRowTile = 16;
// Tokens per inner step: keeps the activation block in L2 for large prefills.
constexpr size_t kTokenTile = 64;

// Reused per thread: decode calls this for every projection of every token.
struct ActivationScratch {
  AlignedBuffer<int8_t> q;
  AlignedBuffer<float> scale;
  AlignedBuffer<int32_t> sum;
};

// Packed q8/q4: quantize the activations once, then every thread takes a range of row tiles.
void QuantizedMatMul(const ThreadConfig& tc, const simd::WeightRef& w, const float* x, size_t ldx, size_t n_tok,
                     float* y, size_t ldy) {
  thread_local ActivationScratch scratch;
  const size_t kp = w.padded_cols(), groups = w.groups();
  scratch.q.EnsureSize(n_tok * kp);
  scratch.scale.EnsureSize(n_tok * groups);
  scratch.sum.EnsureSize(n_tok * groups);
  int8_t* q = scratch.q.data();
  float* scale = scratch.scale.data();
  int32_t* sum = scratch.sum.data();
  ParallelFor(tc, n_tok, 16, [&](size_t t0, size_t t1, int) {
    simd::QuantizeActivations(x + t0 * ldx, ldx, t1 - t0, w.cols, w.group, q + t0 * kp, scale + t0 * groups,
                              sum + t0 * groups);
  });
  const simd::QuantizedActivations a{q, scale, sum, n_tok, kp, w.group};
  ParallelFor(tc, w.row_tiles(), 1, [&](size_t tile_begin, size_t tile_end, int) {
    simd::QuantMatMul(w, a, tile_begin, tile_end, y, ldy);
  });
}

}  // namespace

void MatMul(const ThreadConfig& tc, const simd::WeightRef& w, const float* x, size_t ldx, size_t n_tok,
            float* y, size_t ldy) {
  if ((w.format == simd::WeightFormat::kQ8 || w.format == simd::WeightFormat::kQ4))
    return QuantizedMatMul(tc, w, x, ldx, n_tok, y, ldy);
  if (w.format == simd::WeightFormat::kBF16Tiled) {
    ParallelFor(tc, w.row_tiles(), 1, [&](size_t tile_begin, size_t tile_end, int) {
      simd::Bf16TiledMatMul(w, x, ldx, n_tok, tile_begin, tile_end, y, ldy);
    });
    return;
  }
  const size_t k = w.cols;
  const size_t n_tiles = (w.rows + kRowTile - 1) / kRowTile;
  // Few tokens: split rows finely so both threads get work; many tokens: any split is balanced.
  ParallelFor(tc, n_tiles, 1, [&](size_t tile_begin, size_t tile_end, int) {
    AlignedBuffer<float> decoded;
    if (w.format != simd::WeightFormat::kF32) decoded.Resize(kRowTile * k);
    for (size_t tile = tile_begin; tile < tile_end; ++tile) {
      const size_t r0 = tile * kRowTile;
      const size_t nr = std::min(kRowTile, w.rows - r0);
      const float* a;
      if (w.format == simd::WeightFormat::kF32) {
        a = static_cast<const float*>(w.data) + r0 * k;
      } else {
        simd::DecodeRows(w, r0, nr, decoded.data());
        a = decoded.data();
      }
      for (size_t t0 = 0; t0 < n_tok; t0 += kTokenTile) {
        const size_t nt = std::min(kTokenTile, n_tok - t0);
        simd::MatMulF32(a, k, nr, x + t0 * ldx, ldx, nt, k, y + t0 * ldy + r0, ldy);
      }
    }
  });
}

void GatherRows(const simd::WeightRef& w, const int32_t* ids, size_t n, float* out) {
  for (size_t t = 0; t < n; ++t) simd::DecodeRows(w, static_cast<size_t>(ids[t]), 1, out + t * w.cols);
}

}  // namespace m3
