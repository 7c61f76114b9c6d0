// The packed-weight kernels (quant_kernels.h) against their scalar references, for every
// implementation runnable here (VNNI, AVX-512BW, AVX2, the portable Highway targets): bit-exact
// where the path has fused multiply-add, GEMV (one token at a time) vs GEMM bit-identical, tile
// ranges composing, and the results close to the fp32 product (sanity).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "simd/kernel_table.h"
#include "simd/quant_kernels.h"
#include "test_util.h"
#include "simd/weight_pack.h"

namespace m3::simd {
namespace {

using test::RandomVec;

struct Packed {
  WeightRef w;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
};

void Attach(Packed& p) {
  p.w.data = p.codes.data();
  p.w.scales = p.scales.data();
}

// Quantized from fp32 values by the packer.
Packed PackFloats(WeightFormat f, size_t rows, size_t cols, const std::vector<float>& src, size_t group = 0) {
  Packed p;
  p.w = TiledShape(f, rows, cols, group);
  p.codes.resize(TiledCodeBytes(p.w));
  p.scales.resize(std::max<size_t>(1, TiledScaleBytes(p.w)));
  std::vector<float> padded(p.w.row_tiles() * kTileRows * cols, 0.0f);
  std::copy(src.begin(), src.end(), padded.begin());
  REQUIRE(PackRowTiles(p.w, padded.data(), 0, p.w.row_tiles(), p.codes.data(), p.scales.data()));
  Attach(p);
  return p;
}

// Codes and scales written directly (every stored byte, padding included, from code(r, c)):
// q4 fp16 scale bits group_scale(r, g); q8 row scale row_scale(r) and shift group_scale(r, g).
template <class CodeFn, class RowScaleFn, class GroupScaleFn>
Packed WriteCodes(WeightFormat f, size_t rows, size_t cols, CodeFn code, RowScaleFn row_scale,
                  GroupScaleFn group_scale, size_t group = 0) {
  Packed p;
  p.w = TiledShape(f, rows, cols, group);
  p.codes.assign(TiledCodeBytes(p.w), 0);
  p.scales.assign(TiledScaleBytes(p.w), 0);
  const size_t G = p.w.group, groups = p.w.groups();
  for (size_t tile = 0; tile < p.w.row_tiles(); ++tile) {
    uint8_t* t = p.codes.data() + tile * p.w.tile_bytes();
    uint8_t* sc = p.scales.data() + tile * p.w.tile_scale_bytes();
    for (size_t tr = 0; tr < kTileRows; ++tr) {
      const size_t r = tile * kTileRows + tr;
      if (f == WeightFormat::kQ8) {
        const float s = row_scale(r);
        std::memcpy(sc + 4 * tr, &s, 4);
      }
      for (size_t g = 0; g < groups; ++g) {
        const uint16_t gs = group_scale(r, g);
        if (f == WeightFormat::kQ8)
          sc[kTileRows * 4 + g * kTileRows + tr] = static_cast<uint8_t>(gs);
        else
          std::memcpy(sc + (g * kTileRows + tr) * 2, &gs, 2);
        for (size_t i = 0; i < G; ++i) {
          const int c = code(r, g * G + i);
          if (f == WeightFormat::kQ8) {
            t[g * G * kTileRows + (i / 4) * 64 + tr * 4 + i % 4] = static_cast<uint8_t>(c);
          } else {
            const size_t quad = i / 4, half = G / 8;
            uint8_t& b = t[g * G * kTileRows / 2 + (quad % half) * 64 + tr * 4 + i % 4];
            b |= quad < half ? static_cast<uint8_t>(c & 0xF) : static_cast<uint8_t>((c & 0xF) << 4);
          }
        }
      }
    }
  }
  Attach(p);
  return p;
}

struct Acts {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  std::vector<uint8_t> shift;
  QuantizedActivations a;
};

// The reference quantization for weights of format f (q8: token scales and group shifts).
Acts Quantize(WeightFormat f, const std::vector<float>& x, size_t ldx, size_t n_tok, size_t cols, size_t group) {
  Acts r;
  const bool q8 = f == WeightFormat::kQ8;
  const size_t padded = (cols + group - 1) / group * group, groups = padded / group;
  r.q.assign(n_tok * padded, 99);
  r.scale.assign(n_tok * (q8 ? 1 : groups), -1.0f);
  r.sum.assign(n_tok * groups, -1);
  if (q8) r.shift.assign(n_tok * groups, 99);
  ref::QuantizeActivations(x.data(), ldx, n_tok, cols, group, r.q.data(), r.scale.data(), r.sum.data(),
                           q8 ? r.shift.data() : nullptr);
  r.a = {r.q.data(), r.scale.data(), r.sum.data(), n_tok, padded, group, q8 ? r.shift.data() : nullptr};
  return r;
}

// One token of a batch as a batch of its own.
QuantizedActivations Token(const QuantizedActivations& a, size_t t) {
  QuantizedActivations one = a;
  one.q += t * a.padded_cols;
  one.scale += t * (a.shift ? 1 : a.groups());
  one.sum += t * a.groups();
  if (a.shift) one.shift += t * a.groups();
  one.n_tok = 1;
  return one;
}

// The scale of activation code (t, c): q4 d_a, q8 s_a 2^-e_a.
double ActivationScale(const QuantizedActivations& a, size_t t, size_t c) {
  const size_t g = c / a.group;
  if (a.shift) return std::ldexp(static_cast<double>(a.scale[t]), -a.shift[t * a.groups() + g]);
  return a.scale[t * a.groups() + g];
}

// Runs body once per runnable implementation, with its kernel table.
template <class Body>
void ForEachImpl(Body body) {
  const auto names = KernelNames();
  REQUIRE(names.size() >= 2);
  for (const std::string& name : names) {
    const std::optional<KernelTable> k = KernelsNamed(name);
    REQUIRE(k);
    INFO("implementation " << name);
    body(*k);
  }
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("quant kernel registry", "[quant]") {
  const auto names = KernelNames();
  CHECK(names.front() == "ref");
  for (const auto& n : names) {
    INFO(n);
    const std::optional<KernelTable> k = KernelsNamed(n);
    REQUIRE(k);
    CHECK(k->name == n);
    if (n == "avx512-bf16") {
      CHECK(k->bf16_name == n);
    } else {
      CHECK(k->quant_name == n);
    }
    CHECK((k->quantize_activations && k->quant_matmul && k->bf16_tiled_matmul && k->matmul_f32));
  }
  CHECK(!KernelsNamed("no-such-kernel"));
  CHECK(KernelsNamed("auto")->name == "auto");
  CHECK(KernelsNamed("")->quant_name == BestKernels().quant_name);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512vnni")) CHECK(BestKernels().quant_name.rfind("avx512-vnni", 0) == 0);
#endif
  // Where AMX runs, it takes the prompts it covers: q8 (groups of 64k) from 16 tokens, q4 (groups of 32)
  // from 9; VNNI keeps the rest.
  if (std::find(names.begin(), names.end(), "amx-int8") != names.end()) {
    const auto amx = [](WeightFormat f, size_t group, size_t n_tok) {
      return std::string(BestKernels().QuantName(TiledShape(f, 64, 256, group), n_tok)) == "amx-int8";
    };
    CHECK(!amx(WeightFormat::kQ8, 128, 15));
    CHECK(amx(WeightFormat::kQ8, 128, 16));
    CHECK(!amx(WeightFormat::kQ8, 32, 512));
    CHECK(!amx(WeightFormat::kQ4, 32, 8));
    CHECK(amx(WeightFormat::kQ4, 32, 9));
    CHECK(amx(WeightFormat::kQ4, 32, 512));
    CHECK(!amx(WeightFormat::kQ4, 64, 512));
  }
}

// The active implementation's QuantizeActivations of x equals the reference's `want`, bit for
// bit (every output buffer starts filled with other values).
void CheckQuantizeEquals(const KernelTable& K, const Acts& want, const std::vector<float>& x, size_t ldx, size_t n_tok, size_t cols,
                         size_t group) {
  std::vector<int8_t> q(want.q.size(), 99);
  std::vector<float> scale(want.scale.size(), -1.0f);
  std::vector<int32_t> sum(want.sum.size(), -1);
  std::vector<uint8_t> shift(want.shift.size(), 99);
  K.quantize_activations(x.data(), ldx, n_tok, cols, group, q.data(), scale.data(), sum.data(),
                      want.shift.empty() ? nullptr : shift.data());
  CHECK(q == want.q);
  CHECK(std::memcmp(scale.data(), want.scale.data(), scale.size() * 4) == 0);
  CHECK(sum == want.sum);
  CHECK(shift == want.shift);
}

TEST_CASE("QuantizeActivations is bit-exact against the reference", "[quant]") {
  std::mt19937 rng(5);
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4})
  for (size_t group : {32, 128}) {
    for (size_t cols : {1, 31, 32, 33, 100, 128, 129, 300, 1000}) {
      const size_t n_tok = 4, ldx = cols + 3;
      auto x = RandomVec(n_tok * ldx, static_cast<uint32_t>(cols + group));
      // Token 1: zero groups and lone values; token 2: huge and tiny magnitudes (including a
      // subnormal amax, whose 127/amax overflows); token 3: exact rounding ties.
      for (size_t c = 0; c < cols; ++c) {
        x[ldx + c] = (c / group) % 2 == 0 ? 0.0f : (c % 7 == 0 ? -3.0f : 0.0f);
        const float mags[] = {3e38f, 1e30f, 1e-30f, 1e-40f, 1e-44f, 0.0f};
        const float sign = rng() % 2 ? 1.0f : -1.0f;
        x[2 * ldx + c] = mags[(c / group) % 6] * (sign * static_cast<float>(1 + rng() % 5) / 5.0f);
        x[3 * ldx + c] = c % group == 0 ? 127.0f : static_cast<float>(static_cast<int>(rng() % 255) - 127) * 0.5f;
      }
      INFO(WeightFormatName(f) << " group " << group << " cols " << cols);
      const Acts want = Quantize(f, x, ldx, n_tok, cols, group);
      ForEachImpl([&](const KernelTable& K) { CheckQuantizeEquals(K, want, x, ldx, n_tok, cols, group); });
      // q8: each group's codes reach at least 64 (its shift is the largest that fits) unless the
      // shift is at its cap, and dequantize within half a step.
      if (f == WeightFormat::kQ8) {
        const size_t padded = want.a.padded_cols, groups = padded / group;
        for (size_t t = 0; t < n_tok; ++t)
          for (size_t g = 0; g < groups; ++g) {
            int qmax = 0;
            for (size_t i = 0; i < group; ++i)
              qmax = std::max(qmax, std::abs(static_cast<int>(want.q[t * padded + g * group + i])));
            const int e = want.shift[t * groups + g];
            CHECK(e <= kQ8MaxShift);
            if (qmax > 0 && e < kQ8MaxShift && want.scale[t] > 1e-30f) CHECK(qmax >= 64);
            for (size_t c = g * group; c < std::min(cols, (g + 1) * group); ++c) {
              const double step = ActivationScale(want.a, t, c), xc = x[t * ldx + c];
              if (std::isfinite(step) && step > 1e-37 && std::fabs(xc) < 126.0 * step)
                CHECK(std::fabs(xc - want.q[t * padded + c] * step) <= 0.5 * step * (1 + 1e-6));
            }
          }
      }
      // The definition itself: ties to even, zero groups, padding.
      const size_t padded = want.a.padded_cols, groups = padded / group;
      for (size_t g = 0; g < groups; ++g) {
        int32_t s = 0;
        for (size_t i = 0; i < group; ++i) s += want.q[g * group + i];
        CHECK(s == want.sum[g]);
      }
      for (size_t c = cols; c < padded; ++c) CHECK(want.q[3 * padded + c] == 0);
      if (cols > 2 && group == 32 && f == WeightFormat::kQ4) {
        // amax 127 -> inv 1: q = round_half_even(x).
        CHECK(want.q[3 * padded + 0] == 127);
        for (size_t c = 1; c < std::min<size_t>(cols, 32); ++c)
          CHECK(want.q[3 * padded + c] == static_cast<int8_t>(std::nearbyint(x[3 * ldx + c])));
      }
    }
  }
}

TEST_CASE("QuantizeActivations on inputs over 1 MiB (next-row prefetch) is bit-exact", "[quant]") {
  const size_t n_tok = 70, cols = 4000, ldx = 4003;  // 1.1 MB: the path that prefetches rows
  const auto x = RandomVec(n_tok * ldx, 31);
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4}) {
    INFO(WeightFormatName(f));
    const Acts want = Quantize(f, x, ldx, n_tok, cols, 128);
    ForEachImpl([&](const KernelTable& K) { CheckQuantizeEquals(K, want, x, ldx, n_tok, cols, 128); });
  }
}

