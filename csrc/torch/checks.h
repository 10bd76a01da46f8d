// Input checks shared by every op's torch glue. Each failure names the op and the argument, so a
// user sees "megalign::token_logprob: targets must be int64, got Float" rather than a crash or
// an out-of-bounds read deep in a kernel.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>

#include "megalign/common.h"

namespace megalign::torch_glue {

inline DType to_dtype(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default:
      TORCH_CHECK(false, "megalign::", op, ": ", arg,
                  " must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const char* arg) {
  TORCH_CHECK(t.scalar_type() == want, "megalign::", op, ": ", arg, " must be ", want, ", got ",
              t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* arg) {
  TORCH_CHECK(t.dim() == dim, "megalign::", op, ": ", arg, " must have ", dim,
              " dimensions, got shape ", t.sizes());
}

inline void check_same_shape(const at::Tensor& a, const at::Tensor& b, const char* op,
                             const char* arg_a, const char* arg_b) {
  TORCH_CHECK(a.sizes() == b.sizes(), "megalign::", op, ": ", arg_b, " must have the shape of ",
              arg_a, " ", a.sizes(), ", got ", b.sizes());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const char* arg_a, const char* arg_b) {
  TORCH_CHECK(a.device() == b.device(), "megalign::", op, ": ", arg_b, " is on ", b.device(),
              " but ", arg_a, " is on ", a.device());
}

inline void check_cpu(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.device().is_cpu(), "megalign::", op, ": ", arg, " must be a CPU tensor here, got ",
              t.device());
}

inline void check_cuda(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.device().is_cuda(), "megalign::", op, ": ", arg, " must be a CUDA tensor here, got ",
              t.device());
}

}  // namespace megalign::torch_glue
