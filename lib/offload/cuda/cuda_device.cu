// The Device interface (offload/device.h) on one CUDA GPU: one stream, fp32 activations, weights
// decoded in the kernels from their device layout (offload/device_layout.h), fp32 accumulation,
// no TF32 and no fast-math. Each kernel computes what HostDevice (offload/host_device.cc)
// defines; tests/test_offload.cc compares them where a GPU is present.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "offload/device.h"

namespace m3 {
namespace {

__constant__ float kFp8Values[256];  // E4M3 code -> value (simd::E4M3ToF32)

Status CudaError(cudaError_t e, const std::string& what) {
  return Internal("CUDA error in ", what, ": ", cudaGetErrorString(e));
}

#define M3_CUDA_RETURN(expr, what)                                     \
  do {                                                                 \
    const cudaError_t m3_cuda_e_ = (expr);                             \
    if (m3_cuda_e_ != cudaSuccess) return CudaError(m3_cuda_e_, what); \
  } while (0)

// ---- Weight decoding: 8 consecutive inputs c..c+7 (c a multiple of 8) of one row. ----
template <DeviceFormat F>
__device__ __forceinline__ void Load8(const uint8_t* __restrict__ row, const float* __restrict__ scales, size_t c,
                                      float w[8]) {
  if constexpr (F == DeviceFormat::kF32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(row + c * 4));
    const float4 b = __ldg(reinterpret_cast<const float4*>(row + c * 4) + 1);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else if constexpr (F == DeviceFormat::kBF16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + c * 2));
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = __uint_as_float(words[i] << 16);
      w[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
  } else if constexpr (F == DeviceFormat::kF16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + c * 2));
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] & 0xFFFFu)));
      w[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
    }
  } else if constexpr (F == DeviceFormat::kQ4) {
    const uint32_t v = __ldg(reinterpret_cast<const uint32_t*>(row + c / 2));
    const float s = __ldg(scales + c / kDeviceGroup);
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = static_cast<float>(static_cast<int>((v >> (4 * i)) & 0xFu) - 8) * s;
  } else {  // kFp8, kQ8: one byte a code
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(row + c));
    const float s = __ldg(scales + c / kDeviceGroup);
    const uint32_t words[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t code = (words[i / 4] >> (8 * (i % 4))) & 0xFFu;
      if constexpr (F == DeviceFormat::kFp8)
        w[i] = kFp8Values[code] * s;
      else
        w[i] = static_cast<float>(static_cast<int>(code) - 128) * s;
    }
  }
}

struct MatrixArgs {
  const uint8_t* codes;
  const float* scales;
  size_t rows, cols, padded, row_bytes, scale_cols;
};

// x[t][c..c+7] with zeros past cols.
__device__ __forceinline__ void LoadX8(const float* __restrict__ xt, size_t c, size_t cols, bool vec, float a[8]) {
  if (vec && c + 8 <= cols) {
    const float4 p = __ldg(reinterpret_cast<const float4*>(xt + c));
    const float4 q = __ldg(reinterpret_cast<const float4*>(xt + c) + 1);
    a[0] = p.x, a[1] = p.y, a[2] = p.z, a[3] = p.w, a[4] = q.x, a[5] = q.y, a[6] = q.z, a[7] = q.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = c + i < cols ? xt[c + i] : 0.0f;
  }
}

// ---- One token (decode): R rows a warp, each lane one 16-byte chunk of each row at a time. ----
// A chunk is 4 (f32), 8 (bf16, f16), 16 (fp8, q8) or 32 (q4) inputs, never across a scale group;
// the x values of a chunk are loaded once for the R rows.
template <DeviceFormat F>
__host__ __device__ constexpr int ChunkInputs() {
  return F == DeviceFormat::kF32 ? 4 : (F == DeviceFormat::kBF16 || F == DeviceFormat::kF16) ? 8 : F == DeviceFormat::kQ4 ? 32 : 16;
}
template <DeviceFormat F>
__host__ __device__ constexpr bool Scaled() {
  return F == DeviceFormat::kFp8 || F == DeviceFormat::kQ8 || F == DeviceFormat::kQ4;
}

