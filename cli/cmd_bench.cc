// m3 bench [MODE] [options]: benchmarks, one mode per run.
//   (no mode)   end to end: prefill and decode of a model (-m DIR, or one generated once with the
//               real MiniMax-M3 layer shapes and random weights), against the read bandwidth and
//               int8 peak measured in the same run (bench/model_bench.h)
//   --kernels   packed-format kernels (q4/q8/bf16 GEMV and GEMM) at the real M3 shapes, each against
//               a limit measured in the same run (read bandwidth, int8 peak, oneDNN)
//   --attention one sparse-attention layer at the real M3 shapes over contexts 1K..128K: indexer,
//               selected-block and dense attention, decode and prefill (bench/attention_bench.h)
//   --constrain constrained decoding: the token-mask cost per step over the real vocabulary, cold and
//               cached, for an agent tool schema as JSON and as tool-call markup (bench/constrain_bench.h)
//   --quant     quantization error of q8/q4/q3/q2 beside llama.cpp's types at equal bits per weight
//               (--peer-lib DIR; bench/quant_quality.h)
// A new mode is one flag in BenchArgs and one entry in kModes.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "model/packer.h"
#if M3_HAVE_BENCH
#include "bench/attention_bench.h"
#include "bench/quant_quality.h"
#include "bench/constrain_bench.h"
#include "bench/kernel_bench.h"
#include "bench/model_bench.h"
#include "bench/synthetic_model.h"
#endif

namespace m3::cli {

std::string ReleasedFootprint(const std::string& pack_type) {
#if M3_HAVE_BENCH
  const std::optional<PackType> type = ParsePackType(pack_type);
  const uint64_t bytes = type ? bench::ReleasedModelPayloadBytes(*type) : 0;
  if (bytes == 0) return "";
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1f GB (MiniMax-M3 as released, 60 layers, at %s)", static_cast<double>(bytes) / 1e9,
                pack_type.c_str());
  return buf;
#else
  (void)pack_type;
  return "";
#endif
}

