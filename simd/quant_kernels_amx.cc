// The q8 matmul on Intel AMX (quant_kernels_x86.h): tdpbsud multiplies a 16-token x 64-input
// tile of activation codes by a 64-input x 16-row tile of weight codes into 16 x 16 int32 sums,
// 16K multiply-adds per instruction (8x vpdpbusd's per core on Sapphire Rapids). The packed q8
// row tile is already in the layout AMX reads for its second operand: 64 bytes hold 4 inputs of
// each of the 16 rows, so 16 consecutive chunks (1 KiB, 64 inputs) are one tile, read in place.
//
// The numerics are the reference's: per group the exact int32 sums I_g (tdpbsud gives
// sum code * q_a; the zero point comes off as -128 * sum q_a), converted, scaled by
// 2^-(e_w + e_a) (vscalefps, exact) and added in ascending group order, then multiplied by
// s_w * s_a. So each group's sums leave the tile registers for memory, where AVX-512 finishes
// them while the next group's tile products run.
//
// q4 (groups of 32 inputs, the packer's): one tdpbssd per group and row tile, 16 tokens x 32
// inputs x 16 rows, on signed codes c - 8 that AVX-512 unpacks from the nibbles into L1 a group
// ahead (the B operand cannot be read in place), then fma(float(I_g), d_w * d_a, y) per group as
// the reference does.
#include "simd/quant_kernels_x86.h"
#include "simd/quant_tiles.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstring>

#include "simd/amx_tiles.h"

#define M3_AMX_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))