// The chunk's dot product with x (codes unscaled: the caller multiplies by the group's scale).
template <DeviceFormat F>
__device__ __forceinline__ float ChunkDot(uint4 raw, const float* xv) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < ChunkInputs<F>(); ++i) {
    float v;
    if constexpr (F == DeviceFormat::kF32) {
      v = __uint_as_float(w[i]);
    } else if constexpr (F == DeviceFormat::kBF16) {
      v = __uint_as_float(i % 2 ? w[i / 2] & 0xFFFF0000u : w[i / 2] << 16);
    } else if constexpr (F == DeviceFormat::kF16) {
      v = __half2float(__ushort_as_half(static_cast<unsigned short>((w[i / 2] >> (16 * (i % 2))) & 0xFFFFu)));
    } else if constexpr (F == DeviceFormat::kQ4) {
      v = static_cast<float>(static_cast<int>((w[i / 8] >> (4 * (i % 8))) & 0xFu) - 8);
    } else {
      const uint32_t code = (w[i / 4] >> (8 * (i % 4))) & 0xFFu;
      if constexpr (F == DeviceFormat::kFp8)
        v = kFp8Values[code];
      else
        v = static_cast<float>(static_cast<int>(code) - 128);
    }
    s = fmaf(v, xv[i], s);
  }
  return s;
}

