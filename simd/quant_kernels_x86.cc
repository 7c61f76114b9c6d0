// AVX-512 VNNI and AVX512-BF16 kernels (quant_kernels_x86.h). Highway 1.0.3 ties VNNI to its
// AVX3_DL target, which also needs VBMI2 and friends (absent on Cascade Lake), so these are
// plain intrinsics under explicit target attributes. Every function using them is internal to
// this file and reached only after the CPU check; buffers are prepared in unattributed code so no
// AVX-512 instruction can end up in shared (COMDAT) functions.
#include "simd/quant_kernels_x86.h"
#include "simd/quant_tiles.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

// GCC 12's AVX-512 headers trip -Wuninitialized in their _mm*_undefined idiom (false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#define M3_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define M3_AVX512BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace m3::simd::x86 {
namespace {

// One kernel for every token count: a step of R row tiles is read in place (no repacking) and
// every chunk of up to 8 tokens passes over it while it is in L2. Up to 8 tokens (decode) that is
// a GEMV, at the memory bound with 1-2 tokens: one row tile at a time, one front-to-back stream
// the hardware prefetcher follows (on Zen 4 ~30% faster than four tiles side by side with
// software prefetch into L1, the earlier design tuned on Cascade Lake); GemvShape has the rest.
// For prompts it is compute bound and beat the 4-tile x 6-token asm GEMM with repacked weights
// that it replaced at every size: Zen 4, one 3072x6144 matrix in cache, GOP/s chunks vs GEMM, q4
// 16 tokens 283 vs 257, 64: 340 vs 302, 512: 314-344 vs 329; q8 16: 321 vs 210, 128: 413 vs 381,
// 512: 415 vs 405.
constexpr int kGemvMaxTok = 8;
// Prompts (more than kGemvMaxTok tokens) run in blocks of 6: 2 tiles x 6 tokens keep the 12 int32
// and 12 fp32 accumulators in registers, where 2 x 8 spills the fp32 ones at every group (q8
// 512-token GEMM on Zen 4: ~1-2% faster).
constexpr int kGemmTok = 6;

// The q4 GEMV does ~2x the vector work per byte of q8 (nibble unpacking, an epilogue per 32
// inputs), so its out-of-order window covers fewer bytes ahead and the hardware prefetcher alone
// leaves it well below the read bandwidth; it prefetches every line of its tiles ahead. 1 token:
// 4 KiB ahead into L1, ~0.82 -> ~0.88-0.92 of one core's read bandwidth on Zen 4 (two threads:
// unchanged at ~0.97-1.0; shorter distances did not help). 2-3 tokens: 8 KiB ahead into L2,
// 1.45-1.8x against none and 1.1-1.35x against 4 KiB into L1. 4-8 tokens (compute bound): 4 KiB
// into L1, +5-13% against none (8 KiB into L2 within +-3% of it). Measured paired call by call,
// weights cycling through 2.5 GiB, both expert shapes. q8 reads at the bandwidth limit without
// it, and prefetching slowed its 2-7 token GEMV by 3-20%.
// Four tiles side by side (R == kFourStreams, GemvShape), q4 and q8 alike: 1 KiB ahead into L1.
constexpr int kFourStreams = 4;
template <int R, int T>
inline void PrefetchGemvLine(const uint8_t* line) {
  if constexpr (R == kFourStreams)
    _mm_prefetch(reinterpret_cast<const char*>(line + 1024), _MM_HINT_T0);
  else if constexpr (T == 2 || T == 3)
    _mm_prefetch(reinterpret_cast<const char*>(line + 8192), _MM_HINT_T1);
  else
    _mm_prefetch(reinterpret_cast<const char*>(line + 4096), _MM_HINT_T0);
}

// A prompt block prefetches its share of the next step's weights into L1 while at most this many
// lines per group (the kernel's ~400 cycles of a q8 group); more, as with a prompt of a few token
// blocks (a MoE expert's share of a batch), and they go to L2 only: a prefetch into L1 holds one
// of its few miss buffers until the line arrives from memory, and so many leave the kernel's own
// loads waiting. Measured with the weights cycling through 20 matrices (cold, as an expert's
// are): L2 at 16 lines per group (20-24 tokens) +1.4-25%, at 13 (28 tokens) +3%; L1 at 11 (32
// tokens) and fewer is as fast or faster (L2 there: -2.5%).
constexpr size_t kL1PrefetchPerGroup = 12;

// Operands of one step: R consecutive row tiles x T tokens, over all groups.
struct Block {
  const uint8_t* w;    // codes of the first tile (q8 layout, or packed q4 when kQ4); tile r at w + r * tile_bytes
  const uint8_t* sc;   // scales of the first tile (WeightRef::tile_scale_bytes); tile r at sc + r * scale_bytes
  size_t tile_bytes, scale_bytes;
  const int8_t* q;     // activation codes of the first token, row-major: token t at q + t * ldq
  size_t ldq;
  const int32_t* bias;  // [groups][T]: -Z * (sum of the group's activation codes)
  const float* da;      // [groups][T]: q4 activation scales d_a, q8 negated shifts -e_a
  const float* sa;      // q8: [T] token scales s_a
  size_t groups, G;
  float* y;  // output of the first token and the first row
  size_t ldy;
  size_t rows;  // valid rows from the first one (the last tile may be partial)
  const uint8_t* prefetch;  // prompts: this block's share of the next step's codes, spread over its groups
  size_t prefetch_lines, prefetch_per_group;
  bool gemv;    // a decode block (kGemvMaxTok tokens or fewer): its own tiles are read from memory
  bool stream;  // write full tiles with non-temporal stores (outputs too large to stay in cache)
};

// vpdpbusd through a one-instruction asm: with the intrinsic GCC 12 copies and spills the
// tied accumulators around every instruction of the inner loop.
M3_VNNI inline __m512i Dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

inline int32_t Load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// GEMV: one row tile for T <= 8 tokens. Per group, accumulators take one vpdpbusd per 64-byte
// chunk and token (u8 codes x s8 activation quad broadcast; q4 chunks unpacked to their low and
// high nibbles, into separate accumulators) over C independent chains (chunks v, v + C, ...)
// that hide vpdpbusd latency when there are few tokens. Chain 0 starts at -Z * sum_a and the
// chains are summed with exact int32 adds, so they end at I_g exactly; then per token, as the
// reference does, q4: one cvt, one multiply d_w * d_a and one fma; q8: one cvt, one subtract
// (-e_a - e_w) and vscalefps, exact, and one add (none of them competes with vpdpbusd for the
// multiply ports, Zen 4 measured), with the row and token scales applied once at the end.
// Activations are read in place, one row per token (each a sequential stream of broadcasts).
// Never inlined: each shape is compiled alone, so its register allocation does not depend on
// the dispatch code around it (inlined into the dispatcher, the q8 4-token kernel ran a 16-token
// prompt 3.5% slower).
// kPrefetch: the prompt block's share of the next step; kAhead: GEMV, its own tiles' lines
// ahead (PrefetchGemvLine).
template <int R, int T, int C, bool kQ4, size_t kG, bool kPrefetch, bool kAhead>
M3_VNNI __attribute__((noinline)) void GemvTiles(const Block& b) {
  // q4: high nibbles in accumulators of their own, left in place (16 x code, one exact >> 4 per
  // group instead of a shift per chunk) while registers allow; with more (5+ tokens x 2 tiles)
  // they share the low ones, shifted down per chunk.
  constexpr bool kHiApart = kQ4 && R * C * T <= 8;
  constexpr int kParts = kHiApart ? 2 : 1;
  const size_t G = kG ? kG : b.G, chunks = kQ4 ? G / 8 : G / 4, group_bytes = chunks * 64;
  const size_t hi_off = G / 2;  // q4: high nibbles of chunk v hold quad v + G/8
  const size_t ldq = b.ldq;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 yacc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) yacc[r][t] = _mm512_setzero_ps();
  const uint8_t* wp = b.w;
  const int8_t* qp = b.q;
#pragma GCC unroll 2
  for (size_t g = 0; g < b.groups; ++g, qp += G, wp += group_bytes) {
    if constexpr (kPrefetch) {
      const size_t end = std::min(b.prefetch_lines, (g + 1) * b.prefetch_per_group);
      if (b.prefetch_per_group > kL1PrefetchPerGroup)
        for (size_t i = g * b.prefetch_per_group; i < end; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(b.prefetch + i * 64), _MM_HINT_T1);
      else
        for (size_t i = g * b.prefetch_per_group; i < end; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(b.prefetch + i * 64), _MM_HINT_T0);
    }
    __m512i acc[R][C][kParts][T];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < kParts; ++h)
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t)  // chain 0 starts at -Z * sum_a: no add in the epilogue
            acc[r][c][h][t] = c == 0 && h == 0 ? _mm512_set1_epi32(b.bias[g * T + t]) : _mm512_setzero_si512();
    for (size_t v = 0; v < chunks; v += C) {  // chunks (G/4 or G/8 with G % 32 == 0): a multiple of 4
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const int8_t* qv = qp + (v + c) * 4;
        if constexpr (kQ4 && !kHiApart && R * C * T >= 12) {
          // Every token's products with the low nibbles, then with the high ones, so that one
          // half of the codes is live at a time: with both, the 2 tiles x 6 tokens prompt block
          // spilled a register in this loop (q4 512-token GEMM without: +1.3-2%, 8 paired runs;
          // 16 tokens unchanged). 5 tokens do not spill, and split they were no faster.
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            __m512i half[R];
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              if constexpr (kAhead)
                if (h == 0) PrefetchGemvLine<R, T>(wp + r * b.tile_bytes + (v + c) * 64);
              const __m512i raw = _mm512_loadu_si512(wp + r * b.tile_bytes + (v + c) * 64);
              half[r] = _mm512_and_si512(h == 0 ? raw : _mm512_srli_epi16(raw, 4), nibble);
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; ++t) {
              const __m512i a = _mm512_set1_epi32(Load32(qv + h * hi_off + t * ldq));
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) acc[r][c][0][t] = Dpbusd(acc[r][c][0][t], half[r], a);
            }
          }
          continue;
        }
        // q4: the high nibbles stay in place (16 x code): no shift here, one exact >> 4 per group.
        __m512i lo[R], hi[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          if constexpr (kAhead) PrefetchGemvLine<R, T>(wp + r * b.tile_bytes + (v + c) * 64);
          const __m512i raw = _mm512_loadu_si512(wp + r * b.tile_bytes + (v + c) * 64);
          lo[r] = kQ4 ? _mm512_and_si512(raw, nibble) : raw;
          hi[r] = !kQ4 ? raw : kHiApart ? _mm512_andnot_si512(nibble, raw)
                                        : _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; ++t) {
          const __m512i a_lo = _mm512_set1_epi32(Load32(qv + t * ldq));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r][c][0][t] = Dpbusd(acc[r][c][0][t], lo[r], a_lo);
          if constexpr (kQ4) {
            const __m512i a_hi = _mm512_set1_epi32(Load32(qv + hi_off + t * ldq));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) acc[r][c][kParts - 1][t] = Dpbusd(acc[r][c][kParts - 1][t], hi[r], a_hi);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // q4: d_w, fp16 [groups][16]; q8: e_w, u8 [groups][16] after the 16 fp32 row scales.
      const uint8_t* sc = b.sc + r * b.scale_bytes;
      const auto* shifts = reinterpret_cast<const __m128i*>(sc + kTileRows * 4 + g * kTileRows);
      const __m512 dw =
          kQ4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * kTileRows * 2)))
              : _mm512_cvtepi32_ps(
                    _mm512_min_epu32(_mm512_cvtepu8_epi32(_mm_loadu_si128(shifts)), _mm512_set1_epi32(kQ8MaxShift)));
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        __m512i sum = acc[r][0][0][t], sum_hi = acc[r][0][kParts - 1][t];
#pragma GCC unroll 4
        for (int c = 1; c < C; ++c) {
          sum = _mm512_add_epi32(sum, acc[r][c][0][t]);
          if constexpr (kHiApart) sum_hi = _mm512_add_epi32(sum_hi, acc[r][c][1][t]);
        }
        if constexpr (kHiApart) sum = _mm512_add_epi32(sum, _mm512_srai_epi32(sum_hi, 4));  // exact: a multiple of 16
        if constexpr (kQ4) {
          const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(b.da[g * T + t]));
          yacc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), d, yacc[r][t]);
        } else {
          const __m512 e = _mm512_sub_ps(_mm512_set1_ps(b.da[g * T + t]), dw);
          yacc[r][t] = _mm512_add_ps(yacc[r][t], _mm512_scalef_ps(_mm512_cvtepi32_ps(sum), e));
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    if constexpr (!kQ4) {
      const __m512 s_w = _mm512_loadu_ps(b.sc + r * b.scale_bytes);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) yacc[r][t] = _mm512_mul_ps(yacc[r][t], _mm512_mul_ps(s_w, _mm512_set1_ps(b.sa[t])));
    }
    if (b.rows <= static_cast<size_t>(r) * kTileRows) break;
    const __mmask16 m = static_cast<__mmask16>((1u << std::min<size_t>(b.rows - r * kTileRows, kTileRows)) - 1);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      if (b.stream && m == 0xFFFF)
        _mm512_stream_ps(b.y + t * b.ldy + r * kTileRows, yacc[r][t]);
      else
        _mm512_mask_storeu_ps(b.y + t * b.ldy + r * kTileRows, m, yacc[r][t]);
    }
  }
}

