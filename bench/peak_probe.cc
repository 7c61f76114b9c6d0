// The int8 compute-peak probes of limits.h (Int8PeakLoop, AmxInt8PeakLoop): the instruction
// sequence of this CPU's quant kernels (simd/quant_kernels*.cc) run from registers only, on
// independent accumulators, with opaque inputs so that nothing can be hoisted out of the loop.
// Highway code per target like the kernels (x86 targets: the kernels' maddubs + madd at their
// width; other targets: a portable int32 multiply-add), and the VNNI, AMX and ARM sdot / usmmla
// instructions under function target attributes, taken where the kernels take them.
#include <cstddef>
#include <cstdint>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/peak_probe.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "bench/limits.h"
#include "simd/quant_kernels_arm.h"
#include "simd/quant_kernels_x86.h"

HWY_BEFORE_NAMESPACE();
namespace m3::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The targets whose quant kernels use maddubs + madd (simd/quant_kernels.cc): the same test.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2

// u8 x s8 products summed in pairs to int16 (maddubs), then in pairs to int32 (madd with ones).
template <class V>
V MaddubsMadd(V u8, V s8, V ones) {
#if HWY_TARGET == HWY_AVX2
  return V{_mm256_madd_epi16(_mm256_maddubs_epi16(u8.raw, s8.raw), ones.raw)};
#else
  return V{_mm512_madd_epi16(_mm512_maddubs_epi16(u8.raw, s8.raw), ones.raw)};
#endif
}

// 12 independent chains of maddubs + madd + add at the target's full width.
constexpr int kChains = 12;
uint64_t PeakImpl(uint64_t iterations, int32_t seed) {
  const hn::ScalableTag<int32_t> di;
  const auto x = hn::Set(di, seed), z = hn::Set(di, seed * 7 + 3), ones = hn::Set(di, 0x00010001);
  hn::Vec<decltype(di)> acc[kChains];
#pragma GCC unroll 12
  for (int i = 0; i < kChains; ++i) acc[i] = hn::Set(di, i);
  for (uint64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) {
      auto xi = x;
      asm volatile("" : "+v"(xi.raw));  // opaque copy: the loop-invariant product must not be hoisted
      acc[i] = hn::Add(acc[i], MaddubsMadd(xi, z, ones));
    }
  }
  auto s = acc[0];
  for (int i = 1; i < kChains; ++i) s = hn::Add(s, acc[i]);
  return static_cast<uint32_t>(hn::GetLane(hn::SumOfLanes(di, s)));
}
uint64_t PeakOpsPerIter() { return kChains * hn::Lanes(hn::ScalableTag<int8_t>()) * 2; }

#else

uint64_t PeakImpl(uint64_t iterations, int32_t seed) {
  const hn::ScalableTag<int32_t> di;
  const auto x = hn::Set(di, seed), z = hn::Set(di, seed * 7 + 3);
  auto a0 = hn::Set(di, 0), a1 = hn::Set(di, 1), a2 = hn::Set(di, 2), a3 = hn::Set(di, 3);
  auto a4 = hn::Set(di, 4), a5 = hn::Set(di, 5), a6 = hn::Set(di, 6), a7 = hn::Set(di, 7);
  // a = a * x + z: loop-carried, so nothing can be hoisted; 8 chains hide the multiply latency.
  for (uint64_t it = 0; it < iterations; ++it) {
    a0 = hn::Add(hn::Mul(a0, x), z), a1 = hn::Add(hn::Mul(a1, x), z), a2 = hn::Add(hn::Mul(a2, x), z);
    a3 = hn::Add(hn::Mul(a3, x), z), a4 = hn::Add(hn::Mul(a4, x), z), a5 = hn::Add(hn::Mul(a5, x), z);
    a6 = hn::Add(hn::Mul(a6, x), z), a7 = hn::Add(hn::Mul(a7, x), z);
  }
  const auto s = hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)));
  return static_cast<uint32_t>(hn::GetLane(hn::SumOfLanes(di, s)));
}
uint64_t PeakOpsPerIter() { return 8 * 2 * hn::Lanes(hn::ScalableTag<int32_t>()); }

#endif

volatile int32_t g_peak_seed = 0x01020304;  // opaque inputs and sink keep the loop alive
volatile uint64_t g_peak_sink;

