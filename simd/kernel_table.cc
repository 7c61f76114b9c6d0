// The kernel tables (kernel_table.h): this CPU's best, one per implementation by name, and the
// scalar references; built from the Highway entries of each target (kernels.cc, quant_kernels.cc)
// and the x86 and ARM kernels (quant_kernels_x86.h, quant_kernels_arm.h) where the CPU runs
// them. Also KernelScratch's memory.
#include "simd/kernel_table.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "hwy/highway.h"
#include "simd/dispatch.h"
#include "simd/kernels.h"
#include "simd/quant_kernels.h"
#include "simd/quant_kernels_arm.h"
#include "simd/quant_kernels_x86.h"

namespace m3::simd {

void KernelScratch::Grow(Buffer& b, size_t bytes) {
  // At least twice the old size (as a std::vector grows): a thread that meets ever larger calls
  // reallocates a few times, not at each of them.
  constexpr size_t kAlign = 64;
  const size_t grown = (std::max(bytes, 2 * b.bytes) + kAlign - 1) / kAlign * kAlign;
  b.data.reset();
  b.bytes = 0;
  b.data.reset(std::aligned_alloc(kAlign, grown));
  if (!b.data) throw std::bad_alloc();
  b.bytes = grown;
}

size_t KernelScratch::bytes() const {
  size_t total = 0;
  for (const Buffer& b : arrays_) total += b.bytes;
  return total;
}

namespace {

// AMX takes q8 matmuls (groups of 64k inputs) and q4 ones (groups of 32) of at least this many
// tokens. Sapphire Rapids-class VM, AMX / VNNI: q8 3072 x 6144 in L3, 12 tokens 0.96x, 16 1.1x,
// 32 1.5x, 64 1.6x; q4 6144 x 3072 with cold weights, 8 tokens 0.93x (VNNI's GEMV), 9 1.12x,
// 12 1.08x, 16 1.14-1.34x, 32 1.2x, 512 1.08x.
constexpr size_t kAmxMinTokensQ8 = 16;
constexpr size_t kAmxMinTokensQ4 = 9;

void QuantMatMulVnniOne(const WeightRef& w, const QuantizedActivations& a, size_t t0, size_t t1, float* y, size_t ldy,
                        KernelScratch& scratch) {
  x86::QuantMatMulVnni(w, a, t0, t1, y, ldy, x86::GemvStreams::kOne, scratch);
}
void QuantMatMulVnniFour(const WeightRef& w, const QuantizedActivations& a, size_t t0, size_t t1, float* y, size_t ldy,
                         KernelScratch& scratch) {
  x86::QuantMatMulVnni(w, a, t0, t1, y, ldy, x86::GemvStreams::kFour, scratch);
}

const char* HighwayKernelName(int64_t target) {
  if (target == HWY_AVX3) return "avx512";
  if (target == HWY_AVX2) return "avx2";
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v(64);
    for (int bit = 0; bit < 64; ++bit) v[bit] = std::string("highway-") + hwy::TargetName(int64_t{1} << bit);
    return v;
  }();
  for (int bit = 0; bit < 64; ++bit)
    if (target == (int64_t{1} << bit)) return names[bit].c_str();
  return "highway-?";
}

// The Highway kernels of one target.
KernelTable HighwayTable(int64_t target) {
  const detail::HighwayQuantKernels quant = detail::HighwayQuantKernelsForTarget(target);
  KernelTable k;
  k.target = hwy::TargetName(target);
  k.quantize_activations = quant.quantize_activations;
  k.quant_matmul = quant.quant_matmul;
  k.super_block_matmul = detail::SuperBlockMatMulForTarget(target);
  k.quant_name = k.super_block_name = HighwayKernelName(target);
  k.bf16_tiled_matmul = quant.bf16_tiled_matmul;
  k.bf16_name = k.quant_name;
  k.matmul_f32 = detail::MatMulF32ForTarget(target);
  k.quant_exact = quant.exact;
  return k;
}

// The ARM kernels on top of Highway's NEON table: sdot for every integer format, usmmla for the
// q8/q4 blocks of 2+ tokens where the CPU has it.
void UseArmKernels(KernelTable& k, bool i8mm) {
  k.quant_matmul = i8mm ? arm::QuantMatMulI8mm : arm::QuantMatMulDotProd;
  k.quant_name = i8mm ? "neon-i8mm" : "neon-dotprod";
  k.super_block_matmul = arm::QuantMatMulDotProd;
  k.super_block_name = "neon-dotprod";
  k.quant_exact = true;
}

// This CPU's best: VNNI (its preferred GEMV streams), AMX for prompts and AVX512-BF16 where
// present; on ARM sdot / usmmla where present; Highway's best target for the rest.
KernelTable Best() {
  KernelTable k = HighwayTable(detail::BestHwyTarget());
  k.name = "auto";
  if (arm::HasDotProd()) UseArmKernels(k, arm::HasI8mm());
  if (x86::HasVnni()) {
    const bool four = x86::PreferredGemvStreams() == x86::GemvStreams::kFour;
    k.quant_matmul = four ? QuantMatMulVnniFour : QuantMatMulVnniOne;
    k.quant_name = four ? "avx512-vnni-4streams" : "avx512-vnni";
    k.quant_exact = true;
  }
  if (x86::HasAmxInt8()) {
    k.quant_matmul_amx = x86::QuantMatMulAmx;
    k.amx_min_tokens_q8 = kAmxMinTokensQ8;
    k.amx_min_tokens_q4 = kAmxMinTokensQ4;
  }
  if (x86::HasAvx512Bf16()) {
    k.bf16_tiled_matmul = x86::Bf16TiledMatMulAvx512Bf16;
    k.bf16_name = "avx512-bf16";
  }
  return k;
}

KernelTable Reference() {
  KernelTable k;
  k.name = k.quant_name = k.super_block_name = k.bf16_name = k.target = "ref";
  k.quantize_activations = ref::QuantizeActivations;
  k.quant_matmul = k.super_block_matmul = ref::QuantMatMul;
  k.bf16_tiled_matmul = ref::Bf16TiledMatMul;
  k.matmul_f32 = ref::MatMulF32;
  return k;
}

}  // namespace

