// Schemas of the kl_penalty ops and their CPU implementations (glue in kl_policy_glue.h).
//   kl_penalty_fwd/bwd:      elementwise estimate; the backward returns d/d logp only
//                            (d/d ref_logp is its negation). With with_dlogp the forward also
//                            returns d kl / d logp (else an empty tensor; CPU only), which
//                            autograd then only scales instead of running the backward.
//   kl_masked_mean_fwd/bwd:  sum(kl * valid) / count(valid) in one pass, returning the count
//                            for the backward (and, with with_dlogp, valid * d kl / d logp).
#include "kl_policy_glue.h"

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def("kl_penalty_fwd(Tensor logp, Tensor ref_logp, str kind, bool with_dlogp=False) -> (Tensor, Tensor)");
  m.def("kl_penalty_bwd(Tensor grad, Tensor logp, Tensor ref_logp, str kind) -> Tensor");
  m.def(
      "kl_masked_mean_fwd(Tensor logp, Tensor ref_logp, Tensor mask, str kind, bool with_dlogp=False) -> "
      "(Tensor, Tensor, Tensor)");
  m.def("kl_masked_mean_bwd(Tensor grad, Tensor count, Tensor logp, Tensor ref_logp, Tensor mask, str kind) -> Tensor");
}

namespace {

using namespace megalign;
using namespace megalign::torch_glue;

std::tuple<at::Tensor, at::Tensor> kl_penalty_fwd_cpu(const at::Tensor& logp, const at::Tensor& ref_logp,
                                                      c10::string_view kind, bool with_dlogp) {
  return kl_penalty_fwd_glue(logp, ref_logp, std::string(kind), with_dlogp,
                             [](const KlArgs& a, void* out, void* dlogp) { cpu::kl_penalty_fwd(a, out, dlogp); });
}

at::Tensor kl_penalty_bwd_cpu(const at::Tensor& grad, const at::Tensor& logp, const at::Tensor& ref_logp,
                              c10::string_view kind) {
  return kl_penalty_bwd_glue(grad, logp, ref_logp, std::string(kind),
                             [](const KlArgs& a, const StridedView& g, void* grad_logp) {
                               cpu::kl_penalty_bwd(a, g, grad_logp);
                             });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kl_masked_mean_fwd_cpu(const at::Tensor& logp,
                                                                      const at::Tensor& ref_logp,
                                                                      const at::Tensor& mask, c10::string_view kind,
                                                                      bool with_dlogp) {
  return kl_masked_mean_fwd_glue(logp, ref_logp, mask, std::string(kind), with_dlogp,
                                 [](const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count, void* dlogp) {
                                   cpu::kl_masked_mean_fwd(a, m, mean, count, dlogp);
                                 });
}

at::Tensor kl_masked_mean_bwd_cpu(const at::Tensor& grad, const at::Tensor& count, const at::Tensor& logp,
                                  const at::Tensor& ref_logp, const at::Tensor& mask, c10::string_view kind) {
  return kl_masked_mean_bwd_glue(
      grad, count, logp, ref_logp, mask, std::string(kind),
      [](const KlArgs& a, const KlMaskArg& m, const void* g, const int64_t* n, void* grad_logp) {
        cpu::kl_masked_mean_bwd(a, m, g, n, grad_logp);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(megalign, CPU, m) {
  m.impl("kl_penalty_fwd", &kl_penalty_fwd_cpu);
  m.impl("kl_penalty_bwd", &kl_penalty_bwd_cpu);
  m.impl("kl_masked_mean_fwd", &kl_masked_mean_fwd_cpu);
  m.impl("kl_masked_mean_bwd", &kl_masked_mean_bwd_cpu);
}
