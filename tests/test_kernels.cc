// Every SIMD kernel against its scalar reference, on every target compiled in and runnable here,
// over shapes with tails (sizes that are not multiples of any vector width).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "simd/attention_kernels.h"
#include "simd/kernels.h"
#include "simd/weight_pack.h"
#include "test_util.h"

namespace m3::simd {
namespace {

const std::vector<size_t> kSizes = {1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129, 255, 1000};

using test::RandomVec;

// Runs body once per runnable target with dispatch forced to that target.
template <class Body>
void ForEachTarget(Body body) {
  const auto targets = RunnableTargets();
  REQUIRE(!targets.empty());
  for (int64_t t : targets) {
    ForceTargetForTest(t);
    INFO("target " << TargetName(t));
    body();
  }
  ForceTargetForTest(0);
}

float Tol(float ref, size_t n) { return 1e-5f * (1.0f + std::fabs(ref)) * std::sqrt(static_cast<float>(n) + 1.0f); }

TEST_CASE("scalar element decoders are exact", "[kernels]") {
  CHECK(Bf16ToF32(0x3F80) == 1.0f);
  CHECK(Bf16ToF32(0xC040) == -3.0f);
  CHECK(F16ToF32(0x3C00) == 1.0f);
  CHECK(F16ToF32(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(F16ToF32(0x7BFF) == 65504.0f);
  CHECK(std::isinf(F16ToF32(0x7C00)));
  CHECK(E4M3ToF32(0x38) == 1.0f);         // exponent 7 = bias
  CHECK(E4M3ToF32(0x7E) == 448.0f);       // max finite
  CHECK(E4M3ToF32(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(E4M3ToF32(0xB8) == -1.0f);
  CHECK(std::isnan(E4M3ToF32(0x7F)));
  CHECK(std::isnan(E4M3ToF32(0xFF)));
  CHECK(E8M0ToF32(127) == 1.0f);
  CHECK(E8M0ToF32(130) == 8.0f);
  CHECK(E8M0ToF32(0) == std::ldexp(1.0f, -127));
  CHECK(std::isnan(E8M0ToF32(255)));
}

TEST_CASE("DecodeRows matches the scalar decoder for every format", "[kernels]") {
  std::mt19937 rng(7);
  for (size_t cols : {1, 5, 16, 31, 32, 33, 70, 96, 130}) {
    const size_t rows = 3;
    std::vector<uint8_t> bytes(rows * cols * 4);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    // Keep f32/f16 finite (random bits may be NaN, whose payload need not survive).
    std::vector<float> f32 = RandomVec(rows * cols, 11, 3.0f);
    std::vector<uint16_t> f16(rows * cols);
    for (auto& h : f16) h = static_cast<uint16_t>(rng() & 0x7BFF);  // exponent < 31
    std::vector<uint8_t> scales(rows * ((cols + 31) / 32));
    for (auto& s : scales) s = static_cast<uint8_t>(110 + rng() % 30);
    for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBF16, WeightFormat::kF16, WeightFormat::kE4M3Mx32}) {
      WeightRef w;
      w.format = f;
      w.rows = rows;
      w.cols = cols;
      w.data = f == WeightFormat::kF32 ? static_cast<const void*>(f32.data())
               : f == WeightFormat::kF16 ? static_cast<const void*>(f16.data())
                                         : static_cast<const void*>(bytes.data());
      w.scales = scales.data();
      INFO("format " << WeightFormatName(f) << " cols " << cols);
      std::vector<float> want(2 * cols), got(2 * cols);
      ref::DecodeRows(w, 1, 2, want.data());
      ForEachTarget([&] {
        std::fill(got.begin(), got.end(), -1.0f);
        DecodeRows(w, 1, 2, got.data());
        for (size_t i = 0; i < want.size(); ++i) {
          if (std::isnan(want[i])) {
            CHECK(std::isnan(got[i]));
          } else {
            CHECK(got[i] == want[i]);  // decoding is exact
          }
        }
      });
    }
  }
}

TEST_CASE("DecodeRows of tiled formats gives every element's TiledWeightAt value", "[kernels]") {
  std::mt19937 rng(9);
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kBF16Tiled}) {
    for (size_t cols : {32, 64, 96, 130, 300}) {
      for (size_t group : {32, 64, 128}) {
        if (f == WeightFormat::kBF16Tiled && group != 32) continue;
        const size_t rows = 37;  // three tiles, the last partial
        WeightRef w = TiledShape(f, rows, cols, f == WeightFormat::kBF16Tiled ? 0 : group);
        std::vector<uint8_t> codes(TiledCodeBytes(w)), scales(std::max<size_t>(1, TiledScaleBytes(w)));
        for (auto& b : codes) b = static_cast<uint8_t>(rng());
        for (auto& b : scales) b = static_cast<uint8_t>(rng() % 60);  // finite fp16/fp32 scales, small shifts
        w.data = codes.data();
        w.scales = scales.data();
        INFO("format " << WeightFormatName(f) << " cols " << cols << " group " << group);
        std::vector<float> got(3 * cols);
        ForEachTarget([&] {
          DecodeRows(w, 16, 3, got.data());  // rows 16-18: the middle tile
          for (size_t r = 0; r < 3; ++r)
            for (size_t c = 0; c < cols; ++c) {
              const float want = TiledWeightAt(w, 16 + r, c);
              if (std::isnan(want)) CHECK(std::isnan(got[r * cols + c]));
              else CHECK(got[r * cols + c] == want);
            }
          DecodeRows(w, rows - 1, 1, got.data());  // the last row, in the partial tile
          for (size_t c = 0; c < cols; ++c)
            if (!std::isnan(TiledWeightAt(w, rows - 1, c))) CHECK(got[c] == TiledWeightAt(w, rows - 1, c));
        });
      }
    }
  }
}

TEST_CASE("MatMulF32 matches the reference and splits identically", "[kernels]") {
  for (size_t k : {1, 7, 16, 33, 128, 257}) {
    for (size_t rows : {1, 3, 4, 5, 9}) {
      const size_t n_tok = 3, lda = k + 3, ldx = k + 1, ldy = rows + 2;
      auto a = RandomVec(rows * lda, 1), x = RandomVec(n_tok * ldx, 2);
      INFO("k " << k << " rows " << rows);
      std::vector<float> want(n_tok * ldy), got(n_tok * ldy), split(n_tok * ldy);
      ref::MatMulF32(a.data(), lda, rows, x.data(), ldx, n_tok, k, want.data(), ldy);
      ForEachTarget([&] {
        MatMulF32(a.data(), lda, rows, x.data(), ldx, n_tok, k, got.data(), ldy);
        for (size_t t = 0; t < n_tok; ++t)
          for (size_t r = 0; r < rows; ++r) CHECK(std::fabs(got[t * ldy + r] - want[t * ldy + r]) <= Tol(want[t * ldy + r], k));
        // Any split of rows or tokens gives bit-identical outputs (thread-count independence).
        for (size_t r = 0; r < rows; ++r)
          MatMulF32(a.data() + r * lda, lda, 1, x.data(), ldx, n_tok, k, split.data() + r, ldy);
        for (size_t t = 0; t < n_tok; ++t)
          for (size_t r = 0; r < rows; ++r) CHECK(split[t * ldy + r] == got[t * ldy + r]);
      });
    }
  }
}

TEST_CASE("MatMulAccumulate matches the reference and key ranges compose", "[kernels]") {
  for (size_t d : {1, 5, 16, 32, 33, 128, 130}) {
    for (size_t rows : {1, 3, 4, 6, 9, 16, 34}) {
      const size_t keys = 29, ldp = keys + 2, ldv = d + 5, ldo = d + 1;
      INFO("d " << d << " rows " << rows);
      auto p = RandomVec(rows * ldp, 8), v = RandomVec(keys * ldv, 9), o0 = RandomVec(rows * ldo, 10);
      auto want = o0;
      ref::MatMulAccumulate(p.data(), ldp, rows, v.data(), ldv, keys, d, want.data(), ldo);
      ForEachTarget([&] {
        auto got = o0, split = o0;
        MatMulAccumulate(p.data(), ldp, rows, v.data(), ldv, keys, d, got.data(), ldo);
        for (size_t h = 0; h < rows; ++h)
          for (size_t c = 0; c < d; ++c) CHECK(std::fabs(got[h * ldo + c] - want[h * ldo + c]) <= Tol(want[h * ldo + c], keys));
        // Two key ranges accumulated one after the other, rows one at a time: bit-identical.
        for (size_t h = 0; h < rows; ++h) {
          MatMulAccumulate(p.data() + h * ldp, ldp, 1, v.data(), ldv, 11, d, split.data() + h * ldo, ldo);
          MatMulAccumulate(p.data() + h * ldp + 11, ldp, 1, v.data() + 11 * ldv, ldv, keys - 11, d, split.data() + h * ldo, ldo);
        }
        CHECK(split == got);
      });
    }
  }
}

TEST_CASE("vector kernels match their references", "[kernels]") {
  for (size_t n : kSizes) {
    INFO("n " << n);
    auto a = RandomVec(n, 3), b = RandomVec(n, 4), w = RandomVec(n, 5);
    ForEachTarget([&] {
      CHECK(std::fabs(Dot(a.data(), b.data(), n) - ref::Dot(a.data(), b.data(), n)) <= Tol(ref::Dot(a.data(), b.data(), n), n));
      CHECK(std::fabs(SumSquares(a.data(), n) - ref::SumSquares(a.data(), n)) <= Tol(ref::SumSquares(a.data(), n), n));
      CHECK(MaxValue(a.data(), n) == ref::MaxValue(a.data(), n));

      auto y1 = b, y2 = b;
      Axpy(0.37f, a.data(), y1.data(), n);
      ref::Axpy(0.37f, a.data(), y2.data(), n);
      for (size_t i = 0; i < n; ++i) CHECK(std::fabs(y1[i] - y2[i]) <= 1e-6f * (1 + std::fabs(y2[i])));

      y1 = b, y2 = b;
      Scale(y1.data(), -1.5f, n);
      ref::Scale(y2.data(), -1.5f, n);
      CHECK(y1 == y2);

      std::vector<float> m1(n), m2(n);
      MulScaled(a.data(), w.data(), 0.25f, m1.data(), n);
      ref::MulScaled(a.data(), w.data(), 0.25f, m2.data(), n);
      for (size_t i = 0; i < n; ++i) CHECK(std::fabs(m1[i] - m2[i]) <= 1e-6f * (1 + std::fabs(m2[i])));

      auto e1 = a, e2 = a;
      const float mx = ref::MaxValue(a.data(), n);
      const float s1 = ExpShiftSum(e1.data(), n, mx), s2 = ref::ExpShiftSum(e2.data(), n, mx);
      CHECK(std::fabs(s1 - s2) <= 1e-5f * s2);
      for (size_t i = 0; i < n; ++i) CHECK(std::fabs(e1[i] - e2[i]) <= 2e-6f * (1 + e2[i]));
      // A NaN score stays NaN (as std::exp keeps it), and so does the sum.
      auto e3 = a;
      e3[n - 1] = std::numeric_limits<float>::quiet_NaN();
      CHECK(std::isnan(ExpShiftSum(e3.data(), n, mx)));
      CHECK(std::isnan(e3[n - 1]));
    });
  }
  CHECK(std::isinf(MaxValue(nullptr, 0)));
}

TEST_CASE("SwigluOai matches its reference across the clamps, large values and non-finite inputs", "[kernels]") {
  const float alpha = 1.702f, limit = 7.0f, beta = 1.0f;
  for (size_t n : kSizes) {
    INFO("n " << n);
    // Gates and ups over [-20, 20] cross both clamps; a few huge values drive the sigmoid to 0 and 1.
    auto g = RandomVec(n, 11, 20.0f), u = RandomVec(n, 12, 20.0f);
    g[n / 2] = -1e30f;
    g[n - 1] = 3e38f;
    u[0] = -3e38f;
    ForEachTarget([&] {
      auto a1 = g, a2 = g;
      SwigluOai(a1.data(), u.data(), n, alpha, limit, beta);
      ref::SwigluOai(a2.data(), u.data(), n, alpha, limit, beta);
      for (size_t i = 0; i < n; ++i) {
        INFO("i " << i << " g " << g[i] << " u " << u[i]);
        REQUIRE(std::isfinite(a2[i]));
        CHECK(std::fabs(a1[i] - a2[i]) <= 4e-6f * (1 + std::fabs(a2[i])));
      }
      // An element's result does not depend on where the call's range starts (threads split rows).
      for (size_t from : {size_t{1}, n / 3}) {
        auto part = g;
        SwigluOai(part.data() + from, u.data() + from, n - from, alpha, limit, beta);
        for (size_t i = from; i < n; ++i) CHECK(part[i] == a1[i]);
      }
      // A NaN or infinite gate or up at any lane (vector body or tail) gives NaN there only.
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()}) {
        for (size_t at : {size_t{0}, n / 2, n - 1}) {
          auto g2 = g, u2 = u;
          (at % 2 ? g2 : u2)[at] = bad;
          auto b1 = g2;
          SwigluOai(b1.data(), u2.data(), n, alpha, limit, beta);
          for (size_t i = 0; i < n; ++i) CHECK(std::isnan(b1[i]) == (i == at));
        }
      }
    });
  }
}

