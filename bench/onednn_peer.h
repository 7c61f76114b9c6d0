// oneDNN's int8 matmul as the peer of our q8 GEMM in `m3 bench --kernels`. Compiled against
// oneDNN 2.x when cmake/Dependencies.cmake finds it (M3_HAVE_DNNL); otherwise Create() fails with
// a message saying so.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace m3::bench {

// y[m, n] = f32(scale[n] * sum_k src[m, k] * wei[k, n]) with src u8 [m, k] row-major, weights s8
// [k, n] in the layout oneDNN prefers (format_tag::any; reordered once at creation from our
// row-major [n, k]) and per-output-channel scales. `copies` weight matrices are made and each Run
// uses the next one round robin, so that with enough of them every call's weights are cold (as a
// MoE expert's are). oneDNN runs on OpenMP: `threads` goes through omp_set_num_threads before
// creation and before every Run (the previous value is restored when the object is destroyed).
class OneDnnInt8MatMul {
 public:
  static std::unique_ptr<OneDnnInt8MatMul> Create(size_t m, size_t k, size_t n, int threads, size_t copies,
                                                  std::string* error);
  ~OneDnnInt8MatMul();
  void Run();                              // one matmul, returns when it is done
  const std::string& impl() const { return impl_; }  // "oneDNN 2.6.3 brg:avx512_core_vnni"

 private:
  struct State;
  OneDnnInt8MatMul() = default;
  std::unique_ptr<State> state_;
  std::string impl_;
  int threads_ = 1, saved_threads_ = 1;
  size_t next_ = 0;  // the weight copy of the next Run
};

bool OneDnnAvailable();
std::string OneDnnDescription();  // "oneDNN 2.6.3", or why it is not built in

}  // namespace m3::bench
