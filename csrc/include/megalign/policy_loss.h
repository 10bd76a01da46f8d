// Launchers of the fused per-token PPO/GRPO policy loss (math/policy.h). Operands are [rows, cols]
// strided views (kl_policy_common.h) of one float dtype; the mask has its own dtype. The forward
// writes the dense per-token loss in acc_t<T> (0 at masked tokens) and kNumPolicyStats fp32
// statistics in the same pass; the backward recomputes each token from the inputs and writes the
// dense grad_logp in T (0 at masked tokens).
#pragma once

#include <cstdint>

#include "megalign/common.h"
#include "megalign/kl_policy_common.h"
#include "megalign/math/policy.h"

namespace megalign {

struct PolicyLossArgs {
  DType dtype;  // of logp, old_logp, advantages, ref_logp
  MaskDType mask_dtype;
  int64_t rows;
  int64_t cols;
  StridedView logp;
  StridedView old_logp;
  StridedView advantages;
  StridedView mask;
  StridedView ref_logp;  // data == nullptr when absent
  double eps_low;
  double eps_high;
  double dual_clip;  // <= 0: no dual clip
  double beta;       // > 0 needs ref_logp
};

// The scalar coefficients of `a` in the accumulation type A.
template <typename A>
inline PolicyCoeffs<A> policy_coeffs(const PolicyLossArgs& a) {
  return {A(a.eps_low), A(a.eps_high), A(a.dual_clip), A(a.beta)};
}

}  // namespace megalign

namespace megalign::cpu {

// With dlogp (dense, acc_t<T>; null: not wanted) the same pass also writes d loss / d logp per
// token (0 at masked tokens): the backward's gradient per unit upstream gradient, which the
// backward then only scales. With loss_sum (null: not wanted) it also writes the sum of the
// per-token loss over the valid tokens (accumulated in acc_t<T> within a chunk, in double across
// chunks, in chunk order); loss may then be null, and the per-token loss is not stored at all.
void policy_loss_fwd(const PolicyLossArgs& a, void* loss, float* stats, void* dlogp = nullptr,
                     double* loss_sum = nullptr);
// grad is acc_t<T>, viewed like the inputs (autograd often hands a stride-0 expansion).
void policy_loss_bwd(const PolicyLossArgs& a, const StridedView& grad, void* grad_logp);

}  // namespace megalign::cpu

#if defined(MEGALIGN_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

namespace megalign::cuda {

// The statistics reduce in two stages through `workspace` (policy_loss_workspace_bytes of device
// memory): per-block partials, then one block that merges them in order and finalises.
int64_t policy_loss_workspace_bytes(int64_t rows, int64_t cols, DType dtype);
void policy_loss_fwd(const PolicyLossArgs& a, void* loss, float* stats, void* workspace,
                     cudaStream_t stream);
void policy_loss_bwd(const PolicyLossArgs& a, const StridedView& grad, void* grad_logp,
                     cudaStream_t stream);

}  // namespace megalign::cuda
#endif
