// How much a packed model differs from the checkpoint it was packed from: weight reconstruction
// error (against llama.cpp's Q4_0 at the same 4.5 bits for the q4 tensors) and the logits of a
// prompt (KL divergence and top-1 agreement against the unpacked fp32 engine).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/imatrix.h"

namespace m3 {

struct PackQuality {
  size_t rows = 0;          // logit rows compared (prompt positions + decode steps)
  double kl_mean = 0;       // mean over rows of KL(p_source || p_packed), nats
  double kl_max = 0;
  double top1 = 0;          // fraction of rows with the same argmax
  // Over every tensor stored as q4 (0 weights when none): sum (w - w')^2 / sum w^2.
  size_t q4_weights = 0;
  double q4_rel_mse = 0;    // m3 q4
  double q4_0_rel_mse = 0;  // llama.cpp Q4_0 on the same rows
  double q8_rel_mse = 0;    // over tensors stored as q8
  size_t sub4_weights = 0;  // over tensors stored as q3 or q2 (0 when none)
  double sub4_rel_mse = 0;
  // With an importance matrix: the same over the tensors it covers, each input's error and
  // value weighted by its importance (what m3 pack --imatrix minimises); 0 without.
  double q4_wrel_mse = 0, sub4_wrel_mse = 0;
};

// Runs `prompt` through both models (all rows), then `decode_steps` tokens chosen greedily by the
// source model, fed to both (teacher forcing, so the same positions are compared). `importance`
// (or null) weighs the *_wrel_mse figures.
StatusOr<PackQuality> MeasurePackQuality(const std::string& source_dir, const std::string& packed_dir,
                                         const std::vector<int32_t>& prompt, int decode_steps, int threads,
                                         const ImportanceMatrix* importance = nullptr);

// An importance matrix of `model_dir` (m3 imatrix's) from `chunks` chunks of `context` token ids
// that are not a golden prompt (a fixed pseudo-random sequence), written to `path`.
Status CollectCalibrationImportance(const std::string& model_dir, const std::string& path, size_t chunks,
                                    size_t context, int threads);

}  // namespace m3
