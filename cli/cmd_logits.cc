// m3 logits -m DIR --ids LIST [-n N] -o OUT [--dump-blocks] [--lookup K] [engine options]
// One prefill of the prompt (one Session::Eval: forward passes of --prefill-chunk tokens), then N
// greedy steps through the cache (a Generation: with --lookup, guesses verified in the step's
// pass, so the oracle judges those rows too). Writes the files of
// tests/data/golden: prefill_logits.npy [T, vocab], decode_logits.npy [N, vocab], greedy_ids.json
// and, with --dump-blocks, selected_blocks.json.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "format/npy.h"
#include "runtime/engine.h"
#include "runtime/generate.h"

namespace m3::cli {
namespace {

struct LogitsArgs {
  std::string model, ids, out;
  int steps = 0;
  EngineArgs engine_args;
  bool dump_blocks = false;
  LookupOptions lookup;
};

// Collects selected blocks as layers[layer][position][index_head] -> ascending ids.
class BlockRecorder : public ForwardObserver {
 public:
  void OnBlockSelection(int layer, int64_t pos0, const BlockSelection& sel) override {
    auto& rows = layers_[layer];
    const size_t n = sel.counts.size() / static_cast<size_t>(sel.num_index_heads);
    rows.resize(static_cast<size_t>(pos0) + n);
    for (size_t t = 0; t < n; ++t) {
      nlohmann::json heads = nlohmann::json::array();
      for (int h = 0; h < sel.num_index_heads; ++h)
        heads.push_back(std::vector<int32_t>(sel.Blocks(t, h), sel.Blocks(t, h) + sel.Count(t, h)));
      rows[static_cast<size_t>(pos0) + t] = std::move(heads);
    }
  }
  // Forgets positions from n on (guesses the decode did not keep).
  void Truncate(size_t n) {
    for (auto& [layer, rows] : layers_)
      if (rows.size() > n) rows.resize(n);
  }
  nlohmann::json ToJson() const {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [layer, rows] : layers_) j[std::to_string(layer)] = rows;
    return j;
  }

 private:
  std::map<int, std::vector<nlohmann::json>> layers_;
};

int Fail(const Status& s) {
  std::fprintf(stderr, "m3 logits: %s\n", s.ToString().c_str());
  return 1;
}

int RunLogits(const LogitsArgs& a) {
  auto ids = ParseIdList("--ids", a.ids);
  if (!ids.ok()) return Fail(ids.status());
  if (a.steps < 0) return Fail(InvalidArgument("-n must be >= 0"));
  if (Status s = ValidateLookupOptions(a.lookup); !s.ok()) return Fail(s);
  SessionOptions session_options;
  auto engine = a.engine_args.Open(a.model, &session_options);
  if (!engine.ok()) return Fail(engine.status());
  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) return Fail(IoError(a.out, ": cannot create output folder: ", ec.message()));

  const ModelConfig& c = (*engine)->model().config();
  const size_t vocab = static_cast<size_t>(c.vocab_size);
  Session session(**engine, session_options);
  BlockRecorder recorder;
  ForwardObserver* obs = a.dump_blocks ? &recorder : nullptr;

  // Greedy (argmax, ties to the lower id): the first id from the prompt's last row, then one per
  // decode row.
  SamplingParams greedy_params;
  greedy_params.temperature = 0;
  Sampler sampler(greedy_params);
  GenerateOptions options;
  options.max_tokens = a.steps + 1;
  options.lookup = a.lookup;
  std::vector<int32_t> greedy;
  std::vector<float> prefill, decode;
  Generation g(session, options, sampler, [&](int32_t id) {
    if (!greedy.empty()) {
      const std::span<const float> row = g.token_logits();
      decode.insert(decode.end(), row.begin(), row.end());
    }
    greedy.push_back(id);
    return true;
  });
  Status s = g.Begin(*ids);
  const auto t0 = std::chrono::steady_clock::now();
  if (s.ok()) s = session.Eval(*ids, LogitsMode::kAllRows, &prefill, obs);  // every row, not Step's last one
  if (!s.ok()) return Fail(s);
  g.logits().assign(prefill.end() - static_cast<std::ptrdiff_t>(vocab), prefill.end());
  g.Evaluated(ids->size());
  const auto t1 = std::chrono::steady_clock::now();
  s = g.Run(obs);
  if (s.ok() && greedy.size() != static_cast<size_t>(a.steps) + 1)  // the context limit
    s = OutOfRange("decode stopped after ", greedy.size() - 1, " of ", a.steps, " steps (", g.stats().stop_reason,
                   "): the context holds ", session.max_context(), " tokens");
  if (!s.ok()) return Fail(s);
  const auto t2 = std::chrono::steady_clock::now();
  recorder.Truncate(session.position());

  const std::filesystem::path out(a.out);
  s = WriteNpyF32((out / "prefill_logits.npy").string(), prefill.data(), {static_cast<int64_t>(ids->size()), c.vocab_size});
  if (s.ok()) s = WriteNpyF32((out / "decode_logits.npy").string(), decode.data(), {a.steps, c.vocab_size});
  if (!s.ok()) return Fail(s);
  std::ofstream((out / "greedy_ids.json").string()) << nlohmann::json(greedy).dump() << "\n";
  if (a.dump_blocks) {
    nlohmann::json j;
    j["format"] = "layers[layer_id][position][index_head] = ascending block ids";
    if (c.any_sparse()) {
      j["block_size"] = c.sparse.block_size;
      j["topk_blocks"] = c.sparse.topk_blocks;
      j["init_blocks"] = c.sparse.init_blocks;
      j["local_blocks"] = c.sparse.local_blocks;
      j["num_index_heads"] = c.sparse.num_index_heads;
    }
    j["prompt_len"] = ids->size();
    j["num_positions"] = session.position();
    j["layers"] = recorder.ToJson();
    std::ofstream((out / "selected_blocks.json").string()) << j.dump() << "\n";
  }
  const double pre_s = std::chrono::duration<double>(t1 - t0).count();
  const double dec_s = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "prefill %zu tokens in %.3f s (%.1f tok/s); decode %d tokens in %.3f s (%.1f tok/s)%s; %d threads, %s\n",
               ids->size(), pre_s, ids->size() / pre_s, a.steps, dec_s, a.steps > 0 ? a.steps / dec_s : 0.0,
               LookupSummary(g.stats()).c_str(), (*engine)->threads().threads, (*engine)->simd_target().c_str());
  if (a.engine_args.numa != "off" || a.engine_args.mlock_dense || (*engine)->expert_parallel())
    std::fprintf(stderr, "placement: %s\n", (*engine)->placement().c_str());
  return 0;
}

}  // namespace

void AddLogitsCommand(CLI::App& app, int* rc) {
  auto* cmd = app.add_subcommand("logits", "Prefill + greedy decode; write logits, greedy ids and selected blocks");
  auto a = std::make_shared<LogitsArgs>();
  cmd->add_option("-m,--model", a->model, "HuggingFace checkpoint folder")->required();
  cmd->add_option("--ids", a->ids, "prompt token ids: comma-separated, or @FILE")->required();
  cmd->add_option("-n,--steps", a->steps, "greedy decode steps after the prefill")->default_val(0);
  cmd->add_option("-o,--out", a->out, "output folder")->required();
  cmd->add_flag("--dump-blocks", a->dump_blocks, "also write selected_blocks.json");
  AddLookupOption(cmd, &a->lookup);
  AddEngineOptions(cmd, &a->engine_args);
  cmd->callback([a, rc] { *rc = RunLogits(*a); });
}

}  // namespace m3::cli
