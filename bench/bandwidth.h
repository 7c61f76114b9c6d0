// Machine-limit probes for the benchmarks (m3 bench --kernels): the memory read bandwidth a
// stream of vector loads reaches, and the fp32 FMA throughput of one core. Highway code like the kernels, dispatched at run time
// like every other kernel; the caller does the timing and the threading.
#pragma once

#include <cstddef>
#include <cstdint>

namespace m3::bench {

// How StreamRead walks the buffer. Which is fastest depends on the CPU and the thread count, so a
// bandwidth limit is the best of them all (the kernels read in each of these ways somewhere): on a
// Cascade Lake VM four prefetched quarters read ~10% faster than one stream; on Zen 4 one plain
// stream reads ~30% faster (L1 software prefetches of several streams hold its hardware streamer
// back); on a Zen 5 VM, one thread, two plain streams 41 GB/s, one stream 37, one stream
// prefetched into L2 40, four prefetched quarters 23 (2 threads: 46-50 for all but the quarters).
enum class ReadPattern {
  kSequential,          // front to back, four independent accumulators, no software prefetch
  kQuartersPrefetched,  // four quarters in lockstep, each prefetched 1 KiB ahead into L1
  kHalves,              // two halves in lockstep, no software prefetch
  kSequentialPrefetchL2 // front to back, each line prefetched 8 KiB ahead into L2 (as the q4 GEMV)
};
inline constexpr ReadPattern kAllReadPatterns[] = {ReadPattern::kSequential, ReadPattern::kQuartersPrefetched,
                                                   ReadPattern::kHalves, ReadPattern::kSequentialPrefetchL2};

// Reads bytes [p, p + n) with full-width vector loads and returns the wrapping sum of the
// buffer's 64-bit words (a trailing n % 8 bytes are added as one zero-padded word), which keeps
// the loads from being optimised away; equal to ref::StreamRead for either pattern. p needs no
// alignment; 64-byte aligned reads are fastest.
uint64_t StreamRead(const void* p, size_t n, ReadPattern pattern = ReadPattern::kSequential);

// Runs `iterations` rounds of 12 independent vector fused multiply-adds on fp32 lanes (enough
// chains to cover 4-cycle latency on two FMA ports) and returns the floating-point operations
// performed (2 per lane per FMA). The final accumulator sum goes to *sink so the work stays.
uint64_t FmaPeakLoop(size_t iterations, float* sink);

namespace ref {
uint64_t StreamRead(const void* p, size_t n);
}  // namespace ref

}  // namespace m3::bench
