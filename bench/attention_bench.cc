// `m3 bench --attention` (attention_bench.h).
//
// Cold caches. One layer's caches at short contexts fit in L3 (index keys at 4K: 2 MB; the 16
// selected blocks of a decode token: 4 MB of f32 K+V at any context), but a real decode step
// never finds them there: between two uses of a layer's caches the weights of all 60 layers and
// the caches of the other 56 sparse layers stream through. So every timed call here follows an
// untimed read of 4x L3 (at least 64 MiB) from the read-bandwidth probe's buffer, taken round
// robin so the eviction read is itself cold. This was chosen over rotating several layers'
// caches because it is cold at every context for the same memory: rotation would need 57
// layers of index keys to exceed L3 at 1K, and 4 layers of K+V (2 GB) to make the selected
// blocks at 128K unlikely to repeat. Each decode repetition also takes another random query,
// so its selection differs as a new token's would. The eviction reads double as read-bandwidth
// samples. The index-key scan is judged as --kernels judges a GEMV: each decode scan is paired
// with a timed read of as many cold bytes right before it (limits.h PairedSamples).
//
// Data: random values in [-1, 1) from a hash of (tensor, row, column), so filling in parallel
// gives the same caches for any thread count; no cost depends on the values.
#include "attention_bench.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "bench/bandwidth.h"
#include "bench/limits.h"
#include "bench/shapes.h"
#include "simd/kernels.h"
#include "ops/attention.h"
#include "platform/parallel.h"

#include "m3_commit.h"  // M3_COMMIT, written at build time

extern char** environ;

