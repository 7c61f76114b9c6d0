// A GGUF read as a minimax-m3 model (model/gguf_source.h): the hyper-parameters into a config, the
// tensors matched to the names and shapes it implies, the tokenizer and chat template written as
// tokenizer.json, and the first and last rows of every tensor decoded (norms back to w). Whatever
// the file holds: a clear error or a model whose every tensor decodes.
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "fuzz_util.h"
#include "model/gguf_source.h"
#include "model/weights.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = m3::fuzz::WriteInput("model.gguf", data, size);
  auto src = m3::GgufSource::Open(path);
  if (!src.ok()) return 0;
  const std::string dir = std::filesystem::path(path).parent_path() / "tokenizer";
  std::filesystem::create_directories(dir);
  (void)(*src)->WriteTokenizerFiles(dir);
  m3::ModelWeights scratch;
  std::vector<float> row;
  m3::ForEachTensor((*src)->config(), 0, &scratch, [&](m3::TensorSlot& s) {
    const m3::GgufSource::Tensor* t = (*src)->Find(s.name);
    if (!t || t->cols > (1u << 16)) return;
    row.resize(t->cols);
    // Open checked every tensor's type, shape and bytes: its rows must decode.
    if (!(*src)->DecodeRows(*t, 0, 1, row.data()).ok() || !(*src)->DecodeRows(*t, t->rows - 1, 1, row.data()).ok())
      std::abort();
  });
  return 0;
}
