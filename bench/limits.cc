// Machine-limit probes (limits.h); the int8 peaks are in peak_probe.cc.
#include "limits.h"

#include "platform/memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <new>

#include "base/status.h"

namespace m3::bench {
namespace {

constexpr size_t kPage = 4096;
size_t RoundUp(size_t n, size_t m) { return (n + m - 1) / m * m; }

}  // namespace

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t b = line.find_first_not_of(" \t", colon + 1);
    return b == std::string::npos ? "unknown" : line.substr(b);
  }
  return "unknown";
}

size_t L3Bytes() {
  const long s = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (s > 0) return static_cast<size_t>(s);
  std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index3/size");  // "36608K"
  size_t v = 0;
  char unit = 0;
  if (in >> v >> unit) return v * (unit == 'M' ? (1u << 20) : unit == 'K' ? 1024u : 1u);
  return size_t{32} << 20;  // unknown: assume a large server L3
}

uint64_t MemAvailable() { return AvailableMemoryBytes().value_or(0); }

size_t SharedL3Bytes() {
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_in(dir + "level"), size_in(dir + "size");
    int level = 0;
    size_t v = 0;
    char unit = 0;
    if (!(level_in >> level) || level != 3) continue;
    if (size_in >> v >> unit) return v * (unit == 'M' ? (1u << 20) : unit == 'K' ? 1024u : 1u);
  }
  return L3Bytes();
}

size_t ReadProbeBytes(size_t l3) { return std::max(size_t{1} << 30, RoundUp(8 * l3, size_t{1} << 21)); }

BigBuffer::BigBuffer(size_t bytes) : bytes_(std::max<size_t>(bytes, 1)) {
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  madvise(p, bytes_, MADV_HUGEPAGE);  // best effort
  data_ = static_cast<uint8_t*>(p);
}

BigBuffer::~BigBuffer() { munmap(data_, bytes_); }

void BigBuffer::Fill(int threads) {
  ParallelFor(ThreadConfig{threads}, bytes_ / kPage, 1, [&](size_t b, size_t e, int) {
    for (size_t i = b; i < e; ++i) std::memset(data_ + i * kPage, static_cast<int>(i & 0xFF), kPage);
  });
}

const char* PatternName(ReadPattern p) {
  switch (p) {
    case ReadPattern::kSequential: return "sequential";
    case ReadPattern::kQuartersPrefetched: return "quarters-prefetched";
    case ReadPattern::kHalves: return "halves";
    case ReadPattern::kSequentialPrefetchL2: return "sequential-prefetch-l2";
  }
  return "?";
}

LimitRatio RatioToLimit(double work, double limit, const char* limit_name) {
  LimitRatio r;
  if (!(limit > 0) || !std::isfinite(work)) {
    r.note = Str("no ", limit_name, " measured");
    return r;
  }
  const double ratio = work / limit;
  if (ratio > 1.0) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "the work (%.4g) exceeded its %s (%.4g): that probe is not the limit", work,
                  limit_name, limit);
    r.note = buf;
    return r;
  }
  r.valid = true;
  r.ratio = ratio;
  return r;
}

double TimedRead(BigBuffer& buf, size_t offset, size_t bytes, int threads, ReadPattern pattern) {
  const size_t slices = static_cast<size_t>(threads), slice = RoundUp((bytes + slices - 1) / slices, 64);
  std::vector<uint64_t> sums(slices);
  const auto t0 = Clock::now();
  ParallelFor(ThreadConfig{threads}, slices, 1, [&](size_t b, size_t e, int) {
    for (size_t s = b; s < e; ++s) {
      const size_t begin = std::min(bytes, s * slice), end = std::min(bytes, begin + slice);
      sums[s] = StreamRead(buf.data() + offset + begin, end - begin, pattern);
    }
  });
  const double dt = Seconds(t0, Clock::now());
  static volatile uint64_t sink;
  for (uint64_t v : sums) sink = sink + v;  // keeps the reads
  return dt;
}

std::map<ReadPattern, std::vector<double>> MeasureReadBandwidth(BigBuffer& buf, size_t chunk, int threads,
                                                                      int reps) {
  std::map<ReadPattern, std::vector<double>> gbs;
  size_t i = 0;
  for (int r = 0; r < reps + 1; ++r) {  // the first pass is a warm-up
    for (size_t c0 = 0; c0 + chunk <= buf.size(); c0 += chunk, ++i) {
      const ReadPattern pattern = ReadPatternAt(i);
      const double dt = TimedRead(buf, c0, chunk, threads, pattern);
      if (r > 0) gbs[pattern].push_back(static_cast<double>(chunk) / dt / 1e9);
    }
  }
  return gbs;
}

double FmaLoop(size_t n) {
  float sink;
  const double ops = static_cast<double>(FmaPeakLoop(n, &sink));
  return sink == 0.123f ? ops + 1 : ops;  // sink is observed
}

void PairedSamples::Add(ReadPattern pattern, double read_gbps, double work_gbps) {
  pairs_[pattern].emplace_back(read_gbps, work_gbps);
}

PairedSamples::Summary PairedSamples::Summarize() const {
  Summary s;
  const std::vector<std::pair<double, double>>* chosen = nullptr;
  for (const auto& [pattern, v] : pairs_) {
    std::vector<double> reads;
    for (const auto& [read, work] : v) reads.push_back(read);
    const double median = Median(reads);
    if (median > s.read_gbps) s.read_gbps = median, s.pattern = PatternName(pattern), chosen = &v;
  }
  if (chosen == nullptr) return s;
  std::vector<double> ratios, fast;
  for (const auto& [read, work] : *chosen) {
    if (work < 0 || read <= 0) continue;
    ratios.push_back(work / read);
    if (read >= kFastRegime * s.read_gbps) fast.push_back(work / read);
  }
  s.pairs = ratios.size();
  s.ratio = Median(ratios);
  s.fast_pairs = fast.size();
  s.fast_ratio = Median(fast);
  return s;
}

void ProbeResult::Merge(const ProbeResult& other) {
  if (other.best > best) best = other.best, pattern = other.pattern;
  samples.insert(samples.end(), other.samples.begin(), other.samples.end());
}

ProbeResult ProbeReadBandwidth(int threads, int reps) {
  BigBuffer buf(ReadProbeBytes(L3Bytes()));
  buf.Fill(threads);
  ProbeResult r;
  for (auto& [pattern, v] : MeasureReadBandwidth(buf, size_t{16} << 20, threads, reps)) {
    ProbeResult one;
    one.samples = v;
    one.best = v.empty() ? 0 : *std::max_element(v.begin(), v.end());
    one.pattern = PatternName(pattern);
    r.Merge(one);
  }
  return r;
}

ProbeResult ProbeInt8Peak(int threads, double seconds, int reps) {
  std::vector<size_t> iters;
  ProbeResult r;
  r.samples = MeasurePeak(threads, seconds, reps, iters, Int8PeakLoop);
  r.best = r.samples.empty() ? 0 : *std::max_element(r.samples.begin(), r.samples.end());
  return r;
}

}  // namespace m3::bench
