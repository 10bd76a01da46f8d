// Schemas of the kl_penalty ops and their CPU implementations (glue in kl_policy_glue.h).
//   kl_penalty_fwd/bwd:      elementwise estimate; the backward returns d/d logp only
//                            (d/d ref_logp is its negation).
//   kl_masked_mean_fwd/bwd:  sum(kl * valid) / count(valid) in one pass, returning the count
//                            for the backward.
#include "kl_policy_glue.h"

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def("kl_penalty_fwd(Tensor logp, Tensor ref_logp, str kind) -> Tensor");
  m.def("kl_penalty_bwd(Tensor grad, Tensor logp, Tensor ref_logp, str kind) -> Tensor");
  m.def("kl_masked_mean_fwd(Tensor logp, Tensor ref_logp, Tensor mask, str kind) -> (Tensor, Tensor)");
  m.def("kl_masked_mean_bwd(Tensor grad, Tensor count, Tensor logp, Tensor ref_logp, Tensor mask, str kind) -> Tensor");
}

namespace {

using namespace megalign;
using namespace megalign::torch_glue;

at::Tensor kl_penalty_fwd_cpu(const at::Tensor& logp, const at::Tensor& ref_logp, c10::string_view kind) {
  return kl_penalty_fwd_glue(logp, ref_logp, std::string(kind),
                             [](const KlArgs& a, void* out) { cpu::kl_penalty_fwd(a, out); });
}

at::Tensor kl_penalty_bwd_cpu(const at::Tensor& grad, const at::Tensor& logp, const at::Tensor& ref_logp,
                              c10::string_view kind) {
  return kl_penalty_bwd_glue(grad, logp, ref_logp, std::string(kind),
                             [](const KlArgs& a, const StridedView& g, void* grad_logp) {
                               cpu::kl_penalty_bwd(a, g, grad_logp);
                             });
}

std::tuple<at::Tensor, at::Tensor> kl_masked_mean_fwd_cpu(const at::Tensor& logp, const at::Tensor& ref_logp,
                                                          const at::Tensor& mask, c10::string_view kind) {
  return kl_masked_mean_fwd_glue(logp, ref_logp, mask, std::string(kind),
                                 [](const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count) {
                                   cpu::kl_masked_mean_fwd(a, m, mean, count);
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
