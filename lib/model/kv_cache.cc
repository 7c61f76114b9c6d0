#include "model/kv_cache.h"

namespace m3 {

KvCache::KvCache(const ModelConfig& cfg) {
  const size_t page = cfg.any_sparse() ? static_cast<size_t>(cfg.sparse.block_size) : 64;
  const size_t kv_width = static_cast<size_t>(cfg.num_kv_heads) * cfg.head_dim;
  for (int l = 0; l < cfg.num_layers; ++l) {
    k_.emplace_back(kv_width, page);
    v_.emplace_back(kv_width, page);
    ik_.emplace_back(cfg.sparse_layer[l] ? static_cast<size_t>(cfg.sparse.index_dim) : 0, page);
  }
}

void KvCache::Reserve(size_t n_tokens) {
  for (size_t l = 0; l < k_.size(); ++l) {
    k_[l].EnsureRows(n_tokens);
    v_[l].EnsureRows(n_tokens);
    if (ik_[l].width()) ik_[l].EnsureRows(n_tokens);
  }
}

size_t KvCache::bytes() const {
  size_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += k_[l].bytes() + v_[l].bytes() + ik_[l].bytes();
  return b;
}

}  // namespace m3
