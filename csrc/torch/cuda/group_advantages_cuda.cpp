// megalign::group_advantages{,_indexed} on CUDA: the checks of the CPU glue
// (group_advantages_checks.h) plus the device, then the launchers on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>

#include "group_advantages_checks.h"
#include "megalign/group_advantages.h"

namespace megalign::torch_glue {
namespace {

at::Tensor group_advantages_cuda(const at::Tensor& scores, int64_t group_size, c10::string_view mode, double eps,
                                 bool unbiased) {
  const char* op = "group_advantages";
  const DType dtype = check_group_scores(scores, eps, op);
  const math::GroupMode m = parse_group_mode(std::string(mode), op);
  check_group_size(scores, group_size);
  check_cuda(scores, op, "scores");
  const c10::cuda::CUDAGuard guard(scores.device());
  at::Tensor out = at::empty({scores.size(0)}, scores.options().dtype(group_out_type(dtype)));
  cuda::group_advantages(dtype, scores.data_ptr(), scores.stride(0), scores.size(0), group_size, m, eps, unbiased,
                         out.data_ptr(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor group_advantages_indexed_cuda(const at::Tensor& scores, const at::Tensor& group_ids, int64_t num_groups,
                                         c10::string_view mode, double eps, bool unbiased) {
  const char* op = "group_advantages_indexed";
  const DType dtype = check_group_scores(scores, eps, op);
  const math::GroupMode m = parse_group_mode(std::string(mode), op);
  check_cuda(scores, op, "scores");
  const c10::cuda::CUDAGuard guard(scores.device());
  check_group_ids(scores, group_ids, num_groups);
  TORCH_CHECK(scores.size(0) <= INT_MAX, "megalign::", op, ": scores may hold at most 2^31 - 1 entries on CUDA, got ",
              scores.size(0));
  const at::Tensor ids = group_ids.contiguous();
  at::Tensor out = at::empty({scores.size(0)}, scores.options().dtype(group_out_type(dtype)));
  at::Tensor workspace = at::empty({static_cast<int64_t>(cuda::group_advantages_indexed_workspace_bytes(dtype, num_groups))},
                                   scores.options().dtype(at::kByte));
  cuda::group_advantages_indexed(dtype, scores.data_ptr(), scores.stride(0), ids.data_ptr<int64_t>(), scores.size(0),
                                 num_groups, m, eps, unbiased, workspace.data_ptr(), out.data_ptr(),
                                 at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_IMPL(megalign, CUDA, m) {
  m.impl("group_advantages", &megalign::torch_glue::group_advantages_cuda);
  m.impl("group_advantages_indexed", &megalign::torch_glue::group_advantages_indexed_cuda);
}
