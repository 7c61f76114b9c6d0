// bench/limits.h: PairedSamples (the limit and ratios the benchmarks judge memory-bound work by)
// and the int8 peak probes.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "bench/limits.h"
#include "simd/kernel_table.h"

using m3::bench::PairedSamples;
using m3::bench::ReadPattern;

TEST_CASE("PairedSamples judges work by the faster pattern's median read, pair by pair", "[bench]") {
  PairedSamples p;
  // Sequential reads at 30 (slow regime) and 60 GB/s (fast regime); work at 0.9 and 0.7 of them.
  for (int i = 0; i < 5; ++i) p.Add(ReadPattern::kSequential, 30, 27);
  for (int i = 0; i < 2; ++i) p.Add(ReadPattern::kSequential, 60, 42);
  p.Add(ReadPattern::kSequential, 31);  // a read with no work: counts towards the limit only
  // The other pattern is slower: its pairs are not used.
  for (int i = 0; i < 9; ++i) p.Add(ReadPattern::kQuartersPrefetched, 20, 19);
  const PairedSamples::Summary s = p.Summarize();
  CHECK(s.read_gbps == 30);  // median of 30 x5, 31, 60 x2
  CHECK(std::string(s.pattern) == "sequential");
  CHECK(s.pairs == 7);
  CHECK(s.ratio == Approx(0.9));
  CHECK(s.fast_pairs == 2);  // 60 >= 1.3 x 30
  CHECK(s.fast_ratio == Approx(0.7));

  p.Clear();
  const PairedSamples::Summary none = p.Summarize();
  CHECK(none.read_gbps == 0);
  CHECK(none.pairs == 0);
  CHECK(none.fast_pairs == 0);
  CHECK(none.fast_ratio == 0);
}

TEST_CASE("RatioToLimit gives a ratio up to 1 and says why above it", "[bench]") {
  using m3::bench::RatioToLimit;
  const auto at = RatioToLimit(45, 50, "paired read bandwidth");
  CHECK(at.valid);
  CHECK(at.ratio == Approx(0.9));
  CHECK(at.note.empty());
  CHECK(RatioToLimit(50, 50, "x").valid);  // exactly at the limit is still a ratio
  const auto above = RatioToLimit(51, 50, "paired read bandwidth");
  CHECK_FALSE(above.valid);
  CHECK(above.note.find("paired read bandwidth") != std::string::npos);
  CHECK(above.note.find("not the limit") != std::string::npos);
  CHECK_FALSE(RatioToLimit(10, 0, "x").valid);  // no limit measured
  CHECK_FALSE(RatioToLimit(NAN, 50, "x").valid);
}

TEST_CASE("the int8 peak probes run and count a fixed number of operations per iteration", "[bench]") {
  using m3::bench::AmxInt8PeakLoop;
  using m3::bench::Int8PeakLoop;
  const double ops = Int8PeakLoop(1000);
  CHECK(ops > 0);
  CHECK(Int8PeakLoop(3000) == 3 * ops);
  // Per iteration: 16 vpdpbusd (VNNI), 12 maddubs + madd at 512 or 256 bits, 16 usmmla or 16
  // sdot (ARM, as the kernels take them: tests/cross_arm64.sh runs this on CPUs with both, sdot
  // only and neither), or 8 int32 multiply-adds per lane of a portable target.
  const double per = ops / 1000;
  const std::vector<std::string> kernels = m3::simd::KernelNames();
  const auto has = [&](const char* name) { return std::find(kernels.begin(), kernels.end(), name) != kernels.end(); };
  if (has("avx512-vnni")) {
    CHECK(per == 16 * 64 * 2);
  } else if (has("neon-i8mm")) {
    CHECK(per == 16 * 32 * 2);
  } else if (has("neon-dotprod")) {
    CHECK(per == 16 * 16 * 2);
  } else {
    CHECK((per == 12 * 64 * 2 || per == 12 * 32 * 2 || std::fmod(per, 8 * 2) == 0));
  }
  const double amx = AmxInt8PeakLoop(100);  // four tdpbsud per iteration, or nothing without AMX
  CHECK((amx == 0 || amx == 100.0 * 4 * 16 * 16 * 64 * 2));
  const m3::bench::ProbeResult peak = m3::bench::ProbeInt8Peak(1, 0.01, 2);
  CHECK(peak.samples.size() == 2);
  CHECK(peak.best > 0);
}
