// Packed model files (lib/format/pack_file.cc) and the packer (lib/model/packer.cc): every golden
// checkpoint packs as q8, q4 and q4-mixed into a file whose tensors are exactly what the
// quantizers produce for the source values; the layout keeps experts in page-aligned ranges;
// damaged files give clear errors; an interrupted pack leaves no model.m3w; loading maps the
// file without reading it.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/hash.h"
#include "base/status.h"
#include "format/pack_file.h"
#include "format/safetensors.h"
#include "simd/kernels.h"
#include "model/background_verify.h"
#include "model/model.h"
#include "model/packer.h"
#include "platform/mapped_file.h"
#include "batch_check.h"
#include "test_util.h"
#include "simd/quant_kernels.h"
#include "simd/weight_pack.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using m3::StatusCode;
using m3::test::RequireError;
using m3::simd::WeightFormat;
using Catch::Matchers::Contains;

using m3::test::kGoldenCases;
using m3::test::ReadBytes;
using m3::test::WriteBytes;

template <class T>
void RequireOk(const m3::StatusOr<T>& r) {
  INFO(r.status().message());
  REQUIRE(r.ok());
}

void RequireOk(const m3::Status& s) {
  INFO(s.message());
  REQUIRE(s.ok());
}


m3::StatusOr<m3::PackSummary> Pack(const std::string& src, const fs::path& out, m3::PackType type, bool force = false) {
  m3::PackOptions opt;
  opt.source_dir = src;
  opt.output_dir = out.string();
  opt.type = type;
  opt.force = force;
  opt.threads = 2;
  return m3::PackModel(opt);
}

uint64_t U64At(const std::string& b, size_t off) {
  uint64_t v;
  std::memcpy(&v, b.data() + off, 8);
  return v;
}

// Replaces the directory of a pack file with `dir_text`, after `pad` extra zero bytes of data
// section, and rewrites a valid header for it.
void RewriteDirectory(const fs::path& file, const std::string& dir_text, uint64_t pad = 0) {
  std::string b = ReadBytes(file);
  const uint64_t dir_offset = U64At(b, 24);
  b.resize(dir_offset);
  b.append(pad, '\0');
  m3::PackHeader h;
  h.directory_offset = b.size();
  h.directory_bytes = dir_text.size();
  h.directory_hash = m3::Hash64(dir_text.data(), dir_text.size());
  h.file_size = h.directory_offset + h.directory_bytes;
  b += dir_text;
  const std::vector<uint8_t> header = m3::EncodePackHeader(h);
  b.replace(0, header.size(), reinterpret_cast<const char*>(header.data()), header.size());
  WriteBytes(file, b);
}

json ReadDirectory(const fs::path& file) {
  const std::string b = ReadBytes(file);
  return json::parse(b.substr(U64At(b, 24), U64At(b, 32)));
}

void EditDirectory(const fs::path& file, const std::function<void(json&)>& edit, uint64_t pad = 0) {
  json d = ReadDirectory(file);
  edit(d);
  RewriteDirectory(file, d.dump(), pad);
}

json& TensorEntry(json& dir, const std::string& name) {
  for (auto& t : dir["tensors"])
    if (t["name"] == name) return t;
  FAIL("no tensor " << name);
  return dir;
}

// Raw stored values of a 1-D checkpoint tensor.
std::vector<float> SourceVector(const m3::TensorInfo& t) {
  auto fmt = m3::CheckpointWeightFormat(t.dtype);
  REQUIRE(fmt.ok());
  const m3::simd::WeightRef ref{*fmt, t.data, nullptr, 1, static_cast<size_t>(t.numel())};
  std::vector<float> v(ref.cols);
  m3::simd::DecodeRows(ref, 0, 1, v.data());
  return v;
}

