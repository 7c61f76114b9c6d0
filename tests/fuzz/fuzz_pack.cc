// A packed model file (format/pack_file.h): the versioned header, the directory's hash and JSON,
// every tensor's and expert's range.
#include "format/pack_file.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)m3::PackFile::Open(m3::fuzz::WriteInput("model.m3w", data, size));
  return 0;
}