// Shapes per token count: R row tiles side by side share each activation broadcast; C chains.
// One stream when memory bound; 4+ tokens are compute bound. q8 with 3 tokens runs two tiles
// with one chain: +7-25% against one tile with two (paired, cold weights, both expert shapes;
// with 2 tokens -6 to +5%, and q4 with 3 tokens 19-23% slower).
// kFour (GemvStreams::kFour): memory-bound blocks (1-3 tokens) read four tiles side by side, four
// streams, each prefetched 1 KiB ahead. On a Sapphire Rapids guest one stream left the core's
// read bandwidth unused (1 token: ~0.70 of the paired read probe, which reads four prefetched
// streams); four read more, paired call by call against one stream, cold weights, both expert
// shapes: q8 1 token +15-20%, 2 tokens +28-31%, 3 tokens +9-12%; q4 +4-13%. (8 side by side,
// or 2 x 2 chains, no better; no prefetch 3% less.) On Zen 4 one stream was ~30% faster.
template <bool kQ4, int T, bool kFour>
struct GemvShape {
  static constexpr bool kWide = kFour && T <= static_cast<int>(kFourStreamMaxTokens);
  static constexpr int R = kWide ? kFourStreams : T >= 4 || (!kQ4 && T == 3) ? 2 : 1;
  static constexpr int C = kWide ? 1 : T == 1 ? (kQ4 ? 1 : 4) : R == 1 ? 2 : 1;
};

