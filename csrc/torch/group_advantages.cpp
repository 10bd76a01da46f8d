// megalign::group_advantages (contiguous groups), megalign::group_advantages_by_id (any integer id
// per score) and megalign::group_advantages_indexed (dense ids): schemas and CPU implementations.
// No derivative: advantages are constants of the loss.
#include "group_advantages_checks.h"
#include "megalign/group_advantages.h"

namespace megalign::torch_glue {
namespace {

at::Tensor group_advantages_cpu(const at::Tensor& scores, int64_t group_size, c10::string_view mode, double eps,
                                bool unbiased) {
  check_cpu(scores, "group_advantages", "scores");
  const GroupCall c = prepare_group_call(scores, mode, eps, "group_advantages");
  check_group_size(scores, group_size);
  cpu::group_advantages(c.dtype, scores.data_ptr(), scores.stride(0), scores.size(0), group_size, c.mode, eps,
                        unbiased, c.out.data_ptr());
  return c.out;
}

// The kernel numbers the distinct ids itself, so the ids need no torch.unique first.
at::Tensor group_advantages_by_id_cpu(const at::Tensor& scores, const at::Tensor& group_index, c10::string_view mode,
                                      double eps, bool unbiased) {
  const char* op = "group_advantages_by_id";
  check_cpu(scores, op, "scores");
  const GroupCall c = prepare_group_call(scores, mode, eps, op);
  const at::Tensor ids = check_group_index(scores, group_index, op);
  cpu::group_advantages_by_id(c.dtype, scores.data_ptr(), scores.stride(0), ids.data_ptr<int64_t>(), ids.stride(0),
                              scores.size(0), c.mode, eps, unbiased, c.out.data_ptr());
  return c.out;
}

// Dense ids are ids too: the range is checked (the schema promises it), then the same kernel runs.
at::Tensor group_advantages_indexed_cpu(const at::Tensor& scores, const at::Tensor& group_ids, int64_t num_groups,
                                        c10::string_view mode, double eps, bool unbiased) {
  const char* op = "group_advantages_indexed";
  check_cpu(scores, op, "scores");
  const GroupCall c = prepare_group_call(scores, mode, eps, op);
  check_group_ids(scores, group_ids, num_groups);
  cpu::group_advantages_by_id(c.dtype, scores.data_ptr(), scores.stride(0), group_ids.data_ptr<int64_t>(),
                              group_ids.stride(0), scores.size(0), c.mode, eps, unbiased, c.out.data_ptr());
  return c.out;
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def("group_advantages(Tensor scores, int group_size, str mode, float eps, bool unbiased) -> Tensor");
  m.def("group_advantages_by_id(Tensor scores, Tensor group_index, str mode, float eps, bool unbiased) -> Tensor");
  m.def("group_advantages_indexed(Tensor scores, Tensor group_ids, int num_groups, str mode, float eps, "
        "bool unbiased) -> Tensor");
}

TORCH_LIBRARY_IMPL(megalign, CPU, m) {
  m.impl("group_advantages", &megalign::torch_glue::group_advantages_cpu);
  m.impl("group_advantages_by_id", &megalign::torch_glue::group_advantages_by_id_cpu);
  m.impl("group_advantages_indexed", &megalign::torch_glue::group_advantages_indexed_cpu);
}
