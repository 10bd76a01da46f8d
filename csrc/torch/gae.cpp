// megalign::gae: schema and CPU implementation. GAE targets are constants of the loss, so the op
// has no derivative; megalign.ops.gae detaches its inputs.
#include "gae_checks.h"

namespace megalign::torch_glue {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& mask, double gamma, double lam) {
  check_cpu(rewards, "gae", "rewards");
  const GaeCall c = prepare_gae(rewards, values, mask, gamma, lam);
  cpu::gae(c.dtype, rewards.data_ptr(), strides2d(rewards), values.data_ptr(), strides2d(values),
           mask.data_ptr<bool>(), strides2d(mask), rewards.size(0), rewards.size(1), gamma, lam,
           c.advantages.data_ptr(), c.returns.data_ptr());
  return {c.advantages, c.returns};
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def("gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megalign, CPU, m) { m.impl("gae", &megalign::torch_glue::gae_cpu); }
