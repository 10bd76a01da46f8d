// CPU kernels of the fused policy loss: one pass writes the per-token loss (or only sums it) and
// accumulates the statistics (per-chunk partials merged in order); the backward recomputes each
// token from the inputs (math/policy.h) and writes grad_logp, so no [rows, cols] intermediate is
// ever stored.
// fp32 / bf16 / fp16 operands that are unit-stride within rows run the vector kernels of the
// CPU's ISA (kl_policy_simd.h, chosen at run time: isa.h); fp64 and other strided layouts run
// the scalar loops below.
#include "megalign/policy_loss.h"

#include "isa.h"
#include "kl_policy_cpu.h"

namespace megalign::cpu {
namespace {

using detail::offset;

// Whether the vector kernels take these operands (isa.h).
bool vector_ok(const PolicyLossArgs& a, const StridedView& grad = {}) {
  return a.dtype != DType::kFloat64 && row_contiguous(a.logp, a.cols) && row_contiguous(a.old_logp, a.cols) &&
         row_contiguous(a.advantages, a.cols) && row_contiguous(a.mask, a.cols) &&
         row_contiguous(a.ref_logp, a.cols) && row_contiguous_or_broadcast(grad, a.cols);
}

bool inputs_dense(const PolicyLossArgs& a) {
  return is_dense(a.logp, a.cols) && is_dense(a.old_logp, a.cols) && is_dense(a.advantages, a.cols) &&
         is_dense(a.mask, a.cols) && is_dense(a.ref_logp, a.cols);
}

// The token at (r, c), masked or not: every load is unconditional (all operands are in bounds)
// and HasRef is a compile-time flag, so the loops below have no control flow and vectorise.
template <typename T, bool Dense, bool HasRef>
MEGALIGN_HD_INLINE PolicyToken<acc_t<T>> token_at(const PolicyLossArgs& a, const PolicyCoeffs<acc_t<T>>& p, int64_t r,
                                      int64_t c) {
  using A = acc_t<T>;
  const A ref = HasRef ? load_acc<T>(a.ref_logp, offset<Dense>(a.ref_logp, r, c, a.cols)) : A(0);
  return policy_token(load_acc<T>(a.logp, offset<Dense>(a.logp, r, c, a.cols)),
                      load_acc<T>(a.old_logp, offset<Dense>(a.old_logp, r, c, a.cols)),
                      load_acc<T>(a.advantages, offset<Dense>(a.advantages, r, c, a.cols)), HasRef, ref, p);
}

// Per block of a chunk: one loop computes the tokens and writes the loss and each token's
// statistics contributions to small stack buffers (no reduction, so it vectorises), a second loop
// reduces the buffers with OpenMP's simd reduction. Sums are exact counts or acc_t<T> values
// (a chunk holds at most kChunk tokens), merged into the fp64 partial per chunk.
constexpr int64_t kStatBlock = 512;

template <typename T, typename M, bool Dense, bool HasRef>
detail::PolicyCpuPartial fwd_impl(const PolicyLossArgs& a, acc_t<T>* loss, acc_t<T>* dlogp) {
  using A = acc_t<T>;
  const PolicyCoeffs<A> p = policy_coeffs<A>(a);
  return detail::parallel_reduce_chunks<detail::PolicyCpuPartial>(
      a.rows, a.cols, [&](detail::PolicyCpuPartial& part, int64_t r, int64_t c0, int64_t c1) {
        A v_count[kStatBlock], v_clipped[kStatBlock], v_dual[kStatBlock], v_nlr[kStatBlock], v_kl[kStatBlock],
            v_min[kStatBlock], v_max[kStatBlock], v_loss[kStatBlock];
        A count = 0, clipped = 0, dual = 0, neg_log_ratio = 0, kl = 0, loss_sum = 0;
        A ratio_min = A(1e30), ratio_max = A(0);
        for (int64_t b0 = c0; b0 < c1; b0 += kStatBlock) {
          const int64_t len = std::min(kStatBlock, c1 - b0);
          for (int64_t j = 0; j < len; ++j) {
            const int64_t c = b0 + j;
            const bool valid = load_valid<M>(a.mask, offset<Dense>(a.mask, r, c, a.cols));
            const PolicyToken<A> t = token_at<T, Dense, HasRef>(a, p, r, c);
            v_loss[j] = select_acc(valid, t.loss, A(0));
            if (loss) loss[r * a.cols + c] = v_loss[j];
            if (dlogp) dlogp[r * a.cols + c] = select_acc(valid, t.dlogp, A(0));
            v_count[j] = select_acc(valid, A(1), A(0));
            v_clipped[j] = select_acc(valid & t.clipped, A(1), A(0));
            v_dual[j] = select_acc(valid & t.dual_clipped, A(1), A(0));
            v_nlr[j] = select_acc(valid, -t.log_ratio, A(0));
            v_kl[j] = select_acc(valid, t.kl, A(0));
            v_min[j] = select_acc(valid, t.ratio, A(1e30));
            v_max[j] = select_acc(valid, t.ratio, A(0));
          }
#pragma omp simd reduction(+ : count, clipped, dual, neg_log_ratio, kl, loss_sum) reduction(min : ratio_min) \
    reduction(max : ratio_max)
          for (int64_t j = 0; j < len; ++j) {
            count += v_count[j];
            clipped += v_clipped[j];
            dual += v_dual[j];
            neg_log_ratio += v_nlr[j];
            kl += v_kl[j];
            loss_sum += v_loss[j];
            ratio_min = std::min(ratio_min, v_min[j]);
            ratio_max = std::max(ratio_max, v_max[j]);
          }
        }
        detail::PolicyCpuPartial chunk;
        chunk.count = static_cast<int64_t>(count);
        chunk.clipped = static_cast<int64_t>(clipped);
        chunk.dual_clipped = static_cast<int64_t>(dual);
        chunk.neg_log_ratio = neg_log_ratio;
        chunk.kl = kl;
        chunk.ratio_min = ratio_min;
        chunk.ratio_max = ratio_max;
        chunk.loss = loss_sum;
        part.merge(chunk);
      });
}

template <typename T, typename M, bool Dense, bool HasRef>
void bwd_impl(const PolicyLossArgs& a, const StridedView& grad, T* grad_logp) {
  using A = acc_t<T>;
  const PolicyCoeffs<A> p = policy_coeffs<A>(a);
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
#pragma omp simd
    for (int64_t c = c0; c < c1; ++c) {
      const bool valid = load_valid<M>(a.mask, offset<Dense>(a.mask, r, c, a.cols));
      const A g = load_acc<A>(grad, element_offset(grad, r, c)) * token_at<T, Dense, HasRef>(a, p, r, c).dlogp;
      grad_logp[r * a.cols + c] = from_acc<T>(select_acc(valid, g, A(0)));
    }
  });
}

