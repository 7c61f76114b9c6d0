// Highway implementations of attention_kernels.h, compiled per SIMD target, dispatched at run time.
#include <algorithm>
#include <cmath>
#include <limits>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/attention_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "simd/row_ops-inl.h"
#include "simd/attention_kernels.h"

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

#if HWY_TARGET != HWY_SCALAR
// kCols vectors of bf16 keys in pairs: one load of 2N keys; the even keys (low halves) shifted
// up and the odd ones masked make two fp32 vectors in 2 simple ops where widening takes 4. With 4
// query rows the scan is FMA bound (one FMA per 2 bytes of bf16 keys; ~26 GB/s per Zen 4 core
// from cache), and the widening took shuffle slots from it: this is ~6% faster. The lanes hold
// the keys out of order, which a maximum over them does not see.
template <int kCols>
HWY_INLINE void LoadBf16Pairs(const uint16_t* HWY_RESTRICT keys, hn::Vec<DF>* k) {
  const DF df;
  const hn::RebindToUnsigned<DF> du32;
  const hn::Repartition<uint16_t, DF> du16;
  const size_t N = hn::Lanes(df);
  const auto high = hn::Set(du32, 0xFFFF0000u);
#pragma GCC unroll 2
  for (int c = 0; c < kCols; c += 2) {
    const auto bits = hn::BitCast(du32, hn::LoadU(du16, keys + c * N));
    k[c] = hn::BitCast(df, hn::ShiftLeft<16>(bits));
    k[c + 1] = hn::BitCast(df, hn::And(bits, high));
  }
}
#endif

// Up to 4 query rows against kCols key vectors of one panel per step, all dimensions. A 64-key
// panel row is 4 vectors (AVX-512): a step reads the panel front to back in one pass for all 4
// index heads of a decode token (4 x 4 accumulators keep both FMA pipes busy). Steps that skip
// parts of each stored row, or a second pass for more heads, left memory idle. GCC keeps the
// arrays in registers only when the loops are unrolled.
template <CacheType kType, int kRows, int kCols>
HWY_INLINE size_t ScoreRows(const float* HWY_RESTRICT q, size_t ldq, const IndexKeyPage& panel, size_t u0,
                            size_t u_end, hn::Vec<DF>* mx) {
  const DF df;
  const size_t N = hn::Lanes(df);
  for (; u0 + kCols * N <= u_end; u0 += kCols * N) {
    hn::Vec<DF> acc[kRows][kCols];
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
      for (int c = 0; c < kCols; ++c) acc[i][c] = hn::Zero(df);
    for (size_t d = 0; d < panel.dim; ++d) {
      hn::Vec<DF> k[kCols];
#if HWY_TARGET != HWY_SCALAR
      if constexpr (kType == CacheType::kBF16 && kCols % 2 == 0)
        LoadBf16Pairs<kCols>(static_cast<const uint16_t*>(panel.data) + d * panel.ld + u0, k);
      else
#endif
#pragma GCC unroll 4
        for (int c = 0; c < kCols; ++c) k[c] = LoadKeys<kType>(panel.data, d * panel.ld + u0 + c * N);
      BroadcastMulAdd<kRows, kCols>(q + d, ldq, k, acc);
    }
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
      for (int c = 0; c < kCols; ++c) {
        if constexpr (kType == CacheType::kInt8) acc[i][c] = hn::Mul(acc[i][c], hn::LoadU(df, panel.scales + u0 + c * N));
        mx[i] = hn::Max(mx[i], acc[i][c]);
      }
  }
  return u0;
}

template <CacheType kType, int kRows>
HWY_INLINE void ScorePanel(const float* HWY_RESTRICT q, size_t ldq, const IndexKeyPage& panel, float* out) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const size_t u_vec = panel.n_keys / N * N;
  hn::Vec<DF> mx[kRows];
  for (int i = 0; i < kRows; ++i) mx[i] = hn::Set(df, -std::numeric_limits<float>::infinity());
  const size_t u = ScoreRows<kType, kRows, 4>(q, ldq, panel, 0, u_vec, mx);
  ScoreRows<kType, kRows, 1>(q, ldq, panel, u, u_vec, mx);
  for (int i = 0; i < kRows; ++i) {
    float m = hn::GetLane(hn::MaxOfLanes(df, mx[i]));
    // Tail keys one at a time, with the reference's operations.
    for (size_t k = u_vec; k < panel.n_keys; ++k) {
      float s = 0.0f;
      for (size_t d = 0; d < panel.dim; ++d) s = std::fma(q[i * ldq + d], ref::IndexKeyValue(panel, d, k), s);
      if constexpr (kType == CacheType::kInt8) s *= panel.scales[k];
      m = std::max(m, s);
    }
    out[i] = std::max(out[i], m);
  }
}

