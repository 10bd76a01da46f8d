// megalign::gae: schema and CPU implementation. GAE targets are constants of the loss, so the op
// has no derivative; megalign.ops.gae detaches its inputs.
#include "gae_checks.h"

namespace megalign::torch_glue {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& mask, double gamma, double lam) {
  const GaeArgs a = check_gae(rewards, values, mask, gamma, lam);
  check_cpu(rewards, "gae", "rewards");
  at::Tensor adv = at::empty({a.batch, a.steps}, rewards.options().dtype(a.out_type));
  at::Tensor ret = at::empty_like(adv);
  cpu::gae(a.dtype, rewards.data_ptr(), strides2d(rewards), values.data_ptr(), strides2d(values),
           mask.data_ptr<bool>(), strides2d(mask), a.batch, a.steps, gamma, lam, adv.data_ptr(), ret.data_ptr());
  return {adv, ret};
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def("gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megalign, CPU, m) { m.impl("gae", &megalign::torch_glue::gae_cpu); }
