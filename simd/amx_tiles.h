// Intel AMX tile registers, shared by the AMX kernels (quant_kernels_amx.cc) and the peak probe
// (bench/peak_probe.cc): the tile configuration and one macro per instruction. x86-64 GCC/Clang
// only; include it under that guard.
#ifndef M3_SIMD_AMX_TILES_H_
#define M3_SIMD_AMX_TILES_H_

#include <cstdint>

// One instruction each, by register number. GCC 12's AMX intrinsics are asm statements
// without memory clobbers (a load of stored tile data could move above the store) that also
// need the amx target enabled for the whole function; these need only the assembler.
#define M3_TILE_LOAD(tmm, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define M3_TILE_STORE(tmm, base, stride) \
  asm volatile("tilestored %%tmm" #tmm ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define M3_TILE_ZERO(tmm) asm volatile("tilezero %%tmm" #tmm ::)
// C += A (s8 activations) . B (u8 weight codes), AT&T operand order.
#define M3_TILE_DPBSUD(c, a, b) asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
// C += A (s8 activations) . B (s8 weight codes).
#define M3_TILE_DPBSSD(c, a, b) asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define M3_TILE_RELEASE() asm volatile("tilerelease" ::)

namespace m3::simd::x86 {

// The ldtilecfg operand (palette 1): each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void LoadTileConfig(const TileConfig& cfg) { asm volatile("ldtilecfg %0" ::"m"(cfg)); }

// Tiles 0-7 each 16 rows of 64 bytes: a tdpbsud makes 16 x 16 sums of 64 products.
inline void LoadFullTileConfig() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  LoadTileConfig(cfg);
}

}  // namespace m3::simd::x86

#endif  // M3_SIMD_AMX_TILES_H_