// Checks one packed folder against its source, tensor by tensor.
void CheckPackedAgainstSource(const std::string& src_dir, const fs::path& out, m3::PackType type) {
  auto pf_or = m3::PackFile::Open((out / m3::kPackFileName).string());
  RequireOk(pf_or);
  const m3::PackFile& pf = *pf_or.value();
  CHECK(pf.pack_type() == m3::PackTypeName(type));
  RequireOk(pf.Verify(m3::ThreadConfig{2}));

  auto ck = m3::Checkpoint::Open(src_dir);
  RequireOk(ck);
  auto cfg = m3::ParseModelConfig(ck.value()->config_json());
  RequireOk(cfg);
  m3::ModelWeights src;
  auto stats = m3::BindWeights(cfg.value(), *ck.value(), &src);
  RequireOk(stats);

  size_t visited = 0;
  m3::ForEachTensor(cfg.value(), stats.value().mtp_depths, &src, [&](m3::TensorSlot& s) {
    INFO("tensor " << s.name);
    ++visited;
    const m3::PackedTensor* t = pf.Find(s.name);
    REQUIRE(t != nullptr);
    CHECK(t->data.offset % 64 == 0);
    CHECK(t->scales.offset % 64 == 0);
    const bool router = s.name.find("block_sparse_moe.gate.weight") != std::string::npos;
    WeightFormat want = WeightFormat::kF32;
    // Routed experts of q3-/q2-mixed: q3 / q2 in these models (fewer than 4 MoE layers).
    const WeightFormat expert_format = type == m3::PackType::kQ3Mixed   ? WeightFormat::kQ3
                                       : type == m3::PackType::kQ2Mixed ? WeightFormat::kQ2
                                                                        : WeightFormat::kQ4;
    if (!s.vector && !router)
      want = type == m3::PackType::kQ8 ? WeightFormat::kQ8
             : type == m3::PackType::kQ4 ? WeightFormat::kQ4
             : s.is_routed_expert ? expert_format : WeightFormat::kQ8;
    REQUIRE(t->format == want);
    if (s.vector) {  // raw values, before any (1 + w)
      CHECK(t->rows == 1);
      CHECK(pf.F32Values(*t) == SourceVector(*ck.value()->Find(s.name)));
      return;
    }
    const m3::simd::WeightRef& sm = *s.matrix;
    REQUIRE(t->rows == sm.rows);
    REQUIRE(t->cols == sm.cols);
    std::vector<float> decoded(sm.rows * sm.cols);
    m3::simd::DecodeRows(sm, 0, sm.rows, decoded.data());
    const m3::simd::WeightRef packed = pf.Weight(*t);
    if (want == WeightFormat::kF32) {
      CHECK(std::memcmp(packed.data, decoded.data(), decoded.size() * 4) == 0);
      return;
    }
    // Exactly the bytes the quantizer gives for the source values, and the same decoded values.
    const m3::simd::WeightRef shape = m3::simd::TiledShape(want, sm.rows, sm.cols);
    CHECK(t->group == shape.group);
    std::vector<uint8_t> codes(m3::simd::TiledCodeBytes(shape));
    std::vector<uint8_t> scales(m3::simd::TiledScaleBytes(shape));
    REQUIRE(m3::simd::PackRowTiles(shape, decoded.data(), 0, shape.row_tiles(), codes.data(), scales.data()));
    REQUIRE(t->data.bytes == codes.size());
    REQUIRE(t->scales.bytes == scales.size());
    CHECK(std::memcmp(packed.data, codes.data(), codes.size()) == 0);
    CHECK(std::memcmp(packed.scales, scales.data(), scales.size()) == 0);
    m3::simd::WeightRef expect = shape;
    expect.data = codes.data();
    expect.scales = scales.data();
    std::vector<float> a(sm.cols), b(sm.cols);
    bool same = true;
    for (size_t r = 0; r < sm.rows; ++r) {
      m3::simd::DecodeRows(packed, r, 1, a.data());
      m3::simd::DecodeRows(expect, r, 1, b.data());
      same = same && a == b;
    }
    CHECK(same);
    // Routed experts: inside their expert's page-aligned range.
    int layer, expert;
    REQUIRE(m3::RoutedExpertOf(cfg.value(), s.name, &layer, &expert) == s.is_routed_expert);
    if (s.is_routed_expert) {
      const m3::ByteRange* r = pf.ExpertRange(layer, expert);
      REQUIRE(r != nullptr);
      CHECK(t->data.offset >= r->offset);
      CHECK(t->scales.end() <= r->end());
    }
  });
  CHECK(visited == pf.tensors().size());

  // Each expert range: page aligned, exactly its three tensors back to back (64-byte gaps at most).
  const int moe_layers = static_cast<int>(std::count(cfg.value().moe_layer.begin(), cfg.value().moe_layer.end(), true));
  CHECK(pf.expert_ranges().size() ==
        static_cast<size_t>(cfg.value().num_experts * (moe_layers + stats.value().mtp_depths)));
  for (const auto& e : pf.expert_ranges()) {
    INFO("expert range layer " << e.layer << " expert " << e.expert);
    CHECK(e.range.offset % 4096 == 0);
    std::vector<m3::ByteRange> spans;
    for (const auto& t : pf.tensors()) {
      int l, x;
      if (!m3::RoutedExpertOf(cfg.value(), t.name, &l, &x) || l != e.layer || x != e.expert) continue;
      spans.push_back(t.data);
      spans.push_back(t.scales);
    }
    REQUIRE(spans.size() == 6);
    std::sort(spans.begin(), spans.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
    CHECK(spans.front().offset == e.range.offset);
    CHECK(spans.back().end() == e.range.end());
    for (size_t i = 1; i < spans.size(); ++i) CHECK(spans[i].offset - spans[i - 1].end() < 64);
  }

  // The folder loads like the source: same parameter counts, weights mapped in place.
  auto model = m3::Model::Load(out.string());
  RequireOk(model);
  const m3::Model& m = *model.value();
  REQUIRE(m.pack() != nullptr);
  CHECK(m.checkpoint() == nullptr);
  CHECK(m.stats().total_params == stats.value().total_params);
  CHECK(m.stats().routed_expert_params == stats.value().routed_expert_params);
  CHECK(m.stats().active_params == stats.value().active_params);
  CHECK(m.stats().mtp_depths == stats.value().mtp_depths);
  CHECK(m.weights().final_norm == src.final_norm);  // (1 + w) prepared the same way
  const auto* base = m.pack()->file().data();
  const auto* end = base + m.pack()->file().size();
  CHECK(static_cast<const uint8_t*>(m.weights().embed.data) >= base);
  CHECK(static_cast<const uint8_t*>(m.weights().embed.data) < end);
  // Every routed expert's memory range (what the MoE prefetches) holds all of its weights.
  for (const auto& L : m.weights().layers) {
    if (!L.is_moe) continue;
    REQUIRE(L.moe.expert_memory.size() == L.moe.experts.size());
    for (size_t e = 0; e < L.moe.experts.size(); ++e) {
      REQUIRE(L.moe.expert_memory[e].size() == 1);
      const auto* lo = static_cast<const uint8_t*>(L.moe.expert_memory[e][0].data);
      const auto* hi = lo + L.moe.expert_memory[e][0].bytes;
      CHECK(reinterpret_cast<uintptr_t>(lo) % 4096 == 0);
      for (const m3::simd::WeightRef* wr : {&L.moe.experts[e].gate, &L.moe.experts[e].up, &L.moe.experts[e].down}) {
        const auto* d = static_cast<const uint8_t*>(wr->data);
        CHECK((d >= lo && d + m3::simd::TiledCodeBytes(*wr) <= hi));
        if (wr->scales) CHECK((wr->scales >= lo && wr->scales + m3::simd::TiledScaleBytes(*wr) <= hi));
      }
    }
  }
}

// Source folder copy with one tensor value replaced (for failure injection).
fs::path CopyGoldenWithValue(const std::string& name, const m3::test::TempDir& tmp, const std::string& tensor,
                             size_t element, float value) {
  const fs::path dst = tmp.path() / ("src_" + name);
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(m3::test::GoldenDir(name)))
    fs::copy_file(e.path(), dst / e.path().filename());
  const fs::path file = dst / "model.safetensors";
  std::string b = ReadBytes(file);
  const uint64_t n = U64At(b, 0);
  const json h = json::parse(b.substr(8, n));
  REQUIRE(h.contains(tensor));
  REQUIRE(h[tensor]["dtype"] == "F32");
  const uint64_t off = 8 + n + h[tensor]["data_offsets"][0].get<uint64_t>() + element * 4;
  std::memcpy(b.data() + off, &value, 4);
  fs::permissions(file, fs::perms::owner_write, fs::perm_options::add);
  WriteBytes(file, b);
  return dst;
}

