// Per-sequence decode state (spec §3): per layer K (after norm + RoPE) and V (raw), and for sparse
// layers one index key per token (after index norm + RoPE). Pages are one sparse block of
// positions, so block b of the indexer is one contiguous page.
#pragma once

#include <cstddef>
#include <vector>

#include "model/config.h"
#include "ops/attention.h"

namespace m3 {

class KvCache {
 public:
  explicit KvCache(const ModelConfig& cfg);

  size_t length() const { return length_; }
  // Drops positions >= n (e.g. to reuse a shared prompt prefix).
  void Truncate(size_t n) { length_ = std::min(length_, n); }
  void SetLength(size_t n) { length_ = n; }
  void Reserve(size_t n_tokens);  // may throw std::bad_alloc
  size_t bytes() const;

  PagedRows& k(int layer) { return k_[layer]; }
  PagedRows& v(int layer) { return v_[layer]; }
  PagedRows& index_k(int layer) { return ik_[layer]; }

 private:
  size_t length_ = 0;
  std::vector<PagedRows> k_, v_, ik_;
};

}  // namespace m3
