// Per-token KL estimators between the policy (logp) and a reference (ref_logp), written as
// functions of d = ref_logp - logp (Schulman, "Approximating KL Divergence", 2020). Shared by
// the CPU and CUDA kernels of kl_penalty and by policy_loss's beta * k3 term.
//
//   k1          logp - ref                       unbiased, high variance, can be negative
//   abs         |logp - ref|                     (verl's "abs")
//   k2          0.5 (logp - ref)^2               biased, low variance
//   k3          e^d - d - 1                      unbiased, low variance, >= 0, = 0 iff d = 0
//   low_var_kl  clamp(e^dc - dc - 1, -10, 10),   verl's clamped k3, dc = clamp(d, -20, 20)
//
// k3 is evaluated as the excess e^d - 1 - d of expm1_split: the same value, but accurate near
// d = 0 and never below zero there (exp(d) - d - 1 can round negative), so k3 >= 0 holds in
// floating point too. Every estimator depends on
// logp - ref only, hence d/d ref_logp = -d/d logp; the functions return the value and d/d logp.
// Clamp gradients follow torch.clamp: the gradient passes where the input lies inside the closed
// interval and is 0 where a bound is active.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "megalign/common.h"
#include "megalign/kl_policy_common.h"

namespace megalign {

enum class KlKind : int { kK1 = 0, kAbs = 1, kK2 = 2, kK3 = 3, kLowVarKl = 4 };


// e^x - 1 and the excess e^x - 1 - x (k3's core), both accurate near x = 0 where the excess is
// x^2/2 + ...: fp32 reduces x = k ln2 + r once (exp_reduced_tail, math/exp.h); at k = 0
// (|x| < ln2/2, then r = x exactly) em1 = r + tail and excess = tail = r^2 P(r), with no
// cancellation, and elsewhere em1 = 2^k e^r - 1, excess = em1 - x. fp64 uses libm's expm1. The
// excess never rounds below 0. One range reduction and one polynomial for both cases, with no
// branch: the vector kernels' loops are bound by the length of this chain of operations.
template <typename A>
struct Expm1Split {
  A em1;
  A excess;
};

template <typename A>  // float or an fp32 vector
MEGALIGN_HD_INLINE Expm1Split<A> expm1_split_f32(A x) {
  const A xc = select_acc(x < A(kExpLo), A(kExpLo), select_acc(x > A(kExpHi), A(kExpHi), x));
  A kf, r;
  const A tail = exp_reduced_tail(xc, kf, r);
  const A em1_r = tail + r;  // e^r - 1
  // 2^k e^r = (2 e^r) 2^(k-1): k - 1 in [-127, 127] is a float exponent for every k of the
  // clamped range (at k = -126 the factor is +0 and em1 = -1, which e^x - 1 rounds to there).
  const A twice_exp_r = em1_r * A(2.0f) + A(2.0f);
  const A em1_big = twice_exp_r * float_from_int_bits((to_int_bits(kf) + 126) << 23) - A(1.0f);
  const A em1_wide = select_acc(x > A(kExpHi), A(std::numeric_limits<float>::infinity()), em1_big);
  const mask_of<A> small = kf == A(0.0f);
  return {select_acc(small, em1_r, em1_wide), select_acc(small, tail, em1_wide - x)};
}
MEGALIGN_HD_INLINE Expm1Split<float> expm1_split(float x) { return expm1_split_f32(x); }
MEGALIGN_HD_INLINE Expm1Split<double> expm1_split(double x) {
  const double em1 = expm1(x);
  return {em1, em1 - x};
}

template <typename A>
MEGALIGN_HD_INLINE A clamp_acc(A x, A lo, A hi) {
  return select_acc(x < lo, lo, select_acc(x > hi, hi, x));
}

template <typename A>
struct KlValue {
  A value;
  A dlogp;  // d value / d logp; d value / d ref_logp = -dlogp
};

// Bounds of verl's low_var_kl: the log-ratio is clamped to +-20, the estimate to +-10.
constexpr double kLowVarLogRatioBound = 20.0;
constexpr double kLowVarKlBound = 10.0;

template <typename A>
MEGALIGN_HD_INLINE KlValue<A> kl_k3(A logp, A ref) {
  const Expm1Split<A> e = expm1_split(ref - logp);
  return {e.excess, -e.em1};
}

template <typename A>
MEGALIGN_HD_INLINE KlValue<A> kl_low_var(A logp, A ref) {
  const A bound = A(kLowVarLogRatioBound);
  const A d = ref - logp;
  const A dc = clamp_acc(d, -bound, bound);
  const Expm1Split<A> e = expm1_split(dc);  // excess >= 0, so only the upper clamp can bind
  const mask_of<A> capped = e.excess > A(kLowVarKlBound);
  const mask_of<A> inside = (d >= -bound) & (d <= bound);
  return {select_acc(capped, A(kLowVarKlBound), e.excess), select_acc(capped | !inside, A(0), -e.em1)};
}

template <typename A>
MEGALIGN_HD_INLINE KlValue<A> kl_estimate(KlKind kind, A logp, A ref) {
  const A x = logp - ref;
  switch (kind) {
    case KlKind::kK1: return {x, A(1)};
    case KlKind::kAbs: return {select_acc(x < A(0), -x, x), select_acc(x > A(0), A(1), select_acc(x < A(0), A(-1), A(0)))};
    case KlKind::kK2: return {A(0.5) * x * x, x};
    case KlKind::kK3: return kl_k3(logp, ref);
    case KlKind::kLowVarKl: return kl_low_var(logp, ref);
  }
  return {A(0), A(0)};
}

// Running (sum, count) of a masked mean; merged in a fixed order so results are reproducible.
template <typename S>
struct KlMeanPartial {
  S sum = S(0);
  int64_t count = 0;
  MEGALIGN_HD_INLINE void merge(const KlMeanPartial& o) {
    sum += o.sum;
    count += o.count;
  }
  // An empty mask gives 0 (not 0/0 = NaN).
  MEGALIGN_HD_INLINE S mean() const { return count > 0 ? sum / S(count) : S(0); }
};

}  // namespace megalign
