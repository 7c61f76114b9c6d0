#include "ops/kv_cache.h"

#include <algorithm>

namespace m3 {

KvCache::KvCache(const KvCacheShape& shape, const CacheOptions& options)
    : page_rows_(shape.page_rows), options_(options) {
  for (const bool sparse : shape.sparse_layer) {
    k_.emplace_back(shape.kv_heads, shape.head_dim, page_rows_, options.kv, KvLayout::kTransposed);
    v_.emplace_back(shape.kv_heads, shape.head_dim, page_rows_, options.kv);
    ik_.emplace_back(sparse ? shape.index_dim : 0, page_rows_, options.index_keys);
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
