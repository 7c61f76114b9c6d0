// config.json parsing (lib/model/config.cc): the golden configs, the real MiniMax-M3 values, the
// HF-normalized alternative names, and every refusal, each checked for its code and for a message
// that names the offending key.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "test_util.h"

namespace {

using nlohmann::json;
using m3::ModelConfig;
using m3::ParseModelConfig;
using m3::StatusCode;
using Catch::Matchers::Contains;

// A small valid flat config (the shape of s1): layer 0 dense/full attention, layers 1-2 MoE/sparse.
json TinyConfig() {
  return json::parse(R"({
    "hidden_size": 64, "intermediate_size": 32, "dense_intermediate_size": 96,
    "shared_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "rms_norm_eps": 1e-6,
    "use_gemma_norm": true, "attention_output_gate": false, "rope_theta": 5000000.0,
    "rotary_dim": 16, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai",
    "use_qk_norm": true, "qk_norm_type": "per_head", "num_local_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.0, "moe_layer_freq": [0, 1, 1],
    "sparse_attention_config": {
      "use_sparse_attention": true, "sparse_attention_freq": [0, 1, 1],
      "sparse_disable_index_value": [0, 1, 1], "sparse_num_index_heads": 2,
      "sparse_index_dim": 32, "sparse_block_size": 8, "sparse_topk_blocks": 3,
      "sparse_init_block": 0, "sparse_local_block": 1, "sparse_score_type": "max"
    }
  })");
}

// The same config in the VL layout.
json Nested(const json& text) { return json{{"model_type", "minimax_m3_vl"}, {"text_config", text}}; }

ModelConfig ParseOk(const json& j) {
  auto r = ParseModelConfig(j);
  INFO(r.status().message());
  REQUIRE(r.ok());
  return r.value();
}

// Parsing must fail with `code` and a message naming `fragment` (usually the key path).
void RequireError(const json& j, StatusCode code, const std::string& fragment) {
  auto r = ParseModelConfig(j);
  REQUIRE_FALSE(r.ok());
  INFO("message: " << r.status().message());
  CHECK(r.status().code() == code);
  CHECK_THAT(r.status().message(), Contains(fragment));
  CHECK_THAT(r.status().message(), Contains("config.json"));
}

std::vector<bool> Flags(std::initializer_list<int> v) {
  std::vector<bool> out;
  for (int x : v) out.push_back(x != 0);
  return out;
}

json GoldenConfig(const std::string& name) {
  auto j = m3::ReadJsonFile(m3::test::GoldenDir(name) + "/config.json");
  INFO(j.status().message());
  REQUIRE(j.ok());
  return j.value();
}

}  // namespace

