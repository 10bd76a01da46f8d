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
// k3 is evaluated as expm1(d) - d: the same value, but it cannot round below zero near d = 0
// (exp(d) - d - 1 can), so k3 >= 0 holds in floating point too. Every estimator depends on
// logp - ref only, hence d/d ref_logp = -d/d logp; the functions return the value and d/d logp.
// Clamp gradients follow torch.clamp: the gradient passes where the input lies inside the closed
// interval and is 0 where a bound is active.
#pragma once

#include <cmath>

#include "megalign/common.h"

namespace megalign {

enum class KlKind : int { kK1 = 0, kAbs = 1, kK2 = 2, kK3 = 3, kLowVarKl = 4 };

MEGALIGN_HD float exp_acc(float x) { return expf(x); }
MEGALIGN_HD double exp_acc(double x) { return exp(x); }
MEGALIGN_HD float expm1_acc(float x) { return expm1f(x); }
MEGALIGN_HD double expm1_acc(double x) { return expm1(x); }

template <typename A>
MEGALIGN_HD A clamp_acc(A x, A lo, A hi) {
  return x < lo ? lo : (x > hi ? hi : x);
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
MEGALIGN_HD KlValue<A> kl_k3(A logp, A ref) {
  const A d = ref - logp;
  const A em1 = expm1_acc(d);
  return {em1 - d, -em1};
}

template <typename A>
MEGALIGN_HD KlValue<A> kl_low_var(A logp, A ref) {
  const A bound = A(kLowVarLogRatioBound);
  const A d = ref - logp;
  const A dc = clamp_acc(d, -bound, bound);
  const A em1 = expm1_acc(dc);
  const A v = em1 - dc;  // >= 0, so only the upper clamp can bind
  if (v > A(kLowVarKlBound)) return {A(kLowVarKlBound), A(0)};
  const bool inside = d >= -bound && d <= bound;
  return {v, inside ? -em1 : A(0)};
}

template <typename A>
MEGALIGN_HD KlValue<A> kl_estimate(KlKind kind, A logp, A ref) {
  const A x = logp - ref;
  switch (kind) {
    case KlKind::kK1: return {x, A(1)};
    case KlKind::kAbs: return {x < A(0) ? -x : x, x > A(0) ? A(1) : (x < A(0) ? A(-1) : A(0))};
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
  MEGALIGN_HD void merge(const KlMeanPartial& o) {
    sum += o.sum;
    count += o.count;
  }
  // An empty mask gives 0 (not 0/0 = NaN).
  MEGALIGN_HD S mean() const { return count > 0 ? sum / S(count) : S(0); }
};

}  // namespace megalign
