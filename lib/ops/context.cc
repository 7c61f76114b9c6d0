#include "ops/context.h"

#include "ops/scratch.h"
#include "ops/workspace.h"
#include "simd/kernel_table.h"
#include "simd/quant_kernels.h"

namespace m3 {

Kernels::Kernels() : table_(std::shared_ptr<const simd::KernelTable>(), &simd::BestKernels()) {}

StatusOr<Kernels> Kernels::Select(const std::string& name) {
  auto table = simd::KernelsNamed(name);
  if (!table) {
    std::string names;
    for (const std::string& n : Names()) names += (names.empty() ? "" : ", ") + n;
    return InvalidArgument("unknown kernels '", name, "' (this CPU runs: auto, ", names, ")");
  }
  Kernels k;
  k.table_ = std::make_shared<const simd::KernelTable>(std::move(*table));
  return k;
}

std::vector<std::string> Kernels::Names() { return simd::KernelNames(); }

std::string Kernels::Describe() const {
  return table_->name + ": q8/q4 " + table_->quant_name + (table_->quant_matmul_amx ? " (amx-int8 prompts)" : "") +
         ", q3/q2 " + table_->super_block_name + ", bf16 " + table_->bf16_name + ", fp32 " + table_->target;
}

const std::string& Kernels::target() const { return table_->target; }
const std::string& Kernels::quant_name() const { return table_->quant_name; }

const simd::KernelTable& OpContext::table() const {
  return kernels ? kernels->table() : simd::BestKernels();
}

Workspace::PerThread::PerThread() : kernels(std::make_unique<simd::KernelScratch>()) {}
Workspace::PerThread::~PerThread() = default;
Workspace::PerThread::PerThread(PerThread&&) noexcept = default;
Workspace::PerThread& Workspace::PerThread::operator=(PerThread&&) noexcept = default;

Workspace::Workspace() : matmul_(std::make_unique<MatMulScratch>()), moe_(std::make_unique<MoeScratch>()) {}
Workspace::~Workspace() = default;

void Workspace::ReserveThreads(int threads) {
  if (per_thread_.size() < static_cast<size_t>(threads)) per_thread_.resize(static_cast<size_t>(threads));
}

float* Workspace::Floats(size_t slot, size_t n) {
  if (floats_.size() <= slot) floats_.resize(slot + 1);
  floats_[slot].EnsureSize(n);
  return floats_[slot].data();
}

}  // namespace m3
