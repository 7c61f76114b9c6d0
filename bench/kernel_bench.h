// `m3 bench --kernels`: the packed-format kernels at the real MiniMax-M3 expert shapes, each
// against a limit measured on this machine in the same run.
//
//   read_bw     memory read bandwidth (StreamRead over a buffer >= 8x L3, both read
//               patterns, best sample of the run)
//   int8_peak   int8 dot-product peak (Int8PeakLoop on every thread, summed, best of reps)
//   fma_peak    fp32 FMA peak (FmaPeakLoop, likewise), the limit of the bf16 GEMM
//   gemv        q4/q8/bf16, 1/2/4/8 tokens: GB/s of weights read (codes + scales) vs read_bw; the
//               weights cycle through enough distinct matrices (>= 8x L3) that every call is cold.
//               Each call is paired with a probe read of as many cold bytes right after it, and
//               the row's limit is the median of those (faster pattern): on a shared VM the
//               bandwidth swings by 30% from second to second, and a best-of-run limit set in a
//               quiet second would judge the kernel by noise. The best of the run is given too.
//               Also its GOP/s against the compute peak (`peak_ratio`), and `bound`: "compute"
//               where the products at the peak take longer than the read at the limit (q4 from
//               ~4 tokens, q8 from ~7), so that the read-bandwidth ratio cannot reach 1.
//   gemm        q4/q8/bf16, 512 tokens: GOP/s (2*rows*cols*tokens) vs int8_peak (fma_peak for bf16),
//               and q8 again vs oneDNN's int8 matmul on the same shape and threads; and at 16
//               tokens (a 512-token prefill's share per routed expert) with the weights cycling
//               through the GEMV matrices, cold as a chosen expert's are
//   onednn_int8 oneDNN's own GOP/s vs int8_peak
// Kernel rows report the median call (activation quantization included). The other limits are
// probed at the start and again before each block of rows; each is the best sample of the run
// (other processes only ever lower a probe). Every row carries the 1-minute load average when it was
// measured. Output: JSON lines (one per figure) or a table, after all measurements.
#pragma once

#include <cstdio>
#include <vector>

namespace m3::bench {

struct KernelBenchOptions {
  std::vector<int> threads;  // thread counts; empty: 1 and all cores
  bool json = false;         // JSON lines instead of the human table
  bool quick = false;        // tiny sizes and few repetitions (smoke test; figures meaningless)
};

// Runs the benchmark, writing results to `out` and notes (skipped rows, check failures) to `log`.
// Returns 0, or 1 when a kernel result disagrees with its scalar reference.
int RunKernelBench(const KernelBenchOptions& options, FILE* out, FILE* log);

}  // namespace m3::bench
