// Machine limits the benchmarks judge their results against, measured in the same run:
//
//   read bandwidth   StreamRead over a buffer >= 8x L3 (1 GiB at least), every read pattern
//                    (one to four streams per thread, with and without software prefetch), split
//                    over the same threads as the work, as a GEMV splits its row tiles; the limit
//                    is the fastest pattern's
//   int8 peak        Int8PeakLoop on every thread at once, rates summed
//   fp32 FMA peak    FmaPeakLoop likewise
//
// Other processes only ever lower a probe, so a probe's best sample is the machine at its
// quietest; work is judged against reads paired with it (PairedSamples) where the bench can take
// them, with the best sample reported beside. A limit is a limit: work measured above it means
// the probe missed a faster way to read (or compute), and the bench prints that instead of a
// ratio (LimitRatio). Shared by
// `m3 bench --kernels` (kernel_bench.cc) and the end-to-end `m3 bench` (model_bench.cc).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <iterator>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "bench/bandwidth.h"
#include "platform/parallel.h"

namespace m3::bench {

using Clock = std::chrono::steady_clock;
inline double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
double Median(std::vector<double> v);  // 0 for none

std::string CpuModel();  // "model name" of /proc/cpuinfo
size_t L3Bytes();
// The L3 that cpu0 shares with its neighbours (sysfs cache index of level 3; L3Bytes() when
// absent). sysconf's figure can be the whole host's: on the 2-core Zen 4 VM it says 320 MiB
// where cpu0 sees one 32 MiB L3. For sizing reads that must evict the cache.
size_t SharedL3Bytes();
uint64_t MemAvailable();  // bytes this process can still get, cgroup limits included (AvailableMemoryBytes); 0 when unknown
// Bytes of the read-bandwidth probe buffer: >= 8x L3 so no sample is served from cache; 1 GiB at least.
size_t ReadProbeBytes(size_t l3);

// An anonymous mapping with a huge-page hint; the caller writes it before timing (on VMs the
// first read of fresh memory is several times slower than later ones).
class BigBuffer {
 public:
  explicit BigBuffer(size_t bytes);  // throws std::bad_alloc
  BigBuffer(const BigBuffer&) = delete;
  BigBuffer& operator=(const BigBuffer&) = delete;
  ~BigBuffer();
  uint8_t* data() { return data_; }
  size_t size() const { return bytes_; }
  // Writes every page, split over `threads` like the reads (first touch on NUMA).
  void Fill(int threads);

