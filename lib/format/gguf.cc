#include "format/gguf.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>

#include "simd/weight_format.h"

namespace m3 {
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// ggml types

namespace {

// Block sizes as ggml's type traits give them (checked against ggml in tests/test_gguf.cc).
constexpr GgmlTypeInfo kGgmlTypes[] = {
    {GgmlType::kF32, "F32", 1, 4, true},          {GgmlType::kF16, "F16", 1, 2, true},
    {GgmlType::kQ4_0, "Q4_0", 32, 18, true},      {GgmlType::kQ4_1, "Q4_1", 32, 20, true},
    {GgmlType::kQ5_0, "Q5_0", 32, 22, true},      {GgmlType::kQ5_1, "Q5_1", 32, 24, true},
    {GgmlType::kQ8_0, "Q8_0", 32, 34, true},      {GgmlType::kQ8_1, "Q8_1", 32, 36, false},
    {GgmlType::kQ2_K, "Q2_K", 256, 84, true},     {GgmlType::kQ3_K, "Q3_K", 256, 110, true},
    {GgmlType::kQ4_K, "Q4_K", 256, 144, true},    {GgmlType::kQ5_K, "Q5_K", 256, 176, true},
    {GgmlType::kQ6_K, "Q6_K", 256, 210, true},    {GgmlType::kQ8_K, "Q8_K", 256, 292, false},
    {GgmlType::kIQ2_XXS, "IQ2_XXS", 256, 66, false}, {GgmlType::kIQ2_XS, "IQ2_XS", 256, 74, false},
    {GgmlType::kIQ3_XXS, "IQ3_XXS", 256, 98, false}, {GgmlType::kIQ1_S, "IQ1_S", 256, 50, false},
    {GgmlType::kIQ4_NL, "IQ4_NL", 32, 18, false}, {GgmlType::kIQ3_S, "IQ3_S", 256, 110, false},
    {GgmlType::kIQ2_S, "IQ2_S", 256, 82, false},  {GgmlType::kIQ4_XS, "IQ4_XS", 256, 136, false},
    {GgmlType::kI8, "I8", 1, 1, false},           {GgmlType::kI16, "I16", 1, 2, false},
    {GgmlType::kI32, "I32", 1, 4, false},         {GgmlType::kI64, "I64", 1, 8, false},
    {GgmlType::kF64, "F64", 1, 8, false},         {GgmlType::kIQ1_M, "IQ1_M", 256, 56, false},
    {GgmlType::kBF16, "BF16", 1, 2, true},        {GgmlType::kTQ1_0, "TQ1_0", 256, 54, false},
    {GgmlType::kTQ2_0, "TQ2_0", 256, 66, false},  {GgmlType::kMXFP4, "MXFP4", 32, 17, false},
    {GgmlType::kNVFP4, "NVFP4", 64, 36, false},   {GgmlType::kQ1_0, "Q1_0", 128, 18, false},
    {GgmlType::kQ2_0, "Q2_0", 64, 18, false},
};

}  // namespace

const GgmlTypeInfo* FindGgmlType(uint32_t id) {
  for (const auto& t : kGgmlTypes)
    if (static_cast<uint32_t>(t.type) == id) return &t;
  return nullptr;
}

const char* GgmlTypeName(GgmlType type) {
  const GgmlTypeInfo* t = FindGgmlType(static_cast<uint32_t>(type));
  return t ? t->name : "?";
}

bool CanDequantizeGgml(GgmlType type) {
  const GgmlTypeInfo* t = FindGgmlType(static_cast<uint32_t>(type));
  return t && t->can_dequantize;
}

StatusOr<uint64_t> GgmlByteSize(GgmlType type, uint64_t n_elements) {
  const GgmlTypeInfo* t = FindGgmlType(static_cast<uint32_t>(type));
  if (!t) return InvalidArgument("ggml type id ", static_cast<uint32_t>(type), " is unknown");
  if (n_elements % t->block_elements)
    return InvalidArgument(n_elements, " values of ", t->name, " are not whole blocks of ", t->block_elements);
  const uint64_t blocks = n_elements / t->block_elements;
  if (blocks > std::numeric_limits<uint64_t>::max() / t->block_bytes)
    return InvalidArgument(n_elements, " values of ", t->name, ": byte size overflows");
  return blocks * t->block_bytes;
}

// ---------------------------------------------------------------------------------------------
// Dequantization: one function per block layout, each the formula of ggml's reference decoder
// with its operations in the same order, so the results are the same bits (fp16 and bf16 decode
// exactly). No multiply-add contraction (m3_format is built with -ffp-contract=off): a fused
// q*d + m rounds once, ggml's rounds twice.

namespace {

float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return simd::F16ToF32(h);
}

// Q8_0, 34 bytes per 32 values: fp16 d, int8 q[32]; x = q * d.
void DecodeQ8_0(const uint8_t* b, float* y) {
  const float d = HalfAt(b);
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

// Q4_0, 18 bytes per 32 values: fp16 d, 16 bytes of nibbles (value i low, i + 16 high);
// x = (q - 8) * d.
void DecodeQ4_0(const uint8_t* b, float* y) {
  const float d = HalfAt(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < 16; ++i) {
    y[i] = static_cast<float>((qs[i] & 0xF) - 8) * d;
    y[i + 16] = static_cast<float>((qs[i] >> 4) - 8) * d;
  }
}

// Q4_1, 20 bytes per 32 values: fp16 d, fp16 m, nibbles as Q4_0; x = q * d + m.
void DecodeQ4_1(const uint8_t* b, float* y) {
  const float d = HalfAt(b), m = HalfAt(b + 2);
  const uint8_t* qs = b + 4;
  for (int i = 0; i < 16; ++i) {
    y[i] = static_cast<float>(qs[i] & 0xF) * d + m;
    y[i + 16] = static_cast<float>(qs[i] >> 4) * d + m;
  }
}

// Fifth bits of Q5_0 / Q5_1: bit i of a little-endian u32 belongs to value i.
uint32_t FifthBits(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

// Q5_0, 22 bytes per 32 values: fp16 d, u32 fifth bits, nibbles as Q4_0; x = (q - 16) * d.
void DecodeQ5_0(const uint8_t* b, float* y) {
  const float d = HalfAt(b);
  const uint32_t high = FifthBits(b + 2);
  const uint8_t* qs = b + 6;
  for (int i = 0; i < 16; ++i) {
    const int q0 = static_cast<int>((qs[i] & 0xF) | (((high >> i) & 1) << 4));
    const int q1 = static_cast<int>((qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4));
    y[i] = static_cast<float>(q0 - 16) * d;
    y[i + 16] = static_cast<float>(q1 - 16) * d;
  }
}

// Q5_1, 24 bytes per 32 values: fp16 d, fp16 m, u32 fifth bits, nibbles; x = q * d + m.
void DecodeQ5_1(const uint8_t* b, float* y) {
  const float d = HalfAt(b), m = HalfAt(b + 2);
  const uint32_t high = FifthBits(b + 4);
  const uint8_t* qs = b + 8;
  for (int i = 0; i < 16; ++i) {
    const int q0 = static_cast<int>((qs[i] & 0xF) | (((high >> i) & 1) << 4));
    const int q1 = static_cast<int>((qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4));
    y[i] = static_cast<float>(q0) * d + m;
    y[i + 16] = static_cast<float>(q1) * d + m;
  }
}

// The 2-bit codes of Q2_K and Q3_K: value v of the 256 (half h = v / 128, within it w = v % 128)
// is bits 2 * (w / 32) of qs[32 * h + w % 32].
int TwoBitCode(const uint8_t* qs, int v) {
  const int h = v / 128, w = v % 128;
  return (qs[32 * h + w % 32] >> (2 * (w / 32))) & 3;
}

// Q2_K, 84 bytes per 256 values: u8 scales[16] (low nibble: scale, high: min, one per 16
// values), qs[64] 2-bit codes, fp16 d, fp16 dmin; x = (d * scale) * q - (dmin * min).
void DecodeQ2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = HalfAt(b + 80), dmin = HalfAt(b + 82);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(scales[g] & 0xF);
    const float ml = dmin * static_cast<float>(scales[g] >> 4);
    for (int v = 16 * g; v < 16 * g + 16; ++v) y[v] = dl * static_cast<float>(TwoBitCode(qs, v)) - ml;
  }
}

// Q3_K, 110 bytes per 256 values: hmask[32] (third bits: value v's is bit v / 32 of
// hmask[v % 32]), qs[64] 2-bit codes as Q2_K, 12 bytes of 6-bit scales, fp16 d;
// x = (d * (scale - 32)) * (code - (third bit ? 0 : 4)).
void DecodeQ3_K(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* packed = b + 96;
  const float d = HalfAt(b + 108);
  for (int g = 0; g < 16; ++g) {
    // Scale g: low 4 bits in the nibble g / 8 of byte g % 8, high 2 bits at 2 * (g / 4) of byte 8 + g % 4.
    const int low = (packed[g % 8] >> (4 * (g / 8))) & 0xF;
    const int high = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
    const float dl = d * static_cast<float>((low | high << 4) - 32);
    for (int v = 16 * g; v < 16 * g + 16; ++v) {
      const int third = (hmask[v % 32] >> (v / 32)) & 1;
      y[v] = dl * static_cast<float>(TwoBitCode(qs, v) - (third ? 0 : 4));
    }
  }
}

// The 6-bit scale and min of group g (of 8) in the 12 bytes of Q4_K / Q5_K.
void ScaleMinK4(const uint8_t* s, int g, int* scale, int* min) {
  if (g < 4) {
    *scale = s[g] & 63;
    *min = s[g + 4] & 63;
  } else {
    *scale = (s[g + 4] & 0xF) | ((s[g - 4] >> 6) << 4);
    *min = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

// Q4_K, 144 bytes per 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (one per
// 32 values), qs[128]: values 64c..64c+31 are the low nibbles of qs[32c..], the next 32 the high
// ones; x = (d * scale) * q - (dmin * min).
void DecodeQ4_K(const uint8_t* b, float* y) {
  const float d = HalfAt(b), dmin = HalfAt(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    ScaleMinK4(scales, g, &scale, &min);
    const float dl = d * static_cast<float>(scale), ml = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int i = 0; i < 32; ++i) y[32 * g + i] = dl * static_cast<float>((q[i] >> shift) & 0xF) - ml;
  }
}

// Q5_K, 176 bytes per 256 values: as Q4_K with qh[32] between scales and qs: value 32g + i has
// its fifth bit at bit g of qh[i].
void DecodeQ5_K(const uint8_t* b, float* y) {
  const float d = HalfAt(b), dmin = HalfAt(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    ScaleMinK4(scales, g, &scale, &min);
    const float dl = d * static_cast<float>(scale), ml = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int i = 0; i < 32; ++i) {
      const int code = ((q[i] >> shift) & 0xF) + (((qh[i] >> g) & 1) << 4);
      y[32 * g + i] = dl * static_cast<float>(code) - ml;
    }
  }
}

// Q6_K, 210 bytes per 256 values: ql[128] low nibbles, qh[64] high 2-bit pairs, int8 scales[16]
// (one per 16 values), fp16 d. Per half h (128 values, ql + 64h, qh + 32h) and quarter k:
// value 128h + 32k + i has low nibble (k odd: ql[i + 32] else ql[i]) >> (k >= 2 ? 4 : 0) and high
// bits (qh[i] >> 2k) & 3; x = (d * scale) * (code - 32).
void DecodeQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql_all = b;
  const uint8_t* qh_all = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = HalfAt(b + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = ql_all + 64 * h;
    const uint8_t* qh = qh_all + 32 * h;
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 32; ++i) {
        const int low = (ql[i + 32 * (k % 2)] >> (4 * (k / 2))) & 0xF;
        const int code = low | (((qh[i] >> (2 * k)) & 3) << 4);
        const int v = 128 * h + 32 * k + i;
        y[v] = d * static_cast<float>(scales[v / 16]) * static_cast<float>(code - 32);
      }
    }
  }
}

}  // namespace

