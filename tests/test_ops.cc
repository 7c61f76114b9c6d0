// Operators against direct math written out in the test (double precision where it matters).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "ops/attention.h"
#include "ops/matmul.h"
#include "ops/mlp.h"
#include "ops/moe.h"
#include "ops/norm_rope.h"
#include "ops/workspace.h"
#include "packed_weights.h"
#include "test_util.h"

namespace m3 {
namespace {

using test::RandomVec;

const ThreadConfig kOne{1}, kTwo{2};

TEST_CASE("MatMul equals the direct product for every weight format, on 1 and 2 threads", "[ops]") {
  const size_t rows = 37, cols = 70, n = 5;
  auto xf = RandomVec(n * cols, 1);
  std::mt19937 rng(3);
  std::vector<uint16_t> bf(rows * cols), h(rows * cols);
  std::vector<uint8_t> q(rows * cols), sc(rows * 3);
  for (auto& v : bf) v = static_cast<uint16_t>(0x3C00 + rng() % 0x600);  // |w| in [2^-7, 2^5)
  for (auto& v : h) v = static_cast<uint16_t>(0x2000 + rng() % 0x3000);
  for (auto& v : q) v = static_cast<uint8_t>(rng() % 0x7E);
  for (auto& v : sc) v = static_cast<uint8_t>(120 + rng() % 10);
  auto f32 = RandomVec(rows * cols, 2);
  for (auto fmt : {simd::WeightFormat::kF32, simd::WeightFormat::kBF16, simd::WeightFormat::kF16, simd::WeightFormat::kE4M3Mx32}) {
    INFO(simd::WeightFormatName(fmt));
    simd::WeightRef w{fmt, nullptr, sc.data(), rows, cols};
    w.data = fmt == simd::WeightFormat::kF32 ? static_cast<const void*>(f32.data())
             : fmt == simd::WeightFormat::kBF16 ? static_cast<const void*>(bf.data())
             : fmt == simd::WeightFormat::kF16 ? static_cast<const void*>(h.data())
                                               : static_cast<const void*>(q.data());
    std::vector<float> y1(n * rows), y2(n * rows);
    MatMul(kOne, w, xf.data(), cols, n, y1.data(), rows);
    MatMul(kTwo, w, xf.data(), cols, n, y2.data(), rows);
    CHECK(y1 == y2);
    for (size_t t = 0; t < n; ++t)
      for (size_t r = 0; r < rows; ++r) {
        double s = 0, mag = 0;
        for (size_t c = 0; c < cols; ++c) {
          s += static_cast<double>(simd::WeightAt(w, r, c)) * xf[t * cols + c];
          mag += std::fabs(simd::WeightAt(w, r, c) * xf[t * cols + c]);
        }
        CHECK(std::fabs(y1[t * rows + r] - s) <= 1e-5 * (1 + mag));
      }
  }
}

TEST_CASE("MatMulSameInput gives every weight MatMul's bits, sharing quantized inputs where it can", "[ops]") {
  // Weights of several formats and row counts over one input: two q8 and two q4 weights share
  // one quantization each, the f32 and bf16 ones read x; a q8 weight with another group size
  // needs its own quantization.
  const size_t cols = 256;
  test::PackedWeights storage;
  auto packed = [&](simd::WeightFormat f, size_t rows, uint32_t seed, size_t group = 0) {
    return storage.Random(f, rows, cols, seed, 0.1f, group);
  };
  using F = simd::WeightFormat;
  const std::vector<simd::WeightRef> weights = {packed(F::kQ8, 100, 1),      packed(F::kQ4, 37, 2),
                                                packed(F::kQ8, 16, 3),       packed(F::kF32, 21, 4),
                                                packed(F::kQ4, 64, 5),       packed(F::kBF16Tiled, 40, 6),
                                                packed(F::kQ8, 33, 7, 64)};
  Workspace session;  // one workspace through calls of every shape, as a session's (the kernels' scratch in it)
  for (size_t n : {29, 1, 6, 29}) {
    const auto x = RandomVec(n * (cols + 3), static_cast<uint32_t>(n));  // row stride cols + 3
    std::vector<std::vector<float>> want(weights.size());
    for (size_t i = 0; i < weights.size(); ++i) {
      want[i].assign(n * (weights[i].rows + 1), -7.0f);  // row stride rows + 1: the gap stays
      MatMul(kOne, weights[i], x.data(), cols + 3, n, want[i].data(), weights[i].rows + 1);
    }
    for (int threads : {1, 2, 3}) {
      INFO(n << " tokens, " << threads << " threads");
      std::vector<std::vector<float>> got(weights.size());
      std::vector<MatMulTarget> targets;
      for (size_t i = 0; i < weights.size(); ++i) {
        got[i].assign(n * (weights[i].rows + 1), -7.0f);
        targets.push_back({&weights[i], got[i].data(), weights[i].rows + 1});
      }
      MatMulSameInput(ThreadConfig{threads}, targets, x.data(), cols + 3, n);
      for (size_t i = 0; i < weights.size(); ++i) CHECK(got[i] == want[i]);
      for (auto& g : got) std::fill(g.begin(), g.end(), -7.0f);
      MatMulSameInput(OpContext(ThreadConfig{threads}, nullptr, &session), targets, x.data(), cols + 3, n);
      for (size_t i = 0; i < weights.size(); ++i) CHECK(got[i] == want[i]);
    }
  }
}

TEST_CASE("RmsNormRows is x / rms(x) * scale", "[ops]") {
  const size_t dim = 37, n = 3;
  auto x = RandomVec(n * dim, 4), scale = RandomVec(dim, 5);
  std::vector<float> y(n * dim);
  RmsNormRows(x.data(), dim, n, dim, scale.data(), 1e-6f, y.data(), dim);
  for (size_t r = 0; r < n; ++r) {
    double ms = 0;
    for (size_t i = 0; i < dim; ++i) ms += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ms / dim + 1e-6);
    for (size_t i = 0; i < dim; ++i) CHECK(std::fabs(y[r * dim + i] - x[r * dim + i] * inv * scale[i]) < 1e-5);
  }
}

TEST_CASE("Rope rotates pairs (i, i + R/2) of the first R channels and leaves the rest", "[ops]") {
  const int D = 16, R = 8;
  const double theta = 5e6;
  Rope rope(R, theta);
  for (int64_t pos : {0, 1, 17, 2303, 1000000}) {
    auto x = RandomVec(2 * D, 6);
    auto y = x;
    rope.Apply(y.data(), 2, D, pos);
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < R / 2; ++i) {
        const float inv = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / R);
        const double a = static_cast<float>(pos) * inv;
        const double x1 = x[h * D + i], x2 = x[h * D + i + R / 2];
        CHECK(std::fabs(y[h * D + i] - (x1 * std::cos(a) - x2 * std::sin(a))) < 1e-5);
        CHECK(std::fabs(y[h * D + i + R / 2] - (x2 * std::cos(a) + x1 * std::sin(a))) < 1e-5);
      }
      for (int i = R; i < D; ++i) CHECK(y[h * D + i] == x[h * D + i]);
    }
  }
}

