// The synthetic benchmark model (synthetic_model.h).
#include "synthetic_model.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/hash.h"
#include "base/progress.h"
#include "bench/shapes.h"
#include "format/pack_file.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "model/packer.h"
#include "platform/parallel.h"
#include "simd/weight_format.h"

#ifndef M3_VERSION_STRING
#define M3_VERSION_STRING "unknown"
#endif

namespace m3::bench {
namespace {

namespace fs = std::filesystem;
using simd::WeightFormat;

// Part of the folder name: bump it when shapes or values change, so old caches are not reused.
constexpr int kGeneratorVersion = 2;
constexpr const char* kGeneratorName = "m3 bench synthetic model";

// Generation unit: one chunk is filled by all threads, hashed, then written (bounded memory).
constexpr size_t kChunkBytes = size_t{16} << 20;
// Each 64 KiB block has its own random stream, so the bytes do not depend on the thread count.
constexpr size_t kBlockBytes = size_t{64} << 10;

struct Shapes {
  int hidden, heads, kv_heads, head_dim, rotary_dim;
  int index_heads, index_dim, block, topk_blocks, init_blocks, local_blocks;
  int experts, top_k, expert_inter, shared_inter, dense_inter, vocab;
  int64_t max_positions;
};

Shapes ModelShapes(bool tiny) {
  // Tiny: every dimension a whole number of row tiles and quantization groups, as the real ones.
  if (tiny) return {256, 4, 2, 64, 32, 2, 64, 16, 4, 0, 1, 8, 2, 128, 128, 256, 1024, 4096};
  using namespace shapes;
  auto i = [](size_t v) { return static_cast<int>(v); };
  return {i(kHidden),      i(kHeads),          i(kKvHeads),
          i(kHeadDim),     i(kRotaryDim),      i(kIndexHeads),
          i(kIndexDim),    i(kBlock),          i(kTopkBlocks),
          i(kInitBlocks),  i(kLocalBlocks),    i(kExperts),
          i(kExpertsPerToken), i(kExpertIntermediate), i(kSharedIntermediate),
          i(kDenseIntermediate), i(kVocab),    int64_t{1} << 20};  // max positions as released
}

ModelConfig ParsedConfig(int layers, bool tiny) {
  auto cfg = ParseModelConfig(SyntheticConfigJson(layers, tiny));
  return std::move(cfg).value();  // a generator bug if it does not parse; tests cover it
}

nlohmann::json GeneratorMeta(int layers, bool tiny, PackType type) {
  return {{"pack_type", PackTypeName(type)},
          {"m3_version", M3_VERSION_STRING},
          {"source",
           {{"dir", "synthetic (m3 bench): random weights"},
            {"generator", kGeneratorName},
            {"generator_version", kGeneratorVersion},
            {"layers", layers},
            {"tiny", tiny}}}};
}

uint64_t PhysicalMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : uint64_t{16} << 30;
}

std::string Size(uint64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  std::snprintf(buf, sizeof buf, b >= 1e9 ? "%.2f GB" : "%.1f MB", b >= 1e9 ? b / 1e9 : b / 1e6);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Values.

uint64_t Mix64(uint64_t z) {  // SplitMix64 finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct Rng {  // SplitMix64
  uint64_t s;
  uint64_t Next() { return Mix64(s += 0x9E3779B97F4A7C15ull); }
  float Uniform() { return static_cast<float>(Next() >> 40) * 0x1p-24f; }  // [0, 1)
};

// Eight random codes symmetric around the zero point: q8 bytes 1..255 with 0 replaced by 128
// (value 0), q4 nibbles 1..15 with 0 replaced by 8. Bit tricks: bit 7 (bit 3) of
// ((v & 0x7F) + 0x7F) | v is clear exactly when the byte (nibble) is zero; no carries cross lanes.
uint64_t Q8Codes(uint64_t v) {
  const uint64_t t = ((v & 0x7F7F7F7F7F7F7F7Full) + 0x7F7F7F7F7F7F7F7Full) | v;
  return v | (~t & 0x8080808080808080ull);
}
uint64_t Q4Codes(uint64_t v) {
  const uint64_t t = ((v & 0x7777777777777777ull) + 0x7777777777777777ull) | v;
  return v | (~t & 0x8888888888888888ull);
}
// RMS of the code values above: q8 sqrt(2 * sum_{k<=127} k^2 / 256), q4 sqrt(2 * sum_{k<=7} k^2 / 16).
const double kQ8CodeRms = std::sqrt(2.0 * 127 * 128 * 255 / 6 / 256);
const double kQ4CodeRms = std::sqrt(2.0 * 140 / 16);

enum class FillKind { kZero, kQ8Codes, kQ4Codes, kAnyCodes, kF16Scales, kQ8Scales, kSuperBlockScales, kF32Uniform };

// How one byte range (a tensor's data or its scales) is filled.
struct RegionFill {
  FillKind kind = FillKind::kZero;
  float amplitude = 0;  // k*Scales: mean scale (each is x [0.75, 1.25)); kF32Uniform: values in [-a, a)
  uint64_t seed = 0;
  size_t tile_scale_bytes = 0;  // kQ8Scales: per row tile 16 fp32 row scales, then u8 group shifts
  float mid = 0;                 // kSuperBlockScales: the code at value 0 (L / 2)
};

// q8 group shifts are 0 or 1 at random: a group's scale is its row's or half of it, so the mean
// squared scale is 5/8 of the row scale's.
constexpr double kQ8ShiftMeanSquare = (1.0 + 0.25) / 2;

void FillBlock(const RegionFill& f, uint64_t block, uint8_t* out, size_t n) {
  Rng rng{Mix64(f.seed ^ Mix64(block + 1))};
  switch (f.kind) {
    case FillKind::kZero:
      std::memset(out, 0, n);
      return;
    case FillKind::kQ8Codes:
    case FillKind::kQ4Codes:
    case FillKind::kAnyCodes:
      for (size_t j = 0; j < n; j += 8) {
        const uint64_t r = rng.Next();
        const uint64_t v = f.kind == FillKind::kQ8Codes ? Q8Codes(r) : f.kind == FillKind::kQ4Codes ? Q4Codes(r) : r;
        std::memcpy(out + j, &v, std::min<size_t>(8, n - j));
      }
      return;
    case FillKind::kF16Scales:
      for (size_t j = 0; j + 2 <= n; j += 2) {
        const uint16_t h = simd::F32ToF16(f.amplitude * (0.75f + 0.5f * rng.Uniform()));
        std::memcpy(out + j, &h, 2);
      }
      return;
    case FillKind::kQ8Scales: {
      const uint64_t start = block * kBlockBytes;  // tile_scale_bytes and kBlockBytes are multiples of 16
      for (size_t j = 0; j < n;) {
        if ((start + j) % f.tile_scale_bytes < simd::kTileRows * 4) {
          const float v = f.amplitude * (0.75f + 0.5f * rng.Uniform());
          std::memcpy(out + j, &v, std::min<size_t>(4, n - j));
          j += 4;
        } else {
          out[j++] = static_cast<uint8_t>(rng.Next() & 1);
        }
      }
      return;
    }
    case FillKind::kSuperBlockScales: {
      // Per row tile: fp16 d [groups][16] around the amplitude, fp16 dmin [groups][16] = the
      // amplitude's 8 * mid, sub-blocks sc = mn = 8: W = 8 d c - 8 mid amplitude, mean ~0.
      const uint64_t start = block * kBlockBytes;
      const size_t groups = f.tile_scale_bytes / (simd::kTileRows * (4 + simd::kSubGroups));
      const uint16_t dmin = simd::F32ToF16(f.amplitude * f.mid);
      for (size_t j = 0; j < n;) {
        const size_t at = (start + j) % f.tile_scale_bytes;
        if (at < groups * simd::kTileRows * 4) {
          const uint16_t h = at < groups * simd::kTileRows * 2
                                 ? simd::F32ToF16(f.amplitude * (0.75f + 0.5f * rng.Uniform()))
                                 : dmin;
          std::memcpy(out + j, &h, std::min<size_t>(2, n - j));
          j += 2;
        } else {
          out[j++] = 0x88;
        }
      }
      return;
    }
    case FillKind::kF32Uniform:
      for (size_t j = 0; j + 4 <= n; j += 4) {
        const float v = f.amplitude * (2.0f * rng.Uniform() - 1.0f);
        std::memcpy(out + j, &v, 4);
      }
      return;
  }
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The fills of tensor `index`: {data, scales}.
std::pair<RegionFill, RegionFill> FillsFor(const PackedTensor& t, size_t index) {
  const uint64_t seed = Mix64(0x6D33'6265'6E63'6800ull + index);  // "m3bench" + index
  RegionFill data, scales;
  data.seed = seed;
  scales.seed = Mix64(seed);
  if (t.format == WeightFormat::kF32) {
    // Vectors: norms and the correction bias are 0. The router [E, H]: logits of unit variance.
    if (t.rows > 1 || EndsWith(t.name, "block_sparse_moe.gate.weight")) {
      data.kind = FillKind::kF32Uniform;
      data.amplitude = static_cast<float>(std::sqrt(3.0 / static_cast<double>(t.cols)));
    }
    return {data, scales};
  }
  // Unit-variance embedding rows; every other matrix keeps unit variance from input to output.
  const double fan = t.name == "model.embed_tokens.weight" ? 1.0 : static_cast<double>(t.cols);
  if (simd::IsSuperBlock(t.format)) {  // uniform codes 0..L: rms about L/2 is sqrt(L (L + 2) / 12)
    const double L = (1 << simd::SuperBlockBits(t.format)) - 1;
    data.kind = FillKind::kAnyCodes;
    scales.kind = FillKind::kSuperBlockScales;
    scales.mid = static_cast<float>(L / 2);
    scales.amplitude = static_cast<float>(1.0 / (8.0 * std::sqrt(L * (L + 2) / 12.0) * std::sqrt(fan)));
    scales.tile_scale_bytes = t.Shape().tile_scale_bytes();
    return {data, scales};
  }
  const bool q8 = t.format == WeightFormat::kQ8;
  data.kind = q8 ? FillKind::kQ8Codes : FillKind::kQ4Codes;
  const double rms = q8 ? kQ8CodeRms : kQ4CodeRms;
  // Unit-variance embedding rows; every other matrix keeps unit variance from input to output.
  const double fan_in = t.name == "model.embed_tokens.weight" ? 1.0 : static_cast<double>(t.cols);
  scales.kind = q8 ? FillKind::kQ8Scales : FillKind::kF16Scales;
  scales.amplitude = static_cast<float>(1.0 / (rms * std::sqrt(fan_in * (q8 ? kQ8ShiftMeanSquare : 1.0))));
  scales.tile_scale_bytes = t.Shape().tile_scale_bytes();
  return {data, scales};
}

// ---------------------------------------------------------------------------------------------
// Output.

// The generator's progress on `log` (nullptr: none).
class ProgressLine {
 public:
  ProgressLine(FILE* log, uint64_t total)
      : log_(log), meter_("m3 bench: generating the model ", total, log && ::isatty(::fileno(log)) != 0) {}
  void Advance(uint64_t bytes) {
    done_ += bytes;
    if (!log_) return;
    std::fputs(meter_.Update(done_).c_str(), log_);
    std::fflush(log_);
  }

 private:
  FILE* log_;
  ProgressMeter meter_;
  uint64_t done_ = 0;
};

// Fills and writes bytes [offset, offset + bytes) a chunk at a time; hashes them in order.
Status WriteRegion(PackWriter& writer, const ThreadConfig& tc, const ByteRange& range, const RegionFill& fill,
                   AlignedBuffer<uint8_t>& buf, Hasher64* hash, ProgressLine* progress) {
  for (uint64_t pos = 0; pos < range.bytes; pos += kChunkBytes) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, range.bytes - pos));
    const size_t blocks = (n + kBlockBytes - 1) / kBlockBytes;
    uint8_t* out = buf.data();
    ParallelFor(tc, blocks, 1, [&](size_t b, size_t e, int) {
      for (size_t i = b; i < e; ++i)
        FillBlock(fill, pos / kBlockBytes + i, out + i * kBlockBytes, std::min(kBlockBytes, n - i * kBlockBytes));
    });
    hash->Update(out, n);
    M3_RETURN_IF_ERROR(writer.Write(range.offset + pos, out, n));
    progress->Advance(n);
  }
  return Status::Ok();
}

Status WriteTextFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return IoError(path.string(), ": cannot write");
  return Status::Ok();
}