// Compute-bound blocks (4+ tokens) with no share of the next step to prefetch, most of a prompt's,
// run a copy of the kernel without the prefetch loop in its group loop (q8 512-token GEMM on Zen
// 4: +0.5-1%, paired). The memory-bound 1-3 token kernels (always decode) keep the one copy:
// without the loop GCC schedules the q8 1-token GEMV's loads differently and it read 2-3% slower.
// Prompt blocks have 4 to kGemmTok tokens.
template <int R, int T, int C, bool kQ4, size_t kG>
M3_VNNI void GemvTilesPrefetchOrNot(const Block& b) {
  if constexpr (T < 4) {
    GemvTiles<R, T, C, kQ4, kG, true, kQ4 || R == kFourStreams>(b);
  } else {
    if constexpr (T <= kGemmTok)
      if (b.prefetch_lines > 0) return GemvTiles<R, T, C, kQ4, kG, true, false>(b);
    if constexpr (kQ4)
      if (b.gemv) return GemvTiles<R, T, C, kQ4, kG, false, true>(b);
    GemvTiles<R, T, C, kQ4, kG, false, false>(b);
  }
}

template <bool kQ4, bool kFour, int MaxT>
M3_VNNI void GemvDispatch(int t, int r, const Block& b) {
  if constexpr (MaxT >= 1) {
    using S = GemvShape<kQ4, MaxT, kFour>;
    // The packer's groups (q4 32, q8 128) as constants: fully unrolled group loops.
    constexpr size_t kPackerGroup = kQ4 ? 32 : 128;
    if (t == MaxT) {
      if (r == S::R) {
        if (b.G == kPackerGroup) return GemvTilesPrefetchOrNot<S::R, MaxT, S::C, kQ4, kPackerGroup>(b);
        return GemvTilesPrefetchOrNot<S::R, MaxT, S::C, kQ4, 0>(b);
      }
      // Fewer tiles than the shape's (the last of an odd count), or more (a token chunk with a
      // one-tile shape inside a two-tile step): one tile at a time.
      for (int i = 0; i < r; ++i) {
        Block one = b;
        one.w += static_cast<size_t>(i) * b.tile_bytes;
        one.sc += static_cast<size_t>(i) * b.scale_bytes;
        one.y += static_cast<size_t>(i) * kTileRows;
        one.rows = b.rows > static_cast<size_t>(i) * kTileRows ? b.rows - static_cast<size_t>(i) * kTileRows : 0;
        if (one.rows == 0) break;
        if (b.G == kPackerGroup)
          GemvTilesPrefetchOrNot<1, MaxT, S::C, kQ4, kPackerGroup>(one);
        else
          GemvTilesPrefetchOrNot<1, MaxT, S::C, kQ4, 0>(one);
      }
      return;
    }
    GemvDispatch<kQ4, kFour, MaxT - 1>(t, r, b);
  }
}

