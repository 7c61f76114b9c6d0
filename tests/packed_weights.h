// Random weight matrices packed into the engine's formats, for operator tests.
#pragma once

#include <algorithm>
#include <deque>
#include <vector>

#include "test_util.h"
#include "simd/weight_pack.h"

namespace m3::test {

// Owns the matrices' storage (a deque: earlier matrices stay put as more are added).
class PackedWeights {
 public:
  // RandomVec(rows * cols, seed, scale) as a rows x cols matrix in format f: f32 as it is, the
  // tiled formats packed (group 0: the format's default).
  simd::WeightRef Random(simd::WeightFormat f, size_t rows, size_t cols, uint32_t seed, float scale,
                         size_t group = 0) {
    f32_.push_back(RandomVec(rows * cols, seed, scale));
    if (f == simd::WeightFormat::kF32) return simd::WeightRef{f, f32_.back().data(), nullptr, rows, cols};
    simd::WeightRef w = simd::TiledShape(f, rows, cols, group);
    std::vector<float> padded(w.row_tiles() * simd::kTileRows * cols, 0.0f);
    std::copy(f32_.back().begin(), f32_.back().end(), padded.begin());
    codes_.emplace_back(simd::TiledCodeBytes(w));
    scales_.emplace_back(std::max<size_t>(1, simd::TiledScaleBytes(w)));
    REQUIRE(simd::PackRowTiles(w, padded.data(), 0, w.row_tiles(), codes_.back().data(), scales_.back().data()));
    w.data = codes_.back().data();
    w.scales = scales_.back().data();
    return w;
  }

 private:
  std::deque<std::vector<float>> f32_;
  std::deque<std::vector<uint8_t>> codes_, scales_;
};

}  // namespace m3::test
