#include "text/bpe.h"

#include <algorithm>
#include <climits>
#include <functional>

namespace m3 {

void MergeTable::Reserve(size_t count) {
  size_t cap = 16;
  while (cap < count * 2) cap <<= 1;  // load factor <= 1/2 keeps probes short
  if (cap <= slots_.size()) return;
  std::vector<Slot> old;
  old.swap(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  size_ = 0;
  for (const Slot& s : old) {
    if (s.key != kEmpty) Insert(static_cast<int32_t>(s.key >> 32), static_cast<int32_t>(s.key), s.merge);
  }
}

void MergeTable::Grow() { Reserve(slots_.empty() ? 8 : slots_.size()); }

void MergeTable::Insert(int32_t left, int32_t right, Merge merge) {
  if ((size_ + 1) * 2 > slots_.size()) Grow();
  const uint64_t key = Key(left, right);
  for (size_t i = Hash(key) & mask_;; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.key == key) {
      s.merge = merge;
      return;
    }
    if (s.key == kEmpty) {
      s.key = key;
      s.merge = merge;
      ++size_;
      return;
    }
  }
}

namespace {

// Short words (nearly all of them): rescanning a small rank array beats heap bookkeeping.
void MergeShort(const MergeTable& merges, std::vector<int32_t>& ids) {
  const size_t n = ids.size();
  int32_t rank[64];  // rank[i]: rank of the pair (ids[i], ids[i+1]); INT_MAX when none
  int32_t merged[64];
  auto set_pair = [&](size_t i) {
    const MergeTable::Merge* m = merges.Find(ids[i], ids[i + 1]);
    rank[i] = m ? m->rank : INT_MAX;
    merged[i] = m ? m->id : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) set_pair(i);
  size_t len = n;
  while (len >= 2) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < len; ++i) {
      if (rank[i] < rank[best]) best = i;  // strict: the leftmost wins ties
    }
    if (rank[best] == INT_MAX) break;
    ids[best] = merged[best];
    for (size_t i = best + 1; i + 1 < len; ++i) ids[i] = ids[i + 1];
    for (size_t i = best + 1; i + 2 < len; ++i) {
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --len;
    ids.resize(len);
    if (best > 0) set_pair(best - 1);
    if (best + 1 < len) set_pair(best);
  }
}

// Long words: a doubly linked list of symbols and a min-heap of candidate merges whose stale
// entries are skipped when popped; the same procedure as HF's Word::merge_all. A candidate is
// packed as rank << 32 | position, so the heap orders by rank and then leftmost position.
void MergeLong(const MergeTable& merges, std::vector<int32_t>& ids) {
  const int n = static_cast<int>(ids.size());
  std::vector<int> prev(n), next(n);  // words over 64 symbols are rare: their own buffers
  std::vector<uint64_t> heap;
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  constexpr int kDead = -2;  // prev[] of a symbol merged into its left neighbour
  auto push = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    if (const MergeTable::Merge* m = merges.Find(ids[pos], ids[next[pos]])) {
      heap.push_back((static_cast<uint64_t>(m->rank) << 32) | static_cast<uint32_t>(pos));
      std::push_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    }
  };
  for (int i = 0; i + 1 < n; ++i) {
    if (const MergeTable::Merge* m = merges.Find(ids[i], ids[i + 1])) {
      heap.push_back((static_cast<uint64_t>(m->rank) << 32) | static_cast<uint32_t>(i));
    }
  }
  std::make_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    const uint64_t top = heap.back();
    heap.pop_back();
    const int pos = static_cast<int>(top & 0xFFFFFFFFu);
    const int32_t rank = static_cast<int32_t>(top >> 32);
    if (prev[pos] == kDead || next[pos] < 0) continue;
    const int right = next[pos];
    // Each pair has one rank, so an entry is current exactly when its pair still has that rank.
    const MergeTable::Merge* m = merges.Find(ids[pos], ids[right]);
    if (m == nullptr || m->rank != rank) continue;
    ids[pos] = m->id;
    next[pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = pos;
    prev[right] = kDead;
    push(prev[pos]);
    push(pos);
  }
  size_t out = 0;
  for (int i = 0; i < n; ++i) {
    if (prev[i] != kDead) ids[out++] = ids[i];
  }
  ids.resize(out);
}

}  // namespace

void BpeMerge(const MergeTable& merges, std::vector<int32_t>& ids) {
  if (ids.size() < 2) return;
  if (ids.size() <= 64) {
    MergeShort(merges, ids);
  } else {
    MergeLong(merges, ids);
  }
}

}  // namespace m3