template <CacheType kType>
void IndexScoreMaxT(const float* HWY_RESTRICT q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out) {
  std::fill_n(out, n_q, -std::numeric_limits<float>::infinity());
  constexpr size_t kBytes = CacheTypeBytes(kType);
  for (size_t u0 = 0; u0 < page.n_keys; u0 += page.ld) {  // panel by panel
    IndexKeyPage panel = page;
    panel.data = static_cast<const uint8_t*>(page.data) + (u0 / page.ld) * page.dim * page.ld * kBytes;
    if (page.scales) panel.scales = page.scales + u0;
    panel.n_keys = std::min(page.ld, page.n_keys - u0);
    size_t i = 0;
    for (; i + 4 <= n_q; i += 4) ScorePanel<kType, 4>(q + i * ldq, ldq, panel, out + i);
    switch (n_q - i) {
      case 3: ScorePanel<kType, 3>(q + i * ldq, ldq, panel, out + i); break;
      case 2: ScorePanel<kType, 2>(q + i * ldq, ldq, panel, out + i); break;
      case 1: ScorePanel<kType, 1>(q + i * ldq, ldq, panel, out + i); break;
      default: break;
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
// kScaled: each sum is multiplied by `scale` before the store (one rounding, as Scale on the stored
// scores would do).
template <int kRows, int kCols, bool kScaled>
HWY_INLINE void KeyScoreSteps(const float* HWY_RESTRICT q, size_t ldq, const float* HWY_RESTRICT kt, size_t ldk,
                              size_t dim, size_t u0, size_t lanes, float scale, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  hn::Vec<DF> acc[kRows][kCols];
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) acc[i][c] = hn::Zero(df);
  for (size_t d = 0; d < dim; ++d) {
    hn::Vec<DF> k[kCols];
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) k[c] = hn::LoadU(df, kt + d * ldk + u0 + c * N);
    BroadcastMulAdd<kRows, kCols>(q + d, ldq, k, acc);
  }
  HWY_ALIGN float last[HWY_MAX_BYTES / sizeof(float)];
  const auto vscale = hn::Set(df, scale);
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) {
      if constexpr (kScaled) acc[i][c] = hn::Mul(acc[i][c], vscale);
      float* o = out + i * ldo + u0 + c * N;
      if (lanes == N) {
        hn::StoreU(acc[i][c], df, o);
      } else {
        hn::Store(acc[i][c], df, last);
        std::copy_n(last, lanes, o);
      }
    }
}

// Rows [0, kRows) against keys [u0, n_keys) (kt and out still at key 0); `bound` is the stored
// keys per row of kt (ldk), the last vector that may be read whole.
template <int kRows, bool kScaled>
HWY_INLINE void KeyScoreRows(const float* HWY_RESTRICT q, size_t ldq, const float* HWY_RESTRICT kt, size_t ldk,
                             size_t u0, size_t n_keys, size_t dim, float scale, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t u = u0;
  for (; u + 8 * N <= n_keys; u += 8 * N) KeyScoreSteps<kRows, 8, kScaled>(q, ldq, kt, ldk, dim, u, N, scale, out, ldo);
  for (; u + N <= n_keys; u += N) KeyScoreSteps<kRows, 1, kScaled>(q, ldq, kt, ldk, dim, u, N, scale, out, ldo);
  if (u < n_keys && u + N <= ldk) {  // a partial vector whose lanes are inside the stored rows
    KeyScoreSteps<kRows, 1, kScaled>(q, ldq, kt, ldk, dim, u, n_keys - u, scale, out, ldo);
    return;
  }
  for (; u < n_keys; ++u)  // the reference's operations
    for (int i = 0; i < kRows; ++i) {
      float s = 0.0f;
      for (size_t d = 0; d < dim; ++d) s = std::fma(q[i * ldq + d], kt[d * ldk + u], s);
      out[i * ldo + u] = kScaled ? s * scale : s;
    }
}

// Many rows (a prefill's queries x heads against one key block): slabs of kSlabCols vectors of
// keys stay in L1 (128 dims x 64 keys: 32 KiB) while every block of kSlabRows rows passes over
// them, instead of each row pair streaming the whole block from L2. Every score is the same
// sum over d in order, so the result is the row-pair path's, bit for bit.
constexpr int kSlabRows = HWY_MAX_BYTES >= 64 ? 4 : 2;  // accumulators: 16 zmm (AVX-512) or 8
constexpr int kSlabCols = 4;
constexpr size_t kSlabMinRows = 8;

