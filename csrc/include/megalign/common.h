// Framework-free basics shared by every megalign kernel: the dtype tag the launchers take,
// 16-bit float storage types with exact round-to-nearest-even conversions, the accumulation
// type rule (fp32 for every input dtype, fp64 for fp64), and the dispatch macro.
//
// Nothing here includes a torch header, so the same code compiles in the CPU kernels, the
// CUDA kernels (nvcc, no torch) and the C++ tests. Per-element math lives in header-only
// MEGALIGN_HD functions (see math/*.h) so the CPU tests exercise the arithmetic the GPU runs.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define MEGALIGN_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define MEGALIGN_HD inline
#endif

namespace megalign {

// Element type of a tensor handed to a launcher. The torch glue maps at::ScalarType onto it.
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "unknown";
}

// 16-bit storage types: plain bit patterns, layout-compatible with at::BFloat16 / at::Half and
// with CUDA's __nv_bfloat16 / __half.
struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

MEGALIGN_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MEGALIGN_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Accumulation type: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 (so CPU gradcheck is exact).
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <typename T> using acc_t = typename AccType<T>::type;

MEGALIGN_HD float to_acc(float v) { return v; }
MEGALIGN_HD double to_acc(double v) { return v; }
MEGALIGN_HD float to_acc(bf16 v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }
MEGALIGN_HD float to_acc(fp16 v) {
#if defined(__CUDA_ARCH__)
  __half h;
  std::memcpy(&h, &v.bits, sizeof(h));
  return __half2float(h);
#elif defined(__FLT16_MAX__) && !defined(MEGALIGN_SOFT_FP16)
  _Float16 h;
  std::memcpy(&h, &v.bits, sizeof(h));
  return static_cast<float>(h);
#else
  // Software path (compilers without _Float16; forced by MEGALIGN_SOFT_FP16 in the C++ tests).
  // IEEE binary16 -> binary32, including subnormals, inf and NaN.
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1Fu;
  uint32_t man = v.bits & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    exp = 127 - 15 + 1;
    while ((man & 0x400u) == 0) { man <<= 1; --exp; }
    man &= 0x3FFu;
    return bits_float(sign | (exp << 23) | (man << 13));
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
#endif
}

// Store an accumulator value into an element type, rounding to nearest even.
template <typename T> MEGALIGN_HD T from_acc(float v);
template <typename T> MEGALIGN_HD T from_acc(double v);
template <> MEGALIGN_HD float from_acc<float>(float v) { return v; }
template <> MEGALIGN_HD double from_acc<double>(double v) { return v; }
template <> MEGALIGN_HD float from_acc<float>(double v) { return static_cast<float>(v); }
template <> MEGALIGN_HD double from_acc<double>(float v) { return v; }
template <> MEGALIGN_HD bf16 from_acc<bf16>(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One cvt.rn.bf16.f32 (sm_80+): the same round-to-nearest-even as the bit arithmetic below, which
  // costs the backward's store path five integer instructions and a NaN branch per element.
  const __nv_bfloat16 h = __float2bfloat16_rn(v);
  bf16 out;
  std::memcpy(&out.bits, &h, sizeof(out.bits));
  return out;
#else
  uint32_t u = float_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
#endif
}
template <> MEGALIGN_HD fp16 from_acc<fp16>(float v) {
#if defined(__CUDA_ARCH__)
  __half h = __float2half_rn(v);
  fp16 out;
  std::memcpy(&out.bits, &h, sizeof(h));
  return out;
#elif defined(__FLT16_MAX__) && !defined(MEGALIGN_SOFT_FP16)
  _Float16 h = static_cast<_Float16>(v);
  fp16 out;
  std::memcpy(&out.bits, &h, sizeof(h));
  return out;
#else
  // Software path, see to_acc(fp16). IEEE binary32 -> binary16, round to nearest even, overflow to inf, subnormals kept.
  const uint32_t u = float_bits(v);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7FFFFFFFu;
  if (au > 0x7F800000u) return fp16{static_cast<uint16_t>(sign | 0x7E00u)};
  if (au >= 0x477FF000u) return fp16{static_cast<uint16_t>(sign | 0x7C00u)};
  if (au < 0x38800000u) {  // result is subnormal or zero
    if (au < 0x33000000u) return fp16{sign};
    const uint32_t e = au >> 23;
    const uint32_t m = (au & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t r = m >> shift;
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return fp16{static_cast<uint16_t>(sign | r)};
  }
  uint32_t r = ((au >> 13) - ((127 - 15) << 10));
  const uint32_t rem = au & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return fp16{static_cast<uint16_t>(sign | r)};
#endif
}
template <> MEGALIGN_HD bf16 from_acc<bf16>(double v) { return from_acc<bf16>(static_cast<float>(v)); }
template <> MEGALIGN_HD fp16 from_acc<fp16>(double v) { return from_acc<fp16>(static_cast<float>(v)); }

// Invoke a generic lambda with `scalar_t` bound to the C++ type of `dtype`:
//   MEGALIGN_DISPATCH_FLOAT(dtype, "token_logprob", [&] { run<scalar_t>(...); });
#define MEGALIGN_DISPATCH_CASE(enum_value, type, ...) \
  case ::megalign::DType::enum_value: {               \
    using scalar_t = type;                            \
    __VA_ARGS__();                                    \
    break;                                            \
  }

#define MEGALIGN_DISPATCH_FLOAT(dtype, op_name, ...)                                    \
  switch (dtype) {                                                                      \
    MEGALIGN_DISPATCH_CASE(kFloat32, float, __VA_ARGS__)                                \
    MEGALIGN_DISPATCH_CASE(kFloat64, double, __VA_ARGS__)                               \
    MEGALIGN_DISPATCH_CASE(kBFloat16, ::megalign::bf16, __VA_ARGS__)                    \
    MEGALIGN_DISPATCH_CASE(kFloat16, ::megalign::fp16, __VA_ARGS__)                     \
    default:                                                                            \
      throw std::invalid_argument(std::string(op_name) + ": unsupported dtype");        \
  }

}  // namespace megalign
