#include "offload/gpu.h"

namespace m3 {

const char* GpuBackendName() { return ""; }

StatusOr<GpuInfo> QueryGpu(int) {
  return Unsupported("this build of m3 has no CUDA: configure with -DM3_CUDA=ON on a machine with the CUDA "
                     "toolkit to use a GPU");
}

}  // namespace m3
