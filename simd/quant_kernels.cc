// Highway implementations of quant_kernels.h, compiled once per SIMD target (kernel_table.cc
// chooses between them, the x86 kernels of quant_kernels_x86.cc and the references).
// x86 targets use maddubs/madd intrinsics (AVX3 without VNNI, AVX2); every other target (SSE4,
// EMU128, NEON, ...) a portable int32 multiply-add on 16-row tiles.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/quant_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "simd/quant_kernels.h"
#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "simd/kernel_table.h"
#include "simd/quant_tiles.h"

HWY_BEFORE_NAMESPACE();
namespace m3::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ------------------------------------------------------------------------------------------
// QuantizeActivations: the vector body performs exactly the reference's float operations.

void QuantizeActivationsImpl(const float* x, size_t ldx, size_t n_tok, size_t cols, size_t group, int8_t* q,
                             float* scale, int32_t* sum, uint8_t* shift) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  const size_t padded = (cols + group - 1) / group * group, groups = padded / group;
  const bool prefetch_rows = n_tok * cols * sizeof(float) > detail::kCoreL2Bytes;
  for (size_t t = 0; t < n_tok; ++t) {
    const float* xt = x + t * ldx;
    // Each group's amax (its bits) waits in the group's sum entry between the two passes.
    int32_t* const amax_of_group = sum + t * groups;
    // amax as the integer max of |x|'s bits: the float max for finite x, and inf or NaN as soon
    // as one value is (a float max may drop a NaN, depending on the operand order).
    int32_t amax_t_bits = 0;
    for (size_t g = 0; g < groups; ++g) {
      const size_t begin = g * group, end = std::min(cols, begin + group);
      auto vmax = hn::Zero(di), vmax2 = hn::Zero(di);  // two chains
      size_t c = begin;
      for (; c + 2 * N <= end; c += 2 * N) {
        vmax = hn::Max(vmax, hn::BitCast(di, hn::Abs(hn::LoadU(df, xt + c))));
        vmax2 = hn::Max(vmax2, hn::BitCast(di, hn::Abs(hn::LoadU(df, xt + c + N))));
      }
      for (; c + N <= end; c += N) vmax = hn::Max(vmax, hn::BitCast(di, hn::Abs(hn::LoadU(df, xt + c))));
      int32_t amax_bits = hn::GetLane(hn::MaxOfLanes(di, hn::Max(vmax, vmax2)));
      for (; c < end; ++c) amax_bits = std::max(amax_bits, detail::AbsBits(xt[c]));
      amax_of_group[g] = amax_bits;
      amax_t_bits = std::max(amax_t_bits, amax_bits);
    }
    const float amax_t = BitsToF32(static_cast<uint32_t>(amax_t_bits));
    if (shift && !std::isfinite(amax_t)) {
      detail::SetNonFiniteQ8Token(t, padded, groups, q, scale, sum, shift);
      continue;
    }
    if (shift) scale[t] = amax_t / 127.0f;
    // Inputs larger than L2 come from memory: while the second pass reads this token from L1,
    // its groups prefetch the next token's row, a share each, so that its first pass does not
    // wait (512 tokens, Zen 4: 1.21x faster at 6144 columns, 1.12x at 3072; 3% slower in cache).
    const float* x_next = prefetch_rows && t + 1 < n_tok ? xt + ldx : nullptr;
    const size_t next_lines = x_next ? (cols * sizeof(float) + 63) / 64 : 0;
    const size_t lines_per_group = (next_lines + groups - 1) / groups;
    for (size_t g = 0; g < groups; ++g) {
      for (size_t i = g * lines_per_group; i < std::min(next_lines, (g + 1) * lines_per_group); ++i)
        __builtin_prefetch(x_next + i * 16, 0, 2);  // into L2: L1 holds this row (into L1: 10-25% slower)
      const size_t begin = g * group, end = std::min(cols, begin + group);
      int8_t* qg = q + t * padded + begin;
      const float amax = BitsToF32(static_cast<uint32_t>(amax_of_group[g]));  // read before the sum replaces it
      const int e = shift ? Q8ActivationShift(amax, amax_t) : 0;
      if (shift) shift[t * groups + g] = static_cast<uint8_t>(e);
      if (amax == 0.0f || !std::isfinite(amax)) {  // q4 only reaches a non-finite group here
        std::memset(qg, 0, group);
        if (!shift) scale[t * groups + g] = amax == 0.0f ? 0.0f : std::numeric_limits<float>::quiet_NaN();
        sum[t * groups + g] = 0;
        continue;
      }
      const float inv = shift ? MulPow2(127.0f / amax_t, e) : 127.0f / amax;
      const auto vinv = hn::Set(df, inv);
      auto vsum = hn::Zero(di);
      size_t c = begin;
      if (std::isfinite(inv)) {
        // No clamp needed: inv = fl(127 / a) * 2^e with amax * 2^e <= a (a = amax_t, or amax
        // for q4 with e = 0), so |x * inv| <= 127 (1 + 2^-24), which rounds to at most 127 (the
        // reference's clamp never acts here; 2 of 7 operations per vector, ~15% of the time).
        // Rounding by adding 1.5 * 2^23 (round half to even, exact for |v| < 2^22) leaves the
        // integer in the low mantissa bits, and the int8 code is its low byte: an add, a
        // subtract and a truncating narrow where NearestInt + DemoteTo take nine operations.
        const hn::RebindToUnsigned<decltype(di)> du;
        const hn::Rebind<uint8_t, decltype(df)> du8;
        const auto magic = hn::Set(df, 12582912.0f);
        const auto magic_bits = hn::Set(di, 0x4B400000);
        for (; c + N <= end; c += N) {
          const auto v = hn::Mul(hn::LoadU(df, xt + c), vinv);
          const auto qi = hn::Sub(hn::BitCast(di, hn::Add(v, magic)), magic_bits);
          vsum = hn::Add(vsum, qi);
          hn::StoreU(hn::TruncateTo(du8, hn::BitCast(du, qi)), du8, reinterpret_cast<uint8_t*>(qg + (c - begin)));
        }
      } else {
        const auto lo = hn::Set(df, -127.0f), hi = hn::Set(df, 127.0f);
        for (; c + N <= end; c += N) {
          const auto xv = hn::LoadU(df, xt + c);
          // x == 0 gives 0 even when inv is inf (subnormal amax), as in the reference.
          const auto v = hn::IfThenZeroElse(hn::Eq(xv, hn::Zero(df)), hn::Mul(xv, vinv));
          const auto qi = hn::NearestInt(hn::Min(hi, hn::Max(lo, v)));
          vsum = hn::Add(vsum, qi);
          hn::StoreU(hn::DemoteTo(d8, qi), d8, qg + (c - begin));
        }
      }
      int32_t s = hn::GetLane(hn::SumOfLanes(di, vsum));
      for (; c < end; ++c) {
        const float v = xt[c] == 0.0f ? 0.0f : std::min(127.0f, std::max(-127.0f, std::nearbyint(xt[c] * inv)));
        qg[c - begin] = static_cast<int8_t>(v);
        s += static_cast<int32_t>(v);
      }
      if (end < begin + group) std::memset(qg + (end - begin), 0, begin + group - end);  // padding
      if (!shift) scale[t * groups + g] = amax / 127.0f;
      sum[t * groups + g] = s;
    }
  }
}

