// The kernels an engine runs with, chosen once: a table of function pointers per operation,
// selected when the engine opens (this CPU's best, or an implementation named for a test or a
// benchmark) and passed down with every call. Nothing is re-decided per call except what depends
// on the call's shape (AMX takes prompts of enough tokens, see UsesAmx), and no global changes.
//
// Covered: the weight matmuls of every format (quantize activations, q8/q4 integer GEMV/GEMM,
// bf16 tiles, fp32), which are where the implementations differ in more than the Highway target
// (VNNI, AMX, AVX512-BF16 and ARM dot-product paths beside Highway's). The other fp32 kernels
// (kernels.h, attention_kernels.h) dispatch through Highway's own table, chosen once per process
// from the CPU.
//
// The kernels keep no state of their own: the matmuls work in the caller's KernelScratch
// (quant_kernels.h; one per thread, from the session's Workspace in ops). The tables are built in
// kernel_table.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "simd/quant_kernels.h"
#include "simd/weight_format.h"

namespace m3::simd {

struct KernelTable {
  using QuantizeActivationsFn = void (*)(const float* x, size_t ldx, size_t n_tok, size_t cols, size_t group,
                                         int8_t* q, float* scale, int32_t* sum, uint8_t* shift);
  using QuantMatMulFn = void (*)(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end,
                                 float* y, size_t ldy, KernelScratch& scratch);
  using Bf16TiledMatMulFn = void (*)(const WeightRef& w, const float* x, size_t ldx, size_t n_tok, size_t tile_begin,
                                     size_t tile_end, float* y, size_t ldy, KernelScratch& scratch);
  using MatMulF32Fn = void (*)(const float* a, size_t lda, size_t n_rows, const float* x, size_t ldx,
                               size_t n_tok, size_t k, float* y, size_t ldy);

  std::string name;         // what was asked for: "auto", "ref", "avx512-vnni", "avx2", ...
  std::string target;       // the Highway target of the fp32 kernels (e.g. "AVX3_ZEN4")
  QuantizeActivationsFn quantize_activations = nullptr;
  QuantMatMulFn quant_matmul = nullptr;     // q8 / q4, any token count
  QuantMatMulFn super_block_matmul = nullptr;  // q3 / q2 (Highway's or the reference), any token count
  std::string super_block_name;                // its name, e.g. "avx2"
  std::string quant_name;                   // its name, e.g. "avx512-vnni"
  QuantMatMulFn quant_matmul_amx = nullptr;  // Intel AMX, or null; prompts of amx_min_tokens_* tokens
  size_t amx_min_tokens_q8 = 0;
  size_t amx_min_tokens_q4 = 0;
  Bf16TiledMatMulFn bf16_tiled_matmul = nullptr;
  std::string bf16_name;                    // e.g. "avx512-bf16"
  MatMulF32Fn matmul_f32 = nullptr;
  // Whether quant_matmul uses fused multiply-add and so matches ref bit for bit on q4 (q8 matches
  // on every path: its epilogue has no fma).
  bool quant_exact = true;

  // Whether quant matmuls of w with n_tok tokens run on AMX.
  bool UsesAmx(const WeightRef& w, size_t n_tok) const {
    if (!quant_matmul_amx) return false;
    if (w.format == WeightFormat::kQ8) return w.group % 64 == 0 && n_tok >= amx_min_tokens_q8;
    if (w.format == WeightFormat::kQ4) return w.group == 32 && n_tok >= amx_min_tokens_q4;
    return false;
  }
  void QuantMatMul(const WeightRef& w, const QuantizedActivations& a, size_t tile_begin, size_t tile_end, float* y,
                   size_t ldy, KernelScratch& scratch) const {
    (IsSuperBlock(w.format) ? super_block_matmul
     : UsesAmx(w, a.n_tok)  ? quant_matmul_amx
                            : quant_matmul)(w, a, tile_begin, tile_end, y, ldy, scratch);
  }
  // The implementation QuantMatMul runs for w with n_tok tokens (for benchmark reports).
  const char* QuantName(const WeightRef& w, size_t n_tok) const;
};

// This CPU's best kernels (the table an engine uses unless told otherwise). Built once.
const KernelTable& BestKernels();
// The table of one implementation by name, as listed by KernelNames(); nullopt for a name this
// CPU cannot run. "auto" (or "") is BestKernels(). "ref" is the scalar references; "avx512-vnni"
// and "avx512-vnni-4streams" the VNNI GEMV reading one or four weight streams; "avx512-bf16" the
// bf16 dot product (bf16 weights; quant kernels as best); "amx-int8" AMX for every prompt it covers
// (q8 with groups of 64k inputs, q4 with groups of 32, every token count; VNNI for the rest);
// "neon-dotprod" ARM's sdot for every integer format and "neon-i8mm" its usmmla for q8/q4 (sdot for
// the rest); and one per Highway target ("avx512", "avx2", "highway-SSE4", "highway-NEON", ...).
std::optional<KernelTable> KernelsNamed(std::string_view name);
// Every implementation this CPU can run, "ref" first.
std::vector<std::string> KernelNames();

namespace detail {
KernelTable::MatMulF32Fn MatMulF32ForTarget(int64_t target);  // kernels.cc's entry for a Highway target
// quant_kernels.cc's entries for a Highway target.
struct HighwayQuantKernels {
  KernelTable::QuantizeActivationsFn quantize_activations;
  KernelTable::QuantMatMulFn quant_matmul;
  KernelTable::Bf16TiledMatMulFn bf16_tiled_matmul;
  bool exact;  // KernelTable::quant_exact
};
HighwayQuantKernels HighwayQuantKernelsForTarget(int64_t target);
KernelTable::QuantMatMulFn SuperBlockMatMulForTarget(int64_t target);  // superblock_kernels.cc's
}  // namespace detail

}  // namespace m3::simd
