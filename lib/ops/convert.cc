#include "ops/convert.h"

#include "simd/kernels.h"
#include "simd/weight_pack.h"

namespace m3 {

void DecodeWeightRows(const simd::WeightRef& w, size_t row0, size_t n_rows, float* out) {
  simd::DecodeRows(w, row0, n_rows, out);
}

bool PackWeightTiles(const simd::WeightRef& shape, const float* rows, size_t tile0, size_t n_tiles, uint8_t* codes,
                     uint8_t* scales, const float* importance) {
  return simd::PackRowTiles(shape, rows, tile0, n_tiles, codes, scales, importance);
}

size_t FindNonFinite(const float* x, size_t n) { return simd::FindNonFinite(x, n); }

void AddInPlace(const float* x, float* y, size_t n) { simd::Axpy(1.0f, x, y, n); }

}  // namespace m3
