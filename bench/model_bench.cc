// `m3 bench` end to end (model_bench.h): the plan and the measured run; the report is in
// model_bench_report.cc.
#include "model_bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench/bandwidth.h"
#include "bench/limits.h"
#include "bench/model_bench_internal.h"
#include "bench/shapes.h"
#include "bench/synthetic_model.h"
#include "ops/context.h"
#include "simd/kernels.h"
#include "ops/matmul.h"
#include "platform/memory.h"
#include "platform/parallel.h"
#include "simd/quant_kernels.h"
#include "runtime/engine.h"
#include "simd/weight_format.h"

namespace m3::bench {
namespace {

namespace fs = std::filesystem;
using simd::WeightFormat;
using simd::WeightRef;

// ---------------------------------------------------------------------------------------------
// What one token reads, from the bound weights.

// Calls fn(pointer, bytes) for the stored bytes of a weight (codes or values, then scales).
template <class Fn>
void ForEachRange(const WeightRef& w, Fn&& fn) {
  if (!w.data) return;
  if (simd::IsTiled(w.format)) {
    fn(static_cast<const uint8_t*>(w.data), simd::TiledCodeBytes(w));
    if (w.scales && simd::TiledScaleBytes(w)) fn(w.scales, simd::TiledScaleBytes(w));
    return;
  }
  fn(static_cast<const uint8_t*>(w.data), w.rows * w.cols * simd::ElementBytes(w.format));
  if (w.format == WeightFormat::kE4M3Mx32 && w.scales) fn(w.scales, w.rows * w.scale_cols());
}

uint64_t MatrixBytes(const WeightRef& w) {
  uint64_t total = 0;
  ForEachRange(w, [&](const uint8_t*, size_t n) { total += n; });
  return total;
}
int64_t Params(const WeightRef& w) { return static_cast<int64_t>(w.rows * w.cols); }
uint64_t VectorBytes(const std::vector<float>& v) { return v.size() * sizeof(float); }

struct Footprint {
  uint64_t fixed_bytes = 0;        // read by every decode token, routed experts aside
  uint64_t layers_fixed_bytes = 0; // the part of fixed_bytes in the layers
  uint64_t lm_head_bytes = 0;
  int64_t layer_params = 0;        // per token in all layers, top-k routed experts included
  int64_t lm_head_params = 0;
  int64_t embed_row_params = 0;
  int64_t last_layer_kv_params = 0;  // the last layer's k, v and index-key projections
  int64_t routed_params = 0, moe_params = 0;  // per token: the top-k routed experts; they and the shared ones
  std::vector<std::vector<uint64_t>> expert_bytes;  // [layer][expert]
  std::vector<std::pair<const uint8_t*, size_t>> ranges;  // every matrix's bytes (to read them in)
  uint64_t range_bytes = 0;
};

Footprint MeasureFootprint(const Model& model) {
  const ModelWeights& w = model.weights();
  const ModelConfig& c = model.config();
  Footprint f;
  auto keep = [&](const WeightRef& m) {
    ForEachRange(m, [&](const uint8_t* p, size_t n) {
      f.ranges.emplace_back(p, n);
      f.range_bytes += n;
    });
  };
  auto per_token = [&](const WeightRef& m) {  // a layer matrix every token reads whole
    f.layers_fixed_bytes += MatrixBytes(m);
    f.layer_params += Params(m);
    keep(m);
  };
  auto per_token_vector = [&](const std::vector<float>& v) {
    f.layers_fixed_bytes += VectorBytes(v);
    f.layer_params += static_cast<int64_t>(v.size());
  };
  keep(w.embed);
  f.fixed_bytes += w.embed.rows ? MatrixBytes(w.embed) / w.embed.rows : 0;  // one row
  f.embed_row_params = static_cast<int64_t>(w.embed.cols);
  if (w.lm_head.data != w.embed.data) keep(w.lm_head);
  f.lm_head_bytes = MatrixBytes(w.lm_head) + VectorBytes(w.final_norm);
  f.lm_head_params = Params(w.lm_head) + static_cast<int64_t>(w.final_norm.size());
  f.expert_bytes.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const AttentionWeights& a = L.attn;
    for (const auto* v : {&L.input_norm, &L.post_norm, &a.q_norm, &a.k_norm, &a.index_q_norm, &a.index_k_norm})
      per_token_vector(*v);
    for (const WeightRef* m : {&a.q, &a.k, &a.v, &a.o}) per_token(*m);
    if (l + 1 == w.layers.size())
      f.last_layer_kv_params = Params(a.k) + Params(a.v) + (a.sparse ? Params(a.index_k) : 0);
    if (a.sparse) {
      per_token(a.index_q);
      per_token(a.index_k);
    }
    if (!L.is_moe) {
      for (const WeightRef* m : {&L.mlp.gate, &L.mlp.up, &L.mlp.down}) per_token(*m);
      continue;
    }
    per_token(L.moe.router);
    per_token_vector(L.moe.router_bias);
    if (L.moe.has_shared)
      for (const WeightRef* m : {&L.moe.shared.gate, &L.moe.shared.up, &L.moe.shared.down}) {
        per_token(*m);
        f.moe_params += Params(*m);
      }
    for (const MlpWeights& e : L.moe.experts) {
      f.expert_bytes[l].push_back(MatrixBytes(e.gate) + MatrixBytes(e.up) + MatrixBytes(e.down));
      for (const WeightRef* m : {&e.gate, &e.up, &e.down}) keep(*m);
    }
    if (!L.moe.experts.empty()) {
      const MlpWeights& e = L.moe.experts[0];  // all experts of a layer have one shape
      const int64_t routed = c.experts_per_token * (Params(e.gate) + Params(e.up) + Params(e.down));
      f.layer_params += routed;
      f.routed_params += routed;
      f.moe_params += routed;
    }
  }
  f.fixed_bytes += f.layers_fixed_bytes + f.lm_head_bytes;
  return f;
}

// Sums the bytes of the distinct routed experts each layer's tokens chose: what a decode step
// reads of them (a batched one reads each chosen expert once for all its tokens).
class RoutedExpertBytes : public ForwardObserver {
 public:
  explicit RoutedExpertBytes(const std::vector<std::vector<uint64_t>>& bytes) : bytes_(bytes) {}
  void OnRouting(int layer, int64_t, size_t n, int top_k, const int32_t* ids) override {
    if (layer < 0 || static_cast<size_t>(layer) >= bytes_.size()) return;
    const auto& sizes = bytes_[static_cast<size_t>(layer)];
    std::vector<int32_t> chosen(ids, ids + n * static_cast<size_t>(top_k));
    std::sort(chosen.begin(), chosen.end());
    chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
    for (int32_t id : chosen)
      if (id >= 0 && static_cast<size_t>(id) < sizes.size()) total_ += sizes[static_cast<size_t>(id)];
  }
  uint64_t Take() { return std::exchange(total_, 0); }
  uint64_t Peek() const { return total_; }

