// CUDA implementations of the kl_penalty ops: the shared glue (kl_policy_glue.h) with the CUDA
// launchers on the current stream of logp's device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kl_policy_glue.h"

namespace {

using namespace megalign;
using namespace megalign::torch_glue;

std::tuple<at::Tensor, at::Tensor> kl_penalty_fwd_cuda(const at::Tensor& logp, const at::Tensor& ref_logp,
                                                       c10::string_view kind, bool with_dlogp) {
  check_no_dlogp(with_dlogp, "kl_penalty_fwd");
  const c10::cuda::CUDAGuard guard(logp.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return kl_penalty_fwd_glue(logp, ref_logp, std::string(kind), false,
                             [&](const KlArgs& a, void* out, void*) { cuda::kl_penalty_fwd(a, out, stream); });
}

at::Tensor kl_penalty_bwd_cuda(const at::Tensor& grad, const at::Tensor& logp, const at::Tensor& ref_logp,
                               c10::string_view kind) {
  const c10::cuda::CUDAGuard guard(logp.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return kl_penalty_bwd_glue(grad, logp, ref_logp, std::string(kind),
                             [&](const KlArgs& a, const StridedView& g, void* grad_logp) {
                               cuda::kl_penalty_bwd(a, g, grad_logp, stream);
                             });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kl_masked_mean_fwd_cuda(const at::Tensor& logp,
                                                                       const at::Tensor& ref_logp,
                                                                       const at::Tensor& mask, c10::string_view kind,
                                                                       bool with_dlogp) {
  check_no_dlogp(with_dlogp, "kl_masked_mean_fwd");
  const c10::cuda::CUDAGuard guard(logp.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return kl_masked_mean_fwd_glue(
      logp, ref_logp, mask, std::string(kind), false,
      [&](const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count, void*) {
        const int64_t bytes = cuda::kl_masked_mean_workspace_bytes(a.rows, a.cols, a.dtype);
        at::Tensor workspace = at::empty({bytes}, logp.options().dtype(at::kByte));
        cuda::kl_masked_mean_fwd(a, m, mean, count, workspace.data_ptr(), stream);
      });
}

at::Tensor kl_masked_mean_bwd_cuda(const at::Tensor& grad, const at::Tensor& count, const at::Tensor& logp,
                                   const at::Tensor& ref_logp, const at::Tensor& mask, c10::string_view kind) {
  const c10::cuda::CUDAGuard guard(logp.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return kl_masked_mean_bwd_glue(
      grad, count, logp, ref_logp, mask, std::string(kind),
      [&](const KlArgs& a, const KlMaskArg& m, const void* g, const int64_t* n, void* grad_logp) {
        cuda::kl_masked_mean_bwd(a, m, g, n, grad_logp, stream);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(megalign, CUDA, m) {
  m.impl("kl_penalty_fwd", &kl_penalty_fwd_cuda);
  m.impl("kl_penalty_bwd", &kl_penalty_bwd_cuda);
  m.impl("kl_masked_mean_fwd", &kl_masked_mean_fwd_cuda);
  m.impl("kl_masked_mean_bwd", &kl_masked_mean_bwd_cuda);
}
