#include "model/kv_cache.h"

#include <algorithm>

namespace m3 {

KvCache::KvCache(const ModelConfig& cfg, const CacheOptions& options) : options_(options) {
  // Sparse models: a page is one key block, so the indexer and the sparse attention read pages.
  const size_t page = cfg.any_sparse() ? static_cast<size_t>(cfg.sparse.block_size) : 64;
  page_rows_ = page;
  const auto kv_heads = static_cast<size_t>(cfg.num_kv_heads), dim = static_cast<size_t>(cfg.head_dim);
  for (int l = 0; l < cfg.num_layers; ++l) {
    k_.emplace_back(kv_heads, dim, page, options.kv, KvLayout::kTransposed);
    v_.emplace_back(kv_heads, dim, page, options.kv);
    ik_.emplace_back(cfg.sparse_layer[l] ? static_cast<size_t>(cfg.sparse.index_dim) : 0, page, options.index_keys);
  }
}

void KvCache::Reserve(size_t n_tokens) {
  const size_t first = length_ / page_rows_, end = (n_tokens + page_rows_ - 1) / page_rows_;
  auto ensure = [&](RowPages& rows) {
    rows.EnsureRows(n_tokens);
    for (size_t b = first; b < end; ++b) rows.page_list().MakeExclusive(b);
  };
  for (size_t l = 0; l < k_.size(); ++l) {
    ensure(k_[l]);
    ensure(v_[l]);
    if (ik_[l].dim()) ensure(ik_[l]);
  }
}

void KvCache::Truncate(size_t n) {
  length_ = std::min(length_, n);
  const size_t keep = (length_ + page_rows_ - 1) / page_rows_;
  for (size_t l = 0; l < k_.size(); ++l) {
    k_[l].page_list().DropSharedFrom(keep);
    v_[l].page_list().DropSharedFrom(keep);
    ik_[l].page_list().DropSharedFrom(keep);
  }
}

std::vector<PageRef> KvCache::SharePage(size_t b) const {
  std::vector<PageRef> pages;
  for (size_t l = 0; l < k_.size(); ++l) {
    pages.push_back(k_[l].page_list().Share(b));
    pages.push_back(v_[l].page_list().Share(b));
    if (ik_[l].dim()) pages.push_back(ik_[l].page_list().Share(b));
  }
  return pages;
}

void KvCache::AdoptPages(std::span<const std::vector<PageRef>* const> pages) {
  for (size_t b = 0; b < pages.size(); ++b) {
    const std::vector<PageRef>& page = *pages[b];
    size_t i = 0;
    for (size_t l = 0; l < k_.size(); ++l) {
      k_[l].page_list().Adopt(b, page.at(i++));
      v_[l].page_list().Adopt(b, page.at(i++));
      if (ik_[l].dim()) ik_[l].page_list().Adopt(b, page.at(i++));
    }
  }
  length_ = pages.size() * page_rows_;
}

size_t KvCache::CopyBytesFor(size_t n_tokens) const {
  size_t b = 0;
  const size_t first = length_ / page_rows_, end = (n_tokens + page_rows_ - 1) / page_rows_;
  auto count = [&](const RowPages& rows) {
    const PageList& list = rows.page_list();
    for (size_t i = first; i < std::min(end, list.pages()); ++i)
      if (list.shared(i)) b += list.page_bytes();
  };
  for (size_t l = 0; l < k_.size(); ++l) {
    count(k_[l]);
    count(v_[l]);
    if (ik_[l].dim()) count(ik_[l]);
  }
  return b;
}

void KvCache::set_account(const std::shared_ptr<PageAccount>& account) {
  for (size_t l = 0; l < k_.size(); ++l) {
    k_[l].page_list().set_account(account);
    v_[l].page_list().set_account(account);
    ik_[l].page_list().set_account(account);
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
