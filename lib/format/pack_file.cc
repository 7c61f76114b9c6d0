#include "format/pack_file.h"
#include "base/json_guard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <set>

#include "base/hash.h"

namespace m3 {
namespace {

using simd::WeightFormat;

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

std::string HashHex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return buf;
}

bool ParseHashHex(const nlohmann::json& j, uint64_t* out) {
  if (!j.is_string()) return false;
  const std::string s = j.get<std::string>();
  if (s.size() != 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return false;
    v = v << 4 | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

bool GetUnsigned(const nlohmann::json& obj, const char* key, uint64_t* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return false;
  if (it->is_number_unsigned()) *out = it->get<uint64_t>();
  else if (it->is_number_integer() && it->get<int64_t>() >= 0) *out = static_cast<uint64_t>(it->get<int64_t>());
  else return false;
  return true;
}

Status WriteAll(int fd, const std::string& path, uint64_t offset, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return IoError(path, ": write of ", n, " bytes at offset ", offset, " failed: ", std::strerror(errno));
    }
    p += w, n -= static_cast<size_t>(w), offset += static_cast<uint64_t>(w);
  }
  return Status::Ok();
}

}  // namespace

std::vector<uint8_t> EncodePackHeader(const PackHeader& h) {
  std::vector<uint8_t> b(kPackHeaderBytes, 0);
  std::memcpy(b.data(), kPackMagic, 8);
  PutU32(b.data() + 8, h.version);
  PutU32(b.data() + 12, h.header_bytes);
  PutU64(b.data() + 16, h.file_size);
  PutU64(b.data() + 24, h.directory_offset);
  PutU64(b.data() + 32, h.directory_bytes);
  PutU64(b.data() + 40, h.directory_hash);
  PutU64(b.data() + kPackHeaderHashOffset, Hash64(b.data(), kPackHeaderHashOffset));
  return b;
}

const char* PackedFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return "f32";
    case WeightFormat::kQ8: return "q8";
    case WeightFormat::kQ4: return "q4";
    case WeightFormat::kBF16Tiled: return "bf16t";
    case WeightFormat::kQ3: return "q3";
    case WeightFormat::kQ2: return "q2";
    default: return "?";
  }
}

std::optional<WeightFormat> ParsePackedFormat(const std::string& name) {
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kQ8, WeightFormat::kQ4, WeightFormat::kBF16Tiled,
                         WeightFormat::kQ3, WeightFormat::kQ2})
    if (name == PackedFormatName(f)) return f;
  return std::nullopt;
}

simd::WeightRef PackedTensor::Shape() const {
  simd::WeightRef w;
  w.format = format;
  w.rows = rows;
  w.cols = cols;
  w.group = group;
  return w;
}

uint64_t PackedDataBytes(const simd::WeightRef& shape) {
  if (simd::IsTiled(shape.format)) return simd::TiledCodeBytes(shape);
  return static_cast<uint64_t>(shape.rows) * shape.cols * simd::ElementBytes(shape.format);
}

uint64_t PackedScaleBytes(const simd::WeightRef& shape) {
  return simd::IsTiled(shape.format) ? simd::TiledScaleBytes(shape) : 0;
}

uint64_t PackedTensorHash(uint64_t data_hash, uint64_t scales_hash) {
  uint8_t b[16];
  PutU64(b, data_hash);
  PutU64(b + 8, scales_hash);
  return Hash64(b, sizeof b);
}

// ---------------------------------------------------------------------------------------------
// Layout and writer.

uint64_t PackLayout::Place(uint64_t bytes, uint64_t align) {
  const uint64_t offset = RoundUp(end_, align);
  end_ = offset + bytes;
  return offset;
}

