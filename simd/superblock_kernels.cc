// Highway implementations of the q3/q2 (super-block) matmul of quant_kernels.h, one per SIMD
// target; ref::QuantMatMul is their definition. Portable: a row tile is taken 8 (or 4, the
// vector's int32 lanes) rows at a time, each lane one row's 4 bytes of a chunk, codes cut out with
// shifts, for up to 4 tokens at a time. AVX2 and the AVX-512 targets: unsigned codes times signed
// activations with maddubs, summed in int16 over a sub-block (at most 32 x 7 x 127, no overflow),
// and one madd by the sub-block scales that widens to int32 (docs/KERNELS.md).
#include <algorithm>
#include <cmath>
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/superblock_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "simd/dispatch.h"
#include "simd/kernel_table.h"
#include "simd/quant_kernels.h"
#include "simd/quant_tiles.h"

HWY_BEFORE_NAMESPACE();
namespace m3::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using detail::TileArgs;

constexpr int kTok = 4;

// Portable: lanes are rows (int32: a row's 4 bytes of a chunk), 8 rows or fewer at a time.
template <int T>
void SuperBlockTilePortable(const TileArgs& b, float (*yacc)[16]) {
  const hn::CappedTag<int32_t, 8> di;
  const hn::RebindToUnsigned<decltype(di)> du;
  const hn::Rebind<float, decltype(di)> df;
  const hn::Rebind<uint8_t, decltype(di)> d8;
  const size_t N = hn::Lanes(di);
  const bool q3 = b.format == WeightFormat::kQ3;
  const size_t chunk_bytes = q3 ? 96 : 64, sb_bytes = 16 * chunk_bytes;
  const auto three = hn::Set(du, 3u), one = hn::Set(du, 1u);
  for (size_t j0 = 0; j0 < kTileRows; j0 += N) {
    const int hshift = j0 >= 8 ? 4 : 0;
    for (size_t g = 0; g < b.groups; ++g) {
      float dw[kTileRows], dm[kTileRows];
      for (size_t i = 0; i < kTileRows; ++i)
        dw[i] = F16ToF32(b.sb_d[g * kTileRows + i]), dm[i] = F16ToF32(b.sb_dmin[g * kTileRows + i]);
      auto i1_0 = hn::Zero(di), i1_1 = hn::Zero(di), i1_2 = hn::Zero(di), i1_3 = hn::Zero(di);
      auto i2_0 = hn::Zero(di), i2_1 = hn::Zero(di), i2_2 = hn::Zero(di), i2_3 = hn::Zero(di);
      for (size_t j = 0; j < kSubGroups; ++j) {
        auto s0 = hn::Zero(di), s1 = hn::Zero(di), s2 = hn::Zero(di), s3 = hn::Zero(di);
        for (size_t k = 2 * j; k < 2 * j + 2; ++k) {
          const uint8_t* ch = b.w + g * sb_bytes + k * chunk_bytes;
          const auto wv = hn::LoadU(du, reinterpret_cast<const uint32_t*>(ch) + j0);
          const auto hv = q3 ? hn::LoadU(du, reinterpret_cast<const uint32_t*>(ch + 64) + j0 % 8) : hn::Zero(du);
          for (int f = 0; f < 4; ++f)
            for (int by = 0; by < 4; ++by) {
              auto c = hn::And(hn::ShiftRightSame(wv, 8 * by + 2 * f), three);
              if (q3) c = hn::Or(c, hn::ShiftLeft<2>(hn::And(hn::ShiftRightSame(hv, 8 * by + f + hshift), one)));
              const auto code = hn::BitCast(di, c);
              const size_t idx = g * kSuperGroup + 16 * k + 4 * f + by;
              const int8_t* qv = b.q + idx;
              s0 = hn::Add(s0, hn::Mul(code, hn::Set(di, qv[0])));
              if constexpr (T > 1) s1 = hn::Add(s1, hn::Mul(code, hn::Set(di, qv[b.ldq])));
              if constexpr (T > 2) s2 = hn::Add(s2, hn::Mul(code, hn::Set(di, qv[2 * b.ldq])));
              if constexpr (T > 3) s3 = hn::Add(s3, hn::Mul(code, hn::Set(di, qv[3 * b.ldq])));
            }
        }
        const auto sub = hn::PromoteTo(di, hn::LoadU(d8, b.sb_sub + (g * kSubGroups + j) * kTileRows + j0));
        const auto sc = hn::And(sub, hn::Set(di, 0xF)), mn = hn::ShiftRight<4>(sub);
        const int16_t* as = b.asum + g * kSubGroups + j;
        i1_0 = hn::Add(i1_0, hn::Mul(s0, sc));
        i2_0 = hn::Add(i2_0, hn::Mul(mn, hn::Set(di, as[0])));
        if constexpr (T > 1) {
          i1_1 = hn::Add(i1_1, hn::Mul(s1, sc));
          i2_1 = hn::Add(i2_1, hn::Mul(mn, hn::Set(di, as[b.ldsum])));
        }
        if constexpr (T > 2) {
          i1_2 = hn::Add(i1_2, hn::Mul(s2, sc));
          i2_2 = hn::Add(i2_2, hn::Mul(mn, hn::Set(di, as[2 * b.ldsum])));
        }
        if constexpr (T > 3) {
          i1_3 = hn::Add(i1_3, hn::Mul(s3, sc));
          i2_3 = hn::Add(i2_3, hn::Mul(mn, hn::Set(di, as[3 * b.ldsum])));
        }
      }
      auto finish = [&](int t, decltype(i1_0) i1, decltype(i1_0) i2) HWY_ATTR {
        const auto da = hn::Set(df, b.da[g * T + t]);
        auto y = hn::LoadU(df, yacc[t] + j0);
        y = hn::MulAdd(hn::ConvertTo(df, i1), hn::Mul(hn::LoadU(df, dw + j0), da), y);
        y = hn::NegMulAdd(hn::ConvertTo(df, i2), hn::Mul(hn::LoadU(df, dm + j0), da), y);
        hn::StoreU(y, df, yacc[t] + j0);
      };
      finish(0, i1_0, i2_0);
      if constexpr (T > 1) finish(1, i1_1, i2_1);
      if constexpr (T > 2) finish(2, i1_2, i2_2);
      if constexpr (T > 3) finish(3, i1_3, i2_3);
    }
  }
}