TEST_CASE("SwiGLU-OAI clamps the gate above only and the up projection both ways", "[ops]") {
  const SwigluParams p;  // alpha 1.702, limit 7, beta 1
  auto act = [&](float g, float u) {
    SwigluOai(&g, &u, 1, p);
    return g;
  };
  auto sig = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  CHECK(act(-8.0f, 0.0f) == Approx(-8.0 * sig(-1.702 * 8)).epsilon(1e-5));  // no lower clamp on the gate
  CHECK(act(12.0f, 0.0f) == Approx(7.0 * sig(1.702 * 7)).epsilon(1e-6));    // gate 12 -> 7
  CHECK(act(1.0f, 12.0f) == Approx(1.0 * sig(1.702) * 8.0).epsilon(1e-6));  // up 12 -> 7, +1
  CHECK(act(1.0f, -12.0f) == Approx(1.0 * sig(1.702) * -6.0).epsilon(1e-6));
  // A NaN or infinite input gives NaN (never a clamped, finite value).
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    CHECK(std::isnan(act(bad, 1.0f)));
    CHECK(std::isnan(act(1.0f, bad)));
  }
}

TEST_CASE("router: bias chooses, unbiased sigmoid weighs, ties go to the lower id", "[ops]") {
  MoeParams p;
  p.top_k = 2;
  p.routed_scaling = 2.0f;
  std::vector<float> logits = {2.0f, 1.0f, 0.0f, -1.0f};
  std::vector<float> bias = {0.0f, 0.0f, 0.0f, 1.0f};  // promotes expert 3
  int32_t ids[2];
  float w[2];
  RouteToken(logits.data(), bias, p, ids, w);
  CHECK(ids[0] == 3);
  CHECK(ids[1] == 0);
  auto sig = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  const double s3 = sig(-1), s0 = sig(2);
  CHECK(w[0] == Approx(2.0 * s3 / (s3 + s0)));
  CHECK(w[1] == Approx(2.0 * s0 / (s3 + s0)));
  std::vector<float> flat(4, 0.5f), zero(4, 0.0f);
  RouteToken(flat.data(), zero, p, ids, w);
  CHECK(ids[0] == 0);
  CHECK(ids[1] == 1);
  // A NaN logit or bias: chosen as if -inf, and every weight NaN (never a quiet finite result).
  for (int where = 0; where < 2; ++where) {
    std::vector<float> l = logits, b = bias;
    (where == 0 ? l : b)[0] = NAN;
    RouteToken(l.data(), b, p, ids, w);
    CHECK(ids[0] == 3);
    CHECK(ids[1] == 1);
    CHECK(std::isnan(w[0]));
    CHECK(std::isnan(w[1]));
  }
}

