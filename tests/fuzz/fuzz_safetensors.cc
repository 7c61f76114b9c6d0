// A safetensors file: header length, JSON header, tensor offsets and dtypes (format/safetensors.h).
#include "format/safetensors.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = m3::fuzz::WriteInput("model.safetensors", data, size);
  auto file = m3::SafetensorsFile::Open(path);
  (void)file;
  return 0;
}
