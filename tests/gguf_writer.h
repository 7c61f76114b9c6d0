// A small GGUF writer for tests (header only): metadata of every value type, tensors of any ggml
// type from raw bytes, an alignment, gguf-split shards. It writes what it is told, including what
// a reader must refuse (duplicate keys or names, any version, offsets, shapes or type ids), so the
// corruption tests can build their files with it. Little-endian hosts only, as GGUF is.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace m3::test {

// GGUF value type ids (format/gguf.h GgufValueType).
enum GgufWriterType : uint32_t {
  kGgufU8 = 0,
  kGgufI8 = 1,
  kGgufU16 = 2,
  kGgufI16 = 3,
  kGgufU32 = 4,
  kGgufI32 = 5,
  kGgufF32 = 6,
  kGgufBool = 7,
  kGgufString = 8,
  kGgufArray = 9,
  kGgufU64 = 10,
  kGgufI64 = 11,
  kGgufF64 = 12,
};

class GgufWriter {
 public:
  // Little-endian encodings of the pieces of a file.
  template <class T>
  static std::string Pod(const T& v) {
    std::string s(sizeof(T), '\0');
    std::memcpy(s.data(), &v, sizeof(T));
    return s;
  }
  static std::string String(const std::string& s) { return Pod<uint64_t>(s.size()) + s; }
  // An array value (after the value type): element type, count, the encoded elements.
  static std::string ArrayValue(uint32_t element_type, uint64_t count, const std::string& elements) {
    return Pod(element_type) + Pod(count) + elements;
  }

  uint32_t version = 3;

  // Metadata, in the order set. `value` is the encoded value that follows the type.
  GgufWriter& SetRaw(const std::string& key, uint32_t type, const std::string& value) {
    kv_.push_back({key, type, value});
    return *this;
  }
  GgufWriter& SetU8(const std::string& k, uint8_t v) { return SetRaw(k, kGgufU8, Pod(v)); }
  GgufWriter& SetI8(const std::string& k, int8_t v) { return SetRaw(k, kGgufI8, Pod(v)); }
  GgufWriter& SetU16(const std::string& k, uint16_t v) { return SetRaw(k, kGgufU16, Pod(v)); }
  GgufWriter& SetI16(const std::string& k, int16_t v) { return SetRaw(k, kGgufI16, Pod(v)); }
  GgufWriter& SetU32(const std::string& k, uint32_t v) { return SetRaw(k, kGgufU32, Pod(v)); }
  GgufWriter& SetI32(const std::string& k, int32_t v) { return SetRaw(k, kGgufI32, Pod(v)); }
  GgufWriter& SetF32(const std::string& k, float v) { return SetRaw(k, kGgufF32, Pod(v)); }
  GgufWriter& SetBool(const std::string& k, bool v) { return SetRaw(k, kGgufBool, Pod<uint8_t>(v ? 1 : 0)); }
  GgufWriter& SetString(const std::string& k, const std::string& v) { return SetRaw(k, kGgufString, String(v)); }
  GgufWriter& SetU64(const std::string& k, uint64_t v) { return SetRaw(k, kGgufU64, Pod(v)); }
  GgufWriter& SetI64(const std::string& k, int64_t v) { return SetRaw(k, kGgufI64, Pod(v)); }
  GgufWriter& SetF64(const std::string& k, double v) { return SetRaw(k, kGgufF64, Pod(v)); }
  // An array of plain values: T is the C++ type of `element_type` (uint8_t for bool).
  template <class T>
  GgufWriter& SetArray(const std::string& k, uint32_t element_type, const std::vector<T>& values) {
    std::string elements;
    for (const T& v : values) elements += Pod(v);
    return SetRaw(k, kGgufArray, ArrayValue(element_type, values.size(), elements));
  }
  GgufWriter& SetStringArray(const std::string& k, const std::vector<std::string>& values) {
    std::string elements;
    for (const auto& v : values) elements += String(v);
    return SetRaw(k, kGgufArray, ArrayValue(kGgufString, values.size(), elements));
  }

  // Sets general.alignment (u32) and lays the data out with it (default 32, not written).
  GgufWriter& SetAlignment(uint32_t alignment) {
    alignment_ = alignment;
    return SetU32("general.alignment", alignment);
  }

  // A tensor: ggml type id, shape in ggml order (ne[0] first, any number of dimensions), its bytes
  // as stored. Placed at the next aligned offset after the previous tensor unless `offset` is
  // given (relative to the data section; may be misaligned, overlapping or past the end).
  GgufWriter& AddTensor(const std::string& name, uint32_t ggml_type, const std::vector<int64_t>& ne, const std::string& bytes,
                        std::optional<uint64_t> offset = std::nullopt) {
    tensors_.push_back({name, ggml_type, ne, bytes, offset});
    return *this;
  }

