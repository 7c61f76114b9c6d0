// A NaN or inf in any weight (a damaged file, a bad conversion) is a clear error that names the
// layer, the block and the position where it shows, for checkpoints and packed models alike:
// never logits computed from it. Each case damages one tensor of a copy of a golden model.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "format/pack_file.h"
#include "format/safetensors.h"
#include "model/packer.h"
#include "model/weights.h"
#include "offload/gpu.h"
#include "runtime/engine.h"
#include "test_util.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A writable copy of a golden folder (the shared files are read-only).
void CopyFolder(const std::string& from, const fs::path& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from))
    test::WriteBytes(to / e.path().filename(), test::ReadBytes(e.path()));
}

// Writes `bytes` at byte `offset` of a file.
void Patch(const fs::path& file, size_t offset, const void* bytes, size_t n) {
  std::string b = test::ReadBytes(file);
  REQUIRE(offset + n <= b.size());
  std::memcpy(b.data() + offset, bytes, n);
  test::WriteBytes(file, b);
}

// A fresh copy of golden checkpoint `golden` in `dir` with `bytes` (one element's worth) written
// over element `element` of each named tensor; returns the file of the last one.
std::string DamagedCopy(const std::string& golden, const fs::path& dir, const std::vector<std::string>& tensors,
                        size_t element, const void* bytes, size_t n) {
  fs::remove_all(dir);
  CopyFolder(golden, dir);
  std::vector<std::pair<std::string, size_t>> patches;  // file, byte offset
  {
    auto ck = Checkpoint::Open(dir.string());
    REQUIRE(ck.ok());
    for (const std::string& name : tensors) {
      const TensorInfo* t = (*ck)->Find(name);
      INFO(name);
      REQUIRE(t != nullptr);
      REQUIRE(element < static_cast<size_t>(t->numel()));
      REQUIRE(n == t->nbytes / static_cast<size_t>(t->numel()));
      patches.emplace_back(t->file->path(), static_cast<size_t>(t->data - t->file->data()) + n * element);
    }
  }
  for (const auto& [file, offset] : patches) Patch(file, offset, bytes, n);
  return patches.back().first;
}

// Runs the prompt (chunks of 7, so that later chunks see a damaged cache too) and expects the
// error to name `where` (and the position, when >= 0); the session is left at position 0.
// The same report on the CPU and, with f32 caches, with the dense part offloaded (--gpu dense on
// the host reference device, and on the GPU where there is one).
void ExpectReported(const std::string& dir, const std::vector<int32_t>& prompt, const std::string& where,
                    int64_t position, CacheType kv = CacheType::kF32) {
  std::vector<EngineOptions> runs = {EngineOptions{2}};
  if (kv == CacheType::kF32)
    for (const char* device : {"host", "cuda"}) {
      if (std::string(device) == "cuda" && !QueryGpu(0).ok()) continue;
      EngineOptions o{2};
      o.gpu = "dense";
      o.gpu_device = device;
      runs.push_back(o);
    }
  for (EngineOptions& options : runs) {
    INFO("--gpu " << (options.gpu.empty() ? "none" : "dense on " + options.gpu_device));
    // The damage is what the passes must report: the background hash check would name the
    // tensor first (which test_pack checks), at a moment that depends on the machine.
    options.verify_weights = false;
    auto engine = Engine::Open(dir, options);
    INFO(engine.status().ToString());
    REQUIRE(engine.ok());
    SessionOptions o;
    o.prefill_chunk = 7;
    o.cache.kv = kv;
    Session s(**engine, o);
    std::vector<float> logits;
    const Status st = s.Eval(prompt, LogitsMode::kAllRows, &logits);
    INFO("message: " << st.message());
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == StatusCode::kCorrupt);
    CHECK_THAT(st.message(), Contains(where + " gave a non-finite value") && Contains("damaged"));
    if (position >= 0) CHECK_THAT(st.message(), Contains("at position " + std::to_string(position) + ":"));
    CHECK(s.position() == 0);
  }
}