// Why the cached folder cannot be reused; Ok when it can.
Status CheckCached(const fs::path& dir, const nlohmann::json& config, const PackLayout& layout) {
  const fs::path model = dir / kPackFileName;
  if (!fs::exists(dir / "config.json") || !fs::exists(model)) return NotFound(dir.string(), ": not generated yet");
  M3_ASSIGN_OR_RETURN(const nlohmann::json cached, ReadJsonFile((dir / "config.json").string()));
  if (cached != config) return Corrupt((dir / "config.json").string(), ": differs from the generator's");
  M3_ASSIGN_OR_RETURN(auto pack, PackFile::Open(model.string()));
  if (pack->tensors().size() != layout.tensors().size())
    return Corrupt(model.string(), ": holds ", pack->tensors().size(), " tensors, expected ", layout.tensors().size());
  return Status::Ok();
}

Status Generate(const fs::path& dir, int layers, bool tiny, PackType type, const PackLayout& planned,
                const ThreadConfig& tc, FILE* log) {
  const fs::path final_path = dir / kPackFileName;
  const fs::path partial_path = dir / (std::string(kPackFileName) + ".partial");
  for (const PackedTensor& t : planned.tensors()) {
    const simd::WeightRef s = t.Shape();
    if (simd::IsTiled(t.format) && (t.rows % simd::kTileRows || t.cols % s.group))
      return Unsupported("synthetic model: tensor '", t.name, "' [", t.rows, ", ", t.cols,
                         "] is not whole tiles (the generator writes no padding)");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError(dir.string(), ": cannot create the folder: ", ec.message());
  // A stale or damaged file is ours to replace; removing it first frees its space.
  fs::remove(final_path, ec);
  fs::remove(partial_path, ec);
  const uint64_t need = SyntheticModelBytes(layers, tiny, type) + (uint64_t{64} << 20);
  struct statvfs vfs;
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (avail < need)
      return IoError(dir.string(), ": the ", layers, "-layer benchmark model needs about ", Size(need), " but only ",
                     Size(avail), " are free (use --layers with fewer layers, or --cache-dir on a larger disk)");
  }
  M3_RETURN_IF_ERROR(WriteTextFile(dir / "config.json", SyntheticConfigJson(layers, tiny).dump(2) + "\n"));

  struct PartialGuard {  // removes the partial file on every early return
    fs::path path;
    bool armed = true;
    ~PartialGuard() {
      std::error_code e;
      if (armed) fs::remove(path, e);
    }
  } guard{partial_path};
  M3_ASSIGN_OR_RETURN(auto writer, PackWriter::Create(partial_path.string()));
  PackLayout layout = planned;
  AlignedBuffer<uint8_t> buf(kChunkBytes);
  ProgressLine progress(log, layout.payload_bytes());
  auto& tensors = layout.mutable_tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    PackedTensor& t = tensors[i];
    const auto [data_fill, scale_fill] = FillsFor(t, i);
    Hasher64 data_hash, scale_hash;
    M3_RETURN_IF_ERROR(WriteRegion(*writer, tc, t.data, data_fill, buf, &data_hash, &progress));
    if (t.scales.bytes) M3_RETURN_IF_ERROR(WriteRegion(*writer, tc, t.scales, scale_fill, buf, &scale_hash, &progress));
    t.hash = PackedTensorHash(data_hash.Digest(), scale_hash.Digest());
  }
  M3_RETURN_IF_ERROR(writer->Finish(layout, GeneratorMeta(layers, tiny, type)));
  fs::rename(partial_path, final_path, ec);
  if (ec) return IoError(final_path.string(), ": cannot rename the finished file into place: ", ec.message());
  guard.armed = false;
  return Status::Ok();
}

}  // namespace

