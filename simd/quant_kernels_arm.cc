// 64-bit ARM int8 kernels (quant_kernels_arm.h), under the shared row-tile driver (quant_tiles.h).
//
// The packed formats already are sdot's layout: a 16-byte quarter of a 64-byte chunk holds 4 rows
// x 4 consecutive inputs (row-major), and sdot by element adds, for each of its 4 int32 lanes (a
// row), the dot product of that row's 4 bytes with one 4-byte lane of a second vector. So one
// 16-byte load of a token's activations serves 4 chunks (lane j for chunk v + j), and a chunk
// costs 4 sdot per token: q8 codes made signed by one eor (code ^ 0x80 = code - 128, bias 0), q4
// nibbles (0..15, bias -8 x sum) by an and and a shift.
// usmmla multiplies a 2x8 unsigned matrix by an 8x2 signed one: two chunks zipped by 32-bit lanes
// give two rows their 8 consecutive inputs, and two tokens' 8 activations side by side are the
// other operand, so one instruction does 32 products (sdot: 16) on unsigned codes (bias -Z x sum).
// The group epilogue is the reference's float arithmetic, lane for lane (fused multiply-add for
// q4/q3/q2, an exact power of two for q8), so results are bit-identical to ref::QuantMatMul.
#include "simd/quant_kernels_arm.h"

#if defined(__aarch64__) && defined(__GNUC__)

#include <arm_neon.h>
#include <sys/auxv.h>

#include <utility>

#include "simd/quant_tiles.h"

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1UL << 13)
#endif

namespace m3::simd::arm {

bool HasDotProd() { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }
bool HasI8mm() { return HasDotProd() && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0; }

namespace {

// Everything up to the i8mm section may use the dot-product instructions, and is reached only
// after HasDotProd(). No standard library function is called in these sections, so no shared
// (COMDAT) copy of one can be compiled with them.
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")

// f.template operator()<I>() for I = 0 .. N-1: lane indices must be constants.
template <int N, class F>
inline void Unroll(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f.template operator()<I>(), ...); }(
      std::make_integer_sequence<int, N>{});
}

