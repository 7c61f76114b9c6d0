#include "model/packer.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/hash.h"
#include "format/safetensors.h"
#include "model/gguf_source.h"
#include "model/imatrix.h"
#include "model/pack_target.h"
#include "ops/convert.h"
#include "platform/parallel.h"

#ifndef M3_VERSION_STRING
#define M3_VERSION_STRING "unknown"
#endif

namespace m3 {
namespace {

namespace fs = std::filesystem;
using simd::WeightFormat;
using simd::WeightRef;

// Row tiles quantized per step: bounds memory (a few MB) while giving every thread work.
constexpr size_t kChunkTiles = 64;

// Files copied next to model.m3w when the source has them.

bool IsRouter(const std::string& name) {
  static const std::string suffix = "block_sparse_moe.gate.weight";
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Parses the decimal number at name[pos...] up to the next '.'; -1 when there is none.
int NumberAt(const std::string& name, size_t pos) {
  int v = 0;
  size_t i = pos;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && i - pos < 9; ++i) v = v * 10 + (name[i] - '0');
  return i > pos && i < name.size() && name[i] == '.' ? v : -1;
}

// One tensor to pack: the plan entry's source.
struct SourceTensor {
  TensorSlot slot;             // name, shape, role (pointers into `weights` below)
  WeightRef matrix;            // bound source matrix (MXFP8 scales included)
  const TensorInfo* info = nullptr;    // stored tensor (for page dropping and vectors)
  const TensorInfo* scales = nullptr;  // MXFP8 `_scale_inv` companion
  // A GGUF's tensor (rows decoded by GgufSource), instead of the three above.
  const GgufSource* gguf = nullptr;
  const GgufSource::Tensor* gguf_tensor = nullptr;
};

void AddToLayout(const ModelConfig& cfg, const TensorSlot& s, PackType type,
                 const std::vector<FormatOverride>& overrides, PackLayout* layout) {
  const WeightFormat f = PackedFormatFor(cfg, s, type, overrides);
  const uint64_t rows = s.vector ? 1 : static_cast<uint64_t>(s.shape[0]);
  const uint64_t cols = static_cast<uint64_t>(s.vector ? s.shape[0] : s.shape[1]);
  const uint64_t group = simd::IsTiled(f) ? simd::TiledShape(f, rows, cols).group : 0;
  int layer = -1, expert = -1;
  if (s.is_routed_expert) RoutedExpertOf(cfg, s.name, &layer, &expert);
  layout->Add(s.name, f, rows, cols, group, layer, expert);
}


nlohmann::json OverridesJson(const std::vector<FormatOverride>& overrides) {
  nlohmann::json a = nlohmann::json::array();
  for (const FormatOverride& o : overrides) a.push_back({{"pattern", o.pattern}, {"format", simd::WeightFormatName(o.format)}});
  return a;
}

std::string Gb(uint64_t bytes) { return Str(static_cast<double>(bytes) / 1e9, " GB"); }

// Where and why a tile could not be quantized.
struct TileFailure {
  bool set = false;
  size_t tile = 0;
  size_t row = 0, col = 0;
  float value = 0;
  bool non_finite = false;
};

// Sums of squared source values and errors of a tensor's packed values, and the largest error.
struct ErrorSums {
  double err = 0, ref = 0, max_abs = 0;
  void Add(const ErrorSums& o) { err += o.err, ref += o.ref, max_abs = std::max(max_abs, o.max_abs); }
};

class TensorPacker {
 public:
  // `measure`: decode what each tensor became and sum its error against the source (GGUF).
  TensorPacker(const std::string& source_dir, PackWriter* writer, const ThreadConfig& tc, bool measure,
               const std::function<void(uint64_t)>& advanced)
      : source_dir_(source_dir), writer_(writer), tc_(tc), measure_(measure), advanced_(advanced) {}