TEST_CASE("a NaN or inf activation gives a NaN scale and NaN outputs for its token on every path", "[quant]") {
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4})
    for (size_t group : {32, 128})
      for (size_t n_tok : {1, 5, 13})  // GEMV and GEMM paths
        for (float bad : bad_values) {
          const size_t rows = 37, cols = 300, ldx = cols + 1;
          INFO(WeightFormatName(f) << " group " << group << " tokens " << n_tok << " value " << bad);
          const Packed p = PackFloats(f, rows, cols, RandomVec(rows * cols, 3), group);
          auto x = RandomVec(n_tok * ldx, 4);
          const Acts clean = Quantize(f, x, ldx, n_tok, cols, group);
          // The last token: one bad value in its first group; token 1 (if any): in its tail
          // (the scalar end of a row, 300 = 2 x 128 + 44).
          const size_t last = n_tok - 1;
          x[last * ldx + 5] = bad;
          if (n_tok > 2) x[1 * ldx + cols - 1] = bad;
          const auto is_bad = [&](size_t t) { return t == last || (n_tok > 2 && t == 1); };
          const Acts acts = Quantize(f, x, ldx, n_tok, cols, group);
          const size_t groups = acts.a.groups();
          for (size_t t = 0; t < n_tok; ++t) {
            if (!is_bad(t)) continue;
            const size_t g = t == last ? 0 : (cols - 1) / group;  // the bad value's group
            CHECK(std::isnan(f == WeightFormat::kQ8 ? acts.scale[t] : acts.scale[t * groups + g]));
            for (size_t c = g * group; c < (g + 1) * group; ++c) CHECK(acts.q[t * acts.a.padded_cols + c] == 0);
            CHECK(acts.sum[t * groups + g] == 0);
          }
          ForEachImpl([&](const KernelTable& K) {
            CheckQuantizeEquals(K, acts, x, ldx, n_tok, cols, group);
            KernelScratch scratch;
            const size_t ldy = rows + 2;
            std::vector<float> want(n_tok * ldy, -1.0f), got(n_tok * ldy, -1.0f);
            K.QuantMatMul(p.w, clean.a, 0, p.w.row_tiles(), want.data(), ldy, scratch);
            K.QuantMatMul(p.w, acts.a, 0, p.w.row_tiles(), got.data(), ldy, scratch);
            size_t wrong = 0;  // counted: one CHECK per element would dominate the run time
            for (size_t t = 0; t < n_tok; ++t)
              for (size_t r = 0; r < rows; ++r) {
                const float gv = got[t * ldy + r], wv = want[t * ldy + r];
                wrong += is_bad(t) ? !std::isnan(gv) : std::memcmp(&gv, &wv, 4) != 0;
              }
            CHECK(wrong == 0);
          });
        }
}

