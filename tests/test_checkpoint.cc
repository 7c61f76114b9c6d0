// Checkpoint loading (lib/format/safetensors.cc, lib/model/weights.cc): every golden folder loads,
// and every kind of damaged file or folder gives a non-ok Status naming the file and/or tensor
// instead of a crash. Damage is always done to a copy of a golden folder inside a TempDir.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "format/npy.h"
#include "format/safetensors.h"
#include "model/dense_part.h"
#include "model/model.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using m3::StatusCode;
using m3::test::RequireError;
using Catch::Matchers::Contains;

using m3::test::kGoldenCases;
using m3::test::ReadBytes;
using m3::test::WriteBytes;

json ReadJson(const fs::path& p) { return json::parse(ReadBytes(p)); }
void WriteJson(const fs::path& p, const json& j) { WriteBytes(p, j.dump(2)); }

std::string U64Le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file split into its header JSON and its data section.
struct Safetensors {
  json header;
  std::string data;
};

Safetensors ReadSafetensors(const fs::path& p) {
  const std::string bytes = ReadBytes(p);
  REQUIRE(bytes.size() >= 8);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  REQUIRE(n <= bytes.size() - 8);
  return {json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
}

// Writes header + data; the header is space-padded to a multiple of 8 so the data stays aligned.
void WriteSafetensors(const fs::path& p, const json& header, const std::string& data) {
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  WriteBytes(p, U64Le(h.size()) + h + data);
}

// Rewrites a file's header through `edit`; `extra_data` is appended to the data section.
void EditHeader(const fs::path& p, const std::function<void(json&, uint64_t data_size)>& edit,
                const std::string& extra_data = "") {
  Safetensors st = ReadSafetensors(p);
  edit(st.header, st.data.size());
  WriteSafetensors(p, st.header, st.data + extra_data);
}

// Copies a golden folder's config, index and shards into `tmp`, writable.
fs::path CopyGolden(const std::string& name, const m3::test::TempDir& tmp) {
  const fs::path dst = tmp.path() / name;
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(m3::test::GoldenDir(name))) {
    const std::string fn = e.path().filename().string();
    if (fn != "config.json" && fn != "model.safetensors.index.json" && e.path().extension() != ".safetensors") continue;
    fs::copy_file(e.path(), dst / fn);
    fs::permissions(dst / fn, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::add);
  }
  return dst;
}

// The shard file the index assigns to `tensor`.
std::string ShardOf(const fs::path& dir, const std::string& tensor) {
  json index = ReadJson(dir / "model.safetensors.index.json");
  REQUIRE(index["weight_map"].contains(tensor));
  return index["weight_map"][tensor].get<std::string>();
}


template <class T>
void RequireOk(const m3::StatusOr<T>& r) {
  INFO(r.status().message());
  REQUIRE(r.ok());
}

const std::string kQProj = "model.layers.0.self_attn.q_proj.weight";

}  // namespace

// ----------------------------------------------------------------------------------------------
// Positive cases.

TEST_CASE("every golden checkpoint loads", "[checkpoint]") {
  for (const char* name : kGoldenCases) {
    SECTION(name) {
      auto m = m3::Model::Load(m3::test::GoldenDir(name));
      RequireOk(m);
      const auto& model = *m.value();
      CHECK(model.weights().layers.size() == static_cast<size_t>(model.config().num_layers));
      CHECK(model.stats().total_params > 0);
      CHECK(model.stats().active_params > 0);
      CHECK(model.stats().active_params <= model.stats().total_params);
      REQUIRE(model.checkpoint() != nullptr);
      CHECK(model.checkpoint()->Find("model.embed_tokens.weight") != nullptr);
    }
  }
}

