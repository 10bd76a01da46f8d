// Schemas of the fused policy-loss ops and their CPU implementations (glue in kl_policy_glue.h).
//   policy_loss_fwd: per-token loss (acc dtype, 0 at masked tokens) and fp32 stats[7] in one pass
//                    (layout: megalign/math/policy.h, PolicyStat); with with_dlogp also
//                    d loss / d logp per token (else an empty tensor; CPU only), which autograd
//                    then only scales instead of running policy_loss_bwd; with sum_loss the loss
//                    is the 0-d sum over valid tokens instead (the CPU kernels reduce it in the
//                    same pass and store no per-token loss).
//   policy_loss_bwd: d loss / d logp recomputed from the inputs.
#include "kl_policy_glue.h"

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def(
      "policy_loss_fwd(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, float eps_low, "
      "float eps_high, float? dual_clip, float beta, Tensor? ref_logp, bool with_dlogp=False, bool sum_loss=False) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "policy_loss_bwd(Tensor grad, Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, "
      "float eps_low, float eps_high, float? dual_clip, float beta, Tensor? ref_logp) -> Tensor");
}

namespace {

using namespace megalign;
using namespace megalign::torch_glue;

std::tuple<at::Tensor, at::Tensor, at::Tensor> policy_loss_fwd_cpu(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
    double eps_low, double eps_high, std::optional<double> dual_clip, double beta,
    const std::optional<at::Tensor>& ref_logp, bool with_dlogp, bool sum_loss) {
  return policy_loss_fwd_glue<true>(
      logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp, with_dlogp, sum_loss,
      [](const PolicyLossArgs& a, void* loss, float* stats, void* dlogp, double* loss_sum) {
        cpu::policy_loss_fwd(a, loss, stats, dlogp, loss_sum);
      });
}

at::Tensor policy_loss_bwd_cpu(const at::Tensor& grad, const at::Tensor& logp, const at::Tensor& old_logp,
                               const at::Tensor& advantages, const at::Tensor& mask, double eps_low,
                               double eps_high, std::optional<double> dual_clip, double beta,
                               const std::optional<at::Tensor>& ref_logp) {
  return policy_loss_bwd_glue(grad, logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta,
                              ref_logp, [](const PolicyLossArgs& a, const StridedView& g, void* grad_logp) {
                                cpu::policy_loss_bwd(a, g, grad_logp);
                              });
}

}  // namespace

TORCH_LIBRARY_IMPL(megalign, CPU, m) {
  m.impl("policy_loss_fwd", &policy_loss_fwd_cpu);
  m.impl("policy_loss_bwd", &policy_loss_bwd_cpu);
}