  // Writes one tensor at its planned offsets and sets its hash; `importance` (or null) weighs
  // the inputs' errors. With `measure`, *error gets the packed values' error (0 for f32).
  Status Pack(const SourceTensor& src, PackedTensor* out, const float* importance, ErrorSums* error) {
    *error = ErrorSums{};
    if (out->format == WeightFormat::kF32) return PackF32(src, out);
    return PackTiled(src, out, importance, error);
  }

 private:
  Status NonFinite(const std::string& name, size_t row, size_t col, float v) const {
    return InvalidArgument(source_dir_, ": tensor '", name, "' has a non-finite value (", v, ") at [", row, ", ", col,
                           "]; it cannot be packed");
  }

  // Releases the source pages of rows [r0, r1): the mapping would otherwise keep every byte read.
  void DropSourceRows(const SourceTensor& src, size_t r0, size_t r1) const {
    if (src.gguf) {
      const GgufTensorInfo& t = *src.gguf_tensor->gguf;
      const MappedFile& f = t.file->file();
      const size_t row = t.row_bytes(), first = src.gguf_tensor->first_row;
      f.DontNeed(static_cast<size_t>(t.data - f.data()) + (first + r0) * row, (r1 - r0) * row);
      return;
    }
    if (!src.info) return;
    const size_t row_bytes = src.info->nbytes / std::max<size_t>(1, src.slot.vector ? 1 : src.matrix.rows);
    const MappedFile& f = *src.info->file;
    f.DontNeed(static_cast<size_t>(src.info->data - f.data()) + r0 * row_bytes, (r1 - r0) * row_bytes);
    if (src.scales) {
      const size_t srow = src.scales->nbytes / std::max<size_t>(1, src.matrix.rows);
      const MappedFile& sf = *src.scales->file;
      sf.DontNeed(static_cast<size_t>(src.scales->data - sf.data()) + r0 * srow, (r1 - r0) * srow);
    }
  }

  // Rows [r0, r0 + n) of a source matrix (or of a vector's raw stored values) as f32.
  static Status DecodeSource(const SourceTensor& src, const WeightRef& ref, size_t r0, size_t n, float* out) {
    if (src.gguf) return src.gguf->DecodeRows(*src.gguf_tensor, r0, n, out);
    DecodeWeightRows(ref, r0, n, out);
    return Status::Ok();
  }

  // Vectors and the router: decoded exactly to f32, row chunks at a time.
  Status PackF32(const SourceTensor& src, PackedTensor* out) {
    WeightRef ref = src.matrix;
    if (src.gguf) {
      ref = WeightRef{WeightFormat::kF32, nullptr, nullptr, out->rows, out->cols};
    } else if (src.slot.vector) {  // raw stored values (the bound vector may already hold 1 + w)
      auto fmt = CheckpointWeightFormat(src.info->dtype);
      if (!fmt.ok()) return Unsupported(source_dir_, ": tensor '", out->name, "': ", fmt.status().message());
      ref = WeightRef{*fmt, src.info->data, nullptr, 1, static_cast<size_t>(src.info->numel())};
    }
    const size_t rows = ref.rows, cols = ref.cols;
    const size_t chunk_rows = std::max<size_t>(1, (size_t{4} << 20) / (cols * 4));
    std::vector<float> buf;
    Hasher64 data_hash;
    for (size_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const size_t nr = std::min(chunk_rows, rows - r0);
      buf.resize(nr * cols);
      M3_RETURN_IF_ERROR(DecodeSource(src, ref, r0, nr, buf.data()));
      const size_t bad = FindNonFinite(buf.data(), buf.size());
      if (bad < buf.size()) return NonFinite(out->name, r0 + bad / cols, bad % cols, buf[bad]);
      const size_t bytes = buf.size() * sizeof(float);
      M3_RETURN_IF_ERROR(writer_->Write(out->data.offset + r0 * cols * sizeof(float), buf.data(), bytes));
      data_hash.Update(buf.data(), bytes);
      DropSourceRows(src, r0, r0 + nr);
      advanced_(bytes);
    }
    out->hash = PackedTensorHash(data_hash.Digest(), Hasher64().Digest());
    return Status::Ok();
  }