// ------------------------------------------------------------------------------------------
// q8 / q4: one row tile x T tokens over all groups. Accumulators start at the bias table's
// value and end at I_g; the epilogue is the reference's: q4 cvt, d_w * d_a and fma; q8 cvt,
// scaling by 2^-(e_w + e_a) (exact) and add. The q8 row and token scales are applied after.

using detail::TileArgs;

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL

// AVX-512BW without VNNI. q8: signed weight s = code ^ 0x80 = code - 128, so that
// maddubs(|s|, a * sign(s)) never saturates (2 * 128 * 127 < 2^15) and gives (code - 128) * a
// directly (bias 0). q4: nibbles are unsigned (2 * 15 * 127 fits), bias -8 * sum.
constexpr int kTok = 6;
constexpr bool kSignedQ8 = true;
inline int32_t Load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int T, bool kQ4>
void TileBlock(const TileArgs& b, float (*yacc)[16]) {
  const size_t G = b.G, chunks = kQ4 ? G / 8 : G / 4;
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
  for (size_t g = 0; g < b.groups; ++g) {
    __m512i acc[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[t] = _mm512_set1_epi32(b.bias[g * T + t]);
    const int8_t* qg = b.q + g * G;
    for (size_t v = 0; v < chunks; ++v) {
      const __m512i c = _mm512_loadu_si512(b.w + (g * chunks + v) * 64);
      if constexpr (kQ4) {
        const __m512i lo = _mm512_and_si512(c, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const int8_t* qt = qg + t * b.ldq + 4 * v;
          const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(lo, _mm512_set1_epi32(Load32(qt))),
                                             _mm512_maddubs_epi16(hi, _mm512_set1_epi32(Load32(qt + 4 * chunks))));
          acc[t] = _mm512_add_epi32(acc[t], _mm512_madd_epi16(p, ones));
        }
      } else {
        const __m512i s = _mm512_xor_si512(c, flip), mag = _mm512_abs_epi8(s);
        const __mmask64 neg = _mm512_movepi8_mask(s);
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const __m512i a = _mm512_set1_epi32(Load32(qg + t * b.ldq + 4 * v));
          const __m512i sa = _mm512_mask_sub_epi8(a, neg, zero, a);
          acc[t] = _mm512_add_epi32(acc[t], _mm512_madd_epi16(_mm512_maddubs_epi16(mag, sa), ones));
        }
      }
    }
    if constexpr (kQ4) {
      const auto* sc = reinterpret_cast<const __m256i*>(b.q4_scales + g * kTileRows);
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(sc));
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(b.da[g * T + t]));
        _mm512_storeu_ps(yacc[t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), d, _mm512_loadu_ps(yacc[t])));
      }
    } else {
      const __m512 ew = _mm512_cvtepi32_ps(_mm512_min_epu32(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q8_shifts + g * kTileRows))),
          _mm512_set1_epi32(kQ8MaxShift)));
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const __m512 e = _mm512_sub_ps(_mm512_set1_ps(b.da[g * T + t]), ew);
        const __m512 term = _mm512_scalef_ps(_mm512_cvtepi32_ps(acc[t]), e);
        _mm512_storeu_ps(yacc[t], _mm512_add_ps(_mm512_loadu_ps(yacc[t]), term));
      }
    }
  }
}

