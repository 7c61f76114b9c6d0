// m3 bench [MODE] [options]: benchmarks, one mode per run.
//   (no mode)   end to end: prefill and decode of a model (-m DIR, or one generated once with the
//               real MiniMax-M3 layer shapes and random weights), against the read bandwidth and
//               int8 peak measured in the same run (bench/model_bench.h)
//   --kernels   packed-format kernels (q4/q8/bf16 GEMV and GEMM) at the real M3 shapes, each against
//               a limit measured in the same run (read bandwidth, int8 peak, oneDNN)
// A new mode is one flag in BenchArgs and one entry in kModes.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#if M3_HAVE_BENCH
#include "bench/kernel_bench.h"
#include "bench/model_bench.h"
#endif

namespace m3::cli {
namespace {

struct BenchArgs {
  bool kernels = false;
  bool json = false;
  bool quick = false;
  std::vector<int> threads;  // empty: each mode's default
  // End to end only.
  std::string model, cache_dir;
  std::optional<int> layers;
  int prompt_tokens = 512, decode_tokens = 128;
  bool tiny = false;
  EngineArgs engine;  // --numa, --mlock-dense (threads come from -t above)
  std::vector<std::string> end_to_end_flags;  // the end-to-end-only options given (to refuse them in other modes)
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

int RunEndToEnd(const BenchArgs& args) {
#if M3_HAVE_BENCH
  if (args.quick) {
    std::fprintf(stderr, "m3 bench: --quick applies to --kernels only (use --tiny for a small end-to-end run)\n");
    return 2;
  }
  if (args.threads.size() > 1)
    std::fprintf(stderr, "m3 bench: the end-to-end run uses one thread count: -t %d\n", args.threads[0]);
  EngineArgs engine = args.engine;
  engine.threads = args.threads.empty() ? 0 : args.threads[0];
  const StatusOr<EngineOptions> engine_options = engine.Options();
  if (!engine_options.ok()) {
    std::fprintf(stderr, "m3 bench: %s\n", engine_options.status().message().c_str());
    return 2;
  }
  bench::ModelBenchOptions opts;
  opts.engine = engine_options.value();
  opts.model_dir = args.model;
  opts.layers = args.layers;
  opts.tiny = args.tiny;
  opts.cache_dir = args.cache_dir;
  opts.prompt_tokens = args.prompt_tokens;
  opts.decode_tokens = args.decode_tokens;
  opts.json = args.json;
  return bench::RunModelBench(opts, stdout, stderr);
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
      "machine limits");
  auto args = std::make_shared<BenchArgs>();
  cmd->add_flag("--kernels", args->kernels, kModes[0].description);
  cmd->add_flag("--json", args->json, "Machine output: one JSON object (end to end) or JSON lines (--kernels)");
  cmd->add_flag("--quick", args->quick,
                "--kernels: tiny sizes and few repetitions (a smoke test; figures are not meaningful)");
  cmd->add_option("-t,--threads", args->threads,
                  "Threads (default: all cores); --kernels takes a list, e.g. -t 1,8 (default: 1 and all cores)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  // End-to-end options; range checks are the benchmark's (clear messages for 0 or negatives).
  std::vector<CLI::Option*> end_to_end = {
      cmd->add_option("-m,--model", args->model, "Model folder to benchmark (default: the generated model)"),
      cmd->add_option("--layers", args->layers,
                      "Layers of the generated model (default: what fits in about a third of RAM)"),
      cmd->add_option("-p,--prompt-tokens", args->prompt_tokens, "Prompt tokens of the prefill (default 512)"),
      cmd->add_option("-n,--decode-tokens", args->decode_tokens, "Tokens to decode (default 128)"),
      cmd->add_option("--cache-dir", args->cache_dir,
                      "Folder for the generated model (default $XDG_CACHE_HOME/m3 or ~/.cache/m3)"),
      cmd->add_option("--numa", args->engine.numa, "NUMA placement: off, distribute or split (as for m3 run)")
          ->check(CLI::IsMember({"off", "distribute", "split"})),
      cmd->add_flag("--mlock-dense", args->engine.mlock_dense,
                    "Lock all weights but the routed experts in memory (as for m3 run)"),
      cmd->add_flag("--tiny", args->tiny, "Generated model at tiny shapes (smoke tests)")->group(""),
  };
  cmd->callback([args, rc, end_to_end] {
    for (CLI::Option* o : end_to_end)
      if (o->count() > 0) args->end_to_end_flags.push_back(o->get_name());
    *rc = RunBench(*args);
  });
}

}  // namespace m3::cli
