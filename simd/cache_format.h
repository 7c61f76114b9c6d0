// Storage layouts of the attention caches, shared by the kernels that read them (attention_kernels.h)
// and the cache pages that hold them (lib/ops/attention_cache.h). Plain data and exact names only:
// this header, like weight_format.h, is the "layout" part of the simd layer that layers beside it
// (format, ops, model) may include without seeing a kernel.
//
// Cache storage types: fp32 (exact), bf16 (round to nearest even), int8 (one fp32 scale per
// stored vector, amax / 127, codes round(x / scale)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace m3::simd {

enum class CacheType : uint8_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };

inline const char* CacheTypeName(CacheType t) {  // "f32", "bf16", "int8"
  switch (t) {
    case CacheType::kF32: return "f32";
    case CacheType::kBF16: return "bf16";
    case CacheType::kInt8: return "int8";
  }
  return "?";
}

inline bool ParseCacheType(const char* name, CacheType* out) {  // false for an unknown name
  for (CacheType t : {CacheType::kF32, CacheType::kBF16, CacheType::kInt8})
    if (std::strcmp(name, CacheTypeName(t)) == 0) return *out = t, true;
  return false;
}

constexpr size_t CacheTypeBytes(CacheType t) {  // bytes per stored value
  return t == CacheType::kF32 ? 4 : t == CacheType::kBF16 ? 2 : 1;
}

// One page of index keys stored transposed in panels of `ld` keys: value d of key u at
// (u / ld) * dim * ld + d * ld + u % ld, so one vector load takes the same dimension of
// consecutive keys and a panel is read front to back. int8 keys have one scale per key.
struct IndexKeyPage {
  CacheType type = CacheType::kF32;
  const void* data = nullptr;
  const float* scales = nullptr;  // int8 only: [n_keys]
  size_t ld = 0;                  // keys per panel (per stored dimension row of a panel)
  size_t dim = 0;
  size_t n_keys = 0;
};

}  // namespace m3::simd
