// Highway implementations of attention_kernels.h, compiled per SIMD target, dispatched at run time.
#include <algorithm>
#include <cmath>
#include <limits>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "attention_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace m3::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// N consecutive keys' value of one dimension, as fp32.
template <CacheType kType>
HWY_INLINE hn::Vec<DF> LoadKeys(const void* data, size_t i) {
  const DF df;
  if constexpr (kType == CacheType::kF32) {
    return hn::LoadU(df, static_cast<const float*>(data) + i);
  } else if constexpr (kType == CacheType::kBF16) {
    const hn::RebindToUnsigned<DF> du32;
    const hn::Rebind<uint16_t, DF> du16;
    const auto bits = hn::PromoteTo(du32, hn::LoadU(du16, static_cast<const uint16_t*>(data) + i));
    return hn::BitCast(df, hn::ShiftLeft<16>(bits));
  } else {
    const hn::RebindToSigned<DF> di32;
    const hn::Rebind<int8_t, DF> di8;
    return hn::ConvertTo(df, hn::PromoteTo(di32, hn::LoadU(di8, static_cast<const int8_t*>(data) + i)));
  }
}

// Up to 2 query rows against kCols vectors of keys per step. With 8 vectors a step reads whole
// 512-byte rows of a 128-key fp32 page front to back (narrower steps stride through the page and
// ran 5x slower, waiting on memory); 2 x 8 independent accumulators keep both FMA pipes busy, and
// each key vector loaded feeds both rows. GCC keeps the arrays in registers only when the loops
// are unrolled.
template <CacheType kType, int kRows, int kCols>
HWY_INLINE size_t ScoreRows(const float* HWY_RESTRICT q, size_t ldq, const IndexKeyPage& page, size_t u0,
                            size_t u_end, hn::Vec<DF>* mx) {
  const DF df;
  const size_t N = hn::Lanes(df);
  for (; u0 + kCols * N <= u_end; u0 += kCols * N) {
    hn::Vec<DF> acc[kRows][kCols];
#pragma GCC unroll 2
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) acc[i][c] = hn::Zero(df);
    for (size_t d = 0; d < page.dim; ++d) {
      hn::Vec<DF> k[kCols];
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) k[c] = LoadKeys<kType>(page.data, d * page.ld + u0 + c * N);
#pragma GCC unroll 2
      for (int i = 0; i < kRows; ++i) {
        const auto qv = hn::Set(df, q[i * ldq + d]);
#pragma GCC unroll 8
        for (int c = 0; c < kCols; ++c) acc[i][c] = hn::MulAdd(qv, k[c], acc[i][c]);
      }
    }
#pragma GCC unroll 2
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) {
        if constexpr (kType == CacheType::kInt8) acc[i][c] = hn::Mul(acc[i][c], hn::LoadU(df, page.scales + u0 + c * N));
        mx[i] = hn::Max(mx[i], acc[i][c]);
      }
  }
  return u0;
}

template <CacheType kType, int kRows>
HWY_INLINE void ScoreRowsAll(const float* HWY_RESTRICT q, size_t ldq, const IndexKeyPage& page, size_t u_end,
                             hn::Vec<DF>* mx) {
  const size_t u = ScoreRows<kType, kRows, 8>(q, ldq, page, 0, u_end, mx);
  ScoreRows<kType, kRows, 1>(q, ldq, page, u, u_end, mx);
}

template <CacheType kType>
void IndexScoreMaxT(const float* HWY_RESTRICT q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const size_t u_vec = page.n_keys / N * N;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (size_t i0 = 0; i0 < n_q; i0 += 2) {
    const int rows = static_cast<int>(std::min<size_t>(2, n_q - i0));
    hn::Vec<DF> mx[2] = {hn::Set(df, neg_inf), hn::Set(df, neg_inf)};
    const float* qi = q + i0 * ldq;
    if (rows == 2)
      ScoreRowsAll<kType, 2>(qi, ldq, page, u_vec, mx);
    else
      ScoreRowsAll<kType, 1>(qi, ldq, page, u_vec, mx);
    for (int i = 0; i < rows; ++i) {
      float m = hn::GetLane(hn::MaxOfLanes(df, mx[i]));
      // Tail keys one at a time, with the reference's operations.
      for (size_t u = u_vec; u < page.n_keys; ++u) {
        float s = 0.0f;
        for (size_t d = 0; d < page.dim; ++d) s = std::fma(qi[i * ldq + d], ref::IndexKeyValue(page, d, u), s);
        if constexpr (kType == CacheType::kInt8) s *= page.scales[u];
        m = std::max(m, s);
      }
      out[i0 + static_cast<size_t>(i)] = m;
    }
  }
}

void IndexScoreMaxImpl(const float* q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out) {
  switch (page.type) {
    case CacheType::kF32: return IndexScoreMaxT<CacheType::kF32>(q, ldq, n_q, page, out);
    case CacheType::kBF16: return IndexScoreMaxT<CacheType::kBF16>(q, ldq, n_q, page, out);
    case CacheType::kInt8: return IndexScoreMaxT<CacheType::kInt8>(q, ldq, n_q, page, out);
  }
}

