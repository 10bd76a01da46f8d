// The pieces every per-element kernel formula needs on both the host and the device: forced
// inlining, a branch-free select, bit casts, the lane-type traits, and e^x in fp32 without libm.
// One copy, shared by token_logprob, kl_penalty and policy_loss on the GPU, in the scalar CPU
// loops and, instantiated on SIMD vectors, in the vector CPU kernels (csrc/cpu/simd.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "megalign/common.h"

// MEGALIGN_HD is plain `inline` on the host, and GCC may then keep the per-token functions out of
// line, which stops the CPU loops from vectorising; force them inline as nvcc does on the device.
#if defined(__CUDACC__)
#define MEGALIGN_HD_INLINE MEGALIGN_HD
#else
#define MEGALIGN_HD_INLINE MEGALIGN_HD __attribute__((always_inline))
#endif

namespace megalign {

// c ? a : b without a branch. GCC if-converts plain ternaries only in simple shapes (chains of
// them with floating-point compares under -ftrapping-math end up as control flow, and the loop
// stays scalar); on the host the select is done on the bits, which always vectorises.
MEGALIGN_HD_INLINE float select_acc(bool c, float a, float b) {
#if defined(__CUDA_ARCH__)
  return c ? a : b;
#else
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return __builtin_bit_cast(float, (__builtin_bit_cast(uint32_t, a) & m) | (__builtin_bit_cast(uint32_t, b) & ~m));
#endif
}
MEGALIGN_HD_INLINE double select_acc(bool c, double a, double b) {
#if defined(__CUDA_ARCH__)
  return c ? a : b;
#else
  const uint64_t m = 0u - static_cast<uint64_t>(c);
  return __builtin_bit_cast(double, (__builtin_bit_cast(uint64_t, a) & m) | (__builtin_bit_cast(uint64_t, b) & ~m));
#endif
}

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

// Lane types. The per-element formulas below and in kl.h / policy.h / token_logprob.h are
// templates over the value type A: a scalar (float, double; the GPU and the scalar CPU loops) or
// one of the CPU's SIMD vectors (csrc/cpu/simd.h: fp32 lanes, overloading the arithmetic, the
// compares, select_acc and the bit casts below). mask_of<A> is what a compare of two A gives:
// bool for a scalar, a lane mask for a vector; lane_t<A> is the element type.
template <typename A> struct LaneOf { using type = A; };
template <typename A> using lane_t = typename LaneOf<A>::type;
template <typename A> using mask_of = decltype(A() < A());

MEGALIGN_HD_INLINE int32_t to_int_bits(float x) { return static_cast<int32_t>(x); }
MEGALIGN_HD_INLINE float float_from_int_bits(int32_t u) { return float_from_bits(static_cast<uint32_t>(u)); }

constexpr float kExpLo = -87.33654475f;  // ln FLT_MIN: smallest x with a normal e^x
constexpr float kExpHi = 88.72283905f;   // ln FLT_MAX

// The core of Cephes expf on an already clamped xc: x = k ln2 + r with |r| <= ln2/2 (Cody-Waite
// split of ln2) and e^r = 1 + r + r^2 P(r), P of degree 5. Returns the tail e^r - 1 - r = r^2 P(r)
// and sets kf = k (an integral float) and r: expm1 (math/kl.h) builds e^x - 1 from them without
// the cancellation of e^r - 1 near x = 0.
template <typename A>
MEGALIGN_HD_INLINE A exp_reduced_tail(A xc, A& kf, A& r) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  kf = (xc * A(1.44269504088896341f) + A(kRound)) - A(kRound);
  r = (xc - kf * A(0.693359375f)) - kf * A(-2.12194440e-4f);
  A p = A(1.9875691500e-4f);
  p = p * r + A(1.3981999507e-3f);
  p = p * r + A(8.3334519073e-3f);
  p = p * r + A(4.1665795894e-2f);
  p = p * r + A(1.6666665459e-1f);
  p = p * r + A(5.0000001201e-1f);
  return p * r * r;
}

// e^r of exp_reduced_tail, setting kf = k.
template <typename A>
MEGALIGN_HD_INLINE A exp_reduced(A xc, A& kf) {
  A r;
  const A tail = exp_reduced_tail(xc, kf, r);
  return tail + r + A(1.0f);
}

// e^x in fp32 without a libm call, branch-free so the CPU runs it on whole vectors; the GPU runs
// the same arithmetic. exp_reduced, then 2^k built from exponent bits in two halves so k = 128 (x
// just below ln FLT_MAX) does not overflow early. Within 2 ulp for x in [-87.33, 88.72]; exactly 0
// below -87.33 (results there are < 1.2e-38, skipped to avoid denormal arithmetic), +inf above
// ln FLT_MAX, NaN for NaN. The input is clamped first so the intermediates stay finite; the
// clamps and the final range checks are compare-selects. A is float or an fp32 vector.
template <typename A>
MEGALIGN_HD_INLINE A exp_f32(A x) {
  A xc = select_acc(x < A(kExpLo), A(kExpLo), x);  // NaN compares false and stays NaN
  xc = select_acc(xc > A(kExpHi), A(kExpHi), xc);
  A kf;
  const A p = exp_reduced(xc, kf);
  const auto k = to_int_bits(kf);
  const auto k1 = k >> 1;  // k in [-126, 128]: both halves are normal exponents
  const A y = p * float_from_int_bits((k1 + 127) << 23) * float_from_int_bits((k - k1 + 127) << 23);
  const A lo = select_acc(x < A(kExpLo), A(0.0f), y);
  return select_acc(x > A(kExpHi), A(std::numeric_limits<float>::infinity()), lo);
}
MEGALIGN_HD_INLINE float exp_acc(float x) { return exp_f32(x); }

// e^x for |x| <= 87, which the caller guarantees (policy_loss clamps its log-ratio to +-20):
// exp_f32's value without its clamps and range checks, 2^k (k in [-126, 126]) in one factor, so
// the same result in ten fewer operations a lane. NaN gives NaN.
template <typename A>
MEGALIGN_HD_INLINE A exp_bounded_f32(A x) {
  A kf;
  const A p = exp_reduced(x, kf);
  return p * float_from_int_bits((to_int_bits(kf) + 127) << 23);
}
MEGALIGN_HD_INLINE float exp_bounded(float x) { return exp_bounded_f32(x); }

// e^x for the arguments of the softmax kernels, x = z - max or z - lse: at most a few ulp above 0.
// exp_f32 with 2^k in one factor (k = round(x log2 e) <= 0 here) and without the upper clamp; the
// results equal exp_f32's for every x <= ln2/2 (k <= 0), exactly 0 below ln FLT_MIN, NaN for NaN.
// Five fewer operations a lane than exp_f32 in the hottest loop.
template <typename A>
MEGALIGN_HD_INLINE A exp_nonpos_f32(A x) {
  A kf;
  const A p = exp_reduced(select_acc(x < A(kExpLo), A(kExpLo), x), kf);
  const A y = p * float_from_int_bits((to_int_bits(kf) + 127) << 23);
  return select_acc(x < A(kExpLo), A(0.0f), y);
}
MEGALIGN_HD_INLINE double exp_acc(double x) { return exp(x); }
MEGALIGN_HD_INLINE double exp_bounded(double x) { return exp(x); }

}  // namespace megalign
