#include "quant_quality.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "simd/weight_format.h"
#include "simd/weight_pack.h"

namespace m3::bench {
namespace {

constexpr size_t kCols = 3072;

// llama.cpp's CPU library (libggml-base.so), opened at run time: the quantize functions and each
// type's decoder. Its API is C; the traits struct is that of ggml.h (checked by type name).
class Ggml {
 public:
  static std::optional<Ggml> Open(const std::string& dir, std::string* error) {
    const std::string path = dir + "/libggml-base.so";
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      *error = "cannot open " + path + ": " + ::dlerror();
      return std::nullopt;
    }
    Ggml g;
    g.handle_ = h;
    g.quantize_ = reinterpret_cast<QuantizeFn>(::dlsym(h, "ggml_quantize_chunk"));
    g.traits_ = reinterpret_cast<TraitsFn>(::dlsym(h, "ggml_get_type_traits"));
    g.row_size_ = reinterpret_cast<RowSizeFn>(::dlsym(h, "ggml_row_size"));
    if (!g.quantize_ || !g.traits_ || !g.row_size_) {
      *error = path + " lacks ggml_quantize_chunk, ggml_get_type_traits or ggml_row_size";
      return std::nullopt;
    }
    return g;
  }
  // Decoded values of `rows` x kCols quantized as `type` (its id in ggml.h), or nullopt when this
  // library does not call the type `name`.
  std::optional<std::vector<float>> RoundTrip(int type, const char* name, const std::vector<float>& x, size_t rows,
                                              const float* importance, double* bits_per_weight) const {
    const Traits* t = traits_(type);
    if (!t || !t->type_name || std::string(t->type_name) != name || !t->to_float) return std::nullopt;
    const size_t row_bytes = row_size_(type, static_cast<int64_t>(kCols));
    std::vector<uint8_t> q(row_bytes * rows);
    quantize_(type, x.data(), q.data(), 0, static_cast<int64_t>(rows), static_cast<int64_t>(kCols), importance);
    std::vector<float> y(x.size());
    for (size_t r = 0; r < rows; ++r) t->to_float(q.data() + r * row_bytes, y.data() + r * kCols, static_cast<int64_t>(kCols));
    *bits_per_weight = 8.0 * static_cast<double>(row_bytes) / static_cast<double>(kCols);
    return y;
  }

 private:
  struct Traits {  // ggml.h's struct ggml_type_traits
    const char* type_name;
    int64_t blck_size, blck_size_interleave;
    size_t type_size;
    bool is_quantized;
    void (*to_float)(const void*, float*, int64_t);
    void (*from_float_ref)(const float*, void*, int64_t);
  };
  using QuantizeFn = size_t (*)(int, const float*, void*, int64_t, int64_t, int64_t, const float*);
  using TraitsFn = const Traits* (*)(int);
  using RowSizeFn = size_t (*)(int, int64_t);
  void* handle_ = nullptr;  // kept open for the process (the library's code is called through it)
  QuantizeFn quantize_ = nullptr;
  TraitsFn traits_ = nullptr;
  RowSizeFn row_size_ = nullptr;
};

struct PeerType {
  int id;
  const char* name;
  bool needs_importance;
};
constexpr PeerType kPeerTypes[] = {{8, "q8_0", false},    {14, "q6_K", false},   {13, "q5_K", false},
                                   {12, "q4_K", false},   {2, "q4_0", false},    {23, "iq4_xs", false},
                                   {11, "q3_K", false},   {21, "iq3_s", false},  {18, "iq3_xxs", false},
                                   {10, "q2_K", false},   {22, "iq2_s", false},  {17, "iq2_xs", true},
                                   {16, "iq2_xxs", true}};

struct Row {
  std::string engine, type, dist;
  bool weighted = false;
  double bpw = 0, rel_err = 0;
  // m3 rows with a peer: the peer's envelope at this bpw, and whether that was extrapolated.
  std::optional<double> peer_equal_bits;
  bool extrapolated = false;
  std::string peer_nearest;
  double peer_nearest_bpw = 0, peer_nearest_err = 0;
};

double RelError(const std::vector<float>& x, const std::vector<float>& y, const std::vector<float>& imp) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double w = imp[i % kCols], e = static_cast<double>(x[i]) - y[i];
    err += w * e * e, ref += w * static_cast<double>(x[i]) * x[i];
  }
  return ref > 0 ? err / ref : 0;
}

