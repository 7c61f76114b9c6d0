// The GPU query (offload/gpu.h) on whatever machine runs the tests: a build without CUDA says so,
// a CUDA build without a usable device says why, and a device is described sanely.
#include <string>

#include <catch2/catch.hpp>

#include "offload/gpu.h"

namespace m3 {
namespace {

TEST_CASE("the GPU query says what it found, or why there is none", "[offload]") {
  const StatusOr<GpuInfo> gpu = QueryGpu(0);
  if (std::string(GpuBackendName()).empty()) {
    REQUIRE(!gpu.ok());
    CHECK(gpu.status().code() == StatusCode::kUnsupported);
    CHECK_THAT(gpu.status().message(), Catch::StartsWith("this build of m3 has no CUDA"));
    return;
  }
  CHECK(std::string(GpuBackendName()) == "cuda");
  if (!gpu.ok()) {  // no device or driver here: a reason, not a crash
    CHECK(gpu.status().code() == StatusCode::kNotFound);
    CHECK_THAT(gpu.status().message(), Catch::StartsWith("no usable CUDA device: "));
    WARN("CUDA build without a usable device: " << gpu.status().message());
    return;
  }
  CHECK(!gpu->name.empty());
  CHECK(gpu->compute_major > 0);
  CHECK(gpu->total_bytes > 0);
  CHECK(gpu->free_bytes <= gpu->total_bytes);
  CHECK(QueryGpu(-1).status().code() == StatusCode::kInvalidArgument);
  CHECK(QueryGpu(1 << 20).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace m3
