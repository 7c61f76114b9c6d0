// MiniMax-M3 weights bound to checkpoint or packed-file tensors (docs/MODEL.md §5). Matrices are views
// into the mapped files in their stored format; only the small norm vectors and the router bias
// are decoded to fp32 at load (norms are prepared as the (1 + w) multiplier, formed in fp32, G8).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "format/pack_file.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "platform/parallel.h"
#include "ops/mlp.h"
#include "ops/moe.h"
#include "simd/weight_format.h"

namespace m3 {

struct AttentionWeights {
  simd::WeightRef q, k, v, o;          // q [Hq*D, H], k/v [Hkv*D, H], o [H, Hq*D]
  std::vector<float> q_norm, k_norm;   // [D] multipliers
  bool sparse = false;
  simd::WeightRef index_q, index_k;    // [H_idx*D_idx, H], [D_idx, H] (one shared key head)
  std::vector<float> index_q_norm, index_k_norm;  // [D_idx]
};

struct LayerWeights {
  std::vector<float> input_norm, post_norm;  // [H]
  AttentionWeights attn;
  bool is_moe = false;
  MlpWeights mlp;  // dense layers
  MoeWeights moe;  // MoE layers
};

// One multi-token-prediction depth (bound when its tensors are present; docs/MODEL.md §5).
struct MtpWeights {
  std::vector<float> enorm, hnorm, final_norm;  // [H]
  simd::WeightRef eh_proj;                      // [H, 2H]
  LayerWeights layer;                           // sparse attention + MoE
};

struct ModelWeights {
  simd::WeightRef embed;    // [V, H]
  simd::WeightRef lm_head;  // [V, H] (the embedding when tied)
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
  std::vector<MtpWeights> mtp;
};

// One expected tensor: its name, shape and where it binds.
struct TensorSlot {
  std::string name;
  std::vector<int64_t> shape;
  simd::WeightRef* matrix = nullptr;  // 2-D weights used in place
  std::vector<float>* vector = nullptr;  // 1-D tensors decoded to fp32
  bool is_norm = false;               // vector is an RMSNorm weight
  bool is_routed_expert = false;
};

// Visits every tensor the config implies (MTP depths only up to `mtp_depths`), in a fixed order.
void ForEachTensor(const ModelConfig& cfg, int mtp_depths, ModelWeights* w,
                   const std::function<void(TensorSlot&)>& fn);

struct WeightStats {
  int64_t total_params = 0;
  int64_t routed_expert_params = 0;
  int64_t embedding_params = 0;
  int64_t active_params = 0;  // read per token: all but unrouted experts and unused embedding rows
  int mtp_depths = 0;
};

// Binds every tensor, checking presence, dtype, shape (and MXFP8 scale companions) against the
// config before any compute. Tensors the config does not explain are an error.
StatusOr<WeightStats> BindWeights(const ModelConfig& cfg, const Checkpoint& ck, ModelWeights* w);

// The same for a packed file (`m3 pack`): every expected tensor present with the config's shape
// (1-D tensors stored as [1, n] f32), nothing unexplained, the same stats. Matrices are used in
// place from the mapping; only the f32 vectors are copied.
StatusOr<WeightStats> BindPackedWeights(const ModelConfig& cfg, const PackFile& pack, ModelWeights* w);

// The weight format a checkpoint dtype is read as (F32, BF16, F16, F8_E4M3 -> MXFP8).
StatusOr<simd::WeightFormat> CheckpointWeightFormat(DType d);

// `m3 inspect --verify` for a checkpoint (which carries no hashes): every value of every text
// tensor is finite (F32/BF16/F16 not NaN or inf, F8_E4M3 not its NaN code, `_scale_inv` E8M0
// scales not 255); else a kCorrupt error naming the first such tensor and element. Reads each
// byte once and releases the pages behind it.
Status VerifyFiniteValues(const Checkpoint& ck, const ThreadConfig& tc);

}  // namespace m3