 private:
  const std::vector<std::vector<uint64_t>>& bytes_;
  uint64_t total_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The process and the machine.

// Bytes this process caused to be read from storage (/proc/self/io); -1 when unavailable.
int64_t StorageReadBytes() {
  std::ifstream in("/proc/self/io");
  std::string key;
  int64_t v = 0;
  while (in >> key >> v)
    if (key == "read_bytes:") return v;
  return -1;
}

uint64_t PeakRssBytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;  // kilobytes on Linux
}

double LoadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

// Reads every range once, split over the threads: maps the pages and brings the file into the
// page cache, so no page fault or disk read lands inside the timed runs.
void ReadIn(const ThreadConfig& tc, const std::vector<std::pair<const uint8_t*, size_t>>& ranges) {
  constexpr size_t kPiece = size_t{64} << 20;
  std::vector<std::pair<const uint8_t*, size_t>> pieces;
  for (const auto& [p, n] : ranges)
    for (size_t o = 0; o < n; o += kPiece) pieces.emplace_back(p + o, std::min(kPiece, n - o));
  std::vector<uint64_t> sums(pieces.size());
  ParallelFor(tc, pieces.size(), 1, [&](size_t b, size_t e, int) {
    for (size_t i = b; i < e; ++i) sums[i] = StreamRead(pieces[i].first, pieces[i].second);
  });
  static volatile uint64_t sink;
  for (uint64_t v : sums) sink = sink + v;
}

int32_t Argmax(const float* v, size_t n) {  // ties -> lower id; NaN never wins
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (v[i] > v[best] || (std::isnan(v[best]) && !std::isnan(v[i]))) best = i;
  return static_cast<int32_t>(best);
}
int32_t Argmax(const std::vector<float>& v) { return Argmax(v.data(), v.size()); }

bool AllFinite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

double Rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return v.empty() ? 0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Times each layer of a pass as it ends, inside the pass: the clock between two OnLayerEnd calls
// is that layer's (the first one's includes the embedding lookup; a prompt in several chunks adds
// up per layer), and Stop() gives what followed the last layer (final norm, lm_head and the
// caller's argmax). It reads no rows, so the pass keeps its trimmed last layer as without it.
// Also counts the routed experts' bytes of each step (as RoutedExpertBytes).
class LayerClock : public ForwardObserver {
 public:
  LayerClock(int layers, const std::vector<std::vector<uint64_t>>& expert_bytes)
      : layer_s_(static_cast<size_t>(layers)), attention_s_(static_cast<size_t>(layers)), routed_(expert_bytes) {}
  bool SeesEveryRow() const override { return false; }
  void Start() {
    std::fill(layer_s_.begin(), layer_s_.end(), 0.0);
    std::fill(attention_s_.begin(), attention_s_.end(), 0.0);
    last_ = Clock::now();
    layer_start_ = last_;
  }
  // The attention part of a layer: from its start (the previous layer's end) to here; the rest
  // of the layer is its MoE (or MLP) block.
  void OnAttentionEnd(int layer) override {
    if (layer >= 0 && static_cast<size_t>(layer) < attention_s_.size())
      attention_s_[static_cast<size_t>(layer)] += Seconds(layer_start_, Clock::now());
  }
  void OnLayerEnd(int layer, size_t) override {
    const auto now = Clock::now();
    if (layer >= 0 && static_cast<size_t>(layer) < layer_s_.size()) layer_s_[static_cast<size_t>(layer)] += Seconds(last_, now);
    last_ = now;
    layer_start_ = now;
  }
  double Stop() const { return Seconds(last_, Clock::now()); }
  const std::vector<double>& layer_s() const { return layer_s_; }
  const std::vector<double>& attention_s() const { return attention_s_; }
  void OnRouting(int layer, int64_t pos0, size_t n, int top_k, const int32_t* ids) override {
    const uint64_t before = routed_.Peek();
    routed_.OnRouting(layer, pos0, n, top_k, ids);
    if (layer + 1 < static_cast<int>(layer_s_.size())) full_layers_routed_ += routed_.Peek() - before;
  }
  uint64_t TakeRouted() { return routed_.Take(); }
  // The routed experts' bytes of the layers but the last since the last call (the last layer
  // routes only the rows that give logits).
  uint64_t TakeFullLayersRouted() { return std::exchange(full_layers_routed_, 0); }

 private:
  std::vector<double> layer_s_, attention_s_;
  Clock::time_point last_, layer_start_;
  RoutedExpertBytes routed_;
  uint64_t full_layers_routed_ = 0;
};

double Mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return end > begin ? s / static_cast<double>(end - begin) : 0;
}

// Forgets the peak RSS so far ("5" to /proc/self/clear_refs resets the high-water mark that
// getrusage reports), so that a probe buffer freed before the model runs does not count.
bool ResetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.close();
  return static_cast<bool>(f);
}

// The read-bandwidth probe paired step by step with decode, as `m3 bench --kernels` pairs it with
// each GEMV call: right after a step, read as many bytes of the model's own weights as the step
// did, from a cursor cycling through all of them (cold when they are >= 8x L3), the patterns
// alternating. Bandwidth on a shared VM swings by a third from second to second (34 to 60 GB/s
// on the 2-core Zen 4 VM), and a limit sampled at other moments than the decode judges it by noise.
class PairedWeightReads {
 public:
  PairedWeightReads(const std::vector<std::pair<const uint8_t*, size_t>>& ranges, int threads) : threads_(threads) {
    for (const auto& r : ranges)
      if (r.second > 0) ranges_.push_back(r);
  }

  // Returns the read's GB/s.
  double Read(uint64_t bytes, ReadPattern pattern) {
    std::vector<std::pair<const uint8_t*, size_t>> pieces;
    for (uint64_t left = bytes; left > 0 && !ranges_.empty();) {
      const auto& [p, n] = ranges_[range_];
      const size_t take = static_cast<size_t>(std::min<uint64_t>(left, n - offset_));
      pieces.emplace_back(p + offset_, take);
      left -= take;
      offset_ += take;
      if (offset_ == n) offset_ = 0, range_ = (range_ + 1) % ranges_.size();
    }
    // Thread t reads bytes [t * bytes / T, (t + 1) * bytes / T) of the pieces back to back.
    const size_t threads = static_cast<size_t>(threads_);
    std::vector<uint64_t> sums(threads);
    const auto t0 = Clock::now();
    ParallelFor(ThreadConfig{threads_}, threads, 1, [&](size_t b, size_t e, int) {
      for (size_t t = b; t < e; ++t) {
        const uint64_t begin = bytes * t / threads, end = bytes * (t + 1) / threads;
        uint64_t at = 0;
        for (const auto& [p, n] : pieces) {
          const uint64_t lo = std::max(begin, at), hi = std::min<uint64_t>(end, at + n);
          if (lo < hi) sums[t] += StreamRead(p + (lo - at), static_cast<size_t>(hi - lo), pattern);
          at += n;
        }
      }
    });
    const double dt = Seconds(t0, Clock::now());
    static volatile uint64_t sink;
    for (uint64_t v : sums) sink = sink + v;
    return static_cast<double>(bytes) / dt / 1e9;
  }

