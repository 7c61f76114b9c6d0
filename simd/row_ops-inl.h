// Per-target row loops shared by kernels.cc and attention_kernels.cc: the softmax steps (row max,
// exp-shift-sum, scale) and the P.V product. Attention's fused AttendBlock calls the very code of the
// kernels it replaces (MaxValue, ExpShiftSum, Scale, MatMulAccumulate), so it rounds exactly as
// that chain of calls on the same target. Included after "hwy/highway.h" inside each file's
// foreach_target re-inclusion (as hwy/contrib/math/math-inl.h is); both files are compiled with
// -ffp-contract=off, which keeps every Mul and Add a separate rounding.
#include <cmath>
#include <cstddef>
#include <limits>

// Include guard toggled per target (still compiled once per target).
#if defined(M3_SIMD_ROW_OPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef M3_SIMD_ROW_OPS_INL_H_
#undef M3_SIMD_ROW_OPS_INL_H_
#else
#define M3_SIMD_ROW_OPS_INL_H_
#endif

#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

HWY_BEFORE_NAMESPACE();
namespace m3::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// acc[i][c] += a[i * lda] * b[c] for kRows rows and kCols vectors: one step of a register-tiled
// product (one MulAdd each). GCC keeps the arrays in registers only when the loops are unrolled.
template <int kRows, int kCols>
HWY_INLINE void BroadcastMulAdd(const float* HWY_RESTRICT a, size_t lda, const hn::Vec<DF>* b,
                                hn::Vec<DF> (*acc)[kCols]) {
  const DF df;
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i) {
    const auto w = hn::Set(df, a[i * lda]);
#pragma GCC unroll 8
    for (int c = 0; c < kCols; ++c) acc[i][c] = hn::MulAdd(w, b[c], acc[i][c]);
  }
}

// The largest of x[0, n): lanes from x[0] in vectors, then the scalar tail (a NaN's fate depends on
// where it falls, so every caller must split the row the same way).
HWY_INLINE float RowMax(const float* HWY_RESTRICT x, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  float m = -std::numeric_limits<float>::infinity();
  size_t i = 0;
  if (n >= N) {
    auto vm = hn::Set(df, m);
    for (; i + N <= n; i += N) vm = hn::Max(vm, hn::LoadU(df, x + i));
    m = hn::GetLane(hn::MaxOfLanes(df, vm));
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// x = exp(x - shift), NaN kept; returns the vector sum, then the tail's added one by one.
HWY_INLINE float RowExpShiftSum(float* HWY_RESTRICT x, size_t n, float shift) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const auto vs = hn::Set(df, shift);
  auto acc = hn::Zero(df);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto d = hn::Sub(hn::LoadU(df, x + i), vs);
    const auto e = hn::IfThenElse(hn::IsNaN(d), d, hn::Exp(df, d));  // hn::Exp(NaN) is 0, std::exp's NaN
    hn::StoreU(e, df, x + i);
    acc = hn::Add(acc, e);
  }
  float s = hn::GetLane(hn::SumOfLanes(df, acc));
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    s += x[i];
  }
  return s;
}

// y *= s.
HWY_INLINE void RowScale(float* HWY_RESTRICT y, float s, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const auto vs = hn::Set(df, s);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(df, y + i), vs), df, y + i);
  for (; i < n; ++i) y[i] *= s;
}

// Rows [0, kRows) of P.V over columns [c, c + kCols * N): accumulators in registers over all keys,
// one fma per key in order u = 0, 1, ... (the order every path of PvAccumulate follows).
template <int kRows, int kCols>
HWY_INLINE void PvSteps(const float* HWY_RESTRICT p, size_t ldp, const float* HWY_RESTRICT v, size_t ldv,
                        size_t n_keys, size_t c, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  hn::Vec<DF> acc[kRows][kCols];
#pragma GCC unroll 4
  for (int h = 0; h < kRows; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) acc[h][j] = hn::LoadU(df, out + h * ldo + c + j * N);
  for (size_t u = 0; u < n_keys; ++u) {
    hn::Vec<DF> vv[kCols];
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) vv[j] = hn::LoadU(df, v + u * ldv + c + j * N);
    BroadcastMulAdd<kRows, kCols>(p + u, ldp, vv, acc);
  }
