// `m3 bench` (no mode flag): end-to-end prefill and decode of a whole model, each figure against
// a machine limit measured in the same run.
//
//   model        -m DIR, or the synthetic model (synthetic_model.h) generated once into a cache
//   prefill      one Session::Eval of `prompt_tokens` random ids (last-row logits): ttft, tok/s,
//                GOP/s of the work done (2 x each layer's active parameters per token, lm_head
//                once) vs the int8 dot-product peak
//   decode       `decode_tokens` single-token Evals, greedy: tok/s from the median step, bytes of
//                weights read per token (from the bound weights' sizes and the experts actually
//                routed to), their GB/s vs the read bandwidth: the best sample of the run (the probe
//                of `m3 bench --kernels`, same threads, before and after the run) and, as the
//                kernel benchmark pairs each GEMV, the median of reads of as many cold weight bytes
//                right after each step (on a shared VM bandwidth swings from 34 to 60 GB/s)
//   batch        `batch` sequences decoded together (continuous batching, Session::DecodeBatch),
//                each batched step paired with a single-sequence step on sessions of the same
//                context: aggregate tok/s and its ratio to one sequence's; weights read per step
//                (each once, the experts the batch routed to as a union) and their GB/s
//   lookup       prompt lookup's verify steps (the sampled token and `lookup` guesses copied from
//                the context, every row's logits, then rewound), each paired with a single step at
//                the same context: the cost of a verify step in single steps, by time and by bytes
//                read (projected to 60 layers), which is the accepted guesses per step it needs
//                to pay off (plus one)
//   scaling      with prompt_threads (-t 1,4,16): the prefill again at each count, on an engine of
//                its own: tok/s, share of the int8 peak probed at that count, a layer's attention
//                and MoE parts, speedup over the first count and the 60-layer projection
//   projection   decode tok/s of the full 60-layer model: per step, the step minus an lm_head
//                matmul timed right after it is the layers' time; medians, x 60 / layers + lm_head
// Weights are read once before timing when they fit in available memory (a server keeps them
// resident); the disk read rate during decode is reported for models that do not fit. Peak RSS
// leaves out the probes' buffer (2.5 GiB on the 2-core VM, whose L3 reads as 320 MiB).
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "model/packer.h"
#include "runtime/engine.h"

namespace m3::bench {

struct ModelBenchOptions {
  std::string model_dir;      // empty: the synthetic model
  std::optional<int> layers;  // synthetic model only; unset: what fits in a third of RAM
  bool tiny = false;          // synthetic model at small shapes (smoke tests)
  PackType type = PackType::kQ4Mixed;  // synthetic model only: its pack type
  bool type_given = false;    // --type was given (refused with -m)
  std::string cache_dir;      // synthetic model cache; empty: $XDG_CACHE_HOME/m3 or ~/.cache/m3
  int prompt_tokens = 512;
  int decode_tokens = 128;
  int batch = 4;              // sequences of the batched decode (1: no batched phase)
  int lookup = 3;             // guesses of the prompt-lookup verify steps (0: no such phase)
  EngineOptions engine;       // threads (0: all cores), NUMA mode, mlock; limits probed on as many threads
  std::vector<int> prompt_threads;  // the prompt again at each of these thread counts (none: not)
  bool json = false;          // one JSON object instead of the table
};

// Runs the benchmark: results to `out`, progress and errors to `log`. Returns 0, or 1 with a
// message on `log` (bad option, unreadable model, context too small, ...).
int RunModelBench(const ModelBenchOptions& options, FILE* out, FILE* log);

}  // namespace m3::bench
