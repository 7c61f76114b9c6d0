// `m3 pack`: converts a HuggingFace checkpoint (F32, BF16, F16 or MXFP8) into a packed folder:
// model.m3w (lib/format/pack_file.h) plus config.json and the tokenizer/chat files.
//
// Formats: vectors (norms, router bias) and the MoE router [E, H] are f32 (tiny and precision
// sensitive); every other matrix is q8 (type q8), q4 (type q4), or q4 for routed experts and q8
// for the rest (type q4-mixed); q3-mixed and q2-mixed store the routed experts as q3 / q2 but
// those of the first and last MoE layers (and MTP's) as q4, the rest as q4-mixed does. The source is streamed a chunk of row tiles at a time, so memory
// stays bounded whatever the model size; the output is written to model.m3w.partial and renamed
// only once complete.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "base/status.h"
#include "format/pack_file.h"
#include "model/config.h"
#include "model/weights.h"

namespace m3 {

// The checkpoint's files a pack's folder gets a copy of (the tokenizer, the chat template, the
// configs), beside model.m3w.
inline constexpr const char* kPackSideFiles[] = {
    "config.json",           "generation_config.json",  "tokenizer.json",    "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json",     "vocab.json",        "merges.txt",
    "tokenizer.model",       "chat_template.jinja",     "chat_template.json"};

enum class PackType { kQ8, kQ4, kQ4Mixed, kQ3Mixed, kQ2Mixed };

const char* PackTypeName(PackType t);  // "q8" | "q4" | "q4-mixed" | "q3-mixed" | "q2-mixed"
std::optional<PackType> ParsePackType(const std::string& name);

// A user's per-tensor choice, `m3 pack --override PATTERN=FORMAT`: every matrix whose name the
// regular expression (ECMAScript, searched anywhere in the name) matches is stored as `format`
// (f32: the source's values exactly; q8, q4, q3 or q2) instead of what the pack type says; the
// first matching override wins.
// Vectors and the MoE router stay f32 whatever matches them.
struct FormatOverride {
  std::string pattern;
  simd::WeightFormat format = simd::WeightFormat::kQ8;
  std::shared_ptr<const std::regex> re;
};
// Parses "PATTERN=FORMAT" (split at the last '='); InvalidArgument naming what is wrong.
StatusOr<FormatOverride> ParseFormatOverride(const std::string& spec);

struct PackOptions {
  std::string source_dir;
  std::string output_dir;
  PackType type = PackType::kQ4Mixed;
  std::vector<FormatOverride> overrides;  // applied before `type` (first match wins)
  // An importance matrix of m3 imatrix (model/imatrix.h): q4, q3 and q2 matrices it covers
  // minimise their error weighted by it. Empty: none.
  std::string imatrix;
  bool force = false;  // replace an existing model.m3w in output_dir
  int threads = 0;     // 0: every core; more: capped to them (ResolveThreadCount)
  // Called after each written chunk (and once at 0) with output bytes done and in total.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

// How far one packed tensor is from its source's values (a GGUF source's decoded values): the
// relative squared error sum (w - q)^2 / sum w^2 and the largest |w - q|; 0 when exact.
struct ConversionError {
  std::string tensor;       // the pack's tensor (m3's name)
  std::string source;       // the GGUF tensor it came from
  std::string source_type;  // its ggml type ("Q4_K", ...)
  std::string format;       // the packed format ("q4", ...)
  double rel_err = 0;
  double max_abs_err = 0;
};

struct PackSummary {
  size_t tensors = 0;
  int mtp_depths = 0;
  uint64_t file_bytes = 0;
  uint64_t payload_bytes = 0;  // tensor data and scales
  int64_t params = 0;
  uint64_t expert_bytes = 0;   // routed experts' data and scales
  int64_t expert_params = 0;
  std::map<std::string, uint64_t> bytes_by_format;  // "f32", "q8", "q4"
  size_t weighted_matrices = 0;  // q4/q3/q2 matrices quantized with the importance matrix
  // GGUF sources: every tensor's conversion error, in pack order (also in the folder's
  // conversion.json); empty for a checkpoint.
  std::vector<ConversionError> conversion;
  double seconds = 0;

  double bits_per_weight() const {
    return params ? 8.0 * static_cast<double>(payload_bytes) / static_cast<double>(params) : 0;
  }
  double expert_bits_per_weight() const {
    return expert_params ? 8.0 * static_cast<double>(expert_bytes) / static_cast<double>(expert_params) : 0;
  }
};

StatusOr<PackSummary> PackModel(const PackOptions& options);

// The stored format of one tensor under a pack type and the overrides.
simd::WeightFormat PackedFormatFor(const ModelConfig& cfg, const TensorSlot& slot, PackType type,
                                   const std::vector<FormatOverride>& overrides = {});

// Layer index of a routed expert's tensor (main layer l, or num_layers + d for MTP depth d) and
// the expert id; false for any other tensor.
bool RoutedExpertOf(const ModelConfig& cfg, const std::string& name, int* layer, int* expert);

// Where every tensor of the model goes in model.m3w, in ForEachTensor order (hashes left zero).
PackLayout PlanPackLayout(const ModelConfig& cfg, int mtp_depths, PackType type,
                          const std::vector<FormatOverride>& overrides = {});

}  // namespace m3
