// `m3 bench --quant`: how much each weight format loses, beside llama.cpp's quantizers on the same
// matrices, at equal bits per weight.
//
// Matrices of 256 rows x 3072 inputs (a routed expert's down projection is 6144 x 3072) drawn
// Gaussian and Student-t (4 degrees of freedom: heavier tails, as trained weights have), each
// packed by m3 as q8, q4, q3 and q2 and, when llama.cpp's CPU library is given (--peer-lib DIR:
// the folder of its libggml-base.so, e.g. bench/peer/setup.sh's), quantized by its own
// ggml_quantize_chunk as Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, IQ4_XS, Q3_K, IQ3_S, IQ3_XXS, Q2_K, IQ2_S
// (and IQ2_XS, IQ2_XXS, which need an importance matrix, in the weighted runs) and decoded by its
// own to_float. The error is sum_i imp_i (w_i - q_i)^2 / sum_i imp_i w_i^2 over the matrix:
// unweighted (imp = 1) and weighted by an importance vector like an activation's mean squares
// (log-normal, 0.5 decades, and 1% of the inputs 30x: outlier channels), given to both
// quantizers (m3 pack --imatrix; llama.cpp's imatrix).
//
// At equal bits: llama.cpp's types make a curve of error against bits per weight; its lower
// envelope, interpolated (log error, linear in bits) at an m3 type's bits per weight, is what
// llama.cpp would give at that size. The ratio m3 / that is <= 1 where m3 is no worse at equal
// size (beyond llama.cpp's range the envelope's end segment is extended, and the row says so).
#pragma once

#include <cstdio>
#include <string>

namespace m3::bench {

struct QuantBenchOptions {
  std::string peer_lib;  // folder of llama.cpp's libggml-base.so; empty: m3's formats only
  bool json = false;     // JSON lines instead of the table
  bool quick = false;    // 32 rows (a smoke test)
};

// Writes the rows to `out`, notes to `log`. 0, or 1 when the peer library cannot be used.
int RunQuantBench(const QuantBenchOptions& options, FILE* out, FILE* log);

}  // namespace m3::bench
