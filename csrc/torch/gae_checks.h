// Input checks and shapes of megalign::gae shared by the CPU and CUDA glue.
#pragma once

#include <cmath>

#include "checks.h"
#include "megalign/gae.h"

namespace megalign::torch_glue {

// The checked call: the kernel dtype and the outputs, [B, T] float32 (float64 for float64 inputs).
struct GaeCall {
  DType dtype;
  at::Tensor advantages;
  at::Tensor returns;
};

inline GaeCall prepare_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask, double gamma,
                         double lam) {
  const char* op = "gae";
  check_dim(rewards, 2, op, "rewards");
  const DType dtype = to_dtype(rewards, op, "rewards");
  check_same_shape(rewards, values, op, "rewards", "values");
  TORCH_CHECK(values.scalar_type() == rewards.scalar_type(), "megalign::gae: values must have the dtype of rewards (",
              rewards.scalar_type(), "), got ", values.scalar_type());
  check_same_shape(rewards, mask, op, "rewards", "mask");
  check_dtype(mask, at::kBool, op, "mask");
  check_same_device(rewards, values, op, "rewards", "values");
  check_same_device(rewards, mask, op, "rewards", "mask");
  TORCH_CHECK(std::isfinite(gamma), "megalign::gae: gamma must be finite, got ", gamma);
  TORCH_CHECK(std::isfinite(lam), "megalign::gae: lam must be finite, got ", lam);
  at::Tensor adv = at::empty(rewards.sizes(), rewards.options().dtype(dtype == DType::kFloat64 ? at::kDouble : at::kFloat));
  return GaeCall{dtype, adv, at::empty_like(adv)};
}

inline Strides2d strides2d(const at::Tensor& t) { return Strides2d{t.stride(0), t.stride(1)}; }

}  // namespace megalign::torch_glue