TEST_CASE("golden configs parse with the right values", "[config]") {
  SECTION("s1 flat fp32") {
    ModelConfig c = ParseOk(GoldenConfig("s1_fp32_basic"));
    CHECK_FALSE(c.vl_layout);
    CHECK(c.hidden_size == 64);
    CHECK(c.num_layers == 3);
    CHECK(c.num_heads == 4);
    CHECK(c.num_kv_heads == 2);
    CHECK(c.head_dim == 32);
    CHECK(c.rotary_dim == 16);
    CHECK(c.vocab_size == 512);
    CHECK(c.moe_layer == Flags({0, 1, 1}));
    CHECK(c.sparse_layer == Flags({0, 1, 1}));
    CHECK(c.sparse.num_index_heads == 2);
    CHECK(c.sparse.index_dim == 32);
    CHECK(c.sparse.block_size == 8);
    CHECK(c.sparse.topk_blocks == 3);
    CHECK(c.num_experts == 8);
    CHECK(c.experts_per_token == 2);
    CHECK(c.shared_intermediate_size == 32);
    CHECK(c.dense_intermediate_size == 96);
    CHECK(c.num_mtp_modules == 1);
    CHECK(c.routed_scaling_factor == Approx(2.0f));
    CHECK(c.swiglu_alpha == Approx(1.702f));
    CHECK(c.swiglu_limit == Approx(7.0f));
    CHECK(c.rope_theta == Approx(5e6));
  }
  SECTION("s2 sharded, one init block") {
    ModelConfig c = ParseOk(GoldenConfig("s2_bf16_sharded_init1"));
    CHECK(c.hidden_size == 96);
    CHECK(c.num_layers == 4);
    CHECK(c.sparse_layer == Flags({0, 1, 1, 1}));
    CHECK(c.sparse.index_dim == 64);
    CHECK(c.sparse.init_blocks == 1);
    CHECK(c.num_experts == 16);
    CHECK(c.experts_per_token == 4);
  }
  SECTION("s3 mixed layers: MoE and sparse flags differ") {
    ModelConfig c = ParseOk(GoldenConfig("s3_mxfp8_mixed_layers_local2"));
    CHECK(c.hidden_size == 128);
    CHECK(c.num_layers == 3);
    CHECK(c.moe_layer == Flags({0, 1, 1}));
    CHECK(c.sparse_layer == Flags({1, 0, 1}));
    CHECK(c.sparse.num_index_heads == 2);
    CHECK(c.sparse.local_blocks == 2);
    CHECK(c.sparse.topk_blocks == 4);
    CHECK(c.rotary_dim == 16);
  }
  SECTION("s4 VL-nested, full rotary") {
    ModelConfig c = ParseOk(GoldenConfig("s4_vl_bf16_full_rotary_topk_gt_blocks"));
    CHECK(c.vl_layout);
    CHECK(c.hidden_size == 64);  // text_config's, not vision_config's 16
    CHECK(c.num_layers == 3);
    CHECK(c.vocab_size == 384);
    CHECK(c.rotary_dim == 32);
    CHECK(c.rotary_dim == c.head_dim);
    CHECK(c.sparse.topk_blocks == 6);
    CHECK(c.sparse.init_blocks == 1);
    CHECK(c.sparse.local_blocks == 2);
  }
  SECTION("s5 VL, real proportions") {
    ModelConfig c = ParseOk(GoldenConfig("s5_realprop_mxfp8_vl"));
    CHECK(c.vl_layout);
    CHECK(c.hidden_size == 128);
    CHECK(c.num_layers == 2);
    CHECK(c.num_heads == 64);
    CHECK(c.num_kv_heads == 4);
    CHECK(c.head_dim == 128);
    CHECK(c.rotary_dim == 64);
    CHECK(c.sparse.num_index_heads == 4);
    CHECK(c.sparse.index_dim == 128);
    CHECK(c.sparse.block_size == 128);
    CHECK(c.sparse.topk_blocks == 16);
    CHECK(c.q_heads_per_index_head() == 16);
  }
  SECTION("s6 MHA, top-1, all layers sparse") {
    ModelConfig c = ParseOk(GoldenConfig("s6_fp16_mha_top1_sharded3"));
    CHECK(c.num_heads == 4);
    CHECK(c.num_kv_heads == 4);
    CHECK(c.q_heads_per_kv() == 1);
    CHECK(c.head_dim == 16);
    CHECK(c.rotary_dim == 8);
    CHECK(c.experts_per_token == 1);
    CHECK(c.sparse_layer == Flags({1, 1}));
    CHECK(c.moe_layer == Flags({0, 1}));
  }
}

