// Input checks of megalign::group_advantages{,_indexed} shared by the CPU and CUDA glue.
#pragma once

#include <cmath>
#include <string>

#include "checks.h"
#include "megalign/math/advantage.h"

namespace megalign::torch_glue {

inline math::GroupMode parse_group_mode(const std::string& mode, const char* op) {
  if (mode == "grpo") return math::GroupMode::kGrpo;
  if (mode == "dr_grpo") return math::GroupMode::kDrGrpo;
  if (mode == "rloo") return math::GroupMode::kRloo;
  TORCH_CHECK(false, "megalign::", op, ": mode must be one of grpo, dr_grpo, rloo, got '", mode, "'");
}

// The checked call of either layout: kernel dtype, mode, and the output [N], float32 (float64 for
// float64 scores).
struct GroupCall {
  DType dtype;
  math::GroupMode mode;
  at::Tensor out;
};

inline GroupCall prepare_group_call(const at::Tensor& scores, c10::string_view mode, double eps, const char* op) {
  check_dim(scores, 1, op, "scores");
  const DType dtype = to_dtype(scores, op, "scores");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "megalign::", op, ": eps must be finite and >= 0, got ", eps);
  const math::GroupMode m = parse_group_mode(std::string(mode), op);
  return GroupCall{dtype, m,
                   at::empty({scores.size(0)}, scores.options().dtype(dtype == DType::kFloat64 ? at::kDouble : at::kFloat))};
}

inline void check_group_size(const at::Tensor& scores, int64_t group_size) {
  TORCH_CHECK(group_size >= 1, "megalign::group_advantages: group_size must be >= 1, got ", group_size);
  TORCH_CHECK(scores.size(0) % group_size == 0, "megalign::group_advantages: group_size ", group_size,
              " does not divide the number of scores ", scores.size(0));
}

// Any integer ids [N] on the scores' device (bool and floating types are refused, naming the
// argument). Returns them as int64, converting other integer types.
inline at::Tensor check_group_index(const at::Tensor& scores, const at::Tensor& group_index, const char* op) {
  check_dim(group_index, 1, op, "group_index");
  const at::ScalarType t = group_index.scalar_type();
  TORCH_CHECK(at::isIntegralType(t, /*includeBool=*/false), "megalign::", op,
              ": group_index must be an integer tensor, got ", t);
  check_same_shape(scores, group_index, op, "scores", "group_index");
  check_same_device(scores, group_index, op, "scores", "group_index");
  return t == at::kLong ? group_index : group_index.to(at::kLong);
}

// Dense ids: int64 [N] on the scores' device, every id in [0, num_groups) (a kernel never indexes
// per-group memory out of bounds). The range check reads the minimum and maximum back from the
// device in one copy (one host sync on CUDA); with check_range false (ids numbered by unique,
// in range by construction) it reads nothing.
inline void check_group_ids(const at::Tensor& scores, const at::Tensor& group_ids, int64_t num_groups,
                            bool check_range = true) {
  const char* op = "group_advantages_indexed";
  check_dim(group_ids, 1, op, "group_ids");
  check_dtype(group_ids, at::kLong, op, "group_ids");
  check_same_shape(scores, group_ids, op, "scores", "group_ids");
  check_same_device(scores, group_ids, op, "scores", "group_ids");
  TORCH_CHECK(num_groups >= 0, "megalign::", op, ": num_groups must be >= 0, got ", num_groups);
  if (group_ids.numel() == 0 || !check_range) return;
  const auto [lo, hi] = at::aminmax(group_ids);
  const at::Tensor bounds = at::stack({lo, hi}).cpu();
  const int64_t lo_v = bounds[0].item<int64_t>(), hi_v = bounds[1].item<int64_t>();
  TORCH_CHECK(lo_v >= 0 && hi_v < num_groups, "megalign::", op, ": group_ids must lie in [0, num_groups=", num_groups,
              "), got values in [", lo_v, ", ", hi_v, "]");
}

}  // namespace megalign::torch_glue
