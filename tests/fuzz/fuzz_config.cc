// config.json (model/config.h): any JSON, flat or VL-nested, every key checked.
#include <nlohmann/json.hpp>

#include "base/json_guard.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto j = m3::ParseJson<nlohmann::json>(std::string_view(reinterpret_cast<const char*>(data), size), "config.json");
  if (j.ok()) (void)m3::ParseModelConfig(*j);
  return 0;
}