SparseParams Sparse(int B, int topk, int init, int local) {
  SparseParams p;
  p.block_size = B, p.topk_blocks = topk, p.init_blocks = init, p.local_blocks = local;
  return p;
}

TEST_CASE("block selection: forced blocks, top-k and tie order", "[ops][sparse]") {
  int32_t out[32];
  // MSA-TIE: all-zero scores, 18 visible blocks, top-16 with local 1 -> {0..14, 17}.
  std::vector<float> zeros(18, 0.0f);
  int n = SelectBlocksForQuery(zeros.data(), 2303, Sparse(128, 16, 0, 1), out);
  std::vector<int32_t> want(15);
  std::iota(want.begin(), want.end(), 0);
  want.push_back(17);
  CHECK(std::vector<int32_t>(out, out + n) == want);
  // Fewer visible blocks than top-k: everything.
  n = SelectBlocksForQuery(zeros.data(), 300, Sparse(128, 16, 0, 1), out);
  CHECK(std::vector<int32_t>(out, out + n) == std::vector<int32_t>{0, 1, 2});
  // init 1 + local 2, top-4 of 8 blocks: {0, 6, 7} forced + best other (block 3).
  std::vector<float> s = {-5, 1, 2, 9, 3, 4, -1, -2};
  n = SelectBlocksForQuery(s.data(), 8 * 8 - 1, Sparse(8, 4, 1, 2), out);
  CHECK(std::vector<int32_t>(out, out + n) == std::vector<int32_t>{0, 3, 6, 7});
  // NaN scores rank as -inf.
  std::vector<float> withnan = {NAN, 1, 0, 5};
  n = SelectBlocksForQuery(withnan.data(), 31, Sparse(8, 3, 0, 1), out);
  CHECK(std::vector<int32_t>(out, out + n) == std::vector<int32_t>{1, 2, 3});
  // Forced blocks overflowing top-k: init first, then local by score.
  std::vector<float> f = {0, 0, 0, 0, 1, 2};
  n = SelectBlocksForQuery(f.data(), 47, Sparse(8, 2, 1, 3), out);
  CHECK(std::vector<int32_t>(out, out + n) == std::vector<int32_t>{0, 5});
}

