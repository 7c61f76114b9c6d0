// Paged storage of the attention caches: K and V rows, and index keys. Pages hold `page_rows`
// consecutive positions and are allocated as the cache grows; a page never moves, so growing
// never copies the cache. For sparse layers a page is one key block.
//
// Storage types (simd::CacheType): f32 (exact), bf16, or int8 with one fp32 scale per stored
// vector (one head of one position for K/V, one index key).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "simd/cache_format.h"

namespace m3 {

using simd::CacheType;

// The bytes of pages alive in a set of caches that share pages (a scheduler's slots and its prefix
// store, lib/runtime/prefix_cache.h): each page counted once, however many lists hold it. Safe to
// read from any thread.
struct PageAccount {
  std::atomic<uint64_t> bytes{0};
};

// Blocks of bytes (pages) that never move, carved out of arenas that double in size up to
// 2 MiB and are then 2 MiB each, aligned and advised as transparent huge pages: a long context's
// pages are read with few TLB misses (64 MB of index keys span 16K small pages), while a short
// one does not pay 2 MiB per cache.
//
// Pages are reference counted (PageRef) so that lists can share them copy-on-write: a prefix
// store keeps the pages of a common prompt prefix and other caches adopt them instead of
// computing them again. A page keeps its arena alive; a write into a page that another holder
// shares goes to a copy first (MakeExclusive). Holders of one page live on one thread (the
// scheduler's): the counts are atomic, the decisions based on them are not synchronized.
class PageList {
 public:
  struct Arena;
  // One page: its bytes (counted in `account` while it lives) and its arena.
  struct Page {
    Page(std::shared_ptr<Arena> arena, uint8_t* data, size_t bytes, std::shared_ptr<PageAccount> account);
    ~Page();
    Page(const Page&) = delete;
    Page& operator=(const Page&) = delete;
    std::shared_ptr<Arena> arena;
    uint8_t* data;
    size_t bytes;
    std::shared_ptr<PageAccount> account;
  };
  using PageRef = std::shared_ptr<const Page>;

  explicit PageList(size_t page_bytes = 0) : page_bytes_((page_bytes + 63) / 64 * 64) {}
  void EnsurePages(size_t n);  // may throw std::bad_alloc
  void Release();              // frees every page (those shared live on with their other holders)
  uint8_t* page(size_t i) { return data_[i]; }
  const uint8_t* page(size_t i) const { return data_[i]; }
  size_t pages() const { return data_.size(); }
  size_t page_bytes() const { return page_bytes_; }
  // Pages held, in use or spare (kept for growth), shared ones included.
  size_t bytes() const { return (data_.size() + free_.size()) * page_bytes_; }
  // Sharing: page i (i < pages()) for another holder; whether another holder has it.
  PageRef Share(size_t i) const { return refs_[i]; }
  bool shared(size_t i) const { return refs_[i].use_count() > 1; }
  // Holds `page` (of this list's page size) as page i (i <= pages()), dropping the one there.
  void Adopt(size_t i, PageRef page);
  // Pages from i on leave the list when any of them is shared (those of this list alone stay as
  // spare): unused pages must not pin what other holders would free.
  void DropSharedFrom(size_t i);
  // Before a write into page i: a page another holder shares is replaced by a copy of its own.
  void MakeExclusive(size_t i);  // may throw std::bad_alloc
  // Where the bytes of the pages this list makes from now on are counted (may be null).
  void set_account(std::shared_ptr<PageAccount> account) { account_ = std::move(account); }