TEST_CASE("the real MiniMax-M3 text config (VL layout)", "[config]") {
  std::vector<int> freq(60, 1);
  freq[0] = freq[1] = freq[2] = 0;
  json text = {
      {"hidden_size", 6144}, {"num_hidden_layers", 60}, {"num_attention_heads", 64},
      {"num_key_value_heads", 4}, {"head_dim", 128}, {"vocab_size", 200064},
      {"max_position_embeddings", 196608}, {"rms_norm_eps", 1e-6}, {"rope_theta", 5000000.0},
      {"rotary_dim", 64}, {"partial_rotary_factor", 0.5}, {"hidden_act", "swigluoai"},
      {"intermediate_size", 3072}, {"dense_intermediate_size", 12288},
      {"shared_intermediate_size", 3072}, {"num_local_experts", 128}, {"num_experts_per_tok", 4},
      {"n_shared_experts", 1}, {"routed_scaling_factor", 2.0}, {"scoring_func", "sigmoid"},
      {"moe_layer_freq", freq}, {"num_mtp_modules", 1},
      {"sparse_attention_config",
       {{"use_sparse_attention", true}, {"sparse_attention_freq", freq},
        {"sparse_num_index_heads", 4}, {"sparse_index_dim", 128}, {"sparse_block_size", 128},
        {"sparse_topk_blocks", 16}, {"sparse_init_block", 0}, {"sparse_local_block", 1},
        {"sparse_score_type", "max"}, {"sparse_disable_index_value", freq}}}};
  ModelConfig c = ParseOk(Nested(text));
  CHECK(c.vl_layout);
  CHECK(c.hidden_size == 6144);
  CHECK(c.num_layers == 60);
  CHECK(c.num_heads == 64);
  CHECK(c.num_kv_heads == 4);
  CHECK(c.q_heads_per_kv() == 16);
  CHECK(c.head_dim == 128);
  CHECK(c.vocab_size == 200064);
  CHECK(c.max_position_embeddings == 196608);
  CHECK(c.rotary_dim == 64);
  CHECK(c.moe_intermediate_size == 3072);
  CHECK(c.dense_intermediate_size == 12288);
  CHECK(c.shared_intermediate_size == 3072);
  CHECK(c.num_experts == 128);
  CHECK(c.experts_per_token == 4);
  CHECK(c.num_shared_experts == 1);
  CHECK(c.routed_scaling_factor == Approx(2.0f));
  CHECK(c.sparse.num_index_heads == 4);
  CHECK(c.q_heads_per_index_head() == 16);
  CHECK(c.sparse.index_dim == 128);
  CHECK(c.sparse.block_size == 128);
  CHECK(c.sparse.topk_blocks == 16);
  CHECK(c.sparse.init_blocks == 0);
  CHECK(c.sparse.local_blocks == 1);
  REQUIRE(c.moe_layer.size() == 60);
  REQUIRE(c.sparse_layer.size() == 60);
  for (int l = 0; l < 60; ++l) {
    CHECK(c.moe_layer[l] == (l >= 3));
    CHECK(c.sparse_layer[l] == (l >= 3));
  }
  CHECK(c.any_sparse());
  CHECK(c.any_moe());
  CHECK(c.any_dense_mlp());
}