 private:
  std::vector<std::pair<const uint8_t*, size_t>> ranges_;
  int threads_;
  size_t range_ = 0, offset_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The plan: what a run measures, decided from the options before anything runs.

struct Plan {
  int threads = 0;                // -t, or all cores
  std::vector<int> prompt_threads;  // the prompt again at each of these counts (-t with several)
  std::string model_dir;          // -m; empty: the synthetic model
  SyntheticModelOptions synthetic;
  std::string model_kind, pack_type;  // as Result reports them (pack_type: the generated model's)
  EngineOptions engine;          // the CPU-only run
  std::optional<EngineOptions> offload;  // --gpu dense: the same run again with these
  int prompt_tokens = 0, decode_tokens = 0;
  // Probes before and after the run: read-bandwidth passes, int8 peak loops of peak_seconds.
  int probe_reps = 2;
  double peak_seconds = 0.2;
  // Timed prefills: up to prefill_runs while each takes under prefill_repeat_s (one prefill
  // moves by +-10% from run to run on a shared VM; the median is the figure).
  size_t prefill_runs = 3;
  double prefill_repeat_s = 10;
  // The batched and lookup phases: their prompts' length (a shorter one than the prefill's, to
  // keep them cheap), sequences (1: no batched phase), guesses (0: no lookup phase), steps.
  size_t phase_context = 0;
  int batch = 1, batch_steps = 0;
  int lookup = 0, lookup_steps = 0;
  bool json = false;
};

// Checks the options and resolves them into a plan; the errors name the flags.
StatusOr<Plan> PlanRun(const ModelBenchOptions& o) {
  if (o.prompt_tokens < 1) return InvalidArgument("-p must be >= 1 prompt token, got ", o.prompt_tokens);
  if (o.decode_tokens < 1) return InvalidArgument("-n must be >= 1 decode token, got ", o.decode_tokens);
  if (o.engine.threads < 0) return InvalidArgument("-t must be >= 1 thread, got ", o.engine.threads);
  if (o.batch < 1 || o.batch > 64) return InvalidArgument("--batch must be 1..64 sequences, got ", o.batch);
  if (o.lookup < 0 || o.lookup > 32) return InvalidArgument("--lookup must be 0..32 guesses, got ", o.lookup);
  if (o.layers && (*o.layers < 1 || *o.layers > static_cast<int>(shapes::kLayers)))
    return InvalidArgument("--layers must be 1..", shapes::kLayers, " (the real model has ", shapes::kLayers,
                           " layers), got ", *o.layers);
  Plan p;
  // Under mpirun each rank takes its node's share of the CPUs unless -t says (cluster/expert_parallel.h).
  p.threads = EngineThreads(o.engine);
  for (const int t : o.prompt_threads) {
    if (t < 1) return InvalidArgument("-t must be >= 1 thread, got ", t);
    p.prompt_threads.push_back(ResolveThreadCount(t));
  }
  std::sort(p.prompt_threads.begin(), p.prompt_threads.end());
  p.prompt_threads.erase(std::unique(p.prompt_threads.begin(), p.prompt_threads.end()), p.prompt_threads.end());
  // The model: given, or the synthetic one (generated once).
  if (!o.model_dir.empty()) {
    if (o.layers || o.tiny || !o.cache_dir.empty() || o.type_given)
      return InvalidArgument(
          "--layers, --type, --tiny and --cache-dir describe the generated model; they cannot be used with -m");
    std::error_code ec;
    if (!fs::is_directory(o.model_dir, ec)) return NotFound(o.model_dir, ": no such model folder");
    p.model_dir = o.model_dir;
    p.model_kind = "given";
  } else {
    p.synthetic.layers = o.layers.value_or(0);
    p.synthetic.tiny = o.tiny;
    p.synthetic.type = o.type;
    p.synthetic.cache_dir = o.cache_dir;
    p.synthetic.threads = p.threads;
    p.model_kind = o.tiny ? "synthetic-tiny" : "synthetic";
    p.pack_type = PackTypeName(o.type);
  }
  p.engine = o.engine;
  p.engine.threads = p.threads;
  if (!o.engine.gpu.empty() && o.engine.gpu != "none") {
    p.offload = p.engine;
    p.engine.gpu.clear();
  }
  p.prompt_tokens = o.prompt_tokens;
  p.decode_tokens = o.decode_tokens;
  p.phase_context = std::min<size_t>(static_cast<size_t>(o.prompt_tokens), 64);
  p.batch = o.batch;
  if (o.batch > 1) p.batch_steps = std::max(1, std::min(o.decode_tokens, 64));
  p.lookup = o.lookup;
  if (o.lookup > 0) p.lookup_steps = std::max(1, std::min(o.decode_tokens, 32));
  p.json = o.json;
  return p;
}

// ---------------------------------------------------------------------------------------------
// The run, phase by phase; each fills its part of the Result.

// Random ids from one fixed-seed stream (prefill, then the batched and lookup phases' prompts).
class RandomIds {
 public:
  explicit RandomIds(int vocab_size) : vocab_size_(vocab_size) {}
  std::vector<int32_t> Next(size_t n) {
    std::vector<int32_t> ids(n);
    for (int32_t& id : ids) {
      s_ = s_ * 6364136223846793005ull + 1442695040888963407ull;
      id = static_cast<int32_t>((s_ >> 33) % static_cast<uint64_t>(vocab_size_));
    }
    return ids;
  }

