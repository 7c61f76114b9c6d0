// Scratch memory operators and the forward pass reuse from call to call, owned by a session (as
// gemma.cpp's Activations) and passed down in the OpContext: one pass at a time. Buffers only
// grow (a 2048-token pass's take ~0.75 GB at M3's shapes; fresh ones would cost page faults and
// zeroing at every layer); every user writes a buffer before it reads it.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "base/aligned_buffer.h"

namespace m3 {
namespace simd {
class KernelScratch;  // simd/quant_kernels.h (only ops sees the kernels)
}  // namespace simd

struct MatMulScratch;  // ops/matmul.cc
struct MoeScratch;     // ops/moe.cc

class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Per worker thread, indexed by the thread index of ParallelFor / ParallelRegion.
  struct PerThread {
    PerThread();
    ~PerThread();
    PerThread(PerThread&&) noexcept;
    PerThread& operator=(PerThread&&) noexcept;
    AlignedBuffer<float> decoded;  // MatMulInput::Multiply: one row tile decoded to fp32
    std::vector<int32_t> order;    // SelectBlocks: one query's block order
    // MatMulInput::Multiply: the matmul kernels' working memory (activation tables, packed tiles).
    std::unique_ptr<simd::KernelScratch> kernels;
  };
  // Makes thread slots [0, threads) exist; called before a parallel region, never inside one.
  void ReserveThreads(int threads);
  PerThread& thread(int index) { return per_thread_[static_cast<size_t>(index)]; }

  // The caller's part (the thread that runs the pass).
  MatMulScratch& matmul() { return *matmul_; }
  MoeScratch& moe() { return *moe_; }
  // Numbered fp32 buffers of at least n values for the layer above (the forward pass's
  // activations: residual stream, normed input, q, k, v, ...).
  float* Floats(size_t slot, size_t n);

 private:
  std::vector<PerThread> per_thread_;
  std::unique_ptr<MatMulScratch> matmul_;
  std::unique_ptr<MoeScratch> moe_;
  std::vector<AlignedBuffer<float>> floats_;
};

// The caller's workspace, or one of the call's own when it brought none (tests, one-off calls).
class ScopedWorkspace {
 public:
  explicit ScopedWorkspace(Workspace* given) : ws_(given ? given : (own_ = std::make_unique<Workspace>()).get()) {}
  Workspace& operator*() const { return *ws_; }
  Workspace* operator->() const { return ws_; }
  Workspace* get() const { return ws_; }

 private:
  std::unique_ptr<Workspace> own_;
  Workspace* ws_;
};

}  // namespace m3