Status DequantizeGgml(GgmlType type, const uint8_t* src, size_t n_elements, float* out) {
  const GgmlTypeInfo* t = FindGgmlType(static_cast<uint32_t>(type));
  if (!t) return Unsupported("ggml type id ", static_cast<uint32_t>(type), " is unknown");
  if (!t->can_dequantize) return Unsupported("ggml type ", t->name, " cannot be dequantized (not implemented)");
  if (n_elements % t->block_elements)
    return InvalidArgument(n_elements, " values of ", t->name, " are not whole blocks of ", t->block_elements);
  const size_t blocks = n_elements / t->block_elements;
  void (*decode)(const uint8_t*, float*) = nullptr;
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(out, src, n_elements * 4);
      return Status::Ok();
    case GgmlType::kF16:
      for (size_t i = 0; i < n_elements; ++i) out[i] = HalfAt(src + 2 * i);
      return Status::Ok();
    case GgmlType::kBF16:
      for (size_t i = 0; i < n_elements; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = simd::Bf16ToF32(h);
      }
      return Status::Ok();
    case GgmlType::kQ8_0: decode = DecodeQ8_0; break;
    case GgmlType::kQ4_0: decode = DecodeQ4_0; break;
    case GgmlType::kQ4_1: decode = DecodeQ4_1; break;
    case GgmlType::kQ5_0: decode = DecodeQ5_0; break;
    case GgmlType::kQ5_1: decode = DecodeQ5_1; break;
    case GgmlType::kQ2_K: decode = DecodeQ2_K; break;
    case GgmlType::kQ3_K: decode = DecodeQ3_K; break;
    case GgmlType::kQ4_K: decode = DecodeQ4_K; break;
    case GgmlType::kQ5_K: decode = DecodeQ5_K; break;
    case GgmlType::kQ6_K: decode = DecodeQ6_K; break;
    default: return Internal("ggml type ", t->name, " is marked decodable but has no decoder");
  }
  for (size_t i = 0; i < blocks; ++i) decode(src + i * t->block_bytes, out + i * t->block_elements);
  return Status::Ok();
}