std::vector<float> M3RoundTrip(simd::WeightFormat f, const std::vector<float>& x, size_t rows, const float* importance,
                               double* bpw) {
  simd::WeightRef w = simd::TiledShape(f, rows, kCols);
  std::vector<float> padded(w.row_tiles() * simd::kTileRows * kCols, 0.0f);
  std::copy(x.begin(), x.end(), padded.begin());
  std::vector<uint8_t> codes(simd::TiledCodeBytes(w)), scales(std::max<size_t>(1, simd::TiledScaleBytes(w)));
  simd::PackRowTiles(w, padded.data(), 0, w.row_tiles(), codes.data(), scales.data(), importance);
  w.data = codes.data();
  w.scales = scales.data();
  std::vector<float> y(x.size());
  for (size_t r = 0; r < rows; ++r) simd::DecodeTiledRow(w, r, y.data() + r * kCols);
  *bpw = 8.0 * static_cast<double>(simd::TiledCodeBytes(w) + simd::TiledScaleBytes(w)) /
         static_cast<double>(rows * kCols);
  return y;
}

// The lower envelope of the peer's (bpw, log error) points at `bpw`: linear between the two
// envelope points around it, or along the nearest end segment outside them.
std::optional<double> EnvelopeAt(std::vector<std::pair<double, double>> pts, double bpw, bool* extrapolated) {
  std::sort(pts.begin(), pts.end());
  std::vector<std::pair<double, double>> env;  // decreasing error with rising bits: a type beaten by fewer bits is dropped
  for (const auto& p : pts) {
    if (p.second <= 0) continue;
    if (!env.empty() && p.first == env.back().first) {
      env.back().second = std::min(env.back().second, p.second);
      continue;
    }
    if (!env.empty() && p.second >= env.back().second) continue;
    env.push_back(p);
  }
  if (env.size() < 2) return std::nullopt;
  size_t i = 1;
  while (i + 1 < env.size() && env[i].first < bpw) ++i;
  *extrapolated = bpw < env.front().first || bpw > env.back().first;
  const auto [b0, e0] = env[i - 1];
  const auto [b1, e1] = env[i];
  const double t = (bpw - b0) / (b1 - b0);
  return std::exp(std::log(e0) + t * (std::log(e1) - std::log(e0)));
}

}  // namespace

