// The packed model file `model.m3w` (docs/PACKED_FORMAT.md, section "File").
//
//   [0, 4096)          header: magic, version, file size, directory offset/size/hash, header hash
//   [4096, dir)        tensor data: codes and scales of tiled matrices, f32 tensors
//   [dir, file end)    directory: JSON (pack type, source, every tensor, every expert's byte range)
//
// Opening validates the header and directory and every tensor's placement, but reads no tensor
// data, so a file of any size opens at once; Verify() hashes the data. Tensors are used in place
// from the mapping.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "platform/mapped_file.h"
#include "platform/parallel.h"
#include "simd/weight_format.h"

namespace m3 {

inline constexpr char kPackMagic[8] = {'M', '3', 'P', 'A', 'C', 'K', '\0', '\0'};
inline constexpr uint32_t kPackVersion = 2;  // 2: q8 scales are fp32 per row + power-of-two shifts per group
inline constexpr uint64_t kPackHeaderBytes = 4096;
inline constexpr uint64_t kPackAlign = 64;         // every tensor's data and scales
inline constexpr uint64_t kPackPageAlign = 4096;   // every routed expert's range
inline constexpr const char* kPackFileName = "model.m3w";

// The fixed header fields (little-endian at the offsets noted; the rest of the 4096 bytes is zero).
struct PackHeader {
  uint32_t version = kPackVersion;      // @8
  uint32_t header_bytes = kPackHeaderBytes;  // @12
  uint64_t file_size = 0;               // @16
  uint64_t directory_offset = 0;        // @24
  uint64_t directory_bytes = 0;         // @32
  uint64_t directory_hash = 0;          // @40  Hash64 of the directory bytes
  // @48 header hash: Hash64 of bytes [0, 48), computed by EncodePackHeader.
};
inline constexpr size_t kPackHeaderHashOffset = 48;

// The 4096-byte header block, magic and header hash included.
std::vector<uint8_t> EncodePackHeader(const PackHeader& h);

// Storage formats of packed tensors: f32 (row-major) or one of the tiled formats.
const char* PackedFormatName(simd::WeightFormat f);  // "f32" | "q8" | "q4" | "bf16t"
std::optional<simd::WeightFormat> ParsePackedFormat(const std::string& name);

struct ByteRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t end() const { return offset + bytes; }
};

// One tensor as the directory describes it. A 1-D tensor of n values has rows 1, cols n.
struct PackedTensor {
  std::string name;
  simd::WeightFormat format = simd::WeightFormat::kF32;
  uint64_t rows = 0, cols = 0;
  uint64_t group = 0;  // tiled formats only
  ByteRange data;
  ByteRange scales;    // empty for f32 and bf16t
  uint64_t hash = 0;   // PackedTensorHash of the data and scales bytes

  uint64_t numel() const { return rows * cols; }
  // Geometry as a WeightRef with null pointers (tiled formats: the sizes it implies).
  simd::WeightRef Shape() const;
};

// Byte sizes implied by format, rows, cols and group.
uint64_t PackedDataBytes(const simd::WeightRef& shape);
uint64_t PackedScaleBytes(const simd::WeightRef& shape);

// Content hash of one tensor: Hash64 over the 16 bytes [Hash64(data), Hash64(scales)], both
// little-endian (data and scales are separate ranges, hashed as they are written).
uint64_t PackedTensorHash(uint64_t data_hash, uint64_t scales_hash);

// All of one routed expert's tensors (gate, up, down: data and scales) lie in one range that
// starts on a page boundary. Layers 0..L-1 are the main layers, L + d is MTP depth d.
struct ExpertRangeEntry {
  int layer = 0;
  int expert = 0;
  ByteRange range;
};