std::string GgufTensorInfo::ShapeString() const {
  std::string s = "[";
  for (uint32_t i = 0; i < n_dims; ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

Status DequantizeGgufRows(const GgufTensorInfo& t, uint64_t first_row, uint64_t n_rows, float* out) {
  const std::string& path = t.file ? t.file->path() : t.name;
  if (!CanDequantizeGgml(t.type))
    return Unsupported(path, ": tensor '", t.name, "' is ", GgmlTypeName(t.type), ", which m3 cannot dequantize");
  const uint64_t rows = t.n_rows();
  if (first_row > rows || n_rows > rows - first_row)
    return OutOfRange(path, ": tensor '", t.name, "': rows [", first_row, ", ", first_row + n_rows, ") are not all among its ",
                      rows, " rows");
  return DequantizeGgml(t.type, t.data + first_row * t.row_bytes(), n_rows * t.row_elements(), out);
}

// ---------------------------------------------------------------------------------------------
// Metadata

namespace {

// Bytes of one scalar value; 0 for strings and arrays.
size_t ScalarBytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool: return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16: return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32: return 4;
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64: return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray: return 0;
  }
  return 0;
}

bool IsInteger(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kU16:
    case GgufValueType::kI16:
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kU64:
    case GgufValueType::kI64: return true;
    default: return false;
  }
}

template <class T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// An integer element of type t at p; false for a u64 above INT64_MAX.
bool LoadInt(GgufValueType t, const uint8_t* p, int64_t* v) {
  switch (t) {
    case GgufValueType::kU8: *v = Load<uint8_t>(p); return true;
    case GgufValueType::kI8: *v = Load<int8_t>(p); return true;
    case GgufValueType::kU16: *v = Load<uint16_t>(p); return true;
    case GgufValueType::kI16: *v = Load<int16_t>(p); return true;
    case GgufValueType::kU32: *v = Load<uint32_t>(p); return true;
    case GgufValueType::kI32: *v = Load<int32_t>(p); return true;
    case GgufValueType::kI64: *v = Load<int64_t>(p); return true;
    case GgufValueType::kU64: {
      const uint64_t u = Load<uint64_t>(p);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
      *v = static_cast<int64_t>(u);
      return true;
    }
    default: return false;
  }
}

