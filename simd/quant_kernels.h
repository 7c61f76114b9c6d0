// Kernels for the packed tiled formats (weight_format.h, docs/PACKED_FORMAT.md), dispatched at
// run time, each with a scalar twin in m3::simd::ref.
//
// q8/q4: activations are first quantized to int8 per token (QuantizeActivations); QuantMatMul
// then forms each output from the exact int32 group dot products
//   I_g = sum_{c in g} (code - Z) * q_a
// accumulated over groups in ascending g, in fp32:
//   q4: y[t, r] = sum_g fma(float(I_g), d_w[r, g] * d_a[t, g])     (fp16 weight scales)
//   q8: y[t, r] = (s_w[r] * s_a[t]) * sum_g float(I_g) * 2^-(e_w[r, g] + e_a[t, g])
//   q3/q2 (groups of 256, the super-blocks; activations quantized per 256 as for q4):
//     I1_g = sum_j sc[r, j] * sum_{c in j} code * q_a,  I2_g = sum_j mn[r, j] * sum_{c in j} q_a
//     over the 8 sub-blocks j of g, and y[t, r] = sum_g of, in turn,
//     fma(float(I1_g), d[r, g] * d_a[t, g]) and fma(float(I2_g), -(dmin[r, g] * d_a[t, g]))
// q8 scales are one fp32 scale per row / token times a power of two per group, so its per-group
// epilogue is a convert, an exponent add and an add (no multiply competing with the dot
// products for the multiply ports). All paths (1..8 tokens "GEMV", many tokens "GEMM", every
// target, the reference) agree bit for bit (q4 on FMA targets).
// AVX-512 VNNI uses vpdpbusd (u8 codes x s8 activations, zero point removed through the group
// sums), AVX-512BW and AVX2 maddubs/madd, other targets (NEON, SSE4, scalar) portable Highway
// code; prompts on Intel AMX-INT8 where present (q8 groups of 64k inputs, 16+ tokens: tdpbsud;
// q4 groups of 32, 9+ tokens: tdpbssd).
// Groups are multiples of 32 inputs (the packed formats' contract).
//
// bf16 (kBF16Tiled): y = x . W^T with fp32 activations; AVX512-BF16 uses vdpbf16ps on the
// activation split into bf16 high and low parts (each input exact to 2^-16 relative), other
// targets widen the weights to fp32 and use fma.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "simd/weight_format.h"

namespace m3::simd {

// Int8 activations for q8/q4 weights: rows of padded_cols codes, scales and per-group code sums.
struct QuantizedActivations {
  const int8_t* q = nullptr;       // [n_tok][padded_cols], zero beyond cols
  const float* scale = nullptr;    // q4: [n_tok][groups] d_a = amax_g / 127; q8: [n_tok] s_a = amax_t / 127
  const int32_t* sum = nullptr;    // [n_tok][groups]  sum of the group's codes
  size_t n_tok = 0;
  size_t padded_cols = 0;
  size_t group = 0;
  const uint8_t* shift = nullptr;  // q8 only: [n_tok][groups] e_a; null for q4
  size_t groups() const { return padded_cols / group; }
};

// The working memory of the matmul kernels (per call: the activations' group tables, AMX's
// packed activation tiles, the bf16 split of x), owned by the caller and passed with every call:
// one per thread, since a call writes it, and reused from call to call (ops keeps one per thread
// in the session's Workspace). A call takes each of its arrays once, before its loops, sized by
// its shape; they only grow. Nothing a call leaves in it is read by the next.
class KernelScratch {
 public:
  static constexpr size_t kArrays = 3;  // the most one call holds at once (AMX q8)
  KernelScratch() = default;
  KernelScratch(KernelScratch&&) noexcept = default;
  KernelScratch& operator=(KernelScratch&&) noexcept = default;