#elif HWY_TARGET == HWY_AVX2

// As AVX3, at 256 bits: a 64-byte chunk is rows 0-7 and rows 8-15, a block is the whole tile for
// 4 tokens. Each token's step on a chunk is one asm block (below): written as intrinsics, GCC 12
// issued every token's broadcast first and spilled accumulators to the stack (a load and a store
// per token and chunk; the q8 GEMM ran at ~0.45 of the int8 peak on Zen 3, now ~0.5-0.55). As
// blocks, each token's temporaries are dead at its end and the 8 accumulators, the chunk's codes
// (q8: s and |s| of both halves; q4: low and high nibbles) and two temporaries fit the 16
// registers. _mm256_sign_epi8 applies the weight's sign to the activation: a 4th vector operation
// per 32 products where the peak loop has 3, which bounds this q8 step at ~0.67 of the peak on
// Zen 3 (3 vector operations a cycle; docs/KERNELS.md has the measurements and what was tried).
constexpr int kTok = 4;
constexpr bool kSignedQ8 = true;
using Quad = int32_t __attribute__((may_alias));
// q8, both halves of a chunk: acc_h += madd(maddubs(|s_h|, sign(a, s_h)), 1) for the activation
// quad a at q (s = code - 128; one broadcast serves both halves).
inline void Q8Step2(__m256i& acc0, __m256i& acc1, const int8_t* q, const __m256i& s0, const __m256i& m0,
                    const __m256i& s1, const __m256i& m1, const __m256i& ones) {
  __m256i a, t;
  asm("vpbroadcastd %[q], %[a]\n\t"
      "vpsignb %[s0], %[a], %[t]\n\t"
      "vpmaddubsw %[t], %[m0], %[t]\n\t"
      "vpmaddwd %[ones], %[t], %[t]\n\t"
      "vpaddd %[t], %[acc0], %[acc0]\n\t"
      "vpsignb %[s1], %[a], %[t]\n\t"
      "vpmaddubsw %[t], %[m1], %[t]\n\t"
      "vpmaddwd %[ones], %[t], %[t]\n\t"
      "vpaddd %[t], %[acc1], %[acc1]"
      : [acc0] "+x"(acc0), [acc1] "+x"(acc1), [a] "=&x"(a), [t] "=&x"(t)
      : [q] "m"(*reinterpret_cast<const Quad*>(q)), [s0] "x"(s0), [m0] "x"(m0), [s1] "x"(s1), [m1] "x"(m1),
        [ones] "xm"(ones));
}
// q4, both halves of a chunk: acc_h += madd(maddubs(lo_h, a) + maddubs(hi_h, a'), 1) for the
// quads a at q and a' at q_hi (the two broadcasts serve both halves).
struct Q4Chunk {
  __m256i lo0, hi0, lo1, hi1;
};
inline void Q4Step(__m256i& acc0, __m256i& acc1, const int8_t* q, const int8_t* q_hi, const Q4Chunk& c,
                   const __m256i& ones) {
  __m256i a, ah, t, u;
  asm("vpbroadcastd %[q], %[a]\n\t"
      "vpbroadcastd %[qh], %[ah]\n\t"
      "vpmaddubsw %[a], %[lo0], %[t]\n\t"
      "vpmaddubsw %[ah], %[hi0], %[u]\n\t"
      "vpaddw %[u], %[t], %[t]\n\t"
      "vpmaddwd %[ones], %[t], %[t]\n\t"
      "vpaddd %[t], %[acc0], %[acc0]\n\t"
      "vpmaddubsw %[a], %[lo1], %[t]\n\t"
      "vpmaddubsw %[ah], %[hi1], %[u]\n\t"
      "vpaddw %[u], %[t], %[t]\n\t"
      "vpmaddwd %[ones], %[t], %[t]\n\t"
      "vpaddd %[t], %[acc1], %[acc1]"
      : [acc0] "+x"(acc0), [acc1] "+x"(acc1), [a] "=&x"(a), [ah] "=&x"(ah), [t] "=&x"(t), [u] "=&x"(u)
      : [q] "m"(*reinterpret_cast<const Quad*>(q)), [qh] "m"(*reinterpret_cast<const Quad*>(q_hi)), [lo0] "x"(c.lo0),
        [hi0] "x"(c.hi0), [lo1] "x"(c.lo1), [hi1] "x"(c.hi1), [ones] "xm"(ones));
}

