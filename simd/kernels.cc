// Highway implementations of kernels.h, compiled once per SIMD target and dispatched at run time.
// Tails shorter than one vector are finished in scalar code, so no load ever reads past an array.
#include <cmath>
#include <cstring>
#include <limits>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "simd/row_ops-inl.h"
#include "simd/kernels.h"
#include "simd/dispatch.h"
#include "simd/kernel_table.h"

HWY_BEFORE_NAMESPACE();
namespace m3::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

void DecodeRowsImpl(const WeightRef& w, size_t row0, size_t n_rows, float* out) {
  const DF df;
  const hn::RebindToUnsigned<DF> du32;
  const size_t N = hn::Lanes(df);
  const size_t cols = w.cols;
  for (size_t r = 0; r < n_rows; ++r) {
    const uint8_t* src = w.row_bytes(row0 + r);
    float* o = out + r * cols;
    size_t c = 0;
    switch (w.format) {
      case WeightFormat::kF32:
        std::memcpy(o, src, cols * sizeof(float));
        c = cols;
        break;
      case WeightFormat::kBF16: {
        const hn::Rebind<uint16_t, DF> du16;
        const uint16_t* p = reinterpret_cast<const uint16_t*>(src);
        for (; c + N <= cols; c += N) {
          auto bits = hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, p + c)));
          hn::StoreU(hn::BitCast(df, bits), df, o + c);
        }
        break;
      }
      case WeightFormat::kF16: {
        const hn::Rebind<hwy::float16_t, DF> df16;
        const hwy::float16_t* p = reinterpret_cast<const hwy::float16_t*>(src);
        for (; c + N <= cols; c += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(df16, p + c)), df, o + c);
        break;
      }
      case WeightFormat::kE4M3Mx32: {
        // e4m3 bits moved into an fp32 exponent/mantissa and rebiased by 2^(127-7): exact for
        // normals and subnormals alike.
        const hn::Rebind<uint8_t, DF> du8;
        const auto k7F = hn::Set(du32, 0x7Fu);
        const auto k80 = hn::Set(du32, 0x80u);
        const auto rebias = hn::Set(df, 0x1p120f);
        const auto nan = hn::Set(df, std::numeric_limits<float>::quiet_NaN());
        for (; c + N <= cols; c += N) {
          const auto v = hn::PromoteTo(du32, hn::LoadU(du8, src + c));
          const auto mag = hn::And(v, k7F);
          const auto sign = hn::ShiftLeft<24>(hn::And(v, k80));
          auto f = hn::Mul(hn::BitCast(df, hn::Or(hn::ShiftLeft<20>(mag), sign)), rebias);
          f = hn::IfThenElse(hn::RebindMask(df, hn::Eq(mag, k7F)), nan, f);
          hn::StoreU(f, df, o + c);
        }
        for (; c < cols; ++c) o[c] = E4M3ToF32(src[c]);
        // Second pass over the (L1-resident) row applies the per-32 E8M0 scales.
        const uint8_t* sc = w.scales + (row0 + r) * w.scale_cols();
        for (size_t g = 0; g * kMxGroup < cols; ++g) {
          const size_t begin = g * kMxGroup, end = std::min(cols, begin + kMxGroup);
          const auto s = hn::Set(df, E8M0ToF32(sc[g]));
          size_t i = begin;
          for (; i + N <= end; i += N) hn::StoreU(hn::Mul(hn::LoadU(df, o + i), s), df, o + i);
          for (; i < end; ++i) o[i] *= E8M0ToF32(sc[g]);
        }
        continue;  // tail and scales done
      }
      default:  // tiled formats (embedding lookups only; matmuls use the int8 kernels)
        if (IsTiled(w.format)) {
          DecodeTiledRow(w, row0 + r, o);
          continue;
        }
        break;
    }
    for (; c < cols; ++c) o[c] = WeightAt(w, row0 + r, c);
  }
}

// One row's dot product: two vector accumulators, one single-vector step, fused scalar tail.
// MatMulF32Impl's 4-row path performs exactly these operations per row.
HWY_INLINE float RowDot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT x, size_t k) {
  const DF df;
  const size_t N = hn::Lanes(df);
  auto acc0 = hn::Zero(df), acc1 = hn::Zero(df);
  size_t c = 0;
  for (; c + 2 * N <= k; c += 2 * N) {
    acc0 = hn::MulAdd(hn::LoadU(df, a + c), hn::LoadU(df, x + c), acc0);
    acc1 = hn::MulAdd(hn::LoadU(df, a + c + N), hn::LoadU(df, x + c + N), acc1);
  }
  if (c + N <= k) {
    acc0 = hn::MulAdd(hn::LoadU(df, a + c), hn::LoadU(df, x + c), acc0);
    c += N;
  }
  float s = hn::GetLane(hn::SumOfLanes(df, hn::Add(acc0, acc1)));
  for (; c < k; ++c) s = std::fma(a[c], x[c], s);
  return s;
}

