// `m3 bench --kernels` (kernel_bench.h).
//
// Weights are random packed matrices: uniform codes (q8 1..255, q4 0..15, q3/q2 any), fp16 scales in
// [2^-9, 2^-7), bf16 values of magnitude 2^-10..2^-3. They are written directly in the tiled layout
// rather than through PackRowTiles, whose q4 scale search costs ~250 ns per weight (minutes for the
// 300 MB a cold GEMV needs); no kernel's time depends on the values. Every buffer is mapped with a
// huge-page hint and written before timing, so no page faults land inside a measurement, and the
// bandwidth probe and the weights see the same kind of pages.
#include "kernel_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "bench/bandwidth.h"
#include "base/aligned_buffer.h"
#include "bench/limits.h"
#include "bench/onednn_peer.h"
#include "bench/shapes.h"
#include "simd/kernel_table.h"
#include "simd/kernels.h"
#include "platform/parallel.h"
#include "simd/quant_kernels.h"
#include "simd/weight_format.h"
#include "simd/weight_pack.h"

#include "m3_commit.h"  // M3_COMMIT, written at build time

namespace m3::bench {
namespace {

using simd::WeightFormat;
using simd::WeightRef;

struct Rng {  // SplitMix64
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float Uniform() { return static_cast<float>(Next() >> 40) * 0x1p-24f; }  // [0, 1)
};

constexpr size_t kPage = 4096;
size_t RoundUp(size_t n, size_t m) { return (n + m - 1) / m * m; }
// Codes and scales of one packed matrix.
size_t MatrixBytes(const WeightRef& w) { return simd::TiledCodeBytes(w) + simd::TiledScaleBytes(w); }

// `count` random packed matrices of one geometry, each page-aligned (like experts in a packed file).
class MatrixSet {
 public:
  MatrixSet(const WeightRef& shape, size_t count, const ThreadConfig& tc)
      : shape_(shape),
        count_(count),
        code_stride_(RoundUp(simd::TiledCodeBytes(shape), kPage)),
        scale_stride_(RoundUp(simd::TiledScaleBytes(shape), kPage)),
        codes_(code_stride_ * count),
        scales_(std::max<size_t>(scale_stride_ * count, 1)) {
    // Written in parallel with the same static split the kernels use (first touch on NUMA).
    ParallelFor(tc, count, 1, [&](size_t b, size_t e, int) {
      for (size_t i = b; i < e; ++i) Fill(i);
    });
  }
  size_t count() const { return count_; }
  WeightRef at(size_t i) {
    WeightRef w = shape_;
    w.data = codes_.data() + i * code_stride_;
    w.scales = scale_stride_ ? scales_.data() + i * scale_stride_ : nullptr;
    return w;
  }

 private:
  void Fill(size_t i) {
    Rng rng{0x5EEDull * (i + 1) + static_cast<uint64_t>(shape_.format) * 0x1000003ull + shape_.rows * 31 + shape_.cols};
    uint8_t* c = codes_.data() + i * code_stride_;
    const size_t n = simd::TiledCodeBytes(shape_);
    for (size_t j = 0; j < n; j += 8) {
      uint64_t v = rng.Next();
      if (shape_.format == WeightFormat::kQ8) {
        for (int b = 0; b < 8; ++b) v |= ((((v >> (8 * b)) & 0xFF) == 0) ? 1ull : 0ull) << (8 * b);  // codes 1..255
      } else if (shape_.format == WeightFormat::kBF16Tiled) {
        // Four bf16 values: random sign and mantissa, exponent 117..124.
        uint64_t r = 0;
        for (int h = 0; h < 4; ++h) {
          const uint64_t x = (v >> (16 * h)) & 0xFFFF;
          r |= ((x & 0x807F) | ((117 + ((x >> 7) & 7)) << 7)) << (16 * h);
        }
        v = r;
      }
      std::memcpy(c + j, &v, std::min<size_t>(8, n - j));
    }
    if (!scale_stride_) return;
    uint8_t* s = scales_.data() + i * scale_stride_;
    if (shape_.format == WeightFormat::kQ8) {  // per tile 16 fp32 row scales, then shifts 0 or 1
      for (size_t tile = 0; tile < shape_.row_tiles(); ++tile, s += shape_.tile_scale_bytes()) {
        for (size_t r = 0; r < simd::kTileRows; ++r) {
          const float v = std::ldexp(1.0f + 3.0f * rng.Uniform(), -9);
          std::memcpy(s + 4 * r, &v, 4);
        }
        for (size_t j = simd::kTileRows * 4; j < shape_.tile_scale_bytes(); ++j) s[j] = rng.Next() & 1;
      }
      return;
    }
    const size_t ns = simd::TiledScaleBytes(shape_) / 2;
    for (size_t j = 0; j < ns; ++j) {
      const uint16_t h = simd::F32ToF16(std::ldexp(1.0f + 3.0f * rng.Uniform(), -9));
      std::memcpy(s + 2 * j, &h, 2);
    }
  }

  WeightRef shape_;
  size_t count_, code_stride_, scale_stride_;
  BigBuffer codes_, scales_;
};

// ---------------------------------------------------------------------------------------------
// One matmul call as the engine makes it: quantize the activations (q8/q4), then split the row
// tiles over the threads.

class MatMulRunner {
 public:
  MatMulRunner(const WeightRef& shape, size_t max_tokens) : shape_(shape), max_tokens_(max_tokens) {
    Rng rng{7};
    x_.Resize(max_tokens * shape.cols);
    for (size_t i = 0; i < x_.size(); ++i) x_[i] = 2.0f * rng.Uniform() - 1.0f;
    y_.Resize(max_tokens * shape.rows);
    if (quantized()) {
      q_.Resize(max_tokens * shape.padded_cols());
      scale_.resize(max_tokens * shape.groups());
      sum_.resize(max_tokens * shape.groups());
      if (q8()) shift_.resize(max_tokens * shape.groups());
    }
  }
  bool quantized() const { return shape_.format != WeightFormat::kBF16Tiled; }
  bool q8() const { return shape_.format == WeightFormat::kQ8; }
  size_t scales_per_token() const { return q8() ? 1 : shape_.groups(); }