 private:
  int vocab_size_;
  uint64_t s_ = 0x5EED;
};

// What the phases share: the engine and the decode session (prefilled by the prefill phase), the
// weights' footprint, the id stream, the prompt, the last logits and the layer clock.
struct Bench {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Session> session;
  Footprint fp;
  std::unique_ptr<RandomIds> ids;
  std::vector<int32_t> prompt;
  std::vector<float> logits;
  std::unique_ptr<LayerClock> clock;
};

// A layer's share of the active parameters per token.
double PerLayerParams(const Footprint& fp, int layers) {
  return static_cast<double>(fp.layer_params) / std::max(1, layers);
}
// What a decode token reads outside the layers (an embedding row, final norm and lm_head).
double OutsideLayerBytes(const Footprint& fp) { return static_cast<double>(fp.fixed_bytes - fp.layers_fixed_bytes); }
// Bytes per step of the full model: this model's layers' bytes x 60 / layers + the rest.
double ProjectBytes(double bytes, double outside_layers, int layers) {
  return (bytes - outside_layers) / std::max(1, layers) * static_cast<double>(shapes::kLayers) + outside_layers;
}

// The model folder: the given one, or the synthetic model, generated when not cached.
Status PrepareModel(const Plan& p, Result* r, FILE* log) {
  r->model_kind = p.model_kind;
  r->pack_type = p.pack_type;
  if (!p.model_dir.empty()) {
    r->model_dir = p.model_dir;
    return Status::Ok();
  }
  M3_ASSIGN_OR_RETURN(SyntheticModel sm, EnsureSyntheticModel(p.synthetic, log));
  r->model_dir = sm.dir;
  r->generated = sm.generated;
  r->generation_s = sm.seconds;
  return Status::Ok();
}

// Opens the engine and the decode session; the prompt and the decode must fit its context.
Status OpenEngine(const Plan& p, Bench* b, Result* r) {
  const auto t0 = Clock::now();
  M3_ASSIGN_OR_RETURN(b->engine, Engine::Open(r->model_dir, p.engine));
  r->load_s = Seconds(t0, Clock::now());
  r->numa = NumaModeName(p.engine.numa);
  r->layers = b->engine->model().config().num_layers;
  r->prompt_tokens = p.prompt_tokens;
  r->decode_tokens = p.decode_tokens;
  b->session = std::make_unique<Session>(*b->engine);
  const size_t need = static_cast<size_t>(p.prompt_tokens) + static_cast<size_t>(p.decode_tokens);
  if (need > b->session->max_context())
    return OutOfRange("-p ", p.prompt_tokens, " + -n ", p.decode_tokens, " = ", need,
                      " tokens exceed the model's context of ", b->session->max_context(), " tokens");
  return Status::Ok();
}

// The limits, before the weights are in memory (opening maps them but reads none): the probe
// buffer is freed and forgotten by the peak RSS. Probed again after the run (ProbeLimitsAgain);
// each limit is the best sample of the run.
void ProbeLimits(const Plan& p, Result* r, FILE* log) {
  if (log) std::fprintf(log, "m3 bench: probing the read bandwidth and int8 peak (%d threads)\n", r->threads);
  r->read_bw = ProbeReadBandwidth(r->threads, p.probe_reps);
  r->int8_peak = ProbeInt8Peak(r->threads, p.peak_seconds, p.probe_reps);
  r->peak_rss_reset = ResetPeakRss();
}

// The weights' footprint, and the weights read into memory when they fit (a server keeps them
// resident); else they stream from storage.
void ReadWeightsIn(Bench* b, Result* r, FILE* log) {
  b->fp = MeasureFootprint(b->engine->model());
  const Footprint& fp = b->fp;
  r->weight_bytes = fp.range_bytes;
  r->active_params = fp.layer_params + fp.lm_head_params + fp.embed_row_params;
  const uint64_t available = MemAvailable();
  if (available == 0 || fp.range_bytes < available / 10 * 8) {
    if (log) std::fprintf(log, "m3 bench: reading %s of weights into memory\n", Bytes(static_cast<double>(fp.range_bytes)).c_str());
    const auto t0 = Clock::now();
    ReadIn(ThreadConfig{r->threads}, fp.ranges);
    // Under mpirun the other ranks read their slices of the experts in too.
    if (const cluster::ExpertParallel* ep = b->engine->expert_parallel()) ep->ReadExpertsIn();
    r->read_in_s = Seconds(t0, Clock::now());
    r->read_in = true;
  } else if (log) {
    std::fprintf(log, "m3 bench: the weights (%s) do not fit in available memory (%s): they stream from storage\n",
                 Bytes(static_cast<double>(fp.range_bytes)).c_str(), Bytes(static_cast<double>(available)).c_str());
  }
}

// Prefill: Evals of random ids (fixed seed), last-row logits. An untimed warm-up, then the decode
// session's prefill and more on fresh sessions as the plan allows; the medians are the figures.
// Each run is timed layer by layer as well (LayerClock): the layers but the last run every row
// through attention and MoE; the last layer only the row that gives logits (the others need
// only their keys and values), as in any prompt.
Status MeasurePrefill(const Plan& p, Bench* b, Result* r, FILE* log) {
  b->ids = std::make_unique<RandomIds>(b->engine->model().config().vocab_size);
  b->prompt = b->ids->Next(static_cast<size_t>(p.prompt_tokens));
  if (log)
    std::fprintf(log, "m3 bench: prefill of %d tokens (a warm-up, then up to %zu timed), %d threads\n", p.prompt_tokens,
                 p.prefill_runs, r->threads);
  // Untimed: the first call's allocations and page faults of the session's workspace (activations)
  // and caches, which every later pass of a session reuses (Rewind keeps them).
  M3_RETURN_IF_ERROR(b->session->Eval(b->prompt, LogitsMode::kLastRow, &b->logits));
  M3_RETURN_IF_ERROR(b->session->Rewind(0));
  b->clock = std::make_unique<LayerClock>(r->layers, b->fp.expert_bytes);
  LayerClock& clock = *b->clock;
  std::vector<double> full_layer_s, full_attention_s, last_layer_s, prefill_rest_s, routed_bytes;  // per run
  auto prefill_run = [&](Session& target, std::vector<float>* out) {
    clock.Start();
    const auto t0 = Clock::now();
    M3_RETURN_IF_ERROR(target.Eval(b->prompt, LogitsMode::kLastRow, out, &clock));
    const double rest = clock.Stop();
    r->prefill_s.push_back(Seconds(t0, Clock::now()));
    const std::vector<double>& ls = clock.layer_s();
    if (ls.size() > 1) {
      full_layer_s.push_back(Mean(ls, 0, ls.size() - 1));
      full_attention_s.push_back(Mean(clock.attention_s(), 0, ls.size() - 1));
    }
    last_layer_s.push_back(ls.back());
    prefill_rest_s.push_back(rest);
    clock.TakeRouted();
    routed_bytes.push_back(static_cast<double>(clock.TakeFullLayersRouted()));
    return Status::Ok();
  };
  M3_RETURN_IF_ERROR(prefill_run(*b->session, &b->logits));
  r->logits_finite = AllFinite(b->logits);
  while (r->prefill_s.size() < p.prefill_runs && r->prefill_s.back() < p.prefill_repeat_s) {
    M3_RETURN_IF_ERROR(b->session->Rewind(0));  // the same prompt again: the same logits, the state decode needs
    M3_RETURN_IF_ERROR(prefill_run(*b->session, &b->logits));
  }
  r->ttft_s = Median(r->prefill_s);
  // The parts of the median run (the mean of the two middle ones for an even count), so that they
  // add up to the ttft: medians of each part over the runs need not, when runs are slowed in
  // different parts (a descheduled thread on a shared machine).
  std::vector<size_t> order(r->prefill_s.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return r->prefill_s[a] < r->prefill_s[b]; });
  const size_t h = order.size() / 2;
  const std::vector<size_t> middle =
      order.size() % 2 ? std::vector<size_t>{order[h]} : std::vector<size_t>{order[h - 1], order[h]};
  auto of_middle = [&](const std::vector<double>& v) {
    double sum = 0;
    for (size_t i : middle) sum += v.empty() ? 0.0 : v[i];
    return sum / static_cast<double>(middle.size());
  };
  r->t_layer_prefill_s = of_middle(full_layer_s);  // 0 with one layer: no full layer was run
  r->t_layer_prefill_attention_s = of_middle(full_attention_s);
  r->t_last_layer_prefill_s = of_middle(last_layer_s);
  r->t_rest_prefill_s = of_middle(prefill_rest_s);
  r->prefill_tok_s = p.prompt_tokens / r->ttft_s;
  // The work done: every layer's active parameters for each prompt token but the last layer's,
  // which runs its keys' and values' projections for every token and all of it for the last;
  // lm_head once (last row).
  const Footprint& fp = b->fp;
  const double per_layer_params = PerLayerParams(fp, r->layers);
  r->prefill_ops = 2.0 * (per_layer_params * p.prompt_tokens * (r->layers - 1) +
                          static_cast<double>(fp.last_layer_kv_params) * (p.prompt_tokens - 1) + per_layer_params +
                          static_cast<double>(fp.lm_head_params));
  r->prefill_gops = r->prefill_ops / r->ttft_s / 1e9;
  // The chunks and what one reads: each full layer's fixed matrices once a chunk and the experts
  // its tokens routed to (the union over the chunk's tokens, as the MoE block reads them).
  const size_t chunk = b->session->ChunkFor(static_cast<size_t>(p.prompt_tokens));
  r->prefill_chunk = static_cast<int>(std::min<size_t>(static_cast<size_t>(p.prompt_tokens), chunk));
  r->prefill_chunks = (p.prompt_tokens + r->prefill_chunk - 1) / r->prefill_chunk;
  if (r->layers > 1) {
    const double full_layers = r->layers - 1, chunks = r->prefill_chunks;
    r->layer_bytes_per_chunk = static_cast<double>(fp.layers_fixed_bytes) / r->layers + Median(routed_bytes) / full_layers / chunks;
  }
  r->layer_params_per_token = per_layer_params;
  r->moe_routed_share = fp.moe_params > 0 ? static_cast<double>(fp.routed_params) / static_cast<double>(fp.moe_params) : 0;
  return Status::Ok();
}

