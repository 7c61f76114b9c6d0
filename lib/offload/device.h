// What the dense part of a forward pass needs from an accelerator (issue 34): memory, copies in
// stream order, and a dozen fp32 operations. DenseOffload (dense_offload.h) drives the model
// through this interface alone; lib/offload/cuda implements it on a GPU, and HostDevice
// (host_device.h) in plain C++ on the CPU: the scalar reference every GPU kernel is tested
// against, and what lets the offloaded forward pass be tested against the golden cases on a
// machine without a GPU.
//
// Addresses returned by Allocate are the device's; the host reads and writes them only through
// ToDevice / ToHost. Every call is queued in order on one stream and returns at once; Wait()
// blocks until everything queued has run (and reports a failure of any of it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "offload/device_layout.h"

namespace m3 {

// A weight matrix in device memory, in its device layout (device_layout.h).
struct DeviceMatrix {
  DeviceLayout layout;
  void* codes = nullptr;    // layout.code_bytes
  float* scales = nullptr;  // layout.scale_bytes (quantized layouts only)
  uint64_t bytes() const { return layout.bytes(); }
};

// Shapes of one attention call: Hq query heads read KV head j / (Hq / Hkv); with a block
// selection, query head j reads the blocks of index head j / (Hq / Hi).
struct DeviceAttentionShape {
  int heads = 1, kv_heads = 1, head_dim = 1;
  int index_heads = 1, block_size = 1, topk = 1;  // with a selection only
};

// A check for NaN and inf folded into an operation that reads (RmsNorm: its input) or writes
// (NormRope: its output) the values anyway: a row with one sets *flag = min(*flag, stage << 40 |
// row), as FlagNonFinite does. No flag: no check.
struct FiniteCheck {
  uint64_t* flag = nullptr;
  uint32_t stage = 0;
};

struct DeviceSwiglu {
  float alpha = 1.702f, limit = 7.0f, beta = 1.0f;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string Describe() const = 0;  // e.g. "cuda: NVIDIA H100 80GB HBM3 (sm_90)"
  virtual uint64_t FreeBytes() const = 0;

  // Memory. An allocation that does not fit is an OutOfMemory status naming `what`.
  virtual StatusOr<void*> Allocate(size_t bytes, const std::string& what) = 0;
  virtual void Free(void* p) = 0;
  // Host memory the device copies to and from fastest (pinned), for the per-layer handoffs.
  virtual StatusOr<void*> AllocateHost(size_t bytes) = 0;
  virtual void FreeHost(void* p) = 0;
  // A weight in its device layout: converted from the mapped file a bounded piece at a time, or
  // copied straight from the mapping where the layouts agree (never a second host copy).
  virtual StatusOr<DeviceMatrix> Upload(const simd::WeightRef& w, const std::string& what) = 0;

  // Copies, queued. The host side of ToDevice must stay unchanged until the copy has run.
  virtual void ToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual void ToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;  // device to device
  virtual Status Wait() = 0;

  // Timing marks in stream order: Mark() returns an id; Seconds(a, b) the device time between
  // two marks once both have run (after a Wait). ResetMarks() forgets them all.
  virtual int Mark() = 0;
  virtual double Seconds(int a, int b) = 0;
  virtual void ResetMarks() = 0;

  // ---- Operations (fp32 activations; weights decoded exactly, fp32 accumulation). ----
  // y[t * ldy + r] (accumulate ? += : =) sum_c W[r, c] * x[t * W.cols + c] for t < n.
  virtual void MatMul(const DeviceMatrix& w, const float* x, size_t n, float* y, size_t ldy, bool accumulate) = 0;
  // Several products of one x (each w has x's cols): MatMul on each, in one launch where the
  // device can (the attention's q/k/v and indexer projections; an MLP's gate and up).
  struct MatMulJob {
    const DeviceMatrix* w;
    float* y;
    size_t ldy;
    bool accumulate;
  };
  virtual void MatMulMany(const MatMulJob* jobs, size_t count, const float* x, size_t n) {
    for (size_t i = 0; i < count; ++i) MatMul(*jobs[i].w, x, n, jobs[i].y, jobs[i].ldy, jobs[i].accumulate);
  }
  // y row = x row / sqrt(mean(x row^2) + eps) * scale, n rows of dim (contiguous); y may be x.
  // With `add`, x += add first (the residual stream taking a block's output) and the check and
  // the norm see the sum.
  virtual void RmsNorm(float* x, const float* add, size_t n, size_t dim, const float* scale, float eps, float* y,
                       FiniteCheck check) = 0;
  // For each of n * heads vectors of dim (contiguous; token t's heads together): an RMSNorm with
  // `scale` (none when null), then NeoX RoPE on the first rotary_dim values with token t's
  // cos/sin pairs rope[t][i] = {cos, sin} (i < rotary_dim / 2). The check's row is the token.
  struct NormRopeJob {
    float* x;
    size_t heads, dim;
    const float* scale;
    FiniteCheck check;
  };
  // Several at once (q, k, and the indexer's q and k), in one launch where the device can.
  virtual void NormRope(const NormRopeJob* jobs, size_t count, size_t n, float eps, const float* rope,
                        size_t rotary_dim) = 0;
  // Lightning-indexer block scores of n queries at positions pos0.. (iq [n][heads][dim]; keys
  // [rows][dim]): scores[t][h][b] = max over visible keys u of block b (u <= pos0 + t) of
  // iq[t][h] . key[u] (fma over d in order; a NaN dot never wins), -inf for a block not yet
  // visible; b < blocks.
  virtual void IndexScores(const float* iq, size_t n, int64_t pos0, const float* keys, size_t heads, size_t dim,
                           size_t block_size, size_t blocks, float* scores) = 0;
  // out[t][j] = softmax(q[t][j] . K^T / sqrt(D)) V over keys u <= pos0 + t, or only those of the
  // blocks selected for (t, index head of j) (blocks [n][Hi][topk], counts [n][Hi]; null: dense).
  // K and V: [rows][Hkv][D].
  virtual void Attention(const DeviceAttentionShape& s, const float* q, size_t n, int64_t pos0, const float* k,
                         const float* v, const int32_t* blocks, const int32_t* counts, float* out) = 0;
  // g[i] = swiglu_oai(g[i], u[i]) (ops/mlp.h), NaN where either is not finite.
  virtual void Swiglu(float* g, const float* u, size_t n, const DeviceSwiglu& p) = 0;
  // y[i] += x[i].
  virtual void Add(const float* x, size_t n, float* y) = 0;
  // Where x [rows][width] holds a value that is not finite, *flag = min(*flag, stage << 40 | row)
  // (the first row of the first stage that went wrong; the pass clears it to ~0 at its start).
  virtual void FlagNonFinite(const float* x, size_t rows, size_t width, uint32_t stage, uint64_t* flag) = 0;
};

// The GPU device `ordinal`: Unsupported in a build without CUDA, NotFound without a usable GPU.
StatusOr<std::unique_ptr<Device>> OpenGpuDevice(int ordinal);

}  // namespace m3
