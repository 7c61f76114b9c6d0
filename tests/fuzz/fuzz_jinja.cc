// The Jinja engine (text/jinja.h): template text, then (after a NUL) JSON render data as the
// template's variables; parse and render errors are statuses, never crashes or hangs.
#include <map>
#include <nlohmann/json.hpp>

#include "base/json_guard.h"
#include "fuzz_util.h"
#include "text/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [source, json_text] = m3::fuzz::SplitAtNul(data, size);
  auto tmpl = m3::jinja::Template::Parse(source);
  if (!tmpl.ok()) return 0;
  std::map<std::string, m3::jinja::Value> globals;
  auto j = m3::ParseJson<nlohmann::ordered_json>(json_text, "data");
  if (j.ok() && j->is_object())
    for (auto it = j->begin(); it != j->end(); ++it) globals[it.key()] = m3::jinja::Value::FromJson(it.value());
  (void)tmpl->Render(globals);
  return 0;
}
