// Prototype (not built with the project, AVX2 only): the decode GEMV of the codebook 2-bit layout
// that bench/research/codebook_q2.py measures for error. A row's 8 weights are 16 bits: a 9-bit
// index into 512 x 8 u8 magnitudes and 7 sign bits, through a 128 x 8 table of +-1 bytes that
// adds the parity sign; 16-row tiles, one token, a 4-bit scale per 16 columns; the matrix
// (192 x 6144, 341 KB) stays in L2, so this is the compute rate. The magnitudes and signs of 4
// rows are 8 scalar table loads into two vectors (vpgatherqq measured 1.45x slower on Zen 3).
// Compare with m3's q2 GEMV on the same shape (m3 bench --kernels, or docs/PERFORMANCE.md).
// Build: g++ -O2 -mavx2 -mfma codebook_q2_gemv.cc -o codebook_q2_gemv
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <algorithm>
alignas(64) uint8_t mag[512][8];
alignas(64) int8_t sgn[128][8];
int main() {
  const size_t rows = 192, cols = 6144;  // in L2: 192*6144*2.3125/8 = 341 KB
  std::mt19937 rng(1);
  for (auto& e : mag) for (auto& v : e) v = 1 + 2 * (rng() % 3);
  for (int i = 0; i < 128; ++i) { int par = __builtin_popcount(i) & 1; for (int b = 0; b < 8; ++b) sgn[i][b] = (b < 7 ? (i >> b) & 1 : par) ? -1 : 1; }
  // layout: per tile of 16 rows, per group of 8 columns: 16 uint16 (rows); scales per 16 columns per row (u8) ignored in cost except one madd per 16 cols
  const size_t tiles = rows / 16, g8 = cols / 8;
  std::vector<uint16_t> codes(tiles * g8 * 16);
  for (auto& c : codes) c = rng();
  std::vector<int8_t> act(cols); for (auto& a : act) a = (int8_t)(rng() % 255 - 127);
  std::vector<uint8_t> sc(tiles * (cols / 16) * 16); for (auto& s : sc) s = rng() % 16;
  std::vector<int32_t> out(rows);
  std::vector<double> ts;
  for (int it = 0; it < 3000; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    for (size_t t = 0; t < tiles; ++t) {
      __m256i acc[4] = {};  // rows 0-3, 4-7, 8-11, 12-15 as int32 (2 lanes per row)
      const uint16_t* ct = codes.data() + t * g8 * 16;
      for (size_t g = 0; g < g8; g += 2) {  // 16 columns: two groups of 8, one scale
        __m256i s16[4] = {};
        for (size_t h = 0; h < 2; ++h) {
          const __m256i a = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(&act[(g + h) * 8]));
          const uint16_t* cg = ct + (g + h) * 16;
          for (int q = 0; q < 4; ++q) {
            const uint16_t c0 = cg[4 * q], c1 = cg[4 * q + 1], c2 = cg[4 * q + 2], c3 = cg[4 * q + 3];
            const __m256i m = _mm256_set_epi64x(*(const int64_t*)mag[c3 & 511], *(const int64_t*)mag[c2 & 511],
                                                *(const int64_t*)mag[c1 & 511], *(const int64_t*)mag[c0 & 511]);
            const __m256i s = _mm256_set_epi64x(*(const int64_t*)sgn[c3 >> 9], *(const int64_t*)sgn[c2 >> 9],
                                                *(const int64_t*)sgn[c1 >> 9], *(const int64_t*)sgn[c0 >> 9]);
            s16[q] = _mm256_add_epi16(s16[q], _mm256_maddubs_epi16(m, _mm256_sign_epi8(a, s)));
          }
        }
        const __m128i sb = _mm_loadu_si128((const __m128i*)&sc[(t * (cols / 16) + g / 2) * 16]);
        const __m256i scl = _mm256_cvtepu8_epi16(sb);
        for (int q = 0; q < 4; ++q) acc[q] = _mm256_add_epi32(acc[q], _mm256_madd_epi16(s16[q], _mm256_shuffle_epi8(scl, _mm256_setzero_si256())));
      }
      for (int q = 0; q < 4; ++q) { alignas(32) int32_t v[8]; _mm256_store_si256((__m256i*)v, acc[q]); for (int r = 0; r < 4; ++r) out[t * 16 + 4 * q + r] = v[2 * r] + v[2 * r + 1]; }
    }
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  printf("codebook q2 GEMV from L2: min %.1f us median %.1f us: %.1f G weights/s, %.2f GB/s at 2.3125 bits (%d)\n", ts[0] * 1e6, ts[ts.size() / 2] * 1e6,
         rows * cols / ts[0] / 1e9, rows * cols * 2.3125 / 8 / ts[0] / 1e9, out[5]);
}
