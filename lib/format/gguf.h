// GGUF files (llama.cpp's model format), memory-mapped and validated, and ggml's block
// dequantization to float (docs/GGUF.md).
//
// A GGUF file, versions 2 and 3, little-endian: "GGUF", u32 version, u64 tensor count, u64 key
// count; the metadata (per key: string key, u32 value type, value); the tensor infos (string name,
// u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset); padding to the alignment
// (`general.alignment`, default 32); the data. A string is a u64 length and its bytes; an array is
// u32 element type, u64 count, the elements. Tensor offsets are relative to the start of the data
// and aligned. Everything is checked against the file's size before it is used or allocated for:
// lengths, counts, type ids, byte ranges (inside the file, not overlapping), names and keys (no
// duplicates). Tensor data and metadata values are never copied: pointers into the mapping.
//
// llama.cpp's gguf-split writes a model as NAME-00001-of-00003.gguf ... with keys split.no,
// split.count and split.tensors.count; GgufShardSet opens such a set from any one of its files
// (and a single file as a set of one).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "platform/mapped_file.h"

namespace m3 {

// ggml element types, by the ids GGUF files store. Ids 4, 5, 31-33 and 36-38 were removed from ggml.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
  kQ2_0 = 42,
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;         // as llama.cpp's tools print it: "Q4_K", "BF16"
  uint32_t block_elements;  // values per block (1 for plain types)
  uint32_t block_bytes;     // bytes per block
  bool can_dequantize;      // DequantizeGgml decodes it
};

// nullptr for an id this reader does not know (so cannot size).
const GgmlTypeInfo* FindGgmlType(uint32_t id);
const char* GgmlTypeName(GgmlType type);  // "?" for an id outside the enum
bool CanDequantizeGgml(GgmlType type);

// Bytes of n_elements values of `type`: an error when they are not whole blocks or the count
// overflows.
StatusOr<uint64_t> GgmlByteSize(GgmlType type, uint64_t n_elements);

// Decodes n_elements values (whole blocks) from src, which holds GgmlByteSize(type, n_elements)
// bytes, into out. F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K;
// the same bits as ggml's reference decoders (tests/data/gguf/ggml_reference.gguf). Others: an
// error naming the type.
Status DequantizeGgml(GgmlType type, const uint8_t* src, size_t n_elements, float* out);

// Metadata value types.
enum class GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
const char* GgufValueTypeName(GgufValueType type);  // "u32", "string", "array", ...

// One metadata entry. Its value stays in the mapping and was checked at open.
struct GgufKeyValue {
  std::string key;
  GgufValueType type = GgufValueType::kU8;
  // Arrays: the elements' type and count. An array of arrays (one level of nesting at most) is
  // kept but none of the getters reads it.
  GgufValueType element_type = GgufValueType::kU8;
  uint64_t count = 1;
  // The value's bytes: a scalar; a string's u64 length and bytes; an array's elements (after its
  // element type and count).
  const uint8_t* value = nullptr;
  size_t value_bytes = 0;
};

// The key/value pairs of a file. Getters return NotFound naming the key when it is absent and
// Corrupt naming the key and both types when it holds another type.
class GgufMetadata {
 public:
  const std::vector<GgufKeyValue>& entries() const { return entries_; }  // in file order
  const GgufKeyValue* Find(std::string_view key) const;  // nullptr when absent
  bool Has(std::string_view key) const { return Find(key) != nullptr; }

  StatusOr<std::string_view> GetString(std::string_view key) const;
  // Any integer type, u8 to i64; OutOfRange for a u64 above INT64_MAX.
  StatusOr<int64_t> GetInt(std::string_view key) const;
  StatusOr<double> GetFloat(std::string_view key) const;  // f32 or f64
  StatusOr<bool> GetBool(std::string_view key) const;
  StatusOr<std::vector<std::string_view>> GetStringArray(std::string_view key) const;
  StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;     // integer elements
  StatusOr<std::vector<double>> GetNumberArray(std::string_view key) const;   // integer or float elements

  // The file the metadata was read from (named in errors).
  const std::string& path() const { return path_; }

 private:
  friend class GgufFile;
  std::string path_;
  std::vector<GgufKeyValue> entries_;
  std::map<std::string, size_t, std::less<>> index_;  // key -> entries_ position
};

class GgufFile;

struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::kF32;
  uint32_t n_dims = 0;
  // ggml order: ne[0] is the contiguous dimension (one row), ne[n_dims..3] are 1. A [rows, cols]
  // PyTorch weight is stored with ne = {cols, rows}.
  std::array<int64_t, 4> ne{1, 1, 1, 1};
  uint64_t n_elements = 0;
  uint64_t offset = 0;            // from the start of the file's data section
  const uint8_t* data = nullptr;  // inside the mapping
  size_t nbytes = 0;
  const GgufFile* file = nullptr;

  uint64_t row_elements() const { return static_cast<uint64_t>(ne[0]); }
  uint64_t n_rows() const { return ne[0] == 0 ? 0 : n_elements / static_cast<uint64_t>(ne[0]); }
  size_t row_bytes() const { return n_rows() == 0 ? 0 : nbytes / n_rows(); }
  std::string ShapeString() const;  // "[4096, 1024]", ggml order (ne[0] first)
};

// Decodes rows [first_row, first_row + n_rows) of a tensor (a row is ne[0] values) into out; an
// error names the tensor when its type cannot be decoded or the rows are out of range.
Status DequantizeGgufRows(const GgufTensorInfo& tensor, uint64_t first_row, uint64_t n_rows, float* out);

class GgufFile {
 public:
  // Errors name the file and what is wrong; nothing is read outside the file.
  static StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);

  const std::string& path() const { return file_->path(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // where the data section starts
  const GgufMetadata& metadata() const { return metadata_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }  // in file order
  const MappedFile& file() const { return *file_; }

 private:
  std::unique_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 0;
  uint64_t data_offset_ = 0;
  GgufMetadata metadata_;
  std::vector<GgufTensorInfo> tensors_;
};

// One GGUF file, or every shard of a gguf-split set opened from any one of them. Checks that the
// shards agree: split.count, each split.no present once and matching its file name, the total
// tensor count (split.tensors.count), no tensor in two shards.
class GgufShardSet {
 public:
  static StatusOr<std::unique_ptr<GgufShardSet>> Open(const std::string& path);

  // The first shard's metadata: gguf-split writes the model's keys there (and only split.* in the
  // others).
  const GgufMetadata& metadata() const { return shards_.front()->metadata(); }
  const std::vector<std::unique_ptr<GgufFile>>& shards() const { return shards_; }  // by split.no
  const std::vector<const GgufTensorInfo*>& tensors() const { return tensors_; }  // shard order, then file order
  const GgufTensorInfo* Find(std::string_view name) const;  // nullptr when absent

 private:
  std::vector<std::unique_ptr<GgufFile>> shards_;
  std::vector<const GgufTensorInfo*> tensors_;
  std::map<std::string, const GgufTensorInfo*, std::less<>> by_name_;
};

}  // namespace m3
