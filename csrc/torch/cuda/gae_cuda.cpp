// megalign::gae on CUDA: the checks of the CPU glue (gae_checks.h) plus the device, then the
// block-scan launcher on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "gae_checks.h"

namespace megalign::torch_glue {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& mask, double gamma, double lam) {
  const GaeArgs a = check_gae(rewards, values, mask, gamma, lam);
  check_cuda(rewards, "gae", "rewards");
  const c10::cuda::CUDAGuard guard(rewards.device());
  at::Tensor adv = at::empty({a.batch, a.steps}, rewards.options().dtype(a.out_type));
  at::Tensor ret = at::empty_like(adv);
  cuda::gae(a.dtype, rewards.data_ptr(), strides2d(rewards), values.data_ptr(), strides2d(values),
            mask.data_ptr<bool>(), strides2d(mask), a.batch, a.steps, gamma, lam, adv.data_ptr(), ret.data_ptr(),
            at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {adv, ret};
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_IMPL(megalign, CUDA, m) { m.impl("gae", &megalign::torch_glue::gae_cuda); }