// Decode: greedy, one token per Eval on the prefilled session; a step is the Eval and the argmax.
// Each step is followed by its paired read when the weights are resident and large enough to be
// cold. Keeps each step's split (after the last layer, a layer's mean) for the projection.
Status MeasureDecode(const Plan& p, Bench* b, Result* r, std::vector<double>* rest_s,
                     std::vector<double>* layer_mean_s, FILE* log) {
  if (log) std::fprintf(log, "m3 bench: decode of %d tokens\n", p.decode_tokens);
  const Footprint& fp = b->fp;
  LayerClock& clock = *b->clock;
  std::vector<float>& logits = b->logits;
  const bool paired = r->read_in && fp.range_bytes >= ReadProbeBytes(L3Bytes());
  PairedWeightReads pair_reads(fp.ranges, r->threads);
  PairedSamples steps_paired;
  uint64_t routed_total = 0;
  double read_s = 0;
  const int64_t io_before = StorageReadBytes();
  if (cluster::ExpertParallel* ep = b->engine->expert_parallel()) ep->ResetStats();  // the decode's exchanges alone
  int32_t token = Argmax(logits);
  for (int i = 0; i < p.decode_tokens; ++i) {
    clock.Start();
    auto t0 = Clock::now();
    M3_RETURN_IF_ERROR(b->session->Eval(std::span<const int32_t>(&token, 1), LogitsMode::kLastRow, &logits, &clock));
    token = Argmax(logits);
    rest_s->push_back(clock.Stop());
    r->step_s.push_back(Seconds(t0, Clock::now()));
    layer_mean_s->push_back(Mean(clock.layer_s(), 0, clock.layer_s().size()));
    r->logits_finite = r->logits_finite && AllFinite(logits);
    const uint64_t step_routed = clock.TakeRouted();
    routed_total += step_routed;
    if (paired) {
      const uint64_t step_bytes = fp.fixed_bytes + step_routed;
      t0 = Clock::now();
      const double read_gbps = pair_reads.Read(step_bytes, ReadPatternAt(static_cast<size_t>(i)));
      read_s += Seconds(t0, Clock::now());
      steps_paired.Add(ReadPatternAt(static_cast<size_t>(i)), read_gbps,
                       static_cast<double>(step_bytes) / r->step_s.back() / 1e9);
    }
  }
  const int64_t io_after = StorageReadBytes();
  r->logits_rms = Rms(logits);
  double decode_total = 0;
  for (double v : r->step_s) decode_total += v;
  r->decode_tok_s = 1.0 / Median(r->step_s);
  r->decode_tok_s_mean = p.decode_tokens / decode_total;
  r->routed_bytes_per_token = static_cast<double>(routed_total) / p.decode_tokens;
  r->bytes_per_token = static_cast<double>(fp.fixed_bytes) + r->routed_bytes_per_token;
  r->decode_gbps = r->bytes_per_token * r->decode_tok_s / 1e9;
  r->disk_read_bytes = io_before >= 0 && io_after >= io_before ? io_after - io_before : 0;
  r->disk_read_mbps = static_cast<double>(r->disk_read_bytes) / (decode_total + read_s) / 1e6;
  r->steps_paired = steps_paired.Summarize();
  r->peak_rss = PeakRssBytes();  // before the second probe's buffer
  return Status::Ok();
}

