// The output parser (text/output_parser.h): model text with reasoning and tool-call markup,
// parsed whole and streamed in pieces cut at every 1-7 bytes, whose deltas must add up to the
// whole parse (its documented contract).
#include <nlohmann/json.hpp>

#include "text/output_parser.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const m3::ThinkState initial = data[0] & 1 ? m3::ThinkState::kInside : m3::ThinkState::kOutside;
  const nlohmann::json tools = nlohmann::json::parse(
      R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{
         "city":{"type":"string"},"days":{"type":"integer"},"hourly":{"type":"boolean"},
         "tags":{"type":"array"},"opts":{"type":"object"}}}}}])");
  const m3::ParsedOutput whole = m3::ParseOutput(text, initial, tools);
  m3::StreamingOutputParser stream(initial, tools);
  std::string reasoning, content;
  size_t calls = 0;
  const size_t step = 1 + (data[0] >> 1) % 7;
  auto add = [&](const m3::StreamingOutputParser::Delta& d) {
    reasoning += d.reasoning;
    content += d.content;
    calls += d.tool_calls.size();
  };
  for (size_t i = 0; i < text.size(); i += step) add(stream.Push(text.substr(i, step)));
  add(stream.Finish());
  if (reasoning != whole.reasoning || content != whole.content || calls != whole.tool_calls.size()) __builtin_trap();
  return 0;
}