namespace m3::simd::x86 {
namespace {

constexpr size_t kAmxK = 64;       // inputs per tile product
constexpr size_t kAmxTokens = 16;  // tokens per activation tile

// q8 registers (LoadFullTileConfig): C (token tile i, row tile j) = tmm(2i + j), A (token tile i)
// = tmm(4 + i), B (row tile j) = tmm(6 + j).
//
// q4: C (16 tokens x 16 rows) tmm0 / tmm1 for token tile 0 and tmm5 / tmm6 for token tile 1
// (alternate units), A (16 tokens x 32 inputs) tmm2 / tmm7, B (8 quads of 4 inputs x 16 rows)
// tmm3 / tmm4.
void LoadQ4TileConfig() {
  TileConfig cfg;
  cfg.colsb[0] = cfg.colsb[1] = 64;
  cfg.rows[0] = cfg.rows[1] = 16;
  cfg.colsb[2] = 32;
  cfg.rows[2] = 16;
  cfg.colsb[3] = cfg.colsb[4] = 64;
  cfg.rows[3] = cfg.rows[4] = 8;
  cfg.colsb[5] = cfg.colsb[6] = 64;
  cfg.rows[5] = cfg.rows[6] = 16;
  cfg.colsb[7] = 32;
  cfg.rows[7] = 16;
  LoadTileConfig(cfg);
}

// The bytes of a's codes packed by PackTokenTiles.
size_t PackedTokenTilesBytes(const QuantizedActivations& a) {
  return (a.n_tok + kAmxTokens - 1) / kAmxTokens * kAmxTokens * a.padded_cols;
}

// Activation codes packed token tile by token tile (tile tt at tt * 16 * padded_cols): per chunk
// of `chunk` inputs, 16 tokens x chunk bytes, so each tile load reads one contiguous run instead
// of 16 lines a row apart, and the missing tokens of a last partial tile read zeros. Writes all
// PackedTokenTilesBytes(a) bytes of packed.
void PackTokenTiles(const QuantizedActivations& a, size_t chunk, int8_t* packed) {
  const size_t n = a.n_tok, padded = a.padded_cols, chunks = padded / chunk;
  const size_t token_tiles = (n + kAmxTokens - 1) / kAmxTokens;
  for (size_t tt = 0; tt < token_tiles; ++tt)
    for (size_t r = 0; r < kAmxTokens; ++r) {
      const size_t t = tt * kAmxTokens + r;
      int8_t* dst = packed + tt * kAmxTokens * padded + r * chunk;
      for (size_t k = 0; k < chunks; ++k, dst += kAmxTokens * chunk) {
        if (t < n)
          std::memcpy(dst, a.q + t * padded + k * chunk, chunk);
        else
          std::memset(dst, 0, chunk);
      }
    }
}

// A step of up to kStepTiles row tiles stays in L2 while every token block passes over it; a
// block runs its row tiles in pairs inside its group loop, so each group's activations are read
// into L1 once and used by all pairs.
constexpr size_t kStepTiles = 8;

// Operands of one token block (TT token tiles) over one step of row tiles, all groups.
struct AmxBlock {
  const uint8_t* w;  // codes of the step's first row tile; tile j at w + j * tile_bytes
  size_t tile_bytes;
  const uint8_t* scales;  // q8 scales of the first row tile; tile j at scales + j * scale_bytes
  size_t scale_bytes;
  size_t row_tiles;     // in the step, <= kStepTiles
  const int8_t* a[2];  // codes of each token tile, packed: 64 inputs x 16 tokens (1 KiB) after another
  const int32_t* bias;  // [token][groups] -128 * sum of the group's codes, from the block's first token
  const float* ne;      // [token][groups] -e_a
  const float* sa;      // [token] s_a
  size_t groups, G;
  float* y;  // output of the block's first token and the step's first row
  size_t ldy;
  size_t tokens, rows;  // valid tokens and rows from the first ones
  const uint8_t* prefetch;  // this block's share of the next step's codes, spread over its groups
  size_t prefetch_lines, prefetch_per_group;
};

template <int TT>
using Sums = int32_t[TT * 2][kAmxTokens][kTileRows];  // C tiles of one pair, [2 token tile + row tile]
template <int TT>
using Acc = float[TT * kAmxTokens][kStepTiles][kTileRows];

// Adds the sums of group g for row tiles j0 .. j0 + RT - 1 into acc: I_g = sums + bias, scaled
// by 2^-(e_w + e_a).
template <int TT, int RT>
M3_AMX_AVX512 inline void AddSums(const AmxBlock& b, size_t g, size_t j0, const Sums<TT>& sums, Acc<TT>& acc) {
  // -e_w per row of each row tile (shifts beyond the cap read as the cap).
  __m512 new_[RT];
  for (int j = 0; j < RT; ++j) {
    const __m128i e = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(b.scales + (j0 + j) * b.scale_bytes + kTileRows * 4 + g * kTileRows));
    const __m512i e32 = _mm512_min_epi32(_mm512_cvtepu8_epi32(e), _mm512_set1_epi32(kQ8MaxShift));
    new_[j] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setzero_si512(), e32));
  }
  const int32_t* bias = b.bias + g;
  const float* ne = b.ne + g;
  for (size_t t = 0; t < b.tokens; ++t, bias += b.groups, ne += b.groups) {
    const __m512i vb = _mm512_set1_epi32(*bias);
    const __m512 vn = _mm512_set1_ps(*ne);
    const int32_t* row = sums[t / kAmxTokens * 2][t % kAmxTokens];
    float* a = acc[t][j0];
#pragma GCC unroll 2
    for (int j = 0; j < RT; ++j) {
      const __m512i dot = _mm512_add_epi32(_mm512_load_si512(row + j * kAmxTokens * kTileRows), vb);
      const __m512 scaled = _mm512_scalef_ps(_mm512_cvtepi32_ps(dot), _mm512_add_ps(new_[j], vn));
      _mm512_store_ps(a + j * kTileRows, _mm512_add_ps(_mm512_load_ps(a + j * kTileRows), scaled));
    }
  }
}

template <int TT>
M3_AMX_AVX512 inline void AddSums(const AmxBlock& b, size_t g, size_t j0, int rt, const Sums<TT>& sums,
                                  Acc<TT>& acc) {
  if (rt == 2)
    AddSums<TT, 2>(b, g, j0, sums, acc);
  else
    AddSums<TT, 1>(b, g, j0, sums, acc);
}

