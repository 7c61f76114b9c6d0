// lib/offload/gpu.h on CUDA: the only translation unit of m3 that includes CUDA headers.
#include <cuda_runtime.h>

#include "offload/gpu.h"

namespace m3 {

const char* GpuBackendName() { return "cuda"; }

StatusOr<GpuInfo> QueryGpu(int device) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess)
    return NotFound("no usable CUDA device: ", cudaGetErrorString(e));
  if (device < 0 || device >= count)
    return InvalidArgument("GPU ", device, " does not exist (this machine has ", count, ")");
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess)
    return Internal("GPU ", device, ": ", cudaGetErrorString(e));
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return Internal("GPU ", device, ": ", cudaGetErrorString(e));
  size_t free_bytes = 0, total_bytes = 0;
  if (const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes); e != cudaSuccess)
    return Internal("GPU ", device, ": ", cudaGetErrorString(e));
  GpuInfo info;
  info.name = prop.name;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.total_bytes = total_bytes;
  info.free_bytes = free_bytes;
  return info;
}

}  // namespace m3
