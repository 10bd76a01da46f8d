// megalign::gae on CUDA: the checks of the CPU glue (gae_checks.h) plus the device, then the
// block-scan launcher on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "gae_checks.h"

namespace megalign::torch_glue {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& mask, double gamma, double lam) {
  check_cuda(rewards, "gae", "rewards");
  const c10::cuda::CUDAGuard guard(rewards.device());
  const GaeCall c = prepare_gae(rewards, values, mask, gamma, lam);
  cuda::gae(c.dtype, rewards.data_ptr(), strides2d(rewards), values.data_ptr(), strides2d(values),
            mask.data_ptr<bool>(), strides2d(mask), rewards.size(0), rewards.size(1), gamma, lam,
            c.advantages.data_ptr(), c.returns.data_ptr(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {c.advantages, c.returns};
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_IMPL(megalign, CUDA, m) { m.impl("gae", &megalign::torch_glue::gae_cuda); }