TEST_CASE("golden checkpoint layout: files, shards and prefixes", "[checkpoint]") {
  SECTION("s1: one file, every tensor's bytes match its shape") {
    auto st = m3::SafetensorsFile::Open(m3::test::GoldenDir("s1_fp32_basic") + "/model.safetensors");
    RequireOk(st);
    CHECK(st.value()->tensors().size() == 96);
    for (const auto& t : st.value()->tensors()) CHECK(t.nbytes == static_cast<size_t>(t.numel()) * 4);
    auto ck = m3::Checkpoint::Open(m3::test::GoldenDir("s1_fp32_basic"));
    RequireOk(ck);
    CHECK(ck.value()->files().size() == 1);
    CHECK_FALSE(ck.value()->is_vl_layout());
    CHECK(ck.value()->skipped_tensor_count() == 0);
    const m3::TensorInfo* q = ck.value()->Find(kQProj);
    REQUIRE(q != nullptr);
    CHECK(q->shape == std::vector<int64_t>{128, 64});
    CHECK(ck.value()->Find("no.such.tensor") == nullptr);
  }
  SECTION("s2 and s6: every shard is opened") {
    auto s2 = m3::Checkpoint::Open(m3::test::GoldenDir("s2_bf16_sharded_init1"));
    RequireOk(s2);
    CHECK(s2.value()->files().size() == 2);
    auto s6 = m3::Checkpoint::Open(m3::test::GoldenDir("s6_fp16_mha_top1_sharded3"));
    RequireOk(s6);
    CHECK(s6.value()->files().size() == 3);
  }
  SECTION("s3: MXFP8 weights with their U8 scales") {
    auto ck = m3::Checkpoint::Open(m3::test::GoldenDir("s3_mxfp8_mixed_layers_local2"));
    RequireOk(ck);
    const m3::TensorInfo* q = ck.value()->Find(kQProj);
    const m3::TensorInfo* s = ck.value()->Find(kQProj + "_scale_inv");
    REQUIRE(q != nullptr);
    REQUIRE(s != nullptr);
    CHECK(q->dtype == m3::DType::kF8E4M3);
    CHECK(s->dtype == m3::DType::kU8);
    CHECK(s->shape == std::vector<int64_t>{q->shape[0], q->shape[1] / 32});
  }
  SECTION("s4: vision tensors skipped, language_model. stripped") {
    const std::string dir = m3::test::GoldenDir("s4_vl_bf16_full_rotary_topk_gt_blocks");
    auto ck = m3::Checkpoint::Open(dir);
    RequireOk(ck);
    CHECK(ck.value()->is_vl_layout());
    // Every stored name outside language_model. is a vision/projector tensor and is skipped.
    const json header = ReadSafetensors(dir + "/model.safetensors").header;
    size_t outside = 0;
    for (const auto& [name, _] : header.items())
      if (name != "__metadata__" && name.rfind("language_model.", 0) != 0) ++outside;
    CHECK(outside > 0);
    CHECK(ck.value()->skipped_tensor_count() == outside);
    CHECK(ck.value()->Find("model.embed_tokens.weight") != nullptr);
    CHECK(ck.value()->Find("language_model.model.embed_tokens.weight") == nullptr);
    for (const auto& [name, _] : ck.value()->text_tensors()) {
      CHECK(name.rfind("language_model.", 0) != 0);
      CHECK(name.rfind("vision_tower.", 0) != 0);
      CHECK(name.rfind("multi_modal_projector.", 0) != 0);
    }
  }
}

TEST_CASE("re-written and renamed copies still load", "[checkpoint]") {
  m3::test::TempDir tmp;
  const fs::path dir = CopyGolden("s1_fp32_basic", tmp);
  SECTION("header re-serialized by the test helper") {  // validates EditHeader itself
    EditHeader(dir / "model.safetensors", [](json&, uint64_t) {});
    RequireOk(m3::Model::Load(dir.string()));
  }
  SECTION("no index and no model.safetensors: *.safetensors are found by listing") {
    fs::rename(dir / "model.safetensors", dir / "weights.safetensors");
    RequireOk(m3::Model::Load(dir.string()));
  }
}

// ----------------------------------------------------------------------------------------------
// Damaged safetensors files.

