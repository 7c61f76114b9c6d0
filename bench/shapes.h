// The real MiniMax-M3 text-model shapes (config.json of the released checkpoints; see
// docs/MODEL.md §1), for benchmarks and tests. Matrices are [rows, cols] with
// y = x . W^T: rows = outputs, cols = inputs.
#pragma once

#include <cstddef>

namespace m3::bench::shapes {

inline constexpr size_t kHidden = 6144;               // hidden_size
inline constexpr size_t kLayers = 60;                 // num_hidden_layers (MTP not included)
inline constexpr size_t kDenseLayers = 3;             // layers 0..2: dense attention + dense MLP
inline constexpr size_t kVocab = 200064;              // vocab_size (embedding and lm_head rows)

// Attention (all layers).
inline constexpr size_t kHeads = 64;                  // num_attention_heads
inline constexpr size_t kKvHeads = 4;                 // num_key_value_heads
inline constexpr size_t kHeadDim = 128;               // head_dim
inline constexpr size_t kRotaryDim = 64;              // rotary_dim (partial rotary 0.5)
inline constexpr size_t kQDim = kHeads * kHeadDim;    // 8192: q_proj rows, o_proj cols
inline constexpr size_t kKvDim = kKvHeads * kHeadDim; // 512: k_proj / v_proj rows

// MiniMax Sparse Attention (layers 3..59).
inline constexpr size_t kIndexHeads = 4;              // sparse_num_index_heads (one per KV group)
inline constexpr size_t kIndexDim = 128;              // sparse_index_dim
inline constexpr size_t kBlock = 128;                 // sparse_block_size (keys per block)
inline constexpr size_t kTopkBlocks = 16;             // sparse_topk_blocks (local block included)
inline constexpr size_t kInitBlocks = 0;              // sparse_init_block
inline constexpr size_t kLocalBlocks = 1;             // sparse_local_block

// MLP / MoE.
inline constexpr size_t kDenseIntermediate = 12288;   // dense_intermediate_size (layers 0..2)
inline constexpr size_t kExpertIntermediate = 3072;   // intermediate_size (routed expert width)
inline constexpr size_t kSharedIntermediate = 3072;   // shared_intermediate_size
inline constexpr size_t kExperts = 128;               // num_local_experts
inline constexpr size_t kExpertsPerToken = 4;         // num_experts_per_tok
inline constexpr size_t kSharedExperts = 1;           // n_shared_experts

// Matrix shapes the kernels see, as {rows, cols}.
struct MatShape {
  size_t rows;
  size_t cols;
};
inline constexpr MatShape kExpertGateUp{kExpertIntermediate, kHidden};  // 3072x6144, each of gate and up
inline constexpr MatShape kExpertDown{kHidden, kExpertIntermediate};    // 6144x3072
inline constexpr MatShape kDenseGateUp{kDenseIntermediate, kHidden};    // 12288x6144
inline constexpr MatShape kDenseDown{kHidden, kDenseIntermediate};      // 6144x12288
inline constexpr MatShape kQProj{kQDim, kHidden};                       // 8192x6144
inline constexpr MatShape kKvProj{kKvDim, kHidden};                     // 512x6144, each of k and v
inline constexpr MatShape kOProj{kHidden, kQDim};                       // 6144x8192
inline constexpr MatShape kIndexQProj{kIndexHeads * kIndexDim, kHidden};  // 512x6144
inline constexpr MatShape kIndexKProj{kIndexDim, kHidden};              // 128x6144 (one shared key head)
inline constexpr MatShape kLmHead{kVocab, kHidden};                     // 200064x6144

// Token counts of the kernel benchmarks: decode (one sequence, a few drafts) and a prefill chunk.
inline constexpr size_t kDecodeTokens[] = {1, 2, 4, 8};
inline constexpr size_t kPrefillTokens = 512;
// A prefill's tokens per routed expert on average (512 x top-4 / 128 experts): the size of the
// GEMM each chosen expert runs, its weights read from memory.
inline constexpr size_t kExpertPrefillTokens = kPrefillTokens * kExpertsPerToken / kExperts;

}  // namespace m3::bench::shapes