std::string TypeDescription(const GgufKeyValue& kv) {
  if (kv.type != GgufValueType::kArray) return GgufValueTypeName(kv.type);
  return Str("array of ", GgufValueTypeName(kv.element_type));
}

}  // namespace

const char* GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kU8: return "u8";
    case GgufValueType::kI8: return "i8";
    case GgufValueType::kU16: return "u16";
    case GgufValueType::kI16: return "i16";
    case GgufValueType::kU32: return "u32";
    case GgufValueType::kI32: return "i32";
    case GgufValueType::kF32: return "f32";
    case GgufValueType::kBool: return "bool";
    case GgufValueType::kString: return "string";
    case GgufValueType::kArray: return "array";
    case GgufValueType::kU64: return "u64";
    case GgufValueType::kI64: return "i64";
    case GgufValueType::kF64: return "f64";
  }
  return "?";
}

const GgufKeyValue* GgufMetadata::Find(std::string_view key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

namespace {

StatusOr<const GgufKeyValue*> FindTyped(const GgufMetadata& m, std::string_view key, bool (*accepts)(const GgufKeyValue&),
                                        const char* wanted) {
  const GgufKeyValue* kv = m.Find(key);
  if (!kv) return NotFound(m.path(), ": metadata key '", key, "' is missing");
  if (!accepts(*kv))
    return Corrupt(m.path(), ": metadata key '", key, "' is ", TypeDescription(*kv), ", not ", wanted);
  return kv;
}

}  // namespace

StatusOr<std::string_view> GgufMetadata::GetString(std::string_view key) const {
  M3_ASSIGN_OR_RETURN(const GgufKeyValue* kv,
                      FindTyped(*this, key, [](const GgufKeyValue& v) { return v.type == GgufValueType::kString; }, "a string"));
  return std::string_view(reinterpret_cast<const char*>(kv->value + 8), kv->value_bytes - 8);
}

StatusOr<int64_t> GgufMetadata::GetInt(std::string_view key) const {
  M3_ASSIGN_OR_RETURN(const GgufKeyValue* kv,
                      FindTyped(*this, key, [](const GgufKeyValue& v) { return IsInteger(v.type); }, "an integer"));
  int64_t v;
  if (!LoadInt(kv->type, kv->value, &v))
    return OutOfRange(path_, ": metadata key '", key, "' = ", Load<uint64_t>(kv->value), " does not fit in int64");
  return v;
}

StatusOr<double> GgufMetadata::GetFloat(std::string_view key) const {
  M3_ASSIGN_OR_RETURN(const GgufKeyValue* kv, FindTyped(*this, key, [](const GgufKeyValue& v) {
    return v.type == GgufValueType::kF32 || v.type == GgufValueType::kF64;
  }, "a float"));
  return kv->type == GgufValueType::kF32 ? static_cast<double>(Load<float>(kv->value)) : Load<double>(kv->value);
}

StatusOr<bool> GgufMetadata::GetBool(std::string_view key) const {
  M3_ASSIGN_OR_RETURN(const GgufKeyValue* kv,
                      FindTyped(*this, key, [](const GgufKeyValue& v) { return v.type == GgufValueType::kBool; }, "a bool"));
  return kv->value[0] != 0;
}

StatusOr<std::vector<std::string_view>> GgufMetadata::GetStringArray(std::string_view key) const {
  M3_ASSIGN_OR_RETURN(const GgufKeyValue* kv, FindTyped(*this, key, [](const GgufKeyValue& v) {
    return v.type == GgufValueType::kArray && v.element_type == GgufValueType::kString;
  }, "an array of strings"));
  // Checked at open: count strings, each a u64 length and its bytes, fill value_bytes exactly.
  std::vector<std::string_view> out;
  out.reserve(kv->count);
  const uint8_t* p = kv->value;
  for (uint64_t i = 0; i < kv->count; ++i) {
    const uint64_t len = Load<uint64_t>(p);
    out.emplace_back(reinterpret_cast<const char*>(p + 8), len);
    p += 8 + len;
  }
  return out;
}

StatusOr<std::vector<int64_t>> GgufMetadata::GetIntArray(std::string_view key) const {
  M3_ASSIGN_OR_RETURN(const GgufKeyValue* kv, FindTyped(*this, key, [](const GgufKeyValue& v) {
    return v.type == GgufValueType::kArray && IsInteger(v.element_type);
  }, "an array of integers"));
  const size_t size = ScalarBytes(kv->element_type);
  std::vector<int64_t> out(kv->count);
  for (uint64_t i = 0; i < kv->count; ++i)
    if (!LoadInt(kv->element_type, kv->value + i * size, &out[i]))
      return OutOfRange(path_, ": metadata key '", key, "' element ", i, " = ", Load<uint64_t>(kv->value + i * size),
                        " does not fit in int64");
  return out;
}

StatusOr<std::vector<double>> GgufMetadata::GetNumberArray(std::string_view key) const {
  M3_ASSIGN_OR_RETURN(const GgufKeyValue* kv, FindTyped(*this, key, [](const GgufKeyValue& v) {
    return v.type == GgufValueType::kArray &&
           (IsInteger(v.element_type) || v.element_type == GgufValueType::kF32 || v.element_type == GgufValueType::kF64);
  }, "an array of numbers"));
  const size_t size = ScalarBytes(kv->element_type);
  std::vector<double> out(kv->count);
  for (uint64_t i = 0; i < kv->count; ++i) {
    const uint8_t* p = kv->value + i * size;
    int64_t v;
    if (kv->element_type == GgufValueType::kF32) out[i] = Load<float>(p);
    else if (kv->element_type == GgufValueType::kF64) out[i] = Load<double>(p);
    else if (kv->element_type == GgufValueType::kU64) out[i] = static_cast<double>(Load<uint64_t>(p));
    else if (LoadInt(kv->element_type, p, &v)) out[i] = static_cast<double>(v);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Parsing

namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr uint64_t kDefaultAlignment = 32;
// Writers use 32 (llama.cpp's default) up to a page; far larger is a damaged value.
constexpr uint64_t kMaxAlignment = uint64_t{1} << 24;
constexpr uint32_t kMaxDims = 4;
// Smallest encodings, to bound counts by the file's size before anything is allocated: a key/value
// is a key length (8), a type (4) and a 1-byte value; a tensor info a name length (8), n_dims (4),
// a type (4) and an offset (8); an array inside an array its type (4) and count (8).
constexpr uint64_t kMinKeyValueBytes = 13;
constexpr uint64_t kMinTensorInfoBytes = 24;
constexpr uint64_t kMinInnerArrayBytes = 12;
// Vectors grow with what the file really holds: a count is only a claim until its items are read.
constexpr uint64_t kMaxReserve = 4096;

// A read position in the mapping; every read checks the bytes are there.
class Reader {
 public:
  Reader(const std::string& path, const uint8_t* data, size_t size) : path_(path), data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  const uint8_t* here() const { return data_ + pos_; }

  // "x.gguf: truncated: <what> at byte N runs past the end of the file (S bytes)".
  template <class Describe>
  Status Truncated(size_t at, const Describe& what) const {
    return Corrupt(path_, ": truncated: ", what(), " at byte ", at, " runs past the end of the file (", size_, " bytes)");
  }

  template <class T, class Describe>
  Status Read(T* v, const Describe& what) {
    if (remaining() < sizeof(T)) return Truncated(pos_, what);
    std::memcpy(v, here(), sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }

  template <class Describe>
  Status Skip(uint64_t n, const Describe& what) {
    if (n > remaining()) return Truncated(pos_, what);
    pos_ += n;
    return Status::Ok();
  }

  template <class Describe>
  Status ReadString(std::string_view* s, const Describe& what) {
    const size_t at = pos_;
    uint64_t len = 0;
    M3_RETURN_IF_ERROR(Read(&len, [&] { return Str(what(), " (its length)"); }));
    if (len > remaining())
      return Corrupt(path_, ": ", what(), " at byte ", at, ": length ", len, " runs past the end of the file (", size_,
                     " bytes)");
    *s = std::string_view(reinterpret_cast<const char*>(here()), len);
    pos_ += len;
    return Status::Ok();
  }

 private:
  const std::string& path_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

bool KnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kF64); }

std::string Quoted(std::string_view s) {
  // Keys and names go into messages as they are, cut short if a damaged one is huge.
  constexpr size_t kMax = 200;
  return "'" + std::string(s.substr(0, kMax)) + (s.size() > kMax ? "...'" : "'");
}

// The elements of an array (after its element type and count); `depth` 0 for a key's array.
Status SkipArrayElements(Reader& r, const std::string& path, const std::string& key, GgufValueType element_type,
                         uint64_t count, int depth) {
  const auto where = [&] { return Str("metadata key ", Quoted(key), depth ? " (inner array)" : ""); };
  if (element_type == GgufValueType::kArray) {
    if (depth > 0)
      return Unsupported(path, ": ", where(), ": arrays nested more than one level deep are not supported");
    if (count > r.remaining() / kMinInnerArrayBytes)
      return Corrupt(path, ": ", where(), ": ", count, " inner arrays cannot fit in the ", r.remaining(),
                     " bytes left in the file");
    for (uint64_t i = 0; i < count; ++i) {
      uint32_t inner_type = 0;
      uint64_t inner_count = 0;
      M3_RETURN_IF_ERROR(r.Read(&inner_type, [&] { return Str(where(), " inner array ", i, " (its type)"); }));
      M3_RETURN_IF_ERROR(r.Read(&inner_count, [&] { return Str(where(), " inner array ", i, " (its count)"); }));
      if (!KnownValueType(inner_type))
        return Corrupt(path, ": ", where(), " inner array ", i, " has unknown element type ", inner_type);
      M3_RETURN_IF_ERROR(
          SkipArrayElements(r, path, key, static_cast<GgufValueType>(inner_type), inner_count, depth + 1));
    }
    return Status::Ok();
  }
  if (element_type == GgufValueType::kString) {
    if (count > r.remaining() / 8)
      return Corrupt(path, ": ", where(), ": ", count, " strings cannot fit in the ", r.remaining(),
                     " bytes left in the file");
    std::string_view s;
    for (uint64_t i = 0; i < count; ++i)
      M3_RETURN_IF_ERROR(r.ReadString(&s, [&] { return Str(where(), " string ", i); }));
    return Status::Ok();
  }
  const size_t size = ScalarBytes(element_type);
  if (count > r.remaining() / size)
    return Corrupt(path, ": ", where(), ": ", count, " ", GgufValueTypeName(element_type), " values (", size,
                   " bytes each) run past the end of the file (", r.remaining(), " bytes left)");
  return r.Skip(count * size, where);
}

Status ReadKeyValue(Reader& r, const std::string& path, uint64_t index, GgufKeyValue* kv) {
  std::string_view key;
  M3_RETURN_IF_ERROR(r.ReadString(&key, [&] { return Str("the key of metadata entry ", index); }));
  kv->key = std::string(key);
  const auto where = [&] { return Str("metadata key ", Quoted(kv->key)); };
  uint32_t type = 0;
  M3_RETURN_IF_ERROR(r.Read(&type, [&] { return Str(where(), " (its type)"); }));
  if (!KnownValueType(type)) return Corrupt(path, ": ", where(), " has unknown value type ", type);
  kv->type = static_cast<GgufValueType>(type);
  if (kv->type == GgufValueType::kArray) {
    uint32_t element_type = 0;
    M3_RETURN_IF_ERROR(r.Read(&element_type, [&] { return Str(where(), " (its element type)"); }));
    M3_RETURN_IF_ERROR(r.Read(&kv->count, [&] { return Str(where(), " (its element count)"); }));
    if (!KnownValueType(element_type))
      return Corrupt(path, ": ", where(), " is an array of unknown element type ", element_type);
    kv->element_type = static_cast<GgufValueType>(element_type);
    const size_t begin = r.pos();
    kv->value = r.here();
    M3_RETURN_IF_ERROR(SkipArrayElements(r, path, kv->key, kv->element_type, kv->count, 0));
    kv->value_bytes = r.pos() - begin;
    return Status::Ok();
  }
  const size_t begin = r.pos();
  kv->value = r.here();
  if (kv->type == GgufValueType::kString) {
    std::string_view s;
    M3_RETURN_IF_ERROR(r.ReadString(&s, where));
  } else {
    M3_RETURN_IF_ERROR(r.Skip(ScalarBytes(kv->type), where));
  }
  kv->value_bytes = r.pos() - begin;
  return Status::Ok();
}

bool IsPowerOfTwo(uint64_t v) { return v && !(v & (v - 1)); }

}  // namespace

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  auto g = std::make_unique<GgufFile>();
  M3_ASSIGN_OR_RETURN(g->file_, MappedFile::Open(path));
  const uint8_t* base = g->file_->data();
  const size_t size = g->file_->size();
  Reader r(path, base, size);

  // Header.
  if (size < 4) return Corrupt(path, ": truncated (", size, " bytes): not a GGUF file (no 4-byte magic)");
  if (std::memcmp(base, kMagic, 4) != 0) {
    char hex[40];
    std::snprintf(hex, sizeof(hex), "%02x %02x %02x %02x", base[0], base[1], base[2], base[3]);
    return Corrupt(path, ": not a GGUF file (starts with bytes ", hex, ", not \"GGUF\")");
  }
  M3_RETURN_IF_ERROR(r.Skip(4, [] { return "the magic"; }));
  M3_RETURN_IF_ERROR(r.Read(&g->version_, [] { return "the version"; }));
  if (g->version_ == 1)
    return Unsupported(path, ": GGUF version 1 (32-bit counts, 2023) is not supported; convert the model again with a "
                       "current llama.cpp (versions 2 and 3 are read)");
  if (g->version_ != 2 && g->version_ != 3) {
    if ((g->version_ & 0xFFFF) == 0 && (g->version_ >> 16) != 0)
      return Unsupported(path, ": big-endian GGUF (version field ", g->version_,
                         " is a small version byte-swapped); only little-endian files are read");
    return Unsupported(path, ": GGUF version ", g->version_, " is not supported (versions 2 and 3 are read)");
  }
  uint64_t n_tensors = 0, n_kv = 0;
  M3_RETURN_IF_ERROR(r.Read(&n_tensors, [] { return "the tensor count"; }));
  M3_RETURN_IF_ERROR(r.Read(&n_kv, [] { return "the metadata key count"; }));
  if (n_kv > r.remaining() / kMinKeyValueBytes)
    return Corrupt(path, ": metadata key count ", n_kv, " cannot fit in the file (", size, " bytes)");
  if (n_tensors > r.remaining() / kMinTensorInfoBytes)
    return Corrupt(path, ": tensor count ", n_tensors, " cannot fit in the file (", size, " bytes)");

  // Metadata.
  GgufMetadata& meta = g->metadata_;
  meta.path_ = path;
  meta.entries_.reserve(std::min(n_kv, kMaxReserve));
  for (uint64_t i = 0; i < n_kv; ++i) {
    GgufKeyValue kv;
    M3_RETURN_IF_ERROR(ReadKeyValue(r, path, i, &kv));
    if (meta.index_.count(kv.key))
      return Corrupt(path, ": metadata key ", Quoted(kv.key), " appears twice (entries ", meta.index_[kv.key], " and ", i,
                     ")");
    meta.index_.emplace(kv.key, meta.entries_.size());
    meta.entries_.push_back(std::move(kv));
  }
  g->alignment_ = kDefaultAlignment;
  if (meta.Has("general.alignment")) {
    StatusOr<int64_t> alignment = meta.GetInt("general.alignment");
    if (!alignment.ok()) return alignment.status();
    if (*alignment <= 0 || !IsPowerOfTwo(static_cast<uint64_t>(*alignment)) ||
        static_cast<uint64_t>(*alignment) > kMaxAlignment)
      return Corrupt(path, ": general.alignment = ", *alignment, " is not a power of two between 1 and ", kMaxAlignment);
    g->alignment_ = static_cast<uint64_t>(*alignment);
  }

  // Tensor infos.
  std::map<std::string_view, uint64_t> tensor_index;
  g->tensors_.reserve(std::min(n_tensors, kMaxReserve));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    std::string_view name;
    M3_RETURN_IF_ERROR(r.ReadString(&name, [&] { return Str("the name of tensor ", i); }));
    t.name = std::string(name);
    const std::string where = Str("tensor ", Quoted(t.name));
    const auto describe = [&](const char* field) { return [&where, field] { return Str(where, " (", field, ")"); }; };
    M3_RETURN_IF_ERROR(r.Read(&t.n_dims, describe("its dimension count")));
    if (t.n_dims > kMaxDims) return Corrupt(path, ": ", where, " has ", t.n_dims, " dimensions (at most ", kMaxDims, ")");
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      M3_RETURN_IF_ERROR(r.Read(&t.ne[d], describe("its shape")));
      if (t.ne[d] < 0) return Corrupt(path, ": ", where, " has a negative size ", t.ne[d], " in dimension ", d);
    }
    uint32_t type_id = 0;
    M3_RETURN_IF_ERROR(r.Read(&type_id, describe("its ggml type")));
    M3_RETURN_IF_ERROR(r.Read(&t.offset, describe("its data offset")));
    const GgmlTypeInfo* type = FindGgmlType(type_id);
    if (!type)
      return Unsupported(path, ": ", where, " has ggml type id ", type_id,
                         ", which this reader does not know (so it cannot tell the tensor's size)");
    t.type = type->type;
    if (auto [it, inserted] = tensor_index.emplace(name, i); !inserted)
      return Corrupt(path, ": ", where, " appears twice (tensors ", it->second, " and ", i, ")");
    g->tensors_.push_back(std::move(t));
  }

  // Data: after the tensor infos, at the next multiple of the alignment.
  const uint64_t header_end = r.pos();
  g->data_offset_ = (header_end + g->alignment_ - 1) / g->alignment_ * g->alignment_;
  for (GgufTensorInfo& t : g->tensors_) {
    const std::string where = Str("tensor ", Quoted(t.name));
    const GgmlTypeInfo& type = *FindGgmlType(static_cast<uint32_t>(t.type));
    if (static_cast<uint64_t>(t.ne[0]) % type.block_elements)
      return Corrupt(path, ": ", where, " of type ", type.name, " has ne[0] = ", t.ne[0],
                     ", not a multiple of its block of ", type.block_elements, " values");
    uint64_t n = 1;
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      const uint64_t e = static_cast<uint64_t>(t.ne[d]);
      if (e && n > std::numeric_limits<uint64_t>::max() / e)
        return Corrupt(path, ": ", where, " shape ", t.ShapeString(), ": element count overflows");
      n *= e;
    }
    t.n_elements = n;
    StatusOr<uint64_t> nbytes = GgmlByteSize(t.type, n);
    if (!nbytes.ok()) return Corrupt(path, ": ", where, " shape ", t.ShapeString(), ": ", nbytes.status().message());
    if (t.offset % g->alignment_)
      return Corrupt(path, ": ", where, " data offset ", t.offset, " is not a multiple of the alignment ", g->alignment_);
    const uint64_t begin = g->data_offset_ + t.offset;
    if (begin < t.offset || *nbytes > std::numeric_limits<uint64_t>::max() - begin || begin + *nbytes > size)
      return Corrupt(path, ": ", where, " data [", begin, ", ", begin + *nbytes, ") runs past the end of the file (", size,
                     " bytes)");
    t.data = base + begin;
    t.nbytes = *nbytes;
    t.file = g.get();
  }
  // Byte ranges must not overlap: a hostile file could alias one tensor onto another.
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& t : g->tensors_)
    if (t.nbytes) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& a = *by_offset[i - 1];
    const GgufTensorInfo& b = *by_offset[i];
    if (b.data < a.data + a.nbytes)
      return Corrupt(path, ": tensors ", Quoted(a.name), " (data [", a.offset, ", ", a.offset + a.nbytes, ")) and ",
                     Quoted(b.name), " (data [", b.offset, ", ", b.offset + b.nbytes, ")) overlap");
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// Split sets