  // Tiled matrices: per chunk of row tiles, each thread decodes and quantizes whole tiles.
  Status PackTiled(const SourceTensor& src, PackedTensor* out, const float* importance, ErrorSums* error) {
    const WeightRef shape = out->Shape();
    const size_t tiles = shape.row_tiles(), tile_bytes = shape.tile_bytes();
    const size_t tile_scales = shape.tile_scale_bytes();
    const int threads = std::max(1, tc_.threads);
    const size_t chunk = std::max(kChunkTiles, static_cast<size_t>(threads) * 4);
    codes_.EnsureSize(std::min(chunk, tiles) * tile_bytes);
    scales_.EnsureSize(std::min(chunk, tiles) * tile_scales);
    decoded_.resize(threads);
    for (auto& d : decoded_) d.EnsureSize(simd::kTileRows * shape.cols);
    std::vector<TileFailure> failures(threads);
    std::vector<Status> decode_errors(threads, Status::Ok());
    std::vector<ErrorSums> errors(threads);
    if (measure_) {
      packed_rows_.resize(threads);
      for (auto& d : packed_rows_) d.EnsureSize(shape.cols);
    }
    Hasher64 data_hash, scales_hash;
    for (size_t t0 = 0; t0 < tiles; t0 += chunk) {
      const size_t n = std::min(chunk, tiles - t0);
      ParallelFor(tc_, n, 1, [&](size_t begin, size_t end, int th) {
        float* rows = decoded_[th].data();
        for (size_t i = begin; i < end; ++i) {
          const size_t tile = t0 + i, r0 = tile * simd::kTileRows;
          const size_t nr = std::min(simd::kTileRows, shape.rows - r0);
          if (Status d = DecodeSource(src, src.matrix, r0, nr, rows); !d.ok()) {
            decode_errors[th] = d;
            return;
          }
          uint8_t* const tile_codes = codes_.data() + i * tile_bytes;
          uint8_t* const tile_scale = tile_scales ? scales_.data() + i * tile_scales : nullptr;
          if (PackWeightTiles(shape, rows, tile, 1, tile_codes, tile_scale, importance)) {
            if (measure_) {  // the tile's packed rows decoded back against the source's
              WeightRef packed = shape;
              packed.data = tile_codes, packed.scales = tile_scale, packed.rows = nr;
              float* q = packed_rows_[th].data();
              ErrorSums& e = errors[th];
              for (size_t r = 0; r < nr; ++r) {
                simd::DecodeTiledRow(packed, r, q);
                const float* w = rows + r * shape.cols;
                for (size_t c = 0; c < shape.cols; ++c) {
                  const double d = static_cast<double>(w[c]) - q[c];
                  e.err += d * d, e.ref += static_cast<double>(w[c]) * w[c];
                  e.max_abs = std::max(e.max_abs, std::fabs(d));
                }
              }
            }
            continue;
          }
          TileFailure& f = failures[th];
          f = TileFailure{true, tile, r0, 0, 0, false};
          const size_t k = FindNonFinite(rows, nr * shape.cols);
          if (k < nr * shape.cols)
            f.row = r0 + k / shape.cols, f.col = k % shape.cols, f.value = rows[k], f.non_finite = true;
          return;
        }
      });
      for (const Status& d : decode_errors) M3_RETURN_IF_ERROR(d);
      for (const ErrorSums& e : errors) error->Add(e);
      std::fill(errors.begin(), errors.end(), ErrorSums{});
      const TileFailure* first = nullptr;
      for (const auto& f : failures)
        if (f.set && (!first || f.tile < first->tile)) first = &f;
      if (first) {
        if (first->non_finite) return NonFinite(out->name, first->row, first->col, first->value);
        // Only q4 can fail on finite values (its scales are fp16; q8's row scales are fp32).
        return InvalidArgument(source_dir_, ": tensor '", out->name, "' rows ", first->row, "..",
                               first->row + simd::kTileRows - 1,
                               " hold values too large for an fp16 scale (|w| > 5.2e5); pack it as q8");
      }
      const size_t code_bytes = n * tile_bytes, scale_bytes = n * tile_scales;
      M3_RETURN_IF_ERROR(writer_->Write(out->data.offset + t0 * tile_bytes, codes_.data(), code_bytes));
      data_hash.Update(codes_.data(), code_bytes);
      if (out->scales.bytes) {
        M3_RETURN_IF_ERROR(
            writer_->Write(out->scales.offset + t0 * tile_scales, scales_.data(), scale_bytes));
        scales_hash.Update(scales_.data(), scale_bytes);
      }
      DropSourceRows(src, t0 * simd::kTileRows, std::min(shape.rows, (t0 + n) * simd::kTileRows));
      advanced_(code_bytes + (out->scales.bytes ? scale_bytes : 0));
    }
    out->hash = PackedTensorHash(data_hash.Digest(), scales_hash.Digest());
    return Status::Ok();
  }

