// Kernels of the attention caches (dispatched, with scalar references in m3::simd::ref):
// the lightning-indexer scan over index-key pages and the storage codecs of KV rows.
// The cache layouts they read are in cache_format.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/cache_format.h"

namespace m3::simd {

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

// One key block of online-softmax attention for n_rows query rows (a query and head each). Row r
// (q + r * ldq, dim values) sees the block's first n_keys[r] keys (kt: [dim][ldk] transposed, so
// n_keys[r] <= ldk; v: [keys][ldv]); a row with 0 keys is left untouched. With s_u = KeyScores(r, u)
// * scale, m' = max(run_max[r], max_u s_u) and c = exp(run_max[r] - m') (0 on a first block, whose
// run_max is -inf):
//   run_sum[r] = run_sum[r] * c + sum_u exp(s_u - m'),
//   acc[r]     = acc[r] * c (skipped when c == 1) + sum_u exp(s_u - m') * v_u  (fma per key, u in order),
//   run_max[r] = m'.
// p ([n_rows][ldp], ldp >= every n_keys[r]) is scratch for the exp'd scores. Each step rounds as
// KeyScores, Scale, MaxValue, ExpShiftSum, Scale and MatMulAccumulate (kernels.h) do on the same
// target, so a row's bits never depend on the other rows (a NaN score stays NaN through the sum).
void AttendBlock(const float* q, size_t ldq, size_t n_rows, const float* kt, size_t ldk, const size_t* n_keys,
                 const float* v, size_t ldv, size_t dim, float scale, float* p, size_t ldp, float* run_max,
                 float* run_sum, float* acc, size_t ld_acc);

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
// The composition of the ref:: kernels of kernels.h, in AttendBlock's order.
void AttendBlock(const float* q, size_t ldq, size_t n_rows, const float* kt, size_t ldk, const size_t* n_keys,
                 const float* v, size_t ldv, size_t dim, float scale, float* p, size_t ldp, float* run_max,
                 float* run_sum, float* acc, size_t ld_acc);
void EncodeBf16(const float* x, size_t n, uint16_t* out);
void DecodeBf16(const uint16_t* x, size_t n, float* out);
float EncodeInt8(const float* x, size_t n, int8_t* out);
void DecodeInt8(const int8_t* x, size_t n, float scale, float* out);
}  // namespace ref

}  // namespace m3::simd
