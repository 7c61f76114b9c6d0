#include "offload/host_device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "platform/parallel.h"

namespace m3 {
namespace {

class HostDevice final : public Device {
 public:
  std::string Describe() const override { return "host (the reference device: no GPU)"; }
  uint64_t FreeBytes() const override { return uint64_t{1} << 40; }

  StatusOr<void*> Allocate(size_t bytes, const std::string& what) override {
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
    if (!p) return Status(StatusCode::kOutOfMemory, Str("out of memory for ", what));
    return p;
  }
  void Free(void* p) override { std::free(p); }
  StatusOr<void*> AllocateHost(size_t bytes) override { return Allocate(bytes, "host staging"); }
  void FreeHost(void* p) override { std::free(p); }

  StatusOr<DeviceMatrix> Upload(const simd::WeightRef& w, const std::string& what) override {
    DeviceMatrix m;
    m.layout = DeviceLayoutFor(w);
    M3_ASSIGN_OR_RETURN(m.codes, Allocate(m.layout.code_bytes, what));
    if (m.layout.scale_bytes) {
      M3_ASSIGN_OR_RETURN(void* s, Allocate(m.layout.scale_bytes, what));
      m.scales = static_cast<float*>(s);
    }
    ConvertRows(w, m.layout, 0, w.rows, static_cast<uint8_t*>(m.codes), m.scales);
    return m;
  }