nlohmann::json SyntheticConfigJson(int layers, bool tiny) {
  const Shapes s = ModelShapes(tiny);
  const std::vector<int> ones(static_cast<size_t>(std::max(layers, 0)), 1);
  return {
      {"architectures", nlohmann::json::array({"MiniMaxM3SparseForCausalLM"})},
      {"model_type", "minimax_m3"},
      {"hidden_size", s.hidden},
      {"intermediate_size", s.expert_inter},
      {"dense_intermediate_size", s.dense_inter},
      {"shared_intermediate_size", s.shared_inter},
      {"num_hidden_layers", layers},
      {"num_attention_heads", s.heads},
      {"num_key_value_heads", s.kv_heads},
      {"head_dim", s.head_dim},
      {"vocab_size", s.vocab},
      {"max_position_embeddings", s.max_positions},
      {"rms_norm_eps", 1e-6},
      {"use_gemma_norm", true},
      {"attention_output_gate", false},
      {"rope_theta", 5000000},
      {"rotary_dim", s.rotary_dim},
      {"partial_rotary_factor", static_cast<double>(s.rotary_dim) / s.head_dim},
      {"hidden_act", "swigluoai"},
      {"use_qk_norm", true},
      {"qk_norm_type", "per_head"},
      {"tie_word_embeddings", false},
      {"num_local_experts", s.experts},
      {"num_experts_per_tok", s.top_k},
      {"n_shared_experts", 1},
      {"scoring_func", "sigmoid"},
      {"use_routing_bias", true},
      {"routed_scaling_factor", 2.0},
      {"moe_layer_freq", ones},  // every layer MoE with sparse attention, like 57 of the real 60
      {"swiglu_alpha", 1.702},
      {"swiglu_limit", 7.0},
      {"sparse_attention_config",
       {{"use_sparse_attention", true},
        {"sparse_attention_freq", ones},
        {"sparse_disable_index_value", ones},
        {"sparse_num_index_heads", s.index_heads},
        {"sparse_index_dim", s.index_dim},
        {"sparse_block_size", s.block},
        {"sparse_topk_blocks", s.topk_blocks},
        {"sparse_init_block", s.init_blocks},
        {"sparse_local_block", s.local_blocks},
        {"sparse_score_type", "max"}}},
      {"num_mtp_modules", 0},
      {"torch_dtype", "bfloat16"},
      {"m3_synthetic", {{"generator", kGeneratorName}, {"version", kGeneratorVersion}, {"weights", "random"}}},
  };
}