namespace {

struct BenchArgs {
  bool kernels = false;
  bool attention = false;
  bool constrain = false;
  bool quant = false;
  std::string peer_lib;  // --quant only
  std::string tokenizer = "tests/data/tokenizer/minimax-m3";  // --constrain only
  bool json = false;
  bool quick = false;
  std::vector<int> threads;  // empty: each mode's default
  // End to end only.
  std::string model, cache_dir;
  std::optional<int> layers;
  std::optional<std::string> type;  // the generated model's pack type
  int prompt_tokens = 512, decode_tokens = 128, batch = 4, lookup = 3;
  bool tiny = false;
  EngineArgs engine;  // --numa, --mlock-dense (threads come from -t above)
  std::vector<std::string> end_to_end_flags;  // the end-to-end-only options given (to refuse them in other modes)
  // --attention only.
  std::vector<std::string> contexts;  // "1024" or "1K"
  size_t chunk = 0;
  std::vector<std::string> index_cache;
  std::string kv_cache = "f32";
  std::optional<std::string> plot;
  std::vector<std::string> attention_flags;  // the --attention-only options given
};

#if !M3_HAVE_BENCH
int NoBench() {
  std::fprintf(stderr, "m3 bench: this m3 was built without benchmarks (M3_BUILD_BENCH=OFF)\n");
  return 1;
}
#endif

int RunKernels(const BenchArgs& args) {
#if M3_HAVE_BENCH
  bench::KernelBenchOptions opts;
  opts.threads = args.threads;
  opts.json = args.json;
  opts.quick = args.quick;
  return bench::RunKernelBench(opts, stdout, stderr);
#else
  (void)args;
  return NoBench();
#endif
}

#if M3_HAVE_BENCH
// "4096", "4K" or "4k" (x 1024); 0 for anything else.
size_t ParseContext(const std::string& s) {
  if (s.empty() || s[0] < '0' || s[0] > '9') return 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (*end == 'k' || *end == 'K') return end[1] == 0 ? static_cast<size_t>(v) * 1024 : 0;
  return *end == 0 ? static_cast<size_t>(v) : 0;
}
#endif

int RunAttention(const BenchArgs& args) {
#if M3_HAVE_BENCH
  bench::AttentionBenchOptions opts;
  for (const std::string& c : args.contexts) {
    const size_t v = ParseContext(c);
    if (v == 0) {
      std::fprintf(stderr, "m3 bench: --contexts: '%s' is not a positive token count (e.g. 4096 or 4K)\n", c.c_str());
      return 2;
    }
    opts.contexts.push_back(v);
  }
  for (const std::string& t : args.index_cache) {
    simd::CacheType type;
    if (!simd::ParseCacheType(t.c_str(), &type)) {
      std::fprintf(stderr, "m3 bench: --index-cache: unknown type '%s' (f32, bf16 or int8)\n", t.c_str());
      return 2;
    }
    opts.index_types.push_back(type);
  }
  if (!simd::ParseCacheType(args.kv_cache.c_str(), &opts.kv_type)) {
    std::fprintf(stderr, "m3 bench: --kv-cache: unknown type '%s' (f32, bf16 or int8)\n", args.kv_cache.c_str());
    return 2;
  }
  if (args.threads.size() > 1)
    std::fprintf(stderr, "m3 bench: --attention uses one thread count: -t %d\n", args.threads[0]);
  opts.threads = args.threads.empty() ? 0 : args.threads[0];
  NoteThreadCap(opts.threads);
  opts.chunk = args.chunk;
  opts.json = args.json;
  opts.quick = args.quick;
  // A plot only where asked (`--plot FILE`): the bench writes no file into the current folder,
  // which is often the source tree.
  opts.plot = args.plot ? *args.plot : "";
  if (opts.plot == "none") opts.plot.clear();  // `--plot none`: no plot (not a file named "none")
  return bench::RunAttentionBench(opts, stdout, stderr);
#else
  (void)args;
  return NoBench();
#endif
}

#if M3_HAVE_BENCH
// The engine options of a run that uses one thread count (-t's first); nothing, with a message,
// when the engine flags are wrong.
std::optional<EngineOptions> BenchEngineOptions(const BenchArgs& args) {
  EngineArgs engine = args.engine;
  engine.threads = args.threads.empty() ? 0 : args.threads[0];
  const StatusOr<EngineOptions> options = engine.Options();
  if (!options.ok()) {
    std::fprintf(stderr, "m3 bench: %s\n", options.status().message().c_str());
    return std::nullopt;
  }
  return options.value();
}
#endif

int RunEndToEnd(const BenchArgs& args) {
#if M3_HAVE_BENCH
  if (args.quick) {
    std::fprintf(stderr,
                 "m3 bench: --quick applies to --kernels and --attention only (use --tiny for a small end-to-end run)\n");
    return 2;
  }
  // Several counts: the whole run on the largest, and the prompt again at each.
  BenchArgs main_args = args;
  if (args.threads.size() > 1) main_args.threads = {*std::max_element(args.threads.begin(), args.threads.end())};
  const std::optional<EngineOptions> engine_options = BenchEngineOptions(main_args);
  if (!engine_options) return 2;
  bench::ModelBenchOptions opts;
  opts.engine = *engine_options;
  if (args.threads.size() > 1) opts.prompt_threads = args.threads;
  opts.model_dir = args.model;
  opts.layers = args.layers;
  if (args.type) {
    const std::optional<PackType> type = ParsePackType(*args.type);
    if (!type) {
      std::fprintf(stderr, "m3 bench: --type: unknown pack type '%s' (q8, q4, q4-mixed, q3-mixed or q2-mixed)\n", args.type->c_str());
      return 2;
    }
    opts.type = *type;
    opts.type_given = true;
  }
  opts.tiny = args.tiny;
  opts.cache_dir = args.cache_dir;
  opts.prompt_tokens = args.prompt_tokens;
  opts.decode_tokens = args.decode_tokens;
  opts.batch = args.batch;
  opts.lookup = args.lookup;
  opts.json = args.json;
  return bench::RunModelBench(opts, stdout, stderr);
#else
  (void)args;
  return NoBench();
#endif
}

int RunQuant(const BenchArgs& args) {
#if M3_HAVE_BENCH
  bench::QuantBenchOptions opts;
  opts.peer_lib = args.peer_lib;
  opts.json = args.json;
  opts.quick = args.quick;
  return bench::RunQuantBench(opts, stdout, stderr);
#else
  (void)args;
  return NoBench();
#endif
}

int RunConstrain(const BenchArgs& args) {
#if M3_HAVE_BENCH
  bench::ConstrainBenchOptions opts;
  opts.tokenizer = args.tokenizer;
  opts.json = args.json;
  if (args.quick) opts.walks = 2;
  opts.model_dir = args.model;  // -m: the decode step the masks are set against
  const std::optional<EngineOptions> engine_options = BenchEngineOptions(args);
  if (!engine_options) return 2;
  opts.engine = *engine_options;
  return bench::RunConstrainBench(opts, stdout, stderr);
#else
  (void)args;
  return NoBench();
#endif
}

struct BenchMode {
  const char* flag;
  bool BenchArgs::*selected;
  const char* description;
  int (*run)(const BenchArgs&);
};

constexpr BenchMode kModes[] = {
    {"--kernels", &BenchArgs::kernels,
     "q4/q8/bf16 GEMV and GEMM at the MiniMax-M3 expert shapes vs measured read bandwidth, int8 peak and oneDNN",
     RunKernels},
    {"--attention", &BenchArgs::attention,
     "one sparse-attention layer at the MiniMax-M3 shapes, contexts 1K..128K: indexer, selected-block and dense "
     "attention (decode and prefill) vs measured read bandwidth; table, JSON lines and a PNG plot",
     RunAttention},
    {"--constrain", &BenchArgs::constrain,
     "constrained decoding: token-mask time per step (cold, cached) over the real vocabulary for an agent tool "
     "schema as JSON and as tool-call markup",
     RunConstrain},
    {"--quant", &BenchArgs::quant,
     "quantization error of q8/q4/q3/q2 on Gaussian and heavy-tailed matrices, plain and importance-weighted, beside "
     "llama.cpp's types at equal bits per weight (--peer-lib DIR)",
     RunQuant},
};

int RunBench(const BenchArgs& args) {
  const BenchMode* chosen = nullptr;
  for (const BenchMode& m : kModes) {
    if (!(args.*m.selected)) continue;
    if (chosen) {
      std::fprintf(stderr, "m3 bench: choose one mode per run (%s and %s given)\n", chosen->flag, m.flag);
      return 2;
    }
    chosen = &m;
  }
  if (!args.attention_flags.empty() && (!chosen || chosen->run != RunAttention)) {
    std::fprintf(stderr, "m3 bench: %s is an option of m3 bench --attention\n", args.attention_flags[0].c_str());
    return 2;
  }
  if (!args.peer_lib.empty() && (!chosen || chosen->run != RunQuant)) {
    std::fprintf(stderr, "m3 bench: --peer-lib is an option of m3 bench --quant\n");
    return 2;
  }
  if (!chosen) return RunEndToEnd(args);
  if (!args.end_to_end_flags.empty()) {
    std::fprintf(stderr, "m3 bench: %s is an option of the end-to-end run (m3 bench without %s)\n",
                 args.end_to_end_flags[0].c_str(), chosen->flag);
    return 2;
  }
  return chosen->run(args);
}

}  // namespace

