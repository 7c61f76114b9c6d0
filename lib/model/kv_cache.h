// Per-sequence decode state (docs/MODEL.md §4): per layer K (after norm + RoPE) and V (raw), and for sparse
// layers one index key per token (after index norm + RoPE). Pages are one sparse block of
// positions, so block b of the indexer is one contiguous page.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "model/config.h"
#include "ops/attention.h"

namespace m3 {

// Storage types of the caches: K/V and index keys (exact fp32 by default).
struct CacheOptions {
  CacheType kv = CacheType::kF32;
  CacheType index_keys = CacheType::kF32;
};

class KvCache {
 public:
  // The cache's rows where a forward pass runs elsewhere (an offload device's memory, lib/offload):
  // owned by the cache, released with it; the length above stays the one truth.
  struct Attached {
    virtual ~Attached() = default;
  };

  explicit KvCache(const ModelConfig& cfg, const CacheOptions& options = {});

  size_t length() const { return length_; }
  // Drops positions >= n (e.g. to reuse a shared prompt prefix).
  void Truncate(size_t n) { length_ = std::min(length_, n); }
  void SetLength(size_t n) { length_ = n; }
  void Reserve(size_t n_tokens);  // may throw std::bad_alloc
  void Release();                 // drops every position and frees every page
  size_t bytes() const;                    // allocated
  size_t BytesFor(size_t n_tokens) const;  // allocated once n_tokens are held (whole pages)
  const CacheOptions& options() const { return options_; }

  KvPages& k(int layer) { return k_[layer]; }
  KvPages& v(int layer) { return v_[layer]; }
  IndexKeyPages& index_k(int layer) { return ik_[layer]; }
  std::unique_ptr<Attached>& attached() { return attached_; }

 private:
  size_t length_ = 0;
  CacheOptions options_;
  std::vector<KvPages> k_, v_;
  std::vector<IndexKeyPages> ik_;
  std::unique_ptr<Attached> attached_;
};

}  // namespace m3
