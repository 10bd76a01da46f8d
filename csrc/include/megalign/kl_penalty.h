// Launchers of kl_penalty (elementwise KL estimate) and its fused masked mean.
// Operands are [rows, cols] strided views (kl_policy_common.h); outputs are dense [rows*cols]
// in acc_t<T> (fp32, fp64 for fp64 inputs); gradients are dense in the input dtype T. Only
// d/d logp is written: d/d ref_logp is its negation (math/kl.h).
#pragma once

#include <cstdint>

#include "megalign/common.h"
#include "megalign/kl_policy_common.h"
#include "megalign/math/kl.h"

namespace megalign {

struct KlArgs {
  DType dtype;  // of logp and ref_logp
  KlKind kind;
  int64_t rows;
  int64_t cols;
  StridedView logp;
  StridedView ref_logp;
};

// Mask of the fused masked mean.
struct KlMaskArg {
  MaskDType dtype;
  StridedView mask;
};

}  // namespace megalign

namespace megalign::cpu {

// out[i] = kl(logp[i], ref_logp[i]). With dlogp (dense, acc_t<T>; null: not wanted), also
// dlogp[i] = dkl/dlogp from the same evaluation: the gradient per unit upstream gradient, which
// the backward then only scales (CPU only: the CUDA backward recomputes, at the GPU's bandwidth).
void kl_penalty_fwd(const KlArgs& a, void* out, void* dlogp = nullptr);
// grad_logp[i] = grad[i] * dkl/dlogp; grad is acc_t<T>, viewed like the inputs.
void kl_penalty_bwd(const KlArgs& a, const StridedView& grad, void* grad_logp);
// mean = sum(kl * valid) / count(valid) (0 when count is 0), count = count(valid); with dlogp
// (as kl_penalty_fwd's) also dlogp[i] = valid ? dkl/dlogp : 0, not yet divided by the count.
void kl_masked_mean_fwd(const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count,
                        void* dlogp = nullptr);
// grad_logp[i] = valid ? grad_mean / count * dkl/dlogp : 0; grad_mean is one acc_t<T> value.
void kl_masked_mean_bwd(const KlArgs& a, const KlMaskArg& m, const void* grad_mean,
                        const int64_t* count, void* grad_logp);

}  // namespace megalign::cpu

#if defined(MEGALIGN_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime_api.h>

namespace megalign::cuda {

// Same contracts as the CPU launchers; every pointer is device memory. The masked mean reduces in
// two stages through `workspace` (kl_masked_mean_workspace_bytes of device memory), so the result
// does not depend on scheduling, and reads grad_mean / count on the device (no host sync).
void kl_penalty_fwd(const KlArgs& a, void* out, cudaStream_t stream);
void kl_penalty_bwd(const KlArgs& a, const StridedView& grad, void* grad_logp, cudaStream_t stream);
int64_t kl_masked_mean_workspace_bytes(int64_t rows, int64_t cols, DType dtype);
void kl_masked_mean_fwd(const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count,
                        void* workspace, cudaStream_t stream);
void kl_masked_mean_bwd(const KlArgs& a, const KlMaskArg& m, const void* grad_mean,
                        const int64_t* count, void* grad_logp, cudaStream_t stream);

}  // namespace megalign::cuda
#endif
