// The Device interface (device.h) in plain C++ on the host: every operation as the scalar
// definition the GPU kernels are tested against (threads over independent rows only, so results
// never depend on the thread count), and a way to run the offloaded forward pass, handoffs and
// all, on a machine without a GPU (`--gpu dense --gpu-device host`: tests, not speed).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "offload/device.h"

namespace m3 {

std::unique_ptr<Device> MakeHostDevice();

}  // namespace m3