// Direct reference: attention of one query over an explicit key set, in double.
void ReferenceAttention(const std::vector<float>& q, const std::vector<float>& K, const std::vector<float>& V,
                        int H, int Hkv, int D, int64_t pos, const std::vector<std::set<int>>* blocks_per_head,
                        int B, std::vector<double>* out) {
  out->assign(H * D, 0.0);
  for (int j = 0; j < H; ++j) {
    const int g = j / (H / Hkv);
    std::vector<double> s;
    std::vector<int> keys;
    for (int64_t u = 0; u <= pos; ++u) {
      if (blocks_per_head && !(*blocks_per_head)[j].count(static_cast<int>(u / B))) continue;
      double d = 0;
      for (int c = 0; c < D; ++c) d += double(q[j * D + c]) * K[(u * Hkv + g) * D + c];
      s.push_back(d / std::sqrt(double(D)));
      keys.push_back(static_cast<int>(u));
    }
    if (s.empty()) continue;  // no visible key: the engine outputs zeros
    const double mx = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - mx));
    for (size_t i = 0; i < keys.size(); ++i)
      for (int c = 0; c < D; ++c) (*out)[j * D + c] += s[i] / sum * V[(keys[i] * Hkv + g) * D + c];
  }
}

// Caches filled from plain arrays, and the values they hold (decoded: bf16 and int8 round).
struct TestCaches {
  KvPages k, v;
  IndexKeyPages ik;
  std::vector<float> K, V, IK;  // as stored
  TestCaches(const std::vector<float>& K0, const std::vector<float>& V0, const std::vector<float>& IK0, int len,
             int Hkv, int D, int Di, int B, CacheType kv_type, CacheType ik_type)
      : k(Hkv, D, B, kv_type, KvLayout::kTransposed), v(Hkv, D, B, kv_type), ik(Di, B, ik_type), K(K0.size()), V(V0.size()), IK(IK0.size()) {
    k.EnsureRows(len), v.EnsureRows(len), ik.EnsureRows(len);
    for (int u = 0; u < len; ++u) {
      k.Write(u, &K0[u * Hkv * D]);
      v.Write(u, &V0[u * Hkv * D]);
      ik.Write(u, &IK0[u * Di]);
      for (int g = 0; g < Hkv; ++g)
        for (int c = 0; c < D; ++c) K[(u * Hkv + g) * D + c] = k.Value(u, g, c), V[(u * Hkv + g) * D + c] = v.Value(u, g, c);
      for (int c = 0; c < Di; ++c) IK[u * Di + c] = ik.Value(u, c);
    }
  }
};