// s1 with tied embeddings (no lm_head) and one MTP depth (layer 2's tensors reused for its
// transformer layer, a random eh_proj): paths no golden case covers.
fs::path MakeTiedMtpCheckpoint(const m3::test::TempDir& tmp) {
  const fs::path golden(m3::test::GoldenDir("s1_fp32_basic"));
  const std::string b = ReadBytes(golden / "model.safetensors");
  const uint64_t n = U64At(b, 0);
  const json h = json::parse(b.substr(8, n));
  json out_h = json::object();
  std::string data;
  auto add = [&](const std::string& name, const json& shape, const std::string& bytes) {
    out_h[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data += bytes;
  };
  auto bytes_of = [&](const json& e) {
    const uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
    return b.substr(8 + n + begin, end - begin);
  };
  const std::string layer2 = "model.layers.2.", mtp = "model.mtp.layers.0.";
  for (const auto& [name, e] : h.items()) {
    if (name == "__metadata__" || name == "lm_head.weight") continue;
    add(name, e["shape"], bytes_of(e));
    if (name.rfind(layer2, 0) == 0)
      add(mtp + "transformer_layer." + name.substr(layer2.size()), e["shape"], bytes_of(e));
  }
  for (const char* norm : {"enorm.weight", "hnorm.weight", "final_layernorm.weight"})
    add(mtp + norm, h["model.norm.weight"]["shape"], bytes_of(h["model.norm.weight"]));
  const std::vector<float> eh = m3::test::RandomVec(64 * 128, 7, 0.1f);
  add(mtp + "eh_proj.weight", {64, 128}, std::string(reinterpret_cast<const char*>(eh.data()), eh.size() * 4));
  std::string header = out_h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string len(8, '\0');
  const uint64_t hl = header.size();
  std::memcpy(len.data(), &hl, 8);
  const fs::path dir = tmp.path() / "tied_mtp";
  fs::create_directories(dir);
  WriteBytes(dir / "model.safetensors", len + header + data);
  json cfg = json::parse(ReadBytes(golden / "config.json"));
  cfg["tie_word_embeddings"] = true;
  WriteBytes(dir / "config.json", cfg.dump(2));
  return dir;
}

size_t ResidentBytes() {
  std::ifstream in("/proc/self/statm");
  size_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

}  // namespace

TEST_CASE("Hash64 is XXH64, incremental in any split", "[pack]") {
  CHECK(m3::Hash64("", 0) == 0xEF46DB3751D8E999ull);
  CHECK(m3::Hash64("abc", 3) == 0x44BC2CF5AD770999ull);
  std::vector<uint8_t> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t n : {0, 1, 31, 32, 33, 100, 1000}) {
    const uint64_t whole = m3::Hash64(data.data(), n, 42);
    for (size_t split : {size_t{1}, size_t{7}, size_t{32}, size_t{45}}) {
      m3::Hasher64 h(42);
      for (size_t i = 0; i < n; i += split) h.Update(data.data() + i, std::min(split, n - i));
      CHECK(h.Digest() == whole);
    }
  }
  CHECK(m3::Hash64(data.data(), 64, 0) != m3::Hash64(data.data(), 64, 1));
}

TEST_CASE("every golden checkpoint packs as q8, q4, q4-mixed, q3-mixed and q2-mixed, exactly", "[pack]") {
  for (const char* name : kGoldenCases) {
    for (m3::PackType type : {m3::PackType::kQ8, m3::PackType::kQ4, m3::PackType::kQ4Mixed, m3::PackType::kQ3Mixed,
                              m3::PackType::kQ2Mixed}) {
      DYNAMIC_SECTION(name << " " << m3::PackTypeName(type)) {
        m3::test::TempDir tmp;
        const fs::path out = tmp.path() / "packed";
        auto summary = Pack(m3::test::GoldenDir(name), out, type);
        RequireOk(summary);
        CHECK(summary.value().tensors > 0);
        CHECK(summary.value().file_bytes == fs::file_size(out / m3::kPackFileName));
        CHECK(fs::exists(out / "config.json"));
        CHECK_FALSE(fs::exists(out / "model.m3w.partial"));
        CheckPackedAgainstSource(m3::test::GoldenDir(name), out, type);
        const double expert_bpw = summary.value().expert_bits_per_weight();
        if (type == m3::PackType::kQ8) CHECK(expert_bpw >= 8.0);
        // (q3 / q2 pad the tiny experts' 32-128 inputs to 256: their rate here says nothing; the
        // released model's footprints are checked in test_bench_limits.)
        if (type == m3::PackType::kQ4 || type == m3::PackType::kQ4Mixed) CHECK(expert_bpw < 5.0);
      }
    }
  }
}

