// Explicit SIMD for the CPU kernels: fp32 vectors of MEGALIGN_SIMD_LANES lanes built on the
// GCC/Clang vector extensions, with the operators, compares, selects and bit casts that the shared
// per-element formulas (megalign/math/*.h, templates over their value type) need, so the vector
// kernels evaluate exactly those formulas, a whole vector at a time.
//
// Why not leave it to the auto-vectoriser: whether GCC vectorises a loop of selects, bit casts and
// a polynomial exp depends on the target, its cost model and the compiler version (on AVX2-only
// machines the same loops that ran as AVX-512 code elsewhere stayed scalar, ~10x slower). With
// the vector types the code generator only chooses instructions.
//
// This header is included only by the per-ISA translation units (csrc/cpu/isa_*.cpp), with
// MEGALIGN_ISA (the namespace, one per ISA) and MEGALIGN_SIMD_LANES defined, *before* their
// `#pragma GCC target`: like the shared formulas, everything here is defined for the baseline
// target and forced inline, and takes the ISA of the kernel loop it is inlined into (GCC inlines
// a callee whose target is a subset of the caller's, not the reverse). So the only functions
// compiled for a wider ISA are the kernels of csrc/cpu/*_simd.h, all in the ISA's namespace, and
// no inline function that code for another ISA might link to carries its instructions.
#pragma once

#pragma GCC diagnostic ignored "-Wpsabi"  // vectors wider than the baseline pass only inlined

#if !defined(MEGALIGN_ISA) || !defined(MEGALIGN_SIMD_LANES)
#error "simd.h is included by csrc/cpu/isa_*.cpp, which define MEGALIGN_ISA and MEGALIGN_SIMD_LANES"
#endif

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>

#include "megalign/common.h"
#include "megalign/math/exp.h"
#include "megalign/math/kl.h"

namespace megalign::simd::MEGALIGN_ISA {

constexpr int W = MEGALIGN_SIMD_LANES;

typedef float f32v __attribute__((vector_size(4 * W)));
typedef int32_t i32v __attribute__((vector_size(4 * W)));
typedef uint32_t u32v __attribute__((vector_size(4 * W)));
typedef uint16_t u16v __attribute__((vector_size(2 * W)));
typedef int16_t i16v __attribute__((vector_size(2 * W)));
typedef uint8_t u8v __attribute__((vector_size(W)));

#define MEGALIGN_SIMD_FN inline __attribute__((always_inline))

// Full-vector loads and stores at any element alignment, through a may_alias vector type of the
// element's alignment: a plain vector move in the kernel's ISA. A memcpy of the vector is expanded
// too early, in these baseline-target helpers: GCC 12 took the 8-lane stores of the avx2 kernels
// through the stack (the vector stored, reloaded as two 64-bit halves, reassembled, stored again:
// store-forwarding stalls, 2.3x the time of torch.add for a k1 kl_penalty) and left two dead
// 64-byte stack stores a vector in the avx512 loops.
template <typename V, typename T>
using unaligned_t [[gnu::may_alias, gnu::aligned(alignof(T))]] = V;

template <typename V, typename T>
MEGALIGN_SIMD_FN V load_raw(const T* p) {
  return *reinterpret_cast<const unaligned_t<V, T>*>(p);
}
template <typename V, typename T>
MEGALIGN_SIMD_FN void store_raw(T* p, V v) {
  *reinterpret_cast<unaligned_t<V, T>*>(p) = v;
}

// a `op` b lane by lane as an all-ones / zero integer vector (what the vector extension's `a < b`
// returns). At 16 lanes, that vector compare in these baseline-target helpers reaches the AVX-512
// kernels typed as a full-width boolean vector, which AVX-512 lacks (its compares write mask
// registers), and GCC 12 then emits one scalar compare per lane (`vcomiss` / `seta` / `neg` /
// `vpinsrd` in `perf annotate`: kl_penalty ran 3.5x slower than the 8-lane kernel on the same
// CPU). Written lane by lane, the SLP vectoriser turns it into one `vcmpps` into a mask register
// once inlined into the kernel. Narrower vectors keep the vector compare, which they do well.
template <typename V, typename Op>
MEGALIGN_SIMD_FN auto compare(V a, V b, Op op) {
  using R = decltype(a < b);
  if constexpr (W > 8) {
    R r;
    for (int i = 0; i < W; ++i) r[i] = op(a[i], b[i]) ? -1 : 0;
    return r;
  } else {
    return R(op(a, b));
  }
}
template <typename V>
MEGALIGN_SIMD_FN auto nonzero(V a) { return compare(a, V{}, std::not_equal_to<>{}); }
// m ? a : b lane by lane for an all-ones / zero mask m. At 16 lanes the vector `?:` meets the
// same fate as the compare above (one branch per lane); the bitwise form is exact for such masks
// and compiles to one vpternlogd.
MEGALIGN_SIMD_FN f32v select(i32v m, f32v a, f32v b) {
  if constexpr (W > 8) {
    return reinterpret_cast<f32v>((m & reinterpret_cast<i32v>(a)) | (~m & reinterpret_cast<i32v>(b)));
  } else {
    return m ? a : b;
  }
}

// Lane mask: all bits set where true. A bool converts to an all-lanes mask, so the formulas'
// `mask_t<A>(flag) & (x > y)` works on vectors as on scalars.
struct Mask {
  i32v m;
  Mask() = default;
  MEGALIGN_SIMD_FN explicit Mask(i32v v) : m(v) {}
  // A choice of two constant vectors, not `i32v{} + (b ? -1 : 0)`: GCC 12 built that broadcast
  // inside the policy-loss loop as eight `vpinsrd` a use (policy.h's has_ref flags), ~15% of the loop.
  MEGALIGN_SIMD_FN Mask(bool b) : m(b ? ~i32v{} : i32v{}) {}  // NOLINT: implicit on purpose
  friend MEGALIGN_SIMD_FN Mask operator&(Mask a, Mask b) { return Mask(a.m & b.m); }
  friend MEGALIGN_SIMD_FN Mask operator|(Mask a, Mask b) { return Mask(a.m | b.m); }
  friend MEGALIGN_SIMD_FN Mask operator!(Mask a) { return Mask(~a.m); }
};

// int32 lanes: exponent arithmetic of exp_f32.
struct VecI {
  i32v v;
  friend MEGALIGN_SIMD_FN VecI operator+(VecI a, int32_t b) { return {a.v + b}; }
  friend MEGALIGN_SIMD_FN VecI operator-(VecI a, VecI b) { return {a.v - b.v}; }
  friend MEGALIGN_SIMD_FN VecI operator<<(VecI a, int b) { return {a.v << b}; }
  friend MEGALIGN_SIMD_FN VecI operator>>(VecI a, int b) { return {a.v >> b}; }
};

struct Vec {
  f32v v;
  Vec() = default;
  MEGALIGN_SIMD_FN explicit Vec(f32v x) : v(x) {}
  MEGALIGN_SIMD_FN Vec(float s) : v(f32v{} + s) {}  // NOLINT: broadcast, as A(1) in the formulas

