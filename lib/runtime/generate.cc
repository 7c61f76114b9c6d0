#include "runtime/generate.h"

#include <algorithm>
#include <chrono>

namespace m3 {

double GenerateStats::prefill_tok_s() const {
  return prefill_seconds > 0 ? (prompt_tokens - reused_tokens) / prefill_seconds : 0;
}
double GenerateStats::decode_tok_s() const {
  return decode_seconds > 0 && generated_tokens > 1 ? (generated_tokens - 1) / decode_seconds : 0;
}

Status Generate(Session& session, std::span<const int32_t> prompt, const GenerateOptions& options, Sampler& sampler,
                const std::function<bool(int32_t)>& on_token, GenerateStats* stats) {
  using Clock = std::chrono::steady_clock;
  if (prompt.empty()) return InvalidArgument("empty prompt");
  if (options.max_tokens < 0) return InvalidArgument("max_tokens must be >= 0, got ", options.max_tokens);
  GenerateStats st;
  st.prompt_tokens = prompt.size();
  if (prompt.size() > session.max_context())
    return OutOfRange("the prompt has ", prompt.size(), " tokens but the context limit is ", session.max_context());
  st.reused_tokens = session.ReusePrefix(prompt);

  const auto t0 = Clock::now();
  std::vector<float> logits;
  M3_RETURN_IF_ERROR(session.Eval(prompt.subspan(st.reused_tokens), LogitsMode::kLastRow, &logits));
  const auto t1 = Clock::now();
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  st.stop_reason = "length";
  for (int i = 0; i < options.max_tokens; ++i) {
    const int32_t id = sampler.Sample(logits, session.tokens());
    ++st.generated_tokens;
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), id) != options.stop_ids.end()) {
      st.stop_reason = "stop";
      break;
    }
    if (!on_token(id)) {
      st.stop_reason = "caller";
      break;
    }
    if (i + 1 == options.max_tokens) break;
    if (session.position() + 1 > session.max_context()) {
      st.stop_reason = "context";
      break;
    }
    M3_RETURN_IF_ERROR(session.Eval({&id, 1}, LogitsMode::kLastRow, &logits));
  }
  st.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  if (stats) *stats = st;
  return Status::Ok();
}

}  // namespace m3