 private:
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

// The read patterns in the order the probes cycle through them (sample i uses ReadPatternAt(i)).
inline ReadPattern ReadPatternAt(size_t i) {
  return kAllReadPatterns[i % std::size(kAllReadPatterns)];
}
const char* PatternName(ReadPattern p);

// Work against its limit: the ratio when it is at most 1, otherwise none and why. Above 1 the
// probe is not the limit of that work (it read or computed less than the work did), and a
// ratio that reads "at the limit" would hide the gap.
struct LimitRatio {
  bool valid = false;
  double ratio = 0;       // work / limit when valid
  std::string note;       // why there is no ratio (empty when valid)
};
LimitRatio RatioToLimit(double work, double limit, const char* limit_name);

// Reads bytes [offset, offset + bytes) of buf with `threads` threads (one contiguous slice each,
// one parallel region); returns the seconds.
double TimedRead(BigBuffer& buf, size_t offset, size_t bytes, int threads, ReadPattern pattern);

// Read bandwidth samples in GB/s: `reps` passes over buf (after one warm-up pass; the first
// read of freshly written memory is several times slower on VMs), each timed in chunks of
// `chunk` bytes, the chunks cycling through the read patterns. Chunks the size of one
// matrix give samples at the time scale of one kernel call; the buffer as a whole (>= 8x L3)
// keeps every chunk cold. Returns the samples of each pattern.
std::map<ReadPattern, std::vector<double>> MeasureReadBandwidth(BigBuffer& buf, size_t chunk, int threads,
                                                                      int reps);

// Runs loop(iterations) -> operations on every thread at once for ~seconds each; returns one
// sample per rep: the per-thread rates summed, in GOP/s. iters[t] (0: not yet) keeps each
// thread's calibrated iteration count between calls.
template <class Loop>
std::vector<double> MeasurePeak(int threads, double seconds, int reps, std::vector<size_t>& iters, Loop&& loop) {
  const ThreadConfig tc{threads};
  std::vector<double> rates(static_cast<size_t>(threads)), totals;
  iters.resize(static_cast<size_t>(threads), 0);
  for (int r = 0; r < reps; ++r) {
    ParallelFor(tc, static_cast<size_t>(threads), 1, [&](size_t b, size_t e, int) {
      for (size_t t = b; t < e; ++t) {
        if (iters[t] == 0) {  // calibrate: double until a run takes >= seconds / 8
          size_t n = 1024;
          for (;;) {
            const auto t0 = Clock::now();
            loop(n);
            const double dt = Seconds(t0, Clock::now());
            if (dt >= seconds / 8 || n >= (size_t{1} << 40)) {
              iters[t] = std::max<size_t>(1, static_cast<size_t>(static_cast<double>(n) * seconds / std::max(dt, 1e-9)));
              break;
            }
            n *= 2;
          }
        }
        const auto t0 = Clock::now();
        const double ops = loop(iters[t]);
        rates[t] = ops / Seconds(t0, Clock::now()) / 1e9;
      }
    });
    double total = 0;
    for (double v : rates) total += v;
    totals.push_back(total);
  }
  return totals;
}

// The int8 dot-product peak (peak_probe.cc): runs the fastest int8 dot-product instruction of
// this CPU's quant kernels (vpdpbusd on 16 independent accumulators when AVX-512 VNNI is present;
// on ARM usmmla with i8mm, else sdot, likewise; else the best Highway target's sequence) from
// registers only, n times; returns the int8 operations performed (2 per multiply-add).
double Int8PeakLoop(size_t n);
// The same for Intel AMX's tdpbsud (four independent accumulator tiles), which the prompt
// matmuls use where present: the int8 operations performed, 0 without AMX.
double AmxInt8PeakLoop(size_t n);
double FmaLoop(size_t n);  // FmaPeakLoop as operations

// The samples of one limit (GB/s or GOP/s) from one or more calls below; the limit is the best.
struct ProbeResult {
  double best = 0;
  std::string pattern;  // read bandwidth: the pattern of the best sample
  std::vector<double> samples;
  double median() const { return Median(samples); }
  void Merge(const ProbeResult& other);
};
// Work samples (GB/s) each paired with a read-probe sample taken right next to it: as many cold
// bytes right after the call, or the cache-evicting read right before it. The host of a shared
// VM switches between bandwidth regimes for seconds to minutes at a time (the 2-core Zen 4 VM:
// about 33 and about 58 GB/s with 2 threads), so the read taken at the same moment is the limit
// that matches a call; the run's best sample may come from the other regime. Pairs are kept per
// read pattern and judged by the fastest pattern's, as the limits are.
class PairedSamples {
 public:
  // work_gbps < 0: a read with no work of its own (it counts towards the limit only).
  void Add(ReadPattern pattern, double read_gbps, double work_gbps = -1);
  void Clear() { pairs_.clear(); }

  struct Summary {
    double read_gbps = 0;     // the fastest pattern's median read: the limit
    const char* pattern = "";
    size_t pairs = 0;         // that pattern's reads paired with work
    double ratio = 0;         // median of work / read over those pairs
    // The pairs whose read is >= kFastRegime x the median read: the host's fast regime. They
    // show whether the work keeps up when the machine gives more (ratio 0: no such pairs).
    size_t fast_pairs = 0;
    double fast_ratio = 0;
  };
  static constexpr double kFastRegime = 1.3;
  Summary Summarize() const;

 private:
  std::map<ReadPattern, std::vector<std::pair<double, double>>> pairs_;  // (read, work)
};

// Read bandwidth over a fresh ReadProbeBytes(L3Bytes()) buffer (freed on return) in 16 MiB
// chunks (about one expert matrix), `reps` passes.
ProbeResult ProbeReadBandwidth(int threads, int reps);
ProbeResult ProbeInt8Peak(int threads, double seconds, int reps);

}  // namespace m3::bench
