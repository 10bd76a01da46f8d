// megalign::group_advantages (contiguous groups) and megalign::group_advantages_indexed (dense
// group ids): schemas and CPU implementations. No derivative: advantages are constants of the loss.
#include "group_advantages_checks.h"
#include "megalign/group_advantages.h"

namespace megalign::torch_glue {
namespace {

at::Tensor group_advantages_cpu(const at::Tensor& scores, int64_t group_size, c10::string_view mode, double eps,
                                bool unbiased) {
  const char* op = "group_advantages";
  const DType dtype = check_group_scores(scores, eps, op);
  const math::GroupMode m = parse_group_mode(std::string(mode), op);
  check_group_size(scores, group_size);
  check_cpu(scores, op, "scores");
  at::Tensor out = at::empty({scores.size(0)}, scores.options().dtype(group_out_type(dtype)));
  cpu::group_advantages(dtype, scores.data_ptr(), scores.stride(0), scores.size(0), group_size, m, eps, unbiased,
                        out.data_ptr());
  return out;
}

at::Tensor group_advantages_indexed_cpu(const at::Tensor& scores, const at::Tensor& group_ids, int64_t num_groups,
                                        c10::string_view mode, double eps, bool unbiased) {
  const char* op = "group_advantages_indexed";
  const DType dtype = check_group_scores(scores, eps, op);
  const math::GroupMode m = parse_group_mode(std::string(mode), op);
  check_group_ids(scores, group_ids, num_groups);
  check_cpu(scores, op, "scores");
  const at::Tensor ids = group_ids.contiguous();
  at::Tensor out = at::empty({scores.size(0)}, scores.options().dtype(group_out_type(dtype)));
  cpu::group_advantages_indexed(dtype, scores.data_ptr(), scores.stride(0), ids.data_ptr<int64_t>(), scores.size(0),
                                num_groups, m, eps, unbiased, out.data_ptr());
  return out;
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def("group_advantages(Tensor scores, int group_size, str mode, float eps, bool unbiased) -> Tensor");
  m.def("group_advantages_indexed(Tensor scores, Tensor group_ids, int num_groups, str mode, float eps, "
        "bool unbiased) -> Tensor");
}

TORCH_LIBRARY_IMPL(megalign, CPU, m) {
  m.impl("group_advantages", &megalign::torch_glue::group_advantages_cpu);
  m.impl("group_advantages_indexed", &megalign::torch_glue::group_advantages_indexed_cpu);
}
