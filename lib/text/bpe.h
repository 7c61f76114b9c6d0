// Byte-pair merging over token ids, as HF's BPE model does it: repeatedly merge the adjacent pair
// with the lowest merge rank, the leftmost one on ties, until no adjacent pair has a merge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace m3 {

// (left id, right id) -> (rank, merged id) in an open-addressing table: the lookup is the inner
// loop of encoding, and std::unordered_map costs a pointer chase per probe.
class MergeTable {
 public:
  struct Merge {
    int32_t rank;
    int32_t id;
  };

  void Reserve(size_t count);
  // A later merge of the same pair replaces the earlier one (HF collects merges into a map).
  void Insert(int32_t left, int32_t right, Merge merge);
  // The merge of (left, right), or nullptr.
  const Merge* Find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = Key(left, right);
    for (size_t i = Hash(key) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.merge;
      if (s.key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  struct Slot {
    uint64_t key = kEmpty;
    Merge merge{};
  };
  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  static size_t Hash(uint64_t key) {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 32);
  }
  void Grow();

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// Merges `ids` (the single-byte symbols of one pre-token) in place into the final tokens.
void BpeMerge(const MergeTable& merges, std::vector<int32_t>& ids);

}  // namespace m3
