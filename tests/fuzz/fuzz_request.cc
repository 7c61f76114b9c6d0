// An HTTP request body of /v1/chat/completions and /v1/completions (runtime/openai.h), as the
// server and m3 batch read it: guarded JSON, then every field checked.
#include "base/json_guard.h"
#include "runtime/openai.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto body = m3::ParseJson<m3::openai::ojson>(std::string_view(reinterpret_cast<const char*>(data), size), "body");
  if (!body.ok()) return 0;
  const m3::RequestDefaults defaults;
  (void)m3::openai::ParseChatRequest(*body, defaults);
  (void)m3::openai::ParseCompletionRequest(*body, defaults);
  return 0;
}
