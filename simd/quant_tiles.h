// Internal to m3_simd: the row-tile driver the integer matmul kernels share. A tile kernel
// computes one row tile (16 rows) for a block of at most max_tok tokens; the driver cuts the
// tokens into blocks, builds each block's per-group tables (bias and activation scale), calls the
// kernel per row tile and block, applies the q8 row and token scales and stores the rows. Highway's
// bodies (quant_kernels.cc, superblock_kernels.cc) and ARM's sdot / usmmla kernels
// (quant_kernels_arm.cc) run under it; the VNNI and AMX kernels (quant_kernels_x86.h) keep their own
// multi-tile loops and use its tables.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/quant_kernels.h"
#include "simd/weight_format.h"

namespace m3::simd::detail {

// A core's L2 (Zen 4, Cascade Lake): inputs and outputs larger than this come from / go to
// memory, where the kernels prefetch and stream.
inline constexpr size_t kCoreL2Bytes = size_t{1} << 20;

// n tokens in the fewest blocks of at most max_tok, their sizes as equal as possible (they differ
// by one at most): 512 tokens in blocks of up to 6 are 82 of 6 and 4 of 5, not 85 of 6 and a
// 2-token block the kernels run at a fraction of their speed, and 13 are 4 + 4 + 5, not 6 + 6 + 1.
struct TokenBlocks {
  size_t n, count;
  TokenBlocks(size_t n_tok, size_t max_tok) : n(n_tok), count((n_tok + max_tok - 1) / max_tok) {}
  size_t begin(size_t block) const { return block * n / count; }  // block <= count
};
// Per token block, [group][token] tables the kernels read with scalar broadcasts (block b's at
// [begin(b) * groups]): bias = -zero * (sum of the group's activation codes), da = the
// activation's group scale d_a (q4, q3, q2) or its negated shift -e_a (q8).
void FillQuantTables(const QuantizedActivations& a, const TokenBlocks& blocks, int32_t zero, int32_t* bias, float* da);
// q8: y[t][i] *= s_w[i] * s_a[t] for t < n_tok, i < 16 (row_scales: 16 fp32, any alignment).
void ApplyQ8RowScales(const uint8_t* row_scales, const float* token_scales, size_t n_tok, float (*y)[16]);

// One row tile x one token block: the kernel's operands.
struct TileArgs {
  WeightFormat format;
  const uint8_t* w;          // the tile's codes
  const uint16_t* q4_scales;  // q4: fp16 d_w [groups][16]
  const uint8_t* q8_shifts;  // q8: u8 e_w [groups][16]
  const uint16_t* sb_d;      // q3/q2: fp16 d [groups][16]
  const uint16_t* sb_dmin;   // q3/q2: fp16 dmin [groups][16]
  const uint8_t* sb_sub;     // q3/q2: u8 sc | mn << 4 [groups][8][16]
  const int8_t* q;           // activation codes of the block's first token (token t at q + t * ldq)
  size_t ldq;
  const int32_t* bias;  // [groups][T]: -zero * (sum of the group's activation codes)
  const float* da;      // [groups][T]: q4, q3, q2 d_a; q8 -e_a
  const int16_t* asum;  // q3/q2: the block's first token's sub-block sums of activation codes [groups * 8]
  size_t ldsum;         // token t's at asum + t * ldsum
  size_t groups, G;
};

// The most tokens a tile kernel takes at once (yacc's rows).
inline constexpr int kMaxTileTokens = 8;

// A tile kernel: yacc[t][i] (zeroed by the driver) for token t < nt and tile row i, before the q8
// row and token scales (which the driver applies).
struct TileKernel {
  void (*block)(const TileArgs& b, int nt, float (*yacc)[16]);
  int max_tok;     // 1..kMaxTileTokens
  bool signed_q8;  // q8 codes read as code - 128 (bias 0), else unsigned with bias -128 x sum
};

// QuantMatMul (quant_kernels.h) for w of any integer format through `kernel`. Tables in scratch
// slots 0-2.
void QuantMatMulByTiles(const TileKernel& kernel, const WeightRef& w, const QuantizedActivations& a, size_t tile_begin,
                        size_t tile_end, float* y, size_t ldy, KernelScratch& scratch);

}  // namespace m3::simd::detail
