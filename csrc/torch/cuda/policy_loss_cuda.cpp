// CUDA implementations of the policy-loss ops: the shared glue (kl_policy_glue.h) with the CUDA
// launchers on the current stream of logp's device; the forward's two-stage statistics reduction
// gets its workspace from the caching allocator.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kl_policy_glue.h"

namespace {

using namespace megalign;
using namespace megalign::torch_glue;

std::tuple<at::Tensor, at::Tensor, at::Tensor> policy_loss_fwd_cuda(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
    double eps_low, double eps_high, std::optional<double> dual_clip, double beta,
    const std::optional<at::Tensor>& ref_logp, bool with_dlogp, bool sum_loss) {
  check_no_dlogp(with_dlogp, "policy_loss_fwd");
  const c10::cuda::CUDAGuard guard(logp.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return policy_loss_fwd_glue<false>(
      logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp, false, sum_loss,
      [&](const PolicyLossArgs& a, void* loss, float* stats, void*, double*) {
        const int64_t bytes = cuda::policy_loss_workspace_bytes(a.rows, a.cols, a.dtype);
        at::Tensor workspace = at::empty({bytes}, logp.options().dtype(at::kByte));
        cuda::policy_loss_fwd(a, loss, stats, workspace.data_ptr(), stream);
      });
}

at::Tensor policy_loss_bwd_cuda(const at::Tensor& grad, const at::Tensor& logp, const at::Tensor& old_logp,
                                const at::Tensor& advantages, const at::Tensor& mask, double eps_low,
                                double eps_high, std::optional<double> dual_clip, double beta,
                                const std::optional<at::Tensor>& ref_logp) {
  const c10::cuda::CUDAGuard guard(logp.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return policy_loss_bwd_glue(grad, logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta,
                              ref_logp, [&](const PolicyLossArgs& a, const StridedView& g, void* grad_logp) {
                                cuda::policy_loss_bwd(a, g, grad_logp, stream);
                              });
}

}  // namespace

TORCH_LIBRARY_IMPL(megalign, CUDA, m) {
  m.impl("policy_loss_fwd", &policy_loss_fwd_cuda);
  m.impl("policy_loss_bwd", &policy_loss_bwd_cuda);
}