template <bool kQ4, bool kFour>
int GemvRows(int t) {
  switch (t) {
    case 1: return GemvShape<kQ4, 1, kFour>::R;
    case 2: return GemvShape<kQ4, 2, kFour>::R;
    case 3: return GemvShape<kQ4, 3, kFour>::R;
    case 4: return GemvShape<kQ4, 4, kFour>::R;
    case 5: return GemvShape<kQ4, 5, kFour>::R;
    case 6: return GemvShape<kQ4, 6, kFour>::R;
    case 7: return GemvShape<kQ4, 7, kFour>::R;
    default: return GemvShape<kQ4, 8, kFour>::R;
  }
}

struct Job {
  const WeightRef* w;
  const QuantizedActivations* a;
  size_t tile_begin, tile_end;
  float* y;
  size_t ldy;
  detail::TokenBlocks blocks;  // of up to kGemvMaxTok tokens (decode) or kGemmTok (prompts)
  const int32_t* bias;         // per token block, [groups][T]
  const float* da;
  const float* sa;             // q8: token scales
  bool stream;                 // Block::stream
  bool four;                   // GemvStreams::kFour
};

// Every step of row tiles, then every token block against it.
M3_VNNI void RunTiles(const Job& j) {
  const WeightRef& w = *j.w;
  const bool q4 = w.format == WeightFormat::kQ4;
  const size_t n = j.a->n_tok, groups = w.groups(), padded = w.padded_cols();
  const detail::TokenBlocks& tb = j.blocks;
  const int largest = static_cast<int>((n + tb.count - 1) / tb.count);  // token block
  const size_t step = static_cast<size_t>(q4 ? (j.four ? GemvRows<true, true>(largest) : GemvRows<true, false>(largest))
                                             : (j.four ? GemvRows<false, true>(largest) : GemvRows<false, false>(largest)));
  // Prompts: each step of row tiles is read from memory by its first token block and from L2
  // by the others. The last kPrefetchBlocks blocks of a step prefetch the next step, a share
  // each spread over its groups, so that step's first block does not wait on memory (Zen 4,
  // 512 tokens: +1-1.5% against none, 0.5-1% more than spreading the prefetch over every block,
  // whose early lines the streaming activations evict from L2 again before use).
  constexpr size_t kPrefetchBlocks = 16;
  const size_t blocks = tb.count, pf_blocks = std::min(blocks, kPrefetchBlocks), first_pf = blocks - pf_blocks;
  for (size_t tile = j.tile_begin; tile < j.tile_end; tile += step) {
    const int r = static_cast<int>(std::min(step, j.tile_end - tile));
    const size_t next = std::min(tile + step, j.tile_end);
    const size_t next_bytes = n > kGemvMaxTok ? (std::min(tile + 2 * step, j.tile_end) - next) * w.tile_bytes() : 0;
    const size_t share = (next_bytes / pf_blocks + 63) / 64 * 64;
    for (size_t block = 0; block < blocks; ++block) {
      const size_t t0 = tb.begin(block);
      const int nt = static_cast<int>(tb.begin(block + 1) - t0);
      Block b;
      const size_t pf0 = block < first_pf ? next_bytes : std::min(next_bytes, (block - first_pf) * share);
      b.prefetch = static_cast<const uint8_t*>(w.data) + next * w.tile_bytes() + pf0;
      b.prefetch_lines = (std::min(next_bytes, pf0 + share) - pf0) / 64;
      b.prefetch_per_group = (b.prefetch_lines + groups - 1) / groups;
      b.w = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes();
      b.sc = w.scales + tile * w.tile_scale_bytes();
      b.tile_bytes = w.tile_bytes();
      b.scale_bytes = w.tile_scale_bytes();
      b.q = j.a->q + t0 * padded;
      b.ldq = padded;
      b.bias = j.bias + t0 * groups;
      b.da = j.da + t0 * groups;
      b.sa = j.sa ? j.sa + t0 : nullptr;
      b.groups = groups;
      b.G = w.group;
      b.y = j.y + t0 * j.ldy + tile * kTileRows;
      b.ldy = j.ldy;
      b.rows = std::min(w.rows, (tile + static_cast<size_t>(r)) * kTileRows) - tile * kTileRows;
      b.gemv = n <= kGemvMaxTok;
      b.stream = j.stream;
      if (q4)
        j.four ? GemvDispatch<true, true, kGemvMaxTok>(nt, r, b) : GemvDispatch<true, false, kGemvMaxTok>(nt, r, b);
      else
        j.four ? GemvDispatch<false, true, kGemvMaxTok>(nt, r, b) : GemvDispatch<false, false, kGemvMaxTok>(nt, r, b);
    }
  }
}