std::vector<int32_t> Prompt(const std::string& dir) {
  return test::ReadPythonJson(dir + "/case.json")["prompt_ids"].get<std::vector<int32_t>>();
}

TEST_CASE("a NaN or inf weight in a checkpoint is reported with its layer, block and position", "[errors]") {
  // s1: fp32 values, layer 0 dense attention + MLP, layers 1-2 sparse attention + MoE.
  const std::string golden = test::GoldenDir("s1_fp32_basic");
  const auto prompt = Prompt(golden);
  struct Damage {
    std::vector<std::string> tensors;  // each gets the same damage
    size_t element;                    // flat index into the tensor
    float value;
    std::string where;
    int64_t position;  // -1: not checked
    CacheType kv = CacheType::kF32;
  };
  const std::string l0 = "model.layers.0.", l1 = "model.layers.1.", moe = l1 + "block_sparse_moe.";
  std::vector<Damage> cases = {
      {{"model.embed_tokens.weight"}, static_cast<size_t>(prompt[4]) * 64 + 5, kNaN, "the token embedding", -1},
      {{l0 + "input_layernorm.weight"}, 3, kNaN, "layer 0's attention", 0},
      {{l0 + "self_attn.q_proj.weight"}, 7 * 64 + 3, kInf, "layer 0's attention", 0},
      {{l0 + "self_attn.k_proj.weight"}, 9 * 64 + 1, kNaN, "layer 0's attention", 0},
      {{l0 + "self_attn.v_proj.weight"}, 2 * 64 + 60, -kInf, "layer 0's attention", 0},
      {{l0 + "self_attn.q_norm.weight"}, 4, kNaN, "layer 0's attention", 0},
      {{l0 + "self_attn.k_norm.weight"}, 4, kNaN, "layer 0's attention", 0},
      {{l0 + "self_attn.o_proj.weight"}, 5 * 128 + 100, kNaN, "layer 0's attention", 0},
      {{l0 + "post_attention_layernorm.weight"}, 0, kNaN, "layer 0's MLP", 0},
      {{l0 + "mlp.gate_proj.weight"}, 11 * 64 + 2, kNaN, "layer 0's MLP", 0},
      {{l0 + "mlp.up_proj.weight"}, 11 * 64 + 2, kInf, "layer 0's MLP", 0},
      {{l0 + "mlp.down_proj.weight"}, 3 * 96 + 50, kNaN, "layer 0's MLP", 0},
      {{l1 + "self_attn.index_q_proj.weight"}, 1 * 64 + 1, kNaN, "layer 1's indexer queries", 0},
      {{l1 + "self_attn.index_k_proj.weight"}, 1 * 64 + 1, kNaN, "layer 1's indexer keys", 0},
      {{l1 + "self_attn.index_k_norm.weight"}, 6, kInf, "layer 1's indexer keys", 0},
      {{moe + "gate.weight"}, 2 * 64 + 7, kNaN, "layer 1's MoE block", 0},
      {{moe + "e_score_correction_bias"}, 5, kNaN, "layer 1's MoE block", 0},
      {{moe + "shared_experts.gate_proj.weight"}, 0, kNaN, "layer 1's MoE block", 0},
      {{moe + "shared_experts.down_proj.weight"}, 64 * 32 - 1, -kInf, "layer 1's MoE block", 0},
      {{"model.norm.weight"}, 63, kNaN, "the final norm and lm_head", 0},
      {{"lm_head.weight"}, 100 * 64 + 9, kNaN, "the final norm and lm_head", 0},
      // An int8 K/V cache quantizes k's rows on the way in.
      {{l1 + "self_attn.k_proj.weight"}, 70, kNaN, "layer 1's attention", 0, CacheType::kInt8},
  };
  // Every routed expert's w1 / w2 / w3 at once (whichever the router picks).
  for (const char* m : {"w1", "w2", "w3"}) {
    Damage d{{}, 33, kNaN, "layer 1's MoE block", 0};
    for (int e = 0; e < 8; ++e) d.tensors.push_back(moe + "experts." + std::to_string(e) + "." + m + ".weight");
    cases.push_back(d);
  }
  test::TempDir tmp;
  for (const Damage& d : cases) {
    DYNAMIC_SECTION(d.tensors[0] << " = " << d.value << " kv " << CacheTypeName(d.kv)) {
      const fs::path dir = tmp.path() / "model";
      DamagedCopy(golden, dir, d.tensors, d.element, &d.value, 4);
      int64_t position = d.position;
      if (d.where == "the token embedding")  // the first position of the damaged token id
        position = std::find(prompt.begin(), prompt.end(), prompt[4]) - prompt.begin();
      ExpectReported(dir.string(), prompt, d.where, position, d.kv);
    }
  }
}