TEST_CASE("damaged safetensors files are refused", "[checkpoint]") {
  m3::test::TempDir tmp;
  const fs::path dir = CopyGolden("s1_fp32_basic", tmp);
  const fs::path file = dir / "model.safetensors";
  const std::string path = file.string();
  const std::string bytes = ReadBytes(file);

  SECTION("cut in half") {
    WriteBytes(file, bytes.substr(0, bytes.size() / 2));
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "tensor '", "outside the data section"});
    // The same error reaches Model::Load.
    RequireError(m3::Model::Load(dir.string()), StatusCode::kCorrupt, {path, "outside the data section"});
  }
  SECTION("cut to 4 bytes") {
    WriteBytes(file, bytes.substr(0, 4));
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "truncated"});
  }
  SECTION("empty file") {
    WriteBytes(file, "");
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "truncated"});
  }
  SECTION("header length past the end of the file") {
    WriteBytes(file, U64Le(bytes.size()) + bytes.substr(8));
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "header length"});
  }
  SECTION("header length near 2^64") {  // must not wrap around in the bounds check
    WriteBytes(file, U64Le(~uint64_t{0} - 4) + bytes.substr(8));
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "header length"});
  }
  SECTION("header is not JSON") {
    Safetensors st = ReadSafetensors(file);
    std::string h = "{\"a\": [1, 2";
    WriteBytes(file, U64Le(h.size()) + h + st.data);
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "not valid JSON"});
  }
  SECTION("header is JSON but not an object") {
    Safetensors st = ReadSafetensors(file);
    WriteSafetensors(file, json::array({1, 2, 3}), st.data);
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "not a JSON object"});
  }
  SECTION("data_offsets outside the data") {
    EditHeader(file, [](json& h, uint64_t size) {
      auto& off = h["lm_head.weight"]["data_offsets"];
      const uint64_t span = off[1].get<uint64_t>() - off[0].get<uint64_t>();
      off = {size - span + 4, size + 4};  // right length, 4 bytes past the end
    });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "'lm_head.weight'", "outside the data"});
  }
  SECTION("data_offsets begin after end") {
    EditHeader(file, [](json& h, uint64_t) { h["lm_head.weight"]["data_offsets"] = {100, 50}; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "'lm_head.weight'", "begin"});
  }
  SECTION("data_offsets negative or malformed") {
    EditHeader(file, [](json& h, uint64_t) { h["lm_head.weight"]["data_offsets"] = {-8, 0}; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "'lm_head.weight'", "data_offsets"});
    EditHeader(file, [](json& h, uint64_t) { h["lm_head.weight"]["data_offsets"] = {0}; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, "'lm_head.weight'", "data_offsets"});
  }
  SECTION("overlapping tensors") {
    // v_proj and k_proj have the same size; aliasing one onto the other keeps every size right.
    EditHeader(file, [](json& h, uint64_t) {
      h["model.layers.0.self_attn.v_proj.weight"]["data_offsets"] = h["model.layers.0.self_attn.k_proj.weight"]["data_offsets"];
    });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt,
                 {path, "overlap", "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.k_proj.weight"});
  }
  SECTION("unknown dtype") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj]["dtype"] = "F7"; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kUnsupported, {path, kQProj, "unknown dtype 'F7'"});
  }
  SECTION("dtype missing") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj].erase("dtype"); });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "dtype"});
  }
  SECTION("entry not an object") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj] = "F32"; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "not an object"});
  }
  SECTION("shape byte size disagrees with data_offsets") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj]["shape"] = {128, 63}; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "[128,63]", "data_offsets span"});
  }
  SECTION("dtype size disagrees with data_offsets") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj]["dtype"] = "BF16"; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "BF16"});
  }
  SECTION("negative shape") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj]["shape"] = {-128, -64}; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "'shape'"});
  }
  SECTION("shape whose element count overflows") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj]["shape"] = {uint64_t{1} << 40, uint64_t{1} << 40}; });
    RequireError(m3::SafetensorsFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "overflows"});
  }
}

// ----------------------------------------------------------------------------------------------
// Files that are valid on their own but do not match config.json or the index.

