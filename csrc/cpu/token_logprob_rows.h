// The row loops of the token_logprob CPU kernels (private to csrc/cpu), shared by the scalar rows
// (token_logprob.cpp: fp64) and the vector rows of each ISA (token_logprob_simd.h: fp32, bf16,
// fp16): OpenMP across rows, the ignored and out-of-range targets, and the target's logit, around
// a per-row statistic or gradient that the caller supplies. Templates only, so nothing here is
// shared between code compiled for different vector ISAs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "megalign/math/token_logprob.h"
#include "megalign/token_logprob.h"

namespace megalign::cpu::detail {

// Below ~1M logits (~0.3 ms on one core) waking the OpenMP team costs more than it saves, and
// far more on a loaded machine where a descheduled worker stalls the join.
template <typename I> bool tl_worth_threads(I n_rows, I vocab) { return n_rows > 1 && n_rows * vocab >= (1 << 20); }

// row_stats(x, vocab, inv_t) -> SoftmaxStats<A> of one row. Fills the N x 4 partials
// (token_logprob.h) and returns the first row with an out-of-range target, or -1.
template <typename T, typename RowStats>
int64_t partials_rows(const T* logits, int64_t n_rows, int64_t vocab, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t vocab_size,
                      acc_t<T> inv_t, int64_t ignore_index, acc_t<T>* out, RowStats row_stats) {
  using A = acc_t<T>;
  int64_t bad_row = std::numeric_limits<int64_t>::max();
#pragma omp parallel for schedule(static) reduction(min : bad_row) if (tl_worth_threads(n_rows, vocab))
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
    const math::SoftmaxStats<A> st = row_stats(x, vocab, inv_t);
    const int64_t local = target - vocab_start;
    o[0] = st.m;
    o[1] = st.s;
    o[2] = (local >= 0 && local < vocab) ? to_acc(x[local]) * inv_t : A(0);
    o[3] = st.t;
  }
  return bad_row == std::numeric_limits<int64_t>::max() ? -1 : bad_row;
}

// row_grad(x, g, vocab, lse, entropy, g_logp, g_ent) writes the gradient of one row without the
// target's 1[j = t] g_logp term, which is added here from the target logit read beforehand (g may
// be x itself: the in-place backward). g_logp and g_ent already carry the 1/temperature.
template <typename T, bool WithEntropy, typename RowGrad>
void backward_rows(const BackwardRows<T>& b, int64_t n_rows, int64_t vocab, int64_t row_stride,
                   const int64_t* targets, int64_t vocab_start, int64_t ignore_index,
                   int64_t grad_row_stride, RowGrad row_grad) {
  using A = acc_t<T>;
#pragma omp parallel for schedule(static) if (tl_worth_threads(n_rows, vocab))
  for (int64_t r = 0; r < n_rows; ++r) {
    const T* x = b.logits + r * row_stride;
    T* g = b.grad + r * grad_row_stride;
    if (targets[r] == ignore_index) {
      std::fill(g, g + vocab, from_acc<T>(A(0)));
      continue;
    }
    const A inv_t = b.inv_t;
    const A lse = b.lse[r];
    const A h = WithEntropy ? b.entropy[r] : A(0);
    const A g_logp = b.grad_logp[r] * inv_t;
    const A g_ent = WithEntropy ? b.grad_entropy[r] * inv_t : A(0);
    const int64_t local = targets[r] - vocab_start;
    const bool in_shard = local >= 0 && local < vocab;
    const A z_target = in_shard ? to_acc(x[local]) * inv_t : A(0);
    row_grad(x, g, vocab, inv_t, lse, h, g_logp, g_ent);
    if (in_shard) {
      g[local] = from_acc<T>(math::logit_grad<WithEntropy>(z_target, lse, h, g_logp, g_ent, true));
    }
  }
}

}  // namespace megalign::cpu::detail