#pragma GCC unroll 4
  for (int h = 0; h < kRows; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) hn::StoreU(acc[h][j], df, out + h * ldo + c + j * N);
}

template <int kRows>
HWY_INLINE void PvRows(const float* HWY_RESTRICT p, size_t ldp, const float* HWY_RESTRICT v, size_t ldv,
                       size_t n_keys, size_t d, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t c = 0;
  for (; c + 8 * N <= d; c += 8 * N) PvSteps<kRows, 8>(p, ldp, v, ldv, n_keys, c, out, ldo);
  for (; c + N <= d; c += N) PvSteps<kRows, 1>(p, ldp, v, ldv, n_keys, c, out, ldo);
  for (; c < d; ++c)
    for (int h = 0; h < kRows; ++h) {
      float acc = out[h * ldo + c];
      for (size_t u = 0; u < n_keys; ++u) acc = std::fma(p[h * ldp + u], v[u * ldv + c], acc);
      out[h * ldo + c] = acc;
    }
}

// Two rows of P share each loaded V vector; 8 vectors of columns per step read whole 512-byte V
// rows (head_dim 128) front to back: the first row pair streams a V block from memory and the
// next ones find it in L2 (narrower column steps strided through it and waited on memory).
// Many rows (a prefill's queries x heads against one value block): slabs of kPvSlabCols vectors of
// columns (128 keys x 64 values: 32 KiB) stay in L1 while every block of kPvSlabRows rows passes
// over them; each output still sums over u in order, so the bits are the row-pair path's.
constexpr int kPvSlabRows = HWY_MAX_BYTES >= 64 ? 4 : 2;
constexpr int kPvSlabCols = 4;
constexpr size_t kPvSlabMinRows = 8;

// out[h] += sum over u of p[h][u] * v[u] for rows [0, n_rows), d columns, n_keys keys.
HWY_INLINE void PvAccumulate(const float* HWY_RESTRICT p, size_t ldp, size_t n_rows, const float* HWY_RESTRICT v,
                             size_t ldv, size_t n_keys, size_t d, float* HWY_RESTRICT out, size_t ldo) {
  const DF df;
  const size_t N = hn::Lanes(df);
  size_t h = 0;
  if (n_rows >= kPvSlabMinRows && d >= kPvSlabCols * N) {
    const size_t slab_rows = n_rows / kPvSlabRows * kPvSlabRows, slab_cols = d / (kPvSlabCols * N) * (kPvSlabCols * N);
    for (size_t c = 0; c < slab_cols; c += kPvSlabCols * N)
      for (size_t r = 0; r < slab_rows; r += kPvSlabRows)
        PvSteps<kPvSlabRows, kPvSlabCols>(p + r * ldp, ldp, v, ldv, n_keys, c, out + r * ldo, ldo);
    if (slab_cols < d)  // the columns past the slabs, for the same rows
      for (; h + 2 <= slab_rows; h += 2)
        PvRows<2>(p + h * ldp, ldp, v + slab_cols, ldv, n_keys, d - slab_cols, out + h * ldo + slab_cols, ldo);
    h = slab_rows;
  }
  for (; h + 2 <= n_rows; h += 2) PvRows<2>(p + h * ldp, ldp, v, ldv, n_keys, d, out + h * ldo, ldo);
  if (h < n_rows) PvRows<1>(p + h * ldp, ldp, v, ldv, n_keys, d, out + h * ldo, ldo);
}

}  // namespace HWY_NAMESPACE
}  // namespace m3::simd
HWY_AFTER_NAMESPACE();

#endif  // M3_SIMD_ROW_OPS_INL_H_
