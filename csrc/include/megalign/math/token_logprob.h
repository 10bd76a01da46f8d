// Per-element and per-row math of token_logprob, shared by the CPU kernels, the CUDA kernels and
// the C++ tests.
//
// Softmax statistics of a row (or of a slice of it: a chunk, a thread's share, a vocab shard) are
// kept as SoftmaxStats {m, s, t} over z = logits / temperature:
//   m = max z,   s = sum_j e^{z_j - m},   t = sum_j e^{z_j - m} (z_j - m).
// Two slices merge exactly (the online-softmax trick of Milakov & Gimelshein 2018, extended to t):
//   M = max(m1, m2),  a_i = e^{m_i - M},
//   S = a1 s1 + a2 s2,  T = a1 (t1 + s1 (m1 - M)) + a2 (t2 + s2 (m2 - M)),
// and the row then gives lse = m + log s, log p(target) = z_target - lse and the entropy
//   H = -sum_j p_j log p_j = log s - t / s.
// Keeping t relative to the running max keeps H stable for logits of any size (1e4 and more).
// A -inf logit contributes 0 to s and t (never 0 * -inf = NaN); a slice with only -inf logits
// is the empty statistic {-inf, 0, 0}.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "megalign/common.h"
#include "megalign/math/exp.h"

namespace megalign::math {

// The exp the kernels call, always on x = z - max or z - lse (<= 0 up to rounding). On the GPU the
// hardware ex2 (__expf, ~2 ulp, flushes results below FLT_MIN to 0 like exp_acc) costs one SFU op
// where the polynomial costs about as many ALU instructions as a bf16 element's share of HBM time
// would allow; on the CPU it is exp_nonpos_f32 (megalign/math/exp.h), exp_acc's polynomial for
// that range, also on vectors (csrc/cpu/simd.h).
MEGALIGN_HD_INLINE float kernel_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return exp_nonpos_f32(x);
#endif
}
MEGALIGN_HD_INLINE double kernel_exp(double x) { return std::exp(x); }

// Most negative finite value: z - m is clamped to it so e^{z-m} (z-m) is 0 * finite = 0 for -inf
// logits instead of NaN. The clamp is a compare-select, which vectorises; NaN stays NaN (a NaN
// logit makes its row NaN rather than vanishing).
template <typename A> MEGALIGN_HD A lowest();
template <> MEGALIGN_HD float lowest<float>() { return -FLT_MAX; }
template <> MEGALIGN_HD double lowest<double>() { return -DBL_MAX; }

template <typename A> MEGALIGN_HD_INLINE A clamp_low(A d) {
  const A lo = A(lowest<lane_t<A>>());
  return select_acc(d < lo, lo, d);
}

template <typename A>
struct SoftmaxStats {
  A m, s, t;
};

template <typename A> MEGALIGN_HD SoftmaxStats<A> empty_stats() { return {-INFINITY, A(0), A(0)}; }

// Re-express x relative to a larger maximum new_m (new_m >= x.m, new_m finite).
template <typename A> MEGALIGN_HD SoftmaxStats<A> rebase_stats(SoftmaxStats<A> x, A new_m) {
  if (x.s == A(0)) return {new_m, A(0), A(0)};  // empty slice (also covers x.m = -inf)
  const A d = x.m - new_m;
  const A a = kernel_exp(d);
  return {new_m, a * x.s, a * (x.t + x.s * d)};
}

// Statistics of the union of two disjoint slices (see the file comment).
template <typename A> MEGALIGN_HD SoftmaxStats<A> merge_stats(SoftmaxStats<A> x, SoftmaxStats<A> y) {
  const A m = x.m > y.m ? x.m : y.m;
  // Both slices without a finite logit: empty, unless one of them carries a NaN in s.
  if (m == -INFINITY) return {m, x.s + y.s, x.t + y.t};
  const SoftmaxStats<A> rx = rebase_stats(x, m);
  const SoftmaxStats<A> ry = rebase_stats(y, m);
  return {m, rx.s + ry.s, rx.t + ry.t};
}

// Adds one logit z to stats already based at m >= z (the inner-loop step; branch-free; A may be a
// CPU vector of logits, see exp.h).
template <typename A> MEGALIGN_HD_INLINE void accumulate(A z, A m, A& s, A& t) {
  const A d = clamp_low(z - m);
  const A e = kernel_exp(d);
  s += e;
  t += e * d;
}

// Per-row results from the full-row statistics and the target's logit z_t.
template <typename A> struct RowResult {
  A logp, lse, entropy;
};

// logp is (z_t - m) - log s rather than z_t - lse: for logits ~1e4, lse rounded to fp32 is off
// by up to half an ulp of 1e4 (5e-4), z_t - m is exact.
template <typename A> MEGALIGN_HD RowResult<A> finalize_row(SoftmaxStats<A> st, A z_target) {
  const A log_s = std::log(st.s);
  return {(z_target - st.m) - log_s, st.m + log_s, log_s - st.t / st.s};
}

// dL/dz_j for one logit, given log p_j = z_j - lse (clamped, see clamp_low):
//   g_logp (1[j = target] - p_j) + g_ent (-p_j (log p_j + H)).
// With with_entropy false the entropy term is skipped (g_ent and H unused).
template <bool WithEntropy, typename A>
MEGALIGN_HD_INLINE A logit_grad(A z, A lse, A entropy, A g_logp, A g_ent, bool is_target) {
  const A lp = clamp_low(z - lse);
  const A p = kernel_exp(lp);
  A g = (is_target ? g_logp : A(0)) - g_logp * p;
  if (WithEntropy) g -= g_ent * p * (lp + entropy);
  return g;
}

// Whether a target id selects a logit of the slice [0, vocab_size) (vocab_size < 0: unknown,
// only negative ids are out of range). Ignored targets are never out of range.
MEGALIGN_HD bool target_out_of_range(int64_t target, int64_t ignore_index, int64_t vocab_size) {
  if (target == ignore_index) return false;
  return target < 0 || (vocab_size >= 0 && target >= vocab_size);
}

}  // namespace megalign::math