template <bool kScaled>
HWY_INLINE void KeyScoresT(const float* HWY_RESTRICT q, size_t ldq, size_t n_q, const float* HWY_RESTRICT kt,
                           size_t ldk, size_t n_keys, size_t dim, float scale, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t slab_rows = 0, slab_keys = 0;  // the part done in slabs: rows [0, slab_rows) x keys [0, slab_keys)
  if (n_q >= kSlabMinRows) {
    slab_rows = n_q / kSlabRows * kSlabRows;
    slab_keys = n_keys / (kSlabCols * N) * (kSlabCols * N);
    for (size_t u = 0; u < slab_keys; u += kSlabCols * N)
      for (size_t i = 0; i < slab_rows; i += kSlabRows)
        KeyScoreSteps<kSlabRows, kSlabCols, kScaled>(q + i * ldq, ldq, kt, ldk, dim, u, N, scale, out + i * ldo, ldo);
  }
  size_t i = 0;
  for (; i + 2 <= n_q; i += 2)
    KeyScoreRows<2, kScaled>(q + i * ldq, ldq, kt, ldk, i < slab_rows ? slab_keys : 0, n_keys, dim, scale,
                             out + i * ldo, ldo);
  if (i < n_q)
    KeyScoreRows<1, kScaled>(q + i * ldq, ldq, kt, ldk, i < slab_rows ? slab_keys : 0, n_keys, dim, scale,
                             out + i * ldo, ldo);
}

void KeyScoresImpl(const float* HWY_RESTRICT q, size_t ldq, size_t n_q, const float* HWY_RESTRICT kt, size_t ldk,
                   size_t n_keys, size_t dim, float* HWY_RESTRICT out, size_t ldo) {
  KeyScoresT<false>(q, ldq, n_q, kt, ldk, n_keys, dim, 1.0f, out, ldo);
}

// AttendBlock's steps after the scores run row_ops-inl.h's code, which kernels.cc's MaxValue,
// ExpShiftSum, Scale and MatMulAccumulate run too: attention keeps the bits it had as a chain of
// those calls on the same target.

// Runs of consecutive rows that see keys, one after another: the run's scores in one pass over the
// keys (up to its largest count; a row's scores never depend on the others), each row's softmax
// update, then P.V for each stretch of rows with the same key count (one pass over V for all).
void AttendBlockImpl(const float* HWY_RESTRICT q, size_t ldq, size_t n_rows, const float* HWY_RESTRICT kt,
                     size_t ldk, const size_t* HWY_RESTRICT n_keys, const float* HWY_RESTRICT v, size_t ldv,
                     size_t dim, float scale, float* HWY_RESTRICT p, size_t ldp, float* HWY_RESTRICT run_max,
                     float* HWY_RESTRICT run_sum, float* HWY_RESTRICT acc, size_t ld_acc) {
  for (size_t r0 = 0; r0 < n_rows;) {
    if (n_keys[r0] == 0) {
      ++r0;
      continue;
    }
    size_t r1 = r0 + 1, most = n_keys[r0];
    for (; r1 < n_rows && n_keys[r1] != 0; ++r1) most = std::max(most, n_keys[r1]);
    KeyScoresT<true>(q + r0 * ldq, ldq, r1 - r0, kt, ldk, most, dim, scale, p + r0 * ldp, ldp);
    for (size_t r = r0; r < r1; ++r) {
      const size_t nk = n_keys[r];
      float* s = p + r * ldp;
      const float m = run_max[r];
      const float m_new = std::max(m, RowMax(s, nk));
      const float correction = std::exp(m - m_new);  // 0 on the first block (m = -inf)
      run_sum[r] = run_sum[r] * correction + RowExpShiftSum(s, nk, m_new);
      if (correction != 1.0f) RowScale(acc + r * ld_acc, correction, dim);
      run_max[r] = m_new;
    }
    for (size_t a = r0; a < r1;) {
      size_t b = a + 1;
      while (b < r1 && n_keys[b] == n_keys[a]) ++b;
      PvAccumulate(p + a * ldp, ldp, b - a, v, ldv, n_keys[a], dim, acc + a * ld_acc, ld_acc);
      a = b;
    }
    r0 = r1;
  }
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
HWY_EXPORT(AttendBlockImpl);
HWY_EXPORT(DecodeBf16Impl);
HWY_EXPORT(DecodeInt8Impl);

void IndexScoreMax(const float* q, size_t ldq, size_t n_q, const IndexKeyPage& page, float* out) {
  HWY_DYNAMIC_DISPATCH(IndexScoreMaxImpl)(q, ldq, n_q, page, out);
}
void KeyScores(const float* q, size_t ldq, size_t n_q, const float* kt, size_t ldk, size_t n_keys, size_t dim,
               float* out, size_t ldo) {
  HWY_DYNAMIC_DISPATCH(KeyScoresImpl)(q, ldq, n_q, kt, ldk, n_keys, dim, out, ldo);
}
void AttendBlock(const float* q, size_t ldq, size_t n_rows, const float* kt, size_t ldk, const size_t* n_keys,
                 const float* v, size_t ldv, size_t dim, float scale, float* p, size_t ldp, float* run_max,
                 float* run_sum, float* acc, size_t ld_acc) {
  HWY_DYNAMIC_DISPATCH(AttendBlockImpl)(q, ldq, n_rows, kt, ldk, n_keys, v, ldv, dim, scale, p, ldp, run_max,
                                        run_sum, acc, ld_acc);
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