// The int8 kernels take a batch's tokens as one GEMV/GEMM: each sequence's logits must be the ones
// it gets decoded alone (they are, bit for bit: integer dot products, per-token scales).
TEST_CASE("packed models decode a batch of sequences as each alone", "[pack][batch]") {
  for (const char* name : {"s2_bf16_sharded_init1", "s5_realprop_mxfp8_vl"}) {
    for (m3::PackType type : {m3::PackType::kQ8, m3::PackType::kQ4Mixed, m3::PackType::kQ2Mixed}) {
      for (const std::string& kernel : m3::Kernels::Names())
      DYNAMIC_SECTION(name << " " << m3::PackTypeName(type) << " " << kernel) {
        m3::test::TempDir tmp;
        const fs::path out = tmp.path() / "packed";
        RequireOk(Pack(m3::test::GoldenDir(name), out, type));
        m3::EngineOptions options{2};
        options.kernels = kernel;
        auto engine = m3::Engine::Open(out.string(), options);
        RequireOk(engine.status());
        const std::vector<std::vector<int32_t>> prompts = {{5, 17, 200, 3, 99, 250}, {7, 7, 7}, {30, 2, 64, 128, 1}};
        CHECK(m3::test::BatchedStepsDifferingFromAlone(**engine, prompts, 4) == 0);
      }
    }
  }
}

TEST_CASE("tied embeddings and MTP depths pack and load", "[pack]") {
  m3::test::TempDir tmp;
  const fs::path src = MakeTiedMtpCheckpoint(tmp);
  const fs::path out = tmp.path() / "packed";
  auto summary = Pack(src.string(), out, m3::PackType::kQ4Mixed);
  RequireOk(summary);
  CHECK(summary.value().mtp_depths == 1);
  CheckPackedAgainstSource(src.string(), out, m3::PackType::kQ4Mixed);
  auto pf = m3::PackFile::Open((out / m3::kPackFileName).string());
  RequireOk(pf);
  CHECK(pf.value()->Find("lm_head.weight") == nullptr);
  CHECK(pf.value()->Find("model.mtp.layers.0.eh_proj.weight")->format == WeightFormat::kQ8);
  // MTP depth d's experts are recorded as layer num_layers + d.
  const m3::ByteRange* r = pf.value()->ExpertRange(3, 7);
  REQUIRE(r != nullptr);
  const std::string gate = "model.mtp.layers.0.transformer_layer.block_sparse_moe.experts.7.w1.weight";
  CHECK(r->offset == pf.value()->Find(gate)->data.offset);
  auto model = m3::Model::Load(out.string());
  RequireOk(model);
  CHECK(model.value()->stats().mtp_depths == 1);
  CHECK(model.value()->weights().lm_head.data == model.value()->weights().embed.data);
  CHECK(model.value()->weights().mtp.size() == 1);
  CHECK(model.value()->weights().mtp[0].layer.moe.experts[7].down.format == WeightFormat::kQ4);
}

