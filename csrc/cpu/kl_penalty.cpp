// CPU kernels of kl_penalty: elementwise estimate and gradient (kind and layout fixed at compile
// time so the simple kinds vectorise), and the masked mean fused into one pass with its gradient.
#include "megalign/kl_penalty.h"

#include "kl_policy_cpu.h"

namespace megalign::cpu {
namespace {

using detail::offset;

bool all_dense(const KlArgs& a) { return is_dense(a.logp, a.cols) && is_dense(a.ref_logp, a.cols); }

template <typename T, KlKind K, bool Dense>
void fwd_impl(const KlArgs& a, acc_t<T>* out) {
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
#pragma omp simd
    for (int64_t c = c0; c < c1; ++c) {
      const auto lp = load_acc<T>(a.logp, offset<Dense>(a.logp, r, c, a.cols));
      const auto ref = load_acc<T>(a.ref_logp, offset<Dense>(a.ref_logp, r, c, a.cols));
      out[r * a.cols + c] = kl_estimate(K, lp, ref).value;
    }
  });
}

template <typename T, KlKind K, bool Dense>
void bwd_impl(const KlArgs& a, const StridedView& grad, T* grad_logp) {
  using A = acc_t<T>;
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
#pragma omp simd
    for (int64_t c = c0; c < c1; ++c) {
      const A lp = load_acc<T>(a.logp, offset<Dense>(a.logp, r, c, a.cols));
      const A ref = load_acc<T>(a.ref_logp, offset<Dense>(a.ref_logp, r, c, a.cols));
      const A g = load_acc<A>(grad, element_offset(grad, r, c));
      grad_logp[r * a.cols + c] = from_acc<T>(g * kl_estimate(K, lp, ref).dlogp);
    }
  });
}

template <typename T, typename M>
KlMeanPartial<double> masked_sum(const KlArgs& a, const KlMaskArg& m) {
  using A = acc_t<T>;
  return detail::parallel_reduce_chunks<KlMeanPartial<double>>(
      a.rows, a.cols, [&](KlMeanPartial<double>& part, int64_t r, int64_t c0, int64_t c1) {
        A sum = 0, count = 0;  // count is exact: a chunk holds at most kChunk tokens
#pragma omp simd reduction(+ : sum, count)
        for (int64_t c = c0; c < c1; ++c) {
          const bool valid = load_valid<M>(m.mask, element_offset(m.mask, r, c));
          const A kl = kl_estimate(a.kind, load_acc<T>(a.logp, element_offset(a.logp, r, c)),
                                   load_acc<T>(a.ref_logp, element_offset(a.ref_logp, r, c)))
                           .value;
          sum += select_acc(valid, kl, A(0));
          count += select_acc(valid, A(1), A(0));
        }
        part.merge(KlMeanPartial<double>{sum, static_cast<int64_t>(count)});
      });
}

template <typename T, typename M>
void masked_bwd_impl(const KlArgs& a, const KlMaskArg& m, acc_t<T> scale, T* grad_logp) {
  using A = acc_t<T>;
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
#pragma omp simd
    for (int64_t c = c0; c < c1; ++c) {
      const bool valid = load_valid<M>(m.mask, element_offset(m.mask, r, c));
      const A g = scale * kl_estimate(a.kind, load_acc<T>(a.logp, element_offset(a.logp, r, c)),
                                      load_acc<T>(a.ref_logp, element_offset(a.ref_logp, r, c)))
                              .dlogp;
      grad_logp[r * a.cols + c] = from_acc<T>(select_acc(valid, g, A(0)));
    }
  });
}

}  // namespace

void kl_penalty_fwd(const KlArgs& a, void* out) {
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_penalty_fwd", [&] {
    detail::dispatch_kl_kind(a.kind, [&](auto kind) {
      dispatch_bool(all_dense(a), [&](auto dense) {
        fwd_impl<scalar_t, decltype(kind)::value, decltype(dense)::value>(a, static_cast<acc_t<scalar_t>*>(out));
      });
    });
  });
}

void kl_penalty_bwd(const KlArgs& a, const StridedView& grad, void* grad_logp) {
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_penalty_bwd", [&] {
    detail::dispatch_kl_kind(a.kind, [&](auto kind) {
      dispatch_bool(all_dense(a), [&](auto dense) {
        bwd_impl<scalar_t, decltype(kind)::value, decltype(dense)::value>(a, grad, static_cast<scalar_t*>(grad_logp));
      });
    });
  });
}

void kl_masked_mean_fwd(const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count) {
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_masked_mean_fwd", [&] {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_fwd", [&] {
      const KlMeanPartial<double> total = masked_sum<scalar_t, mask_t>(a, m);
      *static_cast<acc_t<scalar_t>*>(mean) = static_cast<acc_t<scalar_t>>(total.mean());
      *count = total.count;
    });
  });
}

void kl_masked_mean_bwd(const KlArgs& a, const KlMaskArg& m, const void* grad_mean, const int64_t* count,
                        void* grad_logp) {
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_masked_mean_bwd", [&] {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_bwd", [&] {
      using A = acc_t<scalar_t>;
      // With no valid token every gradient is 0; the guard only avoids dividing by zero.
      const A scale = *static_cast<const A*>(grad_mean) / A(*count > 0 ? *count : 1);
      masked_bwd_impl<scalar_t, mask_t>(a, m, scale, static_cast<scalar_t*>(grad_logp));
    });
  });
}

}  // namespace megalign::cpu
