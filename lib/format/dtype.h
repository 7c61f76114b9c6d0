// safetensors element types.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace m3 {

enum class DType { kF64, kF32, kF16, kBF16, kF8E4M3, kF8E5M2, kF8E8M0, kU8, kI8, kU16, kI16, kU32, kI32, kU64, kI64, kBool };

std::optional<DType> ParseDType(std::string_view name);
const char* DTypeName(DType d);
size_t DTypeSize(DType d);

}  // namespace m3
