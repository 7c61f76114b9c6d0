// NumPy .npy files (version 1.0, little-endian float32/float64, C order): the exchange format of
// `m3 logits` and the golden data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace m3 {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;  // converted to float32
};

Status WriteNpyF32(const std::string& path, const float* data, const std::vector<int64_t>& shape);
StatusOr<NpyArray> ReadNpy(const std::string& path);

}  // namespace m3
