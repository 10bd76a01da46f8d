// The vector kernels for every CPU: 4 fp32 lanes in 128-bit registers (SSE2 on x86-64, NEON on
// AArch64), compiled for the build's baseline target. See isa.h.
#include "isa_prelude.h"

#define MEGALIGN_ISA baseline
#define MEGALIGN_SIMD_LANES 4
#include "simd.h"
#include "isa_kernels.inc"

namespace megalign::cpu {
const IsaKernels* isa_baseline_kernels() { return &baseline::kKernels; }
}  // namespace megalign::cpu
