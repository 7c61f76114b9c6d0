#include "ops/matmul.h"

#include <algorithm>

#include "base/aligned_buffer.h"
#include "kernels.h"

namespace m3 {
namespace {
// 16 decoded rows of k=6144 are 384 KiB: the tile stays in L2 while every token streams past it.
constexpr size_t kRowTile = 16;
// Tokens per inner step: keeps the activation block in L2 for large prefills.
constexpr size_t kTokenTile = 64;
}  // namespace

void MatMul(const ThreadConfig& tc, const simd::WeightRef& w, const float* x, size_t ldx, size_t n_tok,
            float* y, size_t ldy) {
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
