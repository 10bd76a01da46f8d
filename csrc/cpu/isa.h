// The CPU's vector ISA, chosen at run time (private to csrc/cpu).
//
// The fp32 / bf16 / fp16 kernels are compiled once per x86-64 level, each in its own translation
// unit and namespace (isa_baseline.cpp: SSE2, 4 lanes, every x86-64 CPU and other architectures'
// 128-bit vectors; isa_avx2.cpp: AVX2 + FMA + F16C, 8 lanes; isa_avx512.cpp: AVX-512 F/BW/DQ/VL,
// 16 lanes), so one build runs on any CPU at the speed of its vector unit, whatever the machine it
// was built on: the way torch dispatches its CPU kernels by capability. The first kernel call picks
// the widest level the CPU (and the OS, for the AVX register state) supports;
// MEGALIGN_CPU_ISA=baseline|avx2|avx512 forces a lower one (asking for one the CPU lacks is an
// error), which is how CI runs the op tests on the baseline code on any machine.
#pragma once

#include <cstdint>

#include "megalign/common.h"
#include "megalign/kl_penalty.h"
#include "megalign/policy_loss.h"

namespace megalign::cpu {

// The vector kernels of one ISA. Each takes the public launcher's arguments (token_logprob.h,
// kl_penalty.h, policy_loss.h) for an fp32, bf16 or fp16 dtype; the kl_penalty and policy_loss
// ones also need every operand unit-stride within a row (the launchers check both and run the
// scalar loops otherwise), and their `grad` operand unit-stride or a per-row broadcast (stride 0).
struct IsaKernels {
  const char* name;
  int lanes;  // fp32 lanes of one vector
  int64_t (*token_logprob_partials)(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                                    int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                    int64_t vocab_size, double inv_temperature, int64_t ignore_index,
                                    bool with_entropy, void* partials);
  void (*token_logprob_backward)(DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                                 int64_t row_stride, const int64_t* targets, const void* lse,
                                 const void* entropy, const void* grad_logp, const void* grad_entropy,
                                 int64_t vocab_start, double inv_temperature, int64_t ignore_index,
                                 void* grad, int64_t grad_row_stride);
  void (*kl_penalty_fwd)(const KlArgs& a, void* out, void* dlogp);
  void (*kl_penalty_bwd)(const KlArgs& a, const StridedView& grad, void* grad_logp);
  void (*kl_masked_mean_fwd)(const KlArgs& a, const KlMaskArg& m, void* mean, int64_t* count, void* dlogp);
  void (*kl_masked_mean_bwd)(const KlArgs& a, const KlMaskArg& m, const void* grad_mean,
                             const int64_t* count, void* grad_logp);
  void (*policy_loss_fwd)(const PolicyLossArgs& a, void* loss, float* stats, void* dlogp, double* loss_sum);
  void (*policy_loss_bwd)(const PolicyLossArgs& a, const StridedView& grad, void* grad_logp);
};

// The table of each compiled level (null where the level is not compiled: non-x86 builds, or
// compilers without per-function targets).
const IsaKernels* isa_baseline_kernels();
const IsaKernels* isa_avx2_kernels();
const IsaKernels* isa_avx512_kernels();

// The kernels in use (chosen once, see above). Throws std::invalid_argument naming
// MEGALIGN_CPU_ISA for an unknown value or a level this CPU or build lacks.
const IsaKernels& isa_kernels();

// Whether the vector kernels can read these operands: unit stride within a row (or one column).
inline bool row_contiguous(const StridedView& v, int64_t cols) {
  return v.data == nullptr || v.col_stride == 1 || cols <= 1;
}
// A gradient operand: unit stride within a row, or one value per row (stride 0, autograd's
// expansion of a scalar or per-row gradient).
inline bool row_contiguous_or_broadcast(const StridedView& v, int64_t cols) {
  return row_contiguous(v, cols) || v.col_stride == 0;
}

}  // namespace megalign::cpu