// The projection: this run's time per layer x 60 + the rest (final norm, lm_head, argmax),
// medians over the steps of each step's split (decode), over the runs (prefill: 59 full layers,
// the last one as measured).
void Project(const Plan& p, const Footprint& fp, const std::vector<double>& rest_s,
             const std::vector<double>& layer_mean_s, Result* r) {
  r->t_rest_s = Median(rest_s);
  r->t_layer_s = Median(layer_mean_s);
  r->projected_tok_s = 1.0 / (r->t_layer_s * static_cast<double>(shapes::kLayers) + r->t_rest_s);
  const double outside_layers = OutsideLayerBytes(fp);
  r->lm_head_bytes = static_cast<double>(fp.lm_head_bytes);
  r->layer_bytes_per_token = (r->bytes_per_token - outside_layers) / std::max(1, r->layers);
  r->layer_share = r->bytes_per_token > 0 ? (r->bytes_per_token - outside_layers) / r->bytes_per_token : 0;
  if (r->t_layer_prefill_s > 0) {
    r->projected_prefill_tok_s =
        p.prompt_tokens / (r->t_layer_prefill_s * static_cast<double>(shapes::kLayers - 1) + r->t_last_layer_prefill_s +
                           r->t_rest_prefill_s);
    r->layer_prefill_gops = 2.0 * PerLayerParams(fp, r->layers) * p.prompt_tokens / r->t_layer_prefill_s / 1e9;
  }
  r->projected_bytes_per_token = ProjectBytes(r->bytes_per_token, outside_layers, r->layers);
  r->layer_share_full = r->projected_bytes_per_token > 0
                            ? (r->projected_bytes_per_token - outside_layers) / r->projected_bytes_per_token
                            : 0;
}

// Expert parallelism (mpirun -np N): the decode phase's exchanges (its stats, reset when it
// began), the exchanges alone, and the projection for 2-8 ranks from the measured parts of a
// layer: attention and the rest outside the MoE block, the block's compute (rank 0's share times
// the ranks, split evenly over N), the exchanges at this run's rank count. Ranks that share one
// host share its memory bandwidth: on separate servers each rank's share runs faster.
Status MeasureDist(const Footprint& fp, const std::vector<double>& layer_mean_s, Bench* b, Result* r, FILE* log) {
  const cluster::ExpertParallel* ep = b->engine->expert_parallel();
  if (!ep) return Status::Ok();
  DistResult& d = r->dist;
  d.ran = true;
  d.ranks = ep->ranks();
  d.ranks_described = ep->Describe();
  const cluster::ExchangeStats st = ep->stats();
  const double tokens = std::max(1, r->decode_tokens), blocks = static_cast<double>(std::max<uint64_t>(1, st.blocks));
  const double wait_s = st.send_s + st.activations_s + st.outputs_s;
  double decode_s = 0;
  for (double v : r->step_s) decode_s += v;
  d.bytes_per_token = static_cast<double>(st.bytes) / tokens;
  d.bytes_per_layer = static_cast<double>(st.bytes) / blocks;
  d.wait_s_per_token = wait_s / tokens;
  d.wait_share = decode_s > 0 ? wait_s / decode_s : 0;
  d.block_s = st.total_s / blocks;
  d.compute_s = (st.total_s - wait_s) / blocks;
  d.rest_of_layer_s = std::max(0.0, Median(layer_mean_s) - d.block_s);
  if (log) std::fprintf(log, "m3 bench: timing the exchanges of one MoE layer alone (%d ranks)\n", d.ranks);
  std::vector<double> probes;
  for (int i = 0; i < 5; ++i) {
    M3_ASSIGN_OR_RETURN(const auto probe, ep->ProbeExchange(1, 20));
    probes.push_back(probe.first);
  }
  d.exchange_s = Median(probes);
  // Whole experts per rank, to compare: its exchanges, and how much longer its slowest rank works.
  probes.clear();
  for (int i = 0; i < 5; ++i) {
    M3_ASSIGN_OR_RETURN(const auto probe, ep->ProbeExchange(1, 20, cluster::MoeSplitKind::kWholeExperts));
    probes.push_back(probe.first);
    d.whole_bytes_per_layer = static_cast<double>(probe.second);
  }
  d.whole_exchange_s = Median(probes);
  {
    const ModelConfig& c = b->engine->model().config();
    std::mt19937 rng(7);
    std::vector<int> experts(static_cast<size_t>(c.num_experts));
    double slowest = 0;
    const int draws = 100000;
    for (int t = 0; t < draws; ++t) {
      std::iota(experts.begin(), experts.end(), 0);
      std::vector<int> load(static_cast<size_t>(d.ranks), 0);
      for (int k = 0; k < c.experts_per_token; ++k) {  // k distinct experts, uniformly
        std::uniform_int_distribution<int> pick(k, c.num_experts - 1);
        std::swap(experts[static_cast<size_t>(k)], experts[static_cast<size_t>(pick(rng))]);
        ++load[static_cast<size_t>(experts[static_cast<size_t>(k)] % d.ranks)];
      }
      slowest += *std::max_element(load.begin(), load.end());
    }
    d.whole_slowest_share = slowest / draws / (static_cast<double>(c.experts_per_token) / d.ranks);
  }
  uint64_t expert_bytes = 0;  // rank 0's slices of one layer's experts
  for (const auto& layer : fp.expert_bytes)
    for (uint64_t e : layer) expert_bytes += e;
  const double per_layer = static_cast<double>(expert_bytes) / std::max(1, r->layers);
  d.expert_bytes_per_rank_full = per_layer * static_cast<double>(shapes::kLayers - shapes::kDenseLayers);
  const double compute_all = d.compute_s * d.ranks;  // the block's compute on one process
  for (int n : {2, 4, 8}) {
    const double layer = d.rest_of_layer_s + compute_all / n + d.exchange_s;
    d.projected_tok_s.emplace_back(n, 1.0 / (layer * static_cast<double>(shapes::kLayers) + r->t_rest_s));
  }
  return Status::Ok();
}

// A phase's steps, each paired with a greedy single step of a lone session at the same context
// (the phase's yardstick), alternating which goes first. What a phase step reads: the fixed
// weights once, each routed-to expert once (the union of its tokens' choices).
class PairedSteps {
 public:
  PairedSteps(const Footprint& fp, Session& lone, int32_t lone_token, std::vector<float>* logits)
      : fp_(fp), routed_(fp.expert_bytes), lone_(lone), lone_token_(lone_token), logits_(logits) {}

  // The observer a phase step passes to its pass, to count the experts it routes to.
  ForwardObserver* routed() { return &routed_; }

  // Step k: the phase's `step` (timed, with its bytes) and a single step, the phase's first when
  // k is even.
  template <class Step>
  Status Run(int k, Step&& step) {
    if (k % 2 == 0) {
      M3_RETURN_IF_ERROR(TimePhaseStep(step));
      return SingleStep();
    }
    M3_RETURN_IF_ERROR(SingleStep());
    return TimePhaseStep(step);
  }

  // Medians over the steps.
  double step_s() const { return Median(step_s_); }
  double single_step_s() const { return Median(single_s_); }
  double bytes_per_step() const { return Median(bytes_); }

