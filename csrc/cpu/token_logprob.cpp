// CPU kernels of token_logprob: OpenMP across rows, one pass over each row's logits.
//
// Forward: each row is walked in chunks of kChunk logits that stay in L1: a max pass, then an
// exp pass accumulating s and t relative to the chunk max, then a merge of the chunk's
// (m, s, t) into the row's (math/token_logprob.h). Both passes are `omp simd` reductions over
// branch-free code (exp_acc), so GCC vectorises them without -ffast-math. Memory traffic is one
// read of the logits; nothing of size N x V is allocated.
// Backward: one pass per row recomputing p_j = e^{z_j - lse} from the saved lse.
#include "megalign/token_logprob.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "megalign/math/token_logprob.h"

namespace megalign::cpu {
namespace {

using math::SoftmaxStats;

constexpr int64_t kChunk = 2048;  // 8 KiB of fp32: the max pass leaves it in L1 for the exp pass

// Below ~1M logits (~0.3 ms on one core) waking the OpenMP team costs more than it saves, and
// far more on a loaded machine where a descheduled worker stalls the join.
bool worth_threads(int64_t n_rows, int64_t vocab) { return n_rows > 1 && n_rows * vocab >= (1 << 20); }

template <typename T, bool WithEntropy>
SoftmaxStats<acc_t<T>> row_stats(const T* x, int64_t vocab, acc_t<T> inv_t) {
  using A = acc_t<T>;
  SoftmaxStats<A> row = math::empty_stats<A>();
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const T* xc = x + c0;
    const int64_t n = std::min(kChunk, vocab - c0);
    A cm = -std::numeric_limits<A>::infinity();
#pragma omp simd reduction(max : cm)
    for (int64_t j = 0; j < n; ++j) {
      const A z = to_acc(xc[j]) * inv_t;
      cm = z > cm ? z : cm;
    }
    if (cm == -std::numeric_limits<A>::infinity()) continue;  // all -inf: contributes nothing
    A s = 0, t = 0;
    if (WithEntropy) {
#pragma omp simd reduction(+ : s, t)
      for (int64_t j = 0; j < n; ++j) math::accumulate(to_acc(xc[j]) * inv_t, cm, s, t);
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < n; ++j) s += math::kernel_exp(to_acc(xc[j]) * inv_t - cm);
    }
    row = math::merge_stats(row, SoftmaxStats<A>{cm, s, t});
  }
  return row;
}

template <typename T, bool WithEntropy>
int64_t partials_impl(const T* logits, int64_t n_rows, int64_t vocab, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t vocab_size,
                      acc_t<T> inv_t, int64_t ignore_index, acc_t<T>* out) {
  using A = acc_t<T>;
  int64_t bad_row = std::numeric_limits<int64_t>::max();
#pragma omp parallel for schedule(static) reduction(min : bad_row) if (worth_threads(n_rows, vocab))
  for (int64_t r = 0; r < n_rows; ++r) {
    A* o = out + 4 * r;
    const int64_t target = targets[r];
    if (math::target_out_of_range(target, ignore_index, vocab_size)) {
      o[0] = o[1] = o[2] = o[3] = std::numeric_limits<A>::quiet_NaN();
      bad_row = std::min(bad_row, r);
      continue;
    }
    if (target == ignore_index) {
      o[0] = 0; o[1] = 1; o[2] = 0; o[3] = 0;
      continue;
    }
    const T* x = logits + r * row_stride;
    const SoftmaxStats<A> st = row_stats<T, WithEntropy>(x, vocab, inv_t);
    const int64_t local = target - vocab_start;
    o[0] = st.m;
    o[1] = st.s;
    o[2] = (local >= 0 && local < vocab) ? to_acc(x[local]) * inv_t : A(0);
    o[3] = st.t;
  }
  return bad_row == std::numeric_limits<int64_t>::max() ? -1 : bad_row;
}

template <typename A>
void finalize_impl(const A* partials, int64_t n_rows, A* logp, A* lse, A* entropy) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const A* p = partials + 4 * r;
    const math::RowResult<A> res = math::finalize_row<A>({p[0], p[1], p[3]}, p[2]);
    logp[r] = res.logp;
    lse[r] = res.lse;
    if (entropy) entropy[r] = res.entropy;
  }
}

