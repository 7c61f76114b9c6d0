// The row-tile driver of the integer matmuls and its tables (quant_tiles.h). Plain C++ compiled
// once: the per-target work is in the tile kernels it calls, once per row tile and token block
// (thousands of cycles each).
#include "simd/quant_tiles.h"

#include <algorithm>
#include <cstring>

namespace m3::simd::detail {

void FillQuantTables(const QuantizedActivations& a, const TokenBlocks& blocks, int32_t zero, int32_t* bias, float* da) {
  const size_t groups = a.groups();
  for (size_t block = 0; block < blocks.count; ++block) {
    const size_t t0 = blocks.begin(block), nt = blocks.begin(block + 1) - t0;
    for (size_t t = 0; t < nt; ++t)
      for (size_t g = 0; g < groups; ++g) {
        bias[t0 * groups + g * nt + t] = -zero * a.sum[(t0 + t) * groups + g];
        da[t0 * groups + g * nt + t] =
            a.shift ? -static_cast<float>(a.shift[(t0 + t) * groups + g]) : a.scale[(t0 + t) * groups + g];
      }
  }
}

void ApplyQ8RowScales(const uint8_t* row_scales, const float* token_scales, size_t n_tok, float (*y)[16]) {
  float s_w[kTileRows];
  std::memcpy(s_w, row_scales, sizeof(s_w));
  for (size_t t = 0; t < n_tok; ++t)
    for (size_t i = 0; i < kTileRows; ++i) y[t][i] *= s_w[i] * token_scales[t];
}

void QuantMatMulByTiles(const TileKernel& kernel, const WeightRef& w, const QuantizedActivations& a, size_t tile_begin,
                        size_t tile_end, float* y, size_t ldy, KernelScratch& scratch) {
  tile_end = std::min(tile_end, w.row_tiles());
  if (tile_begin >= tile_end || a.n_tok == 0) return;
  const bool q8 = w.format == WeightFormat::kQ8, super_block = IsSuperBlock(w.format);
  const int32_t zero = w.format == WeightFormat::kQ4 ? kQ4Zero : q8 && !kernel.signed_q8 ? kQ8Zero : 0;
  const size_t groups = w.groups(), subs = super_block ? groups * kSubGroups : 0;
  // Batches of at most 768 tokens bound the tables for long prompts; one batch's, taken once.
  constexpr size_t kBatch = 768;
  const size_t n_max = std::min(kBatch, a.n_tok);
  int32_t* const bias = scratch.Array<int32_t>(0, n_max * groups);
  float* const da = scratch.Array<float>(1, n_max * groups);
  int16_t* const asum = super_block ? scratch.Array<int16_t>(2, n_max * subs) : nullptr;
  const auto* data = static_cast<const uint8_t*>(w.data);
  for (size_t b0 = 0; b0 < a.n_tok; b0 += kBatch) {
    QuantizedActivations part = a;
    part.q += b0 * a.padded_cols;
    part.scale += b0 * (q8 ? 1 : groups);
    part.sum += b0 * groups;
    if (q8) part.shift += b0 * groups;
    part.n_tok = std::min(kBatch, a.n_tok - b0);
    const TokenBlocks blocks(part.n_tok, static_cast<size_t>(kernel.max_tok));
    FillQuantTables(part, blocks, zero, bias, da);
    for (size_t t = 0; super_block && t < part.n_tok; ++t)  // |sum| <= 32 * 127: int16
      for (size_t s = 0; s < subs; ++s) {
        int32_t v = 0;
        for (size_t i = 0; i < kSubGroup; ++i) v += part.q[t * a.padded_cols + s * kSubGroup + i];
        asum[t * subs + s] = static_cast<int16_t>(v);
      }
    for (size_t tile = tile_begin; tile < tile_end; ++tile) {
      const size_t rows = std::min(w.rows, (tile + 1) * kTileRows) - tile * kTileRows;
      TileArgs b{};
      b.format = w.format;
      b.w = data + tile * w.tile_bytes();
      if (w.format == WeightFormat::kQ4) b.q4_scales = w.tile_scales(tile);
      if (q8) b.q8_shifts = w.q8_shifts(tile);
      if (super_block) {
        b.sb_d = w.sb_d(tile);
        b.sb_dmin = w.sb_dmin(tile);
        b.sb_sub = w.sb_sub(tile);
        b.ldsum = subs;
      }
      b.ldq = a.padded_cols;
      b.groups = groups;
      b.G = w.group;
      for (size_t block = 0; block < blocks.count; ++block) {
        const size_t t0 = blocks.begin(block);
        const int nt = static_cast<int>(blocks.begin(block + 1) - t0);
        b.q = part.q + t0 * a.padded_cols;
        b.bias = bias + t0 * groups;
        b.da = da + t0 * groups;
        if (super_block) b.asum = asum + t0 * subs;
        float yacc[kMaxTileTokens][16];
        std::memset(yacc, 0, sizeof(yacc[0]) * static_cast<size_t>(nt));
        kernel.block(b, nt, yacc);
        if (q8) ApplyQ8RowScales(w.q8_row_scales(tile), part.scale + t0, static_cast<size_t>(nt), yacc);
        for (int t = 0; t < nt; ++t)
          std::memcpy(y + (b0 + t0 + t) * ldy + tile * kTileRows, yacc[t], rows * sizeof(float));
      }
    }
  }
}

}  // namespace m3::simd::detail
