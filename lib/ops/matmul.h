// y = x . W^T for a weight in any stored format, threaded over output rows.
//
// Shapes: x [n_tok, W.cols] (row stride ldx), y [n_tok, W.rows] (row stride ldy).
// Each row tile of W is decoded once to fp32 (never for F32 weights, which are read in place)
// and multiplied against every token, so weights are read once per call.
#pragma once

#include <cstddef>

#include "platform/parallel.h"
#include "weight_format.h"

namespace m3 {

void MatMul(const ThreadConfig& tc, const simd::WeightRef& w, const float* x, size_t ldx, size_t n_tok,
            float* y, size_t ldy);

// out[t, :] = W[ids[t], :] (embedding lookup, exact).
void GatherRows(const simd::WeightRef& w, const int32_t* ids, size_t n, float* out);

}  // namespace m3
