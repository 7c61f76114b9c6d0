// Internal to m3_simd: the entry of a HWY_EXPORT table for one Highway target, so a kernel table
// can hold the function a target runs without touching Highway's process-wide choice.
#pragma once

#include <cstdint>

#include "hwy/highway.h"

namespace m3::simd::detail {

// `target` is one bit of hwy::SupportedAndGeneratedTargets(); `table` is HWY_DISPATCH_TABLE(f) of
// the calling translation unit (whose HWY_TARGETS it must be compiled with).
template <class Fn>
Fn HwyEntryFor(Fn const* table, int64_t target) {
  int64_t mask = HWY_CHOSEN_TARGET_SHIFT(target);
  if (mask == 0) mask = HWY_CHOSEN_TARGET_MASK_SCALAR;  // HWY_EMU128 / HWY_SCALAR: the last entry
  return table[hwy::Num0BitsBelowLS1Bit_Nonzero64(static_cast<uint64_t>(mask & HWY_CHOSEN_TARGET_MASK_TARGETS))];
}

// The Highway target dispatch picks on this CPU among those compiled (lowest set bit is best).
inline int64_t BestHwyTarget() {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return targets & -targets;
}

}  // namespace m3::simd::detail
