#include "bench/constrain_bench.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/limits.h"
#include "constrain/constrain.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

#include "m3_commit.h"  // M3_COMMIT, written at build time

namespace m3::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// An agent's tool arguments: what a coding or search agent sends.
const char* kAgentSchema = R"({
  "type": "object",
  "properties": {
    "tool": {"type": "string", "enum": ["search", "read_file", "write_file", "run_command"]},
    "arguments": {
      "type": "object",
      "properties": {
        "query": {"type": "string"},
        "path": {"type": "string", "maxLength": 120},
        "content": {"type": "string"},
        "options": {
          "type": "object",
          "properties": {
            "recursive": {"type": "boolean"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 100},
            "timeout_s": {"type": "number", "minimum": 0, "maximum": 600},
            "mode": {"type": "string", "enum": ["fast", "thorough"]}
          },
          "required": ["recursive"],
          "additionalProperties": false
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8}
      },
      "required": ["path", "options"],
      "additionalProperties": false
    },
    "reason": {"type": "string"}
  },
  "required": ["tool", "arguments", "reason"],
  "additionalProperties": false
})";

struct Summary {
  size_t n = 0;
  double mean = 0, p50 = 0, p99 = 0, max = 0;
};

Summary Summarize(std::vector<double> us) {
  Summary s;
  s.n = us.size();
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double x : us) sum += x;
  s.mean = sum / double(us.size());
  s.p50 = us[us.size() / 2];
  s.p99 = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  s.max = us.back();
  return s;
}

struct GrammarResult {
  std::string name;
  double compile_ms = 0;
  Summary cold, shared, cached, all, accept;
  Summary first_all;  // the first walk alone: a request on a grammar no request has used yet
  size_t walks_done = 0, walks = 0;
};

bool Walks(const std::string& name, const std::shared_ptr<const constrain::Grammar>& g,
           const std::shared_ptr<const constrain::VocabIndex>& vocab, int32_t end_id, const ConstrainBenchOptions& o,
           GrammarResult& r, FILE* log) {
  std::vector<double> cold, shared, cached, all, accept, first_all;
  r.name = name;
  for (int w = 0; w < o.walks; ++w) {
    constrain::Matcher m(g, vocab, {end_id});
    std::mt19937 rng(static_cast<uint32_t>(w + 1));
    std::vector<uint64_t> mask(m.mask_words());
    std::vector<int32_t> allowed;
    ++r.walks;
    for (size_t left = o.budget; left > 0 && !m.done(); --left) {
      const constrain::Matcher::Stats before = m.stats();
      const auto t0 = Clock::now();
      m.FillMask(mask, left);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      const constrain::Matcher::Stats after = m.stats();
      (after.trie_walks > before.trie_walks ? cold : after.shared > before.shared ? shared : cached).push_back(us);
      all.push_back(us);
      if (w == 0) first_all.push_back(us);
      allowed.clear();
      for (size_t i = 0; i < mask.size(); ++i) {
        for (uint64_t bits = mask[i]; bits; bits &= bits - 1) allowed.push_back(int32_t(i * 64 + __builtin_ctzll(bits)));
      }
      if (allowed.empty()) {
        std::fprintf(log, "m3 bench --constrain: %s: an empty mask\n", name.c_str());
        return false;
      }
      const int32_t id = allowed[rng() % allowed.size()];
      const auto t1 = Clock::now();
      const bool ok = m.Accept(id);
      accept.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t1).count());
      if (!ok) {
        std::fprintf(log, "m3 bench --constrain: %s: an allowed token was refused\n", name.c_str());
        return false;
      }
    }
    r.walks_done += m.done();
  }
  r.cold = Summarize(cold);
  r.shared = Summarize(shared);
  r.first_all = Summarize(first_all);
  r.cached = Summarize(cached);
  r.all = Summarize(all);
  r.accept = Summarize(accept);
  return true;
}

json SummaryJson(const Summary& s) {
  return {{"n", s.n}, {"mean_us", s.mean}, {"p50_us", s.p50}, {"p99_us", s.p99}, {"max_us", s.max}};
}

