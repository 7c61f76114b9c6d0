// Importance of each matrix's inputs, for quantization that weighs errors by it (m3 imatrix,
// m3 pack --imatrix).
//
// For a matrix W [rows, cols] that multiplies inputs x, the expected squared error of its outputs
// from an error E in W is sum_i E[x_i^2] |E[:, i]|^2 when the inputs are uncorrelated: input i's
// mean square weighs the error of column i. ImportanceCollector gathers those mean squares over
// calibration text, every matrix from the rows it multiplied (a routed expert from the tokens
// routed to it); the file is safetensors: per matrix one F32 [cols] tensor named as the matrix,
// its token count and the run's details in the metadata.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "model/model.h"

namespace m3 {

inline constexpr const char* kImatrixFormat = "m3-imatrix-1";

class ImportanceCollector : public ForwardObserver, public MatMulObserver {
 public:
  // Every matrix of `model` (ForEachTensor's names).
  explicit ImportanceCollector(const Model& model);

  MatMulObserver* matmul_observer() override { return this; }
  void OnMatMulInput(const simd::WeightRef& w, const float* x, size_t ldx, size_t n, const uint32_t* rows) override;

  // Matrices that saw at least one row, and those the model has.
  size_t matrices_seen() const;
  size_t matrices() const { return entries_.size(); }
  // Writes the mean squares of every matrix that saw a row (kImatrixFormat), with `metadata`
  // (strings: the model, the calibration text, tokens) besides each matrix's token count.
  Status Save(const std::string& path, std::map<std::string, std::string> metadata) const;

 private:
  struct Entry {
    std::string name;
    size_t cols = 0;
    std::vector<double> sum_sq;
    uint64_t rows = 0;
  };
  std::vector<Entry> entries_;
  std::unordered_map<const void*, size_t> by_data_;  // a matrix's first byte -> its entry
};

// A file ImportanceCollector::Save wrote, checked against the model it is used for.
class ImportanceMatrix {
 public:
  // Reads and validates the file: its format tag, F32 1-D tensors of finite, non-negative values.
  static StatusOr<ImportanceMatrix> Load(const std::string& path);
  // Every tensor must name a matrix of the model (`matrices`: name -> cols) with its column count.
  Status CheckAgainst(const std::map<std::string, size_t>& matrices) const;
  // The weights of `name`'s inputs (cols values) for the quantizers, or null when the file has
  // none for it (the matrix then quantizes unweighted): the mean squares plus 1% of their mean,
  // so that an input the calibration text never excited still counts a little.
  const float* Find(const std::string& name) const;
  size_t size() const { return importance_.size(); }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::map<std::string, std::vector<float>> importance_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace m3
