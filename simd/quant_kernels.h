// Kernels for the packed tiled formats (weight_format.h, docs/PACKED_FORMAT.md), dispatched at
// run time, each with a scalar twin in m3::simd::ref.
//
// q8/q4: activations are first quantized to int8 per token and per weight group
// (QuantizeActivations); QuantMatMul then forms every output as
//   y[t, r] = sum_g float(I_g) * (d_w[r, g] * d_a[t, g]),   I_g = sum_{c in g} (code - Z) * q_a
// accumulated with one fma per group in ascending g, so all paths (1..8 tokens "GEMV", many
// tokens "GEMM", every target, the reference) agree bit for bit on FMA targets.
// AVX-512 VNNI uses vpdpbusd (u8 codes x s8 activations, zero point removed through the group
// sums), AVX-512BW and AVX2 maddubs/madd, other targets (NEON, SSE4, scalar) portable Highway
// code. Groups are multiples of 32 inputs (the packed formats' contract).
//
// bf16 (kBF16Tiled): y = x . W^T with fp32 activations; AVX512-BF16 uses vdpbf16ps on the
// activation split into bf16 high and low parts (each input exact to 2^-16 relative), other
// targets widen the weights to fp32 and use fma.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "weight_format.h"

namespace m3::simd {

// Int8 activations for q8/q4 weights: rows of padded_cols codes, per-group scale and code sum.
struct QuantizedActivations {
  const int8_t* q = nullptr;       // [n_tok][padded_cols], zero beyond cols
  const float* scale = nullptr;    // [n_tok][groups]  d_a = amax / 127 (0 when amax == 0)
  const int32_t* sum = nullptr;    // [n_tok][groups]  sum of the group's codes
  size_t n_tok = 0;
  size_t padded_cols = 0;
  size_t group = 0;
  size_t groups() const { return padded_cols / group; }
};

// Quantizes x [n_tok, cols] (row stride ldx) for a weight with the given group (padded_cols =
// round_up(cols, group)). Output buffers: q [n_tok * padded_cols], scale and sum [n_tok * groups].
// q = round_half_even(x * (127 / amax)) clamped to [-127, 127]; x must be finite.
void QuantizeActivations(const float* x, size_t ldx, size_t n_tok, size_t cols, size_t group, int8_t* q,
                         float* scale, int32_t* sum);

// y[t * ldy + r] for rows r of row tiles [tile_begin, tile_end) (clipped to w.rows) and all
// a.n_tok tokens; w is kQ8 or kQ4 with w.group == a.group and w.padded_cols() == a.padded_cols.
void QuantMatMul(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                 size_t ldy);

// y[t * ldy + r] = sum_c W[r, c] * x[t * ldx + c] for rows of row tiles [tile_begin, tile_end) of
// a kBF16Tiled weight, t < n_tok.
void Bf16TiledMatMul(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin,
                     size_t tile_end, float* y, size_t ldy);

// Which implementation QuantMatMul / Bf16TiledMatMul use on this CPU (e.g. "avx512-vnni",
// "avx2", "highway-NEON", "avx512-bf16"); for benchmark reports.
const char* QuantKernelName();
const char* Bf16KernelName();

// Runs the fastest int8 dot-product instruction of this CPU (vpdpbusd with 16 independent
// accumulators when AVX-512 VNNI is present, else the active path's sequence) from registers
// only, `iterations` times; returns the int8 operations performed (2 per multiply-add).
uint64_t Int8DotPeakLoop(uint64_t iterations);

// Tests only (not thread safe). Every implementation runnable here: "ref", "avx512-vnni",
// "avx512-bf16" (bf16 only), and one per Highway target ("avx512", "avx2", "highway-SSE4", ...).
std::vector<std::string> RunnableQuantKernels();
// Forces QuantizeActivations / QuantMatMul / Bf16TiledMatMul to the named implementation where it
// provides them (automatic choice for the others); nullptr or "" restores automatic choice.
// Returns false for a name not in RunnableQuantKernels().
bool ForceQuantKernelForTest(const char* name);
// Whether the active QuantMatMul uses fused multiply-add and so matches ref bit for bit.
bool QuantKernelIsExact();

namespace ref {
void QuantizeActivations(const float* x, size_t ldx, size_t n_tok, size_t cols, size_t group, int8_t* q,
                         float* scale, int32_t* sum);
void QuantMatMul(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                 size_t ldy);
void Bf16TiledMatMul(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin,
                     size_t tile_end, float* y, size_t ldy);
}  // namespace ref

}  // namespace m3::simd
