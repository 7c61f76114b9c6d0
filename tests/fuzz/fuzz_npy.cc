// An npy file (format/npy.h): magic, version, header dict, shape, payload size.
#include "format/npy.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)m3::ReadNpy(m3::fuzz::WriteInput("a.npy", data, size));
  return 0;
}