size_t PackLayout::Add(const std::string& name, WeightFormat format, uint64_t rows, uint64_t cols, uint64_t group,
                       int expert_layer, int expert) {
  const bool is_expert = expert_layer >= 0 && expert >= 0;
  if (expert_open_ && (!is_expert || experts_.back().layer != expert_layer || experts_.back().expert != expert))
    expert_open_ = false;
  if (is_expert && !expert_open_) {
    experts_.push_back({expert_layer, expert, {Place(0, kPackPageAlign), 0}});
    expert_open_ = true;
  }
  PackedTensor t;
  t.name = name;
  t.format = format;
  t.rows = rows;
  t.cols = cols;
  t.group = simd::IsTiled(format) ? group : 0;
  const simd::WeightRef shape = t.Shape();
  t.data.bytes = PackedDataBytes(shape);
  t.data.offset = Place(t.data.bytes, kPackAlign);
  t.scales.bytes = PackedScaleBytes(shape);
  if (t.scales.bytes) t.scales.offset = Place(t.scales.bytes, kPackAlign);
  if (expert_open_) experts_.back().range.bytes = end_ - experts_.back().range.offset;
  tensors_.push_back(std::move(t));
  return tensors_.size() - 1;
}

uint64_t PackLayout::payload_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors_) n += t.data.bytes + t.scales.bytes;
  return n;
}

nlohmann::json PackDirectoryJson(const PackLayout& layout, const nlohmann::json& meta) {
  nlohmann::json j = meta.is_object() ? meta : nlohmann::json::object();
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : layout.tensors()) {
    tensors.push_back({{"name", t.name},
                       {"format", PackedFormatName(t.format)},
                       {"rows", t.rows},
                       {"cols", t.cols},
                       {"group", t.group},
                       {"data_offset", t.data.offset},
                       {"data_bytes", t.data.bytes},
                       {"scales_offset", t.scales.offset},
                       {"scales_bytes", t.scales.bytes},
                       {"hash", HashHex(t.hash)}});
  }
  nlohmann::json experts = nlohmann::json::array();
  for (const auto& e : layout.experts())
    experts.push_back({{"layer", e.layer}, {"expert", e.expert}, {"offset", e.range.offset}, {"bytes", e.range.bytes}});
  j["tensors"] = std::move(tensors);
  j["experts"] = std::move(experts);
  return j;
}

StatusOr<std::unique_ptr<PackWriter>> PackWriter::Create(const std::string& path) {
  std::unique_ptr<PackWriter> w(new PackWriter());
  w->path_ = path;
  w->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return IoError(path, ": cannot create: ", std::strerror(errno));
  return w;
}

PackWriter::~PackWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status PackWriter::Write(uint64_t offset, const void* data, size_t n) {
  if (fd_ < 0) return Status(StatusCode::kInternal, path_ + ": write after Finish");
  return WriteAll(fd_, path_, offset, data, n);
}

