// The MiniMax-M3 text-backbone configuration (docs/MODEL.md §1), read from config.json in either the flat
// layout or the VL layout (keys under "text_config"), with the HF-normalized alternative names.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "ops/attention.h"
#include "ops/kv_cache.h"

namespace m3 {

// Sparse-attention settings are the op's parameters (ops/attention.h): one definition.
using SparseAttentionConfig = SparseParams;

struct ModelConfig {
  int hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int64_t max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  bool gemma_norm = true;   // RMSNorm scales by (1 + w)
  bool qk_norm = true;      // per-head RMSNorm on q and k
  double rope_theta = 0;
  int rotary_dim = 0;       // leading channels of each head that rotate (NeoX pairing)
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  float swiglu_beta = 1.0f;
  bool tie_word_embeddings = false;

  int dense_intermediate_size = 0;   // dense-MLP width
  int moe_intermediate_size = 0;     // routed-expert width ("intermediate_size")
  int shared_intermediate_size = 0;  // total shared-expert width (x n_shared_experts)
  int num_experts = 0;
  int experts_per_token = 0;
  int num_shared_experts = 0;
  float routed_scaling_factor = 1.0f;
  bool use_routing_bias = true;

  std::vector<bool> moe_layer;     // per layer: MoE (true) or dense MLP
  std::vector<bool> sparse_layer;  // per layer: MiniMax sparse attention (true) or dense
  SparseAttentionConfig sparse;
  int num_mtp_modules = 0;

  bool vl_layout = false;  // keys were under text_config

  bool any_sparse() const;
  bool any_moe() const;
  bool any_dense_mlp() const;
  int q_heads_per_kv() const { return num_heads / num_kv_heads; }
  int q_heads_per_index_head() const { return num_heads / sparse.num_index_heads; }
};

// The shape of this model's caches (KvCache): sparse models page by the key block, which the
// indexer and the sparse attention then read as one page.
KvCacheShape CacheShapeOf(const ModelConfig& c);

// Parses and validates. Errors name the key (with its text_config. path when nested).
StatusOr<ModelConfig> ParseModelConfig(const nlohmann::json& root);

}  // namespace m3
