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

MEGALIGN_HD_INLINE float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);  // common.h's bits_float uses memcpy, opaque to GCC's vectoriser
#endif
}
MEGALIGN_HD_INLINE uint32_t bits_from_float(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(uint32_t, f);
#endif
}

// e^x in fp32 without a libm call, written so GCC vectorises the CPU loops (no branches, no float
// clamps: range checks are three selects at the end); the GPU runs the same arithmetic. Cody-Waite
// reduction x = n ln2 + r, |r| <= ln2/2, and Cephes' expf polynomial (about 1 ulp). Below -87.33
// it gives 0 (no subnormals), above 88.72 +inf; NaN stays NaN.
MEGALIGN_HD_INLINE float exp_acc(float x) {
  const float hi = 88.72283905f, lo = -87.33654475f;
  // n = round(x / ln2) by adding 1.5 * 2^23; its integer value is read from the low mantissa bits.
  // Outside [lo, hi] the intermediates are meaningless and the final selects discard them.
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const uint32_t ni = bits_from_float(shifted) - 0x4B400000u;  // n modulo 2^32
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n in two factors 2^(n/2) 2^(n - n/2): n reaches 128 at the top, past the largest exponent.
  const uint32_t n1 = static_cast<uint32_t>(static_cast<int32_t>(ni) >> 1);
  const float y = p * float_from_bits((n1 + 127u) << 23) * float_from_bits((ni - n1 + 127u) << 23);
  const float big = select_acc(x > hi, std::numeric_limits<float>::infinity(), y);
  const float out = select_acc(x < lo, 0.0f, big);
  return select_acc(x == x, out, x);
}
MEGALIGN_HD_INLINE double exp_acc(double x) { return exp(x); }

// e^x - 1 and the excess e^x - 1 - x (k3's core), both accurate near x = 0 where the excess is
// x^2/2 + ...: fp32 uses the Taylor series x^2 (1/2 + x/6 + ... + x^6/8!) for |x| < ln2/2 and
// exp_acc elsewhere (branch-free); fp64 uses libm's expm1. The excess never rounds below 0.
template <typename A>
struct Expm1Split {
  A em1;
  A excess;
};

MEGALIGN_HD_INLINE Expm1Split<float> expm1_split(float x) {
  float q = 1.0f / 40320.0f;
  q = q * x + 1.0f / 5040.0f;
  q = q * x + 1.0f / 720.0f;
  q = q * x + 1.0f / 120.0f;
  q = q * x + 1.0f / 24.0f;
  q = q * x + 1.0f / 6.0f;
  q = q * x + 0.5f;
  const float small_excess = x * x * q;
  const float big_em1 = exp_acc(x) - 1.0f;
  const bool small = (x > -0.34657359f) & (x < 0.34657359f);
  return {select_acc(small, x + small_excess, big_em1), select_acc(small, small_excess, big_em1 - x)};
}
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
  const bool capped = e.excess > A(kLowVarKlBound);
  const bool inside = (d >= -bound) & (d <= bound);
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
