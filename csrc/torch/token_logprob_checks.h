// Argument checks and output allocation shared by the CPU and CUDA glue of token_logprob, so both
// devices reject the same inputs with the same messages (each naming the argument).
#pragma once

#include <cmath>

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

}  // namespace megalign::torch_glue::token_logprob
