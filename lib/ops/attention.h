// Causal GQA attention over the paged caches, dense or restricted to selected key blocks, and the
// MiniMax sparse-attention block selection (lightning indexer, docs/MODEL.md §3.6).
//
// Cache rows are token positions; a page holds `page_rows` consecutive positions, and for sparse
// layers (page_rows == block size) one key block is one page. Both functions take a chunk of n
// queries at positions pos0..pos0+n-1 (a prompt chunk, or one decode token) and work in tiles of
// consecutive queries, so every key block is loaded once per tile for all the queries and heads
// that read it; memory stays O(tile x block), never O(n x context).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops/attention_cache.h"
#include "ops/context.h"
#include "platform/parallel.h"

namespace m3 {

// MiniMax sparse attention settings (config: sparse_attention_config).
struct SparseParams {
  int num_index_heads = 1;  // H_idx: one block selection per index head
  int index_dim = 0;        // D_idx
  int block_size = 1;       // B: keys per block
  int topk_blocks = 1;      // blocks attended per query (forced ones included)
  int init_blocks = 0;      // forced leading blocks
  int local_blocks = 1;     // forced trailing blocks (the query's own block first)
};

// Selected key blocks per (query token, index head), ascending, at most topk each.
struct BlockSelection {
  int num_index_heads = 0;
  int topk = 0;
  std::vector<int32_t> blocks;  // [n, H_idx, topk]
  std::vector<int32_t> counts;  // [n, H_idx]
  void Reset(size_t n, int heads, int k) {
    num_index_heads = heads, topk = k;
    blocks.assign(n * heads * k, -1);
    counts.assign(n * heads, 0);
  }
  const int32_t* Blocks(size_t t, int h) const { return &blocks[(t * num_index_heads + h) * topk]; }
  int Count(size_t t, int h) const { return counts[t * num_index_heads + h]; }
};

// Chooses blocks for one query at `pos` from per-block scores [pos / B + 1]: forced init blocks
// (b < init) and local blocks (the last `local` visible ones; local wins an overlap), then the
// best other blocks by score (NaN = -inf, ties -> lower id), min(topk, visible) in all. If the
// forced blocks alone exceed topk, order is (init, local) priority, then score, then id.
// Writes ascending ids to out; returns the count.
// `order` is scratch for the blocks' order (null: one of the call's own).
int SelectBlocksForQuery(const float* block_scores, int64_t pos, const SparseParams& p, int32_t* out,
                         std::vector<int32_t>* order = nullptr);

// Lightning-indexer selection for n queries at positions pos0..pos0+n-1. iq: [n, H_idx*D_idx]
// (after norm and RoPE); index_keys holds rows 0..pos0+n-1. Block scores come from
// simd::IndexScoreMax, one pass over each page of keys for a tile of queries; a decode token's
// scan is split over the threads by pages.
void SelectBlocks(const OpContext& tc, const SparseParams& p, const float* iq, const IndexKeyPages& index_keys,
                  int64_t pos0, size_t n, BlockSelection* out);

struct AttentionParams {
  int num_heads = 1;
  int num_kv_heads = 1;
  int head_dim = 1;
  int num_index_heads = 1;  // only with a selection
  int block_size = 1;       // only with a selection
};

// out[t, j*D..] = softmax(q_j . K^T / sqrt(D)) V over keys u <= pos0+t (and, with `sel`, only in the
// blocks selected for index head j / (H / H_idx)). q: [n, H*D]; k, v: rows [0, pos0+n), Hkv heads
// of D. Online softmax over the blocks a query reads, in ascending order; a query's result does
// not depend on the other queries of its chunk (decode of a position equals its prefill row).
// Without `sel` the blocks are the cache pages (every visible key: dense causal attention).
// K pages are KvLayout::kTransposed, V pages kRows.
void Attention(const OpContext& tc, const AttentionParams& p, const float* q, const KvPages& k, const KvPages& v,
               int64_t pos0, size_t n, const BlockSelection* sel, float* out);

}  // namespace m3