// The AVX2 bodies serve the AVX-512 targets too (their 512-bit forms would need other layouts).
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL

inline int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The end of super-block g for half h (8 rows) of the tile: I2 = sum_j mn_j A_j (the rows'
// (mn_j, mn_j+1) pairs against each token's (A_j, A_j+1)), then per token
// y = fma(I1, d d_a, y) and y = fma(I2, -(dmin d_a), y) as the reference.
template <int T>
HWY_INLINE void FinishHalf(const TileArgs& b, size_t g, int h, const __m256i* i1, float (*yacc)[16]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const uint8_t* sub = b.sb_sub + g * kSubGroups * kTileRows + 8 * h;
  __m256i mn[kSubGroups / 2];
  for (size_t p = 0; p < kSubGroups / 2; ++p) {
    const __m128i m0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 2 * p * kTileRows));
    const __m128i m1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + (2 * p + 1) * kTileRows));
    mn[p] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(_mm_unpacklo_epi8(m0, m1), 4), low4));
  }
  const auto* d = reinterpret_cast<const __m128i*>(b.sb_d + g * kTileRows + 8 * h);
  const auto* dmin = reinterpret_cast<const __m128i*>(b.sb_dmin + g * kTileRows + 8 * h);
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(d)), dm = _mm256_cvtph_ps(_mm_loadu_si128(dmin));
#pragma GCC unroll 4
  for (int t = 0; t < T; ++t) {
    const int16_t* as = b.asum + t * b.ldsum + g * kSubGroups;
    __m256i i2 = _mm256_madd_epi16(mn[0], _mm256_set1_epi32(Load32(as)));
    for (size_t p = 1; p < kSubGroups / 2; ++p)
      i2 = _mm256_add_epi32(i2, _mm256_madd_epi16(mn[p], _mm256_set1_epi32(Load32(as + 2 * p))));
    const __m256 da = _mm256_set1_ps(b.da[g * T + t]);
    __m256 y = _mm256_loadu_ps(yacc[t] + 8 * h);
    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[t]), _mm256_mul_ps(dw, da), y);
    y = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(i2), _mm256_mul_ps(dm, da), y);
    _mm256_storeu_ps(yacc[t] + 8 * h, y);
  }
}