// Where each tensor goes: tensors in the order added, 64-byte aligned, each routed expert's
// tensors in one page-aligned range. Data starts after the header.
class PackLayout {
 public:
  // `expert_layer` / `expert` >= 0 for routed-expert tensors; consecutive tensors of the same
  // expert share its range. Returns the tensor's index.
  size_t Add(const std::string& name, simd::WeightFormat format, uint64_t rows, uint64_t cols, uint64_t group,
             int expert_layer = -1, int expert = -1);
  const std::vector<PackedTensor>& tensors() const { return tensors_; }
  std::vector<PackedTensor>& mutable_tensors() { return tensors_; }
  const std::vector<ExpertRangeEntry>& experts() const { return experts_; }
  uint64_t data_end() const { return end_; }  // end of the last tensor
  uint64_t payload_bytes() const;             // sum of data and scale bytes

 private:
  uint64_t Place(uint64_t bytes, uint64_t align);
  std::vector<PackedTensor> tensors_;
  std::vector<ExpertRangeEntry> experts_;
  uint64_t end_ = kPackHeaderBytes;
  bool expert_open_ = false;
};

// Writes a pack file: data at the layout's offsets (any order), then Finish() writes the
// directory, syncs, and writes the header (with the magic) last, so that a file cut short at
// any point is never taken for a valid pack.
class PackWriter {
 public:
  static StatusOr<std::unique_ptr<PackWriter>> Create(const std::string& path);
  ~PackWriter();
  PackWriter(const PackWriter&) = delete;
  PackWriter& operator=(const PackWriter&) = delete;

  Status Write(uint64_t offset, const void* data, size_t n);
  // `meta` holds the free-form keys (pack_type, source, ...); tensors and expert ranges come
  // from `layout`, hashes included.
  Status Finish(const PackLayout& layout, const nlohmann::json& meta);
  const std::string& path() const { return path_; }

 private:
  PackWriter() = default;
  std::string path_;
  int fd_ = -1;
};

// The directory JSON for a layout (also used by tests that rebuild damaged files).
nlohmann::json PackDirectoryJson(const PackLayout& layout, const nlohmann::json& meta);

class PackFile {
 public:
  static StatusOr<std::unique_ptr<PackFile>> Open(const std::string& path);

  const std::string& path() const { return file_->path(); }
  const MappedFile& file() const { return *file_; }
  const nlohmann::json& directory() const { return directory_; }
  std::string pack_type() const;  // "q8" | "q4" | "q4-mixed" | other producers' names
  const std::vector<PackedTensor>& tensors() const { return tensors_; }
  const std::vector<ExpertRangeEntry>& expert_ranges() const { return experts_; }

  // nullptr when absent.
  const PackedTensor* Find(const std::string& name) const;
  // Whether any tensor name starts with `prefix`.
  bool HasPrefix(const std::string& prefix) const;
  // The byte range of one routed expert; nullptr when the file records none.
  const ByteRange* ExpertRange(int layer, int expert) const;

  // The tensor as a weight the kernels read in place (data/scales inside the mapping).
  simd::WeightRef Weight(const PackedTensor& t) const;
  // The values of an f32 tensor, copied.
  std::vector<float> F32Values(const PackedTensor& t) const;

  // Hashes every tensor's bytes; the error names the first tensor (in directory order) whose
  // hash differs. Pages are dropped from this process after hashing.
  Status Verify(const ThreadConfig& tc = {}) const;
  // Hashes tensor `i` (directory order); Corrupt naming it when its hash differs.
  Status VerifyTensor(size_t i) const;
  // Whether all of tensor `i`'s bytes are in memory now (VerifyTensor then reads no disk).
  bool TensorResident(size_t i) const;
  // What identifies this file on this machine as packed: its directory hash, size, modification
  // time and inode (a stamp of "verified" names this).
  std::string Identity() const;

 private:
  PackFile() = default;
  std::unique_ptr<MappedFile> file_;
  uint64_t directory_hash_ = 0;
  nlohmann::json directory_;
  std::vector<PackedTensor> tensors_;
  std::map<std::string, size_t> by_name_;
  std::vector<ExpertRangeEntry> experts_;
  std::map<std::pair<int, int>, size_t> expert_index_;
};

}  // namespace m3