// Checks QuantMatMul for one weight and activation set against the reference on every
// implementation: full range, split ranges and sentinels beyond the outputs. Every call shares one
// scratch, as a thread's calls do.
void CheckQuantMatMul(const Packed& p, const Acts& acts, bool check_split_tokens) {
  KernelScratch scratch;
  const WeightRef& w = p.w;
  const QuantizedActivations& a = acts.a;
  const size_t n = a.n_tok, ldy = w.rows + 3, tiles = w.row_tiles();
  const float sentinel = -12345.0f;
  std::vector<float> want(n * ldy, sentinel);
  ref::QuantMatMul(w, a, 0, tiles, want.data(), ldy, scratch);
  // |terms| bound for targets without fma (mul + add per group instead of one rounding).
  std::vector<double> mag(n * ldy, 0.0);
  bool mag_done = false;
  ForEachImpl([&](const KernelTable& K) {
    std::vector<float> got(n * ldy, sentinel);
    K.QuantMatMul(w, a, 0, tiles + 2, got.data(), ldy, scratch);  // tile_end clipped
    if (K.quant_exact || w.format == WeightFormat::kQ8) {  // q8's epilogue has no fma
      CHECK(SameBits(got, want));
    } else {  // counted, not one CHECK per element: Catch2 assertions dominate the run time
      if (!mag_done) {
        std::vector<float> wabs(w.cols);
        for (size_t r = 0; r < w.rows; ++r) {
          for (size_t c = 0; c < w.cols; ++c) wabs[c] = std::fabs(TiledWeightAt(w, r, c));
          for (size_t t = 0; t < n; ++t)
            for (size_t c = 0; c < w.cols; ++c)
              mag[t * ldy + r] += wabs[c] * std::abs(a.q[t * a.padded_cols + c]) * ActivationScale(a, t, c);
        }
        mag_done = true;
      }
      size_t bad = 0;
      for (size_t i = 0; i < got.size(); ++i) bad += !(std::fabs(got[i] - want[i]) <= 1e-6 * (w.groups() + 1) * mag[i]);
      CHECK(bad == 0);
    }
    // Tile ranges compose to the same bits; outputs outside a range are untouched.
    if (tiles > 1) {
      std::vector<float> split(n * ldy, sentinel);
      const size_t mid = tiles / 2;
      K.QuantMatMul(w, a, mid, tiles, split.data(), ldy, scratch);
      K.QuantMatMul(w, a, 0, mid, split.data(), ldy, scratch);
      K.QuantMatMul(w, a, mid, mid, split.data(), ldy, scratch);
      CHECK(SameBits(split, got));
      std::vector<float> part(n * ldy, sentinel), expect(n * ldy, sentinel);
      K.QuantMatMul(w, a, mid, mid + 1, part.data(), ldy, scratch);
      for (size_t t = 0; t < n; ++t)
        for (size_t r = mid * kTileRows; r < std::min(w.rows, (mid + 1) * kTileRows); ++r)
          expect[t * ldy + r] = got[t * ldy + r];
      CHECK(SameBits(part, expect));
    }
    // GEMV (one token at a time) and GEMM (the whole batch) give the same bits.
    if (check_split_tokens) {
      std::vector<float> one(n * ldy, sentinel);
      for (size_t t = 0; t < n; ++t) K.QuantMatMul(w, Token(a, t), 0, tiles, one.data() + t * ldy, ldy, scratch);
      CHECK(SameBits(one, got));
    }
  });
}