// Invokes fn(dense, has_ref) as compile-time flags.
template <typename Fn>
void dispatch_layout(const PolicyLossArgs& a, Fn&& fn) {
  dispatch_bool(inputs_dense(a), [&](auto dense) {
    dispatch_bool(a.ref_logp.data != nullptr, [&](auto has_ref) { fn(dense, has_ref); });
  });
}

}  // namespace

void policy_loss_fwd(const PolicyLossArgs& a, void* loss, float* stats, void* dlogp, double* loss_sum) {
  if (vector_ok(a)) return isa_kernels().policy_loss_fwd(a, loss, stats, dlogp, loss_sum);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "policy_loss_fwd", [&] {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_fwd", [&] {
      dispatch_layout(a, [&](auto dense, auto has_ref) {
        using A = acc_t<scalar_t>;
        const detail::PolicyCpuPartial total =
            fwd_impl<scalar_t, mask_t, decltype(dense)::value, decltype(has_ref)::value>(
                a, static_cast<A*>(loss), static_cast<A*>(dlogp));
        total.finalize(stats);
        if (loss_sum) *loss_sum = total.loss;
      });
    });
  });
}

void policy_loss_bwd(const PolicyLossArgs& a, const StridedView& grad, void* grad_logp) {
  if (vector_ok(a, grad)) return isa_kernels().policy_loss_bwd(a, grad, grad_logp);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "policy_loss_bwd", [&] {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_bwd", [&] {
      dispatch_layout(a, [&](auto dense, auto has_ref) {
        bwd_impl<scalar_t, mask_t, decltype(dense)::value, decltype(has_ref)::value>(
            a, grad, static_cast<scalar_t*>(grad_logp));
      });
    });
  });
}

}  // namespace megalign::cpu