// Median milliseconds of single-token decode steps of `model_dir` after a short prompt, and its
// layer and thread counts; -1 with a message on `log` when the model does not open.
double DecodeStepMs(const ConstrainBenchOptions& o, int* layers, int* threads, FILE* log) {
  auto engine = Engine::Open(o.model_dir, o.engine);
  if (!engine.ok()) {
    std::fprintf(log, "m3 bench --constrain: %s\n", engine.status().message().c_str());
    return -1;
  }
  *layers = (*engine)->model().config().num_layers;
  *threads = (*engine)->threads().threads;
  Session session(**engine, SessionOptions{});
  std::vector<float> logits;
  std::vector<int32_t> prompt(16);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(1000 + 37 * i);
  if (Status st = session.Eval(prompt, LogitsMode::kLastRow, &logits); !st.ok()) {
    std::fprintf(log, "m3 bench --constrain: %s\n", st.message().c_str());
    return -1;
  }
  // 48 steps, the first 32 untimed: they page in the experts a step may route to (a server's
  // weights are resident).
  std::vector<double> ms;
  for (int step = 0; step < 48; ++step) {
    const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const auto t = Clock::now();
    if (!session.Eval(std::span<const int32_t>(&next, 1), LogitsMode::kLastRow, &logits).ok()) return -1;
    if (step >= 32) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int RunConstrainBench(const ConstrainBenchOptions& o, FILE* out, FILE* log) {
  auto tokenizer = Tokenizer::Load(o.tokenizer);
  if (!tokenizer.ok()) {
    std::fprintf(log, "m3 bench --constrain: %s\n", tokenizer.status().message().c_str());
    return 1;
  }
  const Tokenizer& tok = **tokenizer;
  const int32_t end_id = tok.TokenId("[e~[");
  if (end_id < 0) {
    std::fprintf(log, "m3 bench --constrain: the tokenizer has no [e~[ token (not MiniMax-M3's)\n");
    return 1;
  }
  auto t0 = Clock::now();
  auto vocab = constrain::VocabIndex::Build(tok);
  const double build_s = std::chrono::duration<double>(Clock::now() - t0).count();

  const json schema = json::parse(kAgentSchema);
  std::vector<GrammarResult> results;
  // Times the compile, then the walks over the grammar; false (with a message) when either fails.
  auto measure = [&](const char* name, auto compile) {
    t0 = Clock::now();
    StatusOr<std::shared_ptr<const constrain::Grammar>> g = compile();
    GrammarResult r;
    r.compile_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (!g.ok()) {
      std::fprintf(log, "m3 bench --constrain: %s\n", g.status().message().c_str());
      return false;
    }
    if (!Walks(name, *g, vocab, end_id, o, r, log)) return false;
    results.push_back(r);
    return true;
  };
  if (!measure("json_schema", [&] { return constrain::CompileJsonSchema(schema); })) return 1;
  auto tokens = constrain::MarkupTokens::From(tok);
  if (!tokens.ok()) {
    std::fprintf(log, "m3 bench --constrain: %s\n", tokens.status().message().c_str());
    return 1;
  }
  const std::vector<constrain::ToolSpec> tools = {{"agent_step", schema["properties"]["arguments"]},
                                                  {"finish", json::parse(R"({"type":"object","properties":{
                                                      "answer":{"type":"string"}},"required":["answer"]})")}};
  if (!measure("tool_calls", [&] { return constrain::CompileToolCalls(tools, *tokens); })) return 1;

  // The masks against a decode step of a real model (-m), as the server pays both per token.
  // A model of fewer layers than the 60 of MiniMax-M3 has a shorter step: the share is an upper
  // bound of the full model's.
  double step_ms = -1;
  int layers = 0, threads = 0;
  if (!o.model_dir.empty()) {
    step_ms = DecodeStepMs(o, &layers, &threads, log);
    if (step_ms < 0) return 1;
  }
  const std::string cpu = CpuModel();
  if (o.json) {
    for (const GrammarResult& r : results) {
      const json line = {{"bench", "constrain"}, {"grammar", r.name}, {"cpu", cpu}, {"commit", M3_COMMIT},
                         {"threads", 1}, {"vocab_size", vocab->vocab_size()}, {"trie_nodes", vocab->trie_nodes()},
                         {"vocab_build_s", build_s}, {"compile_ms", r.compile_ms}, {"walks", r.walks},
                         {"walks_done", r.walks_done}, {"budget", o.budget}, {"cold", SummaryJson(r.cold)}, {"shared", SummaryJson(r.shared)}, {"first_walk", SummaryJson(r.first_all)},
                         {"cached", SummaryJson(r.cached)}, {"all", SummaryJson(r.all)},
                         {"accept", SummaryJson(r.accept)}};
      json with_step = line;
      if (step_ms >= 0)
        with_step.update({{"decode_step_ms", step_ms}, {"decode_layers", layers}, {"decode_threads", threads},
                          {"mask_mean_share_of_step", r.all.mean / 1000.0 / step_ms}});
      std::fprintf(out, "%s\n", with_step.dump().c_str());
    }
    return 0;
  }
  std::fprintf(out,
               "m3 bench --constrain\ncpu %s | commit %s | 1 thread | vocabulary %zu tokens, trie %zu nodes, "
               "built in %.3f s\n",
               cpu.c_str(), M3_COMMIT, vocab->vocab_size(), vocab->trie_nodes(), build_s);
  std::fprintf(out, "%zu random walks per grammar, budget %zu tokens; FillMask times in microseconds\n\n",
               static_cast<size_t>(o.walks), o.budget);
  std::fprintf(out, "%-12s %9s %-7s %7s %9s %9s %9s %9s\n", "grammar", "compile", "masks", "n", "mean", "p50", "p99",
               "max");
  for (const GrammarResult& r : results) {
    const std::pair<const char*, const Summary*> rows[] = {
        {"cold", &r.cold}, {"shared", &r.shared}, {"cached", &r.cached}, {"all", &r.all}, {"1st walk", &r.first_all},
        {"accept", &r.accept}};
    bool first = true;
    for (auto [label, s] : rows) {
      char compile[32] = "";
      if (first) std::snprintf(compile, sizeof compile, "%.1f ms", r.compile_ms);
      std::fprintf(out, "%-12s %9s %-7s %7zu %9.1f %9.1f %9.1f %9.1f\n", first ? r.name.c_str() : "", compile, label,
                   s->n, s->mean, s->p50, s->p99, s->max);
      first = false;
    }
    std::fprintf(out, "%-12s %zu of %zu walks completed within the budget\n", "", r.walks_done, r.walks);
  }
  if (step_ms >= 0) {
    std::fprintf(out, "\ndecode step of %s: %.2f ms median (%d layers, %d threads; the 60-layer model's is longer)\n",
                 o.model_dir.c_str(), step_ms, layers, threads);
    for (const GrammarResult& r : results)
      std::fprintf(out, "%-12s mask per token: mean %.1f us = %.3f%% of that step, p99 %.1f us = %.2f%%\n",
                   r.name.c_str(), r.all.mean, 100.0 * r.all.mean / 1000.0 / step_ms, r.all.p99,
                   100.0 * r.all.p99 / 1000.0 / step_ms);
  }
  return 0;
}

}  // namespace m3::bench
