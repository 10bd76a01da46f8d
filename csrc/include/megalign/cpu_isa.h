// Which vector ISA the CPU kernels run with (csrc/cpu/isa.h): "avx512", "avx2" or "baseline",
// chosen at the first call from the CPU's features and MEGALIGN_CPU_ISA. Throws
// std::invalid_argument naming MEGALIGN_CPU_ISA when its value is unknown or the level is
// unavailable on this CPU or in this build.
#pragma once

namespace megalign::cpu {

const char* cpu_isa_name();
int cpu_isa_lanes();  // fp32 lanes of one vector

}  // namespace megalign::cpu