TEST_CASE("QuantMatMul matches the reference over shapes, tokens and tile ranges", "[quant]") {
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kQ3, WeightFormat::kQ2}) {
    for (size_t rows : {1, 5, 16, 17, 33, 70}) {
      for (size_t cols : {1, 31, 32, 33, 100, 128, 129, 300, 1000}) {
        const auto src = RandomVec(rows * cols, static_cast<uint32_t>(rows * 1000 + cols), 0.3f);
        const Packed p = PackFloats(f, rows, cols, src);
        for (size_t n_tok : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 31, 64, 100}) {
          if (rows * cols * n_tok > 2000000) continue;  // keeps the suite fast; big shapes below
          INFO(WeightFormatName(f) << " rows " << rows << " cols " << cols << " tokens " << n_tok);
          const size_t ldx = cols + 1;
          const auto x = RandomVec(n_tok * ldx, static_cast<uint32_t>(n_tok * 7 + cols));
          const Acts acts = Quantize(f, x, ldx, n_tok, cols, p.w.group);
          CheckQuantMatMul(p, acts, n_tok == 9 || n_tok == 13 || n_tok == 31);
        }
      }
    }
  }
}

TEST_CASE("QuantMatMul on large token counts and GEMV/GEMM identity", "[quant]") {
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kQ3, WeightFormat::kQ2}) {
    using Shape = std::tuple<size_t, size_t, size_t>;
    // 800 tokens: more than one internal token batch.
    for (auto [rows, cols, n_tok] :
         {Shape{70, 300, 100}, Shape{33, 1000, 64}, Shape{70, 1000, 31}, Shape{20, 160, 800}}) {
      INFO(WeightFormatName(f) << " rows " << rows << " cols " << cols << " tokens " << n_tok);
      const Packed p = PackFloats(f, rows, cols, RandomVec(rows * cols, 3, 0.2f));
      const auto x = RandomVec(n_tok * cols, 4);
      CheckQuantMatMul(p, Quantize(f, x, cols, n_tok, cols, p.w.group), true);
    }
  }
}