TEST_CASE("tensors that disagree with config.json are refused", "[checkpoint]") {
  m3::test::TempDir tmp;
  const fs::path dir = CopyGolden("s1_fp32_basic", tmp);
  const fs::path file = dir / "model.safetensors";

  SECTION("q_proj with swapped dims (same byte size)") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj]["shape"] = {64, 128}; });
    RequireOk(m3::SafetensorsFile::Open(file.string()));  // fine as a file
    RequireError(m3::Model::Load(dir.string()), StatusCode::kInvalidArgument,
                 {kQProj, "has shape [64, 128]", "config.json implies [128, 64]", "model.safetensors"});
  }
  SECTION("config.json hidden_size changed") {
    json cfg = ReadJson(dir / "config.json");
    cfg["hidden_size"] = 32;
    WriteJson(dir / "config.json", cfg);
    RequireError(m3::Model::Load(dir.string()), StatusCode::kInvalidArgument,
                 {"model.embed_tokens.weight", "[512, 64]", "[512, 32]"});
  }
  SECTION("missing tensor") {
    EditHeader(file, [](json& h, uint64_t) { h.erase("model.norm.weight"); });
    RequireError(m3::Model::Load(dir.string()), StatusCode::kNotFound, {"'model.norm.weight'", "missing"});
  }
  SECTION("unexpected extra tensor") {
    EditHeader(
        file,
        [](json& h, uint64_t size) {
          h["model.layers.0.extra.weight"] = {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {size, size + 16}}};
        },
        std::string(16, '\0'));
    RequireError(m3::Model::Load(dir.string()), StatusCode::kInvalidArgument,
                 {"'model.layers.0.extra.weight'", "not part of the model"});
  }
  SECTION("MTP tensor beyond num_mtp_modules") {
    EditHeader(
        file,
        [](json& h, uint64_t size) {
          h["model.mtp.layers.1.enorm.weight"] = {{"dtype", "F32"}, {"shape", {64}}, {"data_offsets", {size, size + 256}}};
        },
        std::string(256, '\0'));
    RequireError(m3::Model::Load(dir.string()), StatusCode::kInvalidArgument,
                 {"'model.mtp.layers.1.enorm.weight'", "MTP"});
  }
  SECTION("weight of an integer dtype") {
    EditHeader(file, [](json& h, uint64_t) { h[kQProj]["dtype"] = "I32"; });
    RequireError(m3::Model::Load(dir.string()), StatusCode::kUnsupported, {kQProj, "I32"});
  }
  SECTION("norm vector of an integer dtype") {
    EditHeader(file, [](json& h, uint64_t) { h["model.norm.weight"]["dtype"] = "I32"; });
    RequireError(m3::Model::Load(dir.string()), StatusCode::kUnsupported, {"'model.norm.weight'", "I32"});
  }
}

TEST_CASE("sharded checkpoints whose index and shards disagree are refused", "[checkpoint]") {
  m3::test::TempDir tmp;
  const fs::path dir = CopyGolden("s2_bf16_sharded_init1", tmp);
  const fs::path index = dir / "model.safetensors.index.json";

  SECTION("shard named in the index is missing") {
    fs::remove(dir / "model-00002-of-00002.safetensors");
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kNotFound, {"model-00002-of-00002.safetensors", "missing"});
    RequireError(m3::Model::Load(dir.string()), StatusCode::kNotFound, {"model-00002-of-00002.safetensors"});
  }
  SECTION("tensor listed in the index is not in its shard") {
    const std::string shard = ShardOf(dir, "model.norm.weight");
    EditHeader(dir / shard, [](json& h, uint64_t) { h.erase("model.norm.weight"); });
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kNotFound,
                 {shard, "'model.norm.weight'", "listed in the index"});
  }
  SECTION("tensor missing from both the index and its shard") {
    const std::string shard = ShardOf(dir, "model.norm.weight");
    EditHeader(dir / shard, [](json& h, uint64_t) { h.erase("model.norm.weight"); });
    json j = ReadJson(index);
    j["weight_map"].erase("model.norm.weight");
    WriteJson(index, j);
    RequireOk(m3::Checkpoint::Open(dir.string()));
    RequireError(m3::Model::Load(dir.string()), StatusCode::kNotFound, {"'model.norm.weight'", "missing"});
  }
  SECTION("index names the wrong shard") {
    json j = ReadJson(index);
    const std::string shard = j["weight_map"]["model.norm.weight"];
    j["weight_map"]["model.norm.weight"] =
        shard == "model-00001-of-00002.safetensors" ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
    WriteJson(index, j);
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {"'model.norm.weight'", "index says"});
  }
  SECTION("index without weight_map") {
    WriteJson(index, json{{"metadata", json::object()}});
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {index.string(), "weight_map"});
  }
  SECTION("index naming a file outside the folder") {
    json j = ReadJson(index);
    j["weight_map"]["model.norm.weight"] = "../model.safetensors";
    WriteJson(index, j);
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {"'model.norm.weight'", "invalid file"});
  }
  SECTION("index is not JSON") {
    WriteBytes(index, "{\"weight_map\": ");
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {index.string(), "not valid JSON"});
  }
  SECTION("tensor stored in two shards") {
    // Add a copy of shard 2's model.norm.weight to shard 1 (new bytes at the end of its data).
    const std::string shard = ShardOf(dir, "model.norm.weight");
    const std::string other =
        shard == "model-00001-of-00002.safetensors" ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
    json entry = ReadSafetensors(dir / shard).header["model.norm.weight"];
    const uint64_t n = entry["data_offsets"][1].get<uint64_t>() - entry["data_offsets"][0].get<uint64_t>();
    EditHeader(
        dir / other,
        [&](json& h, uint64_t size) {
          entry["data_offsets"] = {size, size + n};
          h["model.norm.weight"] = entry;
        },
        std::string(n, '\0'));
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {"'model.norm.weight'", "stored twice"});
  }
}

