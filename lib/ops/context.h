// What every threaded operator runs with: the threads, the kernels chosen once when the engine
// opened, and the caller's workspace. Passed down from the session through the forward pass;
// nothing an operator does depends on state it cannot see here or in its arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "platform/parallel.h"

namespace m3 {
namespace simd {
struct KernelTable;  // simd/kernel_table.h (only ops sees the kernels)
struct WeightRef;    // simd/weight_format.h
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

// Sees the fp32 input of every matmul an operator runs (m3 imatrix collects their mean squares):
// called on the operator's calling thread, outside its parallel regions, once the matmul is done.
// Row i of the input is x + (rows ? rows[i] : i) * ldx, i < n, of w.cols values each.
class MatMulObserver {
 public:
  virtual ~MatMulObserver() = default;
  virtual void OnMatMulInput(const simd::WeightRef& w, const float* x, size_t ldx, size_t n, const uint32_t* rows) = 0;
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
  // Sees every matmul's input when set (MatMul, MatMulSameInput, MlpForward, MoeForward; not the
  // expert-parallel exchanges of MoePartForward).
  MatMulObserver* matmul_observer = nullptr;
  const simd::KernelTable& table() const;
};

}  // namespace m3
