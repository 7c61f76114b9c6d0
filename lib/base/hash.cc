#include "base/hash.h"

#include <algorithm>
#include <cstring>

namespace m3 {
namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Little-endian loads (the engine only targets little-endian CPUs; memcpy keeps them unaligned-safe).
inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint64_t Round(uint64_t acc, uint64_t input) { return Rotl(acc + input * kP2, 31) * kP1; }
inline uint64_t MergeRound(uint64_t acc, uint64_t lane) { return (acc ^ Round(0, lane)) * kP1 + kP4; }

// Consumes whole 32-byte stripes; returns the bytes used.
size_t Stripes(uint64_t* lanes, const uint8_t* p, size_t n) {
  uint64_t a = lanes[0], b = lanes[1], c = lanes[2], d = lanes[3];
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = Round(a, Load64(p + i));
    b = Round(b, Load64(p + i + 8));
    c = Round(c, Load64(p + i + 16));
    d = Round(d, Load64(p + i + 24));
  }
  lanes[0] = a, lanes[1] = b, lanes[2] = c, lanes[3] = d;
  return i;
}

}  // namespace

Hasher64::Hasher64(uint64_t seed) : seed_(seed) {
  lanes_[0] = seed + kP1 + kP2;
  lanes_[1] = seed + kP2;
  lanes_[2] = seed;
  lanes_[3] = seed - kP1;
}

void Hasher64::Update(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buffered_) {
    const size_t take = std::min(n, sizeof buffer_ - buffered_);
    std::memcpy(buffer_ + buffered_, p, take);
    buffered_ += take, p += take, n -= take;
    if (buffered_ < sizeof buffer_) return;
    Stripes(lanes_, buffer_, sizeof buffer_);
    buffered_ = 0;
  }
  const size_t used = Stripes(lanes_, p, n);
  std::memcpy(buffer_, p + used, n - used);
  buffered_ = n - used;
}

uint64_t Hasher64::Digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = Rotl(lanes_[0], 1) + Rotl(lanes_[1], 7) + Rotl(lanes_[2], 12) + Rotl(lanes_[3], 18);
    for (uint64_t lane : lanes_) h = MergeRound(h, lane);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  const uint8_t* p = buffer_;
  size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8) h = Rotl(h ^ Round(0, Load64(p)), 27) * kP1 + kP4;
  if (n >= 4) {
    h = Rotl(h ^ (static_cast<uint64_t>(Load32(p)) * kP1), 23) * kP2 + kP3;
    p += 4, n -= 4;
  }
  for (; n > 0; ++p, --n) h = Rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t Hash64(const void* data, size_t n, uint64_t seed) {
  Hasher64 h(seed);
  h.Update(data, n);
  return h.Digest();
}

}  // namespace m3
