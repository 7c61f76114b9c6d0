// m3 bench MODE [--json] [-t THREADS] [--quick]: benchmarks, one mode per run.
//   --kernels   packed-format kernels (q4/q8/bf16 GEMV and GEMM) at the real M3 shapes, each against
//               a limit measured in the same run (read bandwidth, int8 peak, oneDNN)
// A new mode is one flag in BenchArgs and one entry in kModes.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#if M3_HAVE_BENCH
#include "bench/kernel_bench.h"
#endif

namespace m3::cli {
namespace {

struct BenchArgs {
  bool kernels = false;
  bool json = false;
  bool quick = false;
  std::vector<int> threads;  // empty: each mode's default
};

int RunKernels(const BenchArgs& args) {
#if M3_HAVE_BENCH
  bench::KernelBenchOptions opts;
  opts.threads = args.threads;
  opts.json = args.json;
  opts.quick = args.quick;
  return bench::RunKernelBench(opts, stdout, stderr);
#else
  (void)args;
  std::fprintf(stderr, "m3 bench: this m3 was built without benchmarks (M3_BUILD_BENCH=OFF)\n");
  return 1;
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

std::string ModeList() {
  std::string s;
  for (const BenchMode& m : kModes) s += std::string("  ") + m.flag + "  " + m.description + "\n";
  return s;
}

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
  if (!chosen) {
    std::fprintf(stderr,
                 "m3 bench: choose a mode:\n%s(end-to-end prefill/decode and --attention benchmarks are not "
                 "implemented yet)\n",
                 ModeList().c_str());
    return 2;
  }
  return chosen->run(args);
}

}  // namespace

void AddBenchCommand(CLI::App& app, int* rc) {
  auto* cmd = app.add_subcommand("bench", "Benchmarks: --kernels (kernels vs measured machine limits)");
  auto args = std::make_shared<BenchArgs>();
  cmd->add_flag("--kernels", args->kernels, kModes[0].description);
  cmd->add_flag("--json", args->json, "JSON lines (one per figure) instead of a table");
  cmd->add_flag("--quick", args->quick, "Tiny sizes and few repetitions (a smoke test; figures are not meaningful)");
  cmd->add_option("-t,--threads", args->threads, "Thread counts, e.g. -t 1,8 (default: 1 and all cores)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  cmd->callback([args, rc] { *rc = RunBench(*args); });
}

}  // namespace m3::cli