TEST_CASE("MXFP8 checkpoints with bad scale tensors are refused", "[checkpoint]") {
  m3::test::TempDir tmp;
  const fs::path dir = CopyGolden("s3_mxfp8_mixed_layers_local2", tmp);
  const std::string scale = kQProj + "_scale_inv";
  const std::string shard = ShardOf(dir, scale);

  SECTION("scale tensor missing") {
    EditHeader(dir / shard, [&](json& h, uint64_t) { h.erase(scale); });
    json j = ReadJson(dir / "model.safetensors.index.json");
    j["weight_map"].erase(scale);
    WriteJson(dir / "model.safetensors.index.json", j);
    RequireError(m3::Model::Load(dir.string()), StatusCode::kNotFound, {"'" + kQProj + "'", "'" + scale + "'", "block-scale"});
  }
  SECTION("scale tensor of the wrong shape") {
    EditHeader(dir / shard, [&](json& h, uint64_t) {
      auto shape = h[scale]["shape"];
      h[scale]["shape"] = {shape[0].get<int64_t>() / 2, shape[1].get<int64_t>() * 2};
    });
    RequireError(m3::Model::Load(dir.string()), StatusCode::kInvalidArgument, {"'" + scale + "'", "MXFP8"});
  }
  SECTION("unsupported weight_block_size") {
    json cfg = ReadJson(dir / "config.json");
    cfg["quantization_config"]["weight_block_size"] = {128, 128};
    WriteJson(dir / "config.json", cfg);
    RequireError(m3::Model::Load(dir.string()), StatusCode::kUnsupported, {"weight_block_size"});
  }
}

TEST_CASE("VL checkpoint with an unknown non-prefixed tensor is refused", "[checkpoint]") {
  m3::test::TempDir tmp;
  const fs::path dir = CopyGolden("s4_vl_bf16_full_rotary_topk_gt_blocks", tmp);
  EditHeader(
      dir / "model.safetensors",
      [](json& h, uint64_t size) {
        h["audio_tower.weight"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {size, size + 8}}};
      },
      std::string(8, '\0'));
  RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {"'audio_tower.weight'", "language_model."});
}

// ----------------------------------------------------------------------------------------------
// Folder-level problems.

TEST_CASE("bad or missing config.json and folders are refused", "[checkpoint]") {
  m3::test::TempDir tmp;
  const fs::path dir = CopyGolden("s1_fp32_basic", tmp);
  const std::string cfg = (dir / "config.json").string();

  SECTION("config.json is not JSON") {
    WriteBytes(cfg, "{\"hidden_size\": 64,");
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {cfg, "not valid JSON"});
    RequireError(m3::Model::Load(dir.string()), StatusCode::kCorrupt, {cfg});
  }
  SECTION("config.json is not an object") {
    WriteBytes(cfg, "[1, 2, 3]");
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kCorrupt, {"config.json", "not a JSON object"});
  }
  SECTION("config.json with a mistyped key") {
    json j = ReadJson(cfg);
    j["hidden_size"] = "64";
    WriteJson(cfg, j);
    RequireError(m3::Model::Load(dir.string()), StatusCode::kInvalidArgument, {dir.string(), "'hidden_size'"});
  }
  SECTION("config.json missing") {
    fs::remove(cfg);
    RequireError(m3::Checkpoint::Open(dir.string()), StatusCode::kNotFound, {cfg});
    RequireError(m3::Model::Load(dir.string()), StatusCode::kNotFound, {cfg});
  }
  SECTION("no weights in the folder") {
    fs::remove(dir / "model.safetensors");
    RequireError(m3::Model::Load(dir.string()), StatusCode::kNotFound, {dir.string(), "safetensors"});
  }
  SECTION("folder does not exist") {
    const std::string missing = (tmp.path() / "no_such_model").string();
    RequireError(m3::Checkpoint::Open(missing), StatusCode::kNotFound, {missing});
    RequireError(m3::Model::Load(missing), StatusCode::kNotFound, {missing});
  }
  SECTION("a file instead of a folder") {
    RequireError(m3::Model::Load(cfg), StatusCode::kNotFound, {cfg});
  }
  SECTION("safetensors file that does not exist") {
    const std::string missing = (dir / "nope.safetensors").string();
    RequireError(m3::SafetensorsFile::Open(missing), StatusCode::kNotFound, {missing});
  }
}