// Software pipelined: the tile products of one (group, pair) are issued before the previous
// one's sums (stored to memory at the end of its iteration) are added, so the AVX-512 epilogue
// runs while the tile unit works (in L2: 1.1 -> 1.6 TOP/s).
// (What else was tried on this loop, and why it was left: docs/PERFORMANCE.md, "AMX step".)
template <int TT>
M3_AMX_AVX512 __attribute__((noinline)) void AmxStep(const AmxBlock& b) {
  alignas(64) Sums<TT> sums[2];
  alignas(64) Acc<TT> acc;
  for (size_t t = 0; t < b.tokens; ++t)
    for (size_t j = 0; j < b.row_tiles; ++j) _mm512_store_ps(acc[t][j], _mm512_setzero_ps());
  const size_t steps = b.G / kAmxK;
  size_t unit = 0, prev_g = 0, prev_j = 0;
  int prev_rt = 0;
  const uint8_t* pf = b.prefetch;
  size_t pf_left = b.prefetch_lines;
  for (size_t g = 0; g < b.groups; ++g) {
    for (size_t n = std::min(pf_left, b.prefetch_per_group); n > 0; --n, --pf_left, pf += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T1);
    for (size_t j = 0; j < b.row_tiles; j += 2, ++unit) {
      const int rt = static_cast<int>(std::min<size_t>(2, b.row_tiles - j));
      const uint8_t* w0 = b.w + j * b.tile_bytes;
      const uint8_t* w1 = w0 + b.tile_bytes;
      M3_TILE_ZERO(0);
      M3_TILE_ZERO(1);
      if constexpr (TT == 2) {
        M3_TILE_ZERO(2);
        M3_TILE_ZERO(3);
      }
      for (size_t s = 0; s < steps; ++s) {
        const size_t c = g * b.G + s * kAmxK;  // first input
        M3_TILE_LOAD(4, b.a[0] + c * kAmxTokens, 64);
        M3_TILE_LOAD(6, w0 + c * kTileRows, 64);
        M3_TILE_DPBSUD(0, 4, 6);
        if (rt == 2) {
          M3_TILE_LOAD(7, w1 + c * kTileRows, 64);
          M3_TILE_DPBSUD(1, 4, 7);
        }
        if constexpr (TT == 2) {
          M3_TILE_LOAD(5, b.a[1] + c * kAmxTokens, 64);
          M3_TILE_DPBSUD(2, 5, 6);
          if (rt == 2) M3_TILE_DPBSUD(3, 5, 7);
        }
      }
      auto& out = sums[unit & 1];
      M3_TILE_STORE(0, out[0], 64);
      if (rt == 2) M3_TILE_STORE(1, out[1], 64);
      if constexpr (TT == 2) {
        M3_TILE_STORE(2, out[2], 64);
        if (rt == 2) M3_TILE_STORE(3, out[3], 64);
      }
      if (unit > 0) AddSums<TT>(b, prev_g, prev_j, prev_rt, sums[(unit - 1) & 1], acc);
      prev_g = g;
      prev_j = j;
      prev_rt = rt;
    }
  }
  AddSums<TT>(b, prev_g, prev_j, prev_rt, sums[(unit - 1) & 1], acc);
  // y = acc * (s_w * s_a), as the reference rounds it; the last row tile may be partial.
  for (size_t j = 0; j < b.row_tiles; ++j) {
    const size_t valid = std::min<size_t>(kTileRows, b.rows - std::min(b.rows, j * kTileRows));
    if (valid == 0) continue;
    const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 sw = _mm512_loadu_ps(reinterpret_cast<const float*>(b.scales + j * b.scale_bytes));
    for (size_t t = 0; t < b.tokens; ++t) {
      const __m512 out = _mm512_mul_ps(_mm512_load_ps(acc[t][j]), _mm512_mul_ps(sw, _mm512_set1_ps(b.sa[t])));
      _mm512_mask_storeu_ps(b.y + t * b.ldy + j * kTileRows, m, out);
    }
  }
}

