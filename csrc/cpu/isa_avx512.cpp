// The vector kernels for x86-64-v4 CPUs (AVX-512 F, BW, DQ, VL): 16 fp32 lanes. See isa.h and
// isa_avx2.cpp.
#include "isa_prelude.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEGALIGN_ISA avx512
#define MEGALIGN_SIMD_LANES 16
#include "simd.h"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#include "isa_kernels.inc"
#pragma GCC pop_options

namespace megalign::cpu {
const IsaKernels* isa_avx512_kernels() { return &avx512::kKernels; }
}  // namespace megalign::cpu
#else
namespace megalign::cpu {
const IsaKernels* isa_avx512_kernels() { return nullptr; }
}  // namespace megalign::cpu
#endif
