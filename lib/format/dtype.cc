#include "format/dtype.h"

#include <array>
#include <utility>

namespace m3 {
namespace {
struct DTypeEntry {
  DType type;
  const char* name;
  size_t size;
};
constexpr std::array<DTypeEntry, 16> kDTypes = {{
    {DType::kF64, "F64", 8},     {DType::kF32, "F32", 4},         {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},   {DType::kF8E4M3, "F8_E4M3", 1},  {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kF8E8M0, "F8_E8M0", 1}, {DType::kU8, "U8", 1},        {DType::kI8, "I8", 1},
    {DType::kU16, "U16", 2},     {DType::kI16, "I16", 2},         {DType::kU32, "U32", 4},
    {DType::kI32, "I32", 4},     {DType::kU64, "U64", 8},         {DType::kI64, "I64", 8},
    {DType::kBool, "BOOL", 1},
}};
}  // namespace

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& e : kDTypes)
    if (name == e.name) return e.type;
  return std::nullopt;
}

const char* DTypeName(DType d) {
  for (const auto& e : kDTypes)
    if (e.type == d) return e.name;
  return "?";
}

size_t DTypeSize(DType d) {
  for (const auto& e : kDTypes)
    if (e.type == d) return e.size;
  return 0;
}

}  // namespace m3