// Half a row tile at a time (8 rows: the low or high 32 bytes of each 64-byte chunk) for up to 4
// tokens: per field of a chunk, the codes cut out once ((raw >> 2f) & 3, q3 or'ing in its high
// bit), then per token one broadcast, maddubs and an int16 add; per sub-block one madd by its
// scales (each row's twice: a row's two int16 pair sums) into int32.
template <int T, int kBits>
void SuperBlockTile(const TileArgs& b, float (*yacc)[16]) {
  const size_t chunk_bytes = kBits == 3 ? 96 : 64, sb_bytes = 16 * chunk_bytes;
  const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    for (size_t g = 0; g < b.groups; ++g) {
      __m256i i1[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) i1[t] = _mm256_setzero_si256();
      const uint8_t* sub = b.sb_sub + g * kSubGroups * kTileRows + 8 * h;
      const int8_t* qg = b.q + g * kSuperGroup;
      for (size_t j = 0; j < kSubGroups; ++j) {
        __m256i s16[T];
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) s16[t] = _mm256_setzero_si256();
        for (size_t k = 2 * j; k < 2 * j + 2; ++k) {
          const uint8_t* ch = b.w + g * sb_bytes + k * chunk_bytes;
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 32 * h));
          const __m256i hi = kBits == 3 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 64)) : raw;
#pragma GCC unroll 4
          for (int f = 0; f < 4; ++f) {
            __m256i c = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * f), three);
            if constexpr (kBits == 3) {
              const int sh = f + 4 * h;  // the high bit's position; it goes to bit 2
              const __m256i hb = sh >= 2 ? _mm256_srli_epi16(hi, sh - 2) : _mm256_slli_epi16(hi, 2 - sh);
              c = _mm256_or_si256(c, _mm256_and_si256(hb, four));
            }
#pragma GCC unroll 4
            for (int t = 0; t < T; ++t) {
              const __m256i a = _mm256_set1_epi32(Load32(qg + t * b.ldq + 16 * k + 4 * f));
              s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(c, a));
            }
          }
        }
        const __m128i sb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + j * kTileRows));
        const __m256i sc = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_unpacklo_epi8(sb, sb), low4));
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) i1[t] = _mm256_add_epi32(i1[t], _mm256_madd_epi16(s16[t], sc));
      }
      FinishHalf<T>(b, g, h, i1, yacc);
    }
  }
}

// Decode's prefetch distances: the codes this many bytes ahead (into the next tile at a tile's
// end: a thread's tiles are consecutive), the scales this many super-blocks ahead. The kernel
// spends ~14 cycles a 64-byte chunk, too long for the out-of-order window to keep enough lines
// in flight; the hardware prefetcher alone left a core at 0.56-0.76 of the read bandwidth (q2,
// 1-2 threads, 2-core Zen 3, weights cycling through 180 MB), 4 KiB ahead 0.67-0.88 (q3 alike);
// 2 KiB was ~2% slower, 8 KiB the same. The scales' streams (4 KiB a tile, their lines each
// serving 2-4 super-blocks) added ~1-3%.
constexpr size_t kAheadBytes = 4096, kAheadGroups = 4;

// Decode (1-2 tokens): the whole tile per chunk, both halves from one broadcast. Reading a tile
// half by half streams every cache line during the first half and computes the second from
// cache, so memory idles for half of the time (measured: 0.47-0.55 of the read bandwidth).
template <int T, int kBits>
void SuperBlockTileFull(const TileArgs& b, float (*yacc)[16]) {
  const size_t chunk_bytes = kBits == 3 ? 96 : 64, sb_bytes = 16 * chunk_bytes;
  const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (size_t g = 0; g < b.groups; ++g) {
    __m256i i1[T][2];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) i1[t][0] = i1[t][1] = _mm256_setzero_si256();
    const uint8_t* sub = b.sb_sub + g * kSubGroups * kTileRows;
    const int8_t* qg = b.q + g * kSuperGroup;
    const char* sub_ahead = reinterpret_cast<const char*>(sub + kAheadGroups * kSubGroups * kTileRows);
    _mm_prefetch(sub_ahead, _MM_HINT_T0);
    _mm_prefetch(sub_ahead + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b.sb_d + (g + kAheadGroups) * kTileRows), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b.sb_dmin + (g + kAheadGroups) * kTileRows), _MM_HINT_T0);
    for (size_t j = 0; j < kSubGroups; ++j) {
      __m256i s16[T][2];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) s16[t][0] = s16[t][1] = _mm256_setzero_si256();
      for (size_t k = 2 * j; k < 2 * j + 2; ++k) {
        const uint8_t* ch = b.w + g * sb_bytes + k * chunk_bytes;
        _mm_prefetch(reinterpret_cast<const char*>(ch + kAheadBytes), _MM_HINT_T0);  // never faults
        if constexpr (kBits == 3) _mm_prefetch(reinterpret_cast<const char*>(ch + kAheadBytes + 64), _MM_HINT_T0);
        const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch));
        const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 32));
        const __m256i hi = kBits == 3 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 64)) : raw0;