// Rows [r, r + 4) x tokens [t, t + kTok): each output is RowDot's exact sequence (two vector
// accumulators over alternating chunks, their lane sum, a fused scalar tail), whatever the
// blocking; the loads of x (kTok tokens) and of a (4 rows) are shared.
template <int kTok>
HWY_INLINE void DotBlock4(const float* HWY_RESTRICT a, size_t lda, const float* HWY_RESTRICT x, size_t ldx, size_t k,
                          float* HWY_RESTRICT y, size_t ldy) {
  const DF df;
  const size_t N = hn::Lanes(df);
  hn::Vec<DF> s[4][kTok][2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 2
    for (int t = 0; t < kTok; ++t) s[i][t][0] = s[i][t][1] = hn::Zero(df);
  size_t c = 0;
  for (; c + 2 * N <= k; c += 2 * N) {
    hn::Vec<DF> x0[kTok], x1[kTok];
#pragma GCC unroll 2
    for (int t = 0; t < kTok; ++t) x0[t] = hn::LoadU(df, x + t * ldx + c), x1[t] = hn::LoadU(df, x + t * ldx + c + N);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const auto a0 = hn::LoadU(df, a + i * lda + c), a1 = hn::LoadU(df, a + i * lda + c + N);
#pragma GCC unroll 2
      for (int t = 0; t < kTok; ++t) {
        s[i][t][0] = hn::MulAdd(a0, x0[t], s[i][t][0]);
        s[i][t][1] = hn::MulAdd(a1, x1[t], s[i][t][1]);
      }
    }
  }
  const bool one_more = c + N <= k;
  if (one_more) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const auto a0 = hn::LoadU(df, a + i * lda + c);
#pragma GCC unroll 2
      for (int t = 0; t < kTok; ++t) s[i][t][0] = hn::MulAdd(a0, hn::LoadU(df, x + t * ldx + c), s[i][t][0]);
    }
    c += N;
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
#pragma GCC unroll 2
    for (int t = 0; t < kTok; ++t) {
      float r = hn::GetLane(hn::SumOfLanes(df, hn::Add(s[i][t][0], s[i][t][1])));
      for (size_t cc = c; cc < k; ++cc) r = std::fma(a[i * lda + cc], x[t * ldx + cc], r);
      y[t * ldy + i] = r;
    }
}

void MatMulF32Impl(const float* HWY_RESTRICT a, size_t lda, size_t n_rows,
                   const float* HWY_RESTRICT x, size_t ldx, size_t n_tok, size_t k,
                   float* HWY_RESTRICT y, size_t ldy) {
  // Four rows share each load of x; with 32 vector registers (AVX-512) two tokens share each
  // load of a as well (16 accumulators): a prompt's router ([128 experts, 6144] f32) no longer
  // reloads its rows for every token (prefill profile 2.1% -> see the commit).
  constexpr int kTokPair = HWY_MAX_BYTES >= 64 ? 2 : 1;
  size_t r = 0;
  for (; r + 4 <= n_rows; r += 4) {
    size_t t = 0;
    for (; t + kTokPair <= n_tok; t += kTokPair)
      DotBlock4<kTokPair>(a + r * lda, lda, x + t * ldx, ldx, k, y + t * ldy + r, ldy);
    for (; t < n_tok; ++t) DotBlock4<1>(a + r * lda, lda, x + t * ldx, ldx, k, y + t * ldy + r, ldy);
  }
  for (; r < n_rows; ++r)
    for (size_t t = 0; t < n_tok; ++t) y[t * ldy + r] = RowDot(a + r * lda, x + t * ldx, k);
}

// P.V blocking in row_ops-inl.h (shared with attention_kernels.cc's AttendBlock).
void MatMulAccumulateImpl(const float* HWY_RESTRICT p, size_t ldp, size_t n_rows, const float* HWY_RESTRICT v,
                          size_t ldv, size_t n_keys, size_t d, float* HWY_RESTRICT out, size_t ldo) {
  PvAccumulate(p, ldp, n_rows, v, ldv, n_keys, d, out, ldo);
}

float DotImpl(const float* a, const float* b, size_t n) { return RowDot(a, b, n); }