// Decode (1-2 tokens) prefetches its codes this far ahead into L1 (past a tile's end into the
// next, which a thread reads next). The hardware prefetcher alone left a Zen 3 core at 0.58-0.63
// of the read bandwidth for q4 and 0.67 for q8 (1 token, 1 thread; 2 tokens 0.49 / 0.58); 8 KiB
// ahead 0.80 and 0.69 (2 tokens 0.71-0.73 / 0.75-0.77), with 2 threads q4 0.78-0.81 -> 0.89-0.90
// (`m3 bench --kernels`, weights cycling through 2 GiB). 2 and 4 KiB were 3-7% slower than 8.
// Prompts (3-4 tokens a block) are compute bound and go without.
constexpr size_t kGemvAheadBytes = 8192;

template <int T, bool kQ4>
void TileBlock(const TileArgs& b, float (*yacc)[16]) {
  const size_t G = b.G, chunks = kQ4 ? G / 8 : G / 4;
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (size_t g = 0; g < b.groups; ++g) {
    const int8_t* qg = b.q + g * G;
    const uint8_t* wg = b.w + g * chunks * 64;
    if constexpr (kQ4) {
      __m256i acc0[T], acc1[T];
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = _mm256_set1_epi32(b.bias[g * T + t]);
      for (size_t v = 0; v < chunks; ++v) {
        if constexpr (T <= 2) _mm_prefetch(reinterpret_cast<const char*>(wg + v * 64 + kGemvAheadBytes), _MM_HINT_T0);
        const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + v * 64));
        const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + v * 64 + 32));
        const Q4Chunk c{_mm256_and_si256(c0, nibble), _mm256_and_si256(_mm256_srli_epi16(c0, 4), nibble),
                        _mm256_and_si256(c1, nibble), _mm256_and_si256(_mm256_srli_epi16(c1, 4), nibble)};
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const int8_t* qt = qg + t * b.ldq + 4 * v;
          Q4Step(acc0[t], acc1[t], qt, qt + 4 * chunks, c, ones);
        }
      }
      const auto* sc = reinterpret_cast<const __m128i*>(b.q4_scales + g * kTileRows);
      const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128(sc)), dw1 = _mm256_cvtph_ps(_mm_loadu_si128(sc + 1));
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const __m256 da = _mm256_set1_ps(b.da[g * T + t]);
        const __m256 d0 = _mm256_mul_ps(dw0, da), d1 = _mm256_mul_ps(dw1, da);
        _mm256_storeu_ps(yacc[t], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc0[t]), d0, _mm256_loadu_ps(yacc[t])));
        _mm256_storeu_ps(yacc[t] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc1[t]), d1, _mm256_loadu_ps(yacc[t] + 8)));
      }
      continue;
    }
    __m256i acc0[T], acc1[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = _mm256_set1_epi32(b.bias[g * T + t]);
    for (size_t v = 0; v < chunks; ++v) {
      if constexpr (T <= 2) _mm_prefetch(reinterpret_cast<const char*>(wg + v * 64 + kGemvAheadBytes), _MM_HINT_T0);
      const __m256i s0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + v * 64)), flip);
      const __m256i s1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + v * 64 + 32)), flip);
      const __m256i m0 = _mm256_abs_epi8(s0), m1 = _mm256_abs_epi8(s1);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) Q8Step2(acc0[t], acc1[t], qg + t * b.ldq + 4 * v, s0, m0, s1, m1, ones);
    }
    const __m128i ew8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q8_shifts + g * kTileRows));
    const __m256i cap = _mm256_set1_epi32(kQ8MaxShift);
    const __m256i ew0 = _mm256_min_epu32(_mm256_cvtepu8_epi32(ew8), cap);
    const __m256i ew1 = _mm256_min_epu32(_mm256_cvtepu8_epi32(_mm_srli_si128(ew8, 8)), cap);
    // 2^-(e_w + e_a) built in the exponent field (e <= 126: a normal float); the multiply is exact.
    auto pow2 = [](__m256i ew, int32_t ea) HWY_ATTR {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127 - ea), ew), 23));
    };
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const int32_t ea = static_cast<int32_t>(-b.da[g * T + t]);
      _mm256_storeu_ps(yacc[t], _mm256_add_ps(_mm256_loadu_ps(yacc[t]),
                                              _mm256_mul_ps(_mm256_cvtepi32_ps(acc0[t]), pow2(ew0, ea))));
      _mm256_storeu_ps(yacc[t] + 8, _mm256_add_ps(_mm256_loadu_ps(yacc[t] + 8),
                                                  _mm256_mul_ps(_mm256_cvtepi32_ps(acc1[t]), pow2(ew1, ea))));
    }
  }
}