TEST_CASE("VerifyFiniteValues (m3 inspect --verify) finds a NaN or inf in a checkpoint of any dtype", "[errors]") {
  ThreadConfig tc{2};
  for (const char* name : test::kGoldenCases) {
    auto ck = Checkpoint::Open(test::GoldenDir(name));
    REQUIRE(ck.ok());
    INFO(name);
    CHECK(VerifyFiniteValues(**ck, tc).ok());
  }
  struct Damage {
    const char* golden;
    std::string tensor;
    size_t element;
    std::vector<uint8_t> bytes;  // written at the element
    std::string index;           // as the message prints it
  };
  const uint32_t nan32 = 0x7FC00000u, inf32 = 0xFF800000u;
  std::vector<uint8_t> f32_nan(4), f32_inf(4);
  std::memcpy(f32_nan.data(), &nan32, 4);
  std::memcpy(f32_inf.data(), &inf32, 4);
  const Damage cases[] = {
      {"s1_fp32_basic", "lm_head.weight", 100 * 64 + 9, f32_nan, "[100, 9]"},
      {"s1_fp32_basic", "model.norm.weight", 63, f32_inf, "[63]"},
      {"s2_bf16_sharded_init1", "model.layers.1.self_attn.o_proj.weight", 130, {0xC0, 0x7F}, ""},  // bf16 NaN
      {"s2_bf16_sharded_init1", "model.layers.0.self_attn.q_proj.weight", 0, {0x80, 0x7F}, "[0, 0]"},  // bf16 +inf
      {"s3_mxfp8_mixed_layers_local2", "model.layers.0.self_attn.q_proj.weight", 77, {0xFF}, ""},  // E4M3 NaN
      {"s3_mxfp8_mixed_layers_local2", "model.layers.0.self_attn.v_proj.weight_scale_inv", 1, {0xFF}, ""},
      {"s6_fp16_mha_top1_sharded3", "model.embed_tokens.weight", 5, {0x00, 0x7C}, ""},  // fp16 +inf
  };
  test::TempDir tmp;
  for (const Damage& d : cases) {
    DYNAMIC_SECTION(d.golden << " " << d.tensor) {
      const fs::path dir = tmp.path() / "model";
      const std::string file =
          DamagedCopy(test::GoldenDir(d.golden), dir, {d.tensor}, d.element, d.bytes.data(), d.bytes.size());
      auto ck = Checkpoint::Open(dir.string());
      REQUIRE(ck.ok());
      const Status st = VerifyFiniteValues(**ck, tc);
      INFO("message: " << st.message());
      REQUIRE_FALSE(st.ok());
      CHECK(st.code() == StatusCode::kCorrupt);
      CHECK_THAT(st.message(), Contains(file) && Contains("'" + d.tensor + "'") && Contains("damaged"));
      if (!d.index.empty()) CHECK_THAT(st.message(), Contains("at " + d.index + ":"));
    }
  }
}