void AxpyImpl(float alpha, const float* HWY_RESTRICT x, float* HWY_RESTRICT y, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const auto va = hn::Set(df, alpha);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::MulAdd(va, hn::LoadU(df, x + i), hn::LoadU(df, y + i)), df, y + i);
  // The tail through the same vector operation on a padded copy: an element's result never
  // depends on where a call's range starts (a MoE split over processes adds up column slices).
  if (i < n) {
    HWY_ALIGN float xt[HWY_MAX_BYTES / sizeof(float)] = {}, yt[HWY_MAX_BYTES / sizeof(float)] = {};
    std::memcpy(xt, x + i, (n - i) * sizeof(float));
    std::memcpy(yt, y + i, (n - i) * sizeof(float));
    hn::Store(hn::MulAdd(va, hn::Load(df, xt), hn::Load(df, yt)), df, yt);
    std::memcpy(y + i, yt, (n - i) * sizeof(float));
  }
}

void ScaleImpl(float* y, float s, size_t n) { RowScale(y, s, n); }

float SumSquaresImpl(const float* x, size_t n) { return RowDot(x, x, n); }

void MulScaledImpl(const float* HWY_RESTRICT x, const float* HWY_RESTRICT w, float s,
                   float* HWY_RESTRICT y, size_t n) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const auto vs = hn::Set(df, s);
  size_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(df, x + i), vs), hn::LoadU(df, w + i)), df, y + i);
  for (; i < n; ++i) y[i] = x[i] * s * w[i];
}

// SumSquaresImpl then MulScaledImpl per row, the same operations (x and out may be the same rows).
void RmsNormRowsImpl(const float* x, size_t ld_x, size_t n_rows, size_t dim, const float* HWY_RESTRICT scale,
                     float eps, float* out, size_t ld_out) {
  const DF df;
  const size_t N = hn::Lanes(df);
  for (size_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * ld_x;
    float* yr = out + r * ld_out;
    const float ms = RowDot(xr, xr, dim) / static_cast<float>(dim);
    const float inv = 1.0f / std::sqrt(ms + eps);
    const auto vs = hn::Set(df, inv);
    size_t i = 0;
    for (; i + N <= dim; i += N)
      hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(df, xr + i), vs), hn::LoadU(df, scale + i)), df, yr + i);
    for (; i < dim; ++i) yr[i] = xr[i] * inv * scale[i];
  }
}

// The softmax steps (row_ops-inl.h); AttendBlock runs the same code.
float MaxValueImpl(const float* x, size_t n) { return RowMax(x, n); }

float ExpShiftSumImpl(float* x, size_t n, float shift) { return RowExpShiftSum(x, n, shift); }

void SwigluOaiImpl(float* HWY_RESTRICT g, const float* HWY_RESTRICT u, size_t n, float alpha, float limit,
                   float beta) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const auto va = hn::Set(df, alpha), vl = hn::Set(df, limit), vb = hn::Set(df, beta), one = hn::Set(df, 1.0f);
  const auto nan = hn::Set(df, std::numeric_limits<float>::quiet_NaN());
  auto swiglu = [&](float* gi, const float* ui) {
    const auto vg = hn::LoadU(df, gi), vu = hn::LoadU(df, ui);
    const auto gc = hn::Min(vg, vl);
    const auto uc = hn::Min(hn::Max(vu, hn::Neg(vl)), vl);
    // sigmoid(z) from e = exp(-|z|) <= 1, which cannot overflow: 1 / (1 + e) for z >= 0, else e / (1 + e).
    const auto z = hn::Mul(va, gc);
    const auto e = hn::Exp(df, hn::Neg(hn::Abs(z)));
    const auto sig = hn::Div(hn::IfThenElse(hn::Lt(z, hn::Zero(df)), e, one), hn::Add(one, e));
    const auto a = hn::Mul(hn::Mul(gc, sig), hn::Add(uc, vb));
    const auto finite = hn::And(hn::IsFinite(vg), hn::IsFinite(vu));
    hn::StoreU(hn::IfThenElse(finite, a, nan), df, gi);
  };
  size_t i = 0;
  for (; i + N <= n; i += N) swiglu(g + i, u + i);
  // The tail runs the same vector code on a padded copy: an element's result never depends on where
  // a call's range starts (the MoE splits rows over threads; exp differs from std::exp in the ulps).
  if (i < n) {
    HWY_ALIGN float gt[HWY_MAX_BYTES / sizeof(float)] = {}, ut[HWY_MAX_BYTES / sizeof(float)] = {};
    std::memcpy(gt, g + i, (n - i) * sizeof(float));
    std::memcpy(ut, u + i, (n - i) * sizeof(float));
    swiglu(gt, ut);
    std::memcpy(g + i, gt, (n - i) * sizeof(float));
  }
}