#else

// Portable: each 16-byte (or wider) slice of a chunk holds 4 bytes of N rows as int32 lanes;
// bytes are extracted with shifts (codes unsigned, bias -Z * sum) and multiplied in int32.
constexpr int kTok = 4;
constexpr bool kSignedQ8 = false;

template <int T, bool kQ4>
void TileBlock(const TileArgs& b, float (*yacc)[16]) {
  const hn::CappedTag<int32_t, 16> di;
  const hn::RebindToUnsigned<decltype(di)> du;
  const hn::Rebind<float, decltype(di)> df;
  const size_t N = hn::Lanes(di), G = b.G, chunks = kQ4 ? G / 8 : G / 4;
  const auto mask = hn::Set(du, kQ4 ? 0xFu : 0xFFu);
  float dw[kTileRows];    // q4: d_w
  int32_t ew[kTileRows];  // q8: e_w
  for (size_t g = 0; g < b.groups; ++g) {
    for (size_t i = 0; i < kTileRows; ++i) {
      if constexpr (kQ4) dw[i] = F16ToF32(b.q4_scales[g * kTileRows + i]);
      else ew[i] = std::min<int32_t>(b.q8_shifts[g * kTileRows + i], kQ8MaxShift);
    }
    const int8_t* qg = b.q + g * G;
    const int32_t* bias = b.bias + g * T;
    for (size_t j = 0; j < kTileRows; j += N) {
      // Explicit accumulators (no arrays: vectors may be sizeless); unused ones fold away.
      auto acc0 = hn::Set(di, bias[0]);
      auto acc1 = hn::Set(di, T > 1 ? bias[T > 1 ? 1 : 0] : 0);
      auto acc2 = hn::Set(di, T > 2 ? bias[T > 2 ? 2 : 0] : 0);
      auto acc3 = hn::Set(di, T > 3 ? bias[T > 3 ? 3 : 0] : 0);
      auto madd = [&](const int8_t* qv, size_t idx, decltype(acc0) code) HWY_ATTR {
        acc0 = hn::Add(acc0, hn::Mul(code, hn::Set(di, qv[idx])));
        if constexpr (T > 1) acc1 = hn::Add(acc1, hn::Mul(code, hn::Set(di, qv[b.ldq + idx])));
        if constexpr (T > 2) acc2 = hn::Add(acc2, hn::Mul(code, hn::Set(di, qv[2 * b.ldq + idx])));
        if constexpr (T > 3) acc3 = hn::Add(acc3, hn::Mul(code, hn::Set(di, qv[3 * b.ldq + idx])));
      };
      for (size_t v = 0; v < chunks; ++v) {
        const auto* p = reinterpret_cast<const uint32_t*>(b.w + (g * chunks + v) * 64) + j;
        const auto wv = hn::LoadU(du, p);
        const int8_t* qv = qg + 4 * v;
        if constexpr (kQ4) {
          madd(qv, 0, hn::BitCast(di, hn::And(wv, mask)));
          madd(qv, 1, hn::BitCast(di, hn::And(hn::ShiftRight<8>(wv), mask)));
          madd(qv, 2, hn::BitCast(di, hn::And(hn::ShiftRight<16>(wv), mask)));
          madd(qv, 3, hn::BitCast(di, hn::And(hn::ShiftRight<24>(wv), mask)));
          const int8_t* qh = qv + 4 * chunks;  // high nibbles: quad v + G/8
          madd(qh, 0, hn::BitCast(di, hn::And(hn::ShiftRight<4>(wv), mask)));
          madd(qh, 1, hn::BitCast(di, hn::And(hn::ShiftRight<12>(wv), mask)));
          madd(qh, 2, hn::BitCast(di, hn::And(hn::ShiftRight<20>(wv), mask)));
          madd(qh, 3, hn::BitCast(di, hn::ShiftRight<28>(wv)));
        } else {
          madd(qv, 0, hn::BitCast(di, hn::And(wv, mask)));
          madd(qv, 1, hn::BitCast(di, hn::And(hn::ShiftRight<8>(wv), mask)));
          madd(qv, 2, hn::BitCast(di, hn::And(hn::ShiftRight<16>(wv), mask)));
          madd(qv, 3, hn::BitCast(di, hn::ShiftRight<24>(wv)));
        }
      }
      auto finish = [&](int t, decltype(acc0) acc) HWY_ATTR {
        if constexpr (kQ4) {
          const auto d = hn::Mul(hn::LoadU(df, dw + j), hn::Set(df, b.da[g * T + t]));
          hn::StoreU(hn::MulAdd(hn::ConvertTo(df, acc), d, hn::LoadU(df, yacc[t] + j)), df, yacc[t] + j);
        } else {
          // 2^-(e_w + e_a) built in the exponent field (e <= 126: a normal float); the multiply is exact.
          const int32_t ea = static_cast<int32_t>(-b.da[g * T + t]);
          const auto pow2 = hn::BitCast(df, hn::ShiftLeft<23>(hn::Sub(hn::Set(di, 127 - ea), hn::LoadU(di, ew + j))));
          hn::StoreU(hn::Add(hn::LoadU(df, yacc[t] + j), hn::Mul(hn::ConvertTo(df, acc), pow2)), df, yacc[t] + j);
        }
      };
      finish(0, acc0);
      if constexpr (T > 1) finish(1, acc1);
      if constexpr (T > 2) finish(2, acc2);
      if constexpr (T > 3) finish(3, acc3);
    }
  }
}

