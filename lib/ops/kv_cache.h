// Per-sequence decode state (docs/MODEL.md §4): per layer K (after norm + RoPE) and V (raw), and for sparse
// layers one index key per token (after index norm + RoPE). Pages are one sparse block of
// positions, so block b of the indexer is one contiguous page.
//
// Pages may be shared with other caches of the same model and options (a prefix store,
// lib/runtime/prefix_cache.h): the rows of positions < length() are never written again, so a
// shared page needs copying only when a cache truncated into it writes there (Reserve does).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "ops/attention.h"

namespace m3 {

// Storage types of the caches: K/V and index keys (exact fp32 by default).
struct CacheOptions {
  CacheType kv = CacheType::kF32;
  CacheType index_keys = CacheType::kF32;
};

// The shape of a model's caches: per layer K and V of kv_heads x head_dim, and index keys of
// index_dim on the sparse layers; pages of page_rows positions (a sparse layer's key block).
struct KvCacheShape {
  size_t kv_heads = 0, head_dim = 0, index_dim = 0, page_rows = 64;
  std::vector<bool> sparse_layer;  // one per layer
};

class KvCache {
 public:
  // The cache's rows where a forward pass runs elsewhere (an offload device's memory, lib/offload):
  // owned by the cache, released with it; the length above stays the one truth.
  struct Attached {
    virtual ~Attached() = default;
  };

  explicit KvCache(const KvCacheShape& shape, const CacheOptions& options = {});

  size_t length() const { return length_; }
  // Drops positions >= n (e.g. to reuse a shared prompt prefix). Pages past them stay for reuse
  // but those shared with others, which go back to them (a page partly kept stays: Reserve copies
  // it before a write).
  void Truncate(size_t n);
  void SetLength(size_t n) { length_ = n; }
  // Pages for n_tokens positions, those of positions [length(), n_tokens) this cache's alone
  // (copy-on-write of shared pages).
  void Reserve(size_t n_tokens);  // may throw std::bad_alloc
  void Release();                 // drops every position and frees every page
  size_t bytes() const;                    // allocated
  size_t BytesFor(size_t n_tokens) const;  // allocated once n_tokens are held (whole pages)
  const CacheOptions& options() const { return options_; }

  // Sharing whole pages (of page_rows() positions) with caches of the same model and options.
  size_t page_rows() const { return page_rows_; }
  // Page b (b < the pages held) of every list: K and V of each layer, then its index keys on a
  // sparse layer; the pages stay alive while the returned references do.
  std::vector<PageRef> SharePage(size_t b) const;
  // Holds pages[b] (SharePage of such a cache) as its page b for every b < pages.size(), and
  // that many pages' positions as its length: a prefix computed elsewhere, without compute.
  // The pages held there before are dropped (kept as spare when nothing else holds them).
  void AdoptPages(std::span<const std::vector<PageRef>* const> pages);  // may throw std::bad_alloc
  // Bytes a write of positions [length(), n_tokens) must copy first: pages others share.
  size_t CopyBytesFor(size_t n_tokens) const;
  // Where the bytes of pages made from now on are counted (a scheduler's slots and store).
  void set_account(const std::shared_ptr<PageAccount>& account);

  size_t layers() const { return k_.size(); }
  KvPages& k(int layer) { return k_[layer]; }
  KvPages& v(int layer) { return v_[layer]; }
  IndexKeyPages& index_k(int layer) { return ik_[layer]; }
  std::unique_ptr<Attached>& attached() { return attached_; }

 private:
  size_t length_ = 0;
  size_t page_rows_ = 1;
  CacheOptions options_;
  std::vector<KvPages> k_, v_;
  std::vector<IndexKeyPages> ik_;
  std::unique_ptr<Attached> attached_;
};

}  // namespace m3