inline float32x4_t F16x4(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Lanes 4k..4k+3 of 16 bytes, widened: the row quarter k's u8 values as int32.
template <int K>
inline int32x4_t QuarterU8(uint8x16_t v) {
  const uint16x8_t half = K < 2 ? vmovl_u8(vget_low_u8(v)) : vmovl_u8(vget_high_u8(v));
  return vreinterpretq_s32_u32(K % 2 == 0 ? vmovl_u16(vget_low_u16(half)) : vmovl_high_u16(half));
}

// One group's exact int32 sums of rows 4k..4k+3 added to y (4 floats) as the reference does.
inline void AddQ4Group(float* y, int32x4_t sum, const uint16_t* dw, float da) {
  const float32x4_t d = vmulq_n_f32(F16x4(dw), da);
  vst1q_f32(y, vfmaq_f32(vld1q_f32(y), vcvtq_f32_s32(sum), d));
}
// q8: times 2^-(e_w + e_a), built in the exponent field (e <= 126: a normal float, exact).
inline void AddQ8Group(float* y, int32x4_t sum, int32x4_t ew, float neg_ea) {
  const int32_t ea = static_cast<int32_t>(-neg_ea);
  const float32x4_t pow2 = vreinterpretq_f32_s32(vshlq_n_s32(vsubq_s32(vdupq_n_s32(127 - ea), ew), 23));
  vst1q_f32(y, vaddq_f32(vld1q_f32(y), vmulq_f32(vcvtq_f32_s32(sum), pow2)));
}
// The group's 16 q8 shifts, capped at kQ8MaxShift, per row quarter.
inline void Q8Shifts(const uint8_t* shifts, int32x4_t (&ew)[4]) {
  const uint8x16_t e = vminq_u8(vld1q_u8(shifts), vdupq_n_u8(kQ8MaxShift));
  Unroll<4>([&]<int K>() { ew[K] = QuarterU8<K>(e); });
}
// A group's epilogue for token t's rows 4k..4k+3.
template <bool kQ4>
inline void AddGroup(const detail::TileArgs& b, size_t g, int k, const int32x4_t (&ew)[4], int32x4_t sum, float da,
                     float* y) {
  if constexpr (kQ4)
    AddQ4Group(y + 4 * k, sum, b.q4_scales + g * kTileRows + 4 * k, da);
  else
    AddQ8Group(y + 4 * k, sum, ew[k], da);
}

// q8 / q4 on sdot: the whole tile for T <= 4 tokens; 1-2 tokens (decode) in two chains (even and
// odd chunks) so that 8 independent accumulators cover sdot's latency. Chain 0 starts at the bias.
template <int T, bool kQ4>
__attribute__((noinline)) void DotTile(const detail::TileArgs& b, float (*yacc)[16]) {
  constexpr int C = T <= 2 ? 2 : 1;
  const size_t G = b.G, chunks = kQ4 ? G / 8 : G / 4, hi_off = G / 2, ldq = b.ldq;
  const uint8x16_t nibble = vdupq_n_u8(0x0F), flip = vdupq_n_u8(0x80);
  for (size_t g = 0; g < b.groups; ++g) {
    const int8_t* qg = b.q + g * G;
    const uint8_t* wg = b.w + g * chunks * 64;
    int32x4_t acc[C][T][4];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) acc[c][t][k] = vdupq_n_s32(c == 0 ? b.bias[g * T + t] : 0);
    for (size_t v = 0; v < chunks; v += 4) {  // a multiple of 4 (groups of 32k inputs)
      int8x16_t alo[T], ahi[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        alo[t] = vld1q_s8(qg + t * ldq + 4 * v);
        if constexpr (kQ4) ahi[t] = vld1q_s8(qg + t * ldq + hi_off + 4 * v);
      }
      Unroll<4>([&]<int J>() {
        constexpr int c = J % C;
        const uint8_t* ch = wg + (v + J) * 64;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const uint8x16_t raw = vld1q_u8(ch + 16 * k);
          if constexpr (kQ4) {
            const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, nibble));
            const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
#pragma GCC unroll 4
            for (int t = 0; t < T; ++t) {
              acc[c][t][k] = vdotq_laneq_s32(acc[c][t][k], lo, alo[t], J);
              acc[c][t][k] = vdotq_laneq_s32(acc[c][t][k], hi, ahi[t], J);
            }
          } else {
            const int8x16_t s = vreinterpretq_s8_u8(veorq_u8(raw, flip));
#pragma GCC unroll 4
            for (int t = 0; t < T; ++t) acc[c][t][k] = vdotq_laneq_s32(acc[c][t][k], s, alo[t], J);
          }
        }
      });
    }
    int32x4_t ew[4];
    if constexpr (!kQ4) Q8Shifts(b.q8_shifts + g * kTileRows, ew);
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const int32x4_t sum = C == 2 ? vaddq_s32(acc[0][t][k], acc[C - 1][t][k]) : acc[0][t][k];
        AddGroup<kQ4>(b, g, k, ew, sum, b.da[g * T + t], yacc[t]);
      }
  }
}