uint64_t ReleasedModelPayloadBytes(PackType type) {
  // The released structure: dense MLP and full attention in the first kDenseLayers layers, MoE
  // and sparse attention in the rest; no MTP.
  nlohmann::json j = SyntheticConfigJson(static_cast<int>(shapes::kLayers), false);
  std::vector<int> moe(shapes::kLayers, 1);
  for (size_t l = 0; l < shapes::kDenseLayers; ++l) moe[l] = 0;
  j["moe_layer_freq"] = moe;
  j["sparse_attention_config"]["sparse_attention_freq"] = moe;
  j["sparse_attention_config"]["sparse_disable_index_value"] = moe;
  auto cfg = ParseModelConfig(j);
  return cfg.ok() ? PlanPackLayout(*cfg, 0, type).data_end() : 0;
}

uint64_t SyntheticModelBytes(int layers, bool tiny, PackType type) {
  const PackLayout layout = PlanPackLayout(ParsedConfig(layers, tiny), 0, type);
  const uint64_t directory = PackDirectoryJson(layout, GeneratorMeta(layers, tiny, type)).dump().size();
  return (layout.data_end() + kPackAlign - 1) / kPackAlign * kPackAlign + directory;
}

double DecodeBytes::LayerShare(int layers) const {
  const double l = static_cast<double>(per_layer) * layers;
  return l + static_cast<double>(lm_head) > 0 ? l / (l + static_cast<double>(lm_head)) : 0;
}

