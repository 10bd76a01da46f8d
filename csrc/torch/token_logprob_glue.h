// The torch glue of token_logprob, written once for both devices: argument checks (each failure
// names the argument), output allocation and the call of a device's launchers. A Backend supplies
// check_device(tensor, op, arg), a Guard type constructed from the device, and partials /
// finalize / backward launchers with the raw-pointer signatures of megalign/token_logprob.h
// (minus the stream, which the CUDA backend adds).
#pragma once

#include <cmath>
#include <tuple>

#include "checks.h"

namespace megalign::torch_glue::token_logprob {

// Statistics and per-row outputs are fp32, fp64 for fp64 logits (exact gradcheck).
inline at::ScalarType acc_type(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Checks logits [N, V] and targets [N] int64 on one device; returns logits with a unit stride
// along V (copied only when the last dimension is not unit-stride; row strides are kept).
inline at::Tensor check_rows(const char* op, const at::Tensor& logits, const at::Tensor& targets,
                             double temperature) {
  to_dtype(logits, op, "logits");
  check_dim(logits, 2, op, "logits");
  check_dtype(targets, at::kLong, op, "targets");
  check_dim(targets, 1, op, "targets");
  TORCH_CHECK(targets.size(0) == logits.size(0), "megalign::", op,
              ": targets must have one entry per row of logits (", logits.size(0), "), got ",
              targets.size(0));
  check_same_device(logits, targets, op, "logits", "targets");
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "megalign::", op,
              ": temperature must be finite and > 0, got ", temperature);
  return logits.stride(1) == 1 || logits.size(1) <= 1 ? logits : logits.contiguous();
}

// Checks one per-row statistic (lse, entropy, grad_logp, grad_entropy): [N], accumulation dtype.
inline void check_row_values(const char* op, const at::Tensor& logits, const at::Tensor& v,
                             const char* arg) {
  check_dtype(v, acc_type(logits), op, arg);
  check_dim(v, 1, op, arg);
  TORCH_CHECK(v.size(0) == logits.size(0), "megalign::", op, ": ", arg,
              " must have one entry per row of logits (", logits.size(0), "), got ", v.size(0));
  check_same_device(logits, v, op, "logits", arg);
}

struct BackwardArgs {
  at::Tensor logits, targets, lse, entropy, grad_logp, grad_entropy;  // entropy pair may be undefined
};

inline BackwardArgs check_backward(const char* op, const at::Tensor& logits,
                                   const at::Tensor& targets, const at::Tensor& lse,
                                   const c10::optional<at::Tensor>& entropy,
                                   const at::Tensor& grad_logp,
                                   const c10::optional<at::Tensor>& grad_entropy,
                                   double temperature) {
  BackwardArgs a;
  a.logits = check_rows(op, logits, targets, temperature);
  a.targets = targets.contiguous();
  check_row_values(op, logits, lse, "lse");
  check_row_values(op, logits, grad_logp, "grad_logp");
  a.lse = lse.contiguous();
  a.grad_logp = grad_logp.contiguous();
  TORCH_CHECK(entropy.has_value() == grad_entropy.has_value(), "megalign::", op,
              ": entropy and grad_entropy must be given together");
  if (entropy.has_value()) {
    check_row_values(op, logits, *entropy, "entropy");
    check_row_values(op, logits, *grad_entropy, "grad_entropy");
    a.entropy = entropy->contiguous();
    a.grad_entropy = grad_entropy->contiguous();
  }
  return a;
}

// The in-place backward writes through logits' own strides: it cannot go through a copy.
inline void check_inplace_layout(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() != 2 || logits.stride(1) == 1 || logits.size(1) <= 1,
              "megalign::token_logprob_bwd_: logits must have a unit stride along the vocabulary "
              "for the in-place backward, got strides ", logits.strides());
}

inline const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

constexpr const char* kPartialsOp = "token_logprob_partials";
constexpr const char* kFwdOp = "token_logprob_fwd";
constexpr const char* kBwdOp = "token_logprob_bwd";

