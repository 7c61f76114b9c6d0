#include "format/safetensors.h"
#include "base/json_guard.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace m3 {
namespace fs = std::filesystem;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::ShapeString() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

StatusOr<nlohmann::json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!fs::exists(path)) return NotFound(path, ": no such file");
    return IoError(path, ": cannot read");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  StatusOr<nlohmann::json> j = ParseJson<nlohmann::json>(ss.str(), path);
  if (!j.ok()) return Corrupt(j.status().message());
  return j;
}

namespace {

bool ReadU64Array(const nlohmann::json& j, size_t want_len, std::vector<uint64_t>* out) {
  if (!j.is_array() || (want_len && j.size() != want_len)) return false;
  out->clear();
  for (const auto& v : j) {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) return false;
    out->push_back(v.get<uint64_t>());
  }
  return true;
}

}  // namespace

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto st = std::make_unique<SafetensorsFile>();
  M3_ASSIGN_OR_RETURN(st->file_, MappedFile::Open(path));
  const MappedFile& f = *st->file_;
  if (f.size() < 8) return Corrupt(path, ": truncated (", f.size(), " bytes; a safetensors file starts with an 8-byte header length)");
  uint64_t header_len;
  std::memcpy(&header_len, f.data(), 8);
  if (header_len > f.size() - 8)
    return Corrupt(path, ": header length ", header_len, " runs past the end of the file (", f.size(), " bytes)");
  const char* hdr = reinterpret_cast<const char*>(f.data() + 8);
  StatusOr<nlohmann::json> header = ParseJson<nlohmann::json>(std::string_view(hdr, header_len), path + ": header");
  if (!header.ok()) return Corrupt(header.status().message());
  const nlohmann::json& j = *header;
  if (!j.is_object()) return Corrupt(path, ": header is not a JSON object");

  const uint8_t* data_begin = f.data() + 8 + header_len;
  const uint64_t data_size = f.size() - 8 - header_len;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (it.value().is_object())
        for (auto m = it.value().begin(); m != it.value().end(); ++m)
          if (m.value().is_string()) st->metadata_[m.key()] = m.value().get<std::string>();
      continue;
    }
    const auto& e = it.value();
    const std::string where = path + ": tensor '" + name + "'";
    if (!e.is_object()) return Corrupt(where, ": entry is not an object");
    if (!e.contains("dtype") || !e["dtype"].is_string()) return Corrupt(where, ": missing or non-string 'dtype'");
    auto dtype = ParseDType(e["dtype"].get<std::string>());
    if (!dtype) return Unsupported(where, ": unknown dtype '", e["dtype"].get<std::string>(), "'");
    std::vector<uint64_t> shape, offsets;
    if (!e.contains("shape") || !ReadU64Array(e["shape"], 0, &shape))
      return Corrupt(where, ": 'shape' must be an array of non-negative integers");
    if (!e.contains("data_offsets") || !ReadU64Array(e["data_offsets"], 2, &offsets))
      return Corrupt(where, ": 'data_offsets' must be [begin, end] with non-negative integers");
    if (offsets[0] > offsets[1]) return Corrupt(where, ": data_offsets begin ", offsets[0], " > end ", offsets[1]);
    if (offsets[1] > data_size)
      return Corrupt(where, ": data_offsets [", offsets[0], ", ", offsets[1], ") outside the data section (",
                     data_size, " bytes; file truncated?)");
    // Element count with overflow checks (a hostile shape must not wrap around).
    uint64_t numel = 1;
    for (uint64_t d : shape) {
      if (d != 0 && numel > UINT64_MAX / d) return Corrupt(where, ": shape overflows");
      numel *= d;
    }
    const uint64_t esize = DTypeSize(*dtype);
    if (numel > UINT64_MAX / esize || numel * esize != offsets[1] - offsets[0])
      return Corrupt(where, ": shape ", e["shape"].dump(), " of ", DTypeName(*dtype), " needs ", numel * esize,
                     " bytes but data_offsets span ", offsets[1] - offsets[0]);
    TensorInfo t;
    t.name = name;
    t.dtype = *dtype;
    for (uint64_t d : shape) t.shape.push_back(static_cast<int64_t>(d));
    t.data = data_begin + offsets[0];
    t.nbytes = offsets[1] - offsets[0];
    t.file = st->file_.get();
    st->tensors_.push_back(std::move(t));
  }
  // Byte ranges must not overlap: a hostile file could alias one tensor onto another.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : st->tensors_)
    if (t.nbytes) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->data < by_offset[i - 1]->data + by_offset[i - 1]->nbytes)
      return Corrupt(path, ": tensors '", by_offset[i - 1]->name, "' and '", by_offset[i]->name, "' overlap");
  return st;
}

