// How many prompt tokens one forward pass takes when the session was not told (SessionOptions::
// prefill_chunk 0): enough that reading the weights once per pass costs little next to the pass's
// compute. A pass of a long prompt reads every routed expert (2048 tokens x top-4 of 128 leave
// none out), 255 GB with 60 layers at q4-mixed: at 100-200 GB/s that is 1.3-2.6 s a pass whatever
// its tokens, while its compute grows with them. So the chunk is the smallest that keeps that
// read under kMaxReadShare of the pass's compute at this machine's measured rates, at least the
// default and at most what a pass's activations may take of the memory left.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace m3 {

class Kernels;
class Model;
struct ThreadConfig;

// The read of a pass's weights may take at most this share of its compute time.
inline constexpr double kMaxReadShare = 0.125;
// Chunks are multiples of this many tokens, at most kMaxPrefillChunk.
inline constexpr size_t kPrefillChunkStep = 512;
inline constexpr size_t kMaxPrefillChunk = 16384;
// A pass's activations may take at most this share of the memory left.
inline constexpr double kMaxActivationShare = 0.125;

// What the choice weighs; 0 for a rate or the memory means unknown (then the default chunk).
struct ChunkInputs {
  double pass_weight_bytes = 0;     // a pass's weights when every routed expert is read
  double ops_per_token = 0;         // int8 work per token (2 x the active parameters)
  double activation_bytes_per_token = 0;
  double read_gbps = 0;             // the machine's read bandwidth
  double compute_gops = 0;          // the prompt kernels' rate on the engine's threads
  uint64_t memory_available = 0;
};

struct ChunkChoice {
  size_t tokens = 0;
  double read_floor_s = 0;  // reading pass_weight_bytes at read_gbps
  double compute_s = 0;     // the chunk's int8 work at compute_gops
  std::string why;          // in words, for logs and m3 bench
};

// The rule (pure: tests give it inputs). default_chunk is the floor and the answer when a rate is
// unknown; memory can only lower it (to kPrefillChunkStep at least).
ChunkChoice ChoosePrefillChunk(const ChunkInputs& in, size_t default_chunk);

// The inputs of `model`: its bytes, work and activations per token from its weights and shapes.
ChunkInputs ModelChunkInputs(const Model& model);

// This machine's rates, measured at each call (~0.1-0.3 s: a 256 MiB read, and the q4 prompt
// matmul of ops/matmul.h on the engine's threads and kernels).
void ProbeChunkRates(const ThreadConfig& threads, const Kernels& kernels, ChunkInputs* in);

}  // namespace m3