  // The whole file.
  std::string Bytes() const { return Encode(kv_, tensors_); }

  void Write(const std::filesystem::path& path) const { WriteFile(path, Bytes()); }

  // gguf-split's layout: n_shards files DIR/PREFIX-0000i-of-0000n.gguf, the tensors split in order
  // into n_shards runs (as even as can be), the metadata in the first shard only (and the
  // alignment, when set, in every shard), split.no (u16), split.count (u16) and
  // split.tensors.count (i32) in each. Returns the paths, first to last.
  std::vector<std::filesystem::path> WriteSplit(const std::filesystem::path& dir, const std::string& prefix,
                                                int n_shards) const {
    std::vector<std::filesystem::path> paths;
    for (int i = 0; i < n_shards; ++i) {
      std::vector<KeyValue> kv;
      if (i == 0) kv = kv_;
      else if (alignment_ != 32) kv.push_back({"general.alignment", kGgufU32, Pod<uint32_t>(static_cast<uint32_t>(alignment_))});
      kv.push_back({"split.no", kGgufU16, Pod<uint16_t>(static_cast<uint16_t>(i))});
      kv.push_back({"split.count", kGgufU16, Pod<uint16_t>(static_cast<uint16_t>(n_shards))});
      kv.push_back({"split.tensors.count", kGgufI32, Pod<int32_t>(static_cast<int32_t>(tensors_.size()))});
      const size_t begin = tensors_.size() * i / n_shards, end = tensors_.size() * (i + 1) / n_shards;
      std::vector<Tensor> part(tensors_.begin() + begin, tensors_.begin() + end);
      char name[64];
      std::snprintf(name, sizeof(name), "-%05d-of-%05d.gguf", i + 1, n_shards);
      paths.push_back(dir / (prefix + name));
      WriteFile(paths.back(), Encode(kv, part));
    }
    return paths;
  }

  // Offsets of the header fields, for tests that damage them.
  static constexpr size_t kVersionAt = 4, kTensorCountAt = 8, kKeyCountAt = 16, kFirstKeyAt = 24;

 private:
  struct KeyValue {
    std::string key;
    uint32_t type;
    std::string value;
  };
  struct Tensor {
    std::string name;
    uint32_t type;
    std::vector<int64_t> ne;
    std::string bytes;
    std::optional<uint64_t> offset;
  };

  static void WriteFile(const std::filesystem::path& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write " + path.string());
  }

  uint64_t Align(uint64_t v) const { return (v + alignment_ - 1) / alignment_ * alignment_; }

  std::string Encode(const std::vector<KeyValue>& kv, const std::vector<Tensor>& tensors) const {
    std::string out = "GGUF" + Pod(version) + Pod<uint64_t>(tensors.size()) + Pod<uint64_t>(kv.size());
    for (const auto& e : kv) out += String(e.key) + Pod(e.type) + e.value;
    std::vector<uint64_t> offsets;
    uint64_t next = 0;
    for (const auto& t : tensors) {
      offsets.push_back(t.offset ? *t.offset : next);
      next = Align(offsets.back() + t.bytes.size());
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      out += String(t.name) + Pod<uint32_t>(static_cast<uint32_t>(t.ne.size()));
      for (int64_t d : t.ne) out += Pod(d);
      out += Pod(t.type) + Pod(offsets[i]);
    }
    if (tensors.empty()) return out;
    // Bytes are written for tensors laid out in order and for placed ones within the first 16 MiB
    // of data; one placed farther (a test of offsets outside the file) is listed but has no bytes.
    constexpr uint64_t kFar = uint64_t{1} << 24;
    const auto written = [&](size_t i) {
      return !tensors[i].offset || (offsets[i] <= kFar && tensors[i].bytes.size() <= kFar - offsets[i]);
    };
    const uint64_t data_start = Align(out.size());
    uint64_t data_end = 0;
    for (size_t i = 0; i < tensors.size(); ++i)
      if (written(i)) data_end = std::max(data_end, Align(offsets[i] + tensors[i].bytes.size()));
    std::string data(data_end, '\0');
    for (size_t i = 0; i < tensors.size(); ++i)
      if (written(i)) std::memcpy(data.data() + offsets[i], tensors[i].bytes.data(), tensors[i].bytes.size());
    out.resize(data_start, '\0');
    return out + data;
  }

  uint64_t alignment_ = 32;
  std::vector<KeyValue> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace m3::test