  // Array `slot` (< kArrays) with room for n values of T, 64-byte aligned; its contents are
  // undefined. Slots are independent: a call takes its arrays from different ones.
  template <class T>
  T* Array(size_t slot, size_t n) {
    Buffer& b = arrays_[slot];
    if (n * sizeof(T) > b.bytes) Grow(b, n * sizeof(T));
    return static_cast<T*>(b.data.get());
  }
  size_t bytes() const;  // held in all slots

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  struct Buffer {
    std::unique_ptr<void, Free> data;
    size_t bytes = 0;
  };
  static void Grow(Buffer& b, size_t bytes);  // to at least bytes, twice the old size at least
  std::array<Buffer, kArrays> arrays_;
};

// Quantizes x [n_tok, cols] (row stride ldx) for a weight with the given group (padded_cols =
// round_up(cols, group)). Output buffers: q [n_tok * padded_cols], sum [n_tok * groups], and
// - shift == nullptr (q4 weights): scale [n_tok * groups], per group d = amax_g / 127 and
//   q = round_half_even(x * (127 / amax_g)) clamped to [-127, 127];
// - shift != nullptr (q8 weights): scale [n_tok] s = amax_t / 127 over the token's row, shift
//   [n_tok * groups] e = Q8ActivationShift(amax_g, amax_t) and
//   q = round_half_even(x * ldexp(127 / amax_t, e)) clamped (the group's step is s 2^-e).
// The kernels need no scratch: sum holds each group's amax until the group's sum replaces it.
// Both give 0 codes (and scale 0) where the amax is 0. A NaN or inf makes the scale of its group
// (q4) or token (q8) NaN, with codes, sums and shifts 0: QuantMatMul's outputs for that token are
// then NaN, so a damaged value shows downstream instead of turning into finite codes.
// (KernelTable::quantize_activations; ref::QuantizeActivations below has the signature.)

// The q8 activation group shift: the largest e in [0, kQ8MaxShift] with amax_g * 2^e <= amax_t
// (0 when amax_g is 0), so the group's codes reach at least 64 of 127.
inline int Q8ActivationShift(float amax_g, float amax_t) {
  if (amax_g == 0.0f) return 0;
  uint32_t g, t;
  std::memcpy(&g, &amax_g, 4);
  std::memcpy(&t, &amax_t, 4);
  int e;
  if (g >= 0x00800000u && t >= 0x00800000u) {  // both normal: exponent difference, less one when
    e = static_cast<int>(t >> 23) - static_cast<int>(g >> 23);  // g's mantissa is the larger
    e -= (g & 0x7FFFFFu) > (t & 0x7FFFFFu);
  } else {
    e = std::ilogb(amax_t) - std::ilogb(amax_g);
    if (e > 0 && std::ldexp(amax_g, e) > amax_t) --e;
  }
  return std::clamp(e, 0, kQ8MaxShift);
}

namespace detail {

// |x|'s bits as an int32: ordered as |x| for finite x, and at least 0x7F800000 for inf and NaN,
// so an integer max over them keeps any non-finite value (a float max may drop a NaN).
inline int32_t AbsBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return static_cast<int32_t>(b & 0x7FFFFFFFu);
}

// Token t's q8 activations when its row holds a NaN or inf: scale NaN, everything else 0.
inline void SetNonFiniteQ8Token(size_t t, size_t padded_cols, size_t groups, int8_t* q, float* scale, int32_t* sum,
                                uint8_t* shift) {
  std::memset(q + t * padded_cols, 0, padded_cols);
  scale[t] = std::numeric_limits<float>::quiet_NaN();
  std::fill(sum + t * groups, sum + (t + 1) * groups, 0);
  std::memset(shift + t * groups, 0, groups);
}

}  // namespace detail

// x * 2^e for 0 <= e <= 127, exactly as std::ldexp (a product with a power of two: exact unless
// it overflows, to inf alike), without the library call.
inline float MulPow2(float x, int e) {
  const uint32_t bits = static_cast<uint32_t>(127 + e) << 23;
  float p;
  std::memcpy(&p, &bits, 4);
  return x * p;
}

// The matmuls (KernelTable::quant_matmul and bf16_tiled_matmul, simd/kernel_table.h; the ref::
// twins below have the signatures):
// - quant: y[t * ldy + r] for rows r of row tiles [tile_begin, tile_end) (clipped to w.rows) and
//   all a.n_tok tokens; w is kQ8, kQ4, kQ3 or kQ2 with w.group == a.group and
//   w.padded_cols() == a.padded_cols (q3/q2: group kSuperGroup).
// - bf16: y[t * ldy + r] = sum_c W[r, c] * x[t * ldx + c] for rows of row tiles
//   [tile_begin, tile_end) of a kBF16Tiled weight, t < n_tok.
// Both work in `scratch` (the calling thread's; the references leave it alone).

namespace ref {
void QuantizeActivations(const float* x, size_t ldx, size_t n_tok, size_t cols, size_t group, int8_t* q,
                         float* scale, int32_t* sum, uint8_t* shift);
void QuantMatMul(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                 size_t ldy, KernelScratch& scratch);
void Bf16TiledMatMul(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin, size_t tile_end,
                     float* y, size_t ldy, KernelScratch& scratch);
}  // namespace ref

}  // namespace m3::simd
