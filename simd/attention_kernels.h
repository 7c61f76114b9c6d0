// Kernels of the attention caches (dispatched, with scalar references in m3::simd::ref):
// the lightning-indexer scan over index-key pages and the storage codecs of KV rows.
//
// Cache storage types: fp32 (exact), bf16 (round to nearest even), int8 (one fp32 scale per
// stored vector, amax / 127, codes round(x / scale)).
#pragma once

#include <cstddef>
#include <cstdint>

namespace m3::simd {

enum class CacheType : uint8_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };
const char* CacheTypeName(CacheType t);                  // "f32", "bf16", "int8"
bool ParseCacheType(const char* name, CacheType* out);   // false for an unknown name
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

// out[i] = max over keys u < page.n_keys of score(i, u), where score(i, u) is the dot of q row i
// (q + i * ldq, page.dim values) with key u, accumulated with one fma per dimension in order
// d = 0, 1, ... (int8: times the key's scale afterwards). -inf when the page has no key.
// Every score is computed the same way for any n_q, so prefill and decode agree bit for bit.
void IndexScoreMax(const float* q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out);

// out[i * ldo + u] = sum over d of q[i * ldq + d] * kt[d * ldk + u] for i < n_q, u < n_keys: the
// Q.K^T of attention against keys transposed ([dim][keys]), one fma per dimension in order
// d = 0, 1, ..., so a score never depends on n_q. Key columns up to the next vector boundary may
// be read when that stays inside ldk (their results are dropped).
void KeyScores(const float* q, size_t ldq, size_t n_q, const float* kt, size_t ldk, size_t n_keys, size_t dim,
               float* out, size_t ldo);

// Storage codecs of one vector of n values.
void EncodeBf16(const float* x, size_t n, uint16_t* out);        // round to nearest even
void DecodeBf16(const uint16_t* x, size_t n, float* out);
// Returns the scale: 0 for all zeros; NaN (codes 0) where x holds a NaN or inf, so that the row
// decodes to NaN and is never silently finite.
float EncodeInt8(const float* x, size_t n, int8_t* out);
void DecodeInt8(const int8_t* x, size_t n, float scale, float* out);

namespace ref {
float IndexKeyValue(const IndexKeyPage& page, size_t d, size_t u);  // value d of key u (int8: the code)
void IndexScoreMax(const float* q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out);
void KeyScores(const float* q, size_t ldq, size_t n_q, const float* kt, size_t ldk, size_t n_keys, size_t dim,
               float* out, size_t ldo);
void EncodeBf16(const float* x, size_t n, uint16_t* out);
void DecodeBf16(const uint16_t* x, size_t n, float* out);
float EncodeInt8(const float* x, size_t n, int8_t* out);
void DecodeInt8(const int8_t* x, size_t n, float scale, float* out);
}  // namespace ref

}  // namespace m3::simd
