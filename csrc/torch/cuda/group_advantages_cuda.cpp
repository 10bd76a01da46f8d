// megalign::group_advantages{,_by_id,_indexed} on CUDA: the checks of the CPU glue
// (group_advantages_checks.h) plus the device, then the launchers on the current stream.
// group_advantages_by_id numbers the ids with torch's unique on the device (one host sync, for the
// number of groups), then runs the dense-id kernel without the range check (unique's inverse lies
// in range by construction); the CPU kernel numbers them itself. group_advantages_indexed checks
// the caller's ids with one sync.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>

#include "group_advantages_checks.h"
#include "megalign/group_advantages.h"

namespace megalign::torch_glue {
namespace {

at::Tensor group_advantages_cuda(const at::Tensor& scores, int64_t group_size, c10::string_view mode, double eps,
                                 bool unbiased) {
  check_cuda(scores, "group_advantages", "scores");
  const c10::cuda::CUDAGuard guard(scores.device());
  const GroupCall c = prepare_group_call(scores, mode, eps, "group_advantages");
  check_group_size(scores, group_size);
  cuda::group_advantages(c.dtype, scores.data_ptr(), scores.stride(0), scores.size(0), group_size, c.mode, eps,
                         unbiased, c.out.data_ptr(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c.out;
}

at::Tensor indexed_cuda(const at::Tensor& scores, const at::Tensor& group_ids, int64_t num_groups,
                        c10::string_view mode, double eps, bool unbiased, bool check_range) {
  const char* op = "group_advantages_indexed";
  check_cuda(scores, op, "scores");
  const c10::cuda::CUDAGuard guard(scores.device());
  const GroupCall c = prepare_group_call(scores, mode, eps, op);
  check_group_ids(scores, group_ids, num_groups, check_range);
  TORCH_CHECK(scores.size(0) <= INT_MAX, "megalign::", op, ": scores may hold at most 2^31 - 1 entries on CUDA, got ",
              scores.size(0));
  const at::Tensor ids = group_ids.contiguous();
  const auto bytes = static_cast<int64_t>(cuda::group_advantages_indexed_workspace_bytes(c.dtype, num_groups));
  at::Tensor workspace = at::empty({bytes}, scores.options().dtype(at::kByte));
  cuda::group_advantages_indexed(c.dtype, scores.data_ptr(), scores.stride(0), ids.data_ptr<int64_t>(),
                                 scores.size(0), num_groups, c.mode, eps, unbiased, workspace.data_ptr(),
                                 c.out.data_ptr(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c.out;
}

at::Tensor group_advantages_indexed_cuda(const at::Tensor& scores, const at::Tensor& group_ids, int64_t num_groups,
                                         c10::string_view mode, double eps, bool unbiased) {
  return indexed_cuda(scores, group_ids, num_groups, mode, eps, unbiased, /*check_range=*/true);
}

at::Tensor group_advantages_by_id_cuda(const at::Tensor& scores, const at::Tensor& group_index,
                                       c10::string_view mode, double eps, bool unbiased) {
  const char* op = "group_advantages_by_id";
  check_cuda(scores, op, "scores");
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor ids = check_group_index(scores, group_index, op);
  const auto unique = at::_unique2(ids, /*sorted=*/true, /*return_inverse=*/true, /*return_counts=*/false);
  const at::Tensor dense = std::get<1>(unique).reshape({-1});
  return indexed_cuda(scores, dense, std::get<0>(unique).size(0), mode, eps, unbiased, /*check_range=*/false);
}

}  // namespace
}  // namespace megalign::torch_glue

TORCH_LIBRARY_IMPL(megalign, CUDA, m) {
  m.impl("group_advantages", &megalign::torch_glue::group_advantages_cuda);
  m.impl("group_advantages_by_id", &megalign::torch_glue::group_advantages_by_id_cuda);
  m.impl("group_advantages_indexed", &megalign::torch_glue::group_advantages_indexed_cuda);
}
