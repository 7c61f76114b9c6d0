// A fast 64-bit non-cryptographic hash for file integrity checks (packed model files).
//
// The algorithm is XXH64 (four 64-bit lanes of multiply/rotate over 8-byte little-endian words,
// then a final avalanche), written here from its public description: it runs at several GB/s per
// core and gives the same values as `xxhsum -H1`, so files can be checked with standard tools.
#pragma once

#include <cstddef>
#include <cstdint>

namespace m3 {

// Incremental form: Update() may be called with any split of the input; Digest() does not
// change the state, so more data may follow.
class Hasher64 {
 public:
  explicit Hasher64(uint64_t seed = 0);
  void Update(const void* data, size_t n);
  uint64_t Digest() const;

 private:
  uint64_t lanes_[4];
  uint64_t seed_;
  uint64_t total_ = 0;
  uint8_t buffer_[32];
  size_t buffered_ = 0;
};

uint64_t Hash64(const void* data, size_t n, uint64_t seed = 0);

}  // namespace m3
