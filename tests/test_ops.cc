// Operators against direct math written out in the test (double precision where it matters).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "ops/attention.h"
#include "ops/matmul.h"
#include "ops/mlp.h"
#include "ops/moe.h"
#include "ops/norm_rope.h"
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

TEST_CASE("indexer + sparse attention equal a direct masked reference for many settings", "[ops][sparse]") {
  std::mt19937 rng(42);
  struct Setting {
    int len, B, topk, init, local, H, Hkv, Hidx;
  };
  const std::vector<Setting> settings = {
      {40, 8, 3, 0, 1, 4, 2, 2},  {70, 8, 2, 1, 1, 6, 2, 2},   {100, 16, 4, 1, 2, 4, 4, 4},
      {65, 4, 5, 2, 2, 8, 2, 4},  {33, 8, 100, 0, 1, 2, 1, 1}, {90, 8, 3, 0, 0, 4, 2, 2},
  };
  for (const auto& st : settings) {
    INFO("len " << st.len << " B " << st.B << " topk " << st.topk << " init " << st.init << " local " << st.local);
    const int D = 16, Di = 12;
    const SparseParams sp{st.Hidx, Di, st.B, st.topk, st.init, st.local};
    auto K = RandomVec(st.len * st.Hkv * D, rng()), V = RandomVec(st.len * st.Hkv * D, rng());
    auto IK = RandomVec(st.len * Di, rng()), Q = RandomVec(st.len * st.H * D, rng()), IQ = RandomVec(st.len * st.Hidx * Di, rng());
    PagedRows k(st.Hkv * D, st.B), v(st.Hkv * D, st.B), ik(Di, st.B);
    k.EnsureRows(st.len), v.EnsureRows(st.len), ik.EnsureRows(st.len);
    for (int u = 0; u < st.len; ++u) {
      std::copy_n(&K[u * st.Hkv * D], st.Hkv * D, k.Row(u));
      std::copy_n(&V[u * st.Hkv * D], st.Hkv * D, v.Row(u));
      std::copy_n(&IK[u * Di], Di, ik.Row(u));
    }
    // Prefill of every position in one call, and the same positions one at a time (decode).
    BlockSelection sel, one;
    SelectBlocks(kTwo, sp, IQ.data(), ik, 0, st.len, &sel);
    AttentionParams ap{st.H, st.Hkv, D, st.Hidx, st.B};
    std::vector<float> out(st.len * st.H * D), step(st.H * D);
    Attention(kTwo, ap, Q.data(), k, v, 0, st.len, &sel, out.data());
    for (int p = 0; p < st.len; ++p) {
      // Reference selection: block max of exact scores, forced blocks, best others.
      const int valid = p / st.B + 1;
      std::vector<std::set<int>> per_head(st.H);
      for (int h = 0; h < st.Hidx; ++h) {
        std::vector<float> bs(valid, -INFINITY);
        for (int u = 0; u <= p; ++u) {
          double d = 0;
          for (int c = 0; c < Di; ++c) d += double(IQ[(p * st.Hidx + h) * Di + c]) * IK[u * Di + c];
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
      ReferenceAttention(std::vector<float>(&Q[p * st.H * D], &Q[(p + 1) * st.H * D]), K, V, st.H, st.Hkv, D, p,
                         &per_head, st.B, &want);
      // A query whose own block is not selected (local 0) can see no key at all: zero output.
      for (int i = 0; i < st.H * D; ++i) CHECK(std::fabs(out[p * st.H * D + i] - want[i]) < 1e-4);
      SelectBlocks(kOne, sp, &IQ[p * st.Hidx * Di], ik, p, 1, &one);
      Attention(kOne, ap, &Q[p * st.H * D], k, v, p, 1, &one, step.data());
      for (int i = 0; i < st.H * D; ++i) CHECK(step[i] == out[p * st.H * D + i]);  // decode == prefill row
    }
  }
}

TEST_CASE("sparse attention with top-k >= visible blocks equals dense causal attention", "[ops][sparse]") {
  const int len = 50, B = 8, H = 4, Hkv = 2, D = 16, Di = 8;
  auto K = RandomVec(len * Hkv * D, 1), V = RandomVec(len * Hkv * D, 2), Q = RandomVec(len * H * D, 3);
  auto IK = RandomVec(len * Di, 4), IQ = RandomVec(len * 2 * Di, 5);
  PagedRows k(Hkv * D, B), v(Hkv * D, B), ik(Di, B);
  k.EnsureRows(len), v.EnsureRows(len), ik.EnsureRows(len);
  for (int u = 0; u < len; ++u) {
    std::copy_n(&K[u * Hkv * D], Hkv * D, k.Row(u));
    std::copy_n(&V[u * Hkv * D], Hkv * D, v.Row(u));
    std::copy_n(&IK[u * Di], Di, ik.Row(u));
  }
  BlockSelection sel;
  SelectBlocks(kTwo, SparseParams{2, Di, B, 7, 0, 1}, IQ.data(), ik, 0, len, &sel);
  std::vector<float> sparse(len * H * D), dense(len * H * D);
  Attention(kTwo, AttentionParams{H, Hkv, D, 2, B}, Q.data(), k, v, 0, len, &sel, sparse.data());
  Attention(kTwo, AttentionParams{H, Hkv, D, 1, 1}, Q.data(), k, v, 0, len, nullptr, dense.data());
  CHECK(sparse == dense);
}

}  // namespace
}  // namespace m3
