// What every threaded operator runs with: the threads, the kernels chosen once when the engine
// opened, and the caller's workspace. Passed down from the session through the forward pass;
// nothing an operator does depends on state it cannot see here or in its arguments.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "platform/parallel.h"

namespace m3 {
namespace simd {
struct KernelTable;  // simd/kernel_table.h (only ops sees the kernels)
}  // namespace simd

class Workspace;  // ops/workspace.h
class MoeRunner;  // ops/moe.h

// The kernels an engine runs with (simd::KernelTable), chosen once.
class Kernels {
 public:
  Kernels();  // this CPU's best
  // "" or "auto": this CPU's best; otherwise one of Names() (tests and benchmarks compare them).
  static StatusOr<Kernels> Select(const std::string& name);
  static std::vector<std::string> Names();  // every implementation this CPU runs, "ref" first
  const simd::KernelTable& table() const { return *table_; }
  // E.g. "auto: q8/q4 avx512-vnni, bf16 avx512-bf16, fp32 AVX3_ZEN4" (m3 inspect, bench reports).
  std::string Describe() const;
  // The Highway target of the fp32 kernels (e.g. "AVX3_ZEN4").
  const std::string& target() const;
  // The q8/q4 matmul implementation (e.g. "avx512-vnni").
  const std::string& quant_name() const;

 private:
  std::shared_ptr<const simd::KernelTable> table_;
};

// Threads, kernels and workspace of one operator call. Converts from a ThreadConfig (the best
// kernels, and scratch of the call's own: what tests and one-off callers want).
struct OpContext : ThreadConfig {
  OpContext(ThreadConfig tc = {}, const Kernels* k = nullptr, Workspace* ws = nullptr)  // NOLINT: implicit
      : ThreadConfig(tc), kernels(k), workspace(ws) {}
  const Kernels* kernels;  // null: this CPU's best
  Workspace* workspace;    // null: the operator allocates what it needs for the call
  // The MoE blocks of a pass run through it when set (expert parallelism); null: MoeForward here.
  const MoeRunner* moe_runner = nullptr;
  const simd::KernelTable& table() const;
};

}  // namespace m3
