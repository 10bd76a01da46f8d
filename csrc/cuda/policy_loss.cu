// CUDA kernels of the fused policy loss: one grid-stride pass writes the per-token loss and
// accumulates the statistics per thread, merged per block and then by one block in block order
// (kl_policy_reduce.cuh), so the result is reproducible; the backward recomputes each token from
// the inputs. The per-token math is math/policy.h, shared with the CPU kernels.
#include "megalign/policy_loss.h"

#include "kl_policy_reduce.cuh"

namespace megalign::cuda {
namespace {

using detail::at;
using detail::kThreads;

bool inputs_dense(const PolicyLossArgs& a) {
  return is_dense(a.logp, a.cols) && is_dense(a.old_logp, a.cols) && is_dense(a.advantages, a.cols) &&
         is_dense(a.mask, a.cols) && is_dense(a.ref_logp, a.cols);
}

template <typename T, bool Dense>
__device__ __forceinline__ PolicyToken<acc_t<T>> token_at(const PolicyLossArgs& a, const PolicyCoeffs<acc_t<T>>& p,
                                                          int64_t i) {
  using A = acc_t<T>;
  const bool has_ref = a.ref_logp.data != nullptr;
  const A ref = has_ref ? load_acc<T>(a.ref_logp, at<Dense>(a.ref_logp, i, a.cols)) : A(0);
  return policy_token(load_acc<T>(a.logp, at<Dense>(a.logp, i, a.cols)),
                      load_acc<T>(a.old_logp, at<Dense>(a.old_logp, i, a.cols)),
                      load_acc<T>(a.advantages, at<Dense>(a.advantages, i, a.cols)), has_ref, ref, p);
}

// The statistics accumulate in double whatever T is, as the CPU kernels do (PolicyPartial<double>).
template <typename T, typename M, bool Dense>
__global__ void fwd_kernel(PolicyLossArgs a, PolicyCoeffs<acc_t<T>> p, acc_t<T>* loss,
                           PolicyPartial<double>* partials) {
  using A = acc_t<T>;
  const int64_t n = a.rows * a.cols;
  PolicyPartial<double> part;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    if (!load_valid<M>(a.mask, at<Dense>(a.mask, i, a.cols))) {
      loss[i] = A(0);
      continue;
    }
    const PolicyToken<A> t = token_at<T, Dense>(a, p, i);
    loss[i] = t.loss;
    part.add(t);
  }
  const PolicyPartial<double> total = detail::block_merge(part);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

struct StatsFinish {
  float* stats;
  __device__ void operator()(const PolicyPartial<double>& total) const { total.finalize(stats); }
};

template <typename T, typename M, bool Dense>
__global__ void bwd_kernel(PolicyLossArgs a, PolicyCoeffs<acc_t<T>> p, StridedView grad, T* grad_logp) {
  using A = acc_t<T>;
  const int64_t n = a.rows * a.cols;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    A g = A(0);
    if (load_valid<M>(a.mask, at<Dense>(a.mask, i, a.cols))) {
      g = load_acc<A>(grad, at<false>(grad, i, a.cols)) * token_at<T, Dense>(a, p, i).dlogp;
    }
    grad_logp[i] = from_acc<T>(g);
  }
}

}  // namespace

int64_t policy_loss_workspace_bytes(int64_t rows, int64_t cols, DType dtype) {
  (void)dtype;  // every dtype accumulates in double
  return detail::grid_blocks(rows * cols, detail::kMaxReduceBlocks) * static_cast<int64_t>(sizeof(PolicyPartial<double>));
}

void policy_loss_fwd(const PolicyLossArgs& a, void* loss, float* stats, void* workspace, cudaStream_t stream) {
  const int blocks = detail::grid_blocks(a.rows * a.cols, detail::kMaxReduceBlocks);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "policy_loss_fwd", [&] {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_fwd", [&] {
      using S = acc_t<scalar_t>;
      auto* partials = static_cast<PolicyPartial<double>*>(workspace);
      if (blocks > 0) {
        dispatch_bool(inputs_dense(a), [&](auto dense) {
          fwd_kernel<scalar_t, mask_t, decltype(dense)::value><<<blocks, kThreads, 0, stream>>>(
              a, policy_coeffs<S>(a), static_cast<S*>(loss), partials);
        });
      }
      detail::merge_partials_kernel<<<1, kThreads, 0, stream>>>(static_cast<const PolicyPartial<double>*>(partials),
                                                                 blocks, StatsFinish{stats});
    });
  });
  detail::check_launch("policy_loss_fwd");
}

void policy_loss_bwd(const PolicyLossArgs& a, const StridedView& grad, void* grad_logp, cudaStream_t stream) {
  const int blocks = detail::grid_blocks(a.rows * a.cols, detail::kMaxElementwiseBlocks);
  if (blocks == 0) return;
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "policy_loss_bwd", [&] {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_bwd", [&] {
      dispatch_bool(inputs_dense(a), [&](auto dense) {
        bwd_kernel<scalar_t, mask_t, decltype(dense)::value><<<blocks, kThreads, 0, stream>>>(
            a, policy_coeffs<acc_t<scalar_t>>(a), grad, static_cast<scalar_t*>(grad_logp));
      });
    });
  });
  detail::check_launch("policy_loss_bwd");
}

}  // namespace megalign::cuda