  void ToDevice(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void ToHost(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void Copy(void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }
  Status Wait() override { return Status::Ok(); }

  int Mark() override {
    marks_.push_back(std::chrono::steady_clock::now());
    return static_cast<int>(marks_.size()) - 1;
  }
  double Seconds(int a, int b) override {
    return std::chrono::duration<double>(marks_[static_cast<size_t>(b)] - marks_[static_cast<size_t>(a)]).count();
  }
  void ResetMarks() override { marks_.clear(); }

  void MatMul(const DeviceMatrix& w, const float* x, size_t n, float* y, size_t ldy, bool accumulate) override {
    const DeviceLayout& l = w.layout;
    const auto* codes = static_cast<const uint8_t*>(w.codes);
    ParallelFor(tc_, l.rows, 16, [&](size_t r0, size_t r1, int) {
      std::vector<float> row(l.padded_cols);
      for (size_t r = r0; r < r1; ++r) {
        for (size_t c = 0; c < l.cols; ++c) row[c] = DeviceWeightAt(l, codes, w.scales, r, c);
        for (size_t t = 0; t < n; ++t) {
          const float sum = Dot(row.data(), x + t * l.cols, l.cols);
          float& out = y[t * ldy + r];
          out = accumulate ? out + sum : sum;
        }
      }
    });
  }

  void RmsNorm(float* x, const float* add, size_t n, size_t dim, const float* scale, float eps, float* y,
               FiniteCheck check) override {
    if (add) Add(add, n * dim, x);
    if (check.flag) FlagNonFinite(x, n, dim, check.stage, check.flag);  // before y, which may be x
    for (size_t t = 0; t < n; ++t) NormRow(x + t * dim, dim, scale, eps, y + t * dim);
  }

  void NormRope(const NormRopeJob* jobs, size_t count, size_t n, float eps, const float* rope,
                size_t rotary_dim) override {
    const size_t half = rotary_dim / 2;
    for (size_t j = 0; j < count; ++j) {
      const NormRopeJob& job = jobs[j];
      for (size_t t = 0; t < n; ++t)
        for (size_t h = 0; h < job.heads; ++h) {
          float* v = job.x + (t * job.heads + h) * job.dim;
          if (job.scale) NormRow(v, job.dim, job.scale, eps, v);
          const float* cs = rope + t * half * 2;
          for (size_t i = 0; i < half; ++i) {
            const float x1 = v[i], x2 = v[i + half], c = cs[2 * i], s = cs[2 * i + 1];
            v[i] = x1 * c - x2 * s;
            v[i + half] = x2 * c + x1 * s;
          }
        }
      if (job.check.flag) FlagNonFinite(job.x, n, job.heads * job.dim, job.check.stage, job.check.flag);
    }
  }

  void IndexScores(const float* iq, size_t n, int64_t pos0, const float* keys, size_t heads, size_t dim,
                   size_t block_size, size_t blocks, float* scores) override {
    ParallelFor(tc_, n, 1, [&](size_t t0, size_t t1, int) {
      for (size_t t = t0; t < t1; ++t) {
        const size_t pos = static_cast<size_t>(pos0) + t;
        for (size_t h = 0; h < heads; ++h)
          for (size_t b = 0; b < blocks; ++b) {
            float mx = -std::numeric_limits<float>::infinity();
            for (size_t u = b * block_size; u < (b + 1) * block_size && u <= pos; ++u) {
              float s = 0.0f;
              for (size_t d = 0; d < dim; ++d) s = std::fma(iq[(t * heads + h) * dim + d], keys[u * dim + d], s);
              mx = std::max(mx, s);  // a NaN never wins
            }
            scores[(t * heads + h) * blocks + b] = mx;
          }
      }
    });
  }

  void Attention(const DeviceAttentionShape& s, const float* q, size_t n, int64_t pos0, const float* k, const float* v,
                 const int32_t* blocks, const int32_t* counts, float* out) override {
    const size_t H = static_cast<size_t>(s.heads), Hkv = static_cast<size_t>(s.kv_heads),
                 D = static_cast<size_t>(s.head_dim), B = static_cast<size_t>(s.block_size);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    ParallelFor(tc_, n * H, 1, [&](size_t i0, size_t i1, int) {
      std::vector<float> acc(D), p;
      for (size_t i = i0; i < i1; ++i) {
        {
          const size_t t = i / H, j = i % H;
          const size_t pos = static_cast<size_t>(pos0) + t, kvh = j / (H / Hkv);
          const float* qv = q + (t * H + j) * D;
          std::fill(acc.begin(), acc.end(), 0.0f);
          float run_max = -std::numeric_limits<float>::infinity(), run_sum = 0.0f;
          // Keys [u0, u1) as one step of the online softmax: m' = max(m, scores), c = exp(m - m').
          auto attend = [&](size_t u0, size_t u1) {
            p.resize(u1 - u0);
            float m = run_max;
            for (size_t u = u0; u < u1; ++u) {
              p[u - u0] = Dot(qv, k + (u * Hkv + kvh) * D, D) * scale;
              m = std::max(m, p[u - u0]);
            }
            const float c = std::exp(run_max - m);
            float sum = 0.0f;
            for (float& x : p) sum += x = std::exp(x - m);
            run_sum = run_sum * c + sum;
            for (size_t d = 0; d < D; ++d) acc[d] *= c;
            for (size_t u = u0; u < u1; ++u) {
              const float* vv = v + (u * Hkv + kvh) * D;
              for (size_t d = 0; d < D; ++d) acc[d] += p[u - u0] * vv[d];
            }
            run_max = m;
          };
          if (blocks) {
            const size_t row = t * static_cast<size_t>(s.index_heads) + j / (H / static_cast<size_t>(s.index_heads));
            for (int i = 0; i < counts[row]; ++i) {
              const size_t b = static_cast<size_t>(blocks[row * static_cast<size_t>(s.topk) + static_cast<size_t>(i)]);
              attend(b * B, std::min((b + 1) * B, pos + 1));
            }
          } else {
            attend(0, pos + 1);
          }
          float* o = out + (t * H + j) * D;
          for (size_t d = 0; d < D; ++d) o[d] = acc[d] / run_sum;
        }
      }
    });
  }

  void Swiglu(float* g, const float* u, size_t n, const DeviceSwiglu& p) override {
    for (size_t i = 0; i < n; ++i) {
      const float gc = std::min(g[i], p.limit), uc = std::clamp(u[i], -p.limit, p.limit);
      const float sig = 1.0f / (1.0f + std::exp(-p.alpha * gc));
      g[i] = std::isfinite(g[i]) && std::isfinite(u[i]) ? gc * sig * (uc + p.beta) : NAN;
    }
  }

  void Add(const float* x, size_t n, float* y) override {
    for (size_t i = 0; i < n; ++i) y[i] += x[i];
  }

  void FlagNonFinite(const float* x, size_t rows, size_t width, uint32_t stage, uint64_t* flag) override {
    for (size_t i = 0; i < rows * width; ++i)
      if (!std::isfinite(x[i])) {
        *flag = std::min<uint64_t>(*flag, uint64_t{stage} << 40 | (i / width));
        return;
      }
  }

 private:
  // In 8 partial sums (vectorized; the order is this reference's own).
  static float Dot(const float* a, const float* b, size_t n) {
    float acc[8] = {};
    size_t c = 0;
    for (; c + 8 <= n; c += 8)
      for (int i = 0; i < 8; ++i) acc[i] += a[c + i] * b[c + i];
    for (; c < n; ++c) acc[0] += a[c] * b[c];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }

  static void NormRow(const float* x, size_t dim, const float* scale, float eps, float* y) {
    const float ss = Dot(x, x, dim);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (size_t d = 0; d < dim; ++d) y[d] = x[d] * inv * scale[d];
  }

  std::vector<std::chrono::steady_clock::time_point> marks_;
  ThreadConfig tc_{ResolveThreadCount(0)};  // rows split over every core; no result depends on it
};

}  // namespace

std::unique_ptr<Device> MakeHostDevice() { return std::make_unique<HostDevice>(); }

}  // namespace m3
