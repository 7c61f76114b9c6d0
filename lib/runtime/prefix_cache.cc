#include "runtime/prefix_cache.h"

#include <algorithm>
#include <tuple>

namespace m3 {

struct PrefixCache::Entry {
  uint64_t key = 0;
  Entry* parent = nullptr;     // the page before (null for page 0)
  size_t depth = 0;            // page index
  std::vector<int32_t> ids;    // this page's tokens
  std::vector<PageRef> pages;  // KvCache::SharePage
  uint64_t bytes = 0;
  size_t children = 0;  // entries that continue this one
  uint64_t last_used = 0;
  bool Unshared() const {
    return std::all_of(pages.begin(), pages.end(), [](const PageRef& p) { return p.use_count() == 1; });
  }
};

PrefixCache::PrefixCache(size_t page_rows, const CacheOptions& options)
    : page_rows_(page_rows), options_(options), account_(std::make_shared<PageAccount>()) {}

PrefixCache::~PrefixCache() = default;

uint64_t PrefixCache::ChainKey(uint64_t parent_key, std::span<const int32_t> ids) {
  // splitmix64's finalizer over each token, chained: a 64-bit key; entries verify their tokens.
  uint64_t h = parent_key ^ 0x9e3779b97f4a7c15ull;
  for (int32_t id : ids) {
    h ^= static_cast<uint32_t>(id) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}

std::vector<const std::vector<PageRef>*> PrefixCache::Lookup(std::span<const int32_t> ids) {
  std::vector<const std::vector<PageRef>*> out;
  const Entry* parent = nullptr;
  uint64_t key = 0;
  std::vector<Entry*> chain;
  for (size_t b = 0; (b + 1) * page_rows_ <= ids.size(); ++b) {
    const std::span<const int32_t> page = ids.subspan(b * page_rows_, page_rows_);
    key = ChainKey(key, page);
    auto it = entries_.find(key);
    if (it == entries_.end()) break;
    Entry* e = it->second.get();
    if (e->parent != parent || !std::equal(page.begin(), page.end(), e->ids.begin(), e->ids.end())) break;
    chain.push_back(e);
    out.push_back(&e->pages);
    parent = e;
  }
  ++clock_;
  for (Entry* e : chain) e->last_used = clock_;
  return out;
}

void PrefixCache::CountLookup(size_t adopted_tokens) {
  lookups_.fetch_add(1, std::memory_order_relaxed);
  if (adopted_tokens == 0) return;
  hits_.fetch_add(1, std::memory_order_relaxed);
  hit_tokens_.fetch_add(adopted_tokens, std::memory_order_relaxed);
}

void PrefixCache::Publish(std::span<const int32_t> ids, const KvCache& cache) {
  const size_t pages = std::min(ids.size(), cache.length()) / page_rows_;
  Entry* parent = nullptr;
  uint64_t key = 0;
  ++clock_;
  for (size_t b = 0; b < pages; ++b) {
    const std::span<const int32_t> page = ids.subspan(b * page_rows_, page_rows_);
    key = ChainKey(key, page);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      Entry* e = it->second.get();
      // Another prefix with this key (a 64-bit collision): the one stored stays.
      if (e->parent != parent || !std::equal(page.begin(), page.end(), e->ids.begin(), e->ids.end())) return;
      e->last_used = clock_;
      parent = e;
      continue;
    }
    auto e = std::make_unique<Entry>();
    e->key = key;
    e->parent = parent;
    e->depth = b;
    e->ids.assign(page.begin(), page.end());
    e->pages = cache.SharePage(b);
    for (const PageRef& p : e->pages) e->bytes += p->bytes;
    e->last_used = clock_;
    if (parent) ++parent->children;
    parent = e.get();
    bytes_.fetch_add(e->bytes, std::memory_order_relaxed);
    entries_.emplace(key, std::move(e));
    pages_.store(entries_.size(), std::memory_order_relaxed);
  }
}

void PrefixCache::Evict(Entry* e) {
  if (e->parent) --e->parent->children;
  bytes_.fetch_sub(e->bytes, std::memory_order_relaxed);
  evicted_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t key = e->key;  // erase destroys *e
  entries_.erase(key);
  pages_.store(entries_.size(), std::memory_order_relaxed);
}

uint64_t PrefixCache::EvictUnshared(uint64_t want) {
  // Least recently used first; a continuation is never used later than the entry it continues
  // (lookups and publishes mark whole chains), and on a tie the deeper goes first: an entry comes
  // after all that continue it, so one pass evicts whole unshared tails.
  std::vector<Entry*> order;
  order.reserve(entries_.size());
  for (auto& [key, e] : entries_) order.push_back(e.get());
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return std::make_tuple(a->last_used, b->depth) < std::make_tuple(b->last_used, a->depth);
  });
  uint64_t freed = 0;
  for (Entry* e : order) {
    if (freed >= want) break;
    if (e->children > 0 || !e->Unshared()) continue;
    freed += e->bytes;
    Evict(e);
  }
  return freed;
}

void PrefixCache::Clear() {
  evicted_.fetch_add(entries_.size(), std::memory_order_relaxed);
  entries_.clear();
  bytes_ = 0;
  pages_ = 0;
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s;
  s.bytes = bytes_.load(std::memory_order_relaxed);
  s.pages = pages_.load(std::memory_order_relaxed);
  s.lookups = lookups_.load(std::memory_order_relaxed);
  s.hits = hits_.load(std::memory_order_relaxed);
  s.hit_tokens = hit_tokens_.load(std::memory_order_relaxed);
  s.evicted = evicted_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace m3
