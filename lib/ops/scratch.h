// Internal to ops: the caller-side scratch of MatMulSameInput and MoeForward that a Workspace
// keeps between calls (ops/workspace.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/aligned_buffer.h"
#include "ops/matmul.h"
#include "ops/mlp.h"

namespace m3 {

// MatMulSameInput: the inputs' buffers are reused (decode calls it for every projection).
struct MatMulScratch {
  std::vector<MatMulInput> inputs;
  std::vector<size_t> input_of, prepare_rows, tiles;  // input_of[i]: the input target i multiplies
  std::vector<uint64_t> ones;
};

// One expert's part of the MoE block: its rows (tokens), inputs, intermediate values and outputs.
struct ExpertJob {
  const MlpWeights* w = nullptr;
  size_t expert = 0;                 // index into a NUMA split's slices (the shared expert: E)
  size_t m = 0;                      // rows (tokens routed to it; all tokens for the shared expert)
  const uint32_t* tokens = nullptr;  // token of each row; nullptr: the rows are x's rows as they are
  float* gathered = nullptr;         // [m, H] inputs gathered from x (routed experts not from_source)
  bool from_source = false;          // int8 rows copied from the tokens' once-quantized rows
  float* g = nullptr;                // [m, I] gate, then the SwiGLU activation
  float* u = nullptr;                // [m, I] up
  float* y = nullptr;                // [m, H] output (`out` itself for the shared expert)
  MatMulInput gate_up_in, down_in;
};

// MoeForward: no allocation, and no zeroing of large buffers, per layer.
struct MoeScratch {
  AlignedBuffer<float> logits, gathered, g, u, y;
  MatMulInput routed_source;  // every token quantized once for the routed experts' weights
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<uint32_t> row_tokens;  // routed rows grouped by expert: the token of each
  std::vector<uint32_t> slot_row;    // [n, k]: routed row of (token, slot)
  std::vector<ExpertJob> jobs;
  AlignedBuffer<float> sent, received;  // a part's (MoePart) columns to and from the other processes
};

}  // namespace m3
