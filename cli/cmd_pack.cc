// m3 pack -m HF_DIR|FILE.gguf -o OUT_DIR --type q8|q4|q4-mixed|q3-mixed|q2-mixed [--override PATTERN=FORMAT]...
// [--imatrix FILE] [--force] [-t THREADS]: writes a packed
// model folder (docs/PACKED_FORMAT.md) with a progress bar on stderr and a summary on stdout.
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/progress.h"
#include "cli/commands.h"
#include "model/packer.h"

namespace m3::cli {
namespace {

// A GGUF's conversion, per source type and packed format: how many tensors, how many exact, the
// mean and worst relative squared error (each tensor's in the folder's conversion.json).
void PrintConversion(const std::vector<ConversionError>& tensors, const std::string& out) {
  struct Group {
    size_t count = 0, exact = 0;
    double sum = 0;
    const ConversionError* worst = nullptr;
  };
  std::map<std::pair<std::string, std::string>, Group> groups;
  for (const ConversionError& t : tensors) {
    Group& g = groups[{t.source_type, t.format}];
    ++g.count, g.exact += t.max_abs_err == 0, g.sum += t.rel_err;
    if (!g.worst || t.rel_err > g.worst->rel_err) g.worst = &t;
  }
  std::printf("from GGUF        relative error sum (w - q)^2 / sum w^2 per tensor: %s/conversion.json\n", out.c_str());
  for (const auto& [key, g] : groups) {
    const std::string from_to = key.first + " -> " + key.second;
    if (g.exact == g.count) {
      std::printf("  %-14s %zu tensors, exact\n", from_to.c_str(), g.count);
      continue;
    }
    std::printf("  %-14s %zu tensors (%zu exact), mean %.3g, worst %.3g (%s)\n", from_to.c_str(), g.count, g.exact,
                g.sum / static_cast<double>(g.count), g.worst->rel_err, g.worst->tensor.c_str());
  }
}

struct PackArgs {
  std::string model, output, type = "q4-mixed", imatrix;
  std::vector<std::string> overrides;
  bool force = false;
  int threads = 0;
};

double Mb(uint64_t bytes) { return static_cast<double>(bytes) / 1e6; }

int RunPack(const PackArgs& a) {
  const auto type = ParsePackType(a.type);
  if (!type) {
    std::fprintf(stderr, "m3 pack: unknown --type '%s' (q8, q4, q4-mixed, q3-mixed or q2-mixed)\n", a.type.c_str());
    return 2;
  }
  std::unique_ptr<ProgressMeter> meter;  // made at the first report, which gives the total
  PackOptions opt;
  opt.source_dir = a.model;
  opt.output_dir = a.output;
  opt.type = *type;
  for (const std::string& spec : a.overrides) {
    auto o = ParseFormatOverride(spec);
    if (!o.ok()) {
      std::fprintf(stderr, "m3 pack: %s\n", o.status().message().c_str());
      return 2;
    }
    opt.overrides.push_back(std::move(o).value());
  }
  opt.imatrix = a.imatrix;
  opt.force = a.force;
  opt.threads = a.threads;
  NoteThreadCap(a.threads);
  opt.progress = [&meter](uint64_t done, uint64_t total) {
    if (!meter) meter = std::make_unique<ProgressMeter>("", total, ::isatty(STDERR_FILENO) != 0);
    std::fputs(meter->Update(done).c_str(), stderr);
    std::fflush(stderr);
  };
  auto r = PackModel(opt);
  if (!r.ok()) {
    std::fprintf(stderr, "\nm3 pack: %s\n", r.status().ToString().c_str());
    return 1;
  }
  const PackSummary& s = r.value();
  std::printf("packed           %s -> %s/%s (%s)\n", a.model.c_str(), a.output.c_str(), kPackFileName, a.type.c_str());
  std::printf("tensors          %zu (%d MTP depth(s))\n", s.tensors, s.mtp_depths);
  std::printf("bytes            %.2f MB file, %.2f MB tensor data\n", Mb(s.file_bytes), Mb(s.payload_bytes));
  for (const auto& [fmt, bytes] : s.bytes_by_format) std::printf("  %-6s         %.2f MB\n", fmt.c_str(), Mb(bytes));
  std::printf("bits per weight  %.3f overall", s.bits_per_weight());
  if (s.expert_params) std::printf(", %.3f routed experts", s.expert_bits_per_weight());
  std::printf(" (%lld weights)\n", static_cast<long long>(s.params));
  if (!a.imatrix.empty())
    std::printf("imatrix          %s: %zu q4/q3/q2 matrices weighted by it\n", a.imatrix.c_str(), s.weighted_matrices);
  if (!s.conversion.empty()) PrintConversion(s.conversion, a.output);
  if (const std::string full = ReleasedFootprint(a.type); !full.empty()) std::printf("full model       %s\n", full.c_str());
  std::printf("time             %.2f s (%.1f MB/s written)\n", s.seconds,
              s.seconds > 0 ? Mb(s.payload_bytes) / s.seconds : 0.0);
  return 0;
}

}  // namespace

void AddPackCommand(CLI::App& app, int* rc) {
  auto* cmd = app.add_subcommand("pack", "Convert a HuggingFace checkpoint into a packed m3 model folder");
  auto a = std::make_shared<PackArgs>();
  cmd->add_option("-m,--model", a->model,
                  "HuggingFace checkpoint folder (F32, BF16, F16 or MXFP8), or a llama.cpp minimax-m3 GGUF file "
                  "(one shard of a split set opens them all)")
      ->required();
  cmd->add_option("-o,--output", a->output, "output folder (model.m3w, config.json, tokenizer files)")->required();
  cmd->add_option("--type", a->type, "q8 | q4 | q4-mixed (routed experts q4, the rest q8) | q3-mixed, q2-mixed (routed experts "
                  "3.375 / 2.375 bits a weight but the first and last MoE layers' at q4, the rest q8)")
      ->check(CLI::IsMember({"q8", "q4", "q4-mixed", "q3-mixed", "q2-mixed"}))
      ->capture_default_str();
  cmd->add_option("--override", a->overrides,
                  "PATTERN=FORMAT: store the matrices whose names the regular expression matches as f32 (exact), q8, "
                  "q4, q3 or q2 (repeatable; the first match wins; e.g. 'layers\\.(0|1)\\..*experts=q4')");
  cmd->add_option("--imatrix", a->imatrix,
                  "importance matrix of m3 imatrix: q4, q3 and q2 matrices weigh each input's error by its mean "
                  "square on the calibration text");
  cmd->add_flag("--force", a->force,
                "replace the pack in the output folder (in one step, once the new one is complete)");
  cmd->add_option("-t,--threads", a->threads, "threads (0: every core)")->capture_default_str();
  cmd->callback([a, rc] { *rc = RunPack(*a); });
}

}  // namespace m3::cli