uint64_t Int8DotPeakImpl(uint64_t iterations) {
  g_peak_sink = PeakImpl(iterations, g_peak_seed);
  return iterations * PeakOpsPerIter();
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace m3::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "simd/amx_tiles.h"

#define M3_PROBE_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

namespace m3::bench {
namespace {

volatile int32_t g_x86_seed = 0x01020304;
volatile uint64_t g_x86_sink;

// vpdpbusd through a one-instruction asm, as the VNNI kernels issue it.
M3_PROBE_VNNI inline __m512i Dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// 16 independent vpdpbusd chains.
M3_PROBE_VNNI uint64_t PeakVnni(uint64_t iterations, int32_t seed) {
  const __m512i x = _mm512_set1_epi32(seed), z = _mm512_set1_epi32(seed * 7 + 3);
  __m512i acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(i);
  for (uint64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = Dpbusd(acc[i], x, z);
  }
  __m512i s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_epi32(s, acc[i]);
  return static_cast<uint32_t>(_mm512_reduce_add_epi32(s));
}

uint64_t Int8DotPeakVnni(uint64_t iterations) {
  g_x86_sink = PeakVnni(iterations, g_x86_seed);
  return iterations * 16 * 64 * 2;
}

constexpr uint64_t kAmxTokens = 16, kAmxRows = 16, kAmxK = 64;  // a tdpbsud: 16 x 16 sums of 64 products

// Four independent accumulator tiles keep the tile unit busy (tdpbsud, as the q8 prompt kernel).
// The instructions by register number, through the assembler only (simd/amx_tiles.h).
uint64_t AmxPeak(uint64_t iterations) {
  alignas(64) static const int8_t zeros[kAmxTokens * kAmxK] = {};
  simd::x86::LoadFullTileConfig();
  M3_TILE_LOAD(4, zeros, 64);
  M3_TILE_LOAD(5, zeros, 64);
  M3_TILE_LOAD(6, zeros, 64);
  M3_TILE_LOAD(7, zeros, 64);
  M3_TILE_ZERO(0);
  M3_TILE_ZERO(1);
  M3_TILE_ZERO(2);
  M3_TILE_ZERO(3);
  for (uint64_t it = 0; it < iterations; ++it) {
    M3_TILE_DPBSUD(0, 4, 6);
    M3_TILE_DPBSUD(1, 4, 7);
    M3_TILE_DPBSUD(2, 5, 6);
    M3_TILE_DPBSUD(3, 5, 7);
  }
  M3_TILE_RELEASE();
  return iterations * 4 * kAmxTokens * kAmxRows * kAmxK * 2;
}

}  // namespace
}  // namespace m3::bench

#else  // not x86-64 GCC/Clang: never taken (HasVnni and HasAmxInt8 are false)

namespace m3::bench {
namespace {
uint64_t Int8DotPeakVnni(uint64_t) { return 0; }
uint64_t AmxPeak(uint64_t) { return 0; }
}  // namespace
}  // namespace m3::bench

#endif

#if defined(__aarch64__) && defined(__GNUC__)
#include <arm_neon.h>

namespace m3::bench {
namespace {

volatile int32_t g_arm_seed = 0x01020304;
volatile uint64_t g_arm_sink;

// 16 independent chains of the instruction the ARM kernels issue (simd/quant_kernels_arm.cc):
// usmmla (32 products each) or sdot (16). The intrinsics are opaque to the compiler (no product is
// hoisted out of the loop); usmmla is only reached where the CPU has i8mm.
template <bool kMmla>
__attribute__((target("arch=armv8.2-a+dotprod+i8mm"))) uint64_t PeakArm(uint64_t iterations, int32_t seed) {
  const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(seed)), z = vreinterpretq_s8_s32(vdupq_n_s32(seed * 7 + 3));
  int32x4_t acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = vdupq_n_s32(i);
  for (uint64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      acc[i] = kMmla ? vusmmlaq_s32(acc[i], vreinterpretq_u8_s8(x), z) : vdotq_s32(acc[i], x, z);
  }
  int32x4_t s = acc[0];
  for (int i = 1; i < 16; ++i) s = vaddq_s32(s, acc[i]);
  return static_cast<uint32_t>(vaddvq_s32(s));
}

// The int8 operations performed (2 per multiply-add), 0 without the dot-product instructions.
uint64_t Int8PeakArm(uint64_t iterations) {
  if (simd::arm::HasI8mm()) {
    g_arm_sink = PeakArm<true>(iterations, g_arm_seed);
    return iterations * 16 * 32 * 2;
  }
  if (simd::arm::HasDotProd()) {
    g_arm_sink = PeakArm<false>(iterations, g_arm_seed);
    return iterations * 16 * 16 * 2;
  }
  return 0;
}

}  // namespace
}  // namespace m3::bench

#else

namespace m3::bench {
namespace {
uint64_t Int8PeakArm(uint64_t) { return 0; }
}  // namespace
}  // namespace m3::bench

#endif

namespace m3::bench {

HWY_EXPORT(Int8DotPeakImpl);

double Int8PeakLoop(size_t n) {
  if (simd::x86::HasVnni()) return static_cast<double>(Int8DotPeakVnni(n));
  if (simd::arm::HasDotProd()) return static_cast<double>(Int8PeakArm(n));
  return static_cast<double>(HWY_DYNAMIC_DISPATCH(Int8DotPeakImpl)(n));
}

double AmxInt8PeakLoop(size_t n) {
  return simd::x86::HasAmxInt8() ? static_cast<double>(AmxPeak(n)) : 0.0;  // HasAmxInt8 asks for the tile state
}

}  // namespace m3::bench
#endif  // HWY_ONCE
