// Highway implementations of bandwidth.h, compiled once per SIMD target and dispatched at run time.
//
// StreamRead on a shared 2-core Cascade Lake VM, 1 GiB, one thread, best of 30: one front-to-back
// stream 11.5 GB/s; 2, 4 or 8 interleaved streams without prefetch 11.6-12.6; 4 or 8 streams with
// software prefetch 0.5-4 KiB ahead 12.4-13.0. On a 2-core Zen 4 VM, 3 GiB, paired 16 MiB chunks:
// one stream ~29 GB/s, four prefetched quarters 17-24 GB/s. Hence several patterns (ReadPattern).
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/bandwidth.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "bench/bandwidth.h"

HWY_BEFORE_NAMESPACE();
namespace m3::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Tail words [i, end) of one stream, through memcpy (any alignment).
uint64_t SumWords(const uint8_t* bytes, size_t i, size_t end) {
  uint64_t sum = 0;
  for (; i < end; ++i) {
    uint64_t v;
    std::memcpy(&v, bytes + 8 * i, 8);
    sum += v;
  }
  return sum;
}

uint64_t StreamReadImpl(const void* p, size_t n, ReadPattern pattern) {
  const hn::ScalableTag<uint64_t> d;
  const size_t N = hn::Lanes(d);
  const uint8_t* bytes = static_cast<const uint8_t*>(p);
  const size_t words = n / 8;
  size_t done = 0;  // words [0, done) covered by the vector loops
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  // Word loads through uint64_t pointers need 8-byte alignment; unaligned callers (never the
  // benchmark) go through memcpy.
  if (reinterpret_cast<uintptr_t>(p) % alignof(uint64_t) == 0) {
    const uint64_t* w = reinterpret_cast<const uint64_t*>(bytes);
    switch (pattern) {
      case ReadPattern::kSequential:
      case ReadPattern::kSequentialPrefetchL2: {
        const bool prefetch = pattern == ReadPattern::kSequentialPrefetchL2;
        constexpr size_t kPrefetchBytes = 8192;
        const size_t whole = words / (4 * N) * (4 * N);
        for (size_t i = 0; i < whole; i += 4 * N) {
          if (prefetch)  // every 64-byte line of the next four vectors, 8 KiB ahead
            for (size_t b = 0; b < 4 * N * 8; b += 64)
              __builtin_prefetch(reinterpret_cast<const uint8_t*>(w + i) + kPrefetchBytes + b, 0, 2);
          a0 = hn::Add(a0, hn::LoadU(d, w + i));
          a1 = hn::Add(a1, hn::LoadU(d, w + i + N));
          a2 = hn::Add(a2, hn::LoadU(d, w + i + 2 * N));
          a3 = hn::Add(a3, hn::LoadU(d, w + i + 3 * N));
        }
        done = whole;
        break;
      }
      case ReadPattern::kHalves: {
        const size_t half = words / 2 / (2 * N) * (2 * N);
        const uint64_t *w0 = w, *w1 = w + half;
        for (size_t i = 0; i < half; i += 2 * N) {
          a0 = hn::Add(a0, hn::LoadU(d, w0 + i));
          a1 = hn::Add(a1, hn::LoadU(d, w1 + i));
          a2 = hn::Add(a2, hn::LoadU(d, w0 + i + N));
          a3 = hn::Add(a3, hn::LoadU(d, w1 + i + N));
        }
        done = 2 * half;
        break;
      }
      case ReadPattern::kQuartersPrefetched: {
        constexpr size_t kPrefetchBytes = 1024;
        const size_t quarter = words / 4 / N * N;
        const uint64_t *w0 = w, *w1 = w + quarter, *w2 = w + 2 * quarter, *w3 = w + 3 * quarter;
        for (size_t i = 0; i < quarter; i += N) {
          hwy::Prefetch(reinterpret_cast<const uint8_t*>(w0 + i) + kPrefetchBytes);
          hwy::Prefetch(reinterpret_cast<const uint8_t*>(w1 + i) + kPrefetchBytes);
          hwy::Prefetch(reinterpret_cast<const uint8_t*>(w2 + i) + kPrefetchBytes);
          hwy::Prefetch(reinterpret_cast<const uint8_t*>(w3 + i) + kPrefetchBytes);
          a0 = hn::Add(a0, hn::LoadU(d, w0 + i));
          a1 = hn::Add(a1, hn::LoadU(d, w1 + i));
          a2 = hn::Add(a2, hn::LoadU(d, w2 + i));
          a3 = hn::Add(a3, hn::LoadU(d, w3 + i));
        }
        done = 4 * quarter;
        break;
      }
    }
  }
  uint64_t sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
  sum += SumWords(bytes, done, words);
  if (n % 8) {
    uint64_t v = 0;
    std::memcpy(&v, bytes + 8 * words, n % 8);
    sum += v;
  }
  return sum;
}

