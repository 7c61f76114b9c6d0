// The GPU an offload backend would run on (issue 34: the dense part of the model on one GPU, the
// routed experts on the CPU). The only interface the rest of the engine sees; lib/offload/cuda
// implements it where the build has CUDA (M3_CUDA), lib/offload/no_gpu.cc everywhere else.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace m3 {

struct GpuInfo {
  std::string name;       // e.g. "NVIDIA H100 80GB HBM3"
  int compute_major = 0;  // compute capability
  int compute_minor = 0;
  uint64_t total_bytes = 0;  // device memory
  uint64_t free_bytes = 0;   // free now
};

// Whether this build has a GPU backend ("cuda") or none ("").
const char* GpuBackendName();
// The GPU `device` (0 = the first). Unsupported in a build without CUDA; NotFound (with the
// runtime's reason) where the build has CUDA but the machine has no usable device or driver.
StatusOr<GpuInfo> QueryGpu(int device);

}  // namespace m3