namespace {

// Adds MTP depth 0 to a copy of s1: the transformer layer reuses layer 2's tensors (sparse + MoE),
// the norms reuse model.norm, eh_proj is new zeros [H, 2H].
void AddMtpDepth(const fs::path& file, bool complete) {
  Safetensors st = ReadSafetensors(file);
  json added = json::object();
  std::string extra;
  auto append = [&](const std::string& name, const json& dtype, const json& shape, const std::string& bytes) {
    const uint64_t begin = st.data.size() + extra.size();
    extra += bytes;
    added[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, begin + bytes.size()}}};
  };
  auto bytes_of = [&](const json& e) {
    return st.data.substr(e["data_offsets"][0].get<size_t>(),
                          e["data_offsets"][1].get<size_t>() - e["data_offsets"][0].get<size_t>());
  };
  const std::string layer = "model.layers.2.";
  for (auto it = st.header.begin(); it != st.header.end(); ++it) {
    if (it.key().rfind(layer, 0) != 0) continue;
    if (!complete && it.key().find("o_proj") != std::string::npos) continue;  // leave a hole
    append("model.mtp.layers.0.transformer_layer." + it.key().substr(layer.size()), it.value()["dtype"],
           it.value()["shape"], bytes_of(it.value()));
  }
  const json& norm = st.header["model.norm.weight"];
  for (const char* n : {"enorm", "hnorm", "final_layernorm"})
    append(std::string("model.mtp.layers.0.") + n + ".weight", norm["dtype"], norm["shape"], bytes_of(norm));
  const int64_t H = norm["shape"][0].get<int64_t>();
  append("model.mtp.layers.0.eh_proj.weight", "F32", {H, 2 * H}, std::string(H * 2 * H * 4, '\0'));
  for (auto it = added.begin(); it != added.end(); ++it) st.header[it.key()] = it.value();
  WriteSafetensors(file, st.header, st.data + extra);
}

TEST_CASE("MTP modules are bound when their tensors are present", "[checkpoint][mtp]") {
  m3::test::TempDir tmp;
  SECTION("complete depth 0 binds and is counted") {
    const fs::path dir = CopyGolden("s1_fp32_basic", tmp);
    AddMtpDepth(dir / "model.safetensors", true);
    auto model = m3::Model::Load(dir.string());
    RequireOk(model);
    CHECK((*model)->stats().mtp_depths == 1);
    REQUIRE((*model)->weights().mtp.size() == 1);
    const auto& mtp = (*model)->weights().mtp[0];
    CHECK(mtp.eh_proj.rows == 64);
    CHECK(mtp.eh_proj.cols == 128);
    CHECK(mtp.layer.attn.sparse);
    CHECK(mtp.layer.is_moe);
  }
  SECTION("an incomplete depth is refused, naming the missing tensor") {
    const fs::path dir = CopyGolden("s1_fp32_basic", tmp);
    AddMtpDepth(dir / "model.safetensors", false);
    RequireError(m3::Model::Load(dir.string()), StatusCode::kNotFound,
                 {"model.mtp.layers.0.transformer_layer.self_attn.o_proj.weight"});
  }
}

}  // namespace

