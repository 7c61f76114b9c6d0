// oneDNN int8 matmul peer (onednn_peer.h), on the oneDNN 2.x API (matmul::desc, output scales)
// that Debian 12 ships as libdnnl-dev 2.6.3.
#include "onednn_peer.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <unordered_map>
#include <vector>

#if M3_HAVE_DNNL
#include <dnnl.hpp>
#endif

namespace m3::bench {

#if M3_HAVE_DNNL

namespace {

// Fills n bytes with a fixed pseudo-random sequence (SplitMix64).
void FillRandomBytes(void* p, size_t n, uint64_t seed) {
  uint8_t* b = static_cast<uint8_t*>(p);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(b + i, &z, n - i < 8 ? n - i : 8);
  }
}

}  // namespace

struct OneDnnInt8MatMul::State {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::matmul prim;
  std::unordered_map<int, dnnl::memory> args;
  std::vector<dnnl::memory> weights;  // the copies, in oneDNN's layout
};

bool OneDnnAvailable() { return true; }

std::string OneDnnDescription() {
  const dnnl_version_t* v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

std::unique_ptr<OneDnnInt8MatMul> OneDnnInt8MatMul::Create(size_t m, size_t k, size_t n, int threads, size_t copies,
                                                           std::string* error) {
  using dnnl::memory;
  using dt = memory::data_type;
  using tag = memory::format_tag;
  std::unique_ptr<OneDnnInt8MatMul> mm(new OneDnnInt8MatMul);
  mm->threads_ = threads;
  mm->saved_threads_ = omp_get_max_threads();
  omp_set_num_threads(threads);  // oneDNN picks its blocking for the thread count at creation
  try {
    mm->state_ = std::make_unique<State>();
    State& s = *mm->state_;
    const memory::dim M = static_cast<memory::dim>(m), K = static_cast<memory::dim>(k),
                      N = static_cast<memory::dim>(n);
    const memory::desc src_md({M, K}, dt::u8, tag::ab);
    const memory::desc wei_any_md({K, N}, dt::s8, tag::any);
    const memory::desc dst_md({M, N}, dt::f32, tag::ab);
    dnnl::primitive_attr attr;
    std::vector<float> scales(n);
    for (size_t j = 0; j < n; ++j) scales[j] = 1e-4f * static_cast<float>(1 + j % 7);
    attr.set_output_scales(1 << 1, scales);  // one per output channel (dst dim 1)
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_any_md, dst_md), attr, s.eng);
    mm->impl_ = OneDnnDescription() + " " + pd.impl_info_str();

    // Our weights are row-major [n, k]: oneDNN's [k, n] with tag ba. Symmetric int8 like our codes.
    memory user_wei({{K, N}, dt::s8, tag::ba}, s.eng);
    for (size_t c = 0; c < std::max<size_t>(copies, 1); ++c) {
      FillRandomBytes(user_wei.get_data_handle(), k * n, 2 + c);
      int8_t* w = static_cast<int8_t*>(user_wei.get_data_handle());
      for (size_t i = 0; i < k * n; ++i)
        if (w[i] == -128) w[i] = -127;
      s.weights.emplace_back(pd.weights_desc(), s.eng);
      dnnl::reorder(user_wei, s.weights.back()).execute(s.strm, user_wei, s.weights.back());
    }
    memory src(pd.src_desc(), s.eng);
    FillRandomBytes(src.get_data_handle(), pd.src_desc().get_size(), 1);
    memory dst(pd.dst_desc(), s.eng);
    s.strm.wait();
    s.prim = dnnl::matmul(pd);
    s.args = {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, s.weights[0]}, {DNNL_ARG_DST, dst}};
  } catch (const std::exception& e) {
    *error = std::string("oneDNN int8 matmul unavailable: ") + e.what();
    return nullptr;  // the destructor restores the thread count
  }
  return mm;
}

void OneDnnInt8MatMul::Run() {
  omp_set_num_threads(threads_);
  state_->args[DNNL_ARG_WEIGHTS] = state_->weights[next_++ % state_->weights.size()];
  state_->prim.execute(state_->strm, state_->args);
  state_->strm.wait();
}

OneDnnInt8MatMul::~OneDnnInt8MatMul() { omp_set_num_threads(saved_threads_); }

#else  // !M3_HAVE_DNNL

struct OneDnnInt8MatMul::State {};

bool OneDnnAvailable() { return false; }

std::string OneDnnDescription() {
  return "m3 was built without oneDNN 2.x (libdnnl-dev not found by cmake/Dependencies.cmake)";
}

std::unique_ptr<OneDnnInt8MatMul> OneDnnInt8MatMul::Create(size_t, size_t, size_t, int, size_t, std::string* error) {
  *error = OneDnnDescription();
  return nullptr;
}

void OneDnnInt8MatMul::Run() {}

OneDnnInt8MatMul::~OneDnnInt8MatMul() = default;

#endif

}  // namespace m3::bench