TEST_CASE("damaged packed files are refused with clear errors", "[pack]") {
  m3::test::TempDir tmp;
  const fs::path out = tmp.path() / "packed";
  RequireOk(Pack(m3::test::GoldenDir("s1_fp32_basic"), out, m3::PackType::kQ8));
  const fs::path file = out / m3::kPackFileName;
  const std::string path = file.string();
  const std::string bytes = ReadBytes(file);
  RequireOk(m3::PackFile::Open(path));
  const std::string kQProj = "model.layers.0.self_attn.q_proj.weight";

  SECTION("truncated") {
    WriteBytes(file, bytes.substr(0, bytes.size() / 2));
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "truncated"});
    RequireError(m3::Model::Load(out.string()), StatusCode::kCorrupt, {path, "truncated"});
    WriteBytes(file, bytes.substr(0, 100));
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "truncated"});
  }
  SECTION("bad magic") {
    std::string b = bytes;
    b[0] = 'X';
    WriteBytes(file, b);
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "bad magic"});
  }
  SECTION("no magic: an unfinished pack") {
    std::string b = bytes;
    std::memset(b.data(), 0, 4096);
    WriteBytes(file, b);
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "incomplete"});
  }
  SECTION("wrong version") {
    std::string b = bytes;
    b[8] = static_cast<char>(m3::kPackVersion + 1);
    WriteBytes(file, b);
    RequireError(m3::PackFile::Open(path), StatusCode::kUnsupported,
                 {path, "version " + std::to_string(m3::kPackVersion + 1), "re-run `m3 pack`"});
  }
  SECTION("an older version (q8 with fp16 group scales)") {
    std::string b = bytes;
    b[8] = 1;
    WriteBytes(file, b);
    RequireError(m3::PackFile::Open(path), StatusCode::kUnsupported, {path, "version 1", "re-run `m3 pack`"});
  }
  SECTION("header hash mismatch") {
    std::string b = bytes;
    b[30] ^= 1;  // directory offset, header hash not updated
    WriteBytes(file, b);
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "header hash mismatch"});
  }
  SECTION("a reserved header byte not zero") {
    std::string b = bytes;
    b[100] = 1;  // outside the hashed fields
    WriteBytes(file, b);
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "header byte 100 is not zero"});
  }
  SECTION("directory hash mismatch") {
    std::string b = bytes;
    b[U64At(b, 24) + 3] ^= 0x20;
    WriteBytes(file, b);
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "directory hash mismatch"});
  }
  SECTION("directory is not JSON") {
    RewriteDirectory(file, "{\"tensors\": [1, 2");
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "not valid JSON"});
  }
  SECTION("directory without tensors") {
    RewriteDirectory(file, "{\"experts\": []}");
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "'tensors'"});
  }
  SECTION("tensor past the end of the data") {
    const uint64_t dir_offset = U64At(bytes, 24);
    EditDirectory(file, [&](json& d) { TensorEntry(d, kQProj)["data_offset"] = dir_offset / 64 * 64; });
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "outside the tensor data section"});
  }
  SECTION("overlapping tensors") {
    EditDirectory(file, [&](json& d) {
      TensorEntry(d, kQProj)["data_offset"] = TensorEntry(d, "model.embed_tokens.weight")["data_offset"];
    });
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "overlap", kQProj});
  }
  SECTION("size not matching the shape") {
    EditDirectory(file, [&](json& d) { TensorEntry(d, kQProj)["rows"] = 112; });
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "needs"});
  }
  SECTION("unaligned tensor") {
    EditDirectory(file, [&](json& d) {
      auto& t = TensorEntry(d, kQProj);
      t["data_offset"] = t["data_offset"].get<uint64_t>() + 8;
    });
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "aligned"});
  }
  SECTION("unknown format") {
    EditDirectory(file, [&](json& d) { TensorEntry(d, kQProj)["format"] = "q5"; });
    RequireError(m3::PackFile::Open(path), StatusCode::kUnsupported, {path, kQProj, "'q5'"});
  }
  SECTION("bad hash field") {
    EditDirectory(file, [&](json& d) { TensorEntry(d, kQProj)["hash"] = 12; });
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, kQProj, "'hash'"});
  }
  SECTION("expert range not page aligned") {
    EditDirectory(file, [&](json& d) { d["experts"][0]["offset"] = d["experts"][0]["offset"].get<uint64_t>() + 64; });
    RequireError(m3::PackFile::Open(path), StatusCode::kCorrupt, {path, "expert range", "page"});
  }
  SECTION("missing tensor") {
    EditDirectory(file, [&](json& d) {
      auto& t = d["tensors"];
      for (size_t i = 0; i < t.size(); ++i)
        if (t[i]["name"] == kQProj) t.erase(i);
    });
    RequireOk(m3::PackFile::Open(path));
    RequireError(m3::Model::Load(out.string()), StatusCode::kNotFound, {path, kQProj, "missing"});
  }
  SECTION("extra tensor") {
    const uint64_t dir_offset = U64At(bytes, 24);
    EditDirectory(
        file,
        [&](json& d) {
          json t = TensorEntry(d, "model.norm.weight");
          t["name"] = "model.layers.0.surprise.weight";
          t["data_offset"] = (dir_offset + 63) / 64 * 64;
          d["tensors"].push_back(t);
        },
        /*pad=*/4096);
    RequireOk(m3::PackFile::Open(path));
    RequireError(m3::Model::Load(out.string()), StatusCode::kInvalidArgument,
                 {path, "model.layers.0.surprise.weight", "not part of the model"});
  }
  SECTION("shape not matching config.json") {
    json cfg = json::parse(ReadBytes(out / "config.json"));
    cfg["vocab_size"] = 256;
    WriteBytes(out / "config.json", cfg.dump());
    RequireError(m3::Model::Load(out.string()), StatusCode::kInvalidArgument,
                 {path, "model.embed_tokens.weight", "[512, 64]", "[256, 64]"});
  }
  SECTION("flipped data byte: opens, Verify names the tensor") {
    auto pf = m3::PackFile::Open(path);
    RequireOk(pf);
    const uint64_t off = pf.value()->Find(kQProj)->data.offset + 77;
    std::string b = bytes;
    b[off] ^= 0x10;
    WriteBytes(file, b);
    auto damaged = m3::PackFile::Open(path);
    RequireOk(damaged);
    const m3::Status st = damaged.value()->Verify(m3::ThreadConfig{2});
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == StatusCode::kCorrupt);
    CHECK_THAT(st.message(), Contains(path) && Contains(kQProj) && Contains("damaged"));
  }
}