// The dense part (model/dense_part.h) counts every bound weight but the routed experts and an untied
// embedding table: the binding's own count (WeightStats) says the same, on every golden case.
TEST_CASE("the dense part is every weight but the routed experts and the embedding table", "[checkpoint][dense]") {
  for (const auto& [name, dir] : m3::test::GoldenCases()) {
    INFO(name);
    auto model = m3::Model::Load(dir);
    REQUIRE(model.ok());
    const m3::WeightStats& s = (*model)->stats();
    const m3::DensePart part = m3::MeasureDensePart((*model)->config(), (*model)->weights());
    const int64_t embedding = (*model)->config().tie_word_embeddings ? 0 : s.embedding_params;
    CHECK(part.params() == s.total_params - s.routed_expert_params - embedding);
    CHECK(part.bytes() > 0);
    bool has_attention = false;
    for (const m3::DensePartGroup& g : part.groups) {
      CHECK(g.params > 0);
      has_attention = has_attention || g.name == "attention";
    }
    CHECK(has_attention);
  }
}

// The GPU footprint of the dense part and its caches, the refusal when it does not fit, and the
// longest context that does, on every golden case.
TEST_CASE("the GPU footprint is the dense part and the caches, and a GPU too small is refused with both", "[checkpoint][dense]") {
  for (const auto& [name, dir] : m3::test::GoldenCases()) {
    INFO(name);
    auto model = m3::Model::Load(dir);
    REQUIRE(model.ok());
    const m3::ModelConfig& c = (*model)->config();
    const m3::DensePart dense = m3::MeasureDensePart(c, (*model)->weights());
    const m3::CacheOptions bf16{m3::CacheType::kBF16, m3::CacheType::kF32};
    const m3::GpuFootprint f = m3::EstimateGpuFootprint(c, dense, bf16, 300);
    CHECK(f.weight_bytes == dense.bytes());
    CHECK(f.cache_bytes == m3::KvCache(m3::CacheShapeOf(c), bf16).BytesFor(300));
    CHECK(m3::CheckGpuFits(f, "GPU 0", f.total()).ok());
    const m3::Status tight = m3::CheckGpuFits(f, "GPU 0", f.total() - 1);
    CHECK(tight.code() == m3::StatusCode::kOutOfMemory);
    CHECK_THAT(tight.message(), Catch::StartsWith("the dense part needs "));
    CHECK_THAT(tight.message(), Catch::Contains(" for 300 tokens (bf16 K/V, f32 index keys); GPU 0 has "));
    CHECK_THAT(tight.message(), Catch::EndsWith("use a shorter context or smaller cache types (--kv-cache, --index-cache)"));
    CHECK_THAT(m3::CheckGpuFits(f, "GPU 0", f.weight_bytes - 1).message(),
               Catch::EndsWith("the weights alone do not fit; run without the GPU"));
    // The longest context: its caches fit, one more token's do not (or it is the model's maximum).
    const size_t longest = m3::LongestGpuContext(c, dense, bf16, f.total());
    CHECK(longest >= 300);
    CHECK(m3::EstimateGpuFootprint(c, dense, bf16, longest).total() <= f.total());
    if (longest < static_cast<size_t>(c.max_position_embeddings))
      CHECK(m3::EstimateGpuFootprint(c, dense, bf16, longest + 1).total() > f.total());
    CHECK(m3::LongestGpuContext(c, dense, bf16, dense.bytes() - 1) == 0);
  }
}

TEST_CASE("damaged npy files are refused, never thrown or overrun", "[checkpoint][npy]") {
  m3::test::TempDir tmp;
  const std::string path = (tmp.path() / "a.npy").string();
  // Header: magic, version 1.0, 2-byte length, the dict padded; then `payload` bytes.
  auto npy = [&](const std::string& dict, size_t payload) {
    std::string h = dict;
    while ((10 + h.size() + 1) % 64) h += ' ';
    h += '\n';
    std::string bytes("\x93NUMPY\x01\x00", 8);
    bytes += static_cast<char>(h.size() & 0xFF);
    bytes += static_cast<char>(h.size() >> 8);
    m3::test::WriteBytes(path, bytes + h + std::string(payload, '\0'));
    return m3::ReadNpy(path);
  };
  auto ok = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 24);
  REQUIRE(ok.ok());
  CHECK(ok->shape == std::vector<int64_t>{2, 3});
  for (const auto& [dict, payload] : std::vector<std::pair<std::string, size_t>>{
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (f8, 3), }", 24},   // not a number (fuzz_npy)
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }", 24},   // negative
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, }", 24},     // no ')'
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 24},  // overflows
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }", 24}}) {  // more than the file holds
    INFO(dict);
    const auto bad = npy(dict, payload);
    CHECK(bad.status().code() == m3::StatusCode::kCorrupt);
  }
}