void QuantMatMulAmxQ8(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                      size_t ldy, KernelScratch& scratch) {
  const size_t n = a.n_tok;
  const size_t groups = w.groups(), padded = w.padded_cols();
  // Per token and group: the zero point's share and the negated shift, for scalar broadcasts.
  int32_t* const bias = scratch.Array<int32_t>(0, n * groups);
  float* const ne = scratch.Array<float>(1, n * groups);
  for (size_t i = 0; i < n * groups; ++i) {
    bias[i] = -kQ8Zero * a.sum[i];
    ne[i] = -static_cast<float>(a.shift[i]);
  }
  int8_t* const packed = scratch.Array<int8_t>(2, PackedTokenTilesBytes(a));
  PackTokenTiles(a, kAmxK, packed);
  const auto token_tile = [&](size_t t0) { return packed + t0 * padded; };
  LoadFullTileConfig();
  constexpr size_t kBlockTokens = 2 * kAmxTokens;
  const size_t blocks = (n + kBlockTokens - 1) / kBlockTokens;
  // Every token block prefetches its share of the next step into L2, so that the next step's
  // first block does not wait on memory.
  for (size_t tile = tile_begin; tile < tile_end; tile += kStepTiles) {
    const size_t row_tiles = std::min(kStepTiles, tile_end - tile), next = tile + row_tiles;
    const size_t next_bytes = (std::min(next + kStepTiles, tile_end) - next) * w.tile_bytes();
    const size_t share = (next_bytes / blocks + 63) / 64 * 64;
    for (size_t block = 0; block < blocks; ++block) {
      const size_t t0 = block * kBlockTokens;
      AmxBlock b;
      b.w = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes();
      b.tile_bytes = w.tile_bytes();
      b.scales = w.scales + tile * w.tile_scale_bytes();
      b.scale_bytes = w.tile_scale_bytes();
      b.row_tiles = row_tiles;
      b.tokens = std::min(kBlockTokens, n - t0);
      b.a[0] = token_tile(t0);
      b.a[1] = b.tokens > kAmxTokens ? token_tile(t0 + kAmxTokens) : nullptr;
      b.bias = bias + t0 * groups;
      b.ne = ne + t0 * groups;
      b.sa = a.scale + t0;
      b.groups = groups;
      b.G = w.group;
      b.y = y + t0 * ldy + tile * kTileRows;
      b.ldy = ldy;
      b.rows = std::min(w.rows, next * kTileRows) - tile * kTileRows;
      const size_t pf0 = std::min(next_bytes, block * share);
      b.prefetch = static_cast<const uint8_t*>(w.data) + next * w.tile_bytes() + pf0;
      b.prefetch_lines = (std::min(next_bytes, pf0 + share) - pf0) / 64;
      b.prefetch_per_group = (b.prefetch_lines + groups - 1) / groups;
      if (b.tokens > kAmxTokens)
        AmxStep<2>(b);
      else
        AmxStep<1>(b);
    }
  }
}

// q4: blocks of up to two token tiles (16 tokens each) over a step of kQ4StepTiles row tiles.
constexpr size_t kQ4Group = 32;
constexpr size_t kQ4StepTiles = 4;
constexpr size_t kQ4GroupBytes = kTileRows * kQ4Group / 2;  // one group of a row tile: 256 bytes
// Each row tile's codes and scales are prefetched this many groups ahead into L1 (512 bytes):
// the first token tile reads them from memory. An expert's 16-token share of a prompt, cold
// weights: 1 KiB ahead +10-15% against none; in the engine's prefill 512 bytes to 1 KiB were
// best, 256 bytes and 2 KiB worse, and also prefetching the next step into L2 (as the VNNI
// kernel does) no better.
constexpr size_t kQ4PrefetchGroups = 2;

struct AmxQ4Block {
  const uint8_t* w;  // codes of the step's first row tile; tile j at w + j * tile_bytes
  size_t tile_bytes;
  const uint8_t* scales;  // fp16 [groups][16] of the first row tile; tile j at scales + j * scale_bytes
  size_t scale_bytes;
  size_t row_tiles;  // in the step, <= kQ4StepTiles
  const int8_t* a[2];  // codes of each token tile, packed: [group][16 tokens][32 bytes]
  const float* da[2];  // d_a of each token tile, [group][16], 0 for the missing tokens of a partial tile
  size_t groups;
  float* y;  // output of the block's first token and the step's first row
  size_t ldy;
  size_t tokens, rows;  // valid tokens and rows from the first ones
};

// One group of a q4 row tile (chunk v: quad v in the low nibbles, quad v + 4 in the high ones)
// as the B operand: 8 rows of 64 bytes, row = quad, signed codes c - 8.
M3_AMX_AVX512 inline void UnpackQ4Group(const uint8_t* src, int8_t (*dst)[64]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_set1_epi8(kQ4Zero);
  for (int v = 0; v < 4; ++v) {
    const __m512i raw = _mm512_loadu_si512(src + 64 * v);
    _mm512_store_si512(dst[v], _mm512_sub_epi8(_mm512_and_si512(raw, nibble), zero));
    _mm512_store_si512(dst[v + 4], _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble), zero));
  }
}

template <int TT>
using Q4Sums = int32_t[TT][kAmxTokens][kTileRows];
template <int TT>
using Q4Acc = float[TT * kAmxTokens][kTileRows];

