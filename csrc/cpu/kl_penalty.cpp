// CPU kernels of kl_penalty: elementwise estimate and gradient, and the masked mean fused into one
// pass with its gradient. fp32 / bf16 / fp16 operands that are unit-stride within rows run the
// vector kernels of the CPU's ISA (kl_policy_simd.h, chosen at run time: isa.h); fp64 and other
// strided layouts run the scalar loops below (kind and layout fixed at compile time).
#include "megalign/kl_penalty.h"

#include "isa.h"
#include "kl_policy_cpu.h"

namespace megalign::cpu {
namespace {

using detail::offset;

bool all_dense(const KlArgs& a, const StridedView& mask = {}) {
  return is_dense(a.logp, a.cols) && is_dense(a.ref_logp, a.cols) && is_dense(mask, a.cols);
}

// Whether the vector kernels take these operands (isa.h).
bool vector_ok(const KlArgs& a, const StridedView& mask = {}, const StridedView& grad = {}) {
  return a.dtype != DType::kFloat64 && row_contiguous(a.logp, a.cols) && row_contiguous(a.ref_logp, a.cols) &&
         row_contiguous(mask, a.cols) && row_contiguous_or_broadcast(grad, a.cols);
}

template <typename T, KlKind K, bool Dense>
void fwd_impl(const KlArgs& a, acc_t<T>* out, acc_t<T>* dlogp) {
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const auto lp = load_acc<T>(a.logp, offset<Dense>(a.logp, r, c, a.cols));
      const auto ref = load_acc<T>(a.ref_logp, offset<Dense>(a.ref_logp, r, c, a.cols));
      const KlValue<acc_t<T>> k = kl_estimate(K, lp, ref);
      out[r * a.cols + c] = k.value;
      if (dlogp) dlogp[r * a.cols + c] = k.dlogp;
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

template <typename T, typename M, KlKind K, bool Dense>
KlMeanPartial<double> masked_sum(const KlArgs& a, const KlMaskArg& m, acc_t<T>* dlogp) {
  using A = acc_t<T>;
  return detail::parallel_reduce_chunks<KlMeanPartial<double>>(
      a.rows, a.cols, [&](KlMeanPartial<double>& part, int64_t r, int64_t c0, int64_t c1) {
        // As in policy_loss.cpp: per block, a vectorisable loop fills stack buffers and a simd
        // reduction sums them (count is exact: a chunk holds at most kChunk tokens).
        constexpr int64_t kBlock = 512;
        A v_kl[kBlock], v_count[kBlock];
        A sum = 0, count = 0;
        for (int64_t b0 = c0; b0 < c1; b0 += kBlock) {
          const int64_t len = std::min(kBlock, c1 - b0);
          for (int64_t j = 0; j < len; ++j) {
            const int64_t c = b0 + j;
            const bool valid = load_valid<M>(m.mask, offset<Dense>(m.mask, r, c, a.cols));
            const KlValue<A> kl = kl_estimate(K, load_acc<T>(a.logp, offset<Dense>(a.logp, r, c, a.cols)),
                                              load_acc<T>(a.ref_logp, offset<Dense>(a.ref_logp, r, c, a.cols)));
            v_kl[j] = select_acc(valid, kl.value, A(0));
            if (dlogp) dlogp[r * a.cols + c] = select_acc(valid, kl.dlogp, A(0));
            v_count[j] = select_acc(valid, A(1), A(0));
          }
#pragma omp simd reduction(+ : sum, count)
          for (int64_t j = 0; j < len; ++j) {
            sum += v_kl[j];
            count += v_count[j];
          }
        }
        part.merge(KlMeanPartial<double>{sum, static_cast<int64_t>(count)});
      });
}

template <typename T, typename M, KlKind K, bool Dense>
void masked_bwd_impl(const KlArgs& a, const KlMaskArg& m, acc_t<T> scale, T* grad_logp) {
  using A = acc_t<T>;
  detail::parallel_chunks(a.rows, a.cols, [&](int64_t, int64_t r, int64_t c0, int64_t c1) {
#pragma omp simd
    for (int64_t c = c0; c < c1; ++c) {
      const bool valid = load_valid<M>(m.mask, offset<Dense>(m.mask, r, c, a.cols));
      const A g = scale * kl_estimate(K, load_acc<T>(a.logp, offset<Dense>(a.logp, r, c, a.cols)),
                                      load_acc<T>(a.ref_logp, offset<Dense>(a.ref_logp, r, c, a.cols)))
                              .dlogp;
      grad_logp[r * a.cols + c] = from_acc<T>(select_acc(valid, g, A(0)));
    }
  });
}

}  // namespace

void kl_penalty_fwd(const KlArgs& a, void* out, void* dlogp) {
  if (vector_ok(a)) return isa_kernels().kl_penalty_fwd(a, out, dlogp);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_penalty_fwd", [&] {
    detail::dispatch_kl_kind(a.kind, [&](auto kind) {
      dispatch_bool(all_dense(a), [&](auto dense) {
        fwd_impl<scalar_t, decltype(kind)::value, decltype(dense)::value>(a, static_cast<acc_t<scalar_t>*>(out),
                                                                           static_cast<acc_t<scalar_t>*>(dlogp));
      });
    });
  });
}