// Rows r0..r0+R-1 of m (those below m.rows) for one token, by one warp.
template <DeviceFormat F, int R>
__device__ __forceinline__ void GemvRows(const MatrixArgs& m, size_t r0, int lane, const float* __restrict__ x,
                                         float* y, bool accumulate) {
  constexpr int E = ChunkInputs<F>();
  const size_t chunks = m.padded / E;
  const bool vec = m.cols % 4 == 0;
  float sum[R];
#pragma unroll
  for (int i = 0; i < R; ++i) sum[i] = 0.0f;
#pragma unroll 2
  for (size_t k = lane; k < chunks; k += 32) {
    const size_t c = k * E;
    uint4 raw[R];
    float sc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const size_t r = min(r0 + i, m.rows - 1);  // rows past the end: computed, never written
      raw[i] = __ldg(reinterpret_cast<const uint4*>(m.codes + r * m.row_bytes) + k);
      if constexpr (Scaled<F>()) sc[i] = __ldg(m.scales + r * m.scale_cols + c / kDeviceGroup);
    }
    float xv[E];
#pragma unroll
    for (int j = 0; j < E; j += 4) {
      if (vec && c + j + 4 <= m.cols) {
        const float4 p = __ldg(reinterpret_cast<const float4*>(x + c + j));
        xv[j] = p.x, xv[j + 1] = p.y, xv[j + 2] = p.z, xv[j + 3] = p.w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[j + i] = c + j + i < m.cols ? x[c + j + i] : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float d = ChunkDot<F>(raw[i], xv);
      if constexpr (Scaled<F>())
        sum[i] = fmaf(d, sc[i], sum[i]);
      else
        sum[i] += d;
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    float s = sum[i];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if (lane == 0 && r0 + i < m.rows) y[r0 + i] = accumulate ? y[r0 + i] + s : s;
  }
}

template <DeviceFormat F, int R>
__global__ void GemvRowsKernel(MatrixArgs m, const float* __restrict__ x, float* y, bool accumulate) {
  const size_t r0 = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32 * R;
  if (r0 < m.rows) GemvRows<F, R>(m, r0, threadIdx.x % 32, x, y, accumulate);
}

// Several matrices of one format and one input, one token: warp w takes row w of their rows in turn.
constexpr int kMaxJobs = 6;
struct ManyArgs {
  MatrixArgs m[kMaxJobs];
  float* y[kMaxJobs];
  size_t first[kMaxJobs + 1];  // the first warp of each matrix; first[count] = all rows
  bool accumulate[kMaxJobs];
  int count;
};
template <DeviceFormat F>
__global__ void GemvManyKernel(ManyArgs a, const float* __restrict__ x) {
  const size_t w = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (w >= a.first[a.count]) return;
  int j = 0;
  while (w >= a.first[j + 1]) ++j;
  GemvRows<F, 1>(a.m[j], w - a.first[j], threadIdx.x % 32, x, a.y[j], a.accumulate[j]);
}

// Decode of 2-8 tokens: one warp a row, each lane 8 inputs at a time, U chunks in flight.
constexpr int kGemvMaxTokens = 8;
template <DeviceFormat F, int NT>
__global__ void GemvKernel(MatrixArgs m, const float* __restrict__ x, size_t n, float* y, size_t ldy, bool accumulate) {
  constexpr int U = 4;
  const size_t r = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= m.rows) return;
  const uint8_t* row = m.codes + r * m.row_bytes;
  const float* sc = m.scales ? m.scales + r * m.scale_cols : nullptr;
  const bool vec = m.cols % 4 == 0;
  float sum[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) sum[t] = 0.0f;
  for (size_t c0 = static_cast<size_t>(lane) * 8; c0 < m.padded; c0 += 256 * U) {
    float w[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t c = c0 + u * 256;
      if (c < m.padded)
        Load8<F>(row, sc, c, w[u]);
      else
#pragma unroll
        for (int i = 0; i < 8; ++i) w[u][i] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= static_cast<int>(n)) break;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const size_t c = c0 + u * 256;
        if (c >= m.cols) break;
        float a[8];
        LoadX8(x + t * m.cols, c, m.cols, vec, a);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[t] = fmaf(w[u][i], a[i], sum[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= static_cast<int>(n)) break;
    float s = sum[t];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if (lane == 0) y[t * ldy + r] = accumulate ? y[t * ldy + r] + s : s;
  }
}

// Prompts: 64 rows x 64 tokens a block, 32 inputs a step through shared memory, 4 x 4 a thread.
template <DeviceFormat F>
__global__ void GemmKernel(MatrixArgs m, const float* __restrict__ x, size_t n, float* y, size_t ldy, bool accumulate) {
  __shared__ float ws[32][65];
  __shared__ float xs[32][65];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const size_t r0 = static_cast<size_t>(blockIdx.x) * 64, t0 = static_cast<size_t>(blockIdx.y) * 64;
  const bool vec = m.cols % 4 == 0;
  float acc[4][4] = {};
  for (size_t k0 = 0; k0 < m.padded; k0 += 32) {
    {
      const size_t r = r0 + tid / 4, c = k0 + (tid % 4) * 8;
      float w[8];
      if (r < m.rows)
        Load8<F>(m.codes + r * m.row_bytes, m.scales ? m.scales + r * m.scale_cols : nullptr, c, w);
      else
        for (int i = 0; i < 8; ++i) w[i] = 0.0f;
      for (int i = 0; i < 8; ++i) ws[(tid % 4) * 8 + i][tid / 4] = w[i];
      const size_t t = t0 + tid / 4;
      float a[8];
      if (t < n)
        LoadX8(x + t * m.cols, c, m.cols, vec, a);
      else
        for (int i = 0; i < 8; ++i) a[i] = 0.0f;
      for (int i = 0; i < 8; ++i) xs[(tid % 4) * 8 + i][tid / 4] = a[i];
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < 32; ++kk) {
      float a[4], b[4];
      for (int i = 0; i < 4; ++i) a[i] = ws[kk][ty * 4 + i];
      for (int j = 0; j < 4; ++j) b[j] = xs[kk][tx * 4 + j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const size_t r = r0 + ty * 4 + i, t = t0 + tx * 4 + j;
      if (r < m.rows && t < n) y[t * ldy + r] = accumulate ? y[t * ldy + r] + acc[i][j] : acc[i][j];
    }
}

// ---- Reductions over a block of kThreads. ----
constexpr int kThreads = 128;

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
// Every thread of the block gets the result; `scratch` holds kThreads / 32 floats.
template <bool kMax>
__device__ float BlockReduce(float v, float* scratch) {
  v = kMax ? WarpMax(v) : WarpSum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch free from any earlier use
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

__global__ void RmsNormKernel(float* x, const float* __restrict__ add, size_t dim, const float* __restrict__ scale,
                              float eps, float* y, FiniteCheck check) {
  __shared__ float scratch[kThreads / 32];
  float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  const float* ar = add ? add + blockIdx.x * dim : nullptr;
  float ss = 0.0f;
  int bad = 0;
  for (size_t d = threadIdx.x; d < dim; d += kThreads) {
    float v = xr[d];
    if (ar) xr[d] = v = v + ar[d];
    ss = fmaf(v, v, ss);
    bad |= !isfinite(v);
  }
  if (check.flag && __syncthreads_or(bad) && threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(check.flag),
              static_cast<unsigned long long>(uint64_t{check.stage} << 40 | blockIdx.x));
  ss = BlockReduce<false>(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  for (size_t d = threadIdx.x; d < dim; d += kThreads) yr[d] = xr[d] * inv * scale[d];
}

// Up to four NormRope jobs; one warp a vector (token t, head h of a job): norm, then rotate pairs
// (i, i + half), then the check.
constexpr int kMaxNormRopeJobs = 4;
struct NormRopeArgs {
  Device::NormRopeJob job[kMaxNormRopeJobs];
  size_t first[kMaxNormRopeJobs + 1];  // the first vector of each job
  int count;
};
__global__ void NormRopeKernel(NormRopeArgs a, float eps, const float* __restrict__ rope, size_t half) {
  const size_t w = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= a.first[a.count]) return;
  int j = 0;
  while (w >= a.first[j + 1]) ++j;
  const Device::NormRopeJob& job = a.job[j];
  const size_t vi = w - a.first[j], dim = job.dim;
  float* v = job.x + vi * dim;
  if (job.scale) {
    float ss = 0.0f;
    for (size_t d = lane; d < dim; d += 32) ss = fmaf(v[d], v[d], ss);
    ss = WarpSum(ss);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (size_t d = lane; d < dim; d += 32) v[d] = v[d] * inv * job.scale[d];
    __syncwarp();
  }
  const float* cs = rope + (vi / job.heads) * half * 2;
  for (size_t i = lane; i < half; i += 32) {
    const float x1 = v[i], x2 = v[i + half], c = cs[2 * i], s = cs[2 * i + 1];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
  }
  if (job.check.flag) {
    __syncwarp();
    int bad = 0;
    for (size_t d = lane; d < dim; d += 32) bad |= !isfinite(v[d]);
    if (__any_sync(0xFFFFFFFFu, bad) && lane == 0)
      atomicMin(reinterpret_cast<unsigned long long*>(job.check.flag),
                static_cast<unsigned long long>(uint64_t{job.check.stage} << 40 | (vi / job.heads)));
  }
}

// Block (t, b): the max over block b's visible keys of each head's dot product.
__global__ void IndexScoresKernel(const float* __restrict__ iq, int64_t pos0, const float* __restrict__ keys,
                                  size_t heads, size_t dim, size_t block_size, size_t blocks, float* scores) {
  extern __shared__ float q[];  // heads * dim
  __shared__ float scratch[kThreads / 32];
  const size_t t = blockIdx.x, b = blockIdx.y, pos = static_cast<size_t>(pos0) + t;
  for (size_t i = threadIdx.x; i < heads * dim; i += kThreads) q[i] = iq[t * heads * dim + i];
  __syncthreads();
  const size_t u_end = min((b + 1) * block_size, pos + 1);
  for (size_t h = 0; h < heads; ++h) {
    float mx = -INFINITY;
    for (size_t u = b * block_size + threadIdx.x; u < u_end; u += kThreads) {
      float s = 0.0f;
      for (size_t d = 0; d < dim; ++d) s = fmaf(q[h * dim + d], keys[u * dim + d], s);
      mx = fmaxf(mx, s);  // a NaN never wins
    }
    mx = BlockReduce<true>(mx, scratch);
    if (threadIdx.x == 0) scores[(t * heads + h) * blocks + b] = mx;
  }
}

// Block (t, j): online softmax over the key ranges of query t and head j, 128 keys at a time.
constexpr int kMaxHeadDim = 512;
__global__ void AttentionKernel(DeviceAttentionShape s, const float* __restrict__ q, int64_t pos0,
                                const float* __restrict__ k, const float* __restrict__ v,
                                const int32_t* __restrict__ blocks, const int32_t* __restrict__ counts, float* out) {
  __shared__ float qs[kMaxHeadDim];
  __shared__ float p[kThreads];
  __shared__ float scratch[kThreads / 32];
  const size_t t = blockIdx.x, j = blockIdx.y, H = s.heads, Hkv = s.kv_heads, D = s.head_dim;
  const size_t pos = static_cast<size_t>(pos0) + t, kvh = j / (H / Hkv), stride = Hkv * D;
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  for (size_t d = threadIdx.x; d < D; d += kThreads) qs[d] = q[(t * H + j) * D + d];
  __syncthreads();
  constexpr int kDims = kMaxHeadDim / kThreads;
  float acc[kDims] = {};
  float run_max = -INFINITY, run_sum = 0.0f;
  const size_t ih = blocks ? j / (H / static_cast<size_t>(s.index_heads)) : 0;
  const size_t sel_row = t * static_cast<size_t>(s.index_heads) + ih;
  const int ranges = blocks ? counts[sel_row] : 1;
  for (int ri = 0; ri < ranges; ++ri) {
    size_t u0 = 0, u1 = pos + 1;
    if (blocks) {
      const size_t bb = static_cast<size_t>(blocks[sel_row * static_cast<size_t>(s.topk) + ri]);
      u0 = bb * s.block_size;
      u1 = min((bb + 1) * static_cast<size_t>(s.block_size), pos + 1);
    }
    for (size_t c0 = u0; c0 < u1; c0 += kThreads) {
      const size_t u = c0 + threadIdx.x, nk = min(static_cast<size_t>(kThreads), u1 - c0);
      float sc = -INFINITY;
      if (u < u1) {
        const float* kr = k + u * stride + kvh * D;
        float dot = 0.0f;
        for (size_t d = 0; d < D; ++d) dot = fmaf(qs[d], kr[d], dot);
        sc = dot * scale;
      }
      const float m = fmaxf(run_max, BlockReduce<true>(sc, scratch));
      const float pu = u < u1 ? expf(sc - m) : 0.0f;
      const float c = expf(run_max - m);
      const float chunk_sum = BlockReduce<false>(pu, scratch);
      p[threadIdx.x] = pu;
      __syncthreads();
      run_sum = run_sum * c + chunk_sum;
#pragma unroll
      for (int i = 0; i < kDims; ++i) {
        const size_t d = threadIdx.x + i * kThreads;
        if (d >= D) break;
        float a = acc[i] * c;
        for (size_t jj = 0; jj < nk; ++jj) a = fmaf(p[jj], v[(c0 + jj) * stride + kvh * D + d], a);
        acc[i] = a;
      }
      run_max = m;
      __syncthreads();  // p is rewritten by the next chunk
    }
  }
#pragma unroll
  for (int i = 0; i < kDims; ++i) {
    const size_t d = threadIdx.x + i * kThreads;
    if (d < D) out[(t * H + j) * D + d] = acc[i] / run_sum;
  }
}

__global__ void SwigluKernel(float* g, const float* __restrict__ u, size_t n, DeviceSwiglu p) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float gv = g[i], uv = u[i];
    const float gc = fminf(gv, p.limit), uc = fminf(fmaxf(uv, -p.limit), p.limit);
    const float sig = 1.0f / (1.0f + expf(-p.alpha * gc));
    g[i] = isfinite(gv) && isfinite(uv) ? gc * sig * (uc + p.beta) : NAN;
  }
}

__global__ void AddKernel(const float* __restrict__ x, size_t n, float* y) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

__global__ void FlagKernel(const float* __restrict__ x, size_t n, size_t width, uint64_t stage,
                           unsigned long long* flag) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    if (!isfinite(x[i])) atomicMin(flag, static_cast<unsigned long long>(stage << 40 | (i / width)));
}

unsigned GridFor(size_t n, unsigned threads) {
  return static_cast<unsigned>(std::min<size_t>((n + threads - 1) / threads, 65535 * 8));
}

class CudaDevice final : public Device {
 public:
  ~CudaDevice() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (staging_) cudaFreeHost(staging_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status Init(int ordinal) {
    int count = 0;
    if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess)
      return NotFound("no usable CUDA device: ", cudaGetErrorString(e));
    if (ordinal < 0 || ordinal >= count)
      return InvalidArgument("GPU ", ordinal, " does not exist (this machine has ", count, ")");
    M3_CUDA_RETURN(cudaSetDevice(ordinal), "cudaSetDevice");
    cudaDeviceProp prop{};
    M3_CUDA_RETURN(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
    name_ = Str("cuda: ", prop.name, " (sm_", prop.major, prop.minor, ")");
    M3_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    float lut[256];
    for (int i = 0; i < 256; ++i) lut[i] = simd::E4M3ToF32(static_cast<uint8_t>(i));
    M3_CUDA_RETURN(cudaMemcpyToSymbol(kFp8Values, lut, sizeof(lut)), "the fp8 table");
    return Status::Ok();
  }

  std::string Describe() const override { return name_; }
  uint64_t FreeBytes() const override {
    size_t free_bytes = 0, total = 0;
    return cudaMemGetInfo(&free_bytes, &total) == cudaSuccess ? free_bytes : 0;
  }

  StatusOr<void*> Allocate(size_t bytes, const std::string& what) override {
    void* p = nullptr;
    if (const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1)); e != cudaSuccess) {
      cudaGetLastError();  // clear it
      return Status(StatusCode::kOutOfMemory, Str("the GPU has no room for ", what, " (", bytes >> 20, " MiB; ",
                                                  FreeBytes() >> 20, " MiB free): ", cudaGetErrorString(e)));
    }
    return p;
  }
  void Free(void* p) override { cudaFree(p); }
  StatusOr<void*> AllocateHost(size_t bytes) override {
    void* p = nullptr;
    if (const cudaError_t e = cudaMallocHost(&p, std::max<size_t>(bytes, 1)); e != cudaSuccess) {
      cudaGetLastError();
      return Status(StatusCode::kOutOfMemory,
                    Str("no pinned host memory for ", bytes >> 20, " MiB of handoff buffers: ", cudaGetErrorString(e)));
    }
    return p;
  }
  void FreeHost(void* p) override { cudaFreeHost(p); }

  StatusOr<DeviceMatrix> Upload(const simd::WeightRef& w, const std::string& what) override {
    DeviceMatrix m;
    m.layout = DeviceLayoutFor(w);
    const DeviceLayout& l = m.layout;
    M3_ASSIGN_OR_RETURN(m.codes, Allocate(l.code_bytes, what));
    if (l.scale_bytes) {
      auto s = Allocate(l.scale_bytes, what);
      if (!s.ok()) {
        Free(m.codes);
        return s.status();
      }
      m.scales = static_cast<float*>(*s);
    }
    auto fail = [&](cudaError_t e) {
      Free(m.codes);
      if (m.scales) Free(m.scales);
      return CudaError(e, "uploading " + what);
    };
    if (IsDeviceVerbatim(w)) {  // straight from the mapping
      if (const cudaError_t e = cudaMemcpy(m.codes, w.data, l.code_bytes, cudaMemcpyHostToDevice); e != cudaSuccess)
        return fail(e);
      return m;
    }
    // Converted through a bounded pinned buffer, a run of rows at a time.
    constexpr size_t kStaging = size_t{64} << 20;
    if (!staging_) {
      if (const cudaError_t e = cudaMallocHost(&staging_, kStaging); e != cudaSuccess) {
        staging_ = nullptr;
        return fail(e);
      }
    }
    const size_t per_row = l.row_bytes + l.scale_cols() * sizeof(float);
    const size_t run = std::max<size_t>(1, kStaging / per_row);
    auto* codes = static_cast<uint8_t*>(staging_);
    for (size_t r0 = 0; r0 < l.rows; r0 += run) {
      const size_t r1 = std::min(l.rows, r0 + run);
      float* scales = reinterpret_cast<float*>(codes + (r1 - r0) * l.row_bytes);
      ConvertRows(w, l, r0, r1, codes, l.scale_bytes ? scales : nullptr);
      if (const cudaError_t e = cudaMemcpy(static_cast<uint8_t*>(m.codes) + r0 * l.row_bytes, codes,
                                           (r1 - r0) * l.row_bytes, cudaMemcpyHostToDevice);
          e != cudaSuccess)
        return fail(e);
      if (l.scale_bytes)
        if (const cudaError_t e = cudaMemcpy(m.scales + r0 * l.scale_cols(), scales,
                                             (r1 - r0) * l.scale_cols() * sizeof(float), cudaMemcpyHostToDevice);
            e != cudaSuccess)
          return fail(e);
    }
    return m;
  }

  void ToDevice(void* dst, const void* src, size_t bytes) override {
    Note(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "a copy to the GPU");
  }
  void ToHost(void* dst, const void* src, size_t bytes) override {
    Note(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "a copy from the GPU");
  }
  void Copy(void* dst, const void* src, size_t bytes) override {
    Note(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "a copy on the GPU");
  }
  Status Wait() override {
    Note(cudaGetLastError(), "a kernel launch");
    Note(cudaStreamSynchronize(stream_), "the GPU's work");
    return std::exchange(error_, Status::Ok());
  }

  int Mark() override {
    if (next_event_ == events_.size()) {
      cudaEvent_t e;
      Note(cudaEventCreate(&e), "an event");
      events_.push_back(e);
    }
    Note(cudaEventRecord(events_[next_event_], stream_), "an event");
    return static_cast<int>(next_event_++);
  }
  double Seconds(int a, int b) override {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, events_[static_cast<size_t>(a)], events_[static_cast<size_t>(b)]) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return ms * 1e-3;
  }
  void ResetMarks() override { next_event_ = 0; }

  void MatMulMany(const MatMulJob* jobs, size_t count, const float* x, size_t n) override {
    bool one_launch = n == 1 && count <= static_cast<size_t>(kMaxJobs);
    for (size_t j = 0; j < count && one_launch; ++j) one_launch = jobs[j].w->layout.format == jobs[0].w->layout.format;
    if (!one_launch) return Device::MatMulMany(jobs, count, x, n);
    switch (jobs[0].w->layout.format) {
      case DeviceFormat::kF32: return ManyAs<DeviceFormat::kF32>(jobs, count, x);
      case DeviceFormat::kBF16: return ManyAs<DeviceFormat::kBF16>(jobs, count, x);
      case DeviceFormat::kF16: return ManyAs<DeviceFormat::kF16>(jobs, count, x);
      case DeviceFormat::kFp8: return ManyAs<DeviceFormat::kFp8>(jobs, count, x);
      case DeviceFormat::kQ8: return ManyAs<DeviceFormat::kQ8>(jobs, count, x);
      case DeviceFormat::kQ4: return ManyAs<DeviceFormat::kQ4>(jobs, count, x);
    }
  }

  void MatMul(const DeviceMatrix& w, const float* x, size_t n, float* y, size_t ldy, bool accumulate) override {
    if (n == 0) return;
    switch (w.layout.format) {
      case DeviceFormat::kF32:
        return MatMulAs<DeviceFormat::kF32>(w, x, n, y, ldy, accumulate);
      case DeviceFormat::kBF16:
        return MatMulAs<DeviceFormat::kBF16>(w, x, n, y, ldy, accumulate);
      case DeviceFormat::kF16:
        return MatMulAs<DeviceFormat::kF16>(w, x, n, y, ldy, accumulate);
      case DeviceFormat::kFp8:
        return MatMulAs<DeviceFormat::kFp8>(w, x, n, y, ldy, accumulate);
      case DeviceFormat::kQ8:
        return MatMulAs<DeviceFormat::kQ8>(w, x, n, y, ldy, accumulate);
      case DeviceFormat::kQ4:
        return MatMulAs<DeviceFormat::kQ4>(w, x, n, y, ldy, accumulate);
    }
  }

  void RmsNorm(float* x, const float* add, size_t n, size_t dim, const float* scale, float eps, float* y,
               FiniteCheck check) override {
    if (n) RmsNormKernel<<<static_cast<unsigned>(n), kThreads, 0, stream_>>>(x, add, dim, scale, eps, y, check);
  }
  void NormRope(const NormRopeJob* jobs, size_t count, size_t n, float eps, const float* rope,
                size_t rotary_dim) override {
    for (size_t j0 = 0; j0 < count; j0 += kMaxNormRopeJobs) {
      NormRopeArgs a{};
      a.count = static_cast<int>(std::min<size_t>(kMaxNormRopeJobs, count - j0));
      for (int j = 0; j < a.count; ++j) {
        a.job[j] = jobs[j0 + static_cast<size_t>(j)];
        a.first[j + 1] = a.first[j] + n * a.job[j].heads;
      }
      const size_t vectors = a.first[a.count];
      if (vectors)
        NormRopeKernel<<<static_cast<unsigned>((vectors + 7) / 8), 256, 0, stream_>>>(a, eps, rope, rotary_dim / 2);
    }
  }
  void IndexScores(const float* iq, size_t n, int64_t pos0, const float* keys, size_t heads, size_t dim,
                   size_t block_size, size_t blocks, float* scores) override {
    if (n == 0 || blocks == 0) return;
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(blocks));
    IndexScoresKernel<<<grid, kThreads, heads * dim * sizeof(float), stream_>>>(iq, pos0, keys, heads, dim, block_size,
                                                                                blocks, scores);
  }
  void Attention(const DeviceAttentionShape& s, const float* q, size_t n, int64_t pos0, const float* k, const float* v,
                 const int32_t* blocks, const int32_t* counts, float* out) override {
    if (n == 0) return;
    if (s.head_dim > kMaxHeadDim) {
      if (error_.ok())
        static_cast<void>(error_ = Unsupported("the GPU attention takes heads of at most ", kMaxHeadDim, " values"));
      return;
    }
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(s.heads));
    AttentionKernel<<<grid, kThreads, 0, stream_>>>(s, q, pos0, k, v, blocks, counts, out);
  }
  void Swiglu(float* g, const float* u, size_t n, const DeviceSwiglu& p) override {
    if (n) SwigluKernel<<<GridFor(n, 256), 256, 0, stream_>>>(g, u, n, p);
  }
  void Add(const float* x, size_t n, float* y) override {
    if (n) AddKernel<<<GridFor(n, 256), 256, 0, stream_>>>(x, n, y);
  }
  void FlagNonFinite(const float* x, size_t rows, size_t width, uint32_t stage, uint64_t* flag) override {
    const size_t n = rows * width;
    if (n)
      FlagKernel<<<GridFor(n, 256), 256, 0, stream_>>>(x, n, width, stage, reinterpret_cast<unsigned long long*>(flag));
  }

 private:
  static MatrixArgs Args(const DeviceMatrix& w) {
    const DeviceLayout& l = w.layout;
    return MatrixArgs{static_cast<const uint8_t*>(w.codes), w.scales, l.rows, l.cols, l.padded_cols, l.row_bytes,
                      l.scale_cols()};
  }

  template <DeviceFormat F>
  void ManyAs(const MatMulJob* jobs, size_t count, const float* x) {
    ManyArgs a{};
    a.count = static_cast<int>(count);
    for (size_t j = 0; j < count; ++j) {
      a.m[j] = Args(*jobs[j].w);
      a.y[j] = jobs[j].y;
      a.accumulate[j] = jobs[j].accumulate;
      a.first[j + 1] = a.first[j] + jobs[j].w->layout.rows;
    }
    const size_t warps = a.first[count];
    if (warps) GemvManyKernel<F><<<static_cast<unsigned>((warps + 3) / 4), 128, 0, stream_>>>(a, x);
  }

  template <DeviceFormat F>
  void MatMulAs(const DeviceMatrix& w, const float* x, size_t n, float* y, size_t ldy, bool accumulate) {
    const DeviceLayout& l = w.layout;
    const MatrixArgs m{
        static_cast<const uint8_t*>(w.codes), w.scales, l.rows, l.cols, l.padded_cols, l.row_bytes, l.scale_cols()};
    if (n == 1) {  // 4 warps a block; rows a warp by the matrix's height, so that small ones fill the GPU too
      if (l.rows >= 16384) {
        GemvRowsKernel<F, 4><<<static_cast<unsigned>((l.rows + 15) / 16), 128, 0, stream_>>>(m, x, y, accumulate);
      } else if (l.rows >= 4096) {
        GemvRowsKernel<F, 2><<<static_cast<unsigned>((l.rows + 7) / 8), 128, 0, stream_>>>(m, x, y, accumulate);
      } else {
        GemvRowsKernel<F, 1><<<static_cast<unsigned>((l.rows + 3) / 4), 128, 0, stream_>>>(m, x, y, accumulate);
      }
      return;
    }
    if (n <= static_cast<size_t>(kGemvMaxTokens)) {
      const unsigned blocks = static_cast<unsigned>((l.rows + 7) / 8);  // 8 warps, a row each
      switch (n) {
        case 1:
          GemvKernel<F, 1><<<blocks, 256, 0, stream_>>>(m, x, n, y, ldy, accumulate);
          break;
        case 2:
          GemvKernel<F, 2><<<blocks, 256, 0, stream_>>>(m, x, n, y, ldy, accumulate);
          break;
        case 3:
        case 4:
          GemvKernel<F, 4><<<blocks, 256, 0, stream_>>>(m, x, n, y, ldy, accumulate);
          break;
        default:
          GemvKernel<F, 8><<<blocks, 256, 0, stream_>>>(m, x, n, y, ldy, accumulate);
          break;
      }
      return;
    }
    const dim3 grid(static_cast<unsigned>((l.rows + 63) / 64), static_cast<unsigned>((n + 63) / 64));
    GemmKernel<F><<<grid, 256, 0, stream_>>>(m, x, n, y, ldy, accumulate);
  }

  // The first failure of queued work, reported by the next Wait.
  void Note(cudaError_t e, const char* what) {
    if (e != cudaSuccess && error_.ok()) static_cast<void>(error_ = CudaError(e, what));
  }

  std::string name_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
  size_t next_event_ = 0;
  void* staging_ = nullptr;
  Status error_ = Status::Ok();
};

}  // namespace

StatusOr<std::unique_ptr<Device>> OpenGpuDevice(int ordinal) {
  auto device = std::make_unique<CudaDevice>();
  M3_RETURN_IF_ERROR(device->Init(ordinal));
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace m3