Status PackWriter::Finish(const PackLayout& layout, const nlohmann::json& meta) {
  if (fd_ < 0) return Status(StatusCode::kInternal, path_ + ": Finish called twice");
  const std::string dir = PackDirectoryJson(layout, meta).dump();
  PackHeader h;
  h.directory_offset = RoundUp(layout.data_end(), kPackAlign);
  h.directory_bytes = dir.size();
  h.directory_hash = Hash64(dir.data(), dir.size());
  h.file_size = h.directory_offset + h.directory_bytes;
  M3_RETURN_IF_ERROR(WriteAll(fd_, path_, h.directory_offset, dir.data(), dir.size()));
  if (::ftruncate(fd_, static_cast<off_t>(h.file_size)) != 0)
    return IoError(path_, ": cannot set the file size: ", std::strerror(errno));
  // Everything else must be on disk before the header makes the file look valid.
  if (::fsync(fd_) != 0) return IoError(path_, ": fsync failed: ", std::strerror(errno));
  const std::vector<uint8_t> header = EncodePackHeader(h);
  M3_RETURN_IF_ERROR(WriteAll(fd_, path_, 0, header.data(), header.size()));
  if (::fsync(fd_) != 0) return IoError(path_, ": fsync failed: ", std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return IoError(path_, ": close failed: ", std::strerror(errno));
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Reading.

namespace {

// Limits that keep every size computation far from 64-bit overflow.
constexpr uint64_t kMaxDim = uint64_t{1} << 31;
constexpr uint64_t kMaxNumel = uint64_t{1} << 48;
constexpr uint64_t kMaxGroup = 1 << 16;

Status ParseTensor(const std::string& path, const nlohmann::json& e, size_t index, uint64_t data_begin,
                   uint64_t data_end, PackedTensor* t) {
  std::string where = Str(path, ": directory tensor #", index);
  if (!e.is_object()) return Corrupt(where, " is not an object");
  if (!e.contains("name") || !e["name"].is_string() || e["name"].get<std::string>().empty())
    return Corrupt(where, " has no 'name' string");
  t->name = e["name"].get<std::string>();
  where = path + ": tensor '" + t->name + "'";
  if (!e.contains("format") || !e["format"].is_string()) return Corrupt(where, ": missing or non-string 'format'");
  const auto fmt = ParsePackedFormat(e["format"].get<std::string>());
  if (!fmt) return Unsupported(where, ": unknown format '", e["format"].get<std::string>(), "' (f32, q8, q4 or bf16t)");
  t->format = *fmt;
  for (const char* key : {"rows", "cols", "group", "data_offset", "data_bytes", "scales_offset", "scales_bytes"}) {
    uint64_t v;
    if (!GetUnsigned(e, key, &v)) return Corrupt(where, ": '", key, "' must be a non-negative integer");
  }
  GetUnsigned(e, "rows", &t->rows);
  GetUnsigned(e, "cols", &t->cols);
  GetUnsigned(e, "group", &t->group);
  GetUnsigned(e, "data_offset", &t->data.offset);
  GetUnsigned(e, "data_bytes", &t->data.bytes);
  GetUnsigned(e, "scales_offset", &t->scales.offset);
  GetUnsigned(e, "scales_bytes", &t->scales.bytes);
  if (!e.contains("hash") || !ParseHashHex(e["hash"], &t->hash))
    return Corrupt(where, ": 'hash' must be 16 lowercase hex digits");

  if (t->rows == 0 || t->cols == 0 || t->rows > kMaxDim || t->cols > kMaxDim || t->rows * t->cols > kMaxNumel)
    return Corrupt(where, ": shape [", t->rows, ", ", t->cols, "] is empty or too large");
  if (simd::IsTiled(t->format)) {
    if (t->group == 0 || t->group % 32 != 0 || t->group > kMaxGroup)
      return Corrupt(where, ": group ", t->group, " must be a positive multiple of 32");
    if (simd::IsSuperBlock(t->format) && t->group != simd::kSuperGroup)
      return Corrupt(where, ": ", PackedFormatName(t->format), " group ", t->group, " must be ", simd::kSuperGroup);
  } else if (t->group != 0) {
    return Corrupt(where, ": group ", t->group, " given for an f32 tensor");
  }
  const simd::WeightRef shape = t->Shape();
  const uint64_t want_data = PackedDataBytes(shape), want_scales = PackedScaleBytes(shape);
  if (t->data.bytes != want_data || t->scales.bytes != want_scales)
    return Corrupt(where, ": ", PackedFormatName(t->format), " [", t->rows, ", ", t->cols, "] group ", t->group,
                   " needs ", want_data, " data and ", want_scales, " scale bytes but the directory says ",
                   t->data.bytes, " and ", t->scales.bytes);
  if (t->scales.bytes == 0 && t->scales.offset != 0)
    return Corrupt(where, ": scales_offset ", t->scales.offset, " given without scales");
  for (const auto& [range, what] : {std::pair{t->data, "data"}, std::pair{t->scales, "scales"}}) {
    if (range.bytes == 0) continue;
    if (range.offset % kPackAlign != 0)
      return Corrupt(where, ": ", what, " offset ", range.offset, " is not ", kPackAlign, "-byte aligned");
    if (range.offset < data_begin || range.offset > data_end || range.bytes > data_end - range.offset)
      return Corrupt(where, ": ", what, " [", range.offset, ", ", range.offset + range.bytes,
                     ") lies outside the tensor data section [", data_begin, ", ", data_end, ") (file truncated?)");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<PackFile>> PackFile::Open(const std::string& path) {
  std::unique_ptr<PackFile> pf(new PackFile());
  M3_ASSIGN_OR_RETURN(pf->file_, MappedFile::Open(path));
  const uint8_t* base = pf->file_->data();
  const uint64_t size = pf->file_->size();
  if (size < kPackHeaderBytes)
    return Corrupt(path, ": truncated (", size, " bytes; a packed model file starts with a ", kPackHeaderBytes,
                   "-byte header)");
  if (std::memcmp(base, kPackMagic, 8) != 0) {
    if (std::all_of(base, base + 8, [](uint8_t b) { return b == 0; }))
      return Corrupt(path, ": incomplete packed model file (no magic; the header is written last, so `m3 pack` "
                           "probably did not finish)");
    return Corrupt(path, ": not an m3 packed model file (bad magic)");
  }
  const uint32_t version = GetU32(base + 8);
  if (version != kPackVersion)
    return Unsupported(path, ": packed format version ", version, " is not supported (this m3 reads version ",
                       kPackVersion, "; re-run `m3 pack`)");
  if (GetU64(base + kPackHeaderHashOffset) != Hash64(base, kPackHeaderHashOffset))
    return Corrupt(path, ": header hash mismatch (the header is damaged)");
  // The hash covers the fields only; the rest of the header is zero by the format, so a damaged
  // byte there is caught too.
  const size_t reserved = kPackHeaderHashOffset + 8;  // after the hash field
  if (const uint8_t* nz = std::find_if(base + reserved, base + kPackHeaderBytes, [](uint8_t b) { return b != 0; });
      nz != base + kPackHeaderBytes)
    return Corrupt(path, ": header byte ", nz - base, " is not zero (bytes ", reserved, "-", kPackHeaderBytes - 1,
                   " are reserved; the header is damaged)");
  PackHeader h;
  h.header_bytes = GetU32(base + 12);
  h.file_size = GetU64(base + 16);
  h.directory_offset = GetU64(base + 24);
  h.directory_bytes = GetU64(base + 32);
  h.directory_hash = GetU64(base + 40);
  pf->directory_hash_ = h.directory_hash;
  if (h.header_bytes != kPackHeaderBytes)
    return Corrupt(path, ": header size ", h.header_bytes, " is not ", kPackHeaderBytes);
  if (h.file_size != size)
    return Corrupt(path, ": file is ", size, " bytes but its header says ", h.file_size, " (truncated or appended to)");
  if (h.directory_offset < kPackHeaderBytes || h.directory_offset > size ||
      h.directory_bytes > size - h.directory_offset)
    return Corrupt(path, ": directory [", h.directory_offset, ", +", h.directory_bytes, ") lies outside the file (",
                   size, " bytes)");
  const char* dir = reinterpret_cast<const char*>(base + h.directory_offset);
  if (Hash64(dir, h.directory_bytes) != h.directory_hash)
    return Corrupt(path, ": directory hash mismatch (the directory is damaged)");
  StatusOr<nlohmann::json> directory =
      ParseJson<nlohmann::json>(std::string_view(dir, h.directory_bytes), path + ": directory");
  if (!directory.ok()) return Corrupt(directory.status().message());
  pf->directory_ = std::move(directory).value();
  const nlohmann::json& j = pf->directory_;
  if (!j.is_object()) return Corrupt(path, ": directory is not a JSON object");
  if (!j.contains("tensors") || !j["tensors"].is_array()) return Corrupt(path, ": directory has no 'tensors' array");
  if (!j.contains("experts") || !j["experts"].is_array()) return Corrupt(path, ": directory has no 'experts' array");
  if (j.contains("pack_type") && !j["pack_type"].is_string()) return Corrupt(path, ": 'pack_type' is not a string");

  const uint64_t data_begin = kPackHeaderBytes, data_end = h.directory_offset;
  pf->tensors_.resize(j["tensors"].size());
  for (size_t i = 0; i < pf->tensors_.size(); ++i) {
    PackedTensor& t = pf->tensors_[i];
    M3_RETURN_IF_ERROR(ParseTensor(path, j["tensors"][i], i, data_begin, data_end, &t));
    if (!pf->by_name_.emplace(t.name, i).second) return Corrupt(path, ": tensor '", t.name, "' is listed twice");
  }
  // No byte may belong to two tensors: a damaged directory could alias one onto another.
  struct Span {
    ByteRange r;
    const std::string* name;
  };
  std::vector<Span> spans;
  for (const auto& t : pf->tensors_) {
    spans.push_back({t.data, &t.name});
    if (t.scales.bytes) spans.push_back({t.scales, &t.name});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.r.offset < b.r.offset; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].r.offset < spans[i - 1].r.end())
      return Corrupt(path, ": tensors '", *spans[i - 1].name, "' and '", *spans[i].name, "' overlap");

  for (size_t i = 0; i < j["experts"].size(); ++i) {
    const auto& e = j["experts"][i];
    uint64_t layer, expert, offset, bytes;
    if (!e.is_object() || !GetUnsigned(e, "layer", &layer) || !GetUnsigned(e, "expert", &expert) ||
        !GetUnsigned(e, "offset", &offset) || !GetUnsigned(e, "bytes", &bytes) || layer > INT32_MAX ||
        expert > INT32_MAX)
      return Corrupt(path, ": directory expert range #", i, " needs non-negative integer layer, expert, offset, bytes");
    const std::string where = Str(path, ": expert range of layer ", layer, " expert ", expert);
    if (offset % kPackPageAlign != 0) return Corrupt(where, ": offset ", offset, " is not page (4096) aligned");
    if (offset < data_begin || offset > data_end || bytes > data_end - offset)
      return Corrupt(where, ": [", offset, ", ", offset + bytes, ") lies outside the tensor data section");
    ExpertRangeEntry entry{static_cast<int>(layer), static_cast<int>(expert), {offset, bytes}};
    if (!pf->expert_index_.emplace(std::pair{entry.layer, entry.expert}, pf->experts_.size()).second)
      return Corrupt(where, ": listed twice");
    pf->experts_.push_back(entry);
  }
  return pf;
}

std::string PackFile::pack_type() const {
  auto it = directory_.find("pack_type");
  return it != directory_.end() && it->is_string() ? it->get<std::string>() : std::string();
}

const PackedTensor* PackFile::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

bool PackFile::HasPrefix(const std::string& prefix) const {
  auto it = by_name_.lower_bound(prefix);
  return it != by_name_.end() && it->first.rfind(prefix, 0) == 0;
}

const ByteRange* PackFile::ExpertRange(int layer, int expert) const {
  auto it = expert_index_.find({layer, expert});
  return it == expert_index_.end() ? nullptr : &experts_[it->second].range;
}

simd::WeightRef PackFile::Weight(const PackedTensor& t) const {
  simd::WeightRef w = t.Shape();
  w.data = file_->data() + t.data.offset;
  w.scales = t.scales.bytes ? file_->data() + t.scales.offset : nullptr;
  return w;
}

std::vector<float> PackFile::F32Values(const PackedTensor& t) const {
  std::vector<float> v;
  if (t.format != WeightFormat::kF32) return v;
  v.resize(t.numel());
  std::memcpy(v.data(), file_->data() + t.data.offset, t.data.bytes);
  return v;
}

Status PackFile::VerifyTensor(size_t i) const {
  const PackedTensor& t = tensors_[i];
  const uint8_t* base = file_->data();
  const uint64_t got =
      PackedTensorHash(Hash64(base + t.data.offset, t.data.bytes), Hash64(base + t.scales.offset, t.scales.bytes));
  if (got != t.hash)
    return Corrupt(path(), ": tensor '", t.name, "' is damaged (content hash ", HashHex(got), ", directory says ",
                   HashHex(t.hash), "): the file changed after it was packed; pack or copy it again");
  return Status::Ok();
}

bool PackFile::TensorResident(size_t i) const {
  const PackedTensor& t = tensors_[i];
  return IsResident(file_->data() + t.data.offset, t.data.bytes) &&
         IsResident(file_->data() + t.scales.offset, t.scales.bytes);
}

std::string PackFile::Identity() const {
  struct stat st {};
  if (::stat(path().c_str(), &st) != 0) return "";
  const uint64_t parts[] = {directory_hash_, static_cast<uint64_t>(st.st_size), static_cast<uint64_t>(st.st_dev),
                            static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_mtim.tv_sec),
                            static_cast<uint64_t>(st.st_mtim.tv_nsec)};
  return HashHex(Hash64(parts, sizeof(parts)));
}

Status PackFile::Verify(const ThreadConfig& tc) const {
  std::vector<Status> got(tensors_.size());
  const int threads = std::max(1, tc.threads);
  // Tensor sizes differ by orders of magnitude: hand them out one at a time.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const PackedTensor& t = tensors_[i];
    got[i] = VerifyTensor(i);
    file_->DontNeed(t.data.offset, t.data.bytes);
    if (t.scales.bytes) file_->DontNeed(t.scales.offset, t.scales.bytes);
  }
  for (const Status& s : got) M3_RETURN_IF_ERROR(s);
  return Status::Ok();
}

}  // namespace m3
