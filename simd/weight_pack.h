// Quantizers that write the tiled weight formats of weight_format.h (m3 pack, tests, benchmarks).
//
// q8: per row one fp32 scale s and per (row, group of 128 inputs) a shift e, the largest with
//     amax_g * 2^e <= 127 s (so a group's step s 2^-e is within 2x of amax_g / 127); codes
//     round(x / (s 2^-e)) + 128. s is the one of 32 candidates in [rowmax/127, 2 rowmax/127)
//     that gives the row's groups the smallest sum of squared steps.
// q4: per (row, group of 32 inputs) one fp16 scale chosen by a small search that minimises the
//     squared reconstruction error of the group; the candidates include llama.cpp's Q4_0 choice
//     (d = max / -8), so the error is never larger than Q4_0's at the same 4.5 bits per weight.
// q3 / q2: per sub-block of 32 a float scale and min fitted by least squares on its codes (from
//     the range and steps of 0.7-1.25 times it), then per super-block of 256 fp16 d and dmin and the
//     4-bit scales and mins, the best of a few d near max / 15; then d and dmin refitted by least
//     squares on the chosen integers and each sub-block's 4-bit scale and min re-chosen among
//     its neighbours, while the error falls.
// Importance (m3 pack --imatrix): q4, q3 and q2 minimise sum_i imp[i] (w_i - q_i)^2 instead of
//     the plain squared error, imp[i] being the mean square of input i over calibration tokens:
//     the expected squared error of the matrix's outputs. q8 (error ~1e-5) ignores it.
// bf16 (tiled): round to nearest even.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/weight_format.h"

namespace m3::simd {

// Packs row tiles [tile0, tile0 + n_tiles) of `shape`. `src` holds the fp32 rows of those tiles,
// row-major with stride shape.cols, starting at row tile0 * 16 (a final partial tile has only
// the rows that exist). Writes n_tiles * shape.tile_bytes() bytes to `codes` and, for q8/q4,
// n_tiles * shape.tile_scale_bytes() bytes of scales to `scales`. Padding rows and inputs are zero.
// Returns false (writing nothing useful) when a value is not finite or a scale overflows fp16.
// `importance` (nullable): shape.cols non-negative weights of the inputs' errors (see above).
bool PackRowTiles(const WeightRef& shape, const float* src, size_t tile0, size_t n_tiles, uint8_t* codes,
                  uint8_t* scales, const float* importance = nullptr);

// Reconstruction of n values (n % 32 == 0) through llama.cpp's Q4_0 (fp16 d = max / -8 per 32,
// codes min(15, (int)(x / d + 8.5))): the baseline the q4 quality test compares against.
void ReconstructQ4_0(const float* x, size_t n, float* out);

// The q4 choice for one group: codes in -8..7 and the fp16 scale bits; returns the squared error
// (weighted by `importance[0..n)` when given).
double QuantizeQ4Group(const float* x, const float* importance, size_t n, int8_t* q, uint16_t* scale_bits);

// The q3/q2 choice for one super-block of kSuperGroup values, the first `valid` of them real (the
// rest padding, zero, fitted by nothing and coded nearest zero): codes 0..2^bits-1, fp16 d and
// dmin bits, sub-block bytes sc | mn << 4; returns the squared error over the valid values,
// weighted by `importance[0..valid)` when given (d or dmin 0x7C00 when fp16 overflowed).
double QuantizeSuperBlock(const float* x, const float* importance, size_t valid, int bits, uint8_t* codes,
                          uint16_t* d_bits, uint16_t* dmin_bits, uint8_t* sub);
// ORs super-block codes c[kSuperGroup] of tile row tr into a zeroed super-block of a row tile.
void PlaceSuperBlockCodes(WeightFormat f, const uint8_t* c, size_t tr, uint8_t* super_block);

}  // namespace m3::simd
