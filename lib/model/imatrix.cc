#include "model/imatrix.h"

#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "format/safetensors.h"
#include "model/weights.h"

namespace m3 {

ImportanceCollector::ImportanceCollector(const Model& model) {
  ModelWeights weights = model.weights();  // ForEachTensor binds into a ModelWeights; the refs are the model's
  ForEachTensor(model.config(), model.stats().mtp_depths, &weights, [&](TensorSlot& s) {
    if (!s.matrix || !s.matrix->data || by_data_.count(s.matrix->data)) return;
    by_data_[s.matrix->data] = entries_.size();
    entries_.push_back(Entry{s.name, s.matrix->cols, std::vector<double>(s.matrix->cols, 0.0), 0});
  });
}

void ImportanceCollector::OnMatMulInput(const simd::WeightRef& w, const float* x, size_t ldx, size_t n,
                                        const uint32_t* rows) {
  const auto it = by_data_.find(w.data);
  if (it == by_data_.end() || n == 0) return;  // a copy (NUMA placement) or a slice is not the model's matrix
  Entry& e = entries_[it->second];
  if (e.cols != w.cols) return;
  for (size_t i = 0; i < n; ++i) {
    const float* r = x + (rows ? rows[i] : i) * ldx;
    for (size_t c = 0; c < e.cols; ++c) e.sum_sq[c] += static_cast<double>(r[c]) * r[c];
  }
  e.rows += n;
}

size_t ImportanceCollector::matrices_seen() const {
  size_t n = 0;
  for (const Entry& e : entries_) n += e.rows > 0;
  return n;
}

Status ImportanceCollector::Save(const std::string& path, std::map<std::string, std::string> metadata) const {
  std::vector<std::vector<float>> means;
  std::vector<F32Tensor> tensors;
  nlohmann::json counts = nlohmann::json::object();
  means.reserve(entries_.size());
  for (const Entry& e : entries_) {
    if (e.rows == 0) continue;
    std::vector<float>& m = means.emplace_back(e.cols);
    for (size_t c = 0; c < e.cols; ++c) m[c] = static_cast<float>(e.sum_sq[c] / static_cast<double>(e.rows));
    tensors.push_back(F32Tensor{e.name, {static_cast<int64_t>(e.cols)}, m.data()});
    counts[e.name] = e.rows;
  }
  metadata["format"] = kImatrixFormat;
  metadata["rows"] = counts.dump();
  return WriteSafetensors(path, tensors, metadata);
}

StatusOr<ImportanceMatrix> ImportanceMatrix::Load(const std::string& path) {
  M3_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  ImportanceMatrix m;
  m.path_ = path;
  m.metadata_ = file->metadata();
  const auto format = m.metadata_.find("format");
  if (format == m.metadata_.end() || format->second != kImatrixFormat)
    return InvalidArgument(path, ": not an importance matrix of m3 imatrix (metadata 'format' is not '", kImatrixFormat,
                           "')");
  for (const TensorInfo& t : file->tensors()) {
    const std::string where = path + ": tensor '" + t.name + "'";
    if (t.dtype != DType::kF32 || t.shape.size() != 1 || t.shape[0] <= 0)
      return InvalidArgument(where, " must be F32 with one dimension, not ", DTypeName(t.dtype), " ", t.ShapeString());
    std::vector<float> v(static_cast<size_t>(t.shape[0]));
    std::memcpy(v.data(), t.data, v.size() * sizeof(float));
    double mean = 0;
    for (size_t c = 0; c < v.size(); ++c) {
      if (!std::isfinite(v[c]) || v[c] < 0)
        return InvalidArgument(where, ": value ", v[c], " at ", c, " is not a finite mean square (>= 0)");
      mean += v[c];
    }
    mean /= static_cast<double>(v.size());
    if (!(mean > 0)) continue;  // every input zero: nothing to weigh by
    for (float& x : v) x += static_cast<float>(0.01 * mean);
    m.importance_[t.name] = std::move(v);
  }
  return m;
}

Status ImportanceMatrix::CheckAgainst(const std::map<std::string, size_t>& matrices) const {
  for (const auto& [name, v] : importance_) {
    const auto it = matrices.find(name);
    if (it == matrices.end())
      return InvalidArgument(path_, ": '", name, "' is not a matrix of this model (an importance matrix of another model?)");
    if (it->second != v.size())
      return InvalidArgument(path_, ": '", name, "' has ", v.size(), " inputs in the importance matrix but ", it->second,
                             " in the model");
  }
  return Status::Ok();
}

const float* ImportanceMatrix::Find(const std::string& name) const {
  const auto it = importance_.find(name);
  return it == importance_.end() ? nullptr : it->second.data();
}

}  // namespace m3