  friend MEGALIGN_SIMD_FN Vec operator+(Vec a, Vec b) { return Vec(a.v + b.v); }
  friend MEGALIGN_SIMD_FN Vec operator-(Vec a, Vec b) { return Vec(a.v - b.v); }
  friend MEGALIGN_SIMD_FN Vec operator*(Vec a, Vec b) { return Vec(a.v * b.v); }
  friend MEGALIGN_SIMD_FN Vec operator/(Vec a, Vec b) { return Vec(a.v / b.v); }
  friend MEGALIGN_SIMD_FN Vec operator-(Vec a) { return Vec(-a.v); }
  MEGALIGN_SIMD_FN Vec& operator+=(Vec b) { v += b.v; return *this; }
  MEGALIGN_SIMD_FN Vec& operator-=(Vec b) { v -= b.v; return *this; }

  friend MEGALIGN_SIMD_FN Mask operator<(Vec a, Vec b) { return Mask(compare(a.v, b.v, std::less<>{})); }
  friend MEGALIGN_SIMD_FN Mask operator>(Vec a, Vec b) { return Mask(compare(a.v, b.v, std::greater<>{})); }
  friend MEGALIGN_SIMD_FN Mask operator<=(Vec a, Vec b) { return Mask(compare(a.v, b.v, std::less_equal<>{})); }
  friend MEGALIGN_SIMD_FN Mask operator>=(Vec a, Vec b) { return Mask(compare(a.v, b.v, std::greater_equal<>{})); }
  friend MEGALIGN_SIMD_FN Mask operator==(Vec a, Vec b) { return Mask(compare(a.v, b.v, std::equal_to<>{})); }