TEST_CASE("a NaN or inf scale in a packed model is reported, not turned into finite logits", "[errors][pack]") {
  const std::string golden = test::GoldenDir("s1_fp32_basic");
  const auto prompt = Prompt(golden);
  const std::string l0 = "model.layers.0.", experts = "model.layers.1.block_sparse_moe.experts.";
  struct Damage {
    PackType type;
    std::string tensor;  // damaged in every routed expert of layer 1 when it starts with `experts`
    size_t row, group;   // q8: row scale of row; q4: fp16 scale of (row, group)
    float value;
    std::string where;
  };
  const Damage cases[] = {
      {PackType::kQ8, l0 + "self_attn.o_proj.weight", 5, 0, kNaN, "layer 0's attention"},
      {PackType::kQ8, l0 + "self_attn.q_proj.weight", 7, 0, kInf, "layer 0's attention"},
      {PackType::kQ8, l0 + "self_attn.k_proj.weight", 3, 0, kNaN, "layer 0's attention"},
      {PackType::kQ8, l0 + "mlp.gate_proj.weight", 1, 0, kNaN, "layer 0's MLP"},
      {PackType::kQ8, experts + "w1.weight", 2, 0, kNaN, "layer 1's MoE block"},
      {PackType::kQ8, experts + "w3.weight", 2, 0, kInf, "layer 1's MoE block"},
      {PackType::kQ8, "model.layers.1.self_attn.index_q_proj.weight", 0, 0, kNaN, "layer 1's indexer queries"},
      {PackType::kQ4Mixed, experts + "w2.weight", 6, 0, kNaN, "layer 1's MoE block"},
      {PackType::kQ4Mixed, experts + "w1.weight", 9, 1, kInf, "layer 1's MoE block"},
      {PackType::kQ4Mixed, "lm_head.weight", 17, 1, kNaN, "the final norm and lm_head"},
  };
  test::TempDir tmp;
  for (const Damage& d : cases) {
    DYNAMIC_SECTION(PackTypeName(d.type) << " " << d.tensor << " row " << d.row << " = " << d.value) {
      const fs::path dir = tmp.path() / "packed";
      PackOptions opt;
      opt.source_dir = golden;
      opt.output_dir = dir.string();
      opt.type = d.type;
      opt.force = true;
      opt.threads = 2;
      REQUIRE(PackModel(opt).ok());
      const fs::path file = dir / kPackFileName;
      std::vector<std::pair<size_t, std::vector<uint8_t>>> patches;  // offset, bytes
      {
        auto pf = PackFile::Open(file.string());
        REQUIRE(pf.ok());
        const bool all_experts = d.tensor.rfind(experts, 0) == 0;
        for (int e = 0; e < (all_experts ? 8 : 1); ++e) {
          const std::string name =
              all_experts ? experts + std::to_string(e) + d.tensor.substr(experts.size() - 1) : d.tensor;
          const PackedTensor* t = (*pf)->Find(name);
          INFO(name);
          REQUIRE(t != nullptr);
          const size_t tile = t->scales.offset + d.row / simd::kTileRows * t->Shape().tile_scale_bytes();
          const size_t tr = d.row % simd::kTileRows;
          if (t->format == simd::WeightFormat::kQ8) {
            std::vector<uint8_t> b(4);
            std::memcpy(b.data(), &d.value, 4);
            patches.emplace_back(tile + 4 * tr, b);
          } else {
            REQUIRE(t->format == simd::WeightFormat::kQ4);
            const uint16_t h = simd::F32ToF16(d.value);
            std::vector<uint8_t> b(2);
            std::memcpy(b.data(), &h, 2);
            patches.emplace_back(tile + 2 * (d.group * simd::kTileRows + tr), b);
          }
        }
      }
      for (const auto& [offset, bytes] : patches) Patch(file, offset, bytes.data(), bytes.size());
      ExpectReported(dir.string(), prompt, d.where, 0);
    }
  }
}

}  // namespace
}  // namespace m3