namespace m3::bench {
namespace {

using simd::CacheType;

constexpr size_t kHeads = shapes::kHeads, kKvHeads = shapes::kKvHeads, kHeadDim = shapes::kHeadDim;
constexpr size_t kIndexHeads = shapes::kIndexHeads, kIndexDim = shapes::kIndexDim, kBlock = shapes::kBlock;
constexpr size_t kTopk = shapes::kTopkBlocks;
constexpr size_t kDecodeQueries = 8;  // random decode queries, used in turn
constexpr size_t kRatioContext = 4096;

// ---------------------------------------------------------------------------------------------
// Random data.

uint64_t Mix(uint64_t z) {  // SplitMix64 finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// n values in [-1, 1), a function of (tensor, row) only.
void RandomRow(uint64_t tensor, uint64_t row, float* x, size_t n) {
  uint64_t s = Mix(tensor * 0x9E3779B97F4A7C15ull + row + 1);
  for (size_t i = 0; i < n; ++i) {
    s += 0x9E3779B97F4A7C15ull;
    x[i] = static_cast<float>(Mix(s) >> 40) * 0x1p-23f - 1.0f;
  }
}

std::vector<float> RandomRows(uint64_t tensor, size_t rows, size_t n) {
  std::vector<float> x(rows * n);
  for (size_t r = 0; r < rows; ++r) RandomRow(tensor, r, x.data() + r * n, n);
  return x;
}

// Rows [0, rows) of a paged cache, written in parallel by pages (a page is only written by the
// thread that owns it).
template <class Cache>
void FillCache(Cache& cache, size_t rows, size_t width, uint64_t tensor, const ThreadConfig& tc) {
  cache.EnsureRows(rows);
  const size_t pages = (rows + kBlock - 1) / kBlock;
  ParallelFor(tc, pages, 1, [&](size_t b, size_t e, int) {
    std::vector<float> x(width);
    for (size_t r = b * kBlock; r < std::min(rows, e * kBlock); ++r) {
      RandomRow(tensor, r, x.data(), width);
      cache.Write(r, x.data());
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Cold reads: the read-bandwidth probe buffer, its probe, and the eviction read before each call.

class ColdReads {
 public:
  ColdReads(size_t buffer_bytes, size_t probe_chunk, size_t evict_bytes, int threads)
      : buf_(buffer_bytes), probe_chunk_(probe_chunk), evict_bytes_(std::min(evict_bytes, buffer_bytes)),
        threads_(threads) {
    buf_.Fill(threads);
  }
  size_t buffer_bytes() const { return buf_.size(); }
  size_t evict_bytes() const { return evict_bytes_; }
  size_t probe_chunk() const { return probe_chunk_; }

  // The read-bandwidth probe of `m3 bench --kernels` (limits.h MeasureReadBandwidth: the whole
  // buffer in chunks, both read patterns); the run keeps the best sample.
  void Probe(int reps) {
    for (auto& [pattern, v] : MeasureReadBandwidth(buf_, probe_chunk_, threads_, reps)) {
      ProbeResult one;
      one.samples = v;
      one.best = v.empty() ? 0 : *std::max_element(v.begin(), v.end());
      one.pattern = PatternName(pattern);
      best_.Merge(one);
    }
  }
  const ProbeResult& best() const { return best_; }

  // Reads the next evict_bytes of the buffer (round robin, patterns alternating); kept as a read
  // sample, the limit of rows whose calls are paired with nothing (no keys scanned).
  void Evict() {
    const auto [pattern, gbps] = Read(evict_bytes_);
    evictions_.Add(pattern, gbps);
  }
  // A timed read of as many cold bytes as the call that follows reads, right before it; Pair()
  // records that call against it, as --kernels pairs each GEMV call with a read of its bytes.
  void ReadLike(size_t bytes) { std::tie(next_pattern_, next_gbps_) = Read(bytes); }
  void Pair(double work_gbps) {
    if (next_gbps_ > 0) pairs_.Add(next_pattern_, next_gbps_, work_gbps);
    next_gbps_ = 0;
  }
  // The pairs since the last call (the limit: the faster pattern's median read), or the eviction
  // reads when there are none; starts afresh.
  PairedSamples::Summary TakePaired() {
    PairedSamples::Summary s = pairs_.Summarize();
    if (s.pairs == 0) s = evictions_.Summarize();
    pairs_.Clear();
    evictions_.Clear();
    return s;
  }

 private:
  std::pair<ReadPattern, double> Read(size_t bytes) {
    bytes = std::min(bytes, buf_.size());
    if (cursor_ + bytes > buf_.size()) cursor_ = 0;
    const ReadPattern pattern = ReadPatternAt(count_++);
    const double dt = TimedRead(buf_, cursor_, bytes, threads_, pattern);
    cursor_ += bytes;
    return {pattern, static_cast<double>(bytes) / dt / 1e9};
  }

  BigBuffer buf_;
  size_t probe_chunk_, evict_bytes_;
  int threads_;
  size_t cursor_ = 0, count_ = 0;
  ProbeResult best_;
  PairedSamples evictions_, pairs_;
  ReadPattern next_pattern_ = ReadPattern::kSequential;
  double next_gbps_ = 0;
};

// How many times a figure is measured: at least min_calls (unless cap_s passes first; one call
// always), then more until target_s has passed, at most max_calls. Time spent evicting counts.
struct Reps {
  int min_calls, max_calls;
  double target_s, cap_s;
  template <class Fn>
  void Run(Fn&& one_call) const {
    const auto start = Clock::now();
    for (int i = 0; i < max_calls; ++i) {
      one_call(static_cast<size_t>(i));
      const double elapsed = Seconds(start, Clock::now());
      if ((i + 1 >= min_calls && elapsed >= target_s) || elapsed >= cap_s) break;
    }
  }
};

struct Plan {
  std::vector<size_t> contexts;
  size_t chunk;
  size_t probe_bytes, probe_chunk, evict_bytes;
  int probe_reps;
  Reps decode, dense_decode, prefill, dense_prefill;
  size_t shared_l3;                     // SharedL3Bytes(): sizes the evictions
  int threads = 0;                      // -t, or all cores
  std::vector<CacheType> index_types;   // one row per context each; f32 when none are given
  CacheType kv_type = CacheType::kF32;
};

Plan MakePlan(const AttentionBenchOptions& o, size_t l3, size_t shared_l3) {
  Plan p;
  p.shared_l3 = shared_l3;
  if (o.quick) {
    p.contexts = {512, kRatioContext};
    p.chunk = 16;
    p.probe_bytes = size_t{32} << 20;
    p.probe_chunk = size_t{1} << 20;
    p.evict_bytes = size_t{8} << 20;
    p.probe_reps = 1;
    p.decode = p.dense_decode = {3, 3, 0, 1};
    p.prefill = p.dense_prefill = {1, 1, 0, 1};
  } else {
    p.contexts = {1024, 4096, 16384, 65536, 131072};
    p.chunk = 256;
    p.probe_bytes = ReadProbeBytes(l3);
    p.probe_chunk = size_t{16} << 20;
    // The probe buffer of --kernels (>= 8x L3Bytes); evictions of 4x the L3 this CPU shares.
    p.evict_bytes = std::max(size_t{64} << 20, (4 * shared_l3 + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20));
    p.probe_reps = 2;
    // Decode: >= 7 calls (median), ~0.3 s of calls per figure. Prefill: >= 3 calls, but a dense
    // chunk at 128K takes seconds, so its cap leaves one or two there.
    p.decode = {7, 200, 0.3, 5};
    p.dense_decode = {7, 200, 0.3, 5};
    p.prefill = {3, 20, 0.5, 10};
    p.dense_prefill = {3, 20, 0.5, 6};
  }
  if (!o.contexts.empty()) p.contexts = o.contexts;
  if (o.chunk) p.chunk = o.chunk;
  return p;
}

// ---------------------------------------------------------------------------------------------
// Rows.

struct Row {
  size_t context = 0, chunk = 0;
  CacheType index_type = CacheType::kF32, kv_type = CacheType::kF32;
  double indexer_ms = 0, attention_ms = 0, dense_attention_ms = 0;
  double indexer_min_ms = 0, attention_min_ms = 0, dense_attention_min_ms = 0;  // fastest call
  double prefill_indexer_ms = 0, prefill_attention_ms = 0, prefill_ms = 0, dense_prefill_ms = 0;
  size_t index_scan_bytes = 0;  // 0: every block is selected, SelectBlocks scans nothing
  // The decode scans and the reads paired with them (the limit), or the eviction reads.
  PairedSamples::Summary scan_pairs;
  size_t decode_calls = 0, dense_decode_calls = 0, prefill_calls = 0, dense_prefill_calls = 0;
  size_t kv_bytes = 0, index_bytes = 0;
  double loadavg = 0;
  std::string check = "ok";
  // Filled in after all contexts.
  double best_read_gbps = 0;  // the run's best read sample
  std::optional<double> ratio_4k;
};

// What a run measured: the rows, the notes of what was skipped, the status (1 when a check
// failed), and the cold reads' sizes and best sample for the report.
struct Measured {
  std::vector<Row> rows;
  std::vector<std::string> notes;
  int status = 0;
  double load_start = 0;
  size_t evict_bytes = 0, buffer_bytes = 0, probe_chunk = 0;
  std::string best_read_pattern;
};

double LoadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

double Ms(const std::vector<double>& secs) { return Median(secs) * 1e3; }
double MinMs(const std::vector<double>& secs) { return secs.empty() ? 0 : *std::min_element(secs.begin(), secs.end()) * 1e3; }

std::string ContextName(size_t c) {
  return c % 1024 == 0 ? std::to_string(c / 1024) + "K" : std::to_string(c);
}

// Every (query, index head) of the selection has min(topk, visible blocks) ascending blocks that
// end with the query's own block.
bool SelectionOk(const BlockSelection& sel, int64_t pos0, size_t n) {
  for (size_t t = 0; t < n; ++t) {
    const int64_t visible = (pos0 + static_cast<int64_t>(t)) / static_cast<int64_t>(kBlock) + 1;
    for (int h = 0; h < static_cast<int>(kIndexHeads); ++h) {
      const int c = sel.Count(t, h);
      if (c != std::min<int64_t>(static_cast<int64_t>(kTopk), visible) || sel.Blocks(t, h)[c - 1] != visible - 1)
        return false;
      for (int i = 1; i < c; ++i)
        if (sel.Blocks(t, h)[i - 1] >= sel.Blocks(t, h)[i]) return false;
    }
  }
  return true;
}

bool Close(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!(std::fabs(a[i] - b[i]) <= 1e-5f * (1.0f + std::fabs(b[i])))) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// The plot: a gnuplot script and its data in a temporary folder, gnuplot run as a subprocess.

std::string GnuplotString(const std::string& s) {  // single-quoted: '' is one quote
  std::string r = "'";
  for (char c : s) r += c == '\'' ? std::string("''") : std::string(1, c);
  return r + "'";
}

// Runs `gnuplot script` with output to `err_path`. Returns the exit status, or -1 (errno set)
// when it could not be started.
int RunGnuplot(const std::string& script, const std::string& err_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::string prog = "gnuplot";
  char* argv[] = {prog.data(), const_cast<char*>(script.c_str()), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    errno = rc;
    return -1;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

namespace fs = std::filesystem;

// The data: one block per index-key type: context, indexer, attention, dense attention, prefill,
// dense prefill (ms).
void WritePlotData(const fs::path& dir, const std::vector<Row>& rows, const std::vector<CacheType>& types) {
  std::ofstream data(dir / "attention.dat");
  for (CacheType t : types) {
    data << "# index keys " << simd::CacheTypeName(t) << "\n";
    for (const Row& r : rows)
      if (r.index_type == t)
        data << r.context << ' ' << r.indexer_ms << ' ' << r.attention_ms << ' ' << r.dense_attention_ms << ' '
             << r.prefill_ms << ' ' << r.dense_prefill_ms << '\n';
    data << "\n\n";
  }
}

// The gnuplot script: a log-log plot of each series against the context, to `target`.
void WritePlotScript(const fs::path& dir, const fs::path& target, const std::vector<Row>& rows,
                     const std::vector<CacheType>& types, int threads) {
  std::ofstream gp(dir / "attention.gp");
  gp << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n  set terminal pngcairo size 1100,750 noenhanced\n"
        "} else {\n  set terminal png size 1100,750 noenhanced\n}\n"
     << "set output " << GnuplotString(target.string()) << "\n"
     << "set title " << GnuplotString("m3 bench --attention: one MiniMax-M3 sparse layer (64 q / 4 kv heads x 128, "
                                      "index 4 x 128, top-16 blocks of 128)")
     << " . \"\\n\" . "
     << GnuplotString("kv cache " + std::string(simd::CacheTypeName(rows[0].kv_type)) + ", prefill chunk " +
                      std::to_string(std::max_element(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
                                       return a.chunk < b.chunk;
                                     })->chunk) +
                      ", " + std::to_string(threads) + " threads, " + CpuModel())
     << "\nset logscale xy\nset grid\nset key left top\nset xlabel 'context (tokens)'\n"
        "set ylabel 'ms per layer (median)'\nset xtics (";
  std::vector<size_t> contexts;
  for (const Row& r : rows) contexts.push_back(r.context);
  std::sort(contexts.begin(), contexts.end());
  contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
  for (size_t i = 0; i < contexts.size(); ++i)
    gp << (i ? ", " : "") << GnuplotString(ContextName(contexts[i])) << ' ' << contexts[i];
  gp << ")\n";
  gp << "set xrange [" << static_cast<double>(contexts.front()) / 1.5 << ":"
     << static_cast<double>(contexts.back()) * 1.5 << "]\n";
  const std::string data_path = GnuplotString((dir / "attention.dat").string());
  const char* series[] = {"indexer_ms", "attention_ms", "dense_attention_ms", "prefill_ms", "dense_prefill_ms"};
  gp << "plot ";
  bool first = true;
  for (size_t ti = 0; ti < types.size(); ++ti) {
    const std::string type = simd::CacheTypeName(types[ti]);
    for (int s = 0; s < 5; ++s) {
      // The dense figures and the attention do not depend on the index-key type: once.
      if (ti > 0 && s != 0 && s != 3) continue;
      gp << (first ? "" : ", \\\n     ") << data_path << " index " << ti << " using 1:" << s + 2
         << " with linespoints lw 2 pt " << 5 + s << " lc " << s + 1 << (ti > 0 ? " dt " + std::to_string(ti + 1) : "")
         << " title "
         << GnuplotString(std::string(series[s]) + (types.size() > 1 && (s == 0 || s == 3) ? " (" + type + ")" : ""));
      first = false;
    }
  }
  gp << "\n";
}

// Runs the script; returns the note: written where, or why not (gnuplot missing, or its errors).
std::string RunPlotScript(const fs::path& dir, const fs::path& target) {
  std::string note;
  const std::string err_path = (dir / "gnuplot.log").string();
  const int rc = RunGnuplot((dir / "attention.gp").string(), err_path);
  if (rc < 0 && errno == ENOENT) {
    note = "gnuplot not found: plot skipped (install the Debian package gnuplot-nox)";
  } else if (rc < 0) {
    note = std::string("plot skipped: cannot run gnuplot: ") + std::strerror(errno);
  } else if (rc != 0 || !fs::exists(target)) {
    // gnuplot's messages on one line, without the lines that only point at a column.
    std::ifstream err(err_path);
    std::string msg;
    for (std::string line; std::getline(err, line);) {
      if (line.find_first_not_of(" \t^") == std::string::npos) continue;
      msg += (msg.empty() ? "" : " | ") + line;
    }
    note = "plot not written: gnuplot exited with " + std::to_string(rc) + (msg.empty() ? "" : ": " + msg);
  } else {
    note = "plot written to " + target.string();
  }
  return note;
}

// Writes the PNG (data and script in a temporary folder, removed after); returns a note for the
// log (written where, or why not).
std::string WritePlot(const std::vector<Row>& rows, const std::vector<CacheType>& types, int threads,
                      const std::string& png) {
  if (rows.empty()) return "no rows: plot not written";
  std::error_code ec;
  const fs::path target = fs::absolute(png, ec);
  if (ec || !fs::is_directory(target.parent_path(), ec))
    return "plot not written: no folder " + target.parent_path().string();
  char dir_template[] = "/tmp/m3-attention-plot-XXXXXX";
  if (!mkdtemp(dir_template)) return std::string("plot not written: cannot create a temporary folder: ") + std::strerror(errno);
  const fs::path dir = dir_template;
  WritePlotData(dir, rows, types);
  WritePlotScript(dir, target, rows, types, threads);
  const std::string note = RunPlotScript(dir, target);
  fs::remove_all(dir, ec);
  return note;
}

// ---------------------------------------------------------------------------------------------
// Output.

nlohmann::json Nullable(double v, bool present) { return present ? nlohmann::json(v) : nlohmann::json(nullptr); }
// The scan against a read limit: a ratio when the scan has one and stays at or below it.
nlohmann::json LimitJson(double scan_gbps, double limit, bool scanned) {
  const LimitRatio j = RatioToLimit(scan_gbps, limit, "read limit");
  return Nullable(j.ratio, scanned && j.valid);
}
// The table's cell for it: "-" without a scan, "above" when the probe read less than the scan.
std::string LimitCell(double scan_gbps, double limit) {
  if (!(limit > 0)) return "-";
  const LimitRatio j = RatioToLimit(scan_gbps, limit, "read limit");
  char buf[32] = "above";
  if (j.valid) std::snprintf(buf, sizeof buf, "%.3f", j.ratio);
  return buf;
}

void PrintJson(const Measured& m, int threads, FILE* out) {
  const std::string cpu = CpuModel(), target = simd::ActiveTargetName();
  for (const Row& r : m.rows) {
    const bool scanned = r.index_scan_bytes > 0;
    const double scan_gbps = scanned ? static_cast<double>(r.index_scan_bytes) / (r.indexer_ms * 1e-3) / 1e9 : 0;
    nlohmann::json j = {
        {"bench", "attention"},
        {"context", r.context},
        {"chunk", r.chunk},
        {"index_key_type", simd::CacheTypeName(r.index_type)},
        {"kv_type", simd::CacheTypeName(r.kv_type)},
        {"threads", threads},
        {"indexer_ms", r.indexer_ms},
        {"attention_ms", r.attention_ms},
        {"dense_attention_ms", r.dense_attention_ms},
        {"indexer_min_ms", r.indexer_min_ms},
        {"attention_min_ms", r.attention_min_ms},
        {"dense_attention_min_ms", r.dense_attention_min_ms},
        {"decode_speedup", r.dense_attention_ms / (r.indexer_ms + r.attention_ms)},
        {"prefill_ms", r.prefill_ms},
        {"prefill_indexer_ms", r.prefill_indexer_ms},
        {"prefill_attention_ms", r.prefill_attention_ms},
        {"dense_prefill_ms", r.dense_prefill_ms},
        {"prefill_speedup", r.dense_prefill_ms / r.prefill_ms},
        {"index_scan_bytes", r.index_scan_bytes},
        {"index_scan_gbps", Nullable(scan_gbps, scanned)},
        {"read_gbps", r.scan_pairs.read_gbps},
        {"read_stat", scanned ? "median of cold reads of the scan's bytes, one right before each decode scan"
                              : "median of the eviction reads during the decode calls"},
        {"read_pattern", r.scan_pairs.pattern},
        {"index_scan_ratio", LimitJson(scan_gbps, r.scan_pairs.read_gbps, scanned)},
        {"index_scan_pair_ratio_median", Nullable(r.scan_pairs.ratio, scanned && r.scan_pairs.pairs > 0)},
        {"fast_regime_pairs", r.scan_pairs.fast_pairs},
        {"fast_regime_ratio", Nullable(r.scan_pairs.fast_ratio, scanned && r.scan_pairs.fast_pairs > 0)},
        {"read_gbps_best", r.best_read_gbps},
        {"read_pattern_best", m.best_read_pattern},
        {"index_scan_ratio_best", LimitJson(scan_gbps, r.best_read_gbps, scanned)},
        {"attention_ms_ratio_4k", Nullable(r.ratio_4k.value_or(0), r.ratio_4k.has_value())},
        {"decode_calls", r.decode_calls},
        {"dense_decode_calls", r.dense_decode_calls},
        {"prefill_calls", r.prefill_calls},
        {"dense_prefill_calls", r.dense_prefill_calls},
        {"kv_bytes", r.kv_bytes},
        {"index_bytes", r.index_bytes},
        {"evict_bytes", m.evict_bytes},
        {"stat", "median (*_min_ms: fastest call)"},
        {"check", r.check},
        {"loadavg", r.loadavg},
        {"cpu", cpu},
        {"simd_target", target},
        {"commit", M3_COMMIT},
    };
    std::fprintf(out, "%s\n", j.dump().c_str());
  }
}

void PrintTable(const std::vector<Row>& rows, const std::string& header, FILE* out) {
  std::fprintf(out, "%s\n", header.c_str());
  std::fprintf(out, "%7s %-5s %-4s | %9s %9s %9s %7s | %10s %10s %7s | %8s %7s %6s %9s | %7s %6s | %7s %5s\n",
               "context", "index", "kv", "indexer", "attn", "dense", "speedup", "prefill", "dense pf", "speedup", "scan",
               "read", "ratio", "fast", "best", "/best", "attn/4K", "load");
  std::fprintf(out, "%7s %-5s %-4s | %9s %9s %9s %7s | %10s %10s %7s | %8s %7s %6s %9s | %7s %6s | %7s %5s\n", "",
               "keys", "", "ms", "ms", "ms", "", "ms", "ms", "", "GB/s", "GB/s", "", "ratio/n", "GB/s", "", "", "");
  for (const Row& r : rows) {
    char scan[32] = "-", ratio[32] = "-", fast[32] = "-", best[32] = "-", r4k[32] = "-";
    if (r.index_scan_bytes > 0) {
      const double gbps = static_cast<double>(r.index_scan_bytes) / (r.indexer_ms * 1e-3) / 1e9;
      std::snprintf(scan, sizeof scan, "%.2f", gbps);
      std::snprintf(ratio, sizeof ratio, "%s", LimitCell(gbps, r.scan_pairs.read_gbps).c_str());
      if (r.scan_pairs.fast_pairs > 0)
        std::snprintf(fast, sizeof fast, "%.3f/%zu", r.scan_pairs.fast_ratio, r.scan_pairs.fast_pairs);
      std::snprintf(best, sizeof best, "%s", LimitCell(gbps, r.best_read_gbps).c_str());
    }
    if (r.ratio_4k) std::snprintf(r4k, sizeof r4k, "%.3f", *r.ratio_4k);
    std::fprintf(out,
                 "%7s %-5s %-4s | %9.3f %9.3f %9.3f %7.2f | %10.2f %10.2f %7.2f | %8s %7.2f %6s %9s | %7.2f %6s | %7s "
                 "%5.2f%s\n",
                 ContextName(r.context).c_str(), simd::CacheTypeName(r.index_type), simd::CacheTypeName(r.kv_type),
                 r.indexer_ms, r.attention_ms, r.dense_attention_ms,
                 r.dense_attention_ms / (r.indexer_ms + r.attention_ms), r.prefill_ms, r.dense_prefill_ms,
                 r.dense_prefill_ms / r.prefill_ms, scan, r.scan_pairs.read_gbps, ratio, fast, r.best_read_gbps, best,
                 r4k, r.loadavg, r.check == "ok" ? "" : "  CHECK FAILED");
  }
}

// ---------------------------------------------------------------------------------------------
// The plan: sizes and repetitions (MakePlan), the threads and the cache types.

// Checks the options and resolves them; on bad options says so on `log` and returns nothing.
std::optional<Plan> PlanRun(const AttentionBenchOptions& options, FILE* log) {
  Plan plan = MakePlan(options, L3Bytes(), SharedL3Bytes());
  plan.threads = ResolveThreadCount(options.threads);
  plan.index_types = options.index_types;
  if (plan.index_types.empty()) plan.index_types = {CacheType::kF32};
  plan.kv_type = options.kv_type;
  for (size_t c : plan.contexts)
    if (c == 0) {
      std::fprintf(log, "m3 bench --attention: contexts must be positive\n");
      return std::nullopt;
    }
  if (plan.chunk == 0) {
    std::fprintf(log, "m3 bench --attention: --chunk must be positive\n");
    return std::nullopt;
  }
  return plan;
}

// ---------------------------------------------------------------------------------------------
// The run: per context its K/V caches and dense figures, then per index-key type its sparse row.

// Something the run could not measure: to the log as it happens, and to the table's notes.
void Skip(const char* note, Measured* m, FILE* log) {
  std::fprintf(log, "m3 bench --attention: %s\n", note);
  m->notes.push_back(note);
}

// The layer (MiniMax-M3's sparse-attention shapes), its queries and output buffers: the same for
// every context.
struct Layer {
  ThreadConfig tc;
  SparseParams sp;
  AttentionParams ap;
  // kDecodeQueries decode queries (one per repetition in turn) and one prefill chunk's.
  std::vector<float> decode_q, decode_iq, prefill_q, prefill_iq;
  std::vector<float> attn_out, dense_out;
};

constexpr size_t kQWidth = kHeads * kHeadDim, kIqWidth = kIndexHeads * kIndexDim, kKvWidth = kKvHeads * kHeadDim;

Layer MakeLayer(const Plan& plan) {
  Layer L;
  L.tc = ThreadConfig{plan.threads};
  L.sp.num_index_heads = static_cast<int>(kIndexHeads);
  L.sp.index_dim = static_cast<int>(kIndexDim);
  L.sp.block_size = static_cast<int>(kBlock);
  L.sp.topk_blocks = static_cast<int>(kTopk);
  L.sp.init_blocks = static_cast<int>(shapes::kInitBlocks);
  L.sp.local_blocks = static_cast<int>(shapes::kLocalBlocks);
  L.ap.num_heads = static_cast<int>(kHeads);
  L.ap.num_kv_heads = static_cast<int>(kKvHeads);
  L.ap.head_dim = static_cast<int>(kHeadDim);
  L.ap.num_index_heads = static_cast<int>(kIndexHeads);
  L.ap.block_size = static_cast<int>(kBlock);
  const size_t max_chunk = std::min(plan.chunk, *std::max_element(plan.contexts.begin(), plan.contexts.end()));
  L.decode_q = RandomRows(1, kDecodeQueries, kQWidth);
  L.decode_iq = RandomRows(2, kDecodeQueries, kIqWidth);
  L.prefill_q = RandomRows(3, max_chunk, kQWidth);
  L.prefill_iq = RandomRows(4, max_chunk, kIqWidth);
  L.attn_out.resize(max_chunk * kQWidth);
  L.dense_out.resize(max_chunk * kQWidth);
  return L;
}

// One context: its positions (decode at context-1, the prefill chunk at the end), its K/V caches
// and the dense figures, which do not depend on the index keys.
struct Context {
  size_t context = 0, chunk = 0, pages = 0, kv_bytes = 0;
  int64_t pos = 0, pos0 = 0;
  std::optional<KvPages> k, v;
  std::vector<double> dense_decode, dense_prefill;  // seconds per call
};

// The caches of a context, unless they need more than half of the available memory (the index
// caches of the types are made one at a time; the probe buffer is already counted) or do not fit.
bool MakeCaches(const Plan& plan, const Layer& L, size_t context, Context* c, Measured* m, FILE* log) {
  c->context = context;
  c->chunk = std::min(plan.chunk, context);
  c->pages = (context + kBlock - 1) / kBlock;
  c->kv_bytes = 2 * c->pages * kBlock * KvPages::BytesPerRow(kKvHeads, kHeadDim, plan.kv_type);
  size_t max_index_bytes = 0;
  for (CacheType t : plan.index_types)
    max_index_bytes = std::max(max_index_bytes, c->pages * kBlock * IndexKeyPages::BytesPerRow(kIndexDim, t));
  const uint64_t available = MemAvailable();
  if (available > 0 && c->kv_bytes + max_index_bytes > available / 2) {
    char note[256];
    std::snprintf(note, sizeof note,
                  "context %zu skipped: its caches need %.2f GB, more than half of MemAvailable (%.2f GB)", context,
                  static_cast<double>(c->kv_bytes + max_index_bytes) / 1e9, static_cast<double>(available) / 1e9);
    Skip(note, m, log);
    return false;
  }
  try {
    c->k.emplace(kKvHeads, kHeadDim, kBlock, plan.kv_type, KvLayout::kTransposed);  // as KvCache stores K
    c->v.emplace(kKvHeads, kHeadDim, kBlock, plan.kv_type);
    FillCache(*c->k, context, kKvWidth, 10, L.tc);
    FillCache(*c->v, context, kKvWidth, 11, L.tc);
  } catch (const std::bad_alloc&) {
    char note[160];
    std::snprintf(note, sizeof note, "context %zu skipped: out of memory for its K/V caches", context);
    Skip(note, m, log);
    return false;
  }
  c->pos = static_cast<int64_t>(context) - 1;
  c->pos0 = static_cast<int64_t>(context - c->chunk);
  return true;
}

// Dense decode and prefill: once per context. One untimed call first reads all of K and V (on VMs
// the first read of fresh memory is slower).
void MeasureDense(const Plan& plan, Layer* L, ColdReads* cold, Context* c) {
  Attention(L->tc, L->ap, L->decode_q.data(), *c->k, *c->v, c->pos, 1, nullptr, L->dense_out.data());
  plan.dense_decode.Run([&](size_t i) {
    cold->Evict();
    const auto t0 = Clock::now();
    Attention(L->tc, L->ap, L->decode_q.data() + (i % kDecodeQueries) * kQWidth, *c->k, *c->v, c->pos, 1, nullptr,
              L->dense_out.data());
    c->dense_decode.push_back(Seconds(t0, Clock::now()));
  });
  plan.dense_prefill.Run([&](size_t) {
    cold->Evict();
    const auto t0 = Clock::now();
    Attention(L->tc, L->ap, L->prefill_q.data(), *c->k, *c->v, c->pos0, c->chunk, nullptr, L->dense_out.data());
    c->dense_prefill.push_back(Seconds(t0, Clock::now()));
  });
  cold->TakePaired();
}

// A row's fields from its context: sizes and the dense figures.
Row ContextRow(const Plan& plan, const Context& c, CacheType index_type) {
  Row row;
  row.context = c.context;
  row.chunk = c.chunk;
  row.index_type = index_type;
  row.kv_type = plan.kv_type;
  row.kv_bytes = c.kv_bytes;
  row.dense_attention_ms = Ms(c.dense_decode);
  row.dense_attention_min_ms = MinMs(c.dense_decode);
  row.dense_prefill_ms = Ms(c.dense_prefill);
  row.dense_decode_calls = c.dense_decode.size();
  row.dense_prefill_calls = c.dense_prefill.size();
  return row;
}

// Sparse decode, cold: SelectBlocks then Attention on its selection, a new query each call. Each
// scan that reads keys is paired with a timed read of as many cold bytes right before it.
void MeasureSparseDecode(const Plan& plan, const Context& c, const IndexKeyPages& index_keys, Layer* L,
                         ColdReads* cold, BlockSelection* sel, Row* row) {
  std::vector<double> indexer, attention;
  plan.decode.Run([&](size_t i) {
    const size_t qi = i % kDecodeQueries;
    cold->Evict();
    if (row->index_scan_bytes > 0) cold->ReadLike(row->index_scan_bytes);
    const auto t0 = Clock::now();
    SelectBlocks(L->tc, L->sp, L->decode_iq.data() + qi * kIqWidth, index_keys, c.pos, 1, sel);
    const auto t1 = Clock::now();
    if (row->index_scan_bytes > 0) cold->Pair(static_cast<double>(row->index_scan_bytes) / Seconds(t0, t1) / 1e9);
    cold->Evict();
    const auto t2 = Clock::now();
    Attention(L->tc, L->ap, L->decode_q.data() + qi * kQWidth, *c.k, *c.v, c.pos, 1, sel, L->attn_out.data());
    const auto t3 = Clock::now();
    indexer.push_back(Seconds(t0, t1));
    attention.push_back(Seconds(t2, t3));
  });
  row->scan_pairs = cold->TakePaired();
  row->indexer_ms = Ms(indexer);
  row->attention_ms = Ms(attention);
  row->indexer_min_ms = MinMs(indexer);
  row->attention_min_ms = MinMs(attention);
  row->decode_calls = indexer.size();
}

// Sparse prefill of the chunk, cold: SelectBlocks then Attention on the selection.
void MeasureSparsePrefill(const Plan& plan, const Context& c, const IndexKeyPages& index_keys, Layer* L,
                          ColdReads* cold, BlockSelection* sel, Row* row) {
  std::vector<double> pf_indexer, pf_attention, pf_total;
  plan.prefill.Run([&](size_t) {
    cold->Evict();
    const auto t0 = Clock::now();
    SelectBlocks(L->tc, L->sp, L->prefill_iq.data(), index_keys, c.pos0, c.chunk, sel);
    const auto t1 = Clock::now();
    Attention(L->tc, L->ap, L->prefill_q.data(), *c.k, *c.v, c.pos0, c.chunk, sel, L->attn_out.data());
    const auto t2 = Clock::now();
    pf_indexer.push_back(Seconds(t0, t1));
    pf_attention.push_back(Seconds(t1, t2));
    pf_total.push_back(Seconds(t0, t2));
  });
  cold->TakePaired();
  row->prefill_indexer_ms = Ms(pf_indexer);
  row->prefill_attention_ms = Ms(pf_attention);
  row->prefill_ms = Ms(pf_total);
  row->prefill_calls = pf_total.size();
}

// The row of one index-key type at a context: its index keys filled (skipped when they do not
// fit), the decode selection checked (and the sparse result against the dense one where every
// block is selected), decode and prefill timed, then the prefill checked likewise. A failed
// check is logged and makes the run's status 1.
void MeasureSparse(const Plan& plan, const Context& c, CacheType index_type, Layer* L, ColdReads* cold, Measured* m,
                   FILE* log) {
  Row row = ContextRow(plan, c, index_type);
  std::optional<IndexKeyPages> index_keys;
  try {
    index_keys.emplace(kIndexDim, kBlock, index_type);
    FillCache(*index_keys, c.context, kIndexDim, 12, L->tc);
  } catch (const std::bad_alloc&) {
    char note[160];
    std::snprintf(note, sizeof note, "context %zu, index keys %s skipped: out of memory", c.context,
                  simd::CacheTypeName(index_type));
    Skip(note, m, log);
    return;
  }
  row.index_bytes = index_keys->bytes();
  // Below topk * block visible keys every block is selected and SelectBlocks reads no key.
  row.index_scan_bytes = c.context > kTopk * kBlock ? IndexKeyPages::BytesPerRow(kIndexDim, index_type) * c.context : 0;

  BlockSelection sel;
  SelectBlocks(L->tc, L->sp, L->decode_iq.data(), *index_keys, c.pos, 1, &sel);  // untimed: first read
  if (!SelectionOk(sel, c.pos, 1)) row.check = "decode selection";
  if (c.pages <= kTopk) {  // everything selected: the sparse result is the dense one
    Attention(L->tc, L->ap, L->decode_q.data(), *c.k, *c.v, c.pos, 1, nullptr, L->dense_out.data());
    Attention(L->tc, L->ap, L->decode_q.data(), *c.k, *c.v, c.pos, 1, &sel, L->attn_out.data());
    if (!Close(L->attn_out.data(), L->dense_out.data(), kQWidth))
      row.check = "sparse decode != dense";
  }

  MeasureSparseDecode(plan, c, *index_keys, L, cold, &sel, &row);
  MeasureSparsePrefill(plan, c, *index_keys, L, cold, &sel, &row);
  if (!SelectionOk(sel, c.pos0, c.chunk)) row.check = "prefill selection";
  if (c.pages <= kTopk) {
    Attention(L->tc, L->ap, L->prefill_q.data(), *c.k, *c.v, c.pos0, c.chunk, nullptr, L->dense_out.data());
    if (!Close(L->attn_out.data(), L->dense_out.data(), c.chunk * kQWidth))
      row.check = "sparse prefill != dense";
  }

  row.loadavg = LoadAverage();
  if (row.check != "ok") {
    std::fprintf(log, "m3 bench --attention: context %zu, index keys %s: check failed: %s\n", c.context,
                 simd::CacheTypeName(index_type), row.check.c_str());
    m->status = 1;
  }
  m->rows.push_back(row);
}

// Every context of the plan in turn, cold, then the figures that relate the rows: the run's best
// read sample for every row, and attention time relative to 4K of the same index-key type.
Measured Measure(const Plan& plan, FILE* log) {
  Measured m;
  m.load_start = LoadAverage();
  ColdReads cold(plan.probe_bytes, plan.probe_chunk, plan.evict_bytes, plan.threads);
  cold.Probe(plan.probe_reps);
  Layer L = MakeLayer(plan);
  for (const size_t context : plan.contexts) {
    Context c;
    if (!MakeCaches(plan, L, context, &c, &m, log)) continue;
    cold.Probe(1);
    MeasureDense(plan, &L, &cold, &c);
    for (CacheType index_type : plan.index_types) MeasureSparse(plan, c, index_type, &L, &cold, &m, log);
  }
  for (Row& r : m.rows) {
    r.best_read_gbps = cold.best().best;
    for (const Row& base : m.rows)
      if (base.context == kRatioContext && base.index_type == r.index_type && base.attention_ms > 0)
        r.ratio_4k = r.attention_ms / base.attention_ms;
  }
  m.evict_bytes = cold.evict_bytes();
  m.buffer_bytes = cold.buffer_bytes();
  m.probe_chunk = cold.probe_chunk();
  m.best_read_pattern = cold.best().pattern;
  return m;
}

// ---------------------------------------------------------------------------------------------
// The report: the plot where asked, then JSON lines or the header, the table and the notes.

std::string Header(const AttentionBenchOptions& options, const Plan& plan, const Measured& m) {
  char header[4096];
  std::snprintf(
      header, sizeof header,
      "m3 bench --attention%s\ncpu %s | simd %s | commit %s | %d threads | L3 %.1f MiB | load at start %.2f\n"
      "one sparse layer: 64 q heads, 4 kv heads x 128, indexer 4 heads x 128, blocks of 128, top-16 (init 0, local 1); "
      "random caches, kv %s\n"
      "decode: 1 token at position context-1 (median of >= %d calls, a new random query each); prefill: %zu queries "
      "at the end of the context (median of >= %d calls; dense fewer when slow)\n"
      "cold: before every timed call an untimed read of %zu MiB evicts the caches, as the weights and the other "
      "sparse layers of a real decode step do\n"
      "indexer = SelectBlocks | attn = Attention on the selection | dense = Attention over every key | speedup = "
      "dense / (indexer + attn), dense prefill / prefill\n"
      "scan = index-key bytes of the decode scan / indexer time (- : <= 16 blocks, nothing scanned) | read = median "
      "of cold reads of as many bytes, one right before each decode scan (the limit, as --kernels pairs a GEMV; the "
      "host's bandwidth switches between regimes, so the read at the moment of the work is its yardstick; rows "
      "without a scan: the eviction reads) | ratio = scan / read | fast = median scan / read over the calls whose "
      "read was >= %.1fx read (the host's fast regime) and their number | best = best read sample of the run (%zu "
      "MiB buffer, %zu MiB chunks, as --kernels read_bw) | /best = scan / best\n"
      "attn/4K = attn / attn at 4K (same index-key type)\n",
      options.quick ? " --quick (small contexts, few calls: figures are not meaningful)" : "", CpuModel().c_str(),
      simd::ActiveTargetName().c_str(), M3_COMMIT, plan.threads, static_cast<double>(plan.shared_l3) / (1 << 20),
      m.load_start, simd::CacheTypeName(options.kv_type), plan.decode.min_calls, plan.chunk, plan.prefill.min_calls,
      m.evict_bytes >> 20, PairedSamples::kFastRegime, m.buffer_bytes >> 20, m.probe_chunk >> 20);
  return header;
}

void PrintReport(const AttentionBenchOptions& options, const Plan& plan, const Measured& m, FILE* out, FILE* log) {
  std::string plot_note;
  if (!options.plot.empty()) plot_note = WritePlot(m.rows, plan.index_types, plan.threads, options.plot);

  if (options.json) {
    PrintJson(m, plan.threads, out);
  } else {
    PrintTable(m.rows, Header(options, plan, m), out);
    for (const std::string& n : m.notes) std::fprintf(out, "note: %s\n", n.c_str());
    if (!plot_note.empty()) std::fprintf(out, "%s\n", plot_note.c_str());
  }
  std::fflush(out);  // before the note, so that the two streams do not interleave in one file
  if (!plot_note.empty() && options.json) std::fprintf(log, "m3 bench --attention: %s\n", plot_note.c_str());
}

}  // namespace

int RunAttentionBench(const AttentionBenchOptions& options, FILE* out, FILE* log) {
  const std::optional<Plan> plan = PlanRun(options, log);
  if (!plan) return 2;
  const Measured m = Measure(*plan, log);
  PrintReport(options, *plan, m, out, log);
  return m.status;
}

}  // namespace m3::bench