TEST_CASE("HF-normalized alternative key names", "[config]") {
  json j = TinyConfig();
  j.erase("sparse_attention_config");
  j.erase("moe_layer_freq");
  j.erase("num_local_experts");
  j.erase("rope_theta");
  j.erase("partial_rotary_factor");
  j.erase("rotary_dim");
  j["num_experts"] = 8;
  j["hidden_act"] = "silu";  // HF normalization renames swigluoai
  j["rope_parameters"] = {{"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}};
  j["num_nextn_predict_layers"] = 2;
  j["index_n_heads"] = 4;
  j["index_head_dim"] = 64;
  j["index_block_size"] = 16;
  j["index_topk_blocks"] = 5;
  j["index_init_blocks"] = 1;
  j["index_local_blocks"] = 2;
  j["layer_types"] = {"full_attention", "minimax_m3_sparse", "minimax_m3_sparse"};
  j["mlp_layer_types"] = {"dense", "sparse", "dense"};

  SECTION("flat") {
    ModelConfig c = ParseOk(j);
    CHECK(c.sparse_layer == Flags({0, 1, 1}));
    CHECK(c.moe_layer == Flags({0, 1, 0}));
    CHECK(c.sparse.num_index_heads == 4);
    CHECK(c.sparse.index_dim == 64);
    CHECK(c.sparse.block_size == 16);
    CHECK(c.sparse.topk_blocks == 5);
    CHECK(c.sparse.init_blocks == 1);
    CHECK(c.sparse.local_blocks == 2);
    CHECK(c.num_experts == 8);
    CHECK(c.rope_theta == Approx(10000.0));
    CHECK(c.rotary_dim == 16);  // 0.5 x head_dim 32, from rope_parameters
    CHECK(c.num_mtp_modules == 2);
  }
  SECTION("nested under text_config") {
    ModelConfig c = ParseOk(Nested(j));
    CHECK(c.vl_layout);
    CHECK(c.sparse_layer == Flags({0, 1, 1}));
    CHECK(c.moe_layer == Flags({0, 1, 0}));
    CHECK(c.sparse.num_index_heads == 4);
  }
  SECTION("index_* names inside sparse_attention_config") {
    json k = j;
    k["sparse_attention_config"] = {{"index_n_heads", 2}, {"index_head_dim", 32}};
    ModelConfig c = ParseOk(k);
    CHECK(c.sparse.num_index_heads == 2);  // the block wins over the top-level value
    CHECK(c.sparse.index_dim == 32);
    CHECK(c.sparse.block_size == 16);  // still from the top level
  }
  SECTION("unknown layer type name") {
    j["layer_types"][1] = "linear_attention";
    RequireError(j, StatusCode::kInvalidArgument, "'layer_types[1]'");
  }
  SECTION("unknown mlp layer type name") {
    j["mlp_layer_types"][2] = "moe";
    RequireError(j, StatusCode::kInvalidArgument, "'mlp_layer_types[2]'");
  }
  SECTION("layer_types of the wrong length") {
    j["layer_types"] = {"full_attention"};
    RequireError(j, StatusCode::kInvalidArgument, "'layer_types'");
  }
}

TEST_CASE("defaults for optional keys", "[config]") {
  json j = TinyConfig();
  for (const char* k : {"num_key_value_heads", "head_dim", "rms_norm_eps", "use_gemma_norm", "rotary_dim",
                        "partial_rotary_factor", "hidden_act", "use_qk_norm", "qk_norm_type", "n_shared_experts",
                        "routed_scaling_factor", "scoring_func", "attention_output_gate"})
    j.erase(k);
  j.erase("sparse_attention_config");  // no sparse flags at all: every layer dense attention
  ModelConfig c = ParseOk(j);
  CHECK(c.num_kv_heads == 4);  // = num_attention_heads
  CHECK(c.head_dim == 16);     // hidden 64 / 4 heads
  CHECK(c.rotary_dim == 16);   // whole head
  CHECK(c.gemma_norm);
  CHECK(c.qk_norm);
  CHECK(c.use_routing_bias);
  CHECK(c.num_shared_experts == 0);
  CHECK(c.shared_intermediate_size == 0);
  CHECK(c.routed_scaling_factor == Approx(1.0f));
  CHECK_FALSE(c.any_sparse());
  CHECK(c.num_mtp_modules == 0);
}

TEST_CASE("use_sparse_attention false turns every layer dense", "[config]") {
  json j = TinyConfig();
  j["sparse_attention_config"] = {{"use_sparse_attention", false}, {"sparse_attention_freq", {1, 1, 1}}};
  ModelConfig c = ParseOk(j);
  CHECK_FALSE(c.any_sparse());
}

TEST_CASE("invalid configs are refused with the key named", "[config]") {
  json j = TinyConfig();
  SECTION("missing hidden_size, flat") {
    j.erase("hidden_size");
    RequireError(j, StatusCode::kNotFound, "config.json: required key 'hidden_size' is missing");
  }
  SECTION("missing hidden_size, nested path") {
    j.erase("hidden_size");
    RequireError(Nested(j), StatusCode::kNotFound, "config.json: required key 'text_config.hidden_size' is missing");
  }
  SECTION("missing vocab_size") {
    j.erase("vocab_size");
    RequireError(j, StatusCode::kNotFound, "'vocab_size'");
  }
  SECTION("missing rope_theta") {
    j.erase("rope_theta");
    RequireError(j, StatusCode::kNotFound, "'rope_theta'");
  }
  SECTION("missing moe_layer_freq") {
    j.erase("moe_layer_freq");
    RequireError(j, StatusCode::kNotFound, "'moe_layer_freq'");
  }
  SECTION("missing index heads on a sparse config") {
    j["sparse_attention_config"].erase("sparse_num_index_heads");
    RequireError(j, StatusCode::kNotFound, "'sparse_attention_config.sparse_num_index_heads'");
  }
  SECTION("missing dense_intermediate_size with a dense layer") {
    j.erase("dense_intermediate_size");
    RequireError(j, StatusCode::kNotFound, "'dense_intermediate_size'");
  }
  SECTION("hidden_size as a string") {
    j["hidden_size"] = "64";
    RequireError(j, StatusCode::kInvalidArgument, "'hidden_size' must be an integer");
  }
  SECTION("hidden_size as a fraction") {
    j["hidden_size"] = 64.5;
    RequireError(j, StatusCode::kInvalidArgument, "'hidden_size'");
  }
  SECTION("hidden_size zero") {
    j["hidden_size"] = 0;
    RequireError(j, StatusCode::kInvalidArgument, "'hidden_size' must be >= 1");
  }
  SECTION("use_gemma_norm as a number") {
    j["use_gemma_norm"] = 1;
    RequireError(Nested(j), StatusCode::kInvalidArgument, "'text_config.use_gemma_norm' must be true or false");
  }
  SECTION("rms_norm_eps as a string") {
    j["rms_norm_eps"] = "1e-6";
    RequireError(j, StatusCode::kInvalidArgument, "'rms_norm_eps' must be a number");
  }
  SECTION("rms_norm_eps zero") {
    j["rms_norm_eps"] = 0.0;
    RequireError(j, StatusCode::kInvalidArgument, "'rms_norm_eps'");
  }
  SECTION("flag list of the wrong length") {
    j["moe_layer_freq"] = {0, 1};
    RequireError(j, StatusCode::kInvalidArgument, "'moe_layer_freq' has 2 entries but num_hidden_layers is 3");
  }
  SECTION("flag list not a list") {
    j["moe_layer_freq"] = 1;
    RequireError(j, StatusCode::kInvalidArgument, "'moe_layer_freq' must be a list");
  }
  SECTION("flag value 2") {
    j["sparse_attention_config"]["sparse_attention_freq"] = {0, 2, 1};
    RequireError(j, StatusCode::kInvalidArgument, "'sparse_attention_config.sparse_attention_freq[1]' must be 0 or 1");
  }
  SECTION("rotary_dim disagrees with partial_rotary_factor") {
    j["partial_rotary_factor"] = 0.25;  // 0.25 x 32 = 8, not 16
    RequireError(j, StatusCode::kInvalidArgument, "'rotary_dim' (16) disagrees with 'partial_rotary_factor'");
  }
  SECTION("rotary width odd") {
    j.erase("partial_rotary_factor");
    j["rotary_dim"] = 15;
    RequireError(j, StatusCode::kInvalidArgument, "rotary width 15");
  }
  SECTION("rotary width past the head") {
    j.erase("partial_rotary_factor");
    j["rotary_dim"] = 64;
    RequireError(j, StatusCode::kInvalidArgument, "rotary width 64");
  }
  SECTION("heads not a multiple of kv heads") {
    j["num_key_value_heads"] = 3;
    RequireError(j, StatusCode::kInvalidArgument, "'num_key_value_heads' (3)");
  }
  SECTION("heads not a multiple of index heads") {
    j["sparse_attention_config"]["sparse_num_index_heads"] = 3;
    RequireError(j, StatusCode::kInvalidArgument, "'sparse_attention_config.sparse_num_index_heads' (3)");
  }
  SECTION("head_dim missing and hidden_size not divisible by heads") {
    j.erase("head_dim");
    j["num_attention_heads"] = 6;
    j["num_key_value_heads"] = 2;
    RequireError(j, StatusCode::kNotFound, "'head_dim'");
  }
  SECTION("rotary width wider than the index head") {
    j["sparse_attention_config"]["sparse_index_dim"] = 8;
    RequireError(j, StatusCode::kInvalidArgument, "'sparse_attention_config.sparse_index_dim' (8)");
  }
  SECTION("top-k above the expert count") {
    j["num_experts_per_tok"] = 9;
    RequireError(j, StatusCode::kInvalidArgument, "'num_experts_per_tok' (9) exceeds the number of experts (8)");
  }
  SECTION("unsupported hidden_act") {
    j["hidden_act"] = "gelu";
    RequireError(j, StatusCode::kUnsupported, "'hidden_act' = \"gelu\"");
  }
  SECTION("unsupported scoring_func") {
    j["scoring_func"] = "softmax";
    RequireError(j, StatusCode::kUnsupported, "'scoring_func' = \"softmax\"");
  }
  SECTION("unsupported qk_norm_type") {
    j["qk_norm_type"] = "per_layer";
    RequireError(j, StatusCode::kUnsupported, "'qk_norm_type'");
  }
  SECTION("unsupported sparse_score_type") {
    j["sparse_attention_config"]["sparse_score_type"] = "mean";
    RequireError(j, StatusCode::kUnsupported, "'sparse_attention_config.sparse_score_type' = \"mean\"");
  }
  SECTION("attention_output_gate true") {
    j["attention_output_gate"] = true;
    RequireError(j, StatusCode::kUnsupported, "'attention_output_gate' = true");
  }
  SECTION("disable_index_value 0 on a sparse layer") {
    j["sparse_attention_config"]["sparse_disable_index_value"] = {0, 0, 1};
    RequireError(j, StatusCode::kUnsupported, "'sparse_attention_config.sparse_disable_index_value[1]' = 0");
  }
  SECTION("rope_scaling yarn (rope_type)") {
    j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
    RequireError(j, StatusCode::kUnsupported, "'rope_scaling' of type \"yarn\"");
  }
  SECTION("rope_scaling yarn (legacy type)") {
    j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
    RequireError(Nested(j), StatusCode::kUnsupported, "'text_config.rope_scaling' of type \"yarn\"");
  }
  SECTION("sparse_attention_config not an object") {
    j["sparse_attention_config"] = json::array();
    RequireError(j, StatusCode::kInvalidArgument, "'sparse_attention_config' must be an object");
  }
  SECTION("text_config not an object") {
    RequireError(json{{"text_config", 5}}, StatusCode::kInvalidArgument, "'text_config' must be an object");
  }
  SECTION("root not an object") {
    RequireError(json::array({1, 2}), StatusCode::kInvalidArgument, "not a JSON object");
    RequireError(json("config"), StatusCode::kInvalidArgument, "not a JSON object");
  }
}

TEST_CASE("rope_scaling of the default type is accepted", "[config]") {
  json j = TinyConfig();
  j["rope_scaling"] = {{"rope_type", "default"}};
  ParseOk(j);
  j["rope_scaling"] = nullptr;  // null counts as absent
  ParseOk(j);
}

namespace m3 {
namespace {

// Regressions: malformed values once escaped as exceptions or wrapped around an int.
TEST_CASE("malformed rope keys are errors, not exceptions", "[config]") {
  for (const json& rs : {json{{"rope_type", nullptr}}, json{{"rope_type", 1}}, json{{"type", nullptr}}, json(3)}) {
    json j = TinyConfig();
    j["rope_scaling"] = rs;
    auto c = ParseModelConfig(j);
    CHECK(!c.ok());
    CHECK_THAT(c.status().message(), Catch::Contains("rope_scaling"));
  }
  for (double prf : {1e10, -0.5, 0.0, 1.5}) {
    json j = TinyConfig();
    j.erase("rotary_dim");
    j["partial_rotary_factor"] = prf;
    RequireError(j, StatusCode::kInvalidArgument, "partial_rotary_factor");
  }
}

}  // namespace
}  // namespace m3