const char* KernelTable::QuantName(const WeightRef& w, size_t n_tok) const {
  if (IsSuperBlock(w.format)) return super_block_name.c_str();
  if (UsesAmx(w, n_tok)) return "amx-int8";
  if (quant_name == "avx512-vnni-4streams" && n_tok > x86::kFourStreamMaxTokens) return "avx512-vnni";
  return quant_name.c_str();
}

const KernelTable& BestKernels() {
  static const KernelTable best = Best();
  return best;
}

std::optional<KernelTable> KernelsNamed(std::string_view name) {
  if (name.empty() || name == "auto") return BestKernels();
  if (name == "ref") return Reference();
  KernelTable k = BestKernels();
  k.name = std::string(name);
  if ((name == "avx512-vnni" || name == "avx512-vnni-4streams") && x86::HasVnni()) {
    k.quant_matmul = name == "avx512-vnni" ? QuantMatMulVnniOne : QuantMatMulVnniFour;
    k.quant_name = k.name;
    k.quant_matmul_amx = nullptr;
    return k;
  }
  if (name == "avx512-bf16" && x86::HasAvx512Bf16()) return k;
  if ((name == "neon-dotprod" && arm::HasDotProd()) || (name == "neon-i8mm" && arm::HasI8mm())) {
    UseArmKernels(k, name == "neon-i8mm");
    return k;
  }
  if (name == "amx-int8" && x86::HasAmxInt8()) {
    k.amx_min_tokens_q8 = k.amx_min_tokens_q4 = 1;
    k.quant_name = "amx-int8";
    return k;
  }
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (name != HighwayKernelName(t)) continue;
    KernelTable h = HighwayTable(t);
    h.name = std::string(name);
    return h;
  }
  return std::nullopt;
}

std::vector<std::string> KernelNames() {
  std::vector<std::string> names = {"ref"};
  if (x86::HasVnni()) {
    names.push_back("avx512-vnni");
    names.push_back("avx512-vnni-4streams");
  }
  if (x86::HasAvx512Bf16()) names.push_back("avx512-bf16");
  if (x86::HasAmxInt8()) names.push_back("amx-int8");
  if (arm::HasDotProd()) names.push_back("neon-dotprod");
  if (arm::HasI8mm()) names.push_back("neon-i8mm");
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) names.push_back(HighwayKernelName(t));
  return names;
}

}  // namespace m3::simd