TEST_CASE("pack refuses to overwrite without force, and failures leave no model.m3w", "[pack]") {
  m3::test::TempDir tmp;
  const fs::path out = tmp.path() / "packed";
  const std::string s1 = m3::test::GoldenDir("s1_fp32_basic");
  RequireOk(Pack(s1, out, m3::PackType::kQ8));
  const std::string first = ReadBytes(out / m3::kPackFileName);

  SECTION("existing model.m3w without force") {
    RequireError(Pack(s1, out, m3::PackType::kQ4), StatusCode::kInvalidArgument, {out.string(), "--force"});
    CHECK(ReadBytes(out / m3::kPackFileName) == first);
    RequireOk(Pack(s1, out, m3::PackType::kQ4, /*force=*/true));
    auto pf = m3::PackFile::Open((out / m3::kPackFileName).string());
    RequireOk(pf);
    CHECK(pf.value()->pack_type() == "q4");
  }
  SECTION("packing a packed folder") {
    RequireError(Pack(out.string(), tmp.path() / "again", m3::PackType::kQ8), StatusCode::kInvalidArgument,
                 {"already a packed folder"});
  }
  SECTION("output folder equal to the source") {
    RequireError(Pack(s1, fs::path(s1), m3::PackType::kQ8, true), StatusCode::kInvalidArgument, {"differ"});
  }
  SECTION("non-finite weight midway: error names the tensor, nothing left behind") {
    const std::string bad_tensor = "model.layers.2.block_sparse_moe.experts.5.w2.weight";
    const fs::path src = CopyGoldenWithValue("s1_fp32_basic", tmp, bad_tensor, 70,
                                             std::numeric_limits<float>::quiet_NaN());
    const fs::path fresh = tmp.path() / "fresh";
    int progress_calls = 0;
    m3::PackOptions opt;
    opt.source_dir = src.string();
    opt.output_dir = fresh.string();
    opt.type = m3::PackType::kQ4Mixed;
    opt.progress = [&](uint64_t, uint64_t) { ++progress_calls; };
    RequireError(m3::PackModel(opt), StatusCode::kInvalidArgument, {bad_tensor, "non-finite", "[2, 6]"});
    CHECK(progress_calls > 1);  // it failed midway, after writing other tensors
    CHECK_FALSE(fs::exists(fresh / m3::kPackFileName));
    CHECK_FALSE(fs::exists(fresh / "model.m3w.partial"));
    // With --force over a good pack, the old file stays as it was.
    const std::string config = ReadBytes(out / "config.json");
    RequireError(Pack(src.string(), out, m3::PackType::kQ8, true), StatusCode::kInvalidArgument, {bad_tensor});
    CHECK(ReadBytes(out / m3::kPackFileName) == first);
    CHECK(ReadBytes(out / "config.json") == config);
    CHECK_FALSE(fs::exists(out / "model.m3w.partial"));
    CHECK_FALSE(fs::exists(tmp.path() / ".packed.m3pack-partial"));
  }
  SECTION("a folder holding anything but a pack is never written into, even with --force") {
    const fs::path mine = tmp.path() / "mine";
    fs::create_directories(mine);
    WriteBytes(mine / "notes.txt", "keep me");
    for (bool force : {false, true})
      RequireError(Pack(s1, mine, m3::PackType::kQ8, force), StatusCode::kInvalidArgument, {"notes.txt", "new or empty"});
    CHECK(ReadBytes(mine / "notes.txt") == "keep me");
    CHECK(std::distance(fs::directory_iterator(mine), fs::directory_iterator()) == 1);
    // Another HuggingFace checkpoint: its config.json is not replaced.
    const fs::path checkpoint = tmp.path() / "checkpoint";
    fs::copy(s1, checkpoint);
    const std::string config = ReadBytes(checkpoint / "config.json");
    RequireError(Pack(s1, checkpoint, m3::PackType::kQ8, true), StatusCode::kInvalidArgument, {"not a file of a pack"});
    CHECK(ReadBytes(checkpoint / "config.json") == config);
    CHECK_FALSE(fs::exists(checkpoint / m3::kPackFileName));
  }
  SECTION("a --force pack replaces the folder in one step; what a killed pack left is removed") {
    const fs::path staging = tmp.path() / ".packed.m3pack-partial";
    fs::create_directories(staging);
    WriteBytes(staging / m3::kPackFileName, first.substr(0, 5000));  // a killed run's partial file
    RequireOk(Pack(s1, out, m3::PackType::kQ4, /*force=*/true));
    CHECK_FALSE(fs::exists(staging));
    CHECK_FALSE(fs::exists(tmp.path() / ".packed.m3pack-old"));
    CHECK(ReadBytes(out / "config.json") == ReadBytes(fs::path(s1) / "config.json"));
    auto pf = m3::PackFile::Open((out / m3::kPackFileName).string());
    RequireOk(pf);
    CHECK(pf.value()->pack_type() == "q4");
    // A trailing separator names the same folder.
    RequireOk(Pack(s1, fs::path(out.string() + "/"), m3::PackType::kQ8, /*force=*/true));
    CHECK(ReadBytes(out / m3::kPackFileName) == first);
  }
  SECTION("two packs of one folder at once: the second is refused while the first holds the lock") {
    const int fd = ::open((tmp.path() / ".packed.m3pack-lock").c_str(), O_RDWR | O_CREAT, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
    RequireError(Pack(s1, out, m3::PackType::kQ4, true), StatusCode::kUnavailable, {"another `m3 pack`"});
    ::close(fd);
    CHECK(ReadBytes(out / m3::kPackFileName) == first);
    RequireOk(Pack(s1, out, m3::PackType::kQ4, true));
  }
  SECTION("a folder left with only model.m3w.partial (pack killed) says so") {
    const fs::path killed = tmp.path() / "killed";
    fs::create_directories(killed);
    fs::copy_file(out / "config.json", killed / "config.json");
    WriteBytes(killed / "model.m3w.partial", first.substr(4096, 1000));
    RequireError(m3::Model::Load(killed.string()), StatusCode::kNotFound, {"did not finish"});
  }
}

// Pages of a mapping that are in memory (mincore).
size_t ResidentPages(const m3::MappedFile& f) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> v((f.size() + page - 1) / page);
  REQUIRE(::mincore(const_cast<uint8_t*>(f.data()), f.size(), v.data()) == 0);
  size_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return n;
}

TEST_CASE("AdviseWillNeed reads ahead a range that is not resident", "[pack]") {
  // The MoE advises each chosen expert's range; a resident one is skipped (mincore), one that is
  // not must still be read ahead.
  m3::test::TempDir tmp;
  const fs::path path = tmp.path() / "data.bin";
  std::string bytes(16 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 2654435761u >> 24);
  WriteBytes(path, bytes);
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // drop the clean pages from the page cache
    ::close(fd);
  }
  auto file = m3::MappedFile::Open(path.string());
  RequireOk(file);
  const m3::MappedFile& f = *file.value();
  if (ResidentPages(f) > 0) {
    WARN("this file system kept the dropped test file resident: nothing to check here");
    return;
  }
  m3::AdviseWillNeed(f.data(), f.size());
  size_t after = ResidentPages(f);
  for (int wait = 0; wait < 200 && after == 0; ++wait) {  // the readahead is asynchronous
    ::usleep(50000);
    after = ResidentPages(f);
  }
  INFO("resident pages after the advice: " << after);
  CHECK(after > 0);
}

