// Any text through the JSON guard and parser (base/json_guard.h), then the copies and dumps that
// recursed to a crash before the guard: a value that parses is copied, compared and dumped.
#include <nlohmann/json.hpp>

#include "base/json_guard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto j = m3::ParseJson<nlohmann::ordered_json>(text, "input");
  if (!j.ok()) return 0;
  const nlohmann::ordered_json copy = *j;
  if (!(copy == *j)) __builtin_trap();
  (void)copy.dump();
  return 0;
}