TEST_CASE("indexer + sparse attention equal a direct masked reference for many settings", "[ops][sparse]") {
  struct Setting {
    int len, B, topk, init, local, H, Hkv, Hidx;
    CacheType kv, ik;
  };
  std::vector<Setting> settings = {
      {40, 8, 3, 0, 1, 4, 2, 2, CacheType::kF32, CacheType::kF32},
      {70, 8, 2, 1, 1, 6, 2, 2, CacheType::kF32, CacheType::kF32},
      {100, 16, 4, 1, 2, 4, 4, 4, CacheType::kBF16, CacheType::kF32},
      {65, 4, 5, 2, 2, 8, 2, 4, CacheType::kF32, CacheType::kBF16},
      {33, 8, 100, 0, 1, 2, 1, 1, CacheType::kInt8, CacheType::kF32},
      {90, 8, 3, 0, 0, 4, 2, 2, CacheType::kF32, CacheType::kInt8},
  };
  // And random ones: lengths across several query tiles and pages, odd block sizes.
  std::mt19937 rng(42);
  const CacheType types[] = {CacheType::kF32, CacheType::kBF16, CacheType::kInt8};
  for (int i = 0; i < 14; ++i) {
    const int Hkv = 1 + static_cast<int>(rng() % 3), Hidx = Hkv;
    const int H = Hkv * (1 + static_cast<int>(rng() % 3));
    settings.push_back({20 + static_cast<int>(rng() % 180), 3 + static_cast<int>(rng() % 14),
                        1 + static_cast<int>(rng() % 6), static_cast<int>(rng() % 3), static_cast<int>(rng() % 3), H,
                        Hkv, Hidx, types[rng() % 3], types[rng() % 3]});
  }
  for (const auto& st : settings) {
    INFO("len " << st.len << " B " << st.B << " topk " << st.topk << " init " << st.init << " local " << st.local
                << " H " << st.H << "/" << st.Hkv << "/" << st.Hidx << " kv " << simd::CacheTypeName(st.kv) << " ik "
                << simd::CacheTypeName(st.ik));
    const int D = 16, Di = 12;
    const SparseParams sp{st.Hidx, Di, st.B, st.topk, st.init, st.local};
    auto K0 = RandomVec(st.len * st.Hkv * D, rng()), V0 = RandomVec(st.len * st.Hkv * D, rng());
    auto IK0 = RandomVec(st.len * Di, rng()), Q = RandomVec(st.len * st.H * D, rng()), IQ = RandomVec(st.len * st.Hidx * Di, rng());
    const TestCaches c(K0, V0, IK0, st.len, st.Hkv, D, Di, st.B, st.kv, st.ik);
    // Prefill of every position in one call, in chunks of random sizes, and one at a time (decode).
    BlockSelection sel, one;
    SelectBlocks(kTwo, sp, IQ.data(), c.ik, 0, st.len, &sel);
    AttentionParams ap{st.H, st.Hkv, D, st.Hidx, st.B};
    std::vector<float> out(st.len * st.H * D), chunked(st.len * st.H * D), step(st.H * D);
    Attention(kTwo, ap, Q.data(), c.k, c.v, 0, st.len, &sel, out.data());
    for (int p0 = 0; p0 < st.len;) {
      const int n = std::min(st.len - p0, 1 + static_cast<int>(rng() % 40));
      BlockSelection part;
      SelectBlocks(kTwo, sp, &IQ[p0 * st.Hidx * Di], c.ik, p0, n, &part);
      Attention(kTwo, ap, &Q[p0 * st.H * D], c.k, c.v, p0, n, &part, &chunked[p0 * st.H * D]);
      p0 += n;
    }
    CHECK(chunked == out);
    for (int p = 0; p < st.len; ++p) {
      // Reference selection: block max of the stored keys' scores, forced blocks, best others.
      const int valid = p / st.B + 1;
      std::vector<std::set<int>> per_head(st.H);
      for (int h = 0; h < st.Hidx; ++h) {
        std::vector<float> bs(valid, -INFINITY);
        for (int u = 0; u <= p; ++u) {
          double d = 0;
          for (int cc = 0; cc < Di; ++cc) d += double(IQ[(p * st.Hidx + h) * Di + cc]) * c.IK[u * Di + cc];
          bs[u / st.B] = std::max(bs[u / st.B], static_cast<float>(d));
        }
        int32_t ids[128];
        const int n = SelectBlocksForQuery(bs.data(), p, sp, ids);
        REQUIRE(n == std::min(st.topk, valid));
        REQUIRE(sel.Count(p, h) == n);
        CHECK(std::vector<int32_t>(ids, ids + n) == std::vector<int32_t>(sel.Blocks(p, h), sel.Blocks(p, h) + n));
        for (int j = h * (st.H / st.Hidx); j < (h + 1) * (st.H / st.Hidx); ++j) per_head[j] = std::set<int>(ids, ids + n);
      }
      std::vector<double> want;
      ReferenceAttention(std::vector<float>(&Q[p * st.H * D], &Q[(p + 1) * st.H * D]), c.K, c.V, st.H, st.Hkv, D, p,
                         &per_head, st.B, &want);
      // A query whose own block is not selected (local 0) can see no key at all: zero output.
      for (int i = 0; i < st.H * D; ++i) CHECK(std::fabs(out[p * st.H * D + i] - want[i]) < 1e-4);
      SelectBlocks(kOne, sp, &IQ[p * st.Hidx * Di], c.ik, p, 1, &one);
      Attention(kOne, ap, &Q[p * st.H * D], c.k, c.v, p, 1, &one, step.data());
      for (int i = 0; i < st.H * D; ++i) CHECK(step[i] == out[p * st.H * D + i]);  // decode == prefill row
    }
  }
}