namespace {

// "NAME-00002-of-00003.gguf" -> NAME, 2, 3 (numbers as written, 1-based); false for other names.
bool ParseShardName(const std::string& file_name, std::string* prefix, int* number, int* count) {
  constexpr std::string_view kSuffix = ".gguf";
  // "-NNNNN-of-NNNNN.gguf": 5 digits each, as llama.cpp writes them.
  constexpr size_t kTail = 1 + 5 + 4 + 5 + 5;
  if (file_name.size() <= kTail) return false;
  const std::string_view tail = std::string_view(file_name).substr(file_name.size() - kTail);
  if (tail.substr(kTail - kSuffix.size()) != kSuffix || tail[0] != '-' || tail.substr(6, 4) != "-of-") return false;
  int n = 0, c = 0;
  for (size_t i = 1; i < 6; ++i) {
    if (tail[i] < '0' || tail[i] > '9' || tail[i + 9] < '0' || tail[i + 9] > '9') return false;
    n = n * 10 + (tail[i] - '0');
    c = c * 10 + (tail[i + 9] - '0');
  }
  *prefix = file_name.substr(0, file_name.size() - kTail);
  *number = n;
  *count = c;
  return true;
}

std::string ShardName(const std::string& prefix, int number, int count) {
  char tail[32];
  std::snprintf(tail, sizeof(tail), "-%05d-of-%05d.gguf", number, count);
  return prefix + tail;
}

// split.no, split.count and split.tensors.count of a shard.
struct SplitKeys {
  int64_t no = 0, count = 1, tensors = 0;
};

StatusOr<SplitKeys> ReadSplitKeys(const GgufFile& f) {
  SplitKeys k;
  M3_ASSIGN_OR_RETURN(k.count, f.metadata().GetInt("split.count"));
  M3_ASSIGN_OR_RETURN(k.no, f.metadata().GetInt("split.no"));
  M3_ASSIGN_OR_RETURN(k.tensors, f.metadata().GetInt("split.tensors.count"));
  return k;
}

}  // namespace

