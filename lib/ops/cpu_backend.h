// The forward pass's steps (ops/backend.h) on the CPU, with the threaded operators of this layer:
// activations in the session's workspace, caches in host pages (KvCache). The MoE blocks run
// through the context's MoE runner when it has one (expert parallelism), else MoeForward here.
#pragma once

#include "ops/backend.h"

namespace m3 {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const PassShape& shape) : shape_(shape) {}
  StatusOr<std::unique_ptr<BackendPass>> BeginPass(const OpContext& tc,
                                                   std::span<const PassSegment> segments) override;

 private:
  PassShape shape_;
};

}  // namespace m3