// vdpbf16ps as asm for the same reason as Dpbusd.
M3_AVX512BF16 inline __m512 Dpbf16(__m512 acc, __m512i w, __m512i x) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

// bf16: y += w . hi(x) + w . lo(x), x = hi + lo + O(2^-16 x) with hi, lo bf16; hi and lo
// products go to separate accumulators (two dependency chains per token).
template <int T>
M3_AVX512BF16 void Bf16Block(const uint8_t* tile, const uint32_t* xhi, const uint32_t* xlo, size_t ldx, size_t pairs,
                             float* y, size_t ldy, size_t rows) {
  __m512 acc_hi[T], acc_lo[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc_hi[t] = acc_lo[t] = _mm512_setzero_ps();
  for (size_t p = 0; p < pairs; ++p) {
    const __m512i wv = _mm512_loadu_si512(tile + p * 64);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      acc_hi[t] = Dpbf16(acc_hi[t], wv, _mm512_set1_epi32(static_cast<int>(xhi[t * ldx + p])));
      acc_lo[t] = Dpbf16(acc_lo[t], wv, _mm512_set1_epi32(static_cast<int>(xlo[t * ldx + p])));
    }
  }
  const __mmask16 m = static_cast<__mmask16>((1u << std::min<size_t>(rows, kTileRows)) - 1);
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + t * ldy, m, _mm512_add_ps(acc_hi[t], acc_lo[t]));
}