void AddBenchCommand(CLI::App& app, int* rc) {
  auto* cmd = app.add_subcommand(
      "bench",
      "Benchmarks. Without a mode: prefill + decode end to end on -m DIR, or on a model with the real "
      "MiniMax-M3 layer shapes and random weights generated once (cached); --kernels: kernels vs measured "
      "machine limits; --attention: one sparse-attention layer over long contexts");
  auto args = std::make_shared<BenchArgs>();
  cmd->add_flag("--kernels", args->kernels, kModes[0].description);
  cmd->add_flag("--attention", args->attention, kModes[1].description);
  cmd->add_flag("--constrain", args->constrain, kModes[2].description);
  cmd->add_flag("--quant", args->quant, kModes[3].description);
  cmd->add_option("--peer-lib", args->peer_lib,
                  "--quant: folder of llama.cpp's libggml-base.so (bench/peer/setup.sh prints it), to compare with");
  cmd->add_option("--tokenizer", args->tokenizer,
                  "--constrain: tokenizer.json or its folder (default: tests/data/tokenizer/minimax-m3); with -m, "
                  "the masks are set against that model's decode step");
  cmd->add_flag("--json", args->json, "Machine output: one JSON object (end to end) or JSON lines (--kernels, --attention)");
  cmd->add_flag("--quick", args->quick,
                "--kernels, --attention: tiny sizes and few repetitions (a smoke test; figures are not meaningful)");
  cmd->add_option("-t,--threads", args->threads,
                  "Threads (default: all cores); --kernels takes a list, e.g. -t 1,8 (default: 1 and all cores); so does the "
                  "end-to-end run: the whole run on the largest, and the prompt again at each count (its scaling)")
      ->delimiter(',')
      ->check(CLI::Validator(
          [](std::string& value) -> std::string {  // CLI::PositiveNumber's message quotes DBL_MAX
            int n = 0;
            const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
            if (ec != std::errc() || end != value.data() + value.size() || n < 1)
              return "thread counts are whole numbers of 1 or more, got '" + value + "'";
            return {};
          },
          "N>=1"));
  // End-to-end options; range checks are the benchmark's (clear messages for 0 or negatives).
  std::vector<CLI::Option*> end_to_end = {
      cmd->add_option("-m,--model", args->model, "Model folder to benchmark (default: the generated model)"),
      cmd->add_option("--layers", args->layers,
                      "Layers of the generated model (default: the fewest whose MoE layers read 2/3 of a decode "
                      "token's bytes, as in the 60-layer model, capped at what fits in 2/3 of RAM)"),
      cmd->add_option("--type", args->type,
                      "Pack type of the generated model: q4-mixed (default; routed experts q4, the rest q8), q4, q8, q3-mixed or "
                      "q2-mixed"),
      cmd->add_option("-p,--prompt-tokens", args->prompt_tokens, "Prompt tokens of the prefill (default 512)"),
      cmd->add_option("-n,--decode-tokens", args->decode_tokens, "Tokens to decode (default 128)"),
      cmd->add_option("--batch", args->batch,
                      "Sequences decoded together in the batched phase, against one sequence's steps (default 4; "
                      "1: none)"),
      cmd->add_option("--lookup", args->lookup,
                      "Guesses of the prompt-lookup verify steps, against single steps (default 3; 0: none)"),
      cmd->add_option("--cache-dir", args->cache_dir,
                      "Folder for the generated model (default $XDG_CACHE_HOME/m3 or ~/.cache/m3)"),
      cmd->add_option("--numa", args->engine.numa, "NUMA placement: off, distribute or split (as for m3 run)")
          ->check(CLI::IsMember({"off", "distribute", "split"})),
      cmd->add_flag("--mlock-dense", args->engine.mlock_dense,
                    "Lock all weights but the routed experts in memory (as for m3 run)"),
      cmd->add_option("--verify-weights", args->engine.verify_weights,
                      "first-load or off: the background check of a packed model's hashes (as for m3 run)")
          ->check(CLI::IsMember({"first-load", "off"})),
      cmd->add_flag("--tiny", args->tiny, "Generated model at tiny shapes (smoke tests)")->group(""),
  };
  AddGpuOptions(cmd, &args->engine);
  // --attention options.
  std::vector<CLI::Option*> attention = {
      cmd->add_option("--contexts", args->contexts,
                      "--attention: context lengths, e.g. 1K,4K,16K,64K,128K (the default) or 1024,262144")
          ->delimiter(','),
      cmd->add_option("--chunk", args->chunk, "--attention: prefill chunk, queries at the end of the context (default 256)"),
      cmd->add_option("--index-cache", args->index_cache,
                      "--attention: index-key storage types, one row each, e.g. f32,bf16,int8 (default f32)")
          ->delimiter(','),
      cmd->add_option("--kv-cache", args->kv_cache, "--attention: K/V storage type: f32 (default), bf16 or int8"),
      cmd->add_option("--plot", args->plot,
                      "--attention: PNG plot of time vs context to FILE (gnuplot; default none)"),
  };
  cmd->callback([args, rc, end_to_end, attention] {
    for (CLI::Option* o : end_to_end)  // -m also serves --constrain (the decode step it compares with)
      if (o->count() > 0 && !(args->constrain && o->get_name() == "--model"))
        args->end_to_end_flags.push_back(o->get_name());
    for (CLI::Option* o : attention)
      if (o->count() > 0) args->attention_flags.push_back(o->get_name());
    *rc = RunBench(*args);
  });
}

}  // namespace m3::cli
