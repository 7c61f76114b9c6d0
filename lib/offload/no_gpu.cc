#include "offload/device.h"
#include "offload/gpu.h"

namespace m3 {

const char* GpuBackendName() { return ""; }

namespace {

Status NoCuda() {
  return Unsupported(
      "this build of m3 has no CUDA: configure with -DM3_CUDA=ON on a machine with the CUDA "
      "toolkit to use a GPU");
}

}  // namespace

StatusOr<GpuInfo> QueryGpu(int) { return NoCuda(); }

StatusOr<std::unique_ptr<Device>> OpenGpuDevice(int) { return NoCuda(); }

}  // namespace m3
