// CUDA implementations of the token_logprob ops (schemas in csrc/torch/token_logprob.cpp, shared
// glue in token_logprob_glue.h). Out-of-range targets are not reported here (that would need a
// host sync): the kernels give NaN for their rows.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "megalign/token_logprob.h"
#include "token_logprob_glue.h"

namespace megalign::torch_glue::token_logprob {
namespace {

struct CudaBackend {
  using Guard = c10::cuda::CUDAGuard;
  static void check_device(const at::Tensor& t, const char* op, const char* arg) { check_cuda(t, op, arg); }

  // Calls a CUDA launcher on the current stream and raises if the launch failed.
  template <class Launcher, class... Args>
  static void launch(const char* op, Launcher launcher, Args... args) {
    const cudaError_t err = launcher(args..., at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "megalign::", op, ": CUDA launch failed: ", cudaGetErrorString(err));
  }
  template <class... Args> static void partials(const char* op, Args... args) {
    launch(op, &cuda::token_logprob_partials, args...);
  }
  template <class... Args> static void finalize(const char* op, Args... args) {
    launch(op, &cuda::token_logprob_finalize, args...);
  }
  template <class... Args> static void backward(const char* op, Args... args) {
    launch(op, &cuda::token_logprob_backward, args...);
  }
  static at::Tensor new_grad(const at::Tensor& logits) { return at::empty(logits.sizes(), logits.options()); }
};

}  // namespace
}  // namespace megalign::torch_glue::token_logprob

TORCH_LIBRARY_IMPL(megalign, CUDA, m) {
  namespace g = megalign::torch_glue::token_logprob;
  g::register_impls<g::CudaBackend>(m);
}