  std::string source_dir_;
  PackWriter* writer_;
  ThreadConfig tc_;
  bool measure_;
  std::function<void(uint64_t)> advanced_;
  AlignedBuffer<uint8_t> codes_;
  AlignedBuffer<uint8_t> scales_;
  std::vector<AlignedBuffer<float>> decoded_;
  std::vector<AlignedBuffer<float>> packed_rows_;  // measure: one packed row decoded, per thread
};


}  // namespace

const char* PackTypeName(PackType t) {
  switch (t) {
    case PackType::kQ8: return "q8";
    case PackType::kQ4: return "q4";
    case PackType::kQ4Mixed: return "q4-mixed";
    case PackType::kQ3Mixed: return "q3-mixed";
    case PackType::kQ2Mixed: return "q2-mixed";
  }
  return "?";
}

std::optional<PackType> ParsePackType(const std::string& name) {
  for (PackType t : {PackType::kQ8, PackType::kQ4, PackType::kQ4Mixed, PackType::kQ3Mixed, PackType::kQ2Mixed})
    if (name == PackTypeName(t)) return t;
  return std::nullopt;
}

StatusOr<FormatOverride> ParseFormatOverride(const std::string& spec) {
  const size_t eq = spec.rfind('=');
  if (eq == std::string::npos || eq == 0)
    return InvalidArgument("--override '", spec, "': expected PATTERN=FORMAT (e.g. 'mlp\\.down_proj=q8')");
  FormatOverride o;
  o.pattern = spec.substr(0, eq);
  const std::string format = spec.substr(eq + 1);
  if (o.pattern.size() > 1000) return InvalidArgument("--override: a pattern of over 1000 characters");
  const WeightFormat choices[] = {WeightFormat::kF32, WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kQ3,
                                 WeightFormat::kQ2};
  const auto* it = std::find_if(std::begin(choices), std::end(choices),
                                [&](WeightFormat f) { return format == simd::WeightFormatName(f); });
  if (it == std::end(choices))
    return InvalidArgument("--override '", spec, "': unknown format '", format, "' (f32, q8, q4, q3 or q2)");
  o.format = *it;
  try {
    o.re = std::make_shared<const std::regex>(o.pattern, std::regex::ECMAScript | std::regex::optimize);
  } catch (const std::regex_error& e) {
    return InvalidArgument("--override '", spec, "': the pattern is not a regular expression (", e.what(), ")");
  }
  return o;
}

WeightFormat PackedFormatFor(const ModelConfig& cfg, const TensorSlot& slot, PackType type,
                             const std::vector<FormatOverride>& overrides) {
  if (slot.vector || IsRouter(slot.name)) return WeightFormat::kF32;
  for (const FormatOverride& o : overrides)
    if (o.re && std::regex_search(slot.name, *o.re)) return o.format;
  switch (type) {
    case PackType::kQ8: return WeightFormat::kQ8;
    case PackType::kQ4: return WeightFormat::kQ4;
    case PackType::kQ4Mixed: return slot.is_routed_expert ? WeightFormat::kQ4 : WeightFormat::kQ8;
    case PackType::kQ3Mixed:
    case PackType::kQ2Mixed: {
      if (!slot.is_routed_expert) return WeightFormat::kQ8;
      // In a stack of 4 or more MoE layers the first and last (and MTP's) keep q4: the ends of
      // the stack are the most sensitive to error, and two layers of 57 cost ~4 GB. (Smaller
      // stacks, the test models, are all q3 / q2.)
      int layer = -1, expert = -1;
      if (!RoutedExpertOf(cfg, slot.name, &layer, &expert) || layer >= cfg.num_layers) return WeightFormat::kQ4;
      int first = -1, last = -1, moe = 0;
      for (int l = 0; l < cfg.num_layers && l < static_cast<int>(cfg.moe_layer.size()); ++l)
        if (cfg.moe_layer[l]) last = l, first = first < 0 ? l : first, ++moe;
      if (moe >= 4 && (layer == first || layer == last)) return WeightFormat::kQ4;
      return type == PackType::kQ3Mixed ? WeightFormat::kQ3 : WeightFormat::kQ2;
    }
  }
  return WeightFormat::kQ8;
}

bool RoutedExpertOf(const ModelConfig& cfg, const std::string& name, int* layer, int* expert) {
  static const std::string kExperts = "block_sparse_moe.experts.";
  static const std::string kLayers = "model.layers.", kMtp = "model.mtp.layers.";
  const size_t at = name.find(kExperts);
  if (at == std::string::npos) return false;
  const int e = NumberAt(name, at + kExperts.size());
  int l = -1;
  if (name.rfind(kLayers, 0) == 0) {
    l = NumberAt(name, kLayers.size());
  } else if (name.rfind(kMtp, 0) == 0) {
    const int d = NumberAt(name, kMtp.size());
    l = d < 0 ? -1 : cfg.num_layers + d;
  }
  if (e < 0 || l < 0) return false;
  *layer = l, *expert = e;
  return true;
}

PackLayout PlanPackLayout(const ModelConfig& cfg, int mtp_depths, PackType type,
                          const std::vector<FormatOverride>& overrides) {
  PackLayout layout;
  ModelWeights scratch;
  ForEachTensor(cfg, mtp_depths, &scratch, [&](TensorSlot& s) { AddToLayout(cfg, s, type, overrides, &layout); });
  return layout;
}

StatusOr<PackSummary> PackModel(const PackOptions& opt) {
  const auto start = std::chrono::steady_clock::now();
  const ThreadConfig tc{ResolveThreadCount(opt.threads)};
  std::error_code ec;
  if (opt.output_dir.empty()) return InvalidArgument("pack: no output folder given");
  if (fs::exists(opt.output_dir) && fs::equivalent(opt.output_dir, opt.source_dir, ec))
    return InvalidArgument(opt.output_dir, ": the output folder must differ from the source folder");
  M3_ASSIGN_OR_RETURN(PackTarget target, PackTarget::Open(opt.output_dir, opt.force));
  const fs::path out_dir = target.staging();
  const fs::path final_path = fs::path(opt.output_dir) / kPackFileName;

  if (fs::exists(fs::path(opt.source_dir) / kPackFileName)) {
    // A packed folder has no safetensors; say so rather than "no model.safetensors".
    bool has_safetensors = false;
    for (const auto& e : fs::directory_iterator(opt.source_dir, ec))
      has_safetensors = has_safetensors || e.path().extension() == ".safetensors";
    if (!has_safetensors)
      return InvalidArgument(opt.source_dir, ": is already a packed folder; pack from the HuggingFace checkpoint");
  }
  // The whole source is validated (presence, dtypes, shapes, MXFP8 scales) before any output.
  std::unique_ptr<Checkpoint> ck;
  std::unique_ptr<GgufSource> gguf;
  ModelConfig cfg;
  ModelWeights source;
  WeightStats stats;
  if (IsGgufFile(opt.source_dir)) {
    M3_ASSIGN_OR_RETURN(gguf, GgufSource::Open(opt.source_dir));
    cfg = gguf->config();
    ForEachTensor(cfg, 0, &source, [&](TensorSlot& s) {
      int64_t numel = 1;
      for (int64_t d : s.shape) numel *= d;
      stats.total_params += numel;
      if (s.is_routed_expert) stats.routed_expert_params += numel;
    });
  } else {
    M3_ASSIGN_OR_RETURN(ck, Checkpoint::Open(opt.source_dir));
    auto parsed = ParseModelConfig(ck->config_json());
    if (!parsed.ok()) return Status(parsed.status().code(), opt.source_dir + "/" + parsed.status().message());
    cfg = parsed.value();
    M3_ASSIGN_OR_RETURN(stats, BindWeights(cfg, *ck, &source));
  }

  std::optional<ImportanceMatrix> imatrix;
  if (!opt.imatrix.empty()) {
    M3_ASSIGN_OR_RETURN(imatrix, ImportanceMatrix::Load(opt.imatrix));
    std::map<std::string, size_t> matrices;
    ForEachTensor(cfg, stats.mtp_depths, &source, [&](TensorSlot& s) {
      if (s.matrix && s.shape.size() == 2) matrices[s.name] = static_cast<size_t>(s.shape[1]);
    });
    M3_RETURN_IF_ERROR(imatrix->CheckAgainst(matrices));
  }
  std::vector<SourceTensor> sources;
  PackLayout layout;
  ForEachTensor(cfg, stats.mtp_depths, &source, [&](TensorSlot& s) {
    SourceTensor t;
    t.slot = s;
    if (gguf) {
      t.gguf = gguf.get();
      t.gguf_tensor = gguf->Find(s.name);
      if (!t.gguf_tensor) t.gguf_tensor = gguf->Find("model.embed_tokens.weight");  // tied lm_head
    } else {
      if (s.matrix) t.matrix = *s.matrix;
      t.info = ck->Find(s.name);
      if (s.matrix && s.matrix->format == WeightFormat::kE4M3Mx32) t.scales = ck->Find(s.name + "_scale_inv");
    }
    AddToLayout(cfg, s, opt.type, opt.overrides, &layout);
    sources.push_back(std::move(t));
  });

  const uint64_t file_estimate = layout.data_end() + (uint64_t{1} << 20) * (1 + layout.tensors().size() / 4096);
  struct statvfs vfs;
  if (::statvfs(out_dir.c_str(), &vfs) == 0) {
    const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (avail < file_estimate)
      return IoError(opt.output_dir, ": the packed file needs about ", Gb(file_estimate), " but only ", Gb(avail),
                     " are free");
  }

  M3_ASSIGN_OR_RETURN(auto writer, PackWriter::Create((out_dir / kPackFileName).string()));
  const uint64_t total = layout.payload_bytes();
  uint64_t done = 0;
  if (opt.progress) opt.progress(0, total);
  TensorPacker packer(opt.source_dir, writer.get(), tc, gguf != nullptr, [&](uint64_t bytes) {
    done += bytes;
    if (opt.progress) opt.progress(done, total);
  });
  auto& planned = layout.mutable_tensors();
  size_t weighted = 0;
  std::vector<ConversionError> conversion;
  nlohmann::json conversion_json = nlohmann::json::array();
  for (size_t i = 0; i < planned.size(); ++i) {
    const float* importance = imatrix ? imatrix->Find(planned[i].name) : nullptr;
    const WeightFormat f = planned[i].format;
    if (f != WeightFormat::kQ4 && !simd::IsSuperBlock(f)) importance = nullptr;  // q8 and f32 ignore it
    weighted += importance != nullptr;
    ErrorSums error;
    M3_RETURN_IF_ERROR(packer.Pack(sources[i], &planned[i], importance, &error));
    if (!gguf) continue;
    const GgufTensorInfo& g = *sources[i].gguf_tensor->gguf;
    ConversionError c{planned[i].name, g.name, GgmlTypeName(g.type), PackedFormatName(f),
                      error.ref > 0 ? error.err / error.ref : error.err > 0 ? 1.0 : 0.0, error.max_abs};
    conversion_json.push_back({{"tensor", c.tensor},
                               {"gguf_tensor", c.source},
                               {"gguf_type", c.source_type},
                               {"format", c.format},
                               {"rel_err", c.rel_err},
                               {"max_abs_err", c.max_abs_err}});
    conversion.push_back(std::move(c));
  }

  nlohmann::json dtypes = nlohmann::json::object();
  if (gguf) {
    for (const auto& [type, count] : gguf->type_counts()) dtypes[type] = count;
  } else {
    for (const auto& [name, info] : ck->text_tensors()) {
      const char* d = DTypeName(info->dtype);
      dtypes[d] = dtypes.value(d, 0) + 1;
    }
  }
  nlohmann::json imatrix_meta = nullptr;
  if (imatrix) {
    imatrix_meta = {{"file", fs::absolute(opt.imatrix, ec).lexically_normal().string()}, {"weighted_matrices", weighted}};
    for (const char* key : {"model", "text", "tokens", "chunks"})
      if (imatrix->metadata().count(key)) imatrix_meta[key] = imatrix->metadata().at(key);
  }
  const nlohmann::json meta = {
      {"pack_type", PackTypeName(opt.type)},
      {"overrides", OverridesJson(opt.overrides)},
      {"imatrix", imatrix_meta},
      {"m3_version", M3_VERSION_STRING},
      {"source",
       {{"dir", fs::absolute(opt.source_dir, ec).lexically_normal().string()},
        {"format", gguf ? "gguf" : "safetensors"},
        {"files", gguf ? gguf->file().shards().size() : ck->files().size()},
        {"tensors", gguf ? gguf->file().tensors().size() : ck->text_tensors().size()},
        {"skipped_non_text_tensors", gguf ? 0 : ck->skipped_tensor_count()},
        {"dtypes", dtypes},
        {"vl_layout", gguf ? false : ck->is_vl_layout()},
        {"mtp_depths", stats.mtp_depths}}}};
  M3_RETURN_IF_ERROR(writer->Finish(layout, meta));

  if (gguf) {  // the config and tokenizer files the GGUF holds
    std::ofstream config(out_dir / "config.json", std::ios::trunc);
    config << gguf->config_json().dump(2) << "\n";
    config.flush();
    if (!config) return IoError(opt.output_dir, ": cannot write config.json");
    M3_RETURN_IF_ERROR(gguf->WriteTokenizerFiles(out_dir.string()));
    // Each tensor's conversion error (ConversionError), for the user to see what was lossy.
    std::ofstream errors(out_dir / "conversion.json", std::ios::trunc);
    errors << conversion_json.dump(1) << "\n";
    errors.flush();
    if (!errors) return IoError(opt.output_dir, ": cannot write conversion.json");
  }
  for (const char* name : kPackSideFiles) {
    if (gguf) break;
    const fs::path from = fs::path(opt.source_dir) / name;
    if (!fs::exists(from)) continue;
    fs::copy_file(from, out_dir / name, ec);
    if (ec) return IoError(opt.output_dir, ": cannot copy ", name, ": ", ec.message());
  }
  M3_RETURN_IF_ERROR(target.Commit());

  PackSummary sum;
  sum.tensors = planned.size();
  sum.mtp_depths = stats.mtp_depths;
  sum.file_bytes = fs::file_size(final_path, ec);
  sum.payload_bytes = total;
  sum.params = stats.total_params;
  sum.expert_params = stats.routed_expert_params;
  for (size_t i = 0; i < planned.size(); ++i) {
    const uint64_t bytes = planned[i].data.bytes + planned[i].scales.bytes;
    sum.bytes_by_format[PackedFormatName(planned[i].format)] += bytes;
    if (sources[i].slot.is_routed_expert) sum.expert_bytes += bytes;
  }
  sum.weighted_matrices = weighted;
  sum.conversion = std::move(conversion);
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return sum;
}

}  // namespace m3
