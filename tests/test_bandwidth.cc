// The benchmark probes of simd/bandwidth.h: StreamRead sums exactly what its reference sums on
// every compiled target, for any length and alignment; FmaPeakLoop counts its operations.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "bench/bandwidth.h"
#include "simd/kernels.h"

namespace m3::bench {
namespace {

template <class Fn>
void ForEachTarget(Fn&& fn) {
  for (int64_t t : simd::RunnableTargets()) {
    simd::ForceTargetForTest(t);
    INFO("target " << simd::TargetName(t));
    fn();
  }
  simd::ForceTargetForTest(0);
}

TEST_CASE("StreamRead equals its reference for every length, offset and pattern", "[bandwidth]") {
  std::vector<uint8_t> buf(70000);
  std::mt19937_64 rng(3);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  ForEachTarget([&] {
    for (size_t offset : {0, 1, 8, 64}) {
      for (size_t n : {0, 1, 7, 8, 9, 63, 64, 255, 256, 257, 1000, 4096, 65536 + 24}) {
        for (ReadPattern pattern : kAllReadPatterns) {
          INFO("offset " << offset << " n " << n << " pattern " << static_cast<int>(pattern));
          CHECK(StreamRead(buf.data() + offset, n, pattern) == ref::StreamRead(buf.data() + offset, n));
        }
      }
    }
  });
}

TEST_CASE("FmaPeakLoop reports two operations per lane per FMA and a finite result", "[bandwidth]") {
  ForEachTarget([&] {
    float sink = 0;
    const uint64_t ops = FmaPeakLoop(1000, &sink);
    CHECK(ops > 0);
    CHECK(ops % (1000 * 12 * 2) == 0);
    CHECK(std::isfinite(sink));
    CHECK(sink > 0);
  });
}

}  // namespace
}  // namespace m3::bench