#pragma GCC unroll 4
        for (int f = 0; f < 4; ++f) {
          __m256i c0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 2 * f), three);
          __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 2 * f), three);
          if constexpr (kBits == 3) {  // high bits: f for rows 0-7, f + 4 for rows 8-15, moved to bit 2
            c0 = _mm256_or_si256(c0, _mm256_and_si256(f >= 2 ? _mm256_srli_epi16(hi, f - 2) : _mm256_slli_epi16(hi, 2 - f), four));
            c1 = _mm256_or_si256(c1, _mm256_and_si256(_mm256_srli_epi16(hi, f + 2), four));
          }
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) {
            const __m256i a = _mm256_set1_epi32(Load32(qg + t * b.ldq + 16 * k + 4 * f));
            s16[t][0] = _mm256_add_epi16(s16[t][0], _mm256_maddubs_epi16(c0, a));
            s16[t][1] = _mm256_add_epi16(s16[t][1], _mm256_maddubs_epi16(c1, a));
          }
        }
      }
      const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + j * kTileRows));
      const __m256i sc0 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_unpacklo_epi8(sb, sb), low4));
      const __m256i sc1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_unpackhi_epi8(sb, sb), low4));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        i1[t][0] = _mm256_add_epi32(i1[t][0], _mm256_madd_epi16(s16[t][0], sc0));
        i1[t][1] = _mm256_add_epi32(i1[t][1], _mm256_madd_epi16(s16[t][1], sc1));
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i half[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) half[t] = i1[t][h];
      FinishHalf<T>(b, g, h, half, yacc);
    }
  }
}

#else

template <int T, int kBits>
void SuperBlockTile(const TileArgs& b, float (*yacc)[16]) {
  SuperBlockTilePortable<T>(b, yacc);
}
template <int T, int kBits>
void SuperBlockTileFull(const TileArgs& b, float (*yacc)[16]) {
  SuperBlockTilePortable<T>(b, yacc);
}

#endif

// A token block's tile: 1-2 tokens the whole tile at once (decode), 3-4 half by half.
template <int kBits>
void RunTile(int nt, const TileArgs& args, float (*yacc)[16]) {
  switch (nt) {
    case 1: SuperBlockTileFull<1, kBits>(args, yacc); break;
    case 2: SuperBlockTileFull<2, kBits>(args, yacc); break;
    case 3: SuperBlockTile<3, kBits>(args, yacc); break;
    default: SuperBlockTile<4, kBits>(args, yacc); break;
  }
}

void SuperBlockBlock(const TileArgs& b, int nt, float (*yacc)[16]) {
  if (b.format == WeightFormat::kQ3)
    RunTile<3>(nt, b, yacc);
  else
    RunTile<2>(nt, b, yacc);
}

void SuperBlockMatMulImpl(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end,
                          float* y, size_t ldy, KernelScratch& scratch) {
  detail::QuantMatMulByTiles({SuperBlockBlock, kTok, false}, w, a, tile_begin, tile_end, y, ldy, scratch);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace m3::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace m3::simd {

HWY_EXPORT(SuperBlockMatMulImpl);

namespace detail {
KernelTable::QuantMatMulFn SuperBlockMatMulForTarget(int64_t target) {
  return HwyEntryFor(HWY_DISPATCH_TABLE(SuperBlockMatMulImpl), target);
}
}  // namespace detail

}  // namespace m3::simd
#endif  // HWY_ONCE