TEST_CASE("q3-/q2-mixed keep the first and last of 4+ MoE layers' experts at q4", "[pack]") {
  json cfg = json::parse(ReadBytes(fs::path(m3::test::GoldenDir("s1_fp32_basic")) / "config.json"));
  const int layers = 7;  // layer 0 dense, MoE 1..6
  std::vector<int> moe(layers, 1), sparse(layers, 1);
  moe[0] = 0;
  cfg["num_hidden_layers"] = layers;
  cfg["moe_layer_freq"] = moe;
  if (cfg.contains("sparse_attention_config")) {
    cfg["sparse_attention_config"]["sparse_attention_freq"] = sparse;
    cfg["sparse_attention_config"]["sparse_disable_index_value"] = sparse;
  }
  auto parsed = m3::ParseModelConfig(cfg);
  RequireOk(parsed);
  for (m3::PackType type : {m3::PackType::kQ3Mixed, m3::PackType::kQ2Mixed}) {
    const WeightFormat low = type == m3::PackType::kQ3Mixed ? WeightFormat::kQ3 : WeightFormat::kQ2;
    const m3::PackLayout layout = m3::PlanPackLayout(parsed.value(), 0, type);
    std::map<int, std::set<WeightFormat>> by_layer;
    for (const auto& t : layout.tensors()) {
      int layer = -1, expert = -1;
      if (m3::RoutedExpertOf(parsed.value(), t.name, &layer, &expert)) by_layer[layer].insert(t.format);
      else if (t.rows > 1 && t.name.find("block_sparse_moe.gate.weight") == std::string::npos)
        CHECK(t.format == WeightFormat::kQ8);  // everything else as in q4-mixed
    }
    INFO(m3::PackTypeName(type));
    REQUIRE(by_layer.size() == 6);
    for (const auto& [layer, formats] : by_layer) {
      INFO("layer " << layer);
      CHECK(formats == std::set<WeightFormat>{layer == 1 || layer == 6 ? WeightFormat::kQ4 : low});
    }
  }
}

TEST_CASE("per-tensor overrides choose the format of the matrices they match, first match first", "[pack]") {
  json cfg = json::parse(ReadBytes(fs::path(m3::test::GoldenDir("s1_fp32_basic")) / "config.json"));
  auto parsed = m3::ParseModelConfig(cfg);
  RequireOk(parsed);
  std::vector<m3::FormatOverride> overrides;
  // "moe\\.experts", not "experts", which matches the shared experts too.
  for (const char* spec : {"experts\\.[0-9]+\\.w2\\.weight$=q8", "moe\\.experts=q3", "self_attn\\.q_proj=q2", "norm=q2"}) {
    auto o = m3::ParseFormatOverride(spec);
    RequireOk(o);
    overrides.push_back(o.value());
  }
  const m3::PackLayout layout = m3::PlanPackLayout(parsed.value(), 0, m3::PackType::kQ4Mixed, overrides);
  size_t down = 0, other_experts = 0, q_proj = 0;
  for (const auto& t : layout.tensors()) {
    INFO(t.name);
    int layer = -1, expert = -1;
    if (m3::RoutedExpertOf(parsed.value(), t.name, &layer, &expert)) {
      const bool is_down = t.name.find(".w2.weight") != std::string::npos;
      CHECK(t.format == (is_down ? WeightFormat::kQ8 : WeightFormat::kQ3));
      ++(is_down ? down : other_experts);
    } else if (t.name.find("self_attn.q_proj") != std::string::npos) {
      CHECK(t.format == WeightFormat::kQ2);
      ++q_proj;
    } else if (t.rows == 1 || t.name.find("block_sparse_moe.gate.weight") != std::string::npos) {
      CHECK(t.format == WeightFormat::kF32);  // vectors and the router stay f32 ("norm=q2" matches norms)
    } else {
      CHECK(t.format == WeightFormat::kQ8);  // q4-mixed's choice for the rest
    }
  }
  CHECK(down > 0);
  CHECK(other_experts == 2 * down);
  CHECK(q_proj == 3);
  // Bad specs are refused by what is wrong.
  for (auto [spec, says] : {std::pair<const char*, const char*>{"experts", "expected PATTERN=FORMAT"},
                            {"=q4", "expected PATTERN=FORMAT"},
                            {"experts=q5", "unknown format 'q5'"},
                            {"experts=", "unknown format ''"},
                            {"experts[=q4", "not a regular expression"}}) {
    auto o = m3::ParseFormatOverride(spec);
    INFO(spec);
    REQUIRE_FALSE(o.ok());
    CHECK_THAT(o.status().message(), Catch::Contains(says));
  }
  CHECK_FALSE(m3::ParseFormatOverride(std::string(1001, 'a') + "=q4").ok());
}

TEST_CASE("loading a large packed model maps it without reading it", "[pack]") {
  // A 400+ MB q8 model written directly through the writer: 2 MoE layers x 64 experts of
  // 3 x [1024, 1024]. The tensor data stays a hole in the file (zeros), so no disk is used.
  m3::test::TempDir tmp;
  const fs::path dir = tmp.path() / "big";
  fs::create_directories(dir);
  json cfg = json::parse(ReadBytes(fs::path(m3::test::GoldenDir("s1_fp32_basic")) / "config.json"));
  cfg["hidden_size"] = 1024;
  cfg["intermediate_size"] = 1024;
  cfg["shared_intermediate_size"] = 256;
  cfg["num_local_experts"] = 64;
  cfg["num_mtp_modules"] = 0;
  WriteBytes(dir / "config.json", cfg.dump(2));
  auto parsed = m3::ParseModelConfig(cfg);
  RequireOk(parsed);
  m3::PackLayout layout = m3::PlanPackLayout(parsed.value(), 0, m3::PackType::kQ8);
  REQUIRE(layout.data_end() >= (uint64_t{256} << 20));
  {
    auto w = m3::PackWriter::Create((dir / m3::kPackFileName).string());
    RequireOk(w);
    const std::vector<uint8_t> zeros(1 << 20, 0);
    for (auto& t : layout.mutable_tensors()) {
      m3::Hasher64 data;
      for (uint64_t done = 0; done < t.data.bytes; done += zeros.size())
        data.Update(zeros.data(), std::min<uint64_t>(zeros.size(), t.data.bytes - done));
      m3::Hasher64 scales;
      for (uint64_t done = 0; done < t.scales.bytes; done += zeros.size())
        scales.Update(zeros.data(), std::min<uint64_t>(zeros.size(), t.scales.bytes - done));
      t.hash = m3::PackedTensorHash(data.Digest(), scales.Digest());
    }
    RequireOk(w.value()->Finish(layout, json{{"pack_type", "q8"}}));
  }
  const size_t file_size = fs::file_size(dir / m3::kPackFileName);

  const size_t before = ResidentBytes();
  auto model = m3::Model::Load(dir.string());
  RequireOk(model);
  const size_t after = ResidentBytes();
  const m3::MappedFile& f = model.value()->pack()->file();
  const size_t mapped_resident = ResidentPages(f) * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  INFO("file " << file_size << " bytes, resident growth " << after - before << ", mapping resident "
               << mapped_resident);
  CHECK(after - before < file_size / 10);
  CHECK(mapped_resident < file_size / 10);
  CHECK(model.value()->weights().layers[1].moe.experts[63].down.format == WeightFormat::kQ8);
  RequireOk(model.value()->pack()->Verify(m3::ThreadConfig{2}));
}

