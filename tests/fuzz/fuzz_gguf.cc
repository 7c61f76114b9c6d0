// A GGUF file (format/gguf.h): header, metadata of every value type, tensor infos, alignment, data
// ranges; then every getter on every key, and the first block and first row of every tensor that
// can be decoded (whatever they hold, decoding a checked range must stay inside the mapping).
#include <cstdlib>
#include <vector>

#include "format/gguf.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = m3::fuzz::WriteInput("model.gguf", data, size);
  auto file = m3::GgufFile::Open(path);
  if (!file.ok()) return 0;
  const m3::GgufMetadata& meta = (*file)->metadata();
  for (const m3::GgufKeyValue& kv : meta.entries()) {
    (void)meta.GetString(kv.key);
    (void)meta.GetInt(kv.key);
    (void)meta.GetFloat(kv.key);
    (void)meta.GetBool(kv.key);
    (void)meta.GetStringArray(kv.key);
    (void)meta.GetIntArray(kv.key);
    (void)meta.GetNumberArray(kv.key);
  }
  std::vector<float> out;
  for (const m3::GgufTensorInfo& t : (*file)->tensors()) {
    if (!m3::CanDequantizeGgml(t.type) || t.n_elements == 0) continue;
    const m3::GgmlTypeInfo* type = m3::FindGgmlType(static_cast<uint32_t>(t.type));
    out.resize(type->block_elements);
    // A listed tensor of a decodable type has whole blocks inside the file: decoding must succeed.
    if (!m3::DequantizeGgml(t.type, t.data, type->block_elements, out.data()).ok()) std::abort();
    if (t.row_elements() <= (1u << 16)) {
      out.resize(t.row_elements());
      if (!m3::DequantizeGgufRows(t, t.n_rows() - 1, 1, out.data()).ok()) std::abort();
    }
  }
  // The same file as a set (a name without -0000i-of-0000n: one file, or a clear error).
  (void)m3::GgufShardSet::Open(path);
  return 0;
}