DecodeBytes SyntheticDecodeBytes(bool tiny, PackType type) {
  const ModelConfig cfg = ParsedConfig(1, tiny);
  const PackLayout layout = PlanPackLayout(cfg, 0, type);
  DecodeBytes b;
  for (const PackedTensor& t : layout.tensors()) {
    const uint64_t bytes = t.data.bytes + t.scales.bytes;
    int layer = 0, expert = 0;
    if (RoutedExpertOf(cfg, t.name, &layer, &expert)) {
      b.per_layer += expert < cfg.experts_per_token ? bytes : 0;  // top-k of the equally sized experts
    } else if (t.name == "lm_head.weight" || t.name == "model.norm.weight") {
      b.lm_head += bytes;
    } else if (t.name != "model.embed_tokens.weight") {
      b.per_layer += bytes;
    }
  }
  return b;
}

int DefaultSyntheticLayers(bool tiny, PackType type) {
  if (tiny) return 2;
  const DecodeBytes decode = SyntheticDecodeBytes(false, type);
  int layers = 1;
  while (layers < static_cast<int>(shapes::kLayers) && decode.LayerShare(layers) < kMoeShareTarget) ++layers;
  const uint64_t budget = PhysicalMemory() / 3 * 2;
  while (layers > 1 && SyntheticModelBytes(layers, false, type) > budget) --layers;
  return layers;
}