template <int MaxT>
M3_AVX512BF16 void Bf16DispatchT(int t, const uint8_t* tile, const uint32_t* xhi, const uint32_t* xlo, size_t ldx,
                                 size_t pairs, float* y, size_t ldy, size_t rows) {
  if constexpr (MaxT >= 1) {
    if (t == MaxT) return Bf16Block<MaxT>(tile, xhi, xlo, ldx, pairs, y, ldy, rows);
    Bf16DispatchT<MaxT - 1>(t, tile, xhi, xlo, ldx, pairs, y, ldy, rows);
  }
}

constexpr int kBf16Tok = 8;

// xhi / xlo rows are ldp words apart (pairs of them used).
M3_AVX512BF16 void RunBf16(const WeightRef& w, const uint32_t* xhi, const uint32_t* xlo, size_t n_tok, size_t pairs,
                           size_t ldp, size_t tile_begin, size_t tile_end, float* y, size_t ldy) {
  const auto* data = static_cast<const uint8_t*>(w.data);
  for (size_t tile = tile_begin; tile < tile_end; ++tile) {
    const size_t rows = std::min(w.rows, (tile + 1) * kTileRows) - tile * kTileRows;
    for (size_t t0 = 0; t0 < n_tok; t0 += kBf16Tok) {
      const int t = static_cast<int>(std::min<size_t>(kBf16Tok, n_tok - t0));
      Bf16DispatchT<kBf16Tok>(t, data + tile * w.tile_bytes(), xhi + t0 * ldp, xlo + t0 * ldp, ldp, pairs,
                              y + t0 * ldy + tile * kTileRows, ldy, rows);
    }
  }
}

}  // namespace

// CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c").
bool HasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1u);
}

bool HasVnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && HasF16c();
  return ok;
}

GemvStreams PreferredGemvStreams() {
  static const GemvStreams s = __builtin_cpu_is("intel") ? GemvStreams::kFour : GemvStreams::kOne;
  return s;
}

bool HasAvx512Bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma") && HasF16c();
  return ok;
}

namespace {

// bias and da: room for the tables of a.n_tok tokens.
void QuantMatMulVnniTokens(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end,
                           float* y, size_t ldy, GemvStreams streams, int32_t* bias, float* da) {
  const size_t n = a.n_tok;
  const int32_t zero = w.format == WeightFormat::kQ4 ? kQ4Zero : kQ8Zero;
  // Per token block, [group][token] tables the kernel reads with scalar broadcasts.
  const detail::TokenBlocks blocks(n, n <= kGemvMaxTok ? kGemvMaxTok : kGemmTok);
  detail::FillQuantTables(a, blocks, zero, bias, da);
  // Prompt outputs larger than a core's L2 cannot stay in cache for their consumer: full tiles
  // go out with non-temporal stores, which skip reading each line before writing it (q8
  // 512-token GEMM, Zen 4: +1.7-2.7% paired). Needs 64-byte aligned rows; the fence orders the
  // stores before the caller's synchronisation.
  const size_t output_bytes = n * (tile_end - tile_begin) * kTileRows * sizeof(float);
  const bool stream = n > kGemvMaxTok && output_bytes >= detail::kCoreL2Bytes &&
                      reinterpret_cast<uintptr_t>(y) % 64 == 0 && ldy % kTileRows == 0;
  RunTiles(Job{&w, &a, tile_begin, tile_end, y, ldy, blocks, bias, da, a.shift ? a.scale : nullptr, stream,
               streams == GemvStreams::kFour});
  if (stream) _mm_sfence();
}

}  // namespace