 private:
  template <class Step>
  Status TimePhaseStep(Step& step) {
    const auto t = Clock::now();
    M3_RETURN_IF_ERROR(step());
    step_s_.push_back(Seconds(t, Clock::now()));
    bytes_.push_back(static_cast<double>(fp_.fixed_bytes + routed_.Take()));
    return Status::Ok();
  }
  Status SingleStep() {
    const auto t = Clock::now();
    M3_RETURN_IF_ERROR(lone_.Eval(std::span<const int32_t>(&lone_token_, 1), LogitsMode::kLastRow, logits_));
    lone_token_ = Argmax(*logits_);
    single_s_.push_back(Seconds(t, Clock::now()));
    return Status::Ok();
  }

  const Footprint& fp_;
  RoutedExpertBytes routed_;
  Session& lone_;
  int32_t lone_token_;
  std::vector<float>* logits_;
  std::vector<double> step_s_, single_s_, bytes_;
};

// Batched decode: `batch` sessions and one more, each with its own prompt of the same length, so
// that they route apart as different conversations do. Each step of the batch is paired with a
// step of the lone session (PairedSteps), which is the yardstick of the batch's speedup.
Status MeasureBatch(const Plan& p, Bench* b, Result* r, FILE* log) {
  r->batch = p.batch;
  if (p.batch <= 1) return Status::Ok();
  r->batch_context = static_cast<int>(p.phase_context);
  r->batch_steps = p.batch_steps;
  if (log) std::fprintf(log, "m3 bench: decode of %d sequences at once, %d steps, paired with one sequence's\n",
                        p.batch, r->batch_steps);
  std::vector<std::unique_ptr<Session>> sessions;  // the batch's, then the lone one
  std::vector<int32_t> next;
  for (int i = 0; i <= p.batch; ++i) {
    const std::vector<int32_t> ids = b->ids->Next(p.phase_context);
    sessions.push_back(std::make_unique<Session>(*b->engine));
    M3_RETURN_IF_ERROR(sessions.back()->Eval(ids, LogitsMode::kLastRow, &b->logits));
    next.push_back(Argmax(b->logits));
  }
  PairedSteps steps(b->fp, *sessions.back(), next.back(), &b->logits);
  next.pop_back();
  std::vector<Session*> batch;
  for (int i = 0; i < p.batch; ++i) batch.push_back(sessions[static_cast<size_t>(i)].get());
  std::vector<float> batch_logits;
  auto batch_step = [&] {
    M3_RETURN_IF_ERROR(Session::DecodeBatch(batch, next, &batch_logits, steps.routed()));
    const size_t vocab = batch_logits.size() / batch.size();
    for (size_t i = 0; i < batch.size(); ++i) next[i] = Argmax(batch_logits.data() + i * vocab, vocab);
    return Status::Ok();
  };
  for (int k = 0; k < r->batch_steps; ++k) {
    M3_RETURN_IF_ERROR(steps.Run(k, batch_step));
    r->logits_finite = r->logits_finite && AllFinite(batch_logits);
  }
  r->batch_bytes_per_step = steps.bytes_per_step();
  r->batch_projected_bytes_per_step = ProjectBytes(r->batch_bytes_per_step, OutsideLayerBytes(b->fp), r->layers);
  r->batch_step_s = steps.step_s();
  r->batch_single_step_s = steps.single_step_s();
  return Status::Ok();
}

// Prompt lookup's verify steps: the sampled token and `lookup` guesses copied from earlier in the
// context (as lookup takes them, so they route as the text does) in one pass with every row's
// logits, then rewound (the pass costs the same whether the guesses are taken or not); each
// paired with a single step of another session at the same context (PairedSteps).
Status MeasureLookup(const Plan& p, Bench* b, Result* r, FILE* log) {
  r->lookup = p.lookup;
  if (p.lookup <= 0) return Status::Ok();
  const size_t k = static_cast<size_t>(p.lookup);
  r->lookup_steps = p.lookup_steps;
  if (log) std::fprintf(log, "m3 bench: %d prompt-lookup verify steps of 1 + %d tokens, paired with single steps\n",
                        r->lookup_steps, p.lookup);
  const std::vector<int32_t> ids = b->ids->Next(std::max(p.phase_context, k + 1));
  Session verify(*b->engine), lone(*b->engine);
  M3_RETURN_IF_ERROR(verify.Eval(ids, LogitsMode::kLastRow, &b->logits));
  int32_t next_verify = Argmax(b->logits);
  M3_RETURN_IF_ERROR(lone.Eval(ids, LogitsMode::kLastRow, &b->logits));
  PairedSteps steps(b->fp, lone, Argmax(b->logits), &b->logits);
  std::vector<int32_t> tokens;
  std::vector<float> rows;
  auto verify_step = [&] {
    M3_RETURN_IF_ERROR(verify.Eval(tokens, LogitsMode::kAllRows, &rows, steps.routed()));
    next_verify = Argmax(rows.data(), rows.size() / tokens.size());
    return Status::Ok();
  };
  for (int step = 0; step < r->lookup_steps; ++step) {
    const size_t from = static_cast<size_t>(step) % (ids.size() - k);
    tokens = {next_verify};
    tokens.insert(tokens.end(), ids.begin() + static_cast<std::ptrdiff_t>(from),
                  ids.begin() + static_cast<std::ptrdiff_t>(from + k));
    M3_RETURN_IF_ERROR(steps.Run(step, verify_step));
    M3_RETURN_IF_ERROR(verify.Rewind(verify.position() - k));
    r->logits_finite = r->logits_finite && AllFinite(rows);
  }
  r->lookup_step_s = steps.step_s();
  r->lookup_single_step_s = steps.single_step_s();
  r->lookup_bytes_per_step = steps.bytes_per_step();
  r->lookup_projected_bytes_per_step = ProjectBytes(r->lookup_bytes_per_step, OutsideLayerBytes(b->fp), r->layers);
  return Status::Ok();
}

// A device-to-device copy's rate on `dev` (bytes read + written; best of 5 copies of 512 MiB),
// the yardstick of the offloaded dense part's reads. 0 when the buffers do not fit.
double DeviceCopyGbps(Device& dev) {
  constexpr size_t kBytes = size_t{512} << 20;
  auto a = dev.Allocate(kBytes, "the copy probe");
  if (!a.ok()) return 0;
  auto b = dev.Allocate(kBytes, "the copy probe");
  if (!b.ok()) {
    dev.Free(*a);
    return 0;
  }
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const int m0 = dev.Mark();
    dev.Copy(*b, *a, kBytes);
    const int m1 = dev.Mark();
    if (!dev.Wait().ok()) break;
    const double s = dev.Seconds(m0, m1);
    if (s > 0) best = std::max(best, 2.0 * kBytes / s / 1e9);
  }
  dev.Free(*a);
  dev.Free(*b);
  return best;
}