template <typename T, bool WithEntropy>
void backward_impl(const BackwardRows<T>& b, int64_t n_rows, int64_t vocab, int64_t row_stride,
                   const int64_t* targets, int64_t vocab_start, int64_t ignore_index,
                   int64_t grad_row_stride) {
  using A = acc_t<T>;
#pragma omp parallel for schedule(static) if (worth_threads(n_rows, vocab))
  for (int64_t r = 0; r < n_rows; ++r) {
    const T* x = b.logits + r * row_stride;
    T* g = b.grad + r * grad_row_stride;
    if (targets[r] == ignore_index) {
      const T zero = from_acc<T>(A(0));
#pragma omp simd
      for (int64_t j = 0; j < vocab; ++j) g[j] = zero;
      continue;
    }
    const A row_lse = b.lse[r];
    const A row_h = WithEntropy ? b.entropy[r] : A(0);
    // The 1/temperature of dz/dlogits is folded into the row coefficients.
    const A inv_t = b.inv_t;
    const A g_logp = b.grad_logp[r] * inv_t;
    const A g_ent = WithEntropy ? b.grad_entropy[r] * inv_t : A(0);
    const int64_t local = targets[r] - vocab_start;
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) {
      const A z = to_acc(x[j]) * inv_t;
      g[j] = from_acc<T>(math::logit_grad<WithEntropy>(z, row_lse, row_h, g_logp, g_ent, j == local));
    }
  }
}

}  // namespace

int64_t token_logprob_partials(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                               int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                               int64_t vocab_size, double inv_temperature, int64_t ignore_index,
                               bool with_entropy, void* partials) {
  int64_t bad_row = -1;
  MEGALIGN_DISPATCH_FLOAT(dtype, "token_logprob_partials", [&] {
    using A = acc_t<scalar_t>;
    const auto* x = static_cast<const scalar_t*>(logits);
    auto* out = static_cast<A*>(partials);
    const A inv_t = static_cast<A>(inv_temperature);
    bad_row = with_entropy
                  ? partials_impl<scalar_t, true>(x, n_rows, vocab, row_stride, targets, vocab_start,
                                                  vocab_size, inv_t, ignore_index, out)
                  : partials_impl<scalar_t, false>(x, n_rows, vocab, row_stride, targets,
                                                   vocab_start, vocab_size, inv_t, ignore_index, out);
  });
  return bad_row;
}

void token_logprob_finalize(DType dtype, const void* partials, int64_t n_rows, void* logp,
                            void* lse, void* entropy) {
  if (dtype == DType::kFloat64) {
    finalize_impl(static_cast<const double*>(partials), n_rows, static_cast<double*>(logp),
                  static_cast<double*>(lse), static_cast<double*>(entropy));
  } else {
    finalize_impl(static_cast<const float*>(partials), n_rows, static_cast<float*>(logp),
                  static_cast<float*>(lse), static_cast<float*>(entropy));
  }
}

void token_logprob_backward(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                            int64_t row_stride, const int64_t* targets, const void* lse,
                            const void* entropy, const void* grad_logp, const void* grad_entropy,
                            int64_t vocab_start, double inv_temperature, int64_t ignore_index,
                            void* grad, int64_t grad_row_stride) {
  MEGALIGN_DISPATCH_FLOAT(dtype, "token_logprob_backward", [&] {
    const auto b = BackwardRows<scalar_t>::cast(logits, grad, lse, entropy, grad_logp, grad_entropy,
                                                inv_temperature);
    if (entropy != nullptr) {
      backward_impl<scalar_t, true>(b, n_rows, vocab, row_stride, targets, vocab_start,
                                    ignore_index, grad_row_stride);
    } else {
      backward_impl<scalar_t, false>(b, n_rows, vocab, row_stride, targets, vocab_start,
                                     ignore_index, grad_row_stride);
    }
  });
}

}  // namespace megalign::cpu