TEST_CASE("a packed model's first load checks its tensor hashes in the background", "[pack][verify]") {
  m3::test::TempDir tmp;
  const fs::path out = tmp.path() / "packed";
  RequireOk(Pack(m3::test::GoldenDir("s1_fp32_basic"), out, m3::PackType::kQ8));
  const fs::path file = out / m3::kPackFileName;
  const std::string stamps = (tmp.path() / "stamps").string();
  const auto wait = [](const m3::BackgroundVerify& v) {
    for (int i = 0; i < 1200 && !v.done() && v.status().ok(); ++i) ::usleep(25000);
  };

  SECTION("a good file: every tensor checked, a stamp, nothing checked on the next load") {
    auto pf = m3::PackFile::Open(file.string());
    RequireOk(pf);
    const m3::PackFile& p = *pf.value();
    auto v = m3::BackgroundVerify::Start(p, stamps);
    REQUIRE(v);
    wait(*v);  // just written: every page is in memory
    REQUIRE(v->done());
    CHECK(v->checked() == p.tensors().size());
    CHECK(v->status().ok());
    CHECK(fs::exists(fs::path(stamps) / p.Identity()));
    CHECK_FALSE(m3::BackgroundVerify::Start(p, stamps));
    // Another file (its identity names size, inode and time) is checked again.
    v.reset();
    const std::string bytes = ReadBytes(file);
    fs::remove(file);
    WriteBytes(file, bytes);
    auto again = m3::PackFile::Open(file.string());
    RequireOk(again);
    CHECK(m3::BackgroundVerify::Start(*again.value(), stamps));
  }
  SECTION("a flipped byte fails the engine's passes by the tensor's name, and leaves no stamp") {
    auto pf = m3::PackFile::Open(file.string());
    RequireOk(pf);
    const std::string kQProj = "model.layers.0.self_attn.q_proj.weight";
    const uint64_t off = pf.value()->Find(kQProj)->data.offset + 5;
    pf.value().reset();
    std::string bytes = ReadBytes(file);
    bytes[off] ^= 0x01;
    WriteBytes(file, bytes);
    ::setenv("XDG_CACHE_HOME", (tmp.path() / "xdg").c_str(), 1);
    m3::EngineOptions options{2};
    auto engine = m3::Engine::Open(out.string(), options);
    RequireOk(engine);
    const m3::BackgroundVerify* v = engine.value()->weights_check();
    REQUIRE(v);
    wait(*v);
    const m3::Status st = v->status();
    CHECK(st.code() == StatusCode::kCorrupt);
    CHECK_THAT(st.message(), Contains(kQProj) && Contains("damaged"));
    m3::Session session(*engine.value());
    std::vector<float> logits;
    const std::vector<int32_t> ids = {1, 2, 3};
    const m3::Status eval = session.Eval(ids, m3::LogitsMode::kLastRow, &logits);
    CHECK(eval.code() == StatusCode::kCorrupt);
    CHECK_THAT(eval.message(), Contains(kQProj));
    const fs::path verified = tmp.path() / "xdg" / "m3" / "verified";
    const bool no_stamp = !fs::exists(verified) || fs::is_empty(verified);
    CHECK(no_stamp);
    // Off: no check runs.
    options.verify_weights = false;
    auto unchecked = m3::Engine::Open(out.string(), options);
    RequireOk(unchecked);
    CHECK(unchecked.value()->weights_check() == nullptr);
  }
  SECTION("pages not in memory are not read for it") {
    {
      const int fd = ::open(file.c_str(), O_RDONLY);
      REQUIRE(fd >= 0);
      ::fdatasync(fd);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
    auto pf = m3::PackFile::Open(file.string());
    RequireOk(pf);
    const m3::PackFile& p = *pf.value();
    size_t resident = 0;
    for (size_t i = 0; i < p.tensors().size(); ++i) resident += p.TensorResident(i);
    if (resident > 0) {
      WARN("this file system kept the dropped test file resident: nothing to check here");
      return;
    }
    auto v = m3::BackgroundVerify::Start(p, stamps);
    REQUIRE(v);
    ::usleep(600000);  // two sweeps
    CHECK(v->checked() == 0);
    CHECK_FALSE(v->done());
    size_t after = 0;
    for (size_t i = 0; i < p.tensors().size(); ++i) after += p.TensorResident(i);
    CHECK(after == 0);  // it read nothing
    // What the engine reads (here: all of it) is checked as it comes in.
    uint64_t sum = 0;
    for (size_t i = 0; i < p.file().size(); i += 4096) sum += p.file().data()[i];
    INFO(sum);
    wait(*v);
    CHECK(v->done());
  }
}
