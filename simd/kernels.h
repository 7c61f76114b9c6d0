// Dispatched fp32 kernels (Highway, chosen at run time) and their scalar references.
//
// Every function in m3::simd has a twin with the same signature in m3::simd::ref, written as plain
// loops; tests compare the two on every compiled SIMD target. Kernels take pointers and sizes only:
// no threads, no files, no model names.
//
// Shapes seen in MiniMax-M3: k = 6144 (hidden), 8192 (q heads x 128), 3072 (expert), 12288 (dense
// MLP), 128 (head / index dim); rows up to 200064 (lm_head).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "simd/weight_format.h"

namespace m3::simd {

// out[r * w.cols + c] = W[row0 + r, c] exactly, for r < n_rows.
void DecodeRows(const WeightRef& w, size_t row0, size_t n_rows, float* out);

// y[t * ldy + r] = sum_c a[r * lda + c] * x[t * ldx + c]   for r < n_rows, t < n_tok.
// Each output's summation order depends only on k (not on n_rows or n_tok), so splitting the
// rows or tokens over threads never changes a result.
void MatMulF32(const float* a, size_t lda, size_t n_rows, const float* x, size_t ldx,
               size_t n_tok, size_t k, float* y, size_t ldy);

// out[h * ldo + c] += sum_u p[h * ldp + u] * v[u * ldv + c]   for h < n_rows, c < d, u < n_keys.
// The P.V product of attention: each V row is loaded once for two rows of P. The sum over u runs
// in order, so accumulating key ranges one after another gives the same result as one call.
void MatMulAccumulate(const float* p, size_t ldp, size_t n_rows, const float* v, size_t ldv, size_t n_keys,
                      size_t d, float* out, size_t ldo);

float Dot(const float* a, const float* b, size_t n);
void Axpy(float alpha, const float* x, float* y, size_t n);  // y += alpha * x
void Scale(float* y, float s, size_t n);                     // y *= s
float SumSquares(const float* x, size_t n);
void MulScaled(const float* x, const float* w, float s, float* y, size_t n);  // y = x * s * w
// RMSNorm of n_rows rows of dim values: out_r = MulScaled(x_r, scale, inv) with
// inv = 1 / sqrt(SumSquares(x_r) / dim + eps), each step rounding as that kernel does on the same
// target (one dispatch for all rows). In place when out == x and ld_out == ld_x.
void RmsNormRows(const float* x, size_t ld_x, size_t n_rows, size_t dim, const float* scale, float eps, float* out,
                 size_t ld_out);
float MaxValue(const float* x, size_t n);                    // -inf for n == 0
float ExpShiftSum(float* x, size_t n, float shift);          // x = exp(x - shift) (NaN stays); returns sum
size_t FindNonFinite(const float* x, size_t n);              // index of the first NaN or +-inf; n if none
// SwiGLU-OAI in place: g[i] = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, +-limit) + beta);
// NaN where g[i] or u[i] is NaN or infinite (overflow or damaged weights, not a value to clamp).
void SwigluOai(float* g, const float* u, size_t n, float alpha, float limit, float beta);

namespace ref {
void DecodeRows(const WeightRef& w, size_t row0, size_t n_rows, float* out);
void MatMulF32(const float* a, size_t lda, size_t n_rows, const float* x, size_t ldx,
               size_t n_tok, size_t k, float* y, size_t ldy);
void MatMulAccumulate(const float* p, size_t ldp, size_t n_rows, const float* v, size_t ldv, size_t n_keys,
                      size_t d, float* out, size_t ldo);
float Dot(const float* a, const float* b, size_t n);
void Axpy(float alpha, const float* x, float* y, size_t n);
void Scale(float* y, float s, size_t n);
float SumSquares(const float* x, size_t n);
void MulScaled(const float* x, const float* w, float s, float* y, size_t n);
void RmsNormRows(const float* x, size_t ld_x, size_t n_rows, size_t dim, const float* scale, float eps, float* out,
                 size_t ld_out);
float MaxValue(const float* x, size_t n);
float ExpShiftSum(float* x, size_t n, float shift);
size_t FindNonFinite(const float* x, size_t n);
void SwigluOai(float* g, const float* u, size_t n, float alpha, float limit, float beta);
}  // namespace ref

// The SIMD target the dispatcher picks on this CPU (e.g. "AVX3", "AVX2", "NEON").
std::string ActiveTargetName();
// Every target compiled into this binary that this CPU can run (for tests).
std::vector<int64_t> RunnableTargets();
std::string TargetName(int64_t target);
// Restricts dispatch to one target (tests only); 0 restores normal dispatch.
void ForceTargetForTest(int64_t target);

}  // namespace m3::simd