std::string DefaultCacheDir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg && *xdg) return (fs::path(xdg) / "m3").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : ".") / ".cache" / "m3").string();
}

std::string SyntheticModelDir(const std::string& cache_dir, int layers, bool tiny, PackType type) {
  return (fs::path(cache_dir) /
          Str("bench-model-", tiny ? "tiny-" : "", PackTypeName(type), "-", layers, "L-v", kGeneratorVersion))
      .string();
}

StatusOr<SyntheticModel> EnsureSyntheticModel(const SyntheticModelOptions& options, FILE* log) {
  if (options.layers < 0 || options.layers > static_cast<int>(shapes::kLayers))
    return InvalidArgument("--layers must be 1..", shapes::kLayers, " (the real model has ", shapes::kLayers,
                           "), got ", options.layers);
  SyntheticModel m;
  m.layers = options.layers > 0 ? options.layers : DefaultSyntheticLayers(options.tiny, options.type);
  m.dir = SyntheticModelDir(options.cache_dir.empty() ? DefaultCacheDir() : options.cache_dir, m.layers, options.tiny,
                            options.type);
  const nlohmann::json config = SyntheticConfigJson(m.layers, options.tiny);
  const PackLayout layout = PlanPackLayout(ParsedConfig(m.layers, options.tiny), 0, options.type);
  const Status cached = CheckCached(m.dir, config, layout);
  std::error_code ec;
  if (cached.ok()) {
    m.file_bytes = fs::file_size(fs::path(m.dir) / kPackFileName, ec);
    if (log) std::fprintf(log, "m3 bench: using the cached benchmark model %s\n", m.dir.c_str());
    return m;
  }
  if (log) {
    if (cached.code() != StatusCode::kNotFound)
      std::fprintf(log, "m3 bench: the cached model cannot be used (%s); generating it again\n", cached.message().c_str());
    std::fprintf(log, "m3 bench: generating a %d-layer %s benchmark model with the %s in %s (%s, once)\n", m.layers,
                 PackTypeName(options.type), options.tiny ? "tiny test shapes" : "MiniMax-M3 shapes", m.dir.c_str(),
                 Size(SyntheticModelBytes(m.layers, options.tiny, options.type)).c_str());
  }
  const auto start = std::chrono::steady_clock::now();
  const ThreadConfig tc{ResolveThreadCount(options.threads)};
  M3_RETURN_IF_ERROR(Generate(m.dir, m.layers, options.tiny, options.type, layout, tc, log));
  m.generated = true;
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  m.file_bytes = fs::file_size(fs::path(m.dir) / kPackFileName, ec);
  if (log) std::fprintf(log, "m3 bench: generated %s in %.1f s\n", m.dir.c_str(), m.seconds);
  return m;
}

}  // namespace m3::bench