  void Quantize(const ThreadConfig& tc, size_t n_tok) {
    const size_t pc = shape_.padded_cols(), g = shape_.groups(), cols = shape_.cols;
    ParallelFor(tc, n_tok, 16, [&](size_t b, size_t e, int) {
      simd::BestKernels().quantize_activations(x_.data() + b * cols, cols, e - b, cols, shape_.group, q_.data() + b * pc,
                                scale_.data() + b * scales_per_token(), sum_.data() + b * g,
                                q8() ? shift_.data() + b * g : nullptr);
    });
  }
  // The quantized matmul alone, on the activations of the last Quantize.
  void Multiply(const ThreadConfig& tc, const WeightRef& w, size_t n_tok) {
    const simd::QuantizedActivations a = Activations(n_tok);
    ReserveThreads(tc);
    ParallelFor(tc, w.row_tiles(), 1, [&](size_t b, size_t e, int thread) {
      simd::BestKernels().QuantMatMul(w, a, b, e, y_.data(), w.rows, Scratch(thread));
    });
  }
  simd::QuantizedActivations Activations(size_t n_tok) const {
    simd::QuantizedActivations a;
    a.q = q_.data();
    a.scale = scale_.data();
    a.sum = sum_.data();
    a.n_tok = n_tok;
    a.padded_cols = shape_.padded_cols();
    a.group = shape_.group;
    a.shift = q8() ? shift_.data() : nullptr;
    return a;
  }

  void Run(const ThreadConfig& tc, const WeightRef& w, size_t n_tok) {
    if (quantized()) {
      Quantize(tc, n_tok);
      Multiply(tc, w, n_tok);
    } else {
      ReserveThreads(tc);
      ParallelFor(tc, w.row_tiles(), 1, [&](size_t b, size_t e, int thread) {
        simd::BestKernels().bf16_tiled_matmul(w, x_.data(), w.cols, n_tok, b, e, y_.data(), w.rows, Scratch(thread));
      });
    }
  }

  // Compares y (from Run with n_tok tokens) on row tiles [t0, t1) with the scalar reference.
  // Returns the largest difference relative to the largest reference output.
  double CompareWithReference(const WeightRef& w, size_t n_tok, size_t t0, size_t t1) {
    std::vector<float> ref(n_tok * w.rows, 0.0f);
    simd::KernelScratch unused;  // the references need none
    if (quantized()) {
      // Reference activations too, so a wrong fast quantizer shows up here.
      std::vector<int8_t> q(n_tok * w.padded_cols());
      std::vector<float> s(n_tok * w.groups());
      std::vector<int32_t> sum(n_tok * w.groups());
      std::vector<uint8_t> shift(n_tok * w.groups());
      simd::ref::QuantizeActivations(x_.data(), w.cols, n_tok, w.cols, w.group, q.data(), s.data(), sum.data(),
                                     q8() ? shift.data() : nullptr);
      simd::QuantizedActivations a = Activations(n_tok);
      a.q = q.data();
      a.scale = s.data();
      a.sum = sum.data();
      a.shift = q8() ? shift.data() : nullptr;
      simd::ref::QuantMatMul(w, a, t0, t1, ref.data(), w.rows, unused);
    } else {
      simd::ref::Bf16TiledMatMul(w, x_.data(), w.cols, n_tok, t0, t1, ref.data(), w.rows, unused);
    }
    double max_ref = 0, max_diff = 0;
    const size_t r0 = t0 * simd::kTileRows, r1 = std::min(w.rows, t1 * simd::kTileRows);
    for (size_t t = 0; t < n_tok; ++t)
      for (size_t r = r0; r < r1; ++r) {
        const float a = y_[t * w.rows + r], b = ref[t * w.rows + r];
        max_ref = std::max(max_ref, std::fabs(static_cast<double>(b)));
        max_diff = std::max(max_diff, std::isfinite(a) ? std::fabs(static_cast<double>(a) - b) : INFINITY);
      }
    return max_ref > 0 ? max_diff / max_ref : max_diff;
  }

 private:
  // The kernels' working memory, one per thread (the engine keeps it in the session's Workspace).
  simd::KernelScratch& Scratch(int thread) { return scratch_[static_cast<size_t>(thread)]; }
  void ReserveThreads(const ThreadConfig& tc) {
    if (scratch_.size() < static_cast<size_t>(tc.threads)) scratch_.resize(static_cast<size_t>(tc.threads));
  }