#endif

template <int T>
void TileBlockT(bool q4, const TileArgs& b, float (*yacc)[16]) {
  if (q4)
    TileBlock<T, true>(b, yacc);
  else
    TileBlock<T, false>(b, yacc);
}

void TileBlockAny(const TileArgs& b, int nt, float (*yacc)[16]) {
  const bool q4 = b.format == WeightFormat::kQ4;
  switch (nt) {
    case 1: return TileBlockT<1>(q4, b, yacc);
    case 2: return TileBlockT<2>(q4, b, yacc);
    case 3: return TileBlockT<3>(q4, b, yacc);
    case 4: if constexpr (kTok >= 4) TileBlockT<kTok >= 4 ? 4 : 1>(q4, b, yacc); return;
    case 5: if constexpr (kTok >= 5) TileBlockT<kTok >= 5 ? 5 : 1>(q4, b, yacc); return;
    case 6: if constexpr (kTok >= 6) TileBlockT<kTok >= 6 ? 6 : 1>(q4, b, yacc); return;
    default: return;
  }
}

void QuantMatMulImpl(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                     size_t ldy, KernelScratch& scratch) {
  detail::QuantMatMulByTiles({TileBlockAny, kTok, kSignedQ8}, w, a, tile_begin, tile_end, y, ldy, scratch);
}