TEST_CASE("sparse attention with top-k >= visible blocks equals dense causal attention", "[ops][sparse]") {
  const int len = 150, B = 8, H = 4, Hkv = 2, D = 16, Di = 8;
  auto K = RandomVec(len * Hkv * D, 1), V = RandomVec(len * Hkv * D, 2), Q = RandomVec(len * H * D, 3);
  auto IK = RandomVec(len * Di, 4), IQ = RandomVec(len * 2 * Di, 5);
  for (CacheType kv : {CacheType::kF32, CacheType::kBF16, CacheType::kInt8}) {
    INFO(simd::CacheTypeName(kv));
    const TestCaches c(K, V, IK, len, Hkv, D, Di, B, kv, CacheType::kF32);
    BlockSelection sel;
    SelectBlocks(kTwo, SparseParams{2, Di, B, 19, 0, 1}, IQ.data(), c.ik, 0, len, &sel);
    std::vector<float> sparse(len * H * D), dense(len * H * D);
    Attention(kTwo, AttentionParams{H, Hkv, D, 2, B}, Q.data(), c.k, c.v, 0, len, &sel, sparse.data());
    Attention(kTwo, AttentionParams{H, Hkv, D, 1, 1}, Q.data(), c.k, c.v, 0, len, nullptr, dense.data());
    CHECK(sparse == dense);
    std::vector<double> want;
    for (int p : {0, 7, 8, 77, len - 1}) {
      ReferenceAttention(std::vector<float>(&Q[p * H * D], &Q[(p + 1) * H * D]), c.K, c.V, H, Hkv, D, p, nullptr, B,
                         &want);
      for (int i = 0; i < H * D; ++i) CHECK(std::fabs(dense[p * H * D + i] - want[i]) < 1e-4);
    }
  }
}

TEST_CASE("attention refuses caches laid out for other blocks or layouts", "[ops][sparse]") {
  const int len = 20, H = 2, Hkv = 1, D = 8, Di = 4;
  auto Q = RandomVec(len * H * D, 1), IQ = RandomVec(len * Di, 2), X = RandomVec(len * Hkv * D, 3);
  KvPages k(Hkv, D, 8, CacheType::kF32, KvLayout::kTransposed), v(Hkv, D, 8, CacheType::kF32);
  KvPages k_rows(Hkv, D, 8, CacheType::kF32);
  IndexKeyPages ik(Di, 8, CacheType::kF32);
  k.EnsureRows(len), v.EnsureRows(len), k_rows.EnsureRows(len), ik.EnsureRows(len);
  for (int u = 0; u < len; ++u) k.Write(u, &X[u * D]), v.Write(u, &X[u * D]), k_rows.Write(u, &X[u * D]), ik.Write(u, &X[u * D]);
  std::vector<float> out(len * H * D);
  BlockSelection sel;
  CHECK_THROWS_AS(SelectBlocks(kOne, SparseParams{1, Di, 16, 2, 0, 1}, IQ.data(), ik, 0, len, &sel), std::invalid_argument);
  SelectBlocks(kOne, SparseParams{1, Di, 8, 2, 0, 1}, IQ.data(), ik, 0, len, &sel);
  CHECK_THROWS_AS(Attention(kOne, AttentionParams{H, Hkv, D, 1, 16}, Q.data(), k, v, 0, len, &sel, out.data()),
                  std::invalid_argument);
  CHECK_THROWS_AS(Attention(kOne, AttentionParams{H, Hkv, D, 1, 8}, Q.data(), k_rows, v, 0, len, &sel, out.data()),
                  std::invalid_argument);
  CHECK_NOTHROW(Attention(kOne, AttentionParams{H, Hkv, D, 1, 8}, Q.data(), k, v, 0, len, &sel, out.data()));
}