  WeightRef shape_;
  size_t max_tokens_;
  AlignedBuffer<float> x_, y_;  // aligned as the engine's activations (the kernels' streaming stores need it)
  AlignedBuffer<int8_t> q_;
  std::vector<float> scale_;
  std::vector<int32_t> sum_;
  std::vector<uint8_t> shift_;  // q8 only
  std::vector<simd::KernelScratch> scratch_;
};

// Per-call seconds of fn() after `warmup` untimed calls: at least min_calls (unless cap_s passes
// first; one call always), then more until target_s has passed, at most max_calls.
struct CallPolicy {
  int warmup, min_calls, max_calls;
  double target_s, cap_s;
};

template <class Fn>
std::vector<double> TimeCalls(const CallPolicy& p, Fn&& fn) {
  for (int i = 0; i < p.warmup; ++i) fn();
  std::vector<double> secs;
  const auto start = Clock::now();
  for (int i = 0; i < p.max_calls; ++i) {
    const auto t0 = Clock::now();
    fn();
    const auto t1 = Clock::now();
    secs.push_back(Seconds(t0, t1));
    const double elapsed = Seconds(start, t1);
    if ((i + 1 >= p.min_calls && elapsed >= p.target_s) || elapsed >= p.cap_s) break;
  }
  return secs;
}

// ---------------------------------------------------------------------------------------------
// Sizes and repetitions.

struct Plan {
  std::vector<int> thread_counts;   // ascending, each once
  size_t l3;                        // L3Bytes(): sizes the cold buffers
  size_t read_bytes;                // bandwidth probe buffer
  size_t read_chunk;                // timed unit of the probe (about one weight matrix)
  int read_reps;
  double peak_seconds;              // one timed peak loop per thread
  int peak_reps;
  int reprobe_reps;                 // limit samples taken before each block of rows
  std::vector<shapes::MatShape> shapes;
  std::vector<size_t> gemv_tokens;
  size_t gemm_tokens;
  size_t expert_tokens;             // a second GEMM row (and oneDNN's), on cold weights
  size_t working_set;               // cold weights (GEMV, the expert share) per (type, shape)
  CallPolicy gemv;                  // min_calls is raised to one full cycle over the matrices
  CallPolicy gemm;                  // also used for oneDNN
};

Plan MakePlan(bool quick, size_t l3) {
  Plan p;
  p.l3 = l3;
  if (quick) {
    p.read_bytes = size_t{8} << 20;
    p.read_chunk = size_t{1} << 20;
    p.read_reps = 2;
    p.peak_seconds = 0.005;
    p.peak_reps = 1;
    p.reprobe_reps = 1;
    p.shapes = {{128, 256}, {256, 128}};
    p.gemv_tokens = {1, 8};
    p.gemm_tokens = 32;
    p.expert_tokens = 12;
    p.working_set = size_t{1} << 20;
    p.gemv = {1, 3, 50, 0.01, 0.5};
    p.gemm = {1, 2, 3, 0.01, 0.5};
    return p;
  }
  // >= 8x L3 so neither the probe nor a GEMV is served from cache; 1 GiB at least.
  p.read_bytes = ReadProbeBytes(l3);
  p.read_chunk = size_t{16} << 20;  // the expert matrices are 10.6 (q4) to 37.7 MB (bf16)
  p.read_reps = 3;
  p.peak_seconds = 0.2;
  p.peak_reps = 3;
  p.reprobe_reps = 1;
  p.shapes = {shapes::kExpertGateUp, shapes::kExpertDown};
  p.gemv_tokens.assign(std::begin(shapes::kDecodeTokens), std::end(shapes::kDecodeTokens));
  p.gemm_tokens = shapes::kPrefillTokens;
  p.expert_tokens = shapes::kExpertPrefillTokens;
  p.working_set = std::max(size_t{256} << 20, 8 * l3);
  p.gemv = {2, 30, 100000, 0.3, 10.0};
  p.gemm = {1, 5, 15, 1.0, 10.0};
  return p;
}

// The thread counts to measure: those given, else 1 and all cores; ascending, each once.
std::vector<int> ThreadCounts(const KernelBenchOptions& options) {
  std::vector<int> thread_counts = options.threads;
  if (thread_counts.empty()) {
    thread_counts = {1};
    if (DefaultThreadCount() > 1) thread_counts.push_back(DefaultThreadCount());
  }
  std::sort(thread_counts.begin(), thread_counts.end());
  thread_counts.erase(std::unique(thread_counts.begin(), thread_counts.end()), thread_counts.end());
  return thread_counts;
}

// What a run measures: the sizes and repetitions of --quick or of the real shapes, at this
// machine's L3, on the thread counts.
Plan PlanRun(const KernelBenchOptions& options) {
  Plan plan = MakePlan(options.quick, L3Bytes());
  plan.thread_counts = ThreadCounts(options);
  return plan;
}

// Matrices of this geometry that fill the plan's working set: cycled through, every call's
// weights are cold.
size_t ColdCount(const Plan& plan, const WeightRef& geometry) {
  const size_t bytes = MatrixBytes(geometry);
  return std::max<size_t>(2, (plan.working_set + bytes - 1) / bytes);
}

// The GEMM rows' calls; the expert share's are many short ones: at least two cycles over its
// `cold` matrices, ~0.5 s.
CallPolicy GemmPolicy(const Plan& plan, bool expert, size_t cold) {
  CallPolicy policy = plan.gemm;
  if (expert) {
    policy.min_calls = std::max(policy.min_calls, static_cast<int>(2 * cold));
    policy.max_calls = 100000;
    policy.target_s = 0.5;
  }
  return policy;
}

// ---------------------------------------------------------------------------------------------
// Limits.

// The machine limits, probed at the start and again before each block of kernel rows. Other
// processes can only lower a probe, so each limit is the best sample of the whole run: a quiet
// moment anywhere sets it, and no kernel row is compared against a limit taken in a noisy one.
class LimitProbes {
 public:
  enum Kind { kReadBw, kInt8Peak, kFmaPeak, kAmxPeak, kKinds };

  LimitProbes(const Plan& plan, const std::vector<int>& thread_counts)
      : plan_(plan), thread_counts_(thread_counts), buf_(plan.read_bytes) {
    buf_.Fill(*std::max_element(thread_counts.begin(), thread_counts.end()));
  }