// q3 / q2 on sdot, row quarters K0..K0+KN-1 for T tokens. Chunk k of a super-block (inputs
// 16k..16k+15) holds in field f (bits 2f, 2f + 1; q3's third bit in the 32 bytes after it) the codes
// of quad 4k + f: one sdot by lane f against the 16 activations of the chunk. Per sub-block (two
// chunks) the exact dot is scaled by its 4-bit scale (an integer multiply-add); the mins' term
// comes from the sub-block sums of the activations (the driver's table) at the group's end.
template <int T, int kBits, int K0, int KN>
inline void DotSuperQuarters(const detail::TileArgs& b, size_t g, float (*yacc)[16]) {
  constexpr size_t kChunkBytes = kBits == 3 ? 96 : 64;
  const uint8x16_t three = vdupq_n_u8(3), four = vdupq_n_u8(4), low = vdupq_n_u8(0x0F);
  const uint8_t* sb = b.w + g * 16 * kChunkBytes;
  const int8_t* qg = b.q + g * kSuperGroup;
  int32x4_t i1[T][KN], i2[T][KN];
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
    for (int k = 0; k < KN; ++k) i1[t][k] = i2[t][k] = vdupq_n_s32(0);
  for (size_t j = 0; j < kSubGroups; ++j) {
    int32x4_t dot[T][KN];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t)
#pragma GCC unroll 4
      for (int k = 0; k < KN; ++k) dot[t][k] = vdupq_n_s32(0);
#pragma GCC unroll 2
    for (size_t h = 0; h < 2; ++h) {
      const size_t chunk = 2 * j + h;
      const uint8_t* ch = sb + chunk * kChunkBytes;
      int8x16_t a[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) a[t] = vld1q_s8(qg + t * b.ldq + 16 * chunk);
      Unroll<KN>([&]<int KK>() {
        constexpr int K = K0 + KK;
        const uint8x16_t raw = vld1q_u8(ch + 16 * K);
        [[maybe_unused]] const uint8x16_t high = kBits == 3 ? vld1q_u8(ch + 64 + 16 * (K % 2)) : raw;
        Unroll<4>([&]<int F>() {
          uint8x16_t code = raw;
          if constexpr (F > 0) code = vshrq_n_u8(raw, 2 * F);
          code = vandq_u8(code, three);
          if constexpr (kBits == 3) {  // the high bit of field F sits at bit F + 4 (K / 2): to bit 2
            constexpr int kAt = F + 4 * (K / 2);
            uint8x16_t h3 = high;
            if constexpr (kAt > 2) h3 = vshrq_n_u8(high, kAt - 2);
            if constexpr (kAt < 2) h3 = vshlq_n_u8(high, 2 - kAt);
            code = vorrq_u8(code, vandq_u8(h3, four));
          }
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) dot[t][KK] = vdotq_laneq_s32(dot[t][KK], vreinterpretq_s8_u8(code), a[t], F);
        });
      });
    }
    const uint8x16_t sub = vld1q_u8(b.sb_sub + (g * kSubGroups + j) * kTileRows);
    const uint8x16_t sc = vandq_u8(sub, low), mn = vshrq_n_u8(sub, 4);
    Unroll<KN>([&]<int KK>() {
      const int32x4_t sc_k = QuarterU8<K0 + KK>(sc), mn_k = QuarterU8<K0 + KK>(mn);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        i1[t][KK] = vmlaq_s32(i1[t][KK], dot[t][KK], sc_k);
        i2[t][KK] = vmlaq_n_s32(i2[t][KK], mn_k, b.asum[t * b.ldsum + g * kSubGroups + j]);
      }
    });
  }
#pragma GCC unroll 4
  for (int k = 0; k < KN; ++k) {
    const float32x4_t d = F16x4(b.sb_d + g * kTileRows + 4 * (K0 + k));
    const float32x4_t dmin = F16x4(b.sb_dmin + g * kTileRows + 4 * (K0 + k));
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const float da = b.da[g * T + t];
      float* y = yacc[t] + 4 * (K0 + k);
      float32x4_t acc = vfmaq_f32(vld1q_f32(y), vcvtq_f32_s32(i1[t][k]), vmulq_n_f32(d, da));
      acc = vfmaq_f32(acc, vcvtq_f32_s32(i2[t][k]), vnegq_f32(vmulq_n_f32(dmin, da)));
      vst1q_f32(y, acc);
    }
  }
}

