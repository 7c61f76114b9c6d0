// Whole-array conversions the model layer needs outside the forward pass's operators: exact decode of
// stored weights to fp32, quantization into the kernels' row tiles (m3 pack), finiteness scans and
// the residual add. The model reaches kernels only through ops; these are the thin ones.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/weight_format.h"

namespace m3 {

// out[r, c] = w[row0 + r, c] exactly, for n_rows rows of w.cols values (padding dropped).
void DecodeWeightRows(const simd::WeightRef& w, size_t row0, size_t n_rows, float* out);

// Quantizes n_tiles row tiles of fp32 rows (kTileRows x shape.cols each, tile0 first) into the
// layout of `shape` (q8, q4, q3, q2 or bf16 tiles), weighing each input's error by
// `importance[0..shape.cols)` when given (q4, q3, q2). False when a value does not fit the format
// (NaN, inf, or a group beyond an fp16 scale); see simd/weight_pack.h.
bool PackWeightTiles(const simd::WeightRef& shape, const float* rows, size_t tile0, size_t n_tiles, uint8_t* codes,
                     uint8_t* scales, const float* importance = nullptr);

// Index of the first NaN or +-inf in x[0, n); n when all are finite.
size_t FindNonFinite(const float* x, size_t n);

// y[i] += x[i] for i < n.
void AddInPlace(const float* x, float* y, size_t n);

}  // namespace m3