int RunQuantBench(const QuantBenchOptions& options, FILE* out, FILE* log) {
  std::optional<Ggml> ggml;
  if (!options.peer_lib.empty()) {
    std::string error;
    ggml = Ggml::Open(options.peer_lib, &error);
    if (!ggml) {
      std::fprintf(log, "m3 bench --quant: %s\n", error.c_str());
      return 1;
    }
  }
  const size_t rows = options.quick ? 32 : 256;
  // The importance of a weighted run: log-normal over 0.5 decades, 1% of the inputs 30x.
  std::vector<float> uniform(kCols, 1.0f), importance(kCols);
  {
    std::mt19937 rng(77);
    std::normal_distribution<float> n(0.0f, 0.5f);
    for (size_t c = 0; c < kCols; ++c) importance[c] = std::pow(10.0f, n(rng)) * (c % 100 == 37 ? 30.0f : 1.0f);
  }
  std::vector<Row> table;
  for (const char* dist : {"gaussian", "student-t4"}) {
    std::mt19937 rng(dist[0] == 'g' ? 5 : 6);
    std::normal_distribution<float> normal;
    std::student_t_distribution<float> student(4.0f);
    std::vector<float> x(rows * kCols);
    for (float& v : x) v = dist[0] == 'g' ? normal(rng) : student(rng);
    for (const bool weighted : {false, true}) {
      const std::vector<float>& imp = weighted ? importance : uniform;
      std::vector<std::pair<double, double>> peer_points;
      std::vector<Row> peer_rows;
      for (const PeerType& t : kPeerTypes) {
        if (!ggml || (t.needs_importance && !weighted)) continue;
        Row r;
        r.engine = "llama.cpp", r.type = t.name, r.dist = dist, r.weighted = weighted;
        const auto y = ggml->RoundTrip(t.id, t.name, x, rows, weighted ? importance.data() : nullptr, &r.bpw);
        if (!y) {
          std::fprintf(log, "m3 bench --quant: this llama.cpp has no type %s at id %d; skipped\n", t.name, t.id);
          continue;
        }
        r.rel_err = RelError(x, *y, imp);
        peer_points.emplace_back(r.bpw, r.rel_err);
        peer_rows.push_back(r);
      }
      for (simd::WeightFormat f : {simd::WeightFormat::kQ8, simd::WeightFormat::kQ4, simd::WeightFormat::kQ3,
                                   simd::WeightFormat::kQ2}) {
        Row r;
        r.engine = "m3", r.type = simd::WeightFormatName(f), r.dist = dist, r.weighted = weighted;
        const auto y = M3RoundTrip(f, x, rows, weighted ? importance.data() : nullptr, &r.bpw);
        r.rel_err = RelError(x, y, imp);
        if (!peer_points.empty()) {
          r.peer_equal_bits = EnvelopeAt(peer_points, r.bpw, &r.extrapolated);
          const Row* nearest = nullptr;
          for (const Row& p : peer_rows)
            if (!nearest || std::fabs(p.bpw - r.bpw) < std::fabs(nearest->bpw - r.bpw)) nearest = &p;
          r.peer_nearest = nearest->type, r.peer_nearest_bpw = nearest->bpw, r.peer_nearest_err = nearest->rel_err;
        }
        table.push_back(r);
      }
      table.insert(table.end(), peer_rows.begin(), peer_rows.end());
    }
  }

  if (!options.json) {
    std::fprintf(out, "relative error sum imp (w - q)^2 / sum imp w^2 on %zu x %zu matrices%s\n", rows, kCols,
                 ggml ? "" : " (m3 only: give --peer-lib DIR for llama.cpp's types)");
    std::fprintf(out, "%-10s %-9s %-11s %-8s %7s %11s %14s %8s  %s\n", "dist", "weighting", "engine", "type", "bpw",
                 "rel err", "peer @ = bits", "ratio", "peer's nearest type");
  }
  for (const Row& r : table) {
    if (options.json) {
      nlohmann::json j = {{"bench", "quant"}, {"dist", r.dist},  {"weighted", r.weighted}, {"engine", r.engine},
                          {"type", r.type},   {"bpw", r.bpw},    {"rel_err", r.rel_err},   {"rows", rows},
                          {"cols", kCols}};
      if (r.peer_equal_bits) {
        j["peer_rel_err_equal_bits"] = *r.peer_equal_bits;
        j["ratio_to_peer_equal_bits"] = r.rel_err / *r.peer_equal_bits;
        j["peer_extrapolated"] = r.extrapolated;
        j["peer_nearest"] = {{"type", r.peer_nearest}, {"bpw", r.peer_nearest_bpw}, {"rel_err", r.peer_nearest_err}};
      }
      std::fprintf(out, "%s\n", j.dump().c_str());
      continue;
    }
    char peer[64] = "", ratio[32] = "", nearest[96] = "";
    if (r.peer_equal_bits) {
      std::snprintf(peer, sizeof peer, "%.3e%s", *r.peer_equal_bits, r.extrapolated ? "*" : "");
      std::snprintf(ratio, sizeof ratio, "%.3f", r.rel_err / *r.peer_equal_bits);
      std::snprintf(nearest, sizeof nearest, "%s %.3f bpw %.3e", r.peer_nearest.c_str(), r.peer_nearest_bpw,
                    r.peer_nearest_err);
    }
    std::fprintf(out, "%-10s %-9s %-11s %-8s %7.3f %11.3e %14s %8s  %s\n", r.dist.c_str(),
                 r.weighted ? "imatrix" : "none", r.engine.c_str(), r.type.c_str(), r.bpw, r.rel_err, peer, ratio,
                 nearest);
  }
  if (!options.json && ggml)
    std::fprintf(out, "peer @ = bits: llama.cpp's lower envelope at the m3 type's bits per weight (* extended past "
                      "its range); ratio <= 1: m3 no worse at equal size\n");
  return 0;
}

}  // namespace m3::bench
