// A llama.cpp GGUF of the `minimax-m3` architecture (one file or a gguf-split set) read as the
// HuggingFace checkpoint it was converted from, for `m3 pack -m FILE.gguf` (docs/GGUF.md).
//
// llama.cpp's converter (conversion/minimax.py) renames the tensors (blk.N.attn_q.weight, ...),
// stacks each layer's routed experts into one 3-D tensor per projection, stores every Gemma norm
// as 1 + w (in f32), the indexer in f32, and the hyper-parameters as minimax-m3.* keys; the
// tokenizer as tokenizer.ggml.* arrays and the chat template as tokenizer.chat_template. This
// undoes all of it: a config.json of the HuggingFace form (the fields GGUF does not carry take
// MiniMax-M3's values, which llama.cpp assumes as well: SwiGLU-OAI 1.702 / 7.0, sparse layers =
// MoE layers, no init blocks, max block scores), each tensor's rows decoded under its HF name
// (the norms back to w), and tokenizer.json + chat_template.jinja. Anything the file lacks, holds
// twice, holds in another shape, or holds beyond the model is refused by name.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "format/gguf.h"
#include "model/config.h"

namespace m3 {

// Whether `path` names a GGUF file (by its magic), so that m3 pack reads it as one.
bool IsGgufFile(const std::string& path);

class GgufSource {
 public:
  static StatusOr<std::unique_ptr<GgufSource>> Open(const std::string& path);

  const nlohmann::json& config_json() const { return config_json_; }
  const ModelConfig& config() const { return config_; }
  const GgufShardSet& file() const { return *file_; }

  // One HF tensor: where its rows are in the GGUF.
  struct Tensor {
    const GgufTensorInfo* gguf = nullptr;
    uint64_t first_row = 0;     // a routed expert: its slice of the stacked tensor
    uint64_t rows = 0, cols = 0;
    bool norm = false;          // stored as 1 + w
  };
  // nullptr when the model has no such tensor (e.g. lm_head with tied embeddings).
  const Tensor* Find(const std::string& hf_name) const;
  // Rows [r0, r0 + n) of `t` as the HF checkpoint holds them (norms as w).
  Status DecodeRows(const Tensor& t, uint64_t r0, uint64_t n, float* out) const;
  // How many tensors of each GGUF type the model's tensors were stored as ("Q4_K": 120, ...).
  std::map<std::string, size_t> type_counts() const;

  // Writes tokenizer.json, chat_template.jinja (when the file has a template) and
  // generation_config.json (its end-of-sequence id) into `dir`.
  Status WriteTokenizerFiles(const std::string& dir) const;

 private:
  std::unique_ptr<GgufShardSet> file_;
  nlohmann::json config_json_;
  ModelConfig config_;
  std::map<std::string, Tensor> tensors_;  // by HF name
};

}  // namespace m3
