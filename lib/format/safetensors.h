// safetensors files and HuggingFace checkpoint folders, memory-mapped and validated.
//
// A file is: u64 little-endian header length n, n bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets are relative to the
// end of the header. Everything is checked before use: header bounds, JSON shape, dtype, byte
// ranges inside the data and not overlapping. Tensor data is never copied.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "format/dtype.h"
#include "platform/mapped_file.h"

namespace m3 {

struct TensorInfo {
  std::string name;        // as stored in the file
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping
  size_t nbytes = 0;
  const MappedFile* file = nullptr;

  int64_t numel() const;
  std::string ShapeString() const;
};

class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const MappedFile& file() const { return *file_; }
  // The header's "__metadata__" entries whose values are strings (the format's only kind).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::unique_ptr<MappedFile> file_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor for WriteSafetensors: F32 values of `shape`, row-major.
struct F32Tensor {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};
// Writes a safetensors file of F32 tensors (in the given order, 8-byte aligned data) with string
// metadata, to path + ".partial" renamed to `path` once complete. Names must be distinct and not
// "__metadata__".
Status WriteSafetensors(const std::string& path, std::span<const F32Tensor> tensors,
                        const std::map<std::string, std::string>& metadata);

// A HuggingFace model folder: config.json plus model.safetensors, or shards listed in
// model.safetensors.index.json. Text tensors are keyed by their name without the VL prefix
// `language_model.`; vision tower and projector tensors are set aside.
class Checkpoint {
 public:
  static StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config_json() const { return config_; }
  bool is_vl_layout() const { return vl_prefix_; }

  // nullptr when absent. `name` is the text name, e.g. "model.layers.0.self_attn.q_proj.weight".
  const TensorInfo* Find(const std::string& name) const;
  const std::map<std::string, const TensorInfo*>& text_tensors() const { return text_; }
  size_t skipped_tensor_count() const { return skipped_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string dir_;
  nlohmann::json config_;
  bool vl_prefix_ = false;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> text_;
  size_t skipped_ = 0;
};

// Reads and parses a JSON file; errors name the file.
StatusOr<nlohmann::json> ReadJsonFile(const std::string& path);

}  // namespace m3