TEST_CASE("KV and index-key pages store each type within its rounding", "[ops][cache]") {
  const int len = 300, Hkv = 3, D = 20, B = 16;
  auto X = RandomVec(len * Hkv * D, 9, 3.0f);
  std::vector<float> scratch(B * D);
  for (CacheType t : {CacheType::kF32, CacheType::kBF16, CacheType::kInt8}) {
    INFO(simd::CacheTypeName(t));
    KvPages k(Hkv, D, B, t), kt(Hkv, D, B, t, KvLayout::kTransposed);
    IndexKeyPages ik(Hkv * D, B, t);
    k.EnsureRows(len), kt.EnsureRows(len), ik.EnsureRows(len);
    CHECK(k.capacity_rows() == (len + B - 1) / B * B);
    CHECK(k.bytes() == k.capacity_rows() * KvPages::BytesPerRow(Hkv, D, t));
    for (int u = 0; u < len; ++u) k.Write(u, &X[u * Hkv * D]), kt.Write(u, &X[u * Hkv * D]), ik.Write(u, &X[u * Hkv * D]);
    for (int u = 0; u < len; ++u)
      for (int g = 0; g < Hkv; ++g) {
        float amax = 0;
        for (int c = 0; c < D; ++c) amax = std::max(amax, std::fabs(X[(u * Hkv + g) * D + c]));
        const float* row = k.Read(u, u + 1, g, scratch.data());
        for (int c = 0; c < D; ++c) {
          CHECK(kt.Value(u, g, c) == row[c]);  // both layouts store the same values
          const float x = X[(u * Hkv + g) * D + c];
          const float tol = t == CacheType::kF32 ? 0.0f : t == CacheType::kBF16 ? std::fabs(x) / 256 : amax / 254 * 1.0001f;
          CHECK(std::fabs(row[c] - x) <= tol);
        }
      }
    // A transposed block read in one call holds the same values, a dimension per row.
    size_t ld = 0;
    const float* tb = kt.Read(2 * B, 3 * B - 1, 2, scratch.data(), &ld);
    CHECK(ld == static_cast<size_t>(B));
    for (int r = 0; r < B - 1; ++r)
      for (int c = 0; c < D; ++c) CHECK(tb[c * ld + r] == k.Value(2 * B + r, 2, c));
    // A block read in one call equals its rows read one by one.
    std::vector<float> block(B * D);
    std::copy_n(k.Read(2 * B, 3 * B, 1, scratch.data()), B * D, block.begin());
    for (int r = 0; r < B; ++r)
      CHECK(std::vector<float>(k.Read(2 * B + r, 2 * B + r + 1, 1, scratch.data()),
                               k.Read(2 * B + r, 2 * B + r + 1, 1, scratch.data()) + D) ==
            std::vector<float>(&block[r * D], &block[(r + 1) * D]));
    if (t == CacheType::kF32)
      for (int u = 0; u < len; u += 7) CHECK(ik.Value(u, 5) == X[u * Hkv * D + 5]);
  }
}

}  // namespace
}  // namespace m3