bool IsExactImpl() { return HWY_NATIVE_FMA != 0; }

// ------------------------------------------------------------------------------------------
// bf16 tiles: a 64-byte chunk holds inputs 2p, 2p + 1 of 16 rows as bf16 pairs; widened to fp32
// by shifts (exact) and accumulated with fma (even and odd inputs in separate chains).

template <int T>
void Bf16Block(const uint8_t* tile, const float* x, size_t ldx, size_t cols, float (*out)[16]) {
  const hn::CappedTag<uint32_t, 16> du;
  const hn::Rebind<float, decltype(du)> df;
  const size_t N = hn::Lanes(du), full = cols / 2;
  const auto high = hn::Set(du, 0xFFFF0000u);
  const auto* w32 = reinterpret_cast<const uint32_t*>(tile);
  for (size_t j = 0; j < kTileRows; j += N) {
    auto e0 = hn::Zero(df), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
    auto step = [&](size_t p, float x_odd_mask) HWY_ATTR {
      hwy::Prefetch(w32 + (p + 16) * kTileRows + j);  // 1 KB ahead in the weight stream
      const auto wv = hn::LoadU(du, w32 + p * kTileRows + j);
      const auto ev = hn::BitCast(df, hn::ShiftLeft<16>(wv)), ov = hn::BitCast(df, hn::And(wv, high));
      const float* xp = x + 2 * p;
      e0 = hn::MulAdd(ev, hn::Set(df, xp[0]), e0);
      if (x_odd_mask != 0.0f) o0 = hn::MulAdd(ov, hn::Set(df, xp[1]), o0);
      if constexpr (T > 1) {
        e1 = hn::MulAdd(ev, hn::Set(df, xp[ldx]), e1);
        if (x_odd_mask != 0.0f) o1 = hn::MulAdd(ov, hn::Set(df, xp[ldx + 1]), o1);
      }
      if constexpr (T > 2) {
        e2 = hn::MulAdd(ev, hn::Set(df, xp[2 * ldx]), e2);
        if (x_odd_mask != 0.0f) o2 = hn::MulAdd(ov, hn::Set(df, xp[2 * ldx + 1]), o2);
      }
      if constexpr (T > 3) {
        e3 = hn::MulAdd(ev, hn::Set(df, xp[3 * ldx]), e3);
        if (x_odd_mask != 0.0f) o3 = hn::MulAdd(ov, hn::Set(df, xp[3 * ldx + 1]), o3);
      }
    };
    for (size_t p = 0; p < full; ++p) step(p, 1.0f);
    if (cols % 2) step(full, 0.0f);  // last input alone (its pair partner is padding)
    hn::StoreU(hn::Add(e0, o0), df, out[0] + j);
    if constexpr (T > 1) hn::StoreU(hn::Add(e1, o1), df, out[1] + j);
    if constexpr (T > 2) hn::StoreU(hn::Add(e2, o2), df, out[2] + j);
    if constexpr (T > 3) hn::StoreU(hn::Add(e3, o3), df, out[3] + j);
  }
}