void kl_penalty_bwd(const KlArgs& a, const StridedView& grad, void* grad_logp) {
  if (vector_ok(a, {}, grad)) return isa_kernels().kl_penalty_bwd(a, grad, grad_logp);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_penalty_bwd", [&] {
    detail::dispatch_kl_kind(a.kind, [&](auto kind) {
      dispatch_bool(all_dense(a), [&](auto dense) {
        bwd_impl<scalar_t, decltype(kind)::value, decltype(dense)::value>(a, grad, static_cast<scalar_t*>(grad_logp));
      });
    });
  });
}

void kl_masked_mean_fwd(const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count, void* dlogp) {
  if (vector_ok(a, m.mask)) return isa_kernels().kl_masked_mean_fwd(a, m, mean, count, dlogp);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_masked_mean_fwd", [&] {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_fwd", [&] {
      detail::dispatch_kl_kind(a.kind, [&](auto kind) {
        dispatch_bool(all_dense(a, m.mask), [&](auto dense) {
          const KlMeanPartial<double> total =
              masked_sum<scalar_t, mask_t, decltype(kind)::value, decltype(dense)::value>(
                  a, m, static_cast<acc_t<scalar_t>*>(dlogp));
          *static_cast<acc_t<scalar_t>*>(mean) = static_cast<acc_t<scalar_t>>(total.mean());
          *count = total.count;
        });
      });
    });
  });
}

void kl_masked_mean_bwd(const KlArgs& a, const KlMaskArg& m, const void* grad_mean, const int64_t* count,
                        void* grad_logp) {
  if (vector_ok(a, m.mask)) return isa_kernels().kl_masked_mean_bwd(a, m, grad_mean, count, grad_logp);
  MEGALIGN_DISPATCH_FLOAT(a.dtype, "kl_masked_mean_bwd", [&] {
    MEGALIGN_DISPATCH_MASK(m.dtype, "kl_masked_mean_bwd", [&] {
      using A = acc_t<scalar_t>;
      // With no valid token every gradient is 0; the guard only avoids dividing by zero.
      const A scale = *static_cast<const A*>(grad_mean) / A(*count > 0 ? *count : 1);
      detail::dispatch_kl_kind(a.kind, [&](auto kind) {
        dispatch_bool(all_dense(a, m.mask), [&](auto dense) {
          masked_bwd_impl<scalar_t, mask_t, decltype(kind)::value, decltype(dense)::value>(
              a, m, scale, static_cast<scalar_t*>(grad_logp));
        });
      });
    });
  });
}

}  // namespace megalign::cpu