TEST_CASE("FindNonFinite finds the first NaN or inf at every position and length", "[kernels]") {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (size_t n : kSizes) {
    INFO("n " << n);
    auto x = RandomVec(n, 7, 1e30f);  // large finite values: 3.4e38 is still finite
    x[n / 2] = std::numeric_limits<float>::max();
    x[0] = -std::numeric_limits<float>::max();
    if (n > 2) x[1] = std::numeric_limits<float>::denorm_min();
    ForEachTarget([&] {
      CHECK(FindNonFinite(x.data(), n) == n);
      for (float b : bad)
        for (size_t at : {size_t{0}, n / 3, n - 1}) {
          auto y = x;
          y[at] = b;
          if (at + 1 < n) y[n - 1] = b;  // a later one does not hide the first
          CHECK(FindNonFinite(y.data(), n) == at);
          CHECK(ref::FindNonFinite(y.data(), n) == at);
        }
    });
  }
  CHECK(FindNonFinite(nullptr, 0) == 0);
}

TEST_CASE("IndexScoreMax matches the reference for every storage type, key count and query count", "[kernels]") {
  std::mt19937 rng(5);
  for (CacheType type : {CacheType::kF32, CacheType::kBF16, CacheType::kInt8}) {
    for (size_t dim : {1, 12, 128}) {
     for (size_t ld : {133, 16, 64, 20}) {  // keys per panel: one panel (133), or several
      const size_t stored = (133 + ld - 1) / ld * ld;  // keys incl. the last panel's padding
      std::vector<float> f(dim * stored), scales(stored);
      std::vector<uint16_t> b(dim * stored);
      std::vector<int8_t> q8(dim * stored);
      for (size_t i = 0; i < f.size(); ++i) {
        f[i] = std::uniform_real_distribution<float>(-1, 1)(rng);
        b[i] = F32ToBf16(f[i]);
        q8[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      }
      for (auto& s : scales) s = std::uniform_real_distribution<float>(0.001f, 0.02f)(rng);
      IndexKeyPage page{type,
                        type == CacheType::kF32    ? static_cast<const void*>(f.data())
                        : type == CacheType::kBF16 ? static_cast<const void*>(b.data())
                                                   : static_cast<const void*>(q8.data()),
                        type == CacheType::kInt8 ? scales.data() : nullptr, ld, dim, 0};
      for (size_t n_keys : {0, 1, 15, 16, 17, 33, 128, 133}) {
        page.n_keys = n_keys;
        for (size_t n_q : {1, 3, 4, 5, 9}) {
          INFO(CacheTypeName(type) << " dim " << dim << " keys " << n_keys << " queries " << n_q);
          const size_t ldq = dim + 3;
          auto q = RandomVec(n_q * ldq, static_cast<uint32_t>(rng()));
          std::vector<float> want(n_q), got(n_q);
          ref::IndexScoreMax(q.data(), ldq, n_q, page, want.data());
          ForEachTarget([&] {
            IndexScoreMax(q.data(), ldq, n_q, page, got.data());
            for (size_t i = 0; i < n_q; ++i) {
              if (n_keys == 0) {
                CHECK((std::isinf(got[i]) && got[i] < 0));
              } else {
                CHECK(std::fabs(got[i] - want[i]) <= Tol(want[i], dim));
              }
            }
            // One query at a time gives the same bits as the query inside a batch.
            for (size_t i = 0; i < n_q; ++i) {
              float one = 0;
              IndexScoreMax(q.data() + i * ldq, ldq, 1, page, &one);
              CHECK(std::memcmp(&one, &got[i], sizeof(float)) == 0);
            }
          });
        }
      }
     }
    }
  }
}

TEST_CASE("KeyScores matches the reference for every key and query count, one query == in a batch", "[kernels]") {
  std::mt19937 rng(6);
  for (size_t dim : {1, 16, 128}) {
    for (size_t ldk : {5, 64, 133}) {
      auto kt = RandomVec(dim * ldk, static_cast<uint32_t>(rng()));
      for (size_t n_keys : {0, 1, 3, 5, 16, 17, 63, 64, 128, 133}) {
        if (n_keys > ldk) continue;
        for (size_t n_q : {1, 2, 3, 4, 7, 9, 16, 34}) {
          INFO("dim " << dim << " ldk " << ldk << " keys " << n_keys << " queries " << n_q);
          const size_t ldq = dim + 1, ldo = n_keys + 2;
          auto q = RandomVec(n_q * ldq, static_cast<uint32_t>(rng()));
          std::vector<float> want(n_q * ldo, -7.0f), got(n_q * ldo, -7.0f);
          ref::KeyScores(q.data(), ldq, n_q, kt.data(), ldk, n_keys, dim, want.data(), ldo);
          ForEachTarget([&] {
            std::fill(got.begin(), got.end(), -7.0f);
            KeyScores(q.data(), ldq, n_q, kt.data(), ldk, n_keys, dim, got.data(), ldo);
            for (size_t i = 0; i < n_q; ++i)
              for (size_t u = 0; u < ldo; ++u) {
                if (u < n_keys) {
                  CHECK(std::fabs(got[i * ldo + u] - want[i * ldo + u]) <= Tol(want[i * ldo + u], dim));
                } else {
                  CHECK(got[i * ldo + u] == -7.0f);  // nothing written past n_keys
                }
              }
            std::vector<float> one(ldo);
            for (size_t i = 0; i < n_q; ++i) {
              KeyScores(q.data() + i * ldq, ldq, 1, kt.data(), ldk, n_keys, dim, one.data(), ldo);
              CHECK(std::memcmp(one.data(), &got[i * ldo], n_keys * sizeof(float)) == 0);
            }
          });
        }
      }
    }
  }
}

// Attention's per-block chain of dispatched kernels before AttendBlock: the bits AttendBlock keeps.
void ChainAttendBlock(const float* q, size_t ldq, size_t n_rows, const float* kt, size_t ldk, const size_t* n_keys,
                      const float* v, size_t ldv, size_t dim, float scale, float* p, size_t ldp, float* run_max,
                      float* run_sum, float* acc, size_t ld_acc) {
  for (size_t r0 = 0; r0 < n_rows;) {  // runs of rows that read the block
    if (n_keys[r0] == 0) {
      ++r0;
      continue;
    }
    size_t r1 = r0 + 1, most = n_keys[r0];
    for (; r1 < n_rows && n_keys[r1] != 0; ++r1) most = std::max(most, n_keys[r1]);
    KeyScores(q + r0 * ldq, ldq, r1 - r0, kt, ldk, most, dim, p + r0 * ldp, ldp);
    for (size_t r = r0; r < r1; ++r) {
      const size_t nk = n_keys[r];
      float* s = p + r * ldp;
      Scale(s, scale, nk);
      const float m_new = std::max(run_max[r], MaxValue(s, nk));
      const float correction = std::exp(run_max[r] - m_new);
      run_sum[r] = run_sum[r] * correction + ExpShiftSum(s, nk, m_new);
      if (correction != 1.0f) Scale(acc + r * ld_acc, correction, dim);
      run_max[r] = m_new;
    }
    size_t full_end = r0;  // the rows that see the run's most keys in one call, then one at a time
    while (full_end < r1 && n_keys[full_end] == most) ++full_end;
    MatMulAccumulate(p + r0 * ldp, ldp, full_end - r0, v, ldv, most, dim, acc + r0 * ld_acc, ld_acc);
    for (size_t r = full_end; r < r1; ++r)
      MatMulAccumulate(p + r * ldp, ldp, 1, v, ldv, n_keys[r], dim, acc + r * ld_acc, ld_acc);
    r0 = r1;
  }
}

struct AttendState {
  std::vector<float> run_max, run_sum, acc;
  AttendState(size_t rows, size_t dim)
      : run_max(rows, -std::numeric_limits<float>::infinity()), run_sum(rows, 0.0f), acc(rows * dim, 0.0f) {}
  bool operator==(const AttendState& o) const {  // bit for bit, NaNs included
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    return same(run_max, o.run_max) && same(run_sum, o.run_sum) && same(acc, o.acc);
  }
};

TEST_CASE("AttendBlock keeps the attention chain's bits on every target and matches its reference", "[kernels]") {
  constexpr size_t B = 128;  // keys per stored block (the scratch and K stride of Attention)
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint32_t seed = 100;
  for (size_t dim : {64, 128}) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    for (size_t nk : {1, 7, 16, 127, 128}) {
      for (size_t ldk : {nk, B}) {  // keys stored exactly (scalar key tail) or padded to the block
        if (ldk == nk && nk == B) continue;
        for (size_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17}) {
          // Key counts per row: the whole block; the diagonal (pairs of rows, one query's two heads,
          // see one key fewer per later query); queries that skip the block (0: left untouched).
          for (int pattern = 0; pattern < 3; ++pattern) {
            std::vector<size_t> counts(rows);
            for (size_t r = 0; r < rows; ++r) {
              const size_t later = (rows - 1 - r) / 2;
              counts[r] = pattern == 0 ? nk : pattern == 1 ? (later < nk ? nk - later : 1) : (r % 3 == 1 ? 0 : nk);
            }
            // Two blocks in a row: the first from running max -inf, the second rescaling the first.
            auto q = RandomVec(rows * dim, seed++);
            auto kt0 = RandomVec(dim * ldk, seed++), kt1 = RandomVec(dim * ldk, seed++);
            auto v0 = RandomVec(nk * dim, seed++), v1 = RandomVec(nk * dim, seed++);
            for (int with_nan = 0; with_nan < 2; ++with_nan) {
              if (with_nan && nk != 7 && nk != 127) continue;
              const size_t bad_key = nk / 2;  // a NaN key value: every row that sees it scores NaN
              auto kt1n = kt1;
              if (with_nan) kt1n[3 * ldk + bad_key] = nan;
              INFO("dim " << dim << " keys " << nk << " ldk " << ldk << " rows " << rows << " pattern " << pattern
                          << " nan " << with_nan);
              std::vector<float> p(rows * B);
              AttendState want(rows, dim);
              for (const auto* blk : {&kt0, &kt1n}) {
                const auto& vv = blk == &kt0 ? v0 : v1;
                ref::AttendBlock(q.data(), dim, rows, blk->data(), ldk, counts.data(), vv.data(), dim, dim, scale,
                                 p.data(), B, want.run_max.data(), want.run_sum.data(), want.acc.data(), dim);
              }
              ForEachTarget([&] {
                AttendState got(rows, dim), chain(rows, dim);
                for (const auto* blk : {&kt0, &kt1n}) {
                  const auto& vv = blk == &kt0 ? v0 : v1;
                  AttendBlock(q.data(), dim, rows, blk->data(), ldk, counts.data(), vv.data(), dim, dim, scale,
                              p.data(), B, got.run_max.data(), got.run_sum.data(), got.acc.data(), dim);
                  ChainAttendBlock(q.data(), dim, rows, blk->data(), ldk, counts.data(), vv.data(), dim, dim, scale,
                                   p.data(), B, chain.run_max.data(), chain.run_sum.data(), chain.acc.data(), dim);
                }
                CHECK(got == chain);
                // One row at a time: the same bits as inside the batch.
                AttendState one(rows, dim);
                for (size_t r = 0; r < rows; ++r)
                  for (const auto* blk : {&kt0, &kt1n}) {
                    const auto& vv = blk == &kt0 ? v0 : v1;
                    AttendBlock(q.data() + r * dim, dim, 1, blk->data(), ldk, &counts[r], vv.data(), dim, dim, scale,
                                p.data(), B, &one.run_max[r], &one.run_sum[r], &one.acc[r * dim], dim);
                  }
                CHECK(one == got);
                for (size_t r = 0; r < rows; ++r) {
                  INFO("row " << r << " keys " << counts[r]);
                  if (counts[r] == 0) {  // untouched
                    CHECK((std::isinf(got.run_max[r]) && got.run_sum[r] == 0.0f));
                    for (size_t c = 0; c < dim; ++c) CHECK(got.acc[r * dim + c] == 0.0f);
                  } else if (with_nan && counts[r] > bad_key) {  // NaN stays NaN, never zeros
                    CHECK(std::isnan(got.run_sum[r]));
                    CHECK(std::isnan(want.run_sum[r]));
                    for (size_t c = 0; c < dim; ++c) CHECK(std::isnan(got.acc[r * dim + c]));
                  } else {
                    CHECK(std::fabs(got.run_max[r] - want.run_max[r]) <= Tol(want.run_max[r], dim));
                    CHECK(std::fabs(got.run_sum[r] - want.run_sum[r]) <= 1e-5f * want.run_sum[r]);
                    const float tol = 1e-5f * (1.0f + want.run_sum[r]) * std::sqrt(2.0f * static_cast<float>(nk));
                    for (size_t c = 0; c < dim; ++c) CHECK(std::fabs(got.acc[r * dim + c] - want.acc[r * dim + c]) <= tol);
                  }
                }
              });
            }
          }
        }
      }
    }
  }
}