  void Probe(Kind kind, int reps) {
    for (int t : thread_counts_) {
      if (kind == kReadBw) {
        for (auto& [pattern, v] : MeasureReadBandwidth(buf_, plan_.read_chunk, t, reps)) {
          auto& best = best_pattern_[t];
          if (!v.empty() && *std::max_element(v.begin(), v.end()) > best.second) best = {pattern, *std::max_element(v.begin(), v.end())};
          samples_[kind][t].insert(samples_[kind][t].end(), v.begin(), v.end());
        }
        continue;
      }
      std::vector<double> v =
          MeasurePeak(t, plan_.peak_seconds, reps, iters_[kind][t],
                      kind == kInt8Peak ? Int8PeakLoop : kind == kAmxPeak ? AmxInt8PeakLoop : FmaLoop);
      auto& all = samples_[kind][t];
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  // Seconds to read `bytes` not read recently (the next range of the probe buffer, round robin)
  // with `threads` threads: the read bandwidth probe paired call by call with a kernel.
  double PairedRead(size_t bytes, int threads, ReadPattern pattern) {
    if (cursor_ + bytes > buf_.size()) cursor_ = 0;
    const double dt = TimedRead(buf_, cursor_, bytes, threads, pattern);
    cursor_ += RoundUp(bytes, kPage);
    return dt;
  }
  const char* BestPattern(int threads) const { return PatternName(best_pattern_.at(threads).first); }
  double Best(Kind kind, int threads) const {
    const auto& v = samples_[kind].at(threads);
    return *std::max_element(v.begin(), v.end());
  }
  double MedianOf(Kind kind, int threads) const { return Median(samples_[kind].at(threads)); }
  size_t Samples(Kind kind, int threads) const { return samples_[kind].at(threads).size(); }

 private:
  const Plan& plan_;
  std::vector<int> thread_counts_;
  BigBuffer buf_;
  size_t cursor_ = 0;
  std::map<int, std::pair<ReadPattern, double>> best_pattern_;  // per thread count
  std::map<int, std::vector<double>> samples_[kKinds];
  std::map<int, std::vector<size_t>> iters_[kKinds];
};

// ---------------------------------------------------------------------------------------------
// Rows: one figure against one limit.

struct Row {
  std::string kernel, type, shape;
  size_t tokens = 0;
  int threads = 1;
  double value = 0;
  std::string unit;
  double limit = 0;
  std::string limit_kind;
  std::string impl;
  nlohmann::json extra = nlohmann::json::object();
};

double LoadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

// Collects the rows; ResolveLimits() fills in the limits from the probes (the best of the whole
// run) once all are measured; then PrintJson() or PrintTable() writes them.
class Report {
 public:
  void Add(Row row) {
    row.extra["loadavg"] = LoadAverage();  // 1-minute load when the row was measured (noise hint)
    rows_.push_back(std::move(row));
  }

  void ResolveLimits(const LimitProbes& probes) {
    for (Row& r : rows_) {
      if (r.extra.contains("peak_kind")) {  // GEMV: its compute against the peak too
        // A few tokens can make a GEMV compute bound: at the peak its products take longer than
        // reading its bytes at the row's limit. Then its ratio to the read bandwidth cannot reach
        // 1, and its fraction of the peak says how close it is.
        const double peak = PeakOf(probes, r.extra["peak_kind"].get<std::string>(), r.threads);
        const double ops = r.extra["ops"].get<double>(), seconds = r.extra["seconds"].get<double>();
        const double bytes = static_cast<double>(r.extra["bytes"].get<size_t>());
        r.extra["gops"] = ops / seconds / 1e9;
        r.extra["peak"] = peak;
        r.extra["peak_ratio"] = peak > 0 ? ops / seconds / 1e9 / peak : 0.0;
        r.extra["bound"] = peak > 0 && ops / (peak * 1e9) > bytes / (r.limit * 1e9) ? "compute" : "memory";
      }
      if (r.limit > 0) {  // measured with the row (paired); the run's best read alongside
        if (r.limit_kind == "read_bw") r.extra["best_read_bw"] = probes.Best(LimitProbes::kReadBw, r.threads);
        continue;
      }
      r.limit = PeakOf(probes, r.limit_kind, r.threads);
    }
  }

  // One JSON line per row, in measured order.
  void PrintJson(FILE* out) const {
    const std::string cpu = CpuModel(), simd_target = simd::ActiveTargetName();
    for (const Row& r : rows_) {
      nlohmann::json j = {{"kernel", r.kernel},         {"type", r.type},
                          {"shape", r.shape},           {"tokens", r.tokens},
                          {"threads", r.threads},       {"value", r.value},
                          {"unit", r.unit},             {"limit", r.limit},
                          {"limit_kind", r.limit_kind}, {"ratio", nullptr},
                          {"cpu", cpu},                 {"simd_target", simd_target},
                          {"kernel_impl", r.impl},      {"commit", M3_COMMIT}};
      const LimitRatio judged = Judge(r);
      if (judged.valid) j["ratio"] = judged.ratio;
      else j["limit_note"] = judged.note;
      for (auto& [k, v] : r.extra.items()) j[k] = v;
      std::fprintf(out, "%s\n", j.dump().c_str());
    }
  }

  // The header, then the rows grouped by section (limits, GEMV, GEMM, oneDNN, GEMM vs oneDNN), in
  // measured order within.
  void PrintTable(const std::string& header, FILE* out) const {
    std::fprintf(out, "%s\n", header.c_str());
    std::fprintf(out, "%-12s %-5s %-10s %4s %4s %10s %-6s %10s %-12s %6s %5s  %s\n", "kernel", "type", "shape", "tok",
                 "thr", "value", "unit", "limit", "limit kind", "ratio", "load", "impl");
    std::vector<const Row*> sorted;
    for (const Row& r : rows_) sorted.push_back(&r);
    std::stable_sort(sorted.begin(), sorted.end(), [](const Row* a, const Row* b) { return Section(*a) < Section(*b); });
    int last = -1;
    for (const Row* rp : sorted) {
      const Row& r = *rp;
      if (last >= 0 && Section(r) != last) std::fprintf(out, "\n");
      last = Section(r);
      const LimitRatio judged = Judge(r);
      char ratio[16] = "above";  // the work beat the probe: not a limit (the note below says so)
      if (judged.valid) std::snprintf(ratio, sizeof ratio, "%.3f", judged.ratio);
      std::fprintf(out, "%-12s %-5s %-10s %4s %4d %10.2f %-6s %10.2f %-12s %6s %5.2f  %s", r.kernel.c_str(),
                   r.type.c_str(), r.shape.c_str(), r.tokens ? std::to_string(r.tokens).c_str() : "-", r.threads,
                   r.value, r.unit.c_str(), r.limit, r.limit_kind.c_str(), ratio, r.extra["loadavg"].get<double>(),
                   r.impl.c_str());
      if (r.extra.contains("matmul_ratio"))  // the GEMM vs oneDNN rows: also without our quantization
        std::fprintf(out, " (matmul alone %.3f)", r.extra["matmul_ratio"].get<double>());
      if (r.extra.value("bound", "") == "compute")
        std::fprintf(out, " (compute bound: %.3f of %s)", r.extra["peak_ratio"].get<double>(),
                     r.extra["peak_kind"].get<std::string>().c_str());
      if (!judged.valid) std::fprintf(out, " (%s)", judged.note.c_str());
      std::fprintf(out, "\n");
    }
  }

 private:
  // A row against a machine limit has a ratio only up to 1 (LimitRatio); against a peer (oneDNN)
  // any ratio is a ratio.
  static bool AgainstPeer(const Row& r) { return r.limit_kind == "onednn"; }
  static LimitRatio Judge(const Row& r) {
    if (AgainstPeer(r)) return {r.limit > 0, r.limit > 0 ? r.value / r.limit : 0.0, ""};
    return RatioToLimit(r.value, r.limit, r.limit_kind.c_str());
  }
  // A peak's best sample of the run; 0 for a kind that is not a peak.
  static double PeakOf(const LimitProbes& probes, const std::string& kind, int threads) {
    if (kind == "read_bw") return probes.Best(LimitProbes::kReadBw, threads);
    if (kind == "int8_peak") return probes.Best(LimitProbes::kInt8Peak, threads);
    if (kind == "amx_int8_peak") return probes.Best(LimitProbes::kAmxPeak, threads);
    if (kind == "fma_peak") return probes.Best(LimitProbes::kFmaPeak, threads);
    if (kind == "fma_peak_x2") return 2 * probes.Best(LimitProbes::kFmaPeak, threads);
    return 0;
  }
  static int Section(const Row& r) {
    static const char* const kOrder[] = {"read_bw",   "int8_peak", "amx_int8_peak", "fma_peak",
                                         "gemv",      "gemm",      "onednn_int8"};
    if (r.kernel == "gemm" && r.limit_kind == "onednn") return 7;
    for (int i = 0; i < 7; ++i)
      if (r.kernel == kOrder[i]) return i;
    return 8;
  }

  std::vector<Row> rows_;
};

// Integer or fp operations of one matmul of `n_tok` tokens: a multiply and an add per weight and token.
double MatMulOps(const shapes::MatShape& ms, size_t n_tok) {
  return 2.0 * static_cast<double>(ms.rows) * static_cast<double>(ms.cols) * static_cast<double>(n_tok);
}

// The compute limit of a weight type's matmul run by `impl`: vdpbf16ps does two products per
// fp32 lane where an FMA does one, twice the FMA peak; AMX has a peak of its own.
const char* PeakKind(WeightFormat f, bool bf16_dot, const std::string& impl) {
  if (f == WeightFormat::kBF16Tiled) return bf16_dot ? "fma_peak_x2" : "fma_peak";
  return impl == "amx-int8" ? "amx_int8_peak" : "int8_peak";
}

const char* TypeName(WeightFormat f) {
  if (simd::IsSuperBlock(f) || f == WeightFormat::kQ8 || f == WeightFormat::kQ4) return simd::WeightFormatName(f);
  return "bf16";
}
std::string ShapeName(size_t rows, size_t cols) { return std::to_string(rows) + "x" + std::to_string(cols); }

// ---------------------------------------------------------------------------------------------
// The run: limits, then per shape the kernel rows of each type and oneDNN's, then the limit rows.

// One weight type at one shape: its cold matrices (enough to fill the plan's working set), the
// runner, and the cursor that takes the matrices round robin across the GEMV rows and the expert
// GEMM rows, so that each read is cold.
struct TypeBench {
  TypeBench(const Plan& plan, const shapes::MatShape& shape_in, WeightFormat format, int max_threads)
      : ms(shape_in),
        f(format),
        geometry(simd::TiledShape(format, shape_in.rows, shape_in.cols)),
        bytes(MatrixBytes(geometry)),
        count(ColdCount(plan, geometry)),
        set(geometry, count, ThreadConfig{max_threads}),
        runner(geometry, std::max(plan.gemm_tokens, plan.gemv_tokens.back())),
        shape(ShapeName(shape_in.rows, shape_in.cols)),
        type(TypeName(format)) {}
  std::string Impl(size_t n_tok) const {
    return f == WeightFormat::kBF16Tiled ? simd::BestKernels().bf16_name.c_str()
                                         : simd::BestKernels().QuantName(geometry, n_tok);
  }

  const shapes::MatShape ms;
  const WeightFormat f;
  const WeightRef geometry;
  const size_t bytes, count;
  MatrixSet set;
  MatMulRunner runner;
  const std::string shape;
  const char* const type;
  size_t next = 0;           // the next matrix of the round robin
  const char* check = "ok";  // or "mismatch" (CheckAgainstReference)
};

// Correctness first (a fast wrong kernel is no result): 1 token on all rows, and the GEMM on its
// first and last row tiles, against the scalar reference. A mismatch is logged and makes the
// run's status 1.
void CheckAgainstReference(const Plan& plan, int max_threads, TypeBench* b, int* status, FILE* log) {
  const double tol = b->f == WeightFormat::kBF16Tiled ? 1e-3 : 1e-5;
  b->runner.Run(ThreadConfig{max_threads}, b->set.at(0), 1);
  const double gemv_err = b->runner.CompareWithReference(b->set.at(0), 1, 0, b->geometry.row_tiles());
  b->runner.Run(ThreadConfig{max_threads}, b->set.at(0), plan.gemm_tokens);
  const size_t last = b->geometry.row_tiles() - 1;
  const double gemm_err = std::max(b->runner.CompareWithReference(b->set.at(0), plan.gemm_tokens, 0, 1),
                                   b->runner.CompareWithReference(b->set.at(0), plan.gemm_tokens, last, last + 1));
  b->check = gemv_err <= tol && gemm_err <= tol ? "ok" : "mismatch";
  if (std::string(b->check) != "ok") {
    std::fprintf(log, "m3 bench: %s %s differs from the scalar reference (relative error gemv %.3g, gemm %.3g)\n",
                 b->type, b->shape.c_str(), gemv_err, gemm_err);
    *status = 1;
  }
}

// One GEMV row: `n_tok` tokens on `t` threads. Each call is followed by a probe read of as many
// cold bytes, the read patterns alternating, so that the kernel and its limit meet the same noise
// from the other tenants of the machine; the limit is the faster pattern's median.
void MeasureGemvRow(const Plan& plan, int t, size_t n_tok, bool bf16_dot, TypeBench* b, LimitProbes* probes,
                    Report* report) {
  const ThreadConfig tc{t};
  CallPolicy policy = plan.gemv;
  policy.min_calls = std::max(policy.min_calls, static_cast<int>(b->count));
  std::vector<double> secs;
  PairedSamples pairs;
  const double gb = static_cast<double>(b->bytes) / 1e9;
  TimeCalls(policy, [&] {
    const auto t0 = Clock::now();
    b->runner.Run(tc, b->set.at(b->next % b->count), n_tok);
    secs.push_back(Seconds(t0, Clock::now()));
    const ReadPattern pattern = ReadPatternAt(b->next);
    const double read_s = probes->PairedRead(b->bytes, t, pattern);
    if (secs.size() > static_cast<size_t>(policy.warmup)) pairs.Add(pattern, gb / read_s, gb / secs.back());
    ++b->next;
  });
  const size_t skip = std::min<size_t>(static_cast<size_t>(policy.warmup), secs.size() - 1);
  secs.erase(secs.begin(), secs.begin() + static_cast<std::ptrdiff_t>(skip));
  const PairedSamples::Summary paired = pairs.Summarize();
  const double s = Median(secs);
  report->Add({"gemv", b->type, b->shape, n_tok, t, gb / s, "GB/s", paired.read_gbps, "read_bw", b->Impl(n_tok),
               {{"seconds", s},
                {"ops", MatMulOps(b->ms, n_tok)},
                {"peak_kind", PeakKind(b->f, bf16_dot, b->Impl(n_tok))},
                {"best_seconds", *std::min_element(secs.begin(), secs.end())},
                {"calls", secs.size()},
                {"bytes", b->bytes},
                {"matrices", b->count},
                {"working_set", b->bytes * b->count},
                {"limit_stat", "median of paired probe reads"},
                {"limit_pattern", paired.pattern},
                {"pair_ratio_median", paired.ratio},
                {"fast_regime_pairs", paired.fast_pairs},
                {"fast_regime_ratio", paired.fast_ratio},
                {"check", b->check}}});
}

// The GEMV rows of a type: every token count on every thread count, the matrices cold.
void MeasureGemv(const Plan& plan, int max_threads, bool bf16_dot, TypeBench* b, LimitProbes* probes, Report* report) {
  // One untimed pass over every matrix: on VMs the first read of freshly written memory is
  // several times slower than later ones.
  for (size_t i = 0; i < b->count; ++i) b->runner.Run(ThreadConfig{max_threads}, b->set.at(i), 1);
  probes->Probe(LimitProbes::kReadBw, plan.reprobe_reps);
  // One discarded cycle of GEMV / probe pairs as the rows run them: on a Sapphire Rapids guest
  // the first row after the probe, whatever its token count, ran in another state (kernel ~20%
  // slower, its paired probe ~10% faster: 0.69-0.77 of it; the same row placed second 0.92-0.97).
  for (size_t i = 0; i < b->count; ++i, ++b->next) {
    b->runner.Run(ThreadConfig{plan.thread_counts.front()}, b->set.at(b->next % b->count), 1);
    probes->PairedRead(b->bytes, plan.thread_counts.front(), ReadPatternAt(b->next));
  }
  for (int t : plan.thread_counts)
    for (size_t n_tok : plan.gemv_tokens) MeasureGemvRow(plan, t, n_tok, bf16_dot, b, probes, report);
}

// The GEMM rows of a type, after the compute peaks are probed again: the prompt's GEMM on one
// matrix, then an expert's share of it on the GEMV set's matrices round robin, each call's weights
// cold as a chosen expert's are.
void MeasureGemm(const Plan& plan, bool amx, bool bf16_dot, TypeBench* b, LimitProbes* probes, Report* report) {
  probes->Probe(b->f == WeightFormat::kBF16Tiled ? LimitProbes::kFmaPeak : LimitProbes::kInt8Peak, plan.reprobe_reps);
  if (amx && simd::IsQuantized(b->f)) probes->Probe(LimitProbes::kAmxPeak, plan.reprobe_reps);
  for (const bool expert : {false, true}) {
    const size_t n_tok = expert ? plan.expert_tokens : plan.gemm_tokens;
    const double n_ops = MatMulOps(b->ms, n_tok);
    const CallPolicy policy = GemmPolicy(plan, expert, b->count);
    for (int t : plan.thread_counts) {
      const ThreadConfig tc{t};
      const std::vector<double> secs =
          TimeCalls(policy, [&] { b->runner.Run(tc, b->set.at(expert ? b->next++ % b->count : 0), n_tok); });
      const double s = Median(secs);
      const double gops = n_ops / s / 1e9;
      report->Add({"gemm", b->type, b->shape, n_tok, t, gops, "GOP/s", 0, PeakKind(b->f, bf16_dot, b->Impl(n_tok)),
                   b->Impl(n_tok),
                   {{"seconds", s},
                    {"best_seconds", *std::min_element(secs.begin(), secs.end())},
                    {"calls", secs.size()},
                    {"ops", n_ops},
                    {"weights", expert ? "cold, round robin over the GEMV matrices" : "one matrix"},
                    {"check", b->check}}});
    }
  }
}

// Our q8 GEMM and oneDNN's int8 matmul of `n_tok` tokens on `t` threads, alternately call by call,
// so that noise from other processes hits both alike; both rows report the medians of these
// paired calls. Ours is timed in two parts: the activation quantization and the int8 matmul
// itself, which starts from int8 activations as oneDNN's does.
void PairWithOneDnn(const Plan& plan, const shapes::MatShape& ms, bool expert, size_t n_tok, size_t copies, int t,
                    bool amx, MatMulRunner* q8_runner, MatrixSet* q8_set, Report* report, FILE* log) {
  const std::string shape = ShapeName(ms.rows, ms.cols);
  const WeightRef q8_shape = simd::TiledShape(WeightFormat::kQ8, ms.rows, ms.cols);
  const double n_ops = MatMulOps(ms, n_tok);
  std::string error;
  const std::unique_ptr<OneDnnInt8MatMul> od = OneDnnInt8MatMul::Create(n_tok, ms.cols, ms.rows, t, copies, &error);
  if (!od) {
    std::fprintf(log, "m3 bench: onednn_int8 %s, %d threads: %s\n", shape.c_str(), t, error.c_str());
    return;
  }
  const ThreadConfig tc{t};
  std::vector<double> quant, matmul, ours, peer;
  size_t next_copy = 0;
  const CallPolicy policy = GemmPolicy(plan, expert, copies);
  TimeCalls(policy, [&] {
    const auto t0 = Clock::now();
    q8_runner->Quantize(tc, n_tok);
    const auto t1 = Clock::now();
    q8_runner->Multiply(tc, q8_set->at(next_copy++ % copies), n_tok);
    const auto t2 = Clock::now();
    od->Run();
    quant.push_back(Seconds(t0, t1));
    matmul.push_back(Seconds(t1, t2));
    ours.push_back(Seconds(t0, t2));
    peer.push_back(Seconds(t2, Clock::now()));
  });
  const size_t skip = std::min<size_t>(static_cast<size_t>(policy.warmup), ours.size() - 1);
  for (auto* v : {&quant, &matmul, &ours, &peer})
    v->erase(v->begin(), v->begin() + static_cast<std::ptrdiff_t>(skip));
  const double gops = n_ops / Median(peer) / 1e9, ours_gops = n_ops / Median(ours) / 1e9;
  const double matmul_gops = n_ops / Median(matmul) / 1e9;
  const std::string weights =
      expert ? "cold, round robin over " + std::to_string(copies) + " copies each" : "one matrix";
  const bool od_amx = amx && od->impl().find("amx") != std::string::npos;
  report->Add({"onednn_int8", "q8", shape, n_tok, t, gops, "GOP/s", 0, od_amx ? "amx_int8_peak" : "int8_peak",
               od->impl(),
               {{"seconds", Median(peer)},
                {"calls", peer.size()},
                {"ops", n_ops},
                {"src", "u8"},
                {"wei", "s8"},
                {"weights", weights}}});
  report->Add({"gemm", "q8", shape, n_tok, t, ours_gops, "GOP/s", gops, "onednn",
               simd::BestKernels().QuantName(q8_shape, n_tok),
               {{"peer", od->impl()},
                {"paired_calls", ours.size()},
                {"seconds", Median(ours)},
                {"includes", "activation quantization (oneDNN gets int8 input)"},
                {"quantize_seconds", Median(quant)},
                {"matmul_seconds", Median(matmul)},
                {"matmul_gops", matmul_gops},
                {"matmul_ratio", matmul_gops / gops},
                {"weights", weights}}});
}

// oneDNN's int8 matmul on the same shape and thread counts: the prompt on one matrix, and an
// expert's share with every call's weights cold, ours and oneDNN's each round robin over copies
// of their own (as many as the GEMV set: >= 8x L3). Skipped, with a note, where the copies need
// more than half of the available memory.
void MeasureOneDnn(const Plan& plan, const shapes::MatShape& ms, int max_threads, bool amx, Report* report,
                   FILE* log) {
  const std::string shape = ShapeName(ms.rows, ms.cols);
  const WeightRef q8_shape = simd::TiledShape(WeightFormat::kQ8, ms.rows, ms.cols);
  MatMulRunner q8_runner(q8_shape, plan.gemm_tokens);
  for (const bool expert : {false, true}) {
    const size_t n_tok = expert ? plan.expert_tokens : plan.gemm_tokens;
    const size_t copies = expert ? ColdCount(plan, q8_shape) : 1;
    // Ours and oneDNN's copies side by side (the probe buffer is already counted).
    const size_t copy_bytes = MatrixBytes(q8_shape) + ms.rows * ms.cols;
    const double need = static_cast<double>(copies) * static_cast<double>(copy_bytes);
    const uint64_t available = MemAvailable();
    if (available > 0 && need > static_cast<double>(available) / 2) {
      std::fprintf(log,
                   "m3 bench: gemm vs onednn %s, %zu tokens skipped: %zu weight copies need %.2f GB, more than "
                   "half of MemAvailable (%.2f GB)\n",
                   shape.c_str(), n_tok, copies, need / 1e9, static_cast<double>(available) / 1e9);
      continue;
    }
    MatrixSet q8_set(q8_shape, copies, ThreadConfig{max_threads});
    for (int t : plan.thread_counts)
      PairWithOneDnn(plan, ms, expert, n_tok, copies, t, amx, &q8_runner, &q8_set, report, log);
  }
}

// The limit rows: best sample of the run (ratio 1 by definition); median and count alongside.
void AddLimitRows(const Plan& plan, const LimitProbes& probes, bool amx, Report* report) {
  struct LimitRow {
    LimitProbes::Kind kind;
    const char *kernel, *type, *unit;
    std::string shape, impl;
  };
  const LimitRow limit_rows[] = {
      {LimitProbes::kReadBw, "read_bw", "bytes", "GB/s", std::to_string(plan.read_bytes >> 20) + "MiB",
       "stream-read-" + simd::ActiveTargetName()},
      {LimitProbes::kInt8Peak, "int8_peak", "int8", "GOP/s", "-", simd::BestKernels().quant_name.c_str()},
      {LimitProbes::kFmaPeak, "fma_peak", "f32", "GOP/s", "-", "fma-" + simd::ActiveTargetName()},
      {LimitProbes::kAmxPeak, "amx_int8_peak", "int8", "GOP/s", "-", "amx-int8"},
  };
  for (const LimitRow& lr : limit_rows)
    for (int t : plan.thread_counts) {
      if (lr.kind == LimitProbes::kAmxPeak && !amx) continue;
      report->Add({lr.kernel, lr.type, lr.shape, 0, t, probes.Best(lr.kind, t), lr.unit, 0, lr.kernel, lr.impl,
                   {{"median", probes.MedianOf(lr.kind, t)},
                    {"pattern", lr.kind == LimitProbes::kReadBw ? probes.BestPattern(t) : "-"},
                    {"samples", probes.Samples(lr.kind, t)},
                    {"stat", "best"},
                    {"sample_bytes", lr.kind == LimitProbes::kReadBw ? plan.read_chunk : 0}}});
    }
}

// What a run measured: the rows with their limits filled in, the load at the start, and the
// status (1 when a kernel disagreed with its scalar reference).
struct Measured {
  Report report;
  double load_start = 0;
  int status = 0;
};

Measured Measure(const Plan& plan, FILE* log) {
  Measured m;
  m.load_start = LoadAverage();
  const int max_threads = plan.thread_counts.back();

  // 1. Limits for every thread count; probed again before each block below.
  LimitProbes probes(plan, plan.thread_counts);
  probes.Probe(LimitProbes::kReadBw, plan.read_reps);
  probes.Probe(LimitProbes::kInt8Peak, plan.peak_reps);
  probes.Probe(LimitProbes::kFmaPeak, plan.peak_reps);
  const bool amx = AmxInt8PeakLoop(1) > 0;
  if (amx) probes.Probe(LimitProbes::kAmxPeak, plan.peak_reps);

  // 2. GEMV and GEMM per shape and type; 3. oneDNN's on the shape, where it is built in.
  const bool bf16_dot = std::string(simd::BestKernels().bf16_name.c_str()).find("bf16") != std::string::npos;
  for (const shapes::MatShape& ms : plan.shapes) {
    for (WeightFormat f :
         {WeightFormat::kQ4, WeightFormat::kQ8, WeightFormat::kQ3, WeightFormat::kQ2, WeightFormat::kBF16Tiled}) {
      TypeBench b(plan, ms, f, max_threads);
      CheckAgainstReference(plan, max_threads, &b, &m.status, log);
      MeasureGemv(plan, max_threads, bf16_dot, &b, &probes, &m.report);
      MeasureGemm(plan, amx, bf16_dot, &b, &probes, &m.report);
    }
    if (OneDnnAvailable()) MeasureOneDnn(plan, ms, max_threads, amx, &m.report, log);
  }
  if (!OneDnnAvailable()) std::fprintf(log, "m3 bench: %s: onednn rows skipped\n", OneDnnDescription().c_str());

  AddLimitRows(plan, probes, amx, &m.report);
  m.report.ResolveLimits(probes);
  return m;
}

// ---------------------------------------------------------------------------------------------
// The report: JSON lines, or the header and the table.

std::string Header(const KernelBenchOptions& options, const Plan& plan, double load_start) {
  char header[1024];
  std::snprintf(header, sizeof header,
                "m3 bench --kernels%s\ncpu %s | simd %s | quant kernels %s | bf16 kernels %s | commit %s\n"
                "L3 %.1f MiB | read_bw: %zu MiB buffer timed in %zu MiB chunks | GEMV weights cycled through >= %zu "
                "MiB per type and shape (every call cold)\nkernel rows: median call | gemv limit: median of probe "
                "reads paired call by call with the kernel (same bytes, cold) | other limits: best sample of the run | "
                "load: 1-min load average when measured (%d CPUs; start %.2f)\n",
                options.quick ? " --quick (tiny sizes: figures are not meaningful)" : "", CpuModel().c_str(),
                simd::ActiveTargetName().c_str(), simd::BestKernels().quant_name.c_str(),
                simd::BestKernels().bf16_name.c_str(), M3_COMMIT, static_cast<double>(plan.l3) / (1 << 20),
                plan.read_bytes >> 20, plan.read_chunk >> 20, plan.working_set >> 20, DefaultThreadCount(), load_start);
  return header;
}

void PrintReport(const KernelBenchOptions& options, const Plan& plan, const Measured& m, FILE* out) {
  if (options.json) {
    m.report.PrintJson(out);
  } else {
    m.report.PrintTable(Header(options, plan, m.load_start), out);
  }
}

}  // namespace

int RunKernelBench(const KernelBenchOptions& options, FILE* out, FILE* log) {
  const Plan plan = PlanRun(options);
  const Measured m = Measure(plan, log);
  PrintReport(options, plan, m, out);
  return m.status;
}

}  // namespace m3::bench