void Bf16TiledMatMulImpl(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin,
                         size_t tile_end, float* y, size_t ldy, KernelScratch& /*scratch*/) {
  tile_end = std::min(tile_end, w.row_tiles());
  const auto* data = static_cast<const uint8_t*>(w.data);
  for (size_t tile = tile_begin; tile < tile_end; ++tile) {
    const size_t rows = std::min(w.rows, (tile + 1) * kTileRows) - tile * kTileRows;
    const uint8_t* t_data = data + tile * w.tile_bytes();
    for (size_t t0 = 0; t0 < n_tok; t0 += 4) {
      const size_t nt = std::min<size_t>(4, n_tok - t0);
      float out[4][16];
      const float* xt = x + t0 * ldx;
      switch (nt) {
        case 1: Bf16Block<1>(t_data, xt, ldx, w.cols, out); break;
        case 2: Bf16Block<2>(t_data, xt, ldx, w.cols, out); break;
        case 3: Bf16Block<3>(t_data, xt, ldx, w.cols, out); break;
        default: Bf16Block<4>(t_data, xt, ldx, w.cols, out); break;
      }
      for (size_t t = 0; t < nt; ++t) std::memcpy(y + (t0 + t) * ldy + tile * kTileRows, out[t], rows * sizeof(float));
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace m3::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace m3::simd {

HWY_EXPORT(QuantizeActivationsImpl);
HWY_EXPORT(QuantMatMulImpl);
HWY_EXPORT(Bf16TiledMatMulImpl);
HWY_EXPORT(IsExactImpl);

namespace detail {
HighwayQuantKernels HighwayQuantKernelsForTarget(int64_t target) {
  return {HwyEntryFor(HWY_DISPATCH_TABLE(QuantizeActivationsImpl), target),
          HwyEntryFor(HWY_DISPATCH_TABLE(QuantMatMulImpl), target),
          HwyEntryFor(HWY_DISPATCH_TABLE(Bf16TiledMatMulImpl), target),
          HwyEntryFor(HWY_DISPATCH_TABLE(IsExactImpl), target)()};
}
}  // namespace detail

}  // namespace m3::simd
#endif  // HWY_ONCE
