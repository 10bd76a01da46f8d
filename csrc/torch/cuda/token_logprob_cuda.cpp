// CUDA implementations of the token_logprob ops (schemas in csrc/torch/token_logprob.cpp).
// Same checks as the CPU glue (token_logprob_checks.h); out-of-range targets are not reported
// here (that would need a host sync): the kernels give NaN for their rows.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "megalign/token_logprob.h"
#include "token_logprob_checks.h"

namespace megalign::torch_glue::token_logprob {
namespace {

constexpr const char* kPartials = "token_logprob_partials";
constexpr const char* kFwd = "token_logprob_fwd";
constexpr const char* kBwd = "token_logprob_bwd";

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "megalign::", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

at::Tensor partials_cuda_checked(const char* op, const at::Tensor& logits, const at::Tensor& targets,
                                 int64_t vocab_start, int64_t vocab_size, double temperature,
                                 int64_t ignore_index, bool with_entropy) {
  const at::Tensor x = check_rows(op, logits, targets, temperature);
  check_cuda(x, op, "logits");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor tgt = targets.contiguous();
  at::Tensor out = at::empty({x.size(0), 4}, x.options().dtype(acc_type(x)));
  check_launch(cuda::token_logprob_partials(to_dtype(x, op, "logits"), x.data_ptr(), x.size(0),
                                            x.size(1), x.stride(0), tgt.data_ptr<int64_t>(),
                                            vocab_start, vocab_size, 1.0 / temperature,
                                            ignore_index, with_entropy, out.data_ptr(),
                                            at::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor partials_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                         int64_t vocab_size, double temperature, int64_t ignore_index,
                         bool with_entropy) {
  return partials_cuda_checked(kPartials, logits, targets, vocab_start, vocab_size, temperature,
                               ignore_index, with_entropy);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& logits,
                                                        const at::Tensor& targets,
                                                        double temperature, int64_t ignore_index,
                                                        bool with_entropy,
                                                        bool /*inplace_backward: autograd only*/) {
  const at::Tensor partials = partials_cuda_checked(kFwd, logits, targets, 0, logits.size(-1),
                                                    temperature, ignore_index, with_entropy);
  const c10::cuda::CUDAGuard guard(partials.device());
  const int64_t n = partials.size(0);
  at::Tensor logp = at::empty({n}, partials.options());
  at::Tensor lse = at::empty({n}, partials.options());
  at::Tensor entropy = at::empty({with_entropy ? n : 0}, partials.options());
  check_launch(cuda::token_logprob_finalize(to_dtype(partials, kFwd, "partials"),
                                            partials.data_ptr(), n, logp.data_ptr(),
                                            lse.data_ptr(),
                                            with_entropy ? entropy.data_ptr() : nullptr,
                                            at::cuda::getCurrentCUDAStream()),
               kFwd);
  return {logp, lse, entropy};
}

void bwd_into(const BackwardArgs& a, int64_t vocab_start, double temperature, int64_t ignore_index,
              at::Tensor& grad) {
  check_cuda(a.logits, kBwd, "logits");
  const c10::cuda::CUDAGuard guard(a.logits.device());
  check_launch(cuda::token_logprob_backward(
                   to_dtype(a.logits, kBwd, "logits"), a.logits.data_ptr(), a.logits.size(0),
                   a.logits.size(1), a.logits.stride(0), a.targets.data_ptr<int64_t>(),
                   a.lse.data_ptr(), data_or_null(a.entropy), a.grad_logp.data_ptr(),
                   data_or_null(a.grad_entropy), vocab_start, 1.0 / temperature, ignore_index,
                   grad.data_ptr(), grad.stride(0), at::cuda::getCurrentCUDAStream()),
               kBwd);
}

at::Tensor bwd_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                    const c10::optional<at::Tensor>& entropy, const at::Tensor& grad_logp,
                    const c10::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                    double temperature, int64_t ignore_index) {
  const BackwardArgs a = check_backward(kBwd, logits, targets, lse, entropy, grad_logp,
                                        grad_entropy, temperature);
  at::Tensor grad = at::empty(a.logits.sizes(), a.logits.options());
  bwd_into(a, vocab_start, temperature, ignore_index, grad);
  return grad;
}

void bwd_inplace_cuda(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                      const c10::optional<at::Tensor>& entropy, const at::Tensor& grad_logp,
                      const c10::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                      double temperature, int64_t ignore_index) {
  check_inplace_layout(logits);
  const BackwardArgs a = check_backward(kBwd, logits, targets, lse, entropy, grad_logp,
                                        grad_entropy, temperature);
  bwd_into(a, vocab_start, temperature, ignore_index, logits);
}

}  // namespace
}  // namespace megalign::torch_glue::token_logprob

TORCH_LIBRARY_IMPL(megalign, CUDA, m) {
  namespace g = megalign::torch_glue::token_logprob;
  m.impl("token_logprob_partials", &g::partials_cuda);
  m.impl("token_logprob_fwd", &g::fwd_cuda);
  m.impl("token_logprob_bwd", &g::bwd_cuda);
  m.impl("token_logprob_bwd_", &g::bwd_inplace_cuda);
}