// acc += the sums of group g of row tile j, as the reference adds them.
template <int TT>
M3_AMX_AVX512 inline void AddQ4Sums(const AmxQ4Block& b, size_t g, size_t j, const Q4Sums<TT>& sums, Q4Acc<TT>& acc) {
  const __m512 dw = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.scales + j * b.scale_bytes + g * kTileRows * 2)));
  for (size_t t = 0; t < b.tokens; ++t) {
    const size_t i = t / kAmxTokens, r = t % kAmxTokens;
    const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(b.da[i][g * kAmxTokens + r]));
    _mm512_store_ps(acc[t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i][r])), d, _mm512_load_ps(acc[t])));
  }
}

// TT token tiles (16 tokens each) over a step of row tiles, all groups. Software pipelined like
// AmxStep: a unit's (group, row tile) tile products are issued before the previous unit's sums
// are added, and every row tile's next group is unpacked meanwhile. Units alternate between two
// sets of registers: C tmm0 / tmm5 (token tile 0 / 1) and B tmm3, or C tmm1 / tmm6 and B tmm4; A
// is tmm2 / tmm7.
template <int TT>
M3_AMX_AVX512 __attribute__((noinline)) void AmxQ4Step(const AmxQ4Block& b) {
  alignas(64) int8_t codes[2][kQ4StepTiles][8][64];  // [group parity][row tile]
  alignas(64) Q4Sums<TT> sums[2];
  alignas(64) Q4Acc<TT> acc[kQ4StepTiles];
  for (size_t j = 0; j < b.row_tiles; ++j) {
    for (size_t t = 0; t < b.tokens; ++t) _mm512_store_ps(acc[j][t], _mm512_setzero_ps());
    UnpackQ4Group(b.w + j * b.tile_bytes, codes[0][j]);
  }
  size_t unit = 0, prev_g = 0, prev_j = 0;
  for (size_t g = 0; g < b.groups; ++g) {
    M3_TILE_LOAD(2, b.a[0] + g * kAmxTokens * kQ4Group, kQ4Group);
    if constexpr (TT == 2) M3_TILE_LOAD(7, b.a[1] + g * kAmxTokens * kQ4Group, kQ4Group);
    for (size_t j = 0; j < b.row_tiles; ++j, ++unit) {
      const uint8_t* wj = b.w + j * b.tile_bytes;
      if (g + kQ4PrefetchGroups < b.groups) {
        const char* line = reinterpret_cast<const char*>(wj + (g + kQ4PrefetchGroups) * kQ4GroupBytes);
        for (size_t l = 0; l < kQ4GroupBytes; l += 64) _mm_prefetch(line + l, _MM_HINT_T0);
        if (g % 2 == 0)  // 32 bytes of scales per group
          _mm_prefetch(reinterpret_cast<const char*>(b.scales + j * b.scale_bytes +
                                                     (g + kQ4PrefetchGroups) * kTileRows * 2),
                       _MM_HINT_T0);
      }
      // The unit's tile products on one register set: C c0 / c1 (token tile 0 / 1), B bt.
#define M3_Q4_UNIT(c0, c1, bt)                                 \
  do {                                                         \
    M3_TILE_ZERO(c0);                                          \
    M3_TILE_LOAD(bt, codes[g & 1][j], 64);                     \
    M3_TILE_DPBSSD(c0, 2, bt);                                 \
    if constexpr (TT == 2) {                                   \
      M3_TILE_ZERO(c1);                                        \
      M3_TILE_DPBSSD(c1, 7, bt);                               \
    }                                                          \
    M3_TILE_STORE(c0, sums[unit & 1][0], 64);                  \
    if constexpr (TT == 2) M3_TILE_STORE(c1, sums[unit & 1][1], 64); \
  } while (0)
      if (unit & 1)
        M3_Q4_UNIT(1, 6, 4);
      else
        M3_Q4_UNIT(0, 5, 3);
#undef M3_Q4_UNIT
      if (g + 1 < b.groups) UnpackQ4Group(wj + (g + 1) * kQ4GroupBytes, codes[(g + 1) & 1][j]);
      if (unit > 0) AddQ4Sums<TT>(b, prev_g, prev_j, sums[(unit - 1) & 1], acc[prev_j]);
      prev_g = g;
      prev_j = j;
    }
  }
  AddQ4Sums<TT>(b, prev_g, prev_j, sums[(unit - 1) & 1], acc[prev_j]);
  for (size_t j = 0; j < b.row_tiles; ++j) {
    const size_t valid = std::min<size_t>(kTileRows, b.rows - std::min(b.rows, j * kTileRows));
    if (valid == 0) continue;
    const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1);
    for (size_t t = 0; t < b.tokens; ++t) _mm512_mask_storeu_ps(b.y + t * b.ldy + j * kTileRows, m, _mm512_load_ps(acc[j][t]));
  }
}

