// The model's forward pass with its dense part on a Device (issue 34, `--gpu dense`): the
// embedding row, norms, attention and indexer projections, q/k norms and RoPE, the indexer's
// block scores, sparse or dense attention over caches in device memory, the output projection,
// the dense MLPs, the router's matmul, the shared expert and the final norm + lm_head run on the
// device; the routed experts run on the CPU with its packed kernels, from the mapped file.
//
// Per MoE layer one handoff: the device sends the normed hidden state and the router logits,
// the CPU chooses the experts (RouteToken, so ties and NaNs go exactly as on the CPU), queues the
// shared expert on the device and runs the routed ones meanwhile, and sends their sum back. Per
// sparse layer the device sends the block scores and the CPU chooses the blocks with the CPU's
// own SelectBlocksForQuery (the same selection bit for bit, and no second implementation of it).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "base/status.h"
#include "model/model.h"
#include "offload/device.h"
#include "ops/context.h"

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

class DenseOffload {
 public:
  // Uploads the dense part of `model` to `device` (refused with what it needs when it does not
  // fit beside caches for `context` tokens of `cache` types). The model must outlive this.
  static StatusOr<std::unique_ptr<DenseOffload>> Open(const Model& model, std::unique_ptr<Device> device,
                                                      uint64_t context);
  ~DenseOffload();

  // Model::ForwardBatch with the dense part on the device (same contract; the caches' rows live
  // in device memory, attached to each KvCache).
  Status Forward(const OpContext& tc, std::span<const Model::Segment> segments, LogitsMode mode, float* logits,
                 ForwardObserver* observer);

  Device& device() { return *device_; }
  // The dense part in device memory: also what one pass reads there (every matrix once; the
  // embedding table stays on the host).
  uint64_t weight_bytes() const { return weight_bytes_; }
  OffloadStats& stats() { return stats_; }

 private:
  struct Layer;
  struct Buffers;
  DenseOffload() = default;
  Status Upload(const std::string& what, const simd::WeightRef& w, DeviceMatrix* m);
  Status UploadVector(const std::string& what, const std::vector<float>& v, float** out);
  Status EnsureBuffers(size_t rows, size_t logit_rows, size_t score_floats);
  void RunMlp(const Layer& L, size_t n);

  const Model* model_ = nullptr;
  std::unique_ptr<Device> device_;
  std::vector<Layer> layers_;
  DeviceMatrix lm_head_;
  float* final_norm_ = nullptr;
  std::vector<void*> owned_;  // device allocations of the weights
  uint64_t weight_bytes_ = 0;
  std::unique_ptr<Buffers> buf_;
  OffloadStats stats_;
  std::mutex pass_;  // one pass at a time: the buffers and the device's stream are shared
};

}  // namespace m3