size_t FindNonFiniteImpl(const float* x, size_t n) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const size_t N = hn::Lanes(df);
  const auto exponent = hn::Set(du, 0x7F800000u);  // all ones: inf or NaN
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto bits = hn::And(hn::BitCast(du, hn::LoadU(df, x + i)), exponent);
    if (!hn::AllFalse(du, hn::Eq(bits, exponent))) break;  // the scalar loop finds the lane
  }
  for (; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return n;
}

}  // namespace HWY_NAMESPACE
}  // namespace m3::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace m3::simd {

HWY_EXPORT(DecodeRowsImpl);
HWY_EXPORT(MatMulF32Impl);
HWY_EXPORT(MatMulAccumulateImpl);
HWY_EXPORT(DotImpl);
HWY_EXPORT(AxpyImpl);
HWY_EXPORT(ScaleImpl);
HWY_EXPORT(SumSquaresImpl);
HWY_EXPORT(MulScaledImpl);
HWY_EXPORT(RmsNormRowsImpl);
HWY_EXPORT(MaxValueImpl);
HWY_EXPORT(ExpShiftSumImpl);
HWY_EXPORT(FindNonFiniteImpl);
HWY_EXPORT(SwigluOaiImpl);

void DecodeRows(const WeightRef& w, size_t row0, size_t n_rows, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeRowsImpl)(w, row0, n_rows, out);
}
void MatMulF32(const float* a, size_t lda, size_t n_rows, const float* x, size_t ldx,
               size_t n_tok, size_t k, float* y, size_t ldy) {
  HWY_DYNAMIC_DISPATCH(MatMulF32Impl)(a, lda, n_rows, x, ldx, n_tok, k, y, ldy);
}
void MatMulAccumulate(const float* p, size_t ldp, size_t n_rows, const float* v, size_t ldv, size_t n_keys,
                      size_t d, float* out, size_t ldo) {
  HWY_DYNAMIC_DISPATCH(MatMulAccumulateImpl)(p, ldp, n_rows, v, ldv, n_keys, d, out, ldo);
}
float Dot(const float* a, const float* b, size_t n) { return HWY_DYNAMIC_DISPATCH(DotImpl)(a, b, n); }
void Axpy(float alpha, const float* x, float* y, size_t n) { HWY_DYNAMIC_DISPATCH(AxpyImpl)(alpha, x, y, n); }
void Scale(float* y, float s, size_t n) { HWY_DYNAMIC_DISPATCH(ScaleImpl)(y, s, n); }
float SumSquares(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(SumSquaresImpl)(x, n); }
void MulScaled(const float* x, const float* w, float s, float* y, size_t n) {
  HWY_DYNAMIC_DISPATCH(MulScaledImpl)(x, w, s, y, n);
}
void RmsNormRows(const float* x, size_t ld_x, size_t n_rows, size_t dim, const float* scale, float eps, float* out,
                 size_t ld_out) {
  HWY_DYNAMIC_DISPATCH(RmsNormRowsImpl)(x, ld_x, n_rows, dim, scale, eps, out, ld_out);
}
float MaxValue(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(MaxValueImpl)(x, n); }
float ExpShiftSum(float* x, size_t n, float shift) {
  return HWY_DYNAMIC_DISPATCH(ExpShiftSumImpl)(x, n, shift);
}
size_t FindNonFinite(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(FindNonFiniteImpl)(x, n); }
void SwigluOai(float* g, const float* u, size_t n, float alpha, float limit, float beta) {
  HWY_DYNAMIC_DISPATCH(SwigluOaiImpl)(g, u, n, alpha, limit, beta);
}

std::string TargetName(int64_t target) { return hwy::TargetName(target); }

namespace detail {
KernelTable::MatMulF32Fn MatMulF32ForTarget(int64_t target) {
  return HwyEntryFor(HWY_DISPATCH_TABLE(MatMulF32Impl), target);
}
}  // namespace detail

std::string ActiveTargetName() {
  // The best runnable target is the lowest set bit of the supported & compiled mask.
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(targets & -targets);
}

std::vector<int64_t> RunnableTargets() { return hwy::SupportedAndGeneratedTargets(); }

void ForceTargetForTest(int64_t target) { hwy::SetSupportedTargetsForTest(target); }

}  // namespace m3::simd
#endif  // HWY_ONCE