// --gpu dense: prefill, decode and the projection again on an engine with the dense part offloaded
// (the weights are in the page cache from the CPU run), with the offload's split of each step.
Status MeasureOffload(const Plan& p, Result* r, FILE* log) {
  if (log) std::fprintf(log, "m3 bench: the same prefill and decode with --gpu dense\n");
  Plan q = p;
  q.engine = *p.offload;
  Bench b;
  Result o;
  o.threads = r->threads;
  o.model_dir = r->model_dir;
  M3_RETURN_IF_ERROR(OpenEngine(q, &b, &o));
  DenseOffload& offload = *b.engine->offload();
  // This engine's own mapping of the weights read through once, as for the CPU-only run: else
  // each expert's first use pays its page faults inside the timed steps.
  ReadWeightsIn(&b, &o, nullptr);
  M3_RETURN_IF_ERROR(MeasurePrefill(q, &b, &o, log));
  offload.stats().Reset();
  std::vector<double> rest_s, layer_mean_s;
  M3_RETURN_IF_ERROR(MeasureDecode(q, &b, &o, &rest_s, &layer_mean_s, log));
  const OffloadStats st = offload.stats();
  Project(q, b.fp, rest_s, layer_mean_s, &o);
  OffloadResult& f = r->offload;
  f.ran = true;
  f.device = offload.device().Describe();
  f.ttft_s = o.ttft_s;
  f.prefill_tok_s = o.prefill_tok_s;
  f.decode_tok_s = o.decode_tok_s;
  f.t_layer_s = o.t_layer_s;
  f.t_rest_s = o.t_rest_s;
  f.projected_tok_s = o.projected_tok_s;
  f.projected_prefill_tok_s = o.projected_prefill_tok_s;
  const double steps = static_cast<double>(std::max<uint64_t>(st.passes, 1));
  f.device_s = st.device_seconds / steps;
  f.shared_s = st.shared_seconds / steps;
  f.experts_s = st.experts_seconds / steps;
  f.handoff_s = st.handoff_seconds / steps;
  f.selection_s = st.selection_seconds / steps;
  f.dense_bytes = static_cast<double>(offload.weight_bytes());
  f.copy_gbps = DeviceCopyGbps(offload.device());
  r->logits_finite = r->logits_finite && o.logits_finite;
  return Status::Ok();
}

// The prompt again at each thread count of -t's list (prompt_threads), each on an engine of its
// own (the same mapping's pages; no background check), with the int8 peak probed at that count
// right before it: how the prefill scales and where its time goes at each count.
Status MeasurePromptScaling(const Plan& p, const Bench& main, Result* r, FILE* log) {
  for (const int t : p.prompt_threads) {
    if (log) std::fprintf(log, "m3 bench: prompt scaling: %d threads\n", t);
    Plan q = p;
    q.engine.threads = t;
    q.engine.verify_weights = false;
    Bench b;
    Result o;
    o.threads = t;
    o.model_dir = r->model_dir;
    M3_RETURN_IF_ERROR(OpenEngine(q, &b, &o));
    b.fp = main.fp;
    const ProbeResult peak = ProbeInt8Peak(t, p.peak_seconds, p.probe_reps);
    M3_RETURN_IF_ERROR(MeasurePrefill(q, &b, &o, nullptr));
    Project(q, b.fp, {0.0}, {0.0}, &o);
    r->prompt_scaling.push_back({t, o.ttft_s, o.prefill_tok_s, o.prefill_gops, peak.best, o.t_layer_prefill_s,
                                 o.t_layer_prefill_attention_s, o.projected_prefill_tok_s});
    r->logits_finite = r->logits_finite && o.logits_finite;
  }
  return Status::Ok();
}

// The limits again, same threads as the run.
void ProbeLimitsAgain(const Plan& p, Result* r, FILE* log) {
  if (log) std::fprintf(log, "m3 bench: probing the machine limits again\n");
  r->read_bw.Merge(ProbeReadBandwidth(r->threads, p.probe_reps));
  r->int8_peak.Merge(ProbeInt8Peak(r->threads, p.peak_seconds, p.probe_reps));
  r->loadavg_end = LoadAverage();
}

// Runs the plan's phases in order and returns what they measured.
StatusOr<Result> Measure(const Plan& p, FILE* log) {
  Result r;
  r.loadavg_start = LoadAverage();
  r.threads = p.threads;
  Bench b;
  M3_RETURN_IF_ERROR(PrepareModel(p, &r, log));
  M3_RETURN_IF_ERROR(OpenEngine(p, &b, &r));
  ProbeLimits(p, &r, log);
  ReadWeightsIn(&b, &r, log);
  M3_RETURN_IF_ERROR(MeasurePrefill(p, &b, &r, log));
  // What the engine chooses for long prompts (its rates probed now, after the timed runs, when
  // this prompt was short enough to run whole); the scaling runs' engines are not asked.
  const std::string& why = b.engine->PromptChunk().why;
  r.prefill_chunk_why = static_cast<size_t>(p.prompt_tokens) > kDefaultPrefillChunk
                            ? why
                            : Str("whole (up to ", kDefaultPrefillChunk, " tokens); longer prompts: ", why);
  std::vector<double> rest_s, layer_mean_s;  // per decode step: after the last layer, a layer's mean
  M3_RETURN_IF_ERROR(MeasureDecode(p, &b, &r, &rest_s, &layer_mean_s, log));
  Project(p, b.fp, rest_s, layer_mean_s, &r);
  M3_RETURN_IF_ERROR(MeasureDist(b.fp, layer_mean_s, &b, &r, log));
  M3_RETURN_IF_ERROR(MeasureBatch(p, &b, &r, log));
  M3_RETURN_IF_ERROR(MeasureLookup(p, &b, &r, log));
  M3_RETURN_IF_ERROR(MeasurePromptScaling(p, b, &r, log));
  if (p.offload) {
    b.session.reset();  // the CPU run's caches and engine give their memory back first
    b.engine.reset();
    M3_RETURN_IF_ERROR(MeasureOffload(p, &r, log));
  }
  ProbeLimitsAgain(p, &r, log);
  return r;
}

}  // namespace

int RunModelBench(const ModelBenchOptions& options, FILE* out, FILE* log) {
  StatusOr<Plan> plan = PlanRun(options);
  StatusOr<Result> r = plan.ok() ? Measure(*plan, log) : StatusOr<Result>(plan.status());
  if (!r.ok()) {
    std::fprintf(log, "m3 bench: %s\n", r.status().message().c_str());
    return 1;
  }
  Report(*r, plan->json, out, log);
  return 0;
}

}  // namespace m3::bench