void QuantMatMulAmxQ4(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                      size_t ldy, KernelScratch& scratch) {
  const size_t n = a.n_tok, groups = w.groups(), padded = w.padded_cols();
  const size_t token_tiles = (n + kAmxTokens - 1) / kAmxTokens;
  // [token tile][group][16], 0 for the missing tokens of a last partial tile.
  float* const da = scratch.Array<float>(0, token_tiles * groups * kAmxTokens);
  std::fill(da, da + token_tiles * groups * kAmxTokens, 0.0f);
  for (size_t t = 0; t < n; ++t)
    for (size_t g = 0; g < groups; ++g)
      da[(t / kAmxTokens * groups + g) * kAmxTokens + t % kAmxTokens] = a.scale[t * groups + g];
  int8_t* const packed = scratch.Array<int8_t>(1, PackedTokenTilesBytes(a));
  PackTokenTiles(a, kQ4Group, packed);
  LoadQ4TileConfig();
  // Blocks of two token tiles share each unpacked B tile (cold weights, 24-64 tokens: +3-14%
  // against one).
  constexpr size_t kBlockTokens = 2 * kAmxTokens;
  for (size_t tile = tile_begin; tile < tile_end; tile += kQ4StepTiles)
    for (size_t t0 = 0; t0 < n; t0 += kBlockTokens) {
      AmxQ4Block b;
      b.w = static_cast<const uint8_t*>(w.data) + tile * w.tile_bytes();
      b.tile_bytes = w.tile_bytes();
      b.scales = w.scales + tile * w.tile_scale_bytes();
      b.scale_bytes = w.tile_scale_bytes();
      b.row_tiles = std::min(kQ4StepTiles, tile_end - tile);
      b.tokens = std::min(kBlockTokens, n - t0);
      for (size_t i = 0; i < 2; ++i) {  // a second token tile only when the block has one
        const size_t ti = std::min(t0 + i * kAmxTokens, (token_tiles - 1) * kAmxTokens);
        b.a[i] = packed + ti * padded;
        b.da[i] = da + ti * groups;
      }
      b.groups = groups;
      b.y = y + t0 * ldy + tile * kTileRows;
      b.ldy = ldy;
      b.rows = std::min(w.rows, (tile + b.row_tiles) * kTileRows) - tile * kTileRows;
      if (b.tokens > kAmxTokens)
        AmxQ4Step<2>(b);
      else
        AmxQ4Step<1>(b);
    }
}

bool AmxUsable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
  if (!tile || !int8 || !HasVnni()) return false;
  // Linux (5.16+) hands out the 8 KiB of tile state per process on request; without it the
  // first tile instruction faults.
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;  // other systems: not wired up
#endif
}

}  // namespace

bool HasAmxInt8() {
  static const bool ok = AmxUsable();
  return ok;
}

void QuantMatMulAmx(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                    size_t ldy, KernelScratch& scratch) {
  tile_end = std::min(tile_end, w.row_tiles());
  const size_t n = a.n_tok;
  if (tile_begin >= tile_end || n == 0) return;
  if (w.format == WeightFormat::kQ4) {
    QuantMatMulAmxQ4(w, a, tile_begin, tile_end, y, ldy, scratch);
  } else {
    QuantMatMulAmxQ8(w, a, tile_begin, tile_end, y, ldy, scratch);
  }
  // Give the tile state back: a thread holding it saves and restores 8 KiB at every switch.
  M3_TILE_RELEASE();
}

}  // namespace m3::simd::x86

#else  // not x86-64 GCC/Clang

namespace m3::simd::x86 {
bool HasAmxInt8() { return false; }
void QuantMatMulAmx(const WeightRef&, const QuantizedActivations&, size_t, size_t, float*, size_t, KernelScratch&) {}
}  // namespace m3::simd::x86

#endif
