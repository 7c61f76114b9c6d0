// 64-bit ARM kernels for quant_kernels.h on the int8 dot-product instructions, compiled with
// function target attributes and chosen at run time from the hwcaps (kernel_table.cc):
// - "neon-dotprod" (FEAT_DotProd, sdot: Neoverse N1 and later, Apple M1+): q8, q4, q3, q2.
// - "neon-i8mm" (FEAT_I8MM, usmmla: Neoverse V1, N2, V2, Grace): q8 and q4 blocks of 2+ tokens
//   (a lone token, and q3/q2, take sdot).
// Bit-identical to ref::QuantMatMul, like every kernel. Internal to m3_simd; on other
// architectures the checks say false and the kernels are never selected.
#pragma once

#include <cstddef>

#include "simd/quant_kernels.h"

namespace m3::simd::arm {

bool HasDotProd();  // sdot / udot (hwcap ASIMDDP)
bool HasI8mm();     // smmla / usmmla (hwcap2 I8MM)

void QuantMatMulDotProd(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end,
                        float* y, size_t ldy, KernelScratch& scratch);
void QuantMatMulI8mm(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                     size_t ldy, KernelScratch& scratch);

}  // namespace m3::simd::arm
