// The GPU query (offload/gpu.h) on whatever machine runs the tests: a build without CUDA says so,
// a CUDA build without a usable device says why, and a device is described sanely.
#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include <catch2/catch.hpp>

#include "offload/device.h"
#include "offload/gpu.h"
#include "offload/host_device.h"
#include "packed_weights.h"

namespace m3 {
namespace {

TEST_CASE("the GPU query says what it found, or why there is none", "[offload]") {
  const StatusOr<GpuInfo> gpu = QueryGpu(0);
  if (std::string(GpuBackendName()).empty()) {
    REQUIRE(!gpu.ok());
    CHECK(gpu.status().code() == StatusCode::kUnsupported);
    CHECK_THAT(gpu.status().message(), Catch::StartsWith("this build of m3 has no CUDA"));
    return;
  }
  CHECK(std::string(GpuBackendName()) == "cuda");
  if (!gpu.ok()) {  // no device or driver here: a reason, not a crash
    CHECK(gpu.status().code() == StatusCode::kNotFound);
    CHECK_THAT(gpu.status().message(), Catch::StartsWith("no usable CUDA device: "));
    WARN("CUDA build without a usable device: " << gpu.status().message());
    return;
  }
  CHECK(!gpu->name.empty());
  CHECK(gpu->compute_major > 0);
  CHECK(gpu->total_bytes > 0);
  CHECK(gpu->free_bytes <= gpu->total_bytes);
  CHECK(QueryGpu(-1).status().code() == StatusCode::kInvalidArgument);
  CHECK(QueryGpu(1 << 20).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace m3

// ---- The device layout and the device operations (offload/device.h). ----
namespace m3 {
namespace {

using simd::WeightFormat;

// A weight of `rows` x `cols` in any format, with random values (and codes: MXFP8 gets random
// E4M3 codes, none NaN, and scales around 2^0).
struct AnyWeight {
  test::PackedWeights packed;
  std::vector<uint16_t> half;
  std::vector<uint8_t> bytes, scales;
  simd::WeightRef Make(WeightFormat f, size_t rows, size_t cols, uint32_t seed) {
    if (f == WeightFormat::kF32 || simd::IsTiled(f)) return packed.Random(f, rows, cols, seed, 0.5f);
    std::mt19937 rng(seed);
    simd::WeightRef w{f, nullptr, nullptr, rows, cols};
    if (f == WeightFormat::kE4M3Mx32) {
      bytes.resize(rows * cols);
      for (auto& b : bytes) {
        b = static_cast<uint8_t>(rng() & 0xFF);
        if ((b & 0x7F) == 0x7F) b = 0x38;
      }
      scales.resize(rows * w.scale_cols());
      for (auto& s : scales) s = static_cast<uint8_t>(120 + rng() % 15);
      w.data = bytes.data();
      w.scales = scales.data();
      return w;
    }
    const std::vector<float> v = test::RandomVec(rows * cols, seed, 0.5f);
    half.resize(rows * cols);
    for (size_t i = 0; i < v.size(); ++i) half[i] = f == WeightFormat::kBF16 ? simd::F32ToBf16(v[i]) : simd::F32ToF16(v[i]);
    w.data = half.data();
    return w;
  }
};

constexpr WeightFormat kAllFormats[] = {WeightFormat::kF32,       WeightFormat::kBF16, WeightFormat::kF16,
                                        WeightFormat::kE4M3Mx32,  WeightFormat::kQ8,   WeightFormat::kQ4,
                                        WeightFormat::kBF16Tiled};

TEST_CASE("the device layout holds every weight format exactly, padding decoding to zero", "[offload]") {
  for (const WeightFormat f : kAllFormats)
    for (const size_t cols : {32, 48, 100, 256}) {
      if (simd::IsTiled(f) && cols % 8) continue;  // the packer's inputs
      AnyWeight any;
      const simd::WeightRef w = any.Make(f, 37, cols, static_cast<uint32_t>(cols) * 7 + static_cast<uint32_t>(f));
      const DeviceLayout l = DeviceLayoutFor(w);
      INFO(simd::WeightFormatName(f) << " cols " << cols << " as " << DeviceFormatName(l.format));
      REQUIRE(l.padded_cols % kDeviceGroup == 0);
      REQUIRE(l.row_bytes % 16 == 0);
      std::vector<uint8_t> codes(l.code_bytes);
      std::vector<float> scales(l.rows * l.scale_cols());
      // In two runs of rows, as a bounded staging buffer converts them.
      ConvertRows(w, l, 0, 20, codes.data(), scales.data());
      ConvertRows(w, l, 20, 37, codes.data() + 20 * l.row_bytes, scales.data() + 20 * l.scale_cols());
      size_t mismatches = 0;
      for (size_t r = 0; r < w.rows; ++r)
        for (size_t c = 0; c < l.padded_cols; ++c) {
          const float got = DeviceWeightAt(l, codes.data(), scales.data(), r, c);
          const float want = c < cols ? simd::WeightAt(w, r, c) : 0.0f;
          mismatches += std::memcmp(&got, &want, 4) != 0 && !(got == 0 && want == 0);
        }
      CHECK(mismatches == 0);
      if (IsDeviceVerbatim(w)) CHECK(std::memcmp(codes.data(), w.data, l.code_bytes) == 0);
    }
}

using test::RelDiff;

// One operation run on `dev` and on the host reference from the same inputs.
class OpCompare {
 public:
  explicit OpCompare(Device& dev) : dev_(dev), host_(MakeHostDevice()) {}
  ~OpCompare() {
    for (void* p : owned_) dev_.Free(p);
  }
  // A device copy of v.
  template <class T>
  T* Put(const std::vector<T>& v) {
    auto p = dev_.Allocate(std::max<size_t>(v.size(), 1) * sizeof(T), "test");
    REQUIRE(p.ok());
    owned_.push_back(*p);
    dev_.ToDevice(*p, v.data(), v.size() * sizeof(T));
    return static_cast<T*>(*p);
  }
  template <class T>
  std::vector<T> Get(const T* p, size_t n) {
    std::vector<T> v(n);
    dev_.ToHost(v.data(), p, n * sizeof(T));
    REQUIRE(dev_.Wait().ok());
    return v;
  }
  Device& host() { return *host_; }

 private:
  Device& dev_;
  std::unique_ptr<Device> host_;
  std::vector<void*> owned_;
};

void CompareOperations(Device& dev) {
  OpCompare cmp(dev);
  Device& host = cmp.host();
  SECTION("matmul: every format, one to 70 tokens, tails, accumulating") {
    for (const WeightFormat f : kAllFormats)
      for (const size_t cols : {64, 200, 1056})
        for (const size_t n : {1, 2, 3, 8, 9, 70}) {
          if (simd::IsTiled(f) && cols % 8) continue;
          AnyWeight any;
          const simd::WeightRef w = any.Make(f, 83, cols, static_cast<uint32_t>(n * 131 + cols));
          auto dm = dev.Upload(w, "test matrix");
          auto hm = host.Upload(w, "test matrix");
          REQUIRE(dm.ok());
          REQUIRE(hm.ok());
          const std::vector<float> x = test::RandomVec(n * cols, 5, 1.0f);
          std::vector<float> y0 = test::RandomVec(n * 90, 6, 1.0f);
          for (const bool acc : {false, true}) {
            float* dx = cmp.Put(x);
            float* dy = cmp.Put(y0);
            dev.MatMul(*dm, dx, n, dy, 90, acc);
            std::vector<float> want = y0;
            host.MatMul(*hm, x.data(), n, want.data(), 90, acc);
            const auto got = cmp.Get(dy, y0.size());
            INFO(simd::WeightFormatName(f) << " cols " << cols << " tokens " << n << " accumulate " << acc);
            CHECK(RelDiff(got.data(), want.data(), got.size()) < 1e-5);
          }
          dev.Free(dm->codes);
          if (dm->scales) dev.Free(dm->scales);
          host.Free(hm->codes);
          if (hm->scales) host.Free(hm->scales);
        }
  }
  SECTION("several matrices of one input at once, as the projections of one layer") {
    for (const WeightFormat f : {WeightFormat::kQ8, WeightFormat::kBF16, WeightFormat::kF32})
      for (const size_t n : {1, 3}) {
        AnyWeight any[3];
        const size_t rows[3] = {300, 40, 9};
        std::vector<DeviceMatrix> dm, hm;
        for (int i = 0; i < 3; ++i) {
          // The last in another format: one launch for the others is not possible then.
          const WeightFormat fi = i == 2 && f == WeightFormat::kQ8 ? WeightFormat::kF32 : f;
          const simd::WeightRef w = any[i].Make(fi, rows[i], 192, static_cast<uint32_t>(40 + i));
          dm.push_back(*dev.Upload(w, "test"));
          hm.push_back(*host.Upload(w, "test"));
        }
        const std::vector<float> x = test::RandomVec(n * 192, 41, 1.0f);
        std::vector<float> want(n * 349, 0.5f);
        float* dx = cmp.Put(x);
        float* dy = cmp.Put(want);
        const size_t at[3] = {0, 300, 340};
        std::vector<Device::MatMulJob> djobs, hjobs;
        for (int i = 0; i < 3; ++i) {
          djobs.push_back({&dm[static_cast<size_t>(i)], dy + at[i], 349, i == 1});
          hjobs.push_back({&hm[static_cast<size_t>(i)], want.data() + at[i], 349, i == 1});
        }
        dev.MatMulMany(djobs.data(), 3, dx, n);
        host.MatMulMany(hjobs.data(), 3, x.data(), n);
        INFO(simd::WeightFormatName(f) << " tokens " << n);
        CHECK(RelDiff(cmp.Get(dy, want.size()).data(), want.data(), want.size()) < 1e-5);
        for (size_t i = 0; i < 3; ++i) {
          dev.Free(dm[i].codes);
          if (dm[i].scales) dev.Free(dm[i].scales);
          host.Free(hm[i].codes);
          if (hm[i].scales) host.Free(hm[i].scales);
        }
      }
  }
  SECTION("norms, RoPE, SwiGLU, add") {
    const size_t n = 5, heads = 3, dim = 96, rot = 64;
    std::vector<float> x = test::RandomVec(n * heads * dim, 11, 2.0f);
    const std::vector<float> scale = test::RandomVec(dim, 12, 1.0f);
    const std::vector<float> rope = test::RandomVec(n * rot, 13, 1.0f);
    float* dx = cmp.Put(x);
    float* ds = cmp.Put(scale);
    float* dr = cmp.Put(rope);
    float* dy = cmp.Put(std::vector<float>(x.size()));
    dev.RmsNorm(dx, nullptr, n * heads, dim, ds, 1e-6f, dy, {});
    std::vector<float> want(x.size());
    host.RmsNorm(x.data(), nullptr, n * heads, dim, scale.data(), 1e-6f, want.data(), {});
    CHECK(RelDiff(cmp.Get(dy, want.size()).data(), want.data(), want.size()) < 1e-6);
    {  // with a block's output added to the rows first: both the rows and the norm
      const std::vector<float> delta = test::RandomVec(x.size(), 16, 1.0f);
      std::vector<float> h = x, y(x.size());
      float* dh = cmp.Put(h);
      dev.RmsNorm(dh, cmp.Put(delta), n * heads, dim, ds, 1e-6f, dy, {});
      host.RmsNorm(h.data(), delta.data(), n * heads, dim, scale.data(), 1e-6f, y.data(), {});
      CHECK(RelDiff(cmp.Get(dh, h.size()).data(), h.data(), h.size()) < 1e-6);
      CHECK(RelDiff(cmp.Get(dy, y.size()).data(), y.data(), y.size()) < 1e-6);
    }
    {  // several vectors' jobs in one call, as q, k and the indexer's q and k
      std::vector<float> a = test::RandomVec(n * 4 * dim, 17, 1.0f), b2 = test::RandomVec(n * 1 * dim, 18, 1.0f),
                         c2 = test::RandomVec(n * 2 * dim, 19, 1.0f);
      float* da = cmp.Put(a);
      float* db = cmp.Put(b2);
      float* dc = cmp.Put(c2);
      const Device::NormRopeJob djobs[] = {{da, 4, dim, ds, {}}, {db, 1, dim, nullptr, {}}, {dc, 2, dim, ds, {}}};
      const Device::NormRopeJob hjobs[] = {
          {a.data(), 4, dim, scale.data(), {}}, {b2.data(), 1, dim, nullptr, {}}, {c2.data(), 2, dim, scale.data(), {}}};
      dev.NormRope(djobs, 3, n, 1e-6f, dr, rot);
      host.NormRope(hjobs, 3, n, 1e-6f, rope.data(), rot);
      CHECK(RelDiff(cmp.Get(da, a.size()).data(), a.data(), a.size()) < 1e-6);
      CHECK(RelDiff(cmp.Get(db, b2.size()).data(), b2.data(), b2.size()) < 1e-6);
      CHECK(RelDiff(cmp.Get(dc, c2.size()).data(), c2.data(), c2.size()) < 1e-6);
    }
    for (const bool with_norm : {false, true}) {
      std::vector<float> h = x;
      float* dh = cmp.Put(h);
      const Device::NormRopeJob dj{dh, heads, dim, with_norm ? ds : nullptr, {}};
      dev.NormRope(&dj, 1, n, 1e-6f, dr, rot);
      const Device::NormRopeJob hj{h.data(), heads, dim, with_norm ? scale.data() : nullptr, {}};
      host.NormRope(&hj, 1, n, 1e-6f, rope.data(), rot);
      CHECK(RelDiff(cmp.Get(dh, h.size()).data(), h.data(), h.size()) < 1e-6);
    }
    std::vector<float> g = test::RandomVec(x.size(), 14, 10.0f), u = test::RandomVec(x.size(), 15, 10.0f);
    g[3] = NAN, u[7] = INFINITY;
    float* dg = cmp.Put(g);
    float* du = cmp.Put(u);
    dev.Swiglu(dg, du, g.size(), DeviceSwiglu{});
    host.Swiglu(g.data(), u.data(), g.size(), DeviceSwiglu{});
    const auto got = cmp.Get(dg, g.size());
    CHECK(std::isnan(got[3]));
    CHECK(std::isnan(got[7]));
    g[3] = g[7] = 0;
    std::vector<float> got_finite = got;
    got_finite[3] = got_finite[7] = 0;
    CHECK(RelDiff(got_finite.data(), g.data(), g.size()) < 1e-6);
    dev.Add(dx, x.size(), du);
    host.Add(x.data(), x.size(), u.data());
    std::vector<float> sum = cmp.Get(du, u.size());
    sum[7] = u[7] = 0;
    CHECK(RelDiff(sum.data(), u.data(), u.size()) < 1e-6);
  }
  SECTION("indexer block scores and attention, dense and over selected blocks") {
    const size_t rows = 300, B = 16, Hi = 2, Di = 32, H = 8, Hkv = 2, D = 64, topk = 3;
    const size_t n = 20;
    const int64_t pos0 = static_cast<int64_t>(rows - n);
    const std::vector<float> keys = test::RandomVec(rows * Di, 21, 1.0f), iq = test::RandomVec(n * Hi * Di, 22, 1.0f);
    const size_t blocks = (rows - 1) / B + 1;
    float* dk = cmp.Put(keys);
    float* dq = cmp.Put(iq);
    float* dsc = cmp.Put(std::vector<float>(n * Hi * blocks));
    dev.IndexScores(dq, n, pos0, dk, Hi, Di, B, blocks, dsc);
    std::vector<float> want(n * Hi * blocks);
    host.IndexScores(iq.data(), n, pos0, keys.data(), Hi, Di, B, blocks, want.data());
    const auto got = cmp.Get(dsc, want.size());
    CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);  // the same fma order

    const std::vector<float> K = test::RandomVec(rows * Hkv * D, 23, 1.0f), V = test::RandomVec(rows * Hkv * D, 24, 1.0f);
    const std::vector<float> Q = test::RandomVec(n * H * D, 25, 1.0f);
    std::vector<int32_t> sel(n * Hi * topk), counts(n * Hi);
    for (size_t t = 0; t < n; ++t)
      for (size_t h = 0; h < Hi; ++h) {
        const int32_t last = static_cast<int32_t>((static_cast<size_t>(pos0) + t) / B);
        const int32_t picks[] = {0, static_cast<int32_t>(3 + (t + h) % 5), last};
        counts[t * Hi + h] = 3;
        std::copy(picks, picks + 3, &sel[(t * Hi + h) * topk]);
      }
    float* dK = cmp.Put(K);
    float* dV = cmp.Put(V);
    float* dQ = cmp.Put(Q);
    int32_t* dsel = cmp.Put(sel);
    int32_t* dcount = cmp.Put(counts);
    for (const bool sparse : {false, true}) {
      DeviceAttentionShape s{static_cast<int>(H), static_cast<int>(Hkv), static_cast<int>(D), 1, 1, 1};
      if (sparse) s.index_heads = static_cast<int>(Hi), s.block_size = static_cast<int>(B), s.topk = static_cast<int>(topk);
      float* dout = cmp.Put(std::vector<float>(n * H * D));
      dev.Attention(s, dQ, n, pos0, dK, dV, sparse ? dsel : nullptr, sparse ? dcount : nullptr, dout);
      std::vector<float> out(n * H * D);
      host.Attention(s, Q.data(), n, pos0, K.data(), V.data(), sparse ? sel.data() : nullptr,
                     sparse ? counts.data() : nullptr, out.data());
      INFO("sparse " << sparse);
      CHECK(RelDiff(cmp.Get(dout, out.size()).data(), out.data(), out.size()) < 1e-5);
    }
  }
  SECTION("the non-finite flag keeps the first stage and row") {
    std::vector<float> x(4 * 10, 1.0f);
    x[23] = NAN;
    float* dx = cmp.Put(x);
    uint64_t* flag = cmp.Put(std::vector<uint64_t>{~uint64_t{0}});
    dev.FlagNonFinite(dx, 4, 10, 7, flag);
    CHECK(cmp.Get(flag, 1)[0] == (uint64_t{7} << 40 | 2));
    dev.FlagNonFinite(dx, 4, 10, 3, flag);
    CHECK(cmp.Get(flag, 1)[0] == (uint64_t{3} << 40 | 2));
    dev.FlagNonFinite(dx, 2, 10, 1, flag);  // rows 0 and 1 are finite
    CHECK(cmp.Get(flag, 1)[0] == (uint64_t{3} << 40 | 2));
    // Folded into the norms: RmsNorm checks its input rows, NormRope its output per token.
    const std::vector<float> ones(10, 1.0f), rope(4 * 4, 0.5f);
    float* scale = cmp.Put(ones);
    float* y = cmp.Put(std::vector<float>(x.size()));
    dev.RmsNorm(dx, nullptr, 4, 10, scale, 1e-6f, y, {flag, 2});
    CHECK(cmp.Get(flag, 1)[0] == (uint64_t{2} << 40 | 2));
    const Device::NormRopeJob job{dx, 2, 10, scale, {flag, 1}};  // tokens of 2 x 10: x[23] is token 1's
    dev.NormRope(&job, 1, 2, 1e-6f, cmp.Put(rope), 8);
    CHECK(cmp.Get(flag, 1)[0] == (uint64_t{1} << 40 | 1));
    dev.RmsNorm(dx, nullptr, 2, 10, scale, 1e-6f, y, {flag, 0});  // rows 0 and 1 are finite
    CHECK(cmp.Get(flag, 1)[0] == (uint64_t{1} << 40 | 1));
  }
}

TEST_CASE("every device operation computes what the host reference does", "[offload]") {
  SECTION("the host device against itself (the comparison's own check)") {
    std::unique_ptr<Device> host = MakeHostDevice();
    CompareOperations(*host);
  }
  SECTION("the GPU") {
    auto gpu = OpenGpuDevice(0);
    if (!gpu.ok()) {
      WARN("SKIPPED: no GPU to compare: " << gpu.status().message());
      return;
    }
    INFO((*gpu)->Describe());
    CompareOperations(**gpu);
  }
}

}  // namespace
}  // namespace m3
