// CPU kernels of the fused policy loss: one pass writes the per-token loss and accumulates the
// statistics (per-chunk partials merged in order); the backward recomputes each token from the
// inputs (math/policy.h) and writes grad_logp, so no [rows, cols] intermediate is ever stored.
#include "megalign/policy_loss.h"

#include "kl_policy_cpu.h"

namespace megalign::cpu {
namespace {

using detail::offset;

bool inputs_dense(const PolicyLossArgs& a) {
  return is_dense(a.logp, a.cols) && is_dense(a.old_logp, a.cols) && is_dense(a.advantages, a.cols) &&
         is_dense(a.mask, a.cols) && is_dense(a.ref_logp, a.cols);
}

// The token at (r, c), or nothing for a masked token.
template <typename T, typename M, bool Dense>
inline bool load_token(const PolicyLossArgs& a, const PolicyCoeffs<acc_t<T>>& p, int64_t r, int64_t c,
                       PolicyToken<acc_t<T>>& out) {
  using A = acc_t<T>;
  if (!load_valid<M>(a.mask, offset<Dense>(a.mask, r, c, a.cols))) return false;
  const bool has_ref = a.ref_logp.data != nullptr;
  const A ref = has_ref ? load_acc<T>(a.ref_logp, offset<Dense>(a.ref_logp, r, c, a.cols)) : A(0);
  out = policy_token(load_acc<T>(a.logp, offset<Dense>(a.logp, r, c, a.cols)),
                     load_acc<T>(a.old_logp, offset<Dense>(a.old_logp, r, c, a.cols)),
                     load_acc<T>(a.advantages, offset<Dense>(a.advantages, r, c, a.cols)), has_ref, ref, p);
  return true;
}

template <typename T, typename M, bool Dense>
PolicyPartial<double> fwd_impl(const PolicyLossArgs& a, acc_t<T>* loss) {
  using A = acc_t<T>;
  const PolicyCoeffs<A> p = policy_coeffs<A>(a);
  return detail::parallel_reduce_chunks<PolicyPartial<double>>(
      a.rows, a.cols, [&](PolicyPartial<double>& part, int64_t r, int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          PolicyToken<A> t;
          const bool valid = load_token<T, M, Dense>(a, p, r, c, t);
          loss[r * a.cols + c] = valid ? t.loss : A(0);
          if (valid) part.add(t);
        }
      });
}

template <typename T, typename M, bool Dense>
void bwd_impl(const PolicyLossArgs& a, const StridedView& grad, T* grad_logp) {
  using A = acc_t<T>;
  const PolicyCoeffs<A> p = policy_coeffs<A>(a);
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      PolicyToken<A> t;
      const bool valid = load_token<T, M, Dense>(a, p, r, c, t);
      grad_logp[r * a.cols + c] = from_acc<T>(valid ? load_acc<A>(grad, element_offset(grad, r, c)) * t.dlogp : A(0));
    }
  });
}

}  // namespace

void policy_loss_fwd(const PolicyLossArgs& a, void* loss, float* stats) {
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "policy_loss_fwd", [&] {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_fwd", [&] {
      detail::dispatch_dense(inputs_dense(a), [&](auto dense) {
        fwd_impl<scalar_t, mask_t, decltype(dense)::value>(a, static_cast<acc_t<scalar_t>*>(loss)).finalize(stats);
      });
    });
  });
}

void policy_loss_bwd(const PolicyLossArgs& a, const StridedView& grad, void* grad_logp) {
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "policy_loss_bwd", [&] {
    MEGALIGN_DISPATCH_MASK(a.mask_dtype, "policy_loss_bwd", [&] {
      detail::dispatch_dense(inputs_dense(a), [&](auto dense) {
        bwd_impl<scalar_t, mask_t, decltype(dense)::value>(a, grad, static_cast<scalar_t*>(grad_logp));
      });
    });
  });
}

}  // namespace megalign::cpu
