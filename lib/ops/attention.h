// Causal GQA attention over a paged cache, dense or restricted to selected key blocks, and the
// MiniMax sparse-attention block selection (lightning indexer, spec §2.6).
//
// Cache rows are token positions; a page holds `page_rows` consecutive positions, so for sparse
// layers (page_rows == block size) one key block is one contiguous page.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "platform/parallel.h"

namespace m3 {

// Rows of `width` floats stored in pages of `page_rows` rows; grows without moving old rows.
class PagedRows {
 public:
  PagedRows() = default;
  PagedRows(size_t width, size_t page_rows) : width_(width), page_rows_(page_rows) {}
  void EnsureRows(size_t n);  // allocates pages to hold rows [0, n)
  float* Row(size_t i) { return pages_[i / page_rows_].get() + (i % page_rows_) * width_; }
  const float* Row(size_t i) const { return pages_[i / page_rows_].get() + (i % page_rows_) * width_; }
  size_t width() const { return width_; }
  size_t page_rows() const { return page_rows_; }
  size_t capacity_rows() const { return pages_.size() * page_rows_; }
  size_t bytes() const { return pages_.size() * page_rows_ * width_ * sizeof(float); }

 private:
  struct FreeDeleter {
    void operator()(float* p) const;
  };
  size_t width_ = 0, page_rows_ = 1;
  std::vector<std::unique_ptr<float, FreeDeleter>> pages_;
};

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
int SelectBlocksForQuery(const float* block_scores, int64_t pos, const SparseParams& p, int32_t* out);

// Lightning-indexer selection for n queries at positions pos0..pos0+n-1. iq: [n, H_idx*D_idx]
// (after norm and RoPE); index_keys holds rows 0..pos0+n-1 (width D_idx).
void SelectBlocks(const ThreadConfig& tc, const SparseParams& p, const float* iq, const PagedRows& index_keys,
                  int64_t pos0, size_t n, BlockSelection* out);

struct AttentionParams {
  int num_heads = 1;
  int num_kv_heads = 1;
  int head_dim = 1;
  int num_index_heads = 1;  // only with a selection
  int block_size = 1;       // only with a selection
};

// out[t, j*D..] = softmax(q_j . K^T / sqrt(D)) V over keys u <= pos0+t (and, with `sel`, only in the
// blocks selected for index head j / (H / H_idx)). q: [n, H*D]; k, v: rows [0, pos0+n) of width Hkv*D.
void Attention(const ThreadConfig& tc, const AttentionParams& p, const float* q, const PagedRows& k,
               const PagedRows& v, int64_t pos0, size_t n, const BlockSelection* sel, float* out);

}  // namespace m3