TEST_CASE("QuantMatMul prompt outputs over 1 MiB (non-temporal stores) match the reference", "[quant]") {
  // 64-byte aligned rows (ldy a multiple of 16) and a large output take the streaming-store path
  // of the VNNI GEMM; the last tile is partial (masked stores) and the columns past the rows must
  // keep their sentinels. Smaller tile ranges of the same call fall back to ordinary stores.
  const size_t rows = 16 * 300 + 5, cols = 128, n_tok = 70, ldy = 16 * 301 + 16, tiles = 301;
  const float sentinel = -12345.0f;
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4}) {
    INFO(WeightFormatName(f));
    const Packed p = PackFloats(f, rows, cols, RandomVec(rows * cols, 21, 0.2f));
    const auto x = RandomVec(n_tok * cols, 22);
    const Acts acts = Quantize(f, x, cols, n_tok, cols, p.w.group);
    std::vector<float> want(n_tok * ldy, sentinel);
    KernelScratch scratch;
    ref::QuantMatMul(p.w, acts.a, 0, tiles, want.data(), ldy, scratch);
    auto* y = static_cast<float*>(std::aligned_alloc(64, n_tok * ldy * sizeof(float)));
    REQUIRE(y != nullptr);
    ForEachImpl([&](const KernelTable& K) {
      if (!K.quant_exact && f == WeightFormat::kQ4) return;  // bit-exact paths only
      for (size_t split : {size_t{0}, size_t{120}}) {  // one call; or 120 tiles (0.5 MiB) + 181
        std::fill(y, y + n_tok * ldy, sentinel);
        if (split == 0) {
          K.QuantMatMul(p.w, acts.a, 0, tiles, y, ldy, scratch);
        } else {
          K.QuantMatMul(p.w, acts.a, split, tiles, y, ldy, scratch);
          K.QuantMatMul(p.w, acts.a, 0, split, y, ldy, scratch);
        }
        CHECK(std::memcmp(y, want.data(), want.size() * sizeof(float)) == 0);
      }
    });
    std::free(y);
  }
}