// The whole tile for 1-2 tokens; 3-4 tokens half by half (the sums of 16 rows x 4 tokens would
// not fit the 32 registers), both halves per group while its codes are in L1.
template <int T, int kBits>
__attribute__((noinline)) void DotSuperTile(const detail::TileArgs& b, float (*yacc)[16]) {
  for (size_t g = 0; g < b.groups; ++g) {
    if constexpr (T <= 2) {
      DotSuperQuarters<T, kBits, 0, 4>(b, g, yacc);
    } else {
      DotSuperQuarters<T, kBits, 0, 2>(b, g, yacc);
      DotSuperQuarters<T, kBits, 2, 2>(b, g, yacc);
    }
  }
}

template <int T>
void DotTileAny(const detail::TileArgs& b, float (*yacc)[16]) {
  switch (b.format) {
    case WeightFormat::kQ4: return DotTile<T, true>(b, yacc);
    case WeightFormat::kQ8: return DotTile<T, false>(b, yacc);
    case WeightFormat::kQ3: return DotSuperTile<T, 3>(b, yacc);
    default: return DotSuperTile<T, 2>(b, yacc);
  }
}

constexpr int kDotMaxTok = 4;

void DotBlock(const detail::TileArgs& b, int nt, float (*yacc)[16]) {
  switch (nt) {
    case 1: return DotTileAny<1>(b, yacc);
    case 2: return DotTileAny<2>(b, yacc);
    case 3: return DotTileAny<3>(b, yacc);
    default: return DotTileAny<4>(b, yacc);
  }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")

// q8 / q4 on usmmla, tile rows 4K..4K+7 (quarters K, K + 1) x T tokens (pairs p: tokens 2p, 2p + 1;
// an odd count's last pair has zero activations for its second). acc[p][kk][h] holds rows
// 4(K + kk) + 2h, + 1 against the pair's two tokens: [row0 t0, row0 t1, row1 t0, row1 t1].
template <int T, bool kQ4, int K>
inline void MmlaHalf(const detail::TileArgs& b, size_t g, const int32x4_t (&ew)[4], float (*yacc)[16]) {
  constexpr int P = (T + 1) / 2;
  const size_t G = b.G, chunks = kQ4 ? G / 8 : G / 4, hi_off = G / 2, ldq = b.ldq;
  const uint8x16_t nibble = vdupq_n_u8(0x0F);
  const int8_t* qg = b.q + g * G;
  const uint8_t* wg = b.w + g * chunks * 64;
  int32x4_t acc[P][2][2];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 2
    for (int kk = 0; kk < 2; ++kk) acc[p][kk][0] = acc[p][kk][1] = vdupq_n_s32(0);
  for (size_t v = 0; v < chunks; v += 2) {  // chunks v, v + 1: inputs 4v..4v+7 of every row
    int8x16_t alo[P], ahi[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const int8_t* q0 = qg + 2 * p * ldq + 4 * v;
      const bool pair = 2 * p + 1 < T;
      alo[p] = vcombine_s8(vld1_s8(q0), pair ? vld1_s8(q0 + ldq) : vdup_n_s8(0));
      if constexpr (kQ4) ahi[p] = vcombine_s8(vld1_s8(q0 + hi_off), pair ? vld1_s8(q0 + ldq + hi_off) : vdup_n_s8(0));
    }
#pragma GCC unroll 2
    for (int kk = 0; kk < 2; ++kk) {
      const uint32x4_t c0 = vreinterpretq_u32_u8(vld1q_u8(wg + v * 64 + 16 * (K + kk)));
      const uint32x4_t c1 = vreinterpretq_u32_u8(vld1q_u8(wg + (v + 1) * 64 + 16 * (K + kk)));
      const uint8x16_t rows[2] = {vreinterpretq_u8_u32(vzip1q_u32(c0, c1)), vreinterpretq_u8_u32(vzip2q_u32(c0, c1))};
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        if constexpr (kQ4) {
          const uint8x16_t lo = vandq_u8(rows[h], nibble), hi = vshrq_n_u8(rows[h], 4);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) {
            acc[p][kk][h] = vusmmlaq_s32(acc[p][kk][h], lo, alo[p]);
            acc[p][kk][h] = vusmmlaq_s32(acc[p][kk][h], hi, ahi[p]);
          }
        } else {
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) acc[p][kk][h] = vusmmlaq_s32(acc[p][kk][h], rows[h], alo[p]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 2
    for (int kk = 0; kk < 2; ++kk) {
      const int32x4_t by_token[2] = {vuzp1q_s32(acc[p][kk][0], acc[p][kk][1]),
                                     vuzp2q_s32(acc[p][kk][0], acc[p][kk][1])};
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        const int t = 2 * p + i;
        if (t >= T) break;
        const int32x4_t sum = vaddq_s32(by_token[i], vdupq_n_s32(b.bias[g * T + t]));
        AddGroup<kQ4>(b, g, K + kk, ew, sum, b.da[g * T + t], yacc[t]);
      }
    }
}

template <int T, bool kQ4>
__attribute__((noinline)) void MmlaTile(const detail::TileArgs& b, float (*yacc)[16]) {
  for (size_t g = 0; g < b.groups; ++g) {
    int32x4_t ew[4];
    if constexpr (!kQ4) Q8Shifts(b.q8_shifts + g * kTileRows, ew);
    MmlaHalf<T, kQ4, 0>(b, g, ew, yacc);
    MmlaHalf<T, kQ4, 2>(b, g, ew, yacc);
  }
}

template <int T>
void MmlaTileAny(const detail::TileArgs& b, float (*yacc)[16]) {
  if (b.format == WeightFormat::kQ4)
    MmlaTile<T, true>(b, yacc);
  else
    MmlaTile<T, false>(b, yacc);
}

void MmlaBlock(const detail::TileArgs& b, int nt, float (*yacc)[16]) {
  switch (nt) {
    case 1: return MmlaTileAny<1>(b, yacc);  // not from the driver's blocks of 2+ (see QuantMatMulI8mm)
    case 2: return MmlaTileAny<2>(b, yacc);
    case 3: return MmlaTileAny<3>(b, yacc);
    case 4: return MmlaTileAny<4>(b, yacc);
    case 5: return MmlaTileAny<5>(b, yacc);
    case 6: return MmlaTileAny<6>(b, yacc);
    case 7: return MmlaTileAny<7>(b, yacc);
    default: return MmlaTileAny<8>(b, yacc);
  }
}

#pragma GCC pop_options

// Unsigned q8 codes for usmmla (bias -128 x sum); sdot reads them signed.
constexpr detail::TileKernel kDotKernel{DotBlock, kDotMaxTok, true};
constexpr detail::TileKernel kMmlaKernel{MmlaBlock, detail::kMaxTileTokens, false};

}  // namespace

void QuantMatMulDotProd(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end,
                        float* y, size_t ldy, KernelScratch& scratch) {
  detail::QuantMatMulByTiles(kDotKernel, w, a, tile_begin, tile_end, y, ldy, scratch);
}

void QuantMatMulI8mm(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                     size_t ldy, KernelScratch& scratch) {
  // A single token (decode) has no pair to fill usmmla's second operand: sdot, with its table.
  const bool lone = a.n_tok == 1 || IsSuperBlock(w.format);
  detail::QuantMatMulByTiles(lone ? kDotKernel : kMmlaKernel, w, a, tile_begin, tile_end, y, ldy, scratch);
}

}  // namespace m3::simd::arm

#else  // not 64-bit ARM: never selected

namespace m3::simd::arm {
bool HasDotProd() { return false; }
bool HasI8mm() { return false; }
void QuantMatMulDotProd(const WeightRef&, const QuantizedActivations&, size_t, size_t, float*, size_t,
                        KernelScratch&) {}
void QuantMatMulI8mm(const WeightRef&, const QuantizedActivations&, size_t, size_t, float*, size_t, KernelScratch&) {}
}  // namespace m3::simd::arm

#endif
