// Run-time choice of the vector ISA of the CPU kernels (isa.h).
#include "isa.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "megalign/cpu_isa.h"

namespace megalign::cpu {
namespace {

struct Level {
  const char* name;
  const IsaKernels* (*table)();
  bool (*cpu_has)();
};

#if defined(__x86_64__) && defined(__GNUC__)
// __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 register state (XCR0).
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
#endif
bool always() { return true; }

// Widest first.
const Level kLevels[] = {
    {"avx512", isa_avx512_kernels, has_avx512},
    {"avx2", isa_avx2_kernels, has_avx2},
    {"baseline", isa_baseline_kernels, always},
};

const IsaKernels& choose() {
  const char* env = std::getenv("MEGALIGN_CPU_ISA");
  const std::string want = env ? env : "";
  if (want.empty() || want == "auto") {
    for (const Level& l : kLevels) {
      if (l.table() != nullptr && l.cpu_has()) return *l.table();
    }
  }
  for (const Level& l : kLevels) {
    if (want != l.name) continue;
    if (l.table() == nullptr) {
      throw std::invalid_argument("MEGALIGN_CPU_ISA=" + want + ": this build of megalign has no " + want +
                                  " kernels (they need GCC on x86-64)");
    }
    if (!l.cpu_has()) {
      throw std::invalid_argument("MEGALIGN_CPU_ISA=" + want + ": this CPU does not support " + want);
    }
    return *l.table();
  }
  throw std::invalid_argument("MEGALIGN_CPU_ISA=" + want + ": expected auto, avx512, avx2 or baseline");
}

}  // namespace

const IsaKernels& isa_kernels() {
  static const IsaKernels& kernels = choose();  // a throwing choice is retried at the next call
  return kernels;
}

const char* cpu_isa_name() { return isa_kernels().name; }
int cpu_isa_lanes() { return isa_kernels().lanes; }

}  // namespace megalign::cpu