TEST_CASE("QuantMatMul with extreme codes, zero scales and other groups", "[quant]") {
  std::mt19937 rng(9);
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4}) {
    const int lo = f == WeightFormat::kQ8 ? 1 : 0, hi = f == WeightFormat::kQ8 ? 255 : 15;
    for (size_t group : {size_t{0}, size_t{64}}) {
      for (int pattern = 0; pattern < 4; ++pattern) {
        const size_t rows = 37, cols = 300, n_tok = pattern == 3 ? 11 : 5;
        INFO(WeightFormatName(f) << " group " << group << " pattern " << pattern);
        auto code = [&](size_t r, size_t c) {
          switch (pattern) {
            case 0: return hi;                       // all max: largest positive products
            case 1: return lo;                       // all min
            case 2: return (r + c) % 2 ? hi : lo;    // alternating
            default: return static_cast<int>(rng() % (hi + 1));  // any stored value, 0 included
          }
        };
        auto row_scale = [&](size_t r) -> float {  // q8
          if (r % 5 == 0) return 0.0f;
          if (r % 7 == 0) return -0.0f;
          return std::ldexp(1.0f + static_cast<float>(rng() % 100) / 100.0f, -static_cast<int>(rng() % 12));
        };
        auto group_scale = [&](size_t r, size_t g) -> uint16_t {
          if (f == WeightFormat::kQ8) {  // shifts, with bytes beyond the cap (read as the cap)
            const uint16_t big[] = {kQ8MaxShift, kQ8MaxShift + 1, 200, 255};
            return (r + g) % 3 == 0 ? big[(r + g) / 3 % 4] : rng() % 5;
          }
          if ((r + g) % 5 == 0) return 0;  // zero scale
          if ((r + g) % 7 == 0) return 0x8000;  // negative zero
          return F32ToF16(std::ldexp(1.0f + static_cast<float>(rng() % 100) / 100.0f, -static_cast<int>(rng() % 12)));
        };
        const Packed p = WriteCodes(f, rows, cols, code, row_scale, group_scale, group);
        // Activations at full scale (+-127 codes) in every group, one all-zero token, and one
        // whose groups span the whole shift range (q8: e_w + e_a up to 126).
        std::vector<float> x(n_tok * cols);
        for (size_t i = 0; i < x.size(); ++i) x[i] = pattern == 1 ? -1.0f : (i % 3 == 0 ? 1.0f : -1.0f);
        for (size_t c = 0; c < cols; ++c) x[2 * cols + c] = 0.0f;
        for (size_t c = 0; c < cols; ++c)
          x[3 * cols + c] = std::ldexp(c % 2 ? 1.0f : -1.0f, -static_cast<int>(c / p.w.group) * 40);
        const Acts acts = Quantize(f, x, cols, n_tok, cols, p.w.group);
        CheckQuantMatMul(p, acts, true);
      }
    }
  }
}

