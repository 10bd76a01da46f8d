// CUDA kernels of kl_penalty: grid-stride elementwise estimate and gradient, and the masked mean
// as a two-stage reduction (kl_policy_reduce.cuh). The estimators are math/kl.h, shared with the
// CPU kernels.
#include "megalign/kl_penalty.h"

#include "kl_policy_reduce.cuh"

namespace megalign::cuda {
namespace {

using detail::at;
using detail::kThreads;

bool all_dense(const KlArgs& a, const StridedView& extra) {
  return is_dense(a.logp, a.cols) && is_dense(a.ref_logp, a.cols) && is_dense(extra, a.cols);
}

template <typename T, bool Dense>
__device__ __forceinline__ KlValue<acc_t<T>> kl_at(const KlArgs& a, int64_t i) {
  return kl_estimate(a.kind, load_acc<T>(a.logp, at<Dense>(a.logp, i, a.cols)),
                     load_acc<T>(a.ref_logp, at<Dense>(a.ref_logp, i, a.cols)));
}

template <typename T, bool Dense>
__global__ void fwd_kernel(KlArgs a, acc_t<T>* out) {
  const int64_t n = a.rows * a.cols;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) out[i] = kl_at<T, Dense>(a, i).value;
}

template <typename T, bool Dense>
__global__ void bwd_kernel(KlArgs a, StridedView grad, T* grad_logp) {
  using A = acc_t<T>;
  const int64_t n = a.rows * a.cols;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    const A g = load_acc<A>(grad, at<false>(grad, i, a.cols));
    grad_logp[i] = from_acc<T>(g * kl_at<T, Dense>(a, i).dlogp);
  }
}

// The masked sum accumulates in double whatever T is, as the CPU kernels do: an fp32 sum over
// millions of tokens loses digits the CPU keeps (one double add per element costs nothing in a
// pass bounded by memory bandwidth).
template <typename T, typename M, bool Dense>
__global__ void masked_sum_kernel(KlArgs a, KlMaskArg m, KlMeanPartial<double>* partials) {
  const int64_t n = a.rows * a.cols;
  KlMeanPartial<double> part;
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    if (!load_valid<M>(m.mask, at<Dense>(m.mask, i, a.cols))) continue;
    part.sum += kl_at<T, Dense>(a, i).value;
    ++part.count;
  }
  const KlMeanPartial<double> total = detail::block_merge(part);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <typename A>
struct MeanFinish {
  A* mean;
  int64_t* count;
  __device__ void operator()(const KlMeanPartial<double>& total) const {
    *mean = static_cast<A>(total.mean());
    *count = total.count;
  }
};

template <typename T, typename M, bool Dense>
__global__ void masked_bwd_kernel(KlArgs a, KlMaskArg m, const acc_t<T>* grad_mean, const int64_t* count,
                                  T* grad_logp) {
  using A = acc_t<T>;
  const int64_t n = a.rows * a.cols;
  const A scale = *grad_mean / A(*count > 0 ? *count : 1);  // no valid token: every gradient is 0
  for (int64_t i = detail::grid_start(); i < n; i += detail::grid_step()) {
    const bool valid = load_valid<M>(m.mask, at<Dense>(m.mask, i, a.cols));
    grad_logp[i] = from_acc<T>(valid ? scale * kl_at<T, Dense>(a, i).dlogp : A(0));
  }
}

}  // namespace

void kl_penalty_fwd(const KlArgs& a, void* out, cudaStream_t stream) {
  const int blocks = detail::grid_blocks(a.rows * a.cols, detail::kMaxElementwiseBlocks);
  if (blocks == 0) return;
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_penalty_fwd", [&] {
    dispatch_bool(all_dense(a, {}), [&](auto dense) {
      fwd_kernel<scalar_t, decltype(dense)::value>
          <<<blocks, kThreads, 0, stream>>>(a, static_cast<acc_t<scalar_t>*>(out));
    });
  });
  detail::check_launch("kl_penalty_fwd");
}

void kl_penalty_bwd(const KlArgs& a, const StridedView& grad, void* grad_logp, cudaStream_t stream) {
  const int blocks = detail::grid_blocks(a.rows * a.cols, detail::kMaxElementwiseBlocks);
  if (blocks == 0) return;
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_penalty_bwd", [&] {
    dispatch_bool(all_dense(a, {}), [&](auto dense) {
      bwd_kernel<scalar_t, decltype(dense)::value>
          <<<blocks, kThreads, 0, stream>>>(a, grad, static_cast<scalar_t*>(grad_logp));
    });
  });
  detail::check_launch("kl_penalty_bwd");
}

int64_t kl_masked_mean_workspace_bytes(int64_t rows, int64_t cols, DType dtype) {
  (void)dtype;  // every dtype accumulates in double
  return detail::grid_blocks(rows * cols, detail::kMaxReduceBlocks) * static_cast<int64_t>(sizeof(KlMeanPartial<double>));
}

void kl_masked_mean_fwd(const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count, void* workspace,
                        cudaStream_t stream) {
  const int blocks = detail::grid_blocks(a.rows * a.cols, detail::kMaxReduceBlocks);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_masked_mean_fwd", [&] {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_fwd", [&] {
      using A = acc_t<scalar_t>;
      auto* partials = static_cast<KlMeanPartial<double>*>(workspace);
      if (blocks > 0) {
        dispatch_bool(all_dense(a, m.mask), [&](auto dense) {
          masked_sum_kernel<scalar_t, mask_t, decltype(dense)::value><<<blocks, kThreads, 0, stream>>>(a, m, partials);
        });
      }
      detail::merge_partials_kernel<<<1, kThreads, 0, stream>>>(
          static_cast<const KlMeanPartial<double>*>(partials), blocks, MeanFinish<A>{static_cast<A*>(mean), count});
    });
  });
  detail::check_launch("kl_masked_mean_fwd");
}

void kl_masked_mean_bwd(const KlArgs& a, const KlMaskArg& m, const void* grad_mean, const int64_t* count,
                        void* grad_logp, cudaStream_t stream) {
  const int blocks = detail::grid_blocks(a.rows * a.cols, detail::kMaxElementwiseBlocks);
  if (blocks == 0) return;
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_masked_mean_bwd", [&] {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_bwd", [&] {
      dispatch_bool(all_dense(a, m.mask), [&](auto dense) {
        masked_bwd_kernel<scalar_t, mask_t, decltype(dense)::value><<<blocks, kThreads, 0, stream>>>(
            a, m, static_cast<const acc_t<scalar_t>*>(grad_mean), count, static_cast<scalar_t*>(grad_logp));
      });
    });
  });
  detail::check_launch("kl_masked_mean_bwd");
}

}  // namespace megalign::cuda
