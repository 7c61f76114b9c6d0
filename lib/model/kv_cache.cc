#include "model/kv_cache.h"

namespace m3 {

KvCache::KvCache(const ModelConfig& cfg, const CacheOptions& options) : options_(options) {
  // Sparse models: a page is one key block, so the indexer and the sparse attention read pages.
  const size_t page = cfg.any_sparse() ? static_cast<size_t>(cfg.sparse.block_size) : 64;
  const auto kv_heads = static_cast<size_t>(cfg.num_kv_heads), dim = static_cast<size_t>(cfg.head_dim);
  for (int l = 0; l < cfg.num_layers; ++l) {
    k_.emplace_back(kv_heads, dim, page, options.kv, KvLayout::kTransposed);
    v_.emplace_back(kv_heads, dim, page, options.kv);
    ik_.emplace_back(cfg.sparse_layer[l] ? static_cast<size_t>(cfg.sparse.index_dim) : 0, page, options.index_keys);
  }
}

void KvCache::Reserve(size_t n_tokens) {
  for (size_t l = 0; l < k_.size(); ++l) {
    k_[l].EnsureRows(n_tokens);
    v_[l].EnsureRows(n_tokens);
    if (ik_[l].dim()) ik_[l].EnsureRows(n_tokens);
  }
}

void KvCache::Release() {
  length_ = 0;
  attached_.reset();
  for (size_t l = 0; l < k_.size(); ++l) {
    k_[l].Release();
    v_[l].Release();
    ik_[l].Release();
  }
}

size_t KvCache::bytes() const {
  size_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += k_[l].bytes() + v_[l].bytes() + ik_[l].bytes();
  return b;
}

size_t KvCache::BytesFor(size_t n_tokens) const {
  size_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) {
    b += k_[l].BytesFor(n_tokens) + v_[l].BytesFor(n_tokens);
    if (ik_[l].dim()) b += ik_[l].BytesFor(n_tokens);
  }
  return b;
}

}  // namespace m3
