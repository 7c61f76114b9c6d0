// x86-64 kernels for quant_kernels.h compiled with function target attributes (not Highway
// targets): AVX-512 VNNI (vpdpbusd) for q8/q4, AMX-INT8 (tdpbsud, tdpbssd) for prompts and
// AVX512-BF16 (vdpbf16ps) for bf16 tiles.
// Internal to m3_simd (kernel_table.cc selects them at run time), but for the feature checks,
// which the machine-limit probes (bench/peak_probe.cc) share.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/quant_kernels.h"

namespace m3::simd {
namespace x86 {

bool HasVnni();       // AVX-512 F/BW/DQ/VL + VNNI usable (CPU and OS)
bool HasAvx512Bf16();  // the above without VNNI, plus AVX512_BF16

// How the decode GEMV (1-3 tokens) reads its weights: one tile at a time, one stream the hardware
// prefetcher follows (fastest on Zen 4), or four tiles side by side, each stream prefetched ahead
// in software (fastest on Sapphire Rapids). Same results either way.
enum class GemvStreams { kOne, kFour };
inline constexpr size_t kFourStreamMaxTokens = 3;  // kFour applies to calls of at most this many tokens
GemvStreams PreferredGemvStreams();  // this CPU's: kFour on Intel, else kOne

void QuantMatMulVnni(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                     size_t ldy, GemvStreams streams, KernelScratch& scratch);
void Bf16TiledMatMulAvx512Bf16(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin,
                               size_t tile_end, float* y, size_t ldy, KernelScratch& scratch);

// Intel AMX-INT8 (quant_kernels_amx.cc): tile registers usable (CPU, and the OS granted the tile
// state), and the q8 (groups that are multiples of 64 inputs) and q4 (groups of 32) matmuls on them.
bool HasAmxInt8();
void QuantMatMulAmx(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                    size_t ldy, KernelScratch& scratch);

}  // namespace x86
}  // namespace m3::simd
