// The model `m3 bench` runs when no model folder is given: the real MiniMax-M3 layer shapes
// (bench/shapes.h: hidden 6144, 64/4 heads x 128, 128 experts x 3072, top-4, a shared expert,
// 4 x 128 indexer, vocab 200064), `layers` layers that are all MoE + sparse attention (57 of the
// real 60 are), and random weights of one pack type (q4-mixed, q4 or q8, as `m3 pack` writes
// them), generated once into a cache folder and reused.
//
// Weights are written straight into the packed layout (PlanPackLayout + PackWriter), not through
// PackRowTiles, whose q4 scale search costs ~250 ns per weight (hours for a 4 GB layer). Values
// keep the forward pass finite through any number of layers: codes uniform and symmetric around
// the zero point, fp16 scales chosen so that each matrix maps unit-variance inputs to roughly
// unit-variance outputs (embedding rows have unit variance), norms 0 (Gemma norms multiply by
// 1 + w), router f32 uniform with unit-variance logits, correction bias 0.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "model/packer.h"

namespace m3::bench {

struct SyntheticModelOptions {
  int layers = 0;         // 0: DefaultSyntheticLayers(tiny, type)
  bool tiny = false;      // the same structure at small shapes (smoke tests; seconds to generate)
  PackType type = PackType::kQ4Mixed;
  std::string cache_dir;  // parent of the model folder; empty: DefaultCacheDir()
  int threads = 0;        // generation threads; 0: all cores
};

struct SyntheticModel {
  std::string dir;
  int layers = 0;
  bool generated = false;  // false: reused from the cache
  uint64_t file_bytes = 0;
  double seconds = 0;      // generation time (0 when reused)
};

// config.json of the generated model (flat MiniMax-M3 layout, parsed by lib/model/config.cc).
nlohmann::json SyntheticConfigJson(int layers, bool tiny);
// Bytes of the released MiniMax-M3 (60 layers, 3 of them dense, no MTP) packed as `type`: what
// `m3 pack` and `m3 inspect` print as the full model's footprint.
uint64_t ReleasedModelPayloadBytes(PackType type);
// Size of model.m3w for `layers` layers (header, payload and directory estimate).
uint64_t SyntheticModelBytes(int layers, bool tiny, PackType type);

// What one decode token reads of a model with these shapes and pack type: each layer's weights
// with its top-k routed experts (not all of them), and the final norm + lm_head.
struct DecodeBytes {
  uint64_t per_layer = 0, lm_head = 0;
  // The layers' share of a token's bytes with `layers` layers.
  double LayerShare(int layers) const;
};
DecodeBytes SyntheticDecodeBytes(bool tiny, PackType type);

// The layers of a model whose MoE layers read most of a decode token's bytes, as in the real
// model (60 layers: 93% for q4-mixed, the rest is lm_head): the fewest with a share of at least
// kMoeShareTarget, capped at what fits in two thirds of physical memory (the benchmark reads the
// weights into memory; on 24 GiB that is 3 q4-mixed layers, 41%); 1 to 60. Tiny: 2.
inline constexpr double kMoeShareTarget = 2.0 / 3.0;
int DefaultSyntheticLayers(bool tiny, PackType type);
// $XDG_CACHE_HOME/m3, else $HOME/.cache/m3.
std::string DefaultCacheDir();
// <cache_dir>/bench-model-<type>-<layers>L-v2 (bench-model-tiny-<type>-<layers>L-v2 for tiny).
std::string SyntheticModelDir(const std::string& cache_dir, int layers, bool tiny, PackType type);

// Reuses the cached folder when it is complete (config.json as generated, model.m3w opens and
// holds every tensor), otherwise (re)generates it: checks free disk space, streams the file in
// chunks with a progress line on `log`, writes model.m3w.partial and renames it when complete.
StatusOr<SyntheticModel> EnsureSyntheticModel(const SyntheticModelOptions& options, FILE* log);

}  // namespace m3::bench