void QuantMatMulVnni(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                     size_t ldy, GemvStreams streams, KernelScratch& scratch) {
  tile_end = std::min(tile_end, w.row_tiles());
  if (tile_begin >= tile_end || a.n_tok == 0) return;
  // Tokens in batches of at most ~768 (a multiple of the token block) bound the tables for long
  // prompts; one batch's, taken once.
  const size_t batches = (a.n_tok + 767) / 768;
  const size_t per = (a.n_tok + batches - 1) / batches, step = (per + kGemmTok - 1) / kGemmTok * kGemmTok;
  const size_t table = std::min(step, a.n_tok) * w.groups();
  int32_t* const bias = scratch.Array<int32_t>(0, table);
  float* const da = scratch.Array<float>(1, table);
  for (size_t t0 = 0; t0 < a.n_tok; t0 += step) {
    QuantizedActivations part = a;
    part.q += t0 * a.padded_cols;
    part.scale += t0 * (a.shift ? 1 : a.groups());
    part.sum += t0 * a.groups();
    if (a.shift) part.shift += t0 * a.groups();
    part.n_tok = std::min(step, a.n_tok - t0);
    QuantMatMulVnniTokens(w, part, tile_begin, tile_end, y + t0 * ldy, ldy, streams, bias, da);
  }
}

void Bf16TiledMatMulAvx512Bf16(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin,
                               size_t tile_end, float* y, size_t ldy, KernelScratch& scratch) {
  tile_end = std::min(tile_end, w.row_tiles());
  if (tile_begin >= tile_end || n_tok == 0) return;
  // x split into bf16 pairs (inputs 2p, 2p + 1 in the low and high halves, as in the tiles).
  const size_t pairs = (w.cols + 1) / 2;
  // Rows an odd number of cache lines apart: the kernel broadcasts from 2 x 8 token rows at once,
  // and rows a multiple of 4 KiB apart (6144 inputs: 12 KiB) all fall into the same L1 set and
  // evict each other (3072 x 6144, 512 tokens: 0.19 of the peak before).
  const size_t lines = (pairs * 4 + 63) / 64, ldp = (lines | 1) * 16;
  uint32_t* const xhi = scratch.Array<uint32_t>(0, 2 * n_tok * ldp);
  uint32_t* const xlo = xhi + n_tok * ldp;
  for (size_t t = 0; t < n_tok; ++t)
    for (size_t p = 0; p < pairs; ++p) {
      uint32_t h = 0, l = 0;
      for (size_t k = 0; k < 2; ++k) {
        const size_t c = 2 * p + k;
        const float v = c < w.cols ? x[t * ldx + c] : 0.0f;
        const uint16_t vh = F32ToBf16(v);
        h |= static_cast<uint32_t>(vh) << (16 * k);
        l |= static_cast<uint32_t>(F32ToBf16(v - Bf16ToF32(vh))) << (16 * k);
      }
      xhi[t * ldp + p] = h;
      xlo[t * ldp + p] = l;
    }
  RunBf16(w, xhi, xlo, n_tok, pairs, ldp, tile_begin, tile_end, y, ldy);
}

}  // namespace m3::simd::x86

#else  // not x86-64: never selected

namespace m3::simd::x86 {
bool HasVnni() { return false; }
bool HasAvx512Bf16() { return false; }
GemvStreams PreferredGemvStreams() { return GemvStreams::kOne; }
void QuantMatMulVnni(const WeightRef&, const QuantizedActivations&, size_t, size_t, float*, size_t, GemvStreams,
                     KernelScratch&) {}
void Bf16TiledMatMulAvx512Bf16(const WeightRef&, const float*, size_t, size_t, size_t, size_t, float*, size_t,
                               KernelScratch&) {}
}  // namespace m3::simd::x86

#endif
