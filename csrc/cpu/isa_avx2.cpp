// The vector kernels for x86-64-v3 CPUs (AVX2, FMA, F16C): 8 fp32 lanes. See isa.h. Built with
// GCC, which compiles the functions after the pragma for this target whatever -march says; other
// compilers get the baseline kernels only.
#include "isa_prelude.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEGALIGN_ISA avx2
#define MEGALIGN_SIMD_LANES 8
#include "simd.h"
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#include "isa_kernels.inc"
#pragma GCC pop_options

namespace megalign::cpu {
const IsaKernels* isa_avx2_kernels() { return &avx2::kKernels; }
}  // namespace megalign::cpu
#else
namespace megalign::cpu {
const IsaKernels* isa_avx2_kernels() { return nullptr; }
}  // namespace megalign::cpu
#endif