TEST_CASE("RmsNormRows kernel keeps the per-row norm kernels' bits and matches its reference", "[kernels]") {
  const float eps = 1e-6f;
  for (size_t dim : kSizes) {
    for (size_t rows : {1, 2, 3, 5, 9, 16, 17}) {
      INFO("dim " << dim << " rows " << rows);
      const size_t ld = dim + 3;
      auto x = RandomVec(rows * ld, static_cast<uint32_t>(dim * 31 + rows), 2.0f), w = RandomVec(dim, 77);
      std::vector<float> want(rows * ld);
      ref::RmsNormRows(x.data(), ld, rows, dim, w.data(), eps, want.data(), ld);
      ForEachTarget([&] {
        std::vector<float> got(rows * ld, -5.0f), chain(rows * ld, -5.0f);
        RmsNormRows(x.data(), ld, rows, dim, w.data(), eps, got.data(), ld);
        for (size_t r = 0; r < rows; ++r) {  // ops' RmsNormRows before this kernel
          const float ms = SumSquares(x.data() + r * ld, dim) / static_cast<float>(dim);
          MulScaled(x.data() + r * ld, w.data(), 1.0f / std::sqrt(ms + eps), chain.data() + r * ld, dim);
        }
        CHECK(std::memcmp(got.data(), chain.data(), got.size() * sizeof(float)) == 0);  // padding untouched too
        auto in_place = x;
        RmsNormRows(in_place.data(), ld, rows, dim, w.data(), eps, in_place.data(), ld);
        for (size_t r = 0; r < rows; ++r)
          for (size_t c = 0; c < dim; ++c) {
            CHECK(std::memcmp(&in_place[r * ld + c], &got[r * ld + c], sizeof(float)) == 0);
            CHECK(std::fabs(got[r * ld + c] - want[r * ld + c]) <= 1e-5f * (1.0f + std::fabs(want[r * ld + c])));
          }
      });
    }
  }
}