 private:
  PageRef NewPage();  // a spare one, else from the last arena, else from a new arena
  void Drop(PageRef page);  // kept as spare when no other holder has it (and ReserveSpare made room)
  void ReserveSpare(size_t n);
  size_t page_bytes_;
  std::vector<uint8_t*> data_;  // data_[i] = refs_[i]->data, read by the kernels
  std::vector<PageRef> refs_;
  std::vector<PageRef> free_;   // spare pages of this list alone, reused before new ones
  std::shared_ptr<Arena> last_;  // the arena pages come from next
  uint8_t* next_ = nullptr;      // its next page
  size_t spare_ = 0;             // pages left in it
  std::shared_ptr<PageAccount> account_;
};

using PageRef = PageList::PageRef;

// Positions stored in pages of page_rows each: the row bookkeeping KvPages and IndexKeyPages share.
class RowPages {
 public:
  void EnsureRows(size_t n) { pages_.EnsurePages((n + page_rows_ - 1) / page_rows_); }  // may throw std::bad_alloc
  size_t page_rows() const { return page_rows_; }
  size_t capacity_rows() const { return pages_.pages() * page_rows_; }
  size_t bytes() const { return pages_.bytes(); }
  size_t BytesFor(size_t rows) const { return (rows + page_rows_ - 1) / page_rows_ * pages_.page_bytes(); }
  void Release() { pages_.Release(); }  // frees every row
  PageList& page_list() { return pages_; }  // sharing pages (KvCache)
  const PageList& page_list() const { return pages_; }

 protected:
  RowPages() = default;
  RowPages(size_t page_rows, size_t page_bytes) : page_rows_(page_rows), pages_(page_bytes) {}
  size_t page_rows_ = 1;
  PageList pages_;
};

// How a page orders one head's values: V is read a row per key (P.V), K a dimension at a time
// across keys (Q.K^T as vector FMAs over keys, simd::KeyScores).
enum class KvLayout : uint8_t {
  kRows,        // [head][row][dim]
  kTransposed,  // [head][dim][row]
};

// K or V of one layer: per position `heads` vectors of `dim` values, each head's part of a page
// contiguous (then int8 scales [head][row]), so what one KV head reads from one block is one range.
class KvPages : public RowPages {
 public:
  KvPages() = default;
  KvPages(size_t heads, size_t dim, size_t page_rows, CacheType type, KvLayout layout = KvLayout::kRows);
  void Write(size_t row, const float* x);  // x: heads * dim values
  // Rows [a, b) of one head (within one page) as fp32: kRows gives rows of `dim` (stride dim),
  // kTransposed gives `dim` rows of keys (stride *ld = page_rows, key a first). A pointer into the
  // page for f32, otherwise decoded into `scratch` (page_rows * dim floats).
  const float* Read(size_t a, size_t b, size_t head, float* scratch, size_t* ld = nullptr) const;
  float Value(size_t row, size_t head, size_t d) const;  // decoded (tests, references)
  KvLayout layout() const { return layout_; }
  size_t heads() const { return heads_; }
  size_t dim() const { return dim_; }
  CacheType type() const { return type_; }
  static size_t BytesPerRow(size_t heads, size_t dim, CacheType type);  // with scales

 private:
  size_t heads_ = 0, dim_ = 0;
  CacheType type_ = CacheType::kF32;
  KvLayout layout_ = KvLayout::kRows;
};

// Index keys of one sparse layer, one vector of `dim` per position. A page stores its keys
// transposed in panels of up to 64 keys ([panel][dim][64], then int8 scales [page_rows]): the
// indexer scan reads a panel front to back for all 4 index heads of a token in one pass.
class IndexKeyPages : public RowPages {
 public:
  IndexKeyPages() = default;
  IndexKeyPages(size_t dim, size_t page_rows, CacheType type);
  void Write(size_t row, const float* x);
  float Value(size_t row, size_t d) const;  // the stored value, decoded (tests, references)
  // Keys [page * page_rows, + n_keys) for simd::IndexScoreMax.
  simd::IndexKeyPage Page(size_t page, size_t n_keys) const;
  size_t dim() const { return dim_; }
  CacheType type() const { return type_; }
  static size_t BytesPerRow(size_t dim, CacheType type);

 private:
  static constexpr size_t kPanel = 64;
  // A page's rows including the padding of its last panel (min(page_rows, kPanel) keys each).
  static size_t PaddedRows(size_t page_rows) {
    const size_t panel = std::min(page_rows, kPanel);
    return (page_rows + panel - 1) / panel * panel;
  }
  size_t At(size_t r, size_t d) const { return (r / panel_) * dim_ * panel_ + d * panel_ + r % panel_; }
  size_t dim_ = 0, panel_ = 1;
  CacheType type_ = CacheType::kF32;
};

}  // namespace m3