uint64_t FmaPeakLoopImpl(size_t iterations, float* sink) {
  const hn::ScalableTag<float> d;
  // acc <- acc * m + a converges to a / (1 - m): values stay normal, never overflow.
  const auto m = hn::Set(d, 0.999f);
  const auto a = hn::Set(d, 1e-3f);
  auto c0 = hn::Set(d, 0.f), c1 = hn::Set(d, 1.f), c2 = hn::Set(d, 2.f), c3 = hn::Set(d, 3.f);
  auto c4 = hn::Set(d, 4.f), c5 = hn::Set(d, 5.f), c6 = hn::Set(d, 6.f), c7 = hn::Set(d, 7.f);
  auto c8 = hn::Set(d, 8.f), c9 = hn::Set(d, 9.f), c10 = hn::Set(d, 10.f), c11 = hn::Set(d, 11.f);
  for (size_t it = 0; it < iterations; ++it) {
    c0 = hn::MulAdd(c0, m, a);
    c1 = hn::MulAdd(c1, m, a);
    c2 = hn::MulAdd(c2, m, a);
    c3 = hn::MulAdd(c3, m, a);
    c4 = hn::MulAdd(c4, m, a);
    c5 = hn::MulAdd(c5, m, a);
    c6 = hn::MulAdd(c6, m, a);
    c7 = hn::MulAdd(c7, m, a);
    c8 = hn::MulAdd(c8, m, a);
    c9 = hn::MulAdd(c9, m, a);
    c10 = hn::MulAdd(c10, m, a);
    c11 = hn::MulAdd(c11, m, a);
  }
  auto s = hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)), hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)));
  s = hn::Add(s, hn::Add(hn::Add(c8, c9), hn::Add(c10, c11)));
  *sink = hn::GetLane(hn::SumOfLanes(d, s));
  return static_cast<uint64_t>(iterations) * 12 * hn::Lanes(d) * 2;
}

}  // namespace HWY_NAMESPACE
}  // namespace m3::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace m3::bench {

HWY_EXPORT(StreamReadImpl);
HWY_EXPORT(FmaPeakLoopImpl);

uint64_t StreamRead(const void* p, size_t n, ReadPattern pattern) {
  return HWY_DYNAMIC_DISPATCH(StreamReadImpl)(p, n, pattern);
}
uint64_t FmaPeakLoop(size_t iterations, float* sink) {
  return HWY_DYNAMIC_DISPATCH(FmaPeakLoopImpl)(iterations, sink);
}

namespace ref {
uint64_t StreamRead(const void* p, size_t n) {
  const uint8_t* bytes = static_cast<const uint8_t*>(p);
  uint64_t sum = 0;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = 0;
    std::memcpy(&v, bytes + i, n - i < 8 ? n - i : 8);
    sum += v;
  }
  return sum;
}
}  // namespace ref

}  // namespace m3::bench
#endif  // HWY_ONCE
