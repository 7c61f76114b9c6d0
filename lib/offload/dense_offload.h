// The backend of `--gpu dense` (issue 34; ops/backend.h): the steps of the dense part of every
// pass (embedding rows aside, which are gathered on the host: a token reads one row) run on a
// Device: norms, attention and indexer projections, q/k norms and RoPE, the indexer's block
// scores, attention over caches in device memory, the output projection, the dense MLPs, the
// router's matmul, the shared expert, lm_head. The routed experts run on the CPU with its packed
// kernels, from the mapped file. The layer loop is the model's (model/forward.cc); what is this
// backend's own is where things live and how the two sides hand over:
//
// - Per MoE layer one handoff: the device sends the normed rows and the router logits, the CPU
//   chooses the experts (RouteToken, so ties and NaNs go exactly as on the CPU), queues the shared
//   expert on the device and runs the routed ones meanwhile, and sends their sum back, which the
//   next norm adds to the residual stream.
// - Per sparse layer the device sends the block scores and the CPU chooses the blocks with the
//   CPU's own SelectBlocksForQuery (the same selection bit for bit, and no second implementation).
// - Checks for NaN and inf run ahead on the device, folded into the norm that reads the checked
//   values anyway; the first one that failed is reported when the pass finishes.
// - One sequence's keys and values are written by the projections straight into its cache rows.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "offload/device.h"
#include "ops/backend.h"

namespace m3 {

// What the passes so far cost, for `m3 bench --gpu dense` (zeroed by Reset).
struct OffloadStats {
  uint64_t passes = 0, tokens = 0;
  double wall_seconds = 0;       // whole passes, on the host
  double device_seconds = 0;     // the device's work of the dense part (its marks), shared experts included
  double shared_seconds = 0;     // of which the shared experts
  double experts_seconds = 0;    // the CPU's routed experts
  double handoff_seconds = 0;    // the rest of the wall time: copies, waits and launches between the two sides
  double selection_seconds = 0;  // host block selection and its waits
  void Reset() { *this = {}; }
};

class DenseOffload final : public Backend {
 public:
  // An empty backend on `device` for passes of `shape`; the model uploads what its passes read
  // (Model::OffloadDensePart).
  DenseOffload(std::unique_ptr<Device> device, const PassShape& shape);
  ~DenseOffload() override;

  // Puts a matrix or a vector in device memory, found from now on by the host reference's
  // address (an empty vector or matrix: nothing). `what` names it in an allocation error.
  Status Upload(const std::string& what, const simd::WeightRef& w);
  Status Upload(const std::string& what, const std::vector<float>& v);
  // Returns once every upload has run.
  Status FinishUploads() { return device_->Wait(); }

  StatusOr<std::unique_ptr<BackendPass>> BeginPass(const OpContext& tc,
                                                   std::span<const PassSegment> segments) override;

  Device& device() { return *device_; }
  // The dense part in device memory: also what one pass reads there (every matrix once; the
  // embedding table stays on the host).
  uint64_t weight_bytes() const { return weight_bytes_; }
  OffloadStats& stats() { return stats_; }

 private:
  class Pass;
  struct Buffers;
  const DeviceMatrix& matrix(const simd::WeightRef& w) const { return matrices_.at(&w); }
  // A vector's device copy; null for an empty one (no per-head norm).
  const float* vector(const std::vector<float>& v) const;
  Status EnsureBuffers(size_t rows, size_t score_floats);
  StatusOr<float*> Slot(size_t slot, size_t floats);  // the model's activation slots

  std::unique_ptr<Device> device_;
  PassShape shape_;
  std::unordered_map<const simd::WeightRef*, DeviceMatrix> matrices_;
  std::unordered_map<const std::vector<float>*, float*> vectors_;
  std::vector<void*> owned_;  // device allocations of the weights
  uint64_t weight_bytes_ = 0;
  std::unique_ptr<Buffers> buf_;
  OffloadStats stats_;
  std::mutex pass_;  // one pass at a time: the buffers and the device's stream are shared
};

}  // namespace m3