Status WriteSafetensors(const std::string& path, std::span<const F32Tensor> tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const F32Tensor& t : tensors) {
    if (t.name == "__metadata__" || header.contains(t.name))
      return InvalidArgument(path, ": tensor name '", t.name, "' is reserved or given twice");
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + numel * 4}}};
    offset += numel * 4;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data 8-byte aligned
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out) return IoError(partial, ": cannot create");
    const uint64_t len = text.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const F32Tensor& t : tensors) {
      uint64_t numel = 1;
      for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
      out.write(reinterpret_cast<const char*>(t.data), static_cast<std::streamsize>(numel * 4));
    }
    out.flush();
    if (!out) return IoError(partial, ": write failed (disk full?)");
  }
  std::error_code ec;
  fs::rename(partial, path, ec);
  if (ec) return IoError(path, ": cannot rename ", partial, ": ", ec.message());
  return Status::Ok();
}

namespace {
constexpr const char* kVlPrefix = "language_model.";
bool IsNonTextModule(const std::string& name) {
  for (const char* p : {"vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "vision_model."})
    if (name.rfind(p, 0) == 0) return true;
  return false;
}
}  // namespace

StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  auto ck = std::unique_ptr<Checkpoint>(new Checkpoint());
  ck->dir_ = dir;
  if (!fs::is_directory(dir)) return NotFound(dir, ": not a model folder");
  M3_ASSIGN_OR_RETURN(ck->config_, ReadJsonFile((fs::path(dir) / "config.json").string()));
  if (!ck->config_.is_object()) return Corrupt(dir, "/config.json: not a JSON object");

  // Which files, and which tensor each file must hold.
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> weight_map;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    M3_ASSIGN_OR_RETURN(nlohmann::json index, ReadJsonFile(index_path.string()));
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      return Corrupt(index_path.string(), ": missing 'weight_map' object");
    std::set<std::string> shards;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it.value().is_string()) return Corrupt(index_path.string(), ": weight_map entry '", it.key(), "' is not a file name");
      std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "..")
        return Corrupt(index_path.string(), ": weight_map entry '", it.key(), "' names an invalid file '", shard, "'");
      weight_map[it.key()] = shard;
      shards.insert(shard);
    }
    for (const auto& s : shards) {
      if (!fs::exists(fs::path(dir) / s))
        return NotFound(dir, "/", s, ": shard named in model.safetensors.index.json is missing");
      shard_names.push_back(s);
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    shard_names.push_back("model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") shard_names.push_back(e.path().filename().string());
    std::sort(shard_names.begin(), shard_names.end());
  }
  if (shard_names.empty()) return NotFound(dir, ": no model.safetensors, index or *.safetensors files");

  std::map<std::string, const TensorInfo*> all;
  std::map<std::string, std::string> file_of;
  for (const auto& s : shard_names) {
    M3_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open((fs::path(dir) / s).string()));
    for (const auto& t : file->tensors()) {
      if (all.count(t.name)) return Corrupt(dir, ": tensor '", t.name, "' stored twice (", file_of[t.name], " and ", s, ")");
      all[t.name] = &t;
      file_of[t.name] = s;
    }
    ck->files_.push_back(std::move(file));
  }
  for (const auto& [name, shard] : weight_map) {
    auto it = file_of.find(name);
    if (it == file_of.end()) return NotFound(dir, "/", shard, ": tensor '", name, "' listed in the index is not in the shard");
    if (it->second != shard)
      return Corrupt(dir, ": tensor '", name, "' is in ", it->second, " but the index says ", shard);
  }

  for (const auto& [name, _] : all)
    if (name.rfind(kVlPrefix, 0) == 0) ck->vl_prefix_ = true;
  for (const auto& [name, info] : all) {
    std::string text_name = name;
    if (ck->vl_prefix_) {
      if (name.rfind(kVlPrefix, 0) != 0) {
        if (IsNonTextModule(name)) {
          ++ck->skipped_;
          continue;
        }
        return Corrupt(dir, ": tensor '", name, "' is outside 'language_model.' and not a known vision/projector module");
      }
      text_name = name.substr(std::strlen(kVlPrefix));
    }
    if (IsNonTextModule(text_name)) {
      ++ck->skipped_;
      continue;
    }
    ck->text_[text_name] = info;
  }
  return ck;
}

const TensorInfo* Checkpoint::Find(const std::string& name) const {
  auto it = text_.find(name);
  return it == text_.end() ? nullptr : it->second;
}

}  // namespace m3
