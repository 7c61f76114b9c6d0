// The real MiniMax-M3 tokenizer (loaded once): any bytes encoded (invalid UTF-8 included), and
// any ids decoded, whole and streamed, with and without special tokens.
#include <cstring>
#include <memory>
#include <vector>

#include "text/tokenizer.h"

namespace {
const m3::Tokenizer& TheTokenizer() {
  static const std::unique_ptr<m3::Tokenizer> t = [] {
    auto loaded = m3::Tokenizer::Load(M3_FUZZ_TOKENIZER_DIR);
    if (!loaded.ok()) __builtin_trap();
    return std::move(loaded).value();
  }();
  return *t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const m3::Tokenizer& tok = TheTokenizer();
  (void)tok.Encode(std::string_view(reinterpret_cast<const char*>(data), size));
  std::vector<int32_t> ids(size / 4);
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
  for (const bool skip : {false, true}) {
    const std::string whole = tok.Decode(ids, skip);
    m3::StreamingDecoder stream(tok, skip);
    std::string pieces;
    for (const int32_t id : ids) pieces += stream.Push(id);
    pieces += stream.Flush();
    if (pieces != whole) __builtin_trap();  // the streaming decoder's contract
  }
  return 0;
}