TEST_CASE("q3/q2 QuantMatMul with extreme codes, sub-scales and super-scales", "[quant]") {
  std::mt19937 rng(11);
  for (WeightFormat f : {WeightFormat::kQ3, WeightFormat::kQ2}) {
    const int top = (1 << SuperBlockBits(f)) - 1;
    for (int pattern = 0; pattern < 4; ++pattern) {
      const size_t rows = 37, cols = 600, n_tok = pattern == 3 ? 11 : 5;
      INFO(WeightFormatName(f) << " pattern " << pattern);
      Packed p;
      p.w = TiledShape(f, rows, cols);
      p.codes.assign(TiledCodeBytes(p.w), 0);
      p.scales.assign(TiledScaleBytes(p.w), 0);
      const size_t groups = p.w.groups(), sb_bytes = p.w.tile_bytes() / groups;
      auto scale = [&](size_t r, size_t g) -> uint16_t {
        if ((r + g) % 5 == 0) return 0;       // zero
        if ((r + g) % 7 == 0) return 0x8000;  // negative zero
        return F32ToF16(std::ldexp(1.0f + static_cast<float>(rng() % 100) / 100.0f, -static_cast<int>(rng() % 12)));
      };
      for (size_t tile = 0; tile < p.w.row_tiles(); ++tile) {
        uint8_t* sc = p.scales.data() + tile * p.w.tile_scale_bytes();
        for (size_t tr = 0; tr < kTileRows; ++tr) {
          const size_t r = tile * kTileRows + tr;
          for (size_t g = 0; g < groups; ++g) {
            const uint16_t d = scale(r, g), dmin = scale(r + 1, g);
            std::memcpy(sc + (g * kTileRows + tr) * 2, &d, 2);
            std::memcpy(sc + ((groups + g) * kTileRows + tr) * 2, &dmin, 2);
            uint8_t c[kSuperGroup];
            for (size_t i = 0; i < kSuperGroup; ++i)  // every stored code, padding included
              c[i] = static_cast<uint8_t>(pattern == 0   ? top
                                          : pattern == 1 ? 0
                                          : pattern == 2 ? ((r + i) % 2 ? top : 0)
                                                         : static_cast<int>(rng() % (top + 1)));
            PlaceSuperBlockCodes(f, c, tr, p.codes.data() + tile * p.w.tile_bytes() + g * sb_bytes);
            for (size_t j = 0; j < kSubGroups; ++j)  // 15 | 15 << 4 at full scale, else any byte
              sc[groups * kTileRows * 4 + (g * kSubGroups + j) * kTileRows + tr] =
                  static_cast<uint8_t>(pattern < 3 ? 0xFF : rng() % 256);
          }
        }
      }
      Attach(p);
      // Activations at full scale (+-127) in every group, one all-zero token, one spanning scales.
      std::vector<float> x(n_tok * cols);
      for (size_t i = 0; i < x.size(); ++i) x[i] = pattern == 1 ? -1.0f : (i % 3 == 0 ? 1.0f : -1.0f);
      for (size_t c = 0; c < cols; ++c) x[2 * cols + c] = 0.0f;
      for (size_t c = 0; c < cols; ++c) x[3 * cols + c] = std::ldexp(c % 2 ? 1.0f : -1.0f, -static_cast<int>(c / 256) * 20);
      CheckQuantMatMul(p, Quantize(f, x, cols, n_tok, cols, p.w.group), true);
    }
  }
}

TEST_CASE("the matmul kernels read nothing an earlier call left in their scratch", "[quant]") {
  // The same bits from a fresh scratch and from one that larger calls grew and that holds
  // garbage, on every path (GEMV, GEMM, AMX where present, bf16).
  const size_t rows = 70, cols = 300, ldy = rows + 1;
  constexpr size_t kPoisonBytes = size_t{1} << 20;  // more than any call below takes
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kQ3, WeightFormat::kQ2,
                         WeightFormat::kBF16Tiled}) {
    const Packed p = PackFloats(f, rows, cols, RandomVec(rows * cols, 41, 0.2f));
    ForEachImpl([&](const KernelTable& K) {
      KernelScratch used;
      for (size_t n_tok : {40, 1, 3, 8, 13, 40}) {
        INFO(WeightFormatName(f) << " tokens " << n_tok);
        const auto x = RandomVec(n_tok * cols, static_cast<uint32_t>(n_tok + 42));
        const Acts acts = f == WeightFormat::kBF16Tiled ? Acts{} : Quantize(f, x, cols, n_tok, cols, p.w.group);
        auto run = [&](KernelScratch& scratch) {
          std::vector<float> y(n_tok * ldy, -3.0f);
          if (f == WeightFormat::kBF16Tiled)
            K.bf16_tiled_matmul(p.w, x.data(), cols, n_tok, 0, p.w.row_tiles(), y.data(), ldy, scratch);
          else
            K.QuantMatMul(p.w, acts.a, 0, p.w.row_tiles(), y.data(), ldy, scratch);
          return y;
        };
        KernelScratch fresh;
        const std::vector<float> want = run(fresh);
        for (size_t slot = 0; slot < KernelScratch::kArrays; ++slot)
          std::memset(used.Array<uint8_t>(slot, kPoisonBytes), 0xA5 + static_cast<int>(slot), kPoisonBytes);
        CHECK(SameBits(run(used), want));
      }
    });
  }
}