template <class Backend>
at::Tensor run_partials(const char* op, const at::Tensor& logits, const at::Tensor& targets,
                        int64_t vocab_start, int64_t vocab_size, double temperature,
                        int64_t ignore_index, bool with_entropy) {
  const at::Tensor x = check_rows(op, logits, targets, temperature);
  Backend::check_device(x, op, "logits");
  const typename Backend::Guard guard(x.device());
  const at::Tensor tgt = targets.contiguous();
  at::Tensor out = at::empty({x.size(0), 4}, x.options().dtype(acc_type(x)));
  Backend::partials(op, to_dtype(x, op, "logits"), x.data_ptr(), x.size(0), x.size(1), x.stride(0),
                    tgt.data_ptr<int64_t>(), vocab_start, vocab_size, 1.0 / temperature,
                    ignore_index, with_entropy, out.data_ptr());
  return out;
}

template <class Backend>
at::Tensor partials_op(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                       int64_t vocab_size, double temperature, int64_t ignore_index,
                       bool with_entropy) {
  return run_partials<Backend>(kPartialsOp, logits, targets, vocab_start, vocab_size, temperature,
                               ignore_index, with_entropy);
}

// inplace_backward is read only by the autograd formula (megalign/ops/token_logprob.py).
template <class Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_op(const at::Tensor& logits,
                                                      const at::Tensor& targets, double temperature,
                                                      int64_t ignore_index, bool with_entropy,
                                                      bool /*inplace_backward*/) {
  const at::Tensor partials = run_partials<Backend>(kFwdOp, logits, targets, 0, logits.size(-1),
                                                    temperature, ignore_index, with_entropy);
  const typename Backend::Guard guard(partials.device());
  const int64_t n = partials.size(0);
  at::Tensor logp = at::empty({n}, partials.options());
  at::Tensor lse = at::empty({n}, partials.options());
  at::Tensor entropy = at::empty({with_entropy ? n : 0}, partials.options());
  Backend::finalize(kFwdOp, to_dtype(partials, kFwdOp, "partials"), partials.data_ptr(), n,
                    logp.data_ptr(), lse.data_ptr(), with_entropy ? entropy.data_ptr() : nullptr);
  return {logp, lse, entropy};
}

template <class Backend>
void run_backward(const BackwardArgs& a, int64_t vocab_start, double temperature,
                  int64_t ignore_index, at::Tensor& grad) {
  Backend::check_device(a.logits, kBwdOp, "logits");
  const typename Backend::Guard guard(a.logits.device());
  Backend::backward(kBwdOp, to_dtype(a.logits, kBwdOp, "logits"), a.logits.data_ptr(),
                    a.logits.size(0), a.logits.size(1), a.logits.stride(0),
                    a.targets.data_ptr<int64_t>(), a.lse.data_ptr(), data_or_null(a.entropy),
                    a.grad_logp.data_ptr(), data_or_null(a.grad_entropy), vocab_start,
                    1.0 / temperature, ignore_index, grad.data_ptr(), grad.stride(0));
}

template <class Backend>
at::Tensor bwd_op(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                  const c10::optional<at::Tensor>& entropy, const at::Tensor& grad_logp,
                  const c10::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                  double temperature, int64_t ignore_index) {
  const BackwardArgs a = check_backward(kBwdOp, logits, targets, lse, entropy, grad_logp,
                                        grad_entropy, temperature);
  at::Tensor grad = Backend::new_grad(a.logits);
  run_backward<Backend>(a, vocab_start, temperature, ignore_index, grad);
  return grad;
}

template <class Backend>
void bwd_inplace_op(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                    const c10::optional<at::Tensor>& entropy, const at::Tensor& grad_logp,
                    const c10::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                    double temperature, int64_t ignore_index) {
  check_inplace_layout(logits);
  const BackwardArgs a = check_backward(kBwdOp, logits, targets, lse, entropy, grad_logp,
                                        grad_entropy, temperature);
  run_backward<Backend>(a, vocab_start, temperature, ignore_index, logits);
}

// Registers the four ops' implementations for one dispatch key.
template <class Backend> void register_impls(torch::Library& m) {
  m.impl("token_logprob_partials", &partials_op<Backend>);
  m.impl("token_logprob_fwd", &fwd_op<Backend>);
  m.impl("token_logprob_bwd", &bwd_op<Backend>);
  m.impl("token_logprob_bwd_", &bwd_inplace_op<Backend>);
}

}  // namespace megalign::torch_glue::token_logprob