TEST_CASE("cache codecs: bf16 and int8 round trips match the references", "[kernels]") {
  for (size_t n : kSizes) {
    INFO("n " << n);
    auto x = RandomVec(n, static_cast<uint32_t>(n), 4.0f);
    std::vector<uint16_t> b(n), b_ref(n);
    std::vector<int8_t> q(n), q_ref(n);
    EncodeBf16(x.data(), n, b.data());
    ref::EncodeBf16(x.data(), n, b_ref.data());
    CHECK(b == b_ref);
    const float scale = EncodeInt8(x.data(), n, q.data()), scale_ref = ref::EncodeInt8(x.data(), n, q_ref.data());
    CHECK(scale == scale_ref);
    CHECK(q == q_ref);
    float amax = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    CHECK(scale == amax / 127.0f);
    std::vector<float> y_ref(n), y(n), z_ref(n), z(n);
    ref::DecodeBf16(b.data(), n, y_ref.data());
    ref::DecodeInt8(q.data(), n, scale, z_ref.data());
    for (size_t i = 0; i < n; ++i) {
      CHECK(std::fabs(y_ref[i] - x[i]) <= std::fabs(x[i]) / 256);
      CHECK(std::fabs(z_ref[i] - x[i]) <= scale / 2 * 1.0001f);
    }
    ForEachTarget([&] {
      DecodeBf16(b.data(), n, y.data());
      DecodeInt8(q.data(), n, scale, z.data());
      CHECK(y == y_ref);
      CHECK(z == z_ref);
    });
  }
  std::vector<float> zeros(5, 0.0f);
  std::vector<int8_t> q(5, 1);
  CHECK(EncodeInt8(zeros.data(), 5, q.data()) == 0.0f);
  CHECK(q == std::vector<int8_t>(5, 0));
  // A non-finite value makes the row's scale NaN (every decoded value NaN, none silently finite).
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> x = {1.0f, -2.0f, bad, 0.5f, 3.0f};
    CHECK(std::isnan(EncodeInt8(x.data(), 5, q.data())));
    CHECK(q == std::vector<int8_t>(5, 0));
  }
  CacheType t{};
  CHECK(ParseCacheType("bf16", &t));
  CHECK(t == CacheType::kBF16);
  CHECK_FALSE(ParseCacheType("fp8", &t));
}

TEST_CASE("the active SIMD target is reported", "[kernels]") {
  CHECK(!ActiveTargetName().empty());
  CHECK(RunnableTargets().size() >= 1);
}

}  // namespace
}  // namespace m3::simd