StatusOr<std::unique_ptr<GgufShardSet>> GgufShardSet::Open(const std::string& path) {
  auto set = std::make_unique<GgufShardSet>();
  M3_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> first, GgufFile::Open(path));

  int64_t count = 1;
  if (first->metadata().Has("split.count")) {
    M3_ASSIGN_OR_RETURN(count, first->metadata().GetInt("split.count"));
    // gguf-split numbers shards with 5 digits.
    if (count < 1 || count > 99999) return Corrupt(path, ": split.count = ", count, " is not between 1 and 99999");
  }
  if (count == 1) {
    set->shards_.push_back(std::move(first));
  } else {
    M3_ASSIGN_OR_RETURN(const SplitKeys opened, ReadSplitKeys(*first));
    const fs::path p(path);
    std::string prefix;
    int number = 0, named_count = 0;
    if (!ParseShardName(p.filename().string(), &prefix, &number, &named_count))
      return Corrupt(path, ": a shard of a split set (split.count = ", count,
                     ") whose name does not follow NAME-00001-of-", ShardName("", 1, static_cast<int>(count)).substr(10),
                     ", so the other shards cannot be found");
    if (named_count != count || number != opened.no + 1)
      return Corrupt(path, ": the file name says shard ", number, " of ", named_count, " but its keys say split.no = ",
                     opened.no, " (shard ", opened.no + 1, ") of split.count = ", count);
    set->shards_.resize(static_cast<size_t>(count));
    for (int i = 0; i < count; ++i) {
      const std::string shard_path = (p.parent_path() / ShardName(prefix, i + 1, static_cast<int>(count))).string();
      std::unique_ptr<GgufFile> shard;
      if (i == opened.no) {
        shard = std::move(first);
      } else {
        std::error_code ec;
        if (!fs::exists(shard_path, ec))
          return NotFound(shard_path, ": shard ", i + 1, " of ", count, " of the split set of ", path, " is missing");
        M3_ASSIGN_OR_RETURN(shard, GgufFile::Open(shard_path));
      }
      if (!shard->metadata().Has("split.count"))
        return Corrupt(shard_path, ": has no split.count key, so it is not shard ", i + 1, " of ", count, " of ", path,
                       "'s set");
      M3_ASSIGN_OR_RETURN(const SplitKeys keys, ReadSplitKeys(*shard));
      if (keys.count != count)
        return Corrupt(shard_path, ": split.count = ", keys.count, " but ", path, " says ", count,
                       " (a shard of another set?)");
      if (keys.no != i)
        return Corrupt(shard_path, ": split.no = ", keys.no, " makes it shard ", keys.no + 1, ", but its name makes it shard ",
                       i + 1, " of ", count, " (a copy of another shard?)");
      if (keys.tensors != opened.tensors)
        return Corrupt(shard_path, ": split.tensors.count = ", keys.tensors, " but ", path, " says ", opened.tensors,
                       " (a shard of another set?)");
      set->shards_[static_cast<size_t>(i)] = std::move(shard);
    }
  }

  uint64_t total = 0;
  for (const auto& shard : set->shards_) {
    for (const GgufTensorInfo& t : shard->tensors()) {
      auto [it, inserted] = set->by_name_.emplace(t.name, &t);
      if (!inserted)
        return Corrupt(shard->path(), ": tensor ", Quoted(t.name), " is also in ", it->second->file->path());
      set->tensors_.push_back(&t);
      ++total;
    }
  }
  if (count > 1) {
    const GgufMetadata& m = set->shards_.front()->metadata();
    M3_ASSIGN_OR_RETURN(const int64_t expected, m.GetInt("split.tensors.count"));
    if (expected < 0 || total != static_cast<uint64_t>(expected))
      return Corrupt(m.path(), ": split.tensors.count = ", expected, " but the ", count, " shards hold ", total,
                     " tensors");
  }
  return set;
}

const GgufTensorInfo* GgufShardSet::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

}  // namespace m3