// Rows [0, kRows) of q against kCols vectors of fp32 keys from u0 (transposed): all dimensions.
// 2 rows x 8 vectors: a step reads whole 512-byte rows of a 128-key page front to back (the first
// row pair streams the page from memory, the next pairs find it in L2; 4 x 4 steps strided
// through it and waited on memory). `lanes` < N stores only the first lanes of the last vector.
template <int kRows, int kCols>
HWY_INLINE void KeyScoreSteps(const float* HWY_RESTRICT q, size_t ldq, const float* HWY_RESTRICT kt, size_t ldk,
                              size_t dim, size_t u0, size_t lanes, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  hn::Vec<DF> acc[kRows][kCols];
#pragma GCC unroll 2
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) acc[i][c] = hn::Zero(df);
  for (size_t d = 0; d < dim; ++d) {
    hn::Vec<DF> k[kCols];
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) k[c] = hn::LoadU(df, kt + d * ldk + u0 + c * N);
#pragma GCC unroll 2
    for (int i = 0; i < kRows; ++i) {
      const auto qv = hn::Set(df, q[i * ldq + d]);
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) acc[i][c] = hn::MulAdd(qv, k[c], acc[i][c]);
    }
  }
  HWY_ALIGN float last[HWY_MAX_BYTES / sizeof(float)];
#pragma GCC unroll 2
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) {
      float* o = out + i * ldo + u0 + c * N;
      if (lanes == N) {
        hn::StoreU(acc[i][c], df, o);
      } else {
        hn::Store(acc[i][c], df, last);
        std::copy_n(last, lanes, o);
      }
    }
}

template <int kRows>
HWY_INLINE void KeyScoreRows(const float* HWY_RESTRICT q, size_t ldq, const float* HWY_RESTRICT kt, size_t ldk,
                             size_t n_keys, size_t dim, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t u = 0;
  for (; u + 8 * N <= n_keys; u += 8 * N) KeyScoreSteps<kRows, 8>(q, ldq, kt, ldk, dim, u, N, out, ldo);
  for (; u + N <= n_keys; u += N) KeyScoreSteps<kRows, 1>(q, ldq, kt, ldk, dim, u, N, out, ldo);
  if (u < n_keys && u + N <= ldk) {  // a partial vector whose lanes are inside the stored rows
    KeyScoreSteps<kRows, 1>(q, ldq, kt, ldk, dim, u, n_keys - u, out, ldo);
    return;
  }
  for (; u < n_keys; ++u)  // the reference's operations
    for (int i = 0; i < kRows; ++i) {
      float s = 0.0f;
      for (size_t d = 0; d < dim; ++d) s = std::fma(q[i * ldq + d], kt[d * ldk + u], s);
      out[i * ldo + u] = s;
    }
}

void KeyScoresImpl(const float* HWY_RESTRICT q, size_t ldq, size_t n_q, const float* HWY_RESTRICT kt, size_t ldk,
                   size_t n_keys, size_t dim, float* HWY_RESTRICT out, size_t ldo) {
  size_t i = 0;
  for (; i + 2 <= n_q; i += 2) KeyScoreRows<2>(q + i * ldq, ldq, kt, ldk, n_keys, dim, out + i * ldo, ldo);
  if (i < n_q) KeyScoreRows<1>(q + i * ldq, ldq, kt, ldk, n_keys, dim, out + i * ldo, ldo);
}

void DecodeBf16Impl(const uint16_t* HWY_RESTRICT x, size_t n, float* HWY_RESTRICT out) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(LoadKeys<CacheType::kBF16>(x, i), df, out + i);
  ref::DecodeBf16(x + i, n - i, out + i);
}

void DecodeInt8Impl(const int8_t* HWY_RESTRICT x, size_t n, float scale, float* HWY_RESTRICT out) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const auto s = hn::Set(df, scale);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(LoadKeys<CacheType::kInt8>(x, i), s), df, out + i);
  ref::DecodeInt8(x + i, n - i, scale, out + i);
}

}  // namespace HWY_NAMESPACE
}  // namespace m3::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace m3::simd {

HWY_EXPORT(IndexScoreMaxImpl);
HWY_EXPORT(KeyScoresImpl);
HWY_EXPORT(DecodeBf16Impl);
HWY_EXPORT(DecodeInt8Impl);

void IndexScoreMax(const float* q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out) {
  HWY_DYNAMIC_DISPATCH(IndexScoreMaxImpl)(q, ldq, n_q, page, out);
}
void KeyScores(const float* q, size_t ldq, size_t n_q, const float* kt, size_t ldk, size_t n_keys, size_t dim,
               float* out, size_t ldo) {
  HWY_DYNAMIC_DISPATCH(KeyScoresImpl)(q, ldq, n_q, kt, ldk, n_keys, dim, out, ldo);
}
void DecodeBf16(const uint16_t* x, size_t n, float* out) { HWY_DYNAMIC_DISPATCH(DecodeBf16Impl)(x, n, out); }
void DecodeInt8(const int8_t* x, size_t n, float scale, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeInt8Impl)(x, n, scale, out);
}
// Encoding runs once per stored token and head (a few hundred values): the reference is fast enough.
void EncodeBf16(const float* x, size_t n, uint16_t* out) { ref::EncodeBf16(x, n, out); }
float EncodeInt8(const float* x, size_t n, int8_t* out) { return ref::EncodeInt8(x, n, out); }

}  // namespace m3::simd
#endif  // HWY_ONCE