TEST_CASE("QuantMatMul is close to the fp32 product of the dequantized weights", "[quant]") {
  for (WeightFormat f : {WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kQ3, WeightFormat::kQ2}) {
    const size_t rows = 48, cols = 512, n_tok = 10;
    const Packed p = PackFloats(f, rows, cols, RandomVec(rows * cols, 21, 0.05f));
    const auto x = RandomVec(n_tok * cols, 22);
    const Acts acts = Quantize(f, x, cols, n_tok, cols, p.w.group);
    std::vector<float> y(n_tok * rows);
    KernelScratch scratch;
    BestKernels().QuantMatMul(p.w, acts.a, 0, p.w.row_tiles(), y.data(), rows, scratch);
    double err = 0, norm = 0;
    for (size_t t = 0; t < n_tok; ++t)
      for (size_t r = 0; r < rows; ++r) {
        double exact = 0;
        for (size_t c = 0; c < cols; ++c) exact += static_cast<double>(TiledWeightAt(p.w, r, c)) * x[t * cols + c];
        err += (y[t * rows + r] - exact) * (y[t * rows + r] - exact);
        norm += exact * exact;
      }
    INFO(WeightFormatName(f) << " relative error " << std::sqrt(err / norm));
    CHECK(std::sqrt(err / norm) < 0.02);  // int8 activation rounding only
  }
}

TEST_CASE("Bf16TiledMatMul matches the reference", "[quant]") {
  for (size_t rows : {1, 5, 16, 17, 33, 70}) {
    for (size_t cols : {1, 2, 31, 32, 33, 100, 129, 300, 1000}) {
      const auto src = RandomVec(rows * cols, static_cast<uint32_t>(rows + 31 * cols));
      const Packed p = PackFloats(WeightFormat::kBF16Tiled, rows, cols, src);
      for (size_t n_tok : {1, 2, 3, 5, 9, 13}) {
        INFO("rows " << rows << " cols " << cols << " tokens " << n_tok);
        const size_t ldx = cols + 2, ldy = rows + 1, tiles = p.w.row_tiles();
        const auto x = RandomVec(n_tok * ldx, static_cast<uint32_t>(n_tok + cols));
        std::vector<float> want(n_tok * ldy, -7.0f);
        KernelScratch scratch;
        ref::Bf16TiledMatMul(p.w, x.data(), ldx, n_tok, 0, tiles, want.data(), ldy, scratch);
        std::vector<double> mag(n_tok * ldy, 0.0);
        for (size_t t = 0; t < n_tok; ++t)
          for (size_t r = 0; r < rows; ++r)
            for (size_t c = 0; c < cols; ++c)
              mag[t * ldy + r] += std::fabs(static_cast<double>(TiledWeightAt(p.w, r, c)) * x[t * ldx + c]);
        ForEachImpl([&](const KernelTable& K) {
          std::vector<float> got(n_tok * ldy, -7.0f);
          K.bf16_tiled_matmul(p.w, x.data(), ldx, n_tok, 0, tiles + 1, got.data(), ldy, scratch);
          size_t bad = 0;
          // 2^-15: twice the worst case of the AVX512-BF16 path's hi + lo split of x (2^-16).
          for (size_t i = 0; i < got.size(); ++i) bad += !(std::fabs(got[i] - want[i]) <= 0x1p-15 * mag[i]);
          CHECK(bad == 0);
          if (tiles > 1) {  // a range leaves the other rows alone
            std::vector<float> part(n_tok * ldy, -7.0f), expect(n_tok * ldy, -7.0f);
            K.bf16_tiled_matmul(p.w, x.data(), ldx, n_tok, 1, tiles, part.data(), ldy, scratch);
            for (size_t t = 0; t < n_tok; ++t)
              for (size_t r = kTileRows; r < rows; ++r) expect[t * ldy + r] = got[t * ldy + r];
            CHECK(SameBits(part, expect));
          }
        });
      }
    }
  }
}

}  // namespace
}  // namespace m3::simd
