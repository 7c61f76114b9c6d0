// `m3 bench --attention`: one MiniMax sparse-attention layer at the real M3 shapes (64 query heads,
// 4 KV heads x 128, indexer 4 heads x 128, block 128, top-16 with init 0 / local 1) over long
// contexts, on random caches (no cost depends on the values). Per context and index-key type:
//
//   indexer_ms          decode: SelectBlocks for one token at position context-1
//   attention_ms        decode: Attention over that token's selected blocks
//   dense_attention_ms  decode: Attention over every key (sel = nullptr), same caches
//   prefill_ms          SelectBlocks + selected-block Attention for a chunk of queries at the end
//                       of the context (positions context-chunk .. context-1)
//   dense_prefill_ms    the same chunk with dense Attention; prefill_speedup = dense / sparse
//   index_scan_gbps     index-key bytes of the decode scan / indexer time, against read_gbps:
//                       the read bandwidth of this run (MeasureReadBandwidth over a buffer >= 8x
//                       L3, best sample, as `m3 bench --kernels` measures read_bw)
//
// Every timed call starts cold: before it, an untimed read of 4x L3 from the bandwidth probe's
// buffer evicts the last-level cache, as the weights and the other 56 sparse layers streamed
// through a real decode step would. Output: a table or JSON lines (one per context and index-key
// type), and a log-log PNG plot of the times against the context (gnuplot, when installed).
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include "simd/cache_format.h"

namespace m3::bench {

struct AttentionBenchOptions {
  std::vector<size_t> contexts;                // empty: 1K 4K 16K 64K 128K (--quick: 512 4096)
  size_t chunk = 0;                            // prefill queries; 0: 256 (--quick: 16)
  std::vector<simd::CacheType> index_types;    // one row each; empty: f32
  simd::CacheType kv_type = simd::CacheType::kF32;
  int threads = 0;                             // 0: all cores
  bool json = false;                           // JSON lines instead of the table
  bool quick = false;                          // small contexts, few repetitions (smoke test)
  std::string plot;                            // PNG to write; empty: no plot
};

// Runs the benchmark, writing results to `out` and notes (skipped contexts, the plot) to `log`.
// Returns 0, 1 when a selection or a sparse result that must equal the dense one does not, 2 for
// bad options.
int RunAttentionBench(const AttentionBenchOptions& options, FILE* out, FILE* log);

}  // namespace m3::bench