  // The primitives the shared formulas call unqualified (found by argument-dependent lookup).
  friend MEGALIGN_SIMD_FN Vec select_acc(Mask c, Vec a, Vec b) { return Vec(select(c.m, a.v, b.v)); }
  friend MEGALIGN_SIMD_FN VecI to_int_bits(Vec x) { return {__builtin_convertvector(x.v, i32v)}; }
  friend MEGALIGN_SIMD_FN Vec exp_acc(Vec x) { return exp_f32(x); }
  friend MEGALIGN_SIMD_FN Vec exp_bounded(Vec x) { return exp_bounded_f32(x); }
  friend MEGALIGN_SIMD_FN Vec kernel_exp(Vec x) { return exp_nonpos_f32(x); }
};

MEGALIGN_SIMD_FN Vec float_from_int_bits(VecI u) { return Vec(reinterpret_cast<f32v>(u.v)); }
MEGALIGN_SIMD_FN Expm1Split<Vec> expm1_split(Vec x) { return expm1_split_f32(x); }
MEGALIGN_SIMD_FN Vec vmax(Vec a, Vec b) { return select_acc(a > b, a, b); }  // NaN lanes keep a's partner b
MEGALIGN_SIMD_FN Vec vmin(Vec a, Vec b) { return select_acc(a < b, a, b); }

// Horizontal reductions, lanes in order (deterministic).
MEGALIGN_SIMD_FN float hsum(Vec a) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += a.v[i];
  return s;
}
MEGALIGN_SIMD_FN float hmax(Vec a) {
  float m = a.v[0];
  for (int i = 1; i < W; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
MEGALIGN_SIMD_FN float hmin(Vec a) {
  float m = a.v[0];
  for (int i = 1; i < W; ++i) m = a.v[i] < m ? a.v[i] : m;
  return m;
}
// Number of set lanes of a mask sum kept as int32 lanes (each lane counts up by one per set bit).
MEGALIGN_SIMD_FN int64_t hcount(i32v counts) {
  int64_t s = 0;
  for (int i = 0; i < W; ++i) s += counts[i];
  return s;
}

// ---- loads of W consecutive elements as fp32 lanes (exact for every input dtype)

MEGALIGN_SIMD_FN Vec load(const float* p) { return Vec(load_raw<f32v>(p)); }
MEGALIGN_SIMD_FN Vec load(const bf16* p) {
  const u32v w = __builtin_convertvector(load_raw<u16v>(p), u32v) << 16;
  return Vec(reinterpret_cast<f32v>(w));
}
// IEEE binary16 -> binary32 without branches (F. Giesen's "half to float" by exponent rescaling):
// shift exponent and mantissa into place, multiply by 2^112 to rebias (exact, also for subnormal
// halves), and restore the all-ones exponent of inf / NaN.
MEGALIGN_SIMD_FN Vec load(const fp16* p) {
  const u32v h = __builtin_convertvector(load_raw<u16v>(p), u32v);
  const u32v magnitude = (h & 0x7FFFu) << 13;
  f32v f = reinterpret_cast<f32v>(magnitude) * bits_float((254u - 15u) << 23);
  const i32v infnan = compare(f, f32v{} + bits_float((127u + 16u) << 23), std::greater_equal<>{});
  u32v u = reinterpret_cast<u32v>(f) | (reinterpret_cast<u32v>(infnan) & (255u << 23));
  u |= (h & 0x8000u) << 16;
  return Vec(reinterpret_cast<f32v>(u));
}

// ---- token masks: a lane is valid where the element is nonzero (kl_policy_common.h's rule)

// Widened in two steps: GCC 12 lowers a one-step u8 -> i32 __builtin_convertvector to one byte
// load and one vpinsrd a lane (a bool mask made kl_masked_mean 3x slower than a float one), but
// each 2x step to vpmovzx.
MEGALIGN_SIMD_FN Mask load_mask(const uint8_t* p) {
  return Mask(nonzero(__builtin_convertvector(__builtin_convertvector(load_raw<u8v>(p), u16v), i32v)));
}
MEGALIGN_SIMD_FN Mask load_mask(const int32_t* p) { return Mask(nonzero(load_raw<i32v>(p))); }
// 64-bit masks as two vectors of their 32-bit halves, low halves (even int32 lanes) and high ones
// (odd) gathered by a two-input shuffle (vpermt2d / vshufps): a 64-bit compare at 8 lanes spans
// two AVX2 registers, which GCC 12 lowered to one neg / sbb / vpinsrq a lane (and the narrowing
// __builtin_convertvector to more inserts). An element is nonzero where its bits, less a
// double's sign bit (-0.0 is zero, NaN is not), are.
template <size_t Odd, size_t... I>
MEGALIGN_SIMD_FN i32v half_words(i32v lo, i32v hi, std::index_sequence<I...>) {
  return __builtin_shufflevector(lo, hi, (2 * I + Odd)...);
}
template <typename T>
MEGALIGN_SIMD_FN Mask load_mask_64(const T* p, int32_t high_bits) {
  const i32v lo = load_raw<i32v>(p), hi = load_raw<i32v>(p + W / 2);
  constexpr auto lanes = std::make_index_sequence<W>{};
  return Mask(nonzero(half_words<0>(lo, hi, lanes) | (half_words<1>(lo, hi, lanes) & high_bits)));
}
MEGALIGN_SIMD_FN Mask load_mask(const int64_t* p) { return load_mask_64(p, -1); }
MEGALIGN_SIMD_FN Mask load_mask(const float* p) { return Mask(nonzero(load_raw<f32v>(p))); }
MEGALIGN_SIMD_FN Mask load_mask(const double* p) { return load_mask_64(p, 0x7FFFFFFF); }
MEGALIGN_SIMD_FN Mask load_mask_16(const uint16_t* p) {  // bf16 / fp16: only +-0 are zero
  return Mask(__builtin_convertvector(nonzero(load_raw<u16v>(p) & 0x7FFF), i32v));
}
MEGALIGN_SIMD_FN Mask load_mask(const bf16* p) { return load_mask_16(reinterpret_cast<const uint16_t*>(p)); }
MEGALIGN_SIMD_FN Mask load_mask(const fp16* p) { return load_mask_16(reinterpret_cast<const uint16_t*>(p)); }

// ---- stores of fp32 lanes as W elements of T, rounding to nearest even like common.h's from_acc

MEGALIGN_SIMD_FN void store(float* p, Vec x) { store_raw(p, x.v); }
MEGALIGN_SIMD_FN void store(bf16* p, Vec x) {
  u32v u = reinterpret_cast<u32v>(x.v);
  const i32v nan = compare(u & 0x7FFFFFFFu, u32v{} + 0x7F800000u, std::greater<>{});
  const u32v rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  u = (reinterpret_cast<u32v>(nan) & ((u >> 16) | 0x40u)) | (~reinterpret_cast<u32v>(nan) & rounded);
  store_raw(reinterpret_cast<uint16_t*>(p), __builtin_convertvector(u, u16v));
}
// binary32 -> binary16, round to nearest even, overflow to inf, NaN quiet, subnormals kept
// (F. Giesen's float_to_half_fast3_rtne, with selects for its three cases).
MEGALIGN_SIMD_FN void store(fp16* p, Vec x) {
  const u32v bits = reinterpret_cast<u32v>(x.v);
  const u32v sign = bits & 0x80000000u;
  const u32v u = bits ^ sign;
  // |x| >= 65520 (rounds to inf) or inf / NaN
  const u32v big = reinterpret_cast<u32v>(compare(u, u32v{} + ((127u + 16u) << 23), std::greater_equal<>{}));
  const u32v nan = reinterpret_cast<u32v>(compare(u, u32v{} + (255u << 23), std::greater<>{}));
  const u32v infnan = (nan & 0x7E00u) | (~nan & 0x7C00u);
  // |x| < 2^-14: the result is subnormal or zero; adding 0.5 rounds the mantissa in place.
  const u32v tiny = reinterpret_cast<u32v>(compare(u, u32v{} + (113u << 23), std::less<>{}));
  const u32v denorm_magic = u32v{} + (((127u - 15u) + (23u - 10u) + 1u) << 23);
  const u32v sub = reinterpret_cast<u32v>(reinterpret_cast<f32v>(u) + reinterpret_cast<f32v>(denorm_magic)) -
                   denorm_magic;
  const u32v normal = (u + ((15u - 127u) << 23) + 0xFFFu + ((u >> 13) & 1u)) >> 13;
  const u32v h = (big & infnan) | (~big & ((tiny & sub) | (~tiny & normal))) | (sign >> 16);
  store_raw(reinterpret_cast<uint16_t*>(p), __builtin_convertvector(h, u16v));
}

// ---- the last, partial vector of a range: n < W elements through a W-element buffer, so no
// access ever leaves the caller's range; the missing lanes read as `fill`.

template <typename T>
MEGALIGN_SIMD_FN Vec load_tail(const T* p, int64_t n, T fill) {
  T buf[W];
  for (int i = 0; i < W; ++i) buf[i] = i < n ? p[i] : fill;
  return load(buf);
}
template <typename M>
MEGALIGN_SIMD_FN Mask load_mask_tail(const M* p, int64_t n) {
  M buf[W];
  std::memset(buf, 0, sizeof(buf));
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(M));
  return load_mask(buf);
}
template <typename T>
MEGALIGN_SIMD_FN void store_tail(T* p, Vec x, int64_t n) {
  T buf[W];
  store(buf, x);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(T));
}

}  // namespace megalign::simd::MEGALIGN_ISA

namespace megalign {
template <> struct LaneOf<simd::MEGALIGN_ISA::Vec> { using type = float; };
}  // namespace megalign
