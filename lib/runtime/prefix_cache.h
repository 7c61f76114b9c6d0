// A store of prompt prefixes' cache pages, shared between the sessions of a scheduler (`m3 serve`,
// `m3 batch`): conversations that begin alike (a long system prompt, tool definitions) prefill
// that beginning once; later ones adopt its pages (KvCache::AdoptPages) and prefill the rest.
//
// An entry is one page of positions (one sparse key block: page_rows tokens) of every K, V and
// index-key list, keyed by a hash chained over all tokens up to the end of that page, and it
// keeps that page's tokens and its parent entry (the page before) so that a lookup verifies the
// whole prefix, never trusting a hash alone. The pages are reference counted (PageList): the
// store and any number of caches hold the same page, copy-on-write (only a cache truncated into a
// shared page ever writes there). A cache's rows depend only on the tokens up to them, so pages
// adopted give the very logits a fresh prefill of the same tokens gives.
//
// Entries are evicted least recently used first, an entry only after the entries that continue
// it. Memory: the store and the sessions count their pages in one PageAccount, each page once
// however many hold it; the scheduler frees what the store alone holds before idle sessions'
// caches when the cache budget is reached (Scheduler::ReleaseCacheMemory). An entry evicted while
// a session still uses its pages leaves them to that session.
//
// One thread uses a store and its sessions (the scheduler's); stats() may be read from any.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "ops/kv_cache.h"

namespace m3 {

struct PrefixCacheStats {
  uint64_t bytes = 0;       // of the pages the store holds (some may be sessions' too), each once
  uint64_t pages = 0;       // entries: pages of positions (of every list)
  uint64_t lookups = 0;     // prompts looked up (requests that may reuse a prefix)
  uint64_t hits = 0;        // of those, served a longer prefix than their session held
  uint64_t hit_tokens = 0;  // positions adopted from the store
  uint64_t evicted = 0;     // entries evicted
};

class PrefixCache {
 public:
  // For caches of `page_rows` positions a page stored as `options` says.
  PrefixCache(size_t page_rows, const CacheOptions& options);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  size_t page_rows() const { return page_rows_; }
  const CacheOptions& options() const { return options_; }
  // Where the store's sessions count their pages (KvCache::set_account): all pages alive.
  const std::shared_ptr<PageAccount>& account() const { return account_; }

  // The pages of the longest stored prefix of `ids` made of whole pages (page 0 first; at most
  // ids.size() / page_rows), each SharePage of a cache that held those tokens. Marks them used.
  std::vector<const std::vector<PageRef>*> Lookup(std::span<const int32_t> ids);
  // Counts a lookup of a request and the positions it adopted (0: none).
  void CountLookup(size_t adopted_tokens);
  // Stores the whole pages of `cache`'s first ids.size() positions, whose tokens `ids` are, that
  // the store does not hold yet (no copy: the store shares them).
  void Publish(std::span<const int32_t> ids, const KvCache& cache);
  // Evicts least recently used entries whose pages nothing else holds until `want` bytes are
  // freed or no such entry is left; returns the bytes freed.
  uint64_t EvictUnshared(uint64_t want);
  // Evicts every entry (the pages sessions hold live on with them).
  void Clear();
  PrefixCacheStats stats() const;  // from any thread

 private:
  struct Entry;
  // The key of the page after `parent_key` holding `ids`.
  static uint64_t ChainKey(uint64_t parent_key, std::span<const int32_t> ids);
  void Evict(Entry* e);

  size_t page_rows_;
  CacheOptions options_;
  std::shared_ptr<PageAccount> account_;
  std::unordered_map<uint64_t, std::unique_ptr<Entry>> entries_;  // by chained key
  uint64_t clock_ = 0;
  std::atomic<uint64_t> bytes_{0}, pages_{0}, lookups_{0}, hits_{0}, hit_tokens_{0}, evicted_{0};
};

}  // namespace m3
